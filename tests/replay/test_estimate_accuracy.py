"""Start-time estimates sampled by the simulator: the ``estimates`` table and KPIs."""

from __future__ import annotations

from pathlib import Path

import pytest
from apportion.replay.cluster_file import cluster_from_dict
from apportion.replay.kpi import compute_kpis
from apportion.replay.run import load_inputs, run_policy
from apportion.replay.simulator import simulate
from apportion.replay.trace import TraceRow

DOCS = Path(__file__).resolve().parents[2] / "docs"
H = 3_600_000
M = 60_000

KEYS = (
    "estimate_samples",
    "estimate_abs_error_p50_s",
    "estimate_abs_error_p90_s",
    "estimate_late_fraction",
)


def one_node_cluster():
    return cluster_from_dict(
        {
            "cluster": {
                "name": "t",
                "pool": [{"prefix": "g", "count": 1, "gpus_per_node": 8, "gpu_type": "h100"}],
            },
            "budget": {
                "owner": "ops",
                "a": {"weight": 1, "owner": "x"},
                "b": {"weight": 1, "owner": "y"},
            },
        }
    ).events


def queue_rows() -> list[TraceRow]:
    """One node, one job running, two queued behind it; nothing arrives after 2 min."""
    return [
        TraceRow(id="w1", submit_ms=0, owner="a", gpus=8, duration_ms=H, min_runtime_ms=H),
        TraceRow(id="w2", submit_ms=M, owner="b", gpus=8, duration_ms=H, min_runtime_ms=H),
        TraceRow(id="w3", submit_ms=2 * M, owner="a", gpus=8, duration_ms=H, min_runtime_ms=H),
    ]


def _estimates(con):
    return con.execute("SELECT * FROM estimates ORDER BY at_ms, workload").fetchall()


@pytest.mark.parametrize("policy", ["budget", "priority"])
def test_no_arrivals_after_the_sample_means_no_error(policy):
    sim = simulate(one_node_cluster(), queue_rows(), policy=policy, days=4 / 24, estimate_every=1)
    rows = _estimates(sim.con)
    # w1 was placed at once (no sample); w2 and w3 waited
    assert [r[0] for r in rows] == ["w2", "w3"]
    placed = dict(
        sim.con.execute(
            "SELECT workload, placed_ms FROM waits WHERE placed_ms IS NOT NULL"
        ).fetchall()
    )
    # after the last arrival w3's estimate is exact; w2's too, since w3 (behind it in
    # the queue) did not go ahead of it
    assert rows == [("w2", M, placed["w2"], None), ("w3", 2 * M, placed["w3"], None)]
    assert (placed["w2"], placed["w3"]) == (H, 2 * H)
    k = compute_kpis(sim.con, sim.start_ms, sim.end_ms)
    assert [k[x] for x in KEYS] == [2, 0.0, 0.0, 0.0]


def test_a_single_late_sample_is_exact():
    rows = queue_rows()[:2]
    sim = simulate(one_node_cluster(), rows, policy="budget", days=4 / 24, estimate_every=1)
    assert _estimates(sim.con) == [("w2", M, H, None)]
    k = compute_kpis(sim.con, sim.start_ms, sim.end_ms)
    assert [k[x] for x in KEYS] == [1, 0.0, 0.0, 0.0]


def test_every_nth_submission_and_off_by_default():
    off = simulate(one_node_cluster(), queue_rows(), policy="budget", days=4 / 24)
    assert _estimates(off.con) == []
    k = compute_kpis(off.con, off.start_ms, off.end_ms)
    assert [k[x] for x in KEYS] == [0, None, None, None]
    # every 2nd: w1 (placed at once, no sample) and w3
    sim = simulate(one_node_cluster(), queue_rows(), policy="budget", days=4 / 24, estimate_every=2)
    assert [r[0] for r in _estimates(sim.con)] == ["w3"]
    # sampling changes no decision
    assert sim.state.digest() == off.state.digest()


def test_no_known_end_is_noted():
    rows = [
        TraceRow(id="w1", submit_ms=0, owner="a", gpus=8, duration_ms=None, min_runtime_ms=H),
        TraceRow(id="w2", submit_ms=M, owner="b", gpus=8, duration_ms=H, min_runtime_ms=0),
    ]
    sim = simulate(one_node_cluster(), rows, policy="priority", days=2 / 24, estimate_every=1)
    assert _estimates(sim.con) == [("w2", M, None, "no_known_end")]
    k = compute_kpis(sim.con, sim.start_ms, sim.end_ms)
    assert k["estimate_samples"] == 1 and k["estimate_abs_error_p50_s"] is None


def test_scenario_run_kpis_match_the_table():
    inp = load_inputs(None, None, None, 1, 2, "debug")
    result, k = run_policy(inp, "budget", estimate_every=3)
    again, k2 = run_policy(inp, "budget", estimate_every=3)
    assert result.con is not None and again.con is not None
    assert _estimates(result.con) == _estimates(again.con)  # deterministic
    start = result.start_ms + inp.warmup_days * 24 * H
    end = result.end_ms
    rows = result.con.execute(
        """
        SELECT e.at_ms, e.estimated_start_ms, e.note,
               (SELECT min(placed_ms) FROM waits p
                 WHERE p.workload = e.workload AND p.placed_ms >= e.at_ms) AS actual
        FROM estimates e"""
    ).fetchall()
    assert rows, "the scenario queues work, so some submissions are sampled"
    assert all((est is None) == (note is not None) for _, est, note, _ in rows)
    assert all(est is None or est >= at for at, est, _, _ in rows)
    sampled = [r for r in rows if start <= r[0] < end]
    assert k["estimate_samples"] == len(sampled)
    compared = [
        (est, act)
        for _, est, _, act in sampled
        if est is not None and act is not None and act < end
    ]
    assert compared
    errors = sorted(abs(act - est) / 1000 for est, act in compared)
    assert k["estimate_abs_error_p90_s"] >= k["estimate_abs_error_p50_s"] >= 0
    assert min(errors) <= k["estimate_abs_error_p50_s"] <= max(errors)
    late = sum(act > est for est, act in compared) / len(compared)
    assert k["estimate_late_fraction"] == round(late, 4)
    # the analyst query of docs/analyst.md runs and agrees
    doc = (DOCS / "analyst.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Start-time estimates") :]
    query = section[section.index("```sql") + 6 : section.index("```", section.index("```sql") + 6)]
    listed = result.con.execute(query.strip().rstrip(";")).fetchall()
    assert len(listed) == len(rows)
    assert sorted(r[6] for r in listed if r[6] is not None) == sorted(
        r[3] for r in rows if r[3] is not None
    )
    assert k2 == {**k, "wall_s": k2["wall_s"]}
