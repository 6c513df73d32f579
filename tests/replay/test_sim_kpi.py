"""Simulator, projection and KPI SQL on small histories."""

from __future__ import annotations

import duckdb
import pytest
from apportion.core.history import HistoryOrderError, fold_item
from apportion.replay.cluster_file import cluster_from_dict
from apportion.replay.kpi import KPI_KEYS, compute_kpis
from apportion.replay.projection import Projection
from apportion.replay.scenarios import debug
from apportion.replay.simulator import simulate
from apportion.replay.trace import HealthRow, TraceRow
from apportion.schemas.history import HistoryItem, InputItem

H = 3_600_000
DAY = 24 * H


def two_team_cluster(nodes: int = 1):
    return cluster_from_dict(
        {
            "cluster": {
                "name": "t",
                "pool": [{"prefix": "g", "count": nodes, "gpus_per_node": 8, "gpu_type": "h100"}],
            },
            "budget": {
                "owner": "ops",
                "a": {"weight": 1, "owner": "x"},
                "b": {"weight": 1, "owner": "y"},
            },
        }
    ).events


def test_kpis_on_a_hand_computed_history():
    rows = [
        TraceRow(id="w1", submit_ms=0, owner="a", gpus=8, duration_ms=H, min_runtime_ms=H),
        TraceRow(id="w2", submit_ms=0, owner="b", gpus=8, duration_ms=H, min_runtime_ms=H),
    ]
    sim = simulate(two_team_cluster(), rows, policy="priority", days=2 / 24)
    k = compute_kpis(sim.con, sim.start_ms, sim.end_ms, sim.wall_s)
    assert set(KPI_KEYS) <= set(k)
    assert k["occupancy"] == 1.0
    # hour 0: a owed min(4, 8) = 4 and got 8 -> 4; b owed 4, got 0. hour 1: b owed 4, got 4.
    assert k["team_delivery"] == {"a": 1.0, "b": 0.5}
    assert k["delivery_ratio"] == round(8 / 12, 4)
    assert (k["wait_p50_s"], k["wait_p90_s"]) == (1800.0, 3240.0)
    assert k["large_wait_p90_s"] is None and k["debug_wait_p90_s"] is None
    assert k["unallocated_fraction"] == 0.0 and k["preemptions_per_1000_gpu_h"] == 0.0
    assert k["workloads"] == 2 and k["simulated_days"] == round(2 / 24, 3)
    runs = sim.con.execute(
        "SELECT workload, node, gpus, start_ms, end_ms, allocated, end_reason FROM runs ORDER BY 1"
    ).fetchall()
    assert runs == [
        ("w1", "g000", 8, 0, H, True, "finished"),
        ("w2", "g000", 8, H, None, True, None),
    ]  # its end falls on the horizon
    assert sim.con.execute("SELECT * FROM waits ORDER BY 1").fetchall() == [
        ("w1", 0, 0),
        ("w2", 0, H),
    ]


def test_preempted_resumable_work_keeps_its_progress_and_drain_time():
    # priority policy: low preemptible w1 runs 30 min, is preempted by high w2 (1 h), resumes, needs 30 min more
    rows = [
        TraceRow(
            id="w1",
            submit_ms=0,
            owner="a",
            gpus=8,
            duration_ms=H,
            min_runtime_ms=0,
            legacy_priority="low",
            legacy_preemptible=True,
        ),
        TraceRow(id="w2", submit_ms=H // 2, owner="b", gpus=8, duration_ms=H, min_runtime_ms=H),
    ]
    health = [HealthRow(at_ms=3 * H, node="g000", state="draining")]
    sim = simulate(two_team_cluster(), rows, health, policy="priority", days=4 / 24)
    runs = sim.con.execute(
        "SELECT workload, start_ms, end_ms, end_reason FROM runs ORDER BY start_ms"
    ).fetchall()
    assert runs == [
        ("w1", 0, H // 2, "preempted"),
        ("w2", H // 2, 3 * H // 2, "finished"),
        ("w1", 3 * H // 2, 2 * H, "finished"),
    ]
    k = compute_kpis(sim.con, sim.start_ms, sim.end_ms)
    assert k["drain_time_p90_s"] == 0.0  # empty when it began draining
    assert k["unallocated_fraction"] == 0.5  # w1: 1 GPU-h x 8 of 2 x 8 run
    assert sim.con.execute(
        "SELECT status, preemptions FROM workloads WHERE workload = 'w1'"
    ).fetchone() == ("succeeded", 1)


TABLES = ("events", "workloads", "runs", "waits", "nodes", "health", "budget")


def _dump(con):
    return {t: sorted(map(repr, con.execute(f"SELECT * FROM {t}").fetchall())) for t in TABLES}


def test_projection_incremental_restart_has_no_duplicates_or_gaps(tmp_path):
    s = debug(days=1, seed=2)
    s.health.append(HealthRow(at_ms=10 * H, node="node-003", state="down"))
    s.health.append(HealthRow(at_ms=12 * H, node="node-003", state="healthy"))
    events = cluster_from_dict(
        {
            "cluster": {
                "name": "d",
                "pool": [{"prefix": "node-", "count": 16, "gpus_per_node": 8, "gpu_type": "h100"}],
            },
            "budget": {"owner": "ops", **{p.split("/")[0]: {} for p, _, _ in s.budget[1:]}},
        }
        | {"budget": _budget_doc(s.budget)}
    ).events
    history: list[HistoryItem] = []
    sim = simulate(
        events,
        s.trace,
        s.health,
        policy="priority",
        days=1,
        sink=lambda item, _state, _rejected: history.append(item),
    )
    reference = _dump(sim.con)

    db = tmp_path / "p.duckdb"
    cut_points = {len(history) // 5, len(history) // 2, 3 * len(history) // 4}
    con = duckdb.connect(str(db))
    proj = Projection(con)
    state = proj.saved_state()
    for i, item in enumerate(history):
        proj(item, state, fold_item(state, item))
        if i in cut_points:
            proj.commit(state)
            position, digest = proj.position, state.digest()
            # lose everything after the commit, restart from the file
            con.close()
            con = duckdb.connect(str(db))
            proj = Projection(con)
            state = proj.saved_state()
            assert proj.position == position and state.digest() == digest
            # a redelivered input is refused and changes nothing
            if isinstance(item, InputItem):
                with pytest.raises(HistoryOrderError):
                    fold_item(state, item)
                assert state.digest() == digest
    proj.commit(state)
    # the tables are identical to the ones the simulator's own projection wrote
    assert _dump(con) == reference
    con.close()


def _budget_doc(budget):
    doc: dict = {"owner": budget[0][2]}
    for path, weight, owner in budget[1:]:
        t = doc
        for seg in path.split("/"):
            t = t.setdefault(seg, {})
        t["weight"], t["owner"] = weight, owner
    return doc


@pytest.mark.parametrize("policy", ["priority", "budget"])
def test_simulator_end_to_end_small_scenario(policy):
    s = debug(days=2, seed=1)
    events = cluster_from_dict(
        {
            "cluster": {
                "name": "d",
                "pool": [{"prefix": "node-", "count": 16, "gpus_per_node": 8, "gpu_type": "h100"}],
            },
            "budget": _budget_doc(s.budget),
        }
    ).events
    a = simulate(events, s.trace, s.health, policy=policy, days=2)
    b = simulate(events, s.trace, s.health, policy=policy, days=2)
    assert _dump(a.con) == _dump(b.con)  # deterministic
    assert a.state.digest() == b.state.digest()
    k = compute_kpis(a.con, a.start_ms, a.end_ms, a.wall_s)
    assert list(k)[: len(KPI_KEYS)] == list(KPI_KEYS)
    assert 0.9 <= k["occupancy"] <= 1.0
    # never more GPUs on a node than it has
    over = a.con.execute("""
        SELECT COUNT(*) FROM (SELECT r.node, r.workload, r.attempt, SUM(o.gpus) AS used FROM runs r JOIN runs o
            ON o.node = r.node AND o.start_ms <= r.start_ms AND COALESCE(o.end_ms, 1e18) > r.start_ms
            GROUP BY r.node, r.workload, r.attempt) x JOIN nodes n USING (node) WHERE used > n.gpus""").fetchone()[
        0
    ]
    assert over == 0
    assert a.con.execute("SELECT COUNT(*) FROM workloads").fetchone()[0] == len(s.trace)
