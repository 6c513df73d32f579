"""Cluster TOML, trace and health CSV parsing, including bad rows."""

from __future__ import annotations

import pytest
from apportion.replay.cluster_file import load_cluster, margin_ppm, parse_duration_ms
from apportion.replay.errors import InputFileError
from apportion.replay.trace import (
    HealthRow,
    TraceRow,
    read_health,
    read_trace,
    write_health,
    write_trace,
)
from apportion.schemas.events import BudgetSet, NodeRegistered, PolicySet

CLUSTER = """
[cluster]
name = "t"
[[cluster.pool]]
prefix = "g"
count = 3
gpus_per_node = 8
gpu_type = "h100"
[policy]
lookback = "7d"
max_min_runtime = "8h"
preemption_margin = 0.05
[budget]
owner = "ops"
[budget.llm]
weight = 3
owner = "lead"
[budget.llm.alice]
weight = 1
owner = "alice"
[budget.vision]
weight = 1
owner = "v"
"""


def test_cluster_file_events(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(CLUSTER)
    spec = load_cluster(p)
    nodes = [e for e in spec.events if isinstance(e, NodeRegistered)]
    assert [n.node for n in nodes] == ["g000", "g001", "g002"]
    budget = [(e.path, e.weight, e.owner, e.actor) for e in spec.events if isinstance(e, BudgetSet)]
    assert budget == [
        ("", 1, "ops", "ops"),
        ("llm", 3, "lead", "ops"),
        ("llm/alice", 1, "alice", "ops"),
        ("vision", 1, "v", "ops"),
    ]
    (policy,) = [e for e in spec.events if isinstance(e, PolicySet)]
    assert (policy.lookback_ms, policy.max_min_runtime_ms, policy.preemption_margin_ppm) == (
        7 * 86_400_000,
        8 * 3_600_000,
        50_000,
    )
    assert policy.preemption_margin_wait_ms == 2 * 3_600_000  # the default wait


def test_the_margin_wait_is_read_and_bounded_by_the_lookback(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(
        CLUSTER.replace(
            "preemption_margin = 0.05", 'preemption_margin = 0.05\npreemption_margin_wait = "30m"'
        )
    )
    (policy,) = [e for e in load_cluster(p).events if isinstance(e, PolicySet)]
    assert policy.preemption_margin_wait_ms == 30 * 60_000
    p.write_text(
        CLUSTER.replace(
            "preemption_margin = 0.05", 'preemption_margin = 0.05\npreemption_margin_wait = "8d"'
        )
    )
    with pytest.raises(InputFileError) as exc:
        load_cluster(p)
    assert exc.value.where == "policy.preemption_margin_wait"


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("7d", 604_800_000),
        ("8h", 28_800_000),
        ("15m", 900_000),
        ("1.5h", 5_400_000),
        ("250ms", 250),
    ],
)
def test_durations(text, ms):
    assert parse_duration_ms(text) == ms


def test_margin_is_exact():
    assert margin_ppm(0.05) == 50_000
    assert margin_ppm(0.1) == 100_000
    with pytest.raises(ValueError):
        margin_ppm(1.5)


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (("weight = 3", "weight = -3"), "budget.llm.weight"),
        (('lookback = "7d"', 'lookback = "7 days"'), "policy.lookback"),
        (("count = 3", 'count = "3"'), "cluster.pool[0].count"),
        (("[policy]", "[policy]\nbogus = 1"), "policy.bogus"),
    ],
)
def test_cluster_file_errors_name_the_key(tmp_path, edit, where):
    p = tmp_path / "c.toml"
    p.write_text(CLUSTER.replace(*edit, 1))
    with pytest.raises(InputFileError) as exc:
        load_cluster(p)
    assert exc.value.where == where
    assert str(exc.value).startswith(f"{p}: {where}: ")


def test_cluster_file_syntax_error(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[cluster\n")
    with pytest.raises(InputFileError, match="TOML syntax"):
        load_cluster(p)


def test_trace_round_trip_and_fractional_seconds(tmp_path):
    rows = [
        TraceRow(
            id="a", submit_ms=1500, owner="llm/alice", gpus=8, duration_ms=60_000, min_runtime_ms=0
        ),
        TraceRow(
            id="b",
            submit_ms=0,
            owner="llm/alice",
            gpus=16,
            duration_ms=1,
            min_runtime_ms=900_000,
            resumable=False,
            legacy_priority="low",
            legacy_preemptible=True,
        ),
    ]
    p = tmp_path / "t.csv"
    write_trace(p, rows)
    back, errors = read_trace(p)
    assert errors == []
    assert [
        (
            r.id,
            r.submit_ms,
            r.gpus,
            r.duration_ms,
            r.min_runtime_ms,
            r.resumable,
            r.legacy_priority,
            r.legacy_preemptible,
        )
        for r in back
    ] == [
        ("b", 0, 16, 1, 900_000, False, "low", True),
        ("a", 1500, 8, 60_000, 0, True, "high", False),
    ]


def test_trace_bad_rows_are_reported_and_skipped(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(
        "id,submit,owner,gpus,duration,min_runtime\n"
        "ok1,0,a/b,1,60,0\n"
        "bad1,zero,a/b,1,60,0\n"
        "bad2,0,a/b,-1,60,0\n"
        "ok1,5,a/b,1,60,0\n"
        "bad3,0,a/b,1,60\n"
        "ok2,0.0005,a/b,2,1.25,0\n"
    )
    rows, errors = read_trace(p)
    assert [r.id for r in rows] == ["ok1", "ok2"]
    assert rows[1].submit_ms == 0 and rows[1].duration_ms == 1250  # 0.5 ms rounds half to even
    assert [(e.where, e.reason.split(" ")[0]) for e in errors] == [
        (3, "not"),
        (4, "gpus"),
        (5, "id"),
        (6, "fewer"),
    ]
    assert str(errors[0]).startswith(f"{p}:3: ")


def test_trace_missing_column(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("id,submit,owner\nx,0,a\n")
    with pytest.raises(InputFileError, match="missing column"):
        read_trace(p)


def test_health_csv(tmp_path):
    p = tmp_path / "h.csv"
    write_health(p, [HealthRow(at_ms=60_000, node="g001", state="draining")])
    with open(p, "a") as fh:
        fh.write("10,g002,broken\n")
    rows, errors = read_health(p)
    assert [(r.at_ms, r.node, r.state) for r in rows] == [(60_000, "g001", "draining")]
    assert errors[0].where == 3 and "state" in errors[0].reason
