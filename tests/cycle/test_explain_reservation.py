"""``explain`` tells a pending workload about the reservation that holds or gates it."""

from __future__ import annotations

from apportion.core.cycle import step
from apportion.services.views import History, explain

from .builders import HOUR, MIN, Cluster, submit, tick


def test_explain_names_the_reservation_and_the_gate():
    s = Cluster().team("a", 1).team("b", 1).nodes(1).state()
    submit(s, "p", "a", 4, 2 * HOUR)
    step(s)
    tick(s, 30 * MIN)
    submit(s, "big", "b", 8, HOUR)
    submit(s, "long", "a", 4, 3 * HOUR)
    step(s)
    assert set(s.pending) == {"big", "long"}
    big = " ".join(explain(s, History(), "big")["reasons"])
    assert (
        "holds a reservation: n001 become free or preemptible for it at "
        "1970-01-01T02:00:00Z (in 1 h 30 min)" in big
    )
    assert "estimated start: 1970-01-01T02:00:00Z (in 1 h 30 min)" in big
    long = explain(s, History(), "long")
    assert "may not use n001: reserved for big from 1970-01-01T02:00:00Z" in " ".join(
        long["reasons"]
    )
    assert long["reservation"] == {"workload": "big", "nodes": ["n001"], "start_ms": 7_200_000}


def test_explain_names_the_protection_a_gang_waits_for_not_the_first_to_end():
    """A gang of three whole nodes: n003 is free, a-debug (1 GPU) is protected on
    n001 for 10 minutes, a-pt1 (8 GPUs) on n002 for 2 hours. The gang needs all three
    nodes, so protections keep it waiting until a-pt1's ends, not a-debug's."""
    s = Cluster().team("a", 1).team("b", 1).nodes(3).state()
    submit(s, "a-pt1", "a", 8, 2 * HOUR)
    submit(s, "a-debug", "a", 1, 10 * MIN)
    step(s)
    assert {w: s.running[w].placement[0].node for w in s.running} == {
        "a-pt1": "n002",
        "a-debug": "n001",
    }
    submit(s, "gang", "b", 24, HOUR)
    step(s)
    reasons = " ".join(explain(s, History(), "gang")["reasons"])
    assert (
        "2 running allocated workloads on nodes it could use are protected; protections "
        "alone keep it waiting until 1970-01-01T02:00:00Z (in 2 h) (a-pt1 on n002, "
        "protected until then)" in reasons
    )
    assert "a-debug" not in reasons
