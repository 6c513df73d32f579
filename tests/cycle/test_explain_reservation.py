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
