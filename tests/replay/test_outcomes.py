"""The family scenario, the window KPIs, ``diagnose`` and the outcomes grid."""

from __future__ import annotations

import pytest
from apportion.replay.cluster_file import cluster_from_dict
from apportion.replay.diagnose import CAUSES, diagnose
from apportion.replay.family import Knobs, family, parse_knobs
from apportion.replay.kpi import TeamHour, delivery_kpis, served_from_hours
from apportion.replay.outcomes import QUICK_GRID, run_grid, table
from apportion.replay.simulator import simulate
from apportion.replay.trace import TraceRow
from apportion.schemas.history import HistoryItem

H = 3_600_000


def test_family_is_deterministic_and_its_knobs_change_it():
    a, b = family(3, 7), family(3, 7)
    assert a.trace == b.trace and a.health == b.health and a.budget == b.budget
    assert family(3, 8).trace != a.trace
    assert {t for _, _, _, t in a.pools} == {"h100", "a100"}
    assert sum(c * g for _, c, g, _ in a.pools) == 512
    teams = {p for p, _, _ in a.budget if p.count("/") == 1}
    leaves = [p for p, _, _ in a.budget if p.count("/") == 2]
    assert len(teams) == 8 and len(leaves) == 24
    kinds = {r.id.split("-")[0] for r in a.trace}
    assert kinds >= {"train", "mid", "debug", "free"}
    assert any(r.gpu_type == "a100" for r in a.trace) and any(r.gpu_type == "any" for r in a.trace)

    def backlog_gpus(s):
        return sum(r.gpus for r in s.trace if r.submit_ms < 10 * 60_000 and r.min_runtime_ms > 0)

    low, high = family(3, 7, Knobs(load=1.5)), family(3, 7, Knobs(load=4.0))
    # the backlog at the start is at least load x the cluster (arrivals of the first minutes add to it)
    assert backlog_gpus(low) >= 1.5 * 512 and backlog_gpus(high) >= 4 * 512
    assert backlog_gpus(high) > backlog_gpus(low) + 512
    assert not any(r.min_runtime_ms == 0 for r in family(3, 7, Knobs(free=0)).trace)
    assert parse_knobs(["load=4", "gpus=1024"]) == Knobs(load=4.0, gpus=1024)
    for bad in (["nope=1"], ["load=x"], ["gpus=12"], ["bursty=2"], ["load"]):
        with pytest.raises(ValueError):
            parse_knobs(bad)


def test_window_kpis_on_hand_made_hours():
    # team a: owed 4 every hour for 8 days, runs 8 then 0 (hourly 50%, over a window 100%)
    # team b: demand below share, runs nothing for a day: starved
    hours = 8 * 24
    rows = [TeamHour("a", h, 4.0, 8.0, 8.0 if h % 2 == 0 else 0.0) for h in range(hours)]
    rows += [TeamHour("b", h, 4.0, 2.0, 0.0 if h < 24 else 2.0) for h in range(hours)]
    k = delivery_kpis(sorted(rows), hours)
    assert k["team_delivery"]["a"] == 0.5
    assert k["team_delivery_7d"]["a"] == 1.0
    assert k["starved_teams"] == ["b"]
    assert 0.5 < k["delivery_ratio_7d"] < 1.0
    first, second = k["windows_5d"]
    assert (first["start_day"], second["start_day"]) == (0, 5)
    assert first["worst_team"] == "a" and first["worst_team_ratio"] == 0.5


def test_double_served_on_hand_made_hours():
    # a runs twice its share while b, owed 4 an hour, gets half: a is double-served;
    # c runs 1.5x its share, but in a week when nobody is short it is not
    hours = 7 * 24
    rows = [TeamHour("a", h, 4.0, 8.0, 8.0) for h in range(hours)]
    rows += [TeamHour("b", h, 4.0, 4.0, 2.0) for h in range(hours)]
    k = served_from_hours(sorted(rows), hours)
    assert k == {"team_served_week_max": {"a": 2.0, "b": 0.5}, "double_served_teams": ["a"]}
    calm = [TeamHour("c", h, 4.0, 8.0, 6.0) for h in range(hours)]
    calm += [TeamHour("d", h, 4.0, 1.0, 1.0) for h in range(hours)]
    assert served_from_hours(sorted(calm), hours)["double_served_teams"] == []


def _two_teams():
    return cluster_from_dict(
        {
            "cluster": {
                "name": "t",
                "pool": [{"prefix": "g", "count": 2, "gpus_per_node": 8, "gpu_type": "h100"}],
            },
            "policy": {"preemption_margin": 0.05},
            "budget": {
                "owner": "ops",
                "a": {"weight": 1, "owner": "x"},
                "b": {"weight": 1, "owner": "y"},
            },
        }
    ).events


def _diagnosed(rows: list[TraceRow], days: float):
    items: list[HistoryItem] = []
    simulate(_two_teams(), rows, days=days, sink=lambda i, _s, _r: items.append(i))
    return {r["team"]: r for r in diagnose(items).rows()}


def test_diagnose_names_protected_contracts_and_who_held_them():
    # a takes the whole cluster under a 2 h contract; b's 8-GPU job waits for it
    rows = [
        TraceRow(id="a1", submit_ms=0, owner="a", gpus=16, duration_ms=4 * H, min_runtime_ms=2 * H),
        TraceRow(id="b1", submit_ms=60_000, owner="b", gpus=8, duration_ms=4 * H, min_runtime_ms=H),
    ]
    d = _diagnosed(rows, 4 / 24)
    b = d["b"]
    assert b["shortfall_gpu_h"] > 0
    assert b["causes"]["contracts"] == pytest.approx(b["shortfall_gpu_h"], abs=0.2)
    assert set(b["holders"]) == {"a"}
    assert set(b["causes"]) == set(CAUSES)


def test_diagnose_names_fragmentation():
    # 4 GPUs free on each node but b asks for 8 on one node: fragmentation
    rows = [
        TraceRow(id="a1", submit_ms=0, owner="a", gpus=4, duration_ms=4 * H, min_runtime_ms=4 * H),
        TraceRow(id="a2", submit_ms=0, owner="a", gpus=4, duration_ms=4 * H, min_runtime_ms=4 * H),
        TraceRow(id="u1", submit_ms=0, owner="b", gpus=8, duration_ms=H, min_runtime_ms=0),
        TraceRow(id="b1", submit_ms=60_000, owner="b", gpus=8, duration_ms=4 * H, min_runtime_ms=H),
    ]
    d = _diagnosed(rows, 2 / 24)
    # the free work is preempted for b1 at once, so b loses nothing
    assert d["b"]["shortfall_gpu_h"] == pytest.approx(0, abs=0.05)


def test_outcomes_quick_grid_has_both_policies_and_sane_figures():
    results = run_grid(QUICK_GRID, workers=1)
    assert [(r["load"], r["days"]) for r in results] == [(c.load, c.days) for c in QUICK_GRID]
    for r in results:
        for policy in ("budget", "priority"):
            k = r[policy]
            assert 0 <= k["occupancy"] <= 1 and 0 <= k["delivery_ratio"] <= 1
            assert k["delivery_ratio_7d"] >= k["delivery_ratio"] - 1e-9
        assert set(r["causes"]) == set(CAUSES)
        assert 0 <= r["controlled_loss"] <= 1 - r["budget"]["delivery_ratio"] + 1e-3
        b = r["budget"]
        assert b["delivery_ratio_weeks"] >= b["delivery_ratio"] - 1e-9
        assert b["largest_team"]["team"] in b["team_delivery"]
        assert 0 <= b["large_never_placed_gpu_fraction"] <= 1
        assert set(b["starved_teams"]) == {
            t for t, v in b["team_delivery_week_min"].items() if v is not None and v < 0.95
        }
    text = table(results).splitlines()
    assert text[0].split()[:4] == ["load", "seed", "days", "knobs"] and len(text) == 2 + len(
        results
    )
    for column in ("worst wk", "worst slide", "big team", "large unplaced", "lg/sm"):
        assert column in text[0]


def test_diagnose_cli_table_json_and_errors(tmp_path):
    import json

    from click.testing import CliRunner

    from apportion.cli import main

    log = tmp_path / "run.jsonl"
    cli = CliRunner()
    r = cli.invoke(
        main, ["simulate", "--scenario", "family", "--days", "1", "-q", "--log", str(log)]
    )
    assert r.exit_code == 0, r.output
    r = cli.invoke(main, ["diagnose", str(log)])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[1].split()[:3] == ["team", "owed", "GPU-h"] and "contracts" in lines[1]
    assert any(line.startswith("all ") for line in lines)
    r = cli.invoke(main, ["diagnose", str(log), "--json", "--from", "1"])
    doc = json.loads(r.stdout)
    assert {row["team"] for row in doc["teams"]} <= {f"p{i % 3}/t{i}" for i in range(8)}
    for row in doc["teams"]:
        assert sum(row["causes"].values()) == pytest.approx(row["shortfall_gpu_h"], abs=0.5)
    r = cli.invoke(main, ["diagnose", str(log), "--team", "nope"])
    assert r.exit_code == 2 and "no team 'nope'" in r.stderr
    r = cli.invoke(main, ["diagnose", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1
