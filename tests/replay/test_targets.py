"""The issue's targets for the budget policy on the bundled ai2 scenario.

The full check (30 measured days, both policies) is a soak test, marked slow
(``make test-slow``); ``make test`` runs a short version on 5 measured days.
"""

from __future__ import annotations

import pytest
from apportion.replay.run import WARMUP_DAYS, load_inputs, run_policy


def _kpis(policy: str, days: int) -> dict:
    inp = load_inputs(None, None, None, seed=1, days=days, scenario="ai2")
    assert inp.warmup_days == WARMUP_DAYS["ai2"]
    _, kpis = run_policy(inp, policy)
    return kpis


def test_short_ai2_run_keeps_the_cluster_busy_and_teams_near_their_share():
    k = _kpis("budget", 5)
    assert k["simulated_days"] == 5
    assert k["occupancy"] >= 0.97
    assert k["delivery_ratio"] >= 0.95
    assert k["debug_allocated_wait_p90_s"] <= 60


@pytest.mark.slow
def test_ai2_30_days_meets_the_targets():
    budget, priority = _kpis("budget", 30), _kpis("priority", 30)
    assert budget["occupancy"] >= 0.98
    assert budget["delivery_ratio"] >= 0.98
    assert all(v >= 0.95 for v in budget["team_delivery"].values() if v is not None)
    assert budget["debug_wait_p90_s"] <= 60
    assert budget["large_wait_p90_s"] <= priority["large_wait_p90_s"]
