"""``whatif --max-min-runtime`` caps the contracts of longer submissions (as its help
says) instead of having them rejected."""

from __future__ import annotations

import json

import pytest
from apportion.replay.cluster_file import parse_duration_ms
from apportion.replay.eventlog import open_log
from apportion.replay.whatif import PolicyChange, whatif
from click.testing import CliRunner

from apportion.cli import main

HOUR = 3_600_000


@pytest.fixture
def log(tmp_path):
    """One 8-GPU node, teams a and b: a's 10 h job with a 4 h contract starts at 0;
    b's 1 h job arrives at 10 min and waits for the protection to end."""
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        '[cluster]\nname = "t"\n[[cluster.pool]]\nprefix = "g"\ncount = 1\n'
        'gpus_per_node = 8\ngpu_type = "h100"\n[budget]\nowner = "ops"\n'
        '[budget.a]\nweight = 1\nowner = "al"\n[budget.b]\nweight = 1\nowner = "bo"\n'
    )
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "id,submit,owner,gpus,duration,min_runtime\nlong,0,a,8,10h,4h\nshort,10m,b,8,1h,30m\n"
    )
    path = tmp_path / "run.jsonl"
    r = CliRunner().invoke(
        main,
        [
            "simulate",
            "--cluster",
            str(cluster),
            "--trace",
            str(trace),
            "--days",
            "1",
            "--log",
            str(path),
            "-q",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    return path


def _placements(con):
    """Each workload's first placement: ``(at_ms, protection in ms)``."""
    first: dict[str, tuple[int, int]] = {}
    for at, w, body in con.execute(
        "SELECT at_ms, workload, body FROM events WHERE kind = 'WorkloadPlaced' ORDER BY pos"
    ).fetchall():
        first.setdefault(w, (at, json.loads(body)["protected_until_ms"] - at))
    return first


def test_cap_replays_a_4h_contract_with_1h_protection(log):
    res = whatif(
        open_log(log), PolicyChange(max_min_runtime_ms=parse_duration_ms("1h")), keep_history=True
    )
    assert res.capped == 1
    assert res.new_rejections == []
    assert res.whatif["rejected"] == 0 and res.whatif["workloads"] == 2
    con = res.sim.con
    assert con.execute(
        "SELECT workload, min_runtime_ms FROM workloads ORDER BY workload"
    ).fetchall() == [("long", HOUR), ("short", HOUR // 2)]
    placed = _placements(con)
    start = res.start_ms
    assert placed["long"] == (start, HOUR)  # protected for 1 h, not 4 h
    assert placed["short"][0] == start + HOUR  # b gets the node when the protection ends


def test_without_the_cap_the_log_is_remade(log):
    res = whatif(open_log(log), PolicyChange(), keep_history=True)
    assert res.capped == 0
    placed = _placements(res.sim.con)
    assert placed["long"] == (res.start_ms, 4 * HOUR)
    assert placed["short"][0] == res.start_ms + 4 * HOUR


def test_cli_whatif_caps_and_says_so(log):
    r = CliRunner().invoke(main, ["whatif", str(log), "--max-min-runtime", "1h", "--json"])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == [
        "apportion: 1 submission declared a min runtime above 1h; replayed with 1h (the new cap)"
    ]
    kpis = json.loads(r.stdout)
    assert kpis["whatif"]["rejected"] == 0 == kpis["original"]["rejected"]
    assert kpis["whatif"]["wait_p90_s"] < kpis["original"]["wait_p90_s"]


def test_cli_whatif_cap_longer_than_the_lookback_is_one_line(log):
    r = CliRunner().invoke(main, ["whatif", str(log), "--max-min-runtime", "8d"])
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [
        "apportion: max min runtime 8d is longer than the lookback 1w; the policy would be refused"
    ]
