"""The Slurm bridge's mapping rules, without Slurm: a job of ``squeue --json`` -> a
workload or the reason it stays held; exit codes; node states; the claim comment."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from apportion.schemas.events import WorkloadSubmitted
from apportion.services.slurm_jobs import (
    AccountMap,
    Claim,
    SlurmJob,
    claim_text,
    decode_jobs,
    exit_code_of,
    gres_gpus,
    parse_claim,
    parse_jobcomp,
    parse_nodes,
    parse_sacct,
    partition_types,
    submission,
    wait_status,
)

GPN = {"fake": 4}


def job(**kw) -> SlurmJob:
    base = {
        "job_id": 7,
        "job_state": "PENDING",
        "partition": "gpu",
        "account": "lab.a",
        "user_name": "alice",
        "cluster": "lab",
        "priority": 0,
        "tres_per_node": "gres:gpu:2",
        "node_count": 1,
    }
    return SlurmJob(**{**base, **kw})


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({}, ("lab/a", 2, "any", 0, True, 0)),
        ({"tres_per_node": "gres:gpu:fake:4", "node_count": 2}, ("lab/a", 8, "fake", 0, True, 0)),
        ({"time_minimum": 90, "requeue": False, "nice": 5}, ("lab/a", 2, "any", 90, False, -5)),
        ({"tres_per_node": "", "tres_per_job": "gres:gpu:3"}, ("lab/a", 3, "any", 0, True, 0)),
        ({"account": "vision"}, ("vision", 2, "any", 0, True, 0)),
        ({"account": "lab/b"}, ("lab/b", 2, "any", 0, True, 0)),
    ],
)
def test_a_held_job_becomes_a_submission(fields, want) -> None:
    e = submission(job(**fields), AccountMap(), GPN, at_ms=5)
    assert isinstance(e, WorkloadSubmitted)
    owner, gpus, gpu_type, minutes, resumable, priority = want
    assert (e.owner, e.gpus, e.gpu_type, e.min_runtime_ms, e.resumable, e.priority) == (
        owner,
        gpus,
        gpu_type,
        minutes * 60_000,
        resumable,
        priority,
    )
    assert (e.workload, e.id, e.submitted_by) == (
        "slurm-lab-7",
        "slurm-submit-slurm-lab-7",
        "alice",
    )


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"account": ""}, "no --account"),
        ({"tres_per_node": ""}, "no GPUs asked"),
        ({"node_count": 2, "tres_per_node": "gres:gpu:1"}, "not a valid gang: 2 nodes x 1 GPUs"),
        ({"node_count": 2, "tres_per_node": "", "tres_per_job": "gres:gpu:8"}, "per node"),
        ({"batch_flag": False}, "not a batch job"),
    ],
)
def test_a_job_that_cannot_be_mapped_says_why(fields, reason) -> None:
    got = submission(job(**fields), AccountMap(), GPN, at_ms=5)
    assert isinstance(got, str) and reason in got


def test_an_untyped_job_takes_its_partitions_gpu_type() -> None:
    text = "\n".join(
        [
            "NodeName=a Gres=gpu:h100:8 State=IDLE Partitions=h100,all",
            "NodeName=b Gres=gpu:a100:8 State=IDLE Partitions=a100,all",
        ]
    )
    types = partition_types(parse_nodes(text))
    assert types == {"h100": "h100", "a100": "a100"}  # "all" is mixed: no type
    gpn = {"h100": 8, "a100": 8}
    e = submission(job(partition="a100"), AccountMap(), gpn, 0, types.get("a100"))
    assert isinstance(e, WorkloadSubmitted) and e.gpu_type == "a100"
    e = submission(job(partition="all"), AccountMap(), gpn, 0, types.get("all"))
    assert isinstance(e, WorkloadSubmitted) and e.gpu_type == "any"
    typed = job(partition="a100", tres_per_node="gres:gpu:h100:1")  # the job's own type wins
    e = submission(typed, AccountMap(), gpn, 0, "a100")
    assert isinstance(e, WorkloadSubmitted) and e.gpu_type == "h100"


def test_account_table_wins_over_the_rule(tmp_path: Path) -> None:
    f = tmp_path / "accounts.toml"
    f.write_text('[accounts]\n"nlp_team" = "llm/nlp"\n')
    table = AccountMap.load(f)
    assert (table.leaf("nlp_team"), table.leaf("llm.pretrain.alice")) == (
        "llm/nlp",
        "llm/pretrain/alice",
    )
    f.write_text("[accounts]\nx = 1\n")
    with pytest.raises(ValueError, match="must map account names"):
        AccountMap.load(f)


@pytest.mark.parametrize(
    ("status", "code"), [(0, 0), (768, 3), (36608, 143), (15, -15), (9, -9), (0x8F, -15)]
)
def test_exit_codes_from_slurm_wait_status(status: int, code: int) -> None:
    assert exit_code_of(status) == code


def test_gres_strings() -> None:
    assert gres_gpus("gres:gpu:2") == (2, None)
    assert gres_gpus("gres:gpu:fake:4") == (4, "fake")
    assert gres_gpus("gpu:h100:8(S:0-1)") == (8, "h100")
    assert gres_gpus("gres/gpu=2,cpu=4") == (2, None)
    assert gres_gpus("(null)") == (0, None)


def test_squeue_nulls_take_defaults() -> None:
    text = msgspec.json.encode(
        {"jobs": [{"job_id": 3, "nice": None, "comment": None, "unknown": {"x": 1}}]}
    )
    [j] = decode_jobs(text)
    assert (j.job_id, j.nice, j.comment, j.requeue) == (3, 0, "", True)


def test_node_states_and_reasons() -> None:
    text = "\n".join(
        [
            "NodeName=a Gres=gpu:fake:4 State=IDLE Partitions=gpu",
            "NodeName=b Gres=gpu:fake:4 State=MIXED+DRAIN Partitions=gpu "
            "Reason=apportion: draining (set by ops) [root@2026-12-03T13:11:10]",
            "NodeName=c Gres=gpu:4 State=DOWN*+NOT_RESPONDING Partitions=gpu,debug Reason=gone",
            "NodeName=d Gres=(null) State=IDLE+NOT_RESPONDING Partitions=cpu",
        ]
    )
    nodes = {n.name: n for n in parse_nodes(text)}
    assert [(n.health, n.gpus, n.gpu_type) for n in nodes.values()] == [
        ("healthy", 4, "fake"),
        ("draining", 4, "fake"),
        ("down", 4, "gpu"),  # untyped gres: the generic type "gpu"
        ("healthy", 0, "gpu"),  # NOT_RESPONDING alone: Slurm sets DOWN itself if it lasts
    ]
    assert nodes["b"].reason == "apportion: draining (set by ops)"
    assert nodes["c"].partitions == ("gpu", "debug")


def test_claim_round_trip() -> None:
    c = Claim("slurm-lab-7", 2, 1)
    text = claim_text(c, ["sn0", "sn1"])
    assert text == "apportion: slurm-lab-7 attempt 2 run 1 on sn0,sn1"
    assert parse_claim(text) == c
    assert parse_claim("apportion: held: unknown owner") is None
    assert parse_claim("my own comment") is None


def test_the_slurm_nats_user_is_opt_in_and_publishes_only_its_kinds() -> None:
    from apportion.services.natsconf import accounts_conf, users_of

    assert "slurm" not in users_of(["h"]) and "slurm" in users_of(["h"], slurm=True)
    passwords = {u: "pw" for u in users_of(["h"], slurm=True)}
    assert '"SLURM"' not in accounts_conf("c", ["h"], passwords)
    conf = accounts_conf("c", ["h"], passwords, slurm=True)
    block = conf[conf.index('"SLURM" {') :]
    block = block[: block.index("subscribe")]
    published = sorted(line.strip().strip('"') for line in block.splitlines() if "inputs" in line)
    assert published == [
        "apportion.c.inputs.NodeHealthChanged.>",
        "apportion.c.inputs.NodeRegistered.>",
        "apportion.c.inputs.WorkloadCancelled",
        "apportion.c.inputs.WorkloadFinished.>",
        "apportion.c.inputs.WorkloadStarted.>",
        "apportion.c.inputs.WorkloadSubmitted",
    ]


def test_ends_from_sacct_and_the_completion_log() -> None:
    sacct = "41|COMPLETED|0:0\n42|CANCELLED by 0|0:15\n42|FAILED|2:0\n"
    assert parse_sacct(sacct, 41) == SlurmJob(job_id=41, job_state="COMPLETED", exit_code=0)
    last = parse_sacct(sacct, 42)  # the last ended row of the job
    assert last is not None and (last.job_state, exit_code_of(last.exit_code)) == ("FAILED", 2)
    assert parse_sacct("43|RUNNING|0:0\n", 43) is None
    assert parse_sacct("", 41) is None
    log = [
        "JobId=7 UserId=root(0) GroupId=root(0) Name=a JobState=NODE_FAIL Partition=gpu "
        "NodeList=sn0 ExitCode=0:0\n",
        "JobId=70 UserId=root(0) JobState=COMPLETED ExitCode=0:0\n",
        "JobId=7 UserId=root(0) GroupId=root(0) Name=a JobState=CANCELLED Partition=gpu "
        "NodeList=sn1 DerivedExitCode=0:0 ExitCode=0:9\n",
    ]
    ended = parse_jobcomp(log, 7)
    assert ended is not None and (ended.job_state, exit_code_of(ended.exit_code)) == (
        "CANCELLED",
        -9,
    )
    assert parse_jobcomp(log, 8) is None
    assert wait_status("3:0") == 3 << 8 and exit_code_of(wait_status("0:15")) == -15
