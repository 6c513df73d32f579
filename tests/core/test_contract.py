"""The contract's predicates and the placement rule, one case a line."""

from __future__ import annotations

import pytest
from apportion.core.placement import FreeGPUs
from apportion.core.rules.classes import is_debug, is_large
from apportion.core.rules.contract import (
    is_allocated,
    is_protected,
    may_use_reserved,
    preemptible_from,
    protected_until,
)
from apportion.schemas.events import HOUR_MS as H
from core_builders import Scenario


class _W:
    def __init__(self, min_runtime_ms: int, protected_until_ms: int = 0) -> None:
        self.min_runtime_ms = min_runtime_ms
        self.protected_until_ms = protected_until_ms


def test_allocated_and_protected() -> None:
    assert is_allocated(_W(1)) and not is_allocated(_W(0))
    assert protected_until(10, H) == 10 + H
    w = _W(H, protected_until(10, H))
    assert is_protected(w, 10) and is_protected(w, 9 + H)
    assert not is_protected(w, 10 + H)  # protection ends at protected_until
    assert not is_protected(_W(0, 10), 5)  # unallocated work is never protected
    assert [preemptible_from(w, t) for t in (10, 10 + H, 20 + H)] == [10 + H, 10 + H, 20 + H]
    assert preemptible_from(_W(0, 5), 10) == 10  # unallocated, placed at 5


@pytest.mark.parametrize(
    ("t", "min_runtime", "start", "expected"),
    [(0, 0, 0, True), (0, 10, 10, True), (0, 11, 10, False), (5, 5, 10, True), (6, 5, 10, False)],
)
def test_the_reservation_gate(t, min_runtime, start, expected) -> None:
    """A reserved node takes only work preemptible by the start: ``t + min_runtime <= start``."""
    assert may_use_reserved(t, min_runtime, start) is expected


@pytest.mark.parametrize(
    ("gpus", "min_runtime", "expected"),
    [(8, 15 * 60_000, True), (1, 0, True), (9, 0, False), (8, 15 * 60_000 + 1, False)],
)
def test_debug_workloads(gpus, min_runtime, expected) -> None:
    assert is_debug(gpus, min_runtime) is expected


@pytest.mark.parametrize(("gpus", "expected"), [(64, True), (63, False), (256, True), (1, False)])
def test_large_workloads(gpus, expected) -> None:
    assert is_large(gpus) is expected


def test_placement_best_fit_across_pools_and_whole_nodes_of_one_pool() -> None:
    s = Scenario().tree("t").nodes("n", 3).node("h0", 4, "h100").node("h1", 4, "h100")
    s.submit("w", "t", gpus=5).place("w", ("n1", 5))
    gpus = FreeGPUs(s.state)
    assert gpus.fit(3, "any") == [("n1", 3)]  # 3 free on n1 is the tightest
    assert gpus.fit(4, "any") == [("h0", 4)]  # 4 free on h0, ties by node id
    assert gpus.fit(4, "any", may_use=lambda n: n != "h0") == [("h1", 4)]
    assert gpus.fit(16, s.state.nodes["n0"].gpu_type) == [("n0", 8), ("n2", 8)]
    assert gpus.fit(12, "any") is None  # a gang never mixes pools
    gpus.set("n1", 8)
    assert gpus.fit(24, "any") == [("n0", 8), ("n1", 8), ("n2", 8)]
    assert s.state.nodes["n1"].free == 3  # the state is not changed
