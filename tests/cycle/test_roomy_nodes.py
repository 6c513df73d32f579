"""The cycle's per-pool list of nodes by free plus unallocated GPUs is its definition.

``RoomyNodes.nodes`` (core/cycle/roomy.py) lists ``(-(free + unallocated GPUs),
node)`` for the nodes of a pool that have any, built once per cycle and kept up
to date as the cycle places and preempts. These tests check every list handed
out during real cycles over random histories against the list computed afresh
from the cycle's free and unallocated GPUs, and every node chosen for
unallocated victims alone (whose candidates come from that list) against the
cheapest over every node of the pool.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from apportion.core import State
from apportion.core.cycle import Cycle
from apportion.core.cycle.roomy import RoomyNodes
from apportion.core.state import Workload
from hypothesis import HealthCheck, given, settings

from .test_skip_doomed import Decided, alike, decided, histories, run_history

SIZES: list[int] = []
"""Length of each checked list (the tests require empty and non-empty ones)."""
CHEAPEST: list[bool] = []
"""Whether each checked search for unallocated victims alone found a node."""


class _CheckedRoomyNodes(RoomyNodes):
    def nodes(self, key: tuple[str, int]) -> list[tuple[int, str]]:
        ranked = super().nodes(key)
        free, unalloc = self.s.free, self.s.victims.node_unalloc
        everything = sorted((-(free[n] + unalloc.get(n, 0)), n) for n in self.s.pool_nodes[key])
        assert ranked == [entry for entry in everything if entry[0]], key
        SIZES.append(len(ranked))
        return ranked

    def cheapest_unallocated(self, c: Workload, key: tuple[str, int], g: int) -> str | None:
        name = super().cheapest_unallocated(c, key, g)
        options = []
        for n in self.s.pool_nodes[key]:
            cost = self.unallocated_cost(n, g)
            if cost is not None and self.s.may_use(c, n):
                options.append((cost, n))
        assert name == (min(options)[1] if options else None), (c.id, key, g)
        CHEAPEST.append(name is not None)
        return name


def _checked(state: State) -> Decided:
    return decided(alike(state, partial(Cycle, roomy=_CheckedRoomyNodes), Cycle))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=histories)
def test_the_roomy_nodes_are_their_definition(h: dict[str, Any]) -> None:
    run_history(_checked, **h)


def test_the_property_test_saw_empty_and_listed_pools() -> None:
    """Runs after the property test (file order): both cases were checked."""
    assert 0 in SIZES and any(SIZES)
    assert True in CHEAPEST and False in CHEAPEST
