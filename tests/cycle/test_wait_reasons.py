"""Each pending workload's ``reason`` code in the queue and in explain (services/views.py,
docs/reasons.md "Why a workload waits"): one state per code, and the doc lists exactly them."""

from __future__ import annotations

import re
from pathlib import Path

from apportion.core.cycle import step
from apportion.services.views import WAIT_REASONS, History, explain, queue_view

from .builders import HOUR, MIN, Cluster, health, submit, tick

DOCS = Path(__file__).resolve().parents[2] / "docs"


def reasons(state) -> dict[str, str]:
    q = queue_view(state)
    for row in q["pending"]:
        assert row["reason_text"] == WAIT_REASONS[row["reason"]]
    return {row["workload"]: row["reason"] for row in q["pending"]}


def test_fits_soon_before_a_cycle_and_no_nodes_of_its_type() -> None:
    s = Cluster().team("a", 1).team("b", 1).nodes(1).nodes(1, gpu_type="a100").state()
    submit(s, "now", "a", 4, HOUR)
    submit(s, "h100-only", "b", 8, HOUR, gpu_type="h100")
    health(s, "n002", "down")  # the only a100
    submit(s, "a100", "b", 1, HOUR, gpu_type="a100")
    got = reasons(s)
    assert got["now"] == "fits_soon" and got["a100"] == "no_nodes_of_type"
    assert explain(s, History(), "a100")["reason"] == "no_nodes_of_type"


def test_a_gang_too_large_once_hosts_are_down() -> None:
    s = Cluster().team("a", 1).nodes(3).state()
    submit(s, "gang", "a", 24, HOUR)
    health(s, "n003", "draining")
    assert reasons(s) == {"gang": "gang_too_large"}


def test_reservation_held_and_gated() -> None:
    s = Cluster().team("a", 1).team("b", 1).nodes(1).state()
    submit(s, "p", "a", 4, 2 * HOUR)
    step(s)
    tick(s, 30 * MIN)
    submit(s, "big", "b", 8, HOUR)
    submit(s, "long", "a", 4, 3 * HOUR)
    step(s)
    assert reasons(s) == {"big": "holds_reservation", "long": "reserved_for_other"}
    out = explain(s, History(), "long")
    assert out["reason"] == "reserved_for_other"
    assert out["reason_text"].startswith("the free GPUs it could use are kept for another")


def test_protection_outranked_share_and_unallocated() -> None:
    s = Cluster().team("a", 1).team("b", 1).nodes(1).policy(reservations=False).state()
    submit(s, "a-run", "a", 8, HOUR)
    step(s)
    submit(s, "b-1", "b", 8, HOUR)
    submit(s, "b-2", "b", 8, HOUR)
    submit(s, "free", "b", 4, 0)
    step(s)
    got = reasons(s)
    assert got == {
        "b-1": "waiting_for_protection",
        "b-2": "outranked",
        "free": "unallocated_waits",
    }, got
    # past its protection, b's own run is not preemptible by b's next workload (the same
    # team is not under-served against itself): it waits for share
    s = Cluster().team("a", 1).team("b", 1).nodes(1).policy(reservations=False).state()
    submit(s, "b-run", "b", 8, 10 * MIN)
    step(s)
    tick(s, 2 * HOUR)
    step(s)
    submit(s, "b-more", "b", 8, 10 * MIN)
    step(s)
    assert "b-run" in s.running and reasons(s) == {"b-more": "waiting_for_share"}


def test_the_doc_lists_exactly_the_codes_in_order() -> None:
    text = (DOCS / "reasons.md").read_text()
    section = text.split("## Why a workload waits", 1)[1].split("\n## ", 1)[0]
    codes = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)
    assert codes == list(WAIT_REASONS)
