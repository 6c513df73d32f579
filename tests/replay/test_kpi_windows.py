"""The KPIs of issue 23 on hand-made histories: weeks (non-overlapping 7-day
windows), the worst sliding 7-day window, starvation judged against owed, the
largest team, and large / small allocated jobs never placed."""

from __future__ import annotations

from apportion.replay.cluster_file import cluster_from_dict
from apportion.replay.kpi import TeamHour, compute_kpis, delivery_kpis
from apportion.replay.simulator import simulate
from apportion.replay.trace import TraceRow

H = 3_600_000
MIN = 60_000


def _hours(team: str, hours: int, ran, share: float = 1.0, demand: float = 1.0):
    return [TeamHour(team, h, share, demand, ran(h)) for h in range(hours)]


def test_weeks_count_each_day_once():
    """Ten days; team ``a`` is owed 1 GPU-ms every hour (share 1, demand 1) and runs
    1 except on days 3-6, where it runs nothing.

    - whole run (hourly): 6 days delivered of 10 owed = 0.6;
    - weeks: days 0-6 (72 of 168 h delivered: 0.4286) and days 7-9, a partial week
      of 3 days (>= 1 day, so it counts; 72 of 72: 1.0); over the weeks
      (72 + 72) / (168 + 72) = 0.6, the whole-run figure: each day counted once;
    - the old ``team_delivery_7d`` (windows starting on days 0-3) has 3 delivered
      days in each of its 4 windows: 12 / 28 = 0.4286: the four empty middle days
      are counted four times each.
    """
    rows = _hours("a", 240, lambda h: 0.0 if 72 <= h < 168 else 1.0)
    k = delivery_kpis(rows, 240)
    assert k["team_delivery"]["a"] == 0.6
    assert [(w["start_day"], w["days"]) for w in k["windows_7d"]] == [(0, 7.0), (7, 3.0)]
    assert [w["team_delivery"]["a"] for w in k["windows_7d"]] == [round(72 / 168, 4), 1.0]
    assert k["team_delivery_weeks"]["a"] == 0.6 == k["delivery_ratio_weeks"]
    assert k["team_delivery_week_min"]["a"] == round(72 / 168, 4)
    assert k["team_delivery_7d"]["a"] == round(12 / 28, 4)  # the old key, meaning kept


def test_a_last_partial_week_under_a_day_is_left_out():
    """7.5 days: the last 12 hours are a partial week shorter than a day, so only
    the first week counts; 12 h of nothing in them change no week figure.
    Under a day of horizon, its one (partial) week is the whole horizon."""
    rows = _hours("a", 180, lambda h: 1.0 if h < 168 else 0.0)
    k = delivery_kpis(rows, 180)
    assert [(w["start_day"], w["days"]) for w in k["windows_7d"]] == [(0, 7.0)]
    assert k["team_delivery_week_min"] == {"a": 1.0}
    assert k["team_delivery"]["a"] == round(168 / 180, 4)
    short = delivery_kpis(_hours("a", 5, lambda h: float(h < 4)), 5)
    assert [(w["start_day"], w["days"]) for w in short["windows_7d"]] == [(0, round(5 / 24, 3))]
    assert short["team_delivery_week_min"] == {"a": 0.8}


def test_worst_sliding_window_starts_at_any_hour():
    """Ten days; team ``b`` is owed 1 every hour and runs nothing in hours 156-179
    (12 h at the end of week 1, 12 h at the start of week 2), 1 otherwise.

    - weeks: 156 / 168 = 0.9286 and 60 / 72 = 0.8333 (the partial week);
    - sliding 7-day windows start at hours 0..72; those starting at 12..72 hold
      all 24 empty hours: 144 / 168 = 0.8571, first at hour 12;
    - team ``a`` always gets what it is owed (1.0 everywhere), so the worst
      sliding window over all teams is ``b``'s.
    """
    rows = _hours("a", 240, lambda h: 1.0)
    rows += _hours("b", 240, lambda h: 0.0 if 156 <= h < 180 else 1.0)
    k = delivery_kpis(rows, 240)
    assert [w["team_delivery"]["b"] for w in k["windows_7d"]] == [0.9286, 0.8333]
    assert k["team_delivery_7d_sliding_min"] == {"a": 1.0, "b": round(144 / 168, 4)}
    assert k["worst_sliding_7d"] == {"team": "b", "start_hour": 12, "ratio": round(144 / 168, 4)}
    assert k["windows_7d"][1]["worst_team"] == "b"
    # a surplus hour repays a short one inside a sliding window too
    burst = delivery_kpis(_hours("c", 200, lambda h: 2.0 if h % 2 else 0.0), 200)
    assert burst["team_delivery_7d_sliding_min"] == {"c": 1.0}
    assert burst["team_delivery"]["c"] == 0.5


def test_starved_is_judged_against_owed_not_average_demand():
    """Eight days, share 4 GPU-ms an hour for each team.

    - ``big`` has pending gangs (demand 16 > share 4): owed 4 an hour, runs 3:
      75% of owed in each week. The old rule (demand at or below share) misses
      it; the new one (a week under 95% of owed) names it;
    - ``calm`` asks for 2 (below share), is owed 2 and runs 2: not starved;
    - ``dip`` asks for 2, runs nothing for the first day, then 2: week 1
      (144 of 168 h: 0.857) is under 95%, starved by both rules.
    """
    hours = 8 * 24
    rows = _hours("big", hours, lambda h: 3.0, share=4.0, demand=16.0)
    rows += _hours("calm", hours, lambda h: 2.0, share=4.0, demand=2.0)
    rows += _hours("dip", hours, lambda h: 0.0 if h < 24 else 2.0, share=4.0, demand=2.0)
    k = delivery_kpis(rows, hours)
    assert k["starved_teams"] == ["big", "dip"]
    assert k["starved_teams_by_demand"] == ["dip"]
    assert k["team_delivery_week_min"] == {"big": 0.75, "calm": 1.0, "dip": round(144 / 168, 4)}


def test_largest_team_is_the_largest_global_share():
    """Given shares, the team with the largest one (here ``b``, 0.6) and its figures:
    owed 1 an hour for 2 days, runs 1 on day 0 and nothing on day 1: 0.5 over the
    run, in its one (partial, 2-day) week and in its one sliding window."""
    rows = _hours("a", 48, lambda h: 1.0) + _hours("b", 48, lambda h: float(h < 24))
    k = delivery_kpis(rows, 48, {"a": 0.4, "b": 0.6})
    assert k["largest_team"] == {
        "team": "b",
        "global_share": 0.6,
        "delivery": 0.5,
        "delivery_weeks": 0.5,
        "week_min": 0.5,
        "sliding_7d_min": 0.5,
    }
    # without shares, the largest sum of share_ms decides (ties: the first path)
    assert delivery_kpis(rows, 48)["largest_team"]["team"] == "a"


def _cluster():
    return cluster_from_dict(
        {
            "cluster": {
                "name": "t",
                "pool": [{"prefix": "g", "count": 8, "gpus_per_node": 8, "gpu_type": "h100"}],
            },
            "budget": {
                "owner": "ops",
                "a": {"weight": 1, "owner": "x"},
                "b": {"weight": 1, "owner": "y"},
            },
        }
    ).events


def _row(id_, at_min, owner, gpus, dur_min, mr_min, lp="normal"):
    return TraceRow(
        id=id_,
        submit_ms=at_min * MIN,
        owner=owner,
        gpus=gpus,
        duration_ms=dur_min * MIN,
        min_runtime_ms=mr_min * MIN,
        legacy_priority=lp,
    )


def test_never_placed_and_allocated_debug_wait_on_a_hand_built_history():
    """64 GPUs (8 nodes), the priority baseline (no preemption of this work, a job
    that does not fit does not block later ones), 4 hours:

    - 0:00 ``b1`` and ``b2``, 32 GPUs each, fill the cluster; ``b1`` ends at 2:00,
      ``b2`` at 6:00 (after the horizon: it holds 4 nodes throughout);
    - 0:10 ``a1``, 64 GPUs (large): never fits; 0:45 ``a5``, 40 GPUs: never fits;
    - 0:20 ``a2``, 8 GPUs, 10 min contract (allocated debug): placed at 2:00,
      waits 6,000 s; 0:30 ``a3``, 16 GPUs: placed at 2:00 (ends 3:00); 0:40 ``a4``,
      32 GPUs: placed at 3:00; 2:10 ``d2``, 4 GPUs, 5 min contract (allocated
      debug) on the node left free: waits 0 s;
    - ``r1`` (unknown owner) is rejected and counted nowhere.

    Large: 1 submitted, 1 never placed (1.0 by count and by GPUs). Small
    allocated: b1, b2, a2, a3, a4, a5, d2 = 7 jobs of 164 GPUs, a5's 40 never
    placed: 1/7 = 0.1429 by count, 40/164 = 0.2439 by GPUs; the ratio of the
    GPU-weighted shares 1.0 / (40/164) = 4.1. Allocated debug p90 over the waits
    (0, 6000) with linear interpolation: 0.9 x 6000 = 5400 s.
    """
    rows = [
        _row("b1", 0, "b", 32, 120, 60),
        _row("b2", 0, "b", 32, 360, 60),
        _row("r1", 5, "nope", 64, 60, 60),
        _row("a1", 10, "a", 64, 60, 60),
        _row("a2", 20, "a", 8, 30, 10, "high"),
        _row("a3", 30, "a", 16, 60, 60),
        _row("a4", 40, "a", 32, 60, 60),
        _row("a5", 45, "a", 40, 60, 60),
        _row("d2", 130, "b", 4, 10, 5, "high"),
    ]
    sim = simulate(_cluster(), rows, policy="priority", days=4 / 24)
    placed = dict(sim.con.execute("SELECT workload, first_placed_ms FROM workloads").fetchall())
    assert placed == {
        "b1": 0,
        "b2": 0,
        "r1": None,
        "a1": None,
        "a2": 120 * MIN,
        "a3": 120 * MIN,
        "a4": 180 * MIN,
        "a5": None,
        "d2": 130 * MIN,
    }
    k = compute_kpis(sim.con, sim.start_ms, sim.end_ms)
    assert (k["large_submitted"], k["large_never_placed"]) == (1, 1)
    assert k["large_never_placed_fraction"] == 1.0 == k["large_never_placed_gpu_fraction"]
    assert (k["small_allocated_submitted"], k["small_allocated_never_placed"]) == (7, 1)
    assert k["small_allocated_never_placed_fraction"] == round(1 / 7, 4)
    assert k["small_allocated_never_placed_gpu_fraction"] == round(40 / 164, 4)
    assert k["never_placed_gpu_ratio"] == 4.1
    assert k["debug_allocated_wait_p90_s"] == 5400.0
    # per size: d2 (4 GPUs) waited 0 s, a2 (8 GPUs) 6,000 s
    assert k["debug_allocated_wait_p90_by_gpus_s"] == {
        "4": {"p90_s": 0.0, "placed": 1},
        "8": {"p90_s": 6000.0, "placed": 1},
    }
    assert k["largest_team"]["team"] == "a" and k["largest_team"]["global_share"] == 0.5
