"""The cycle's per-pool list of nodes by free plus unallocated GPUs is its definition.

``_Cycle._roomy_nodes`` lists ``(-(free + unallocated GPUs), node)`` for the nodes
of a pool that have any (core/cycle.py), built once per cycle and kept up to
date as the cycle places and preempts. These tests check every list handed out
during real cycles over random histories against the list computed afresh
from the cycle's free and unallocated GPUs, and every node chosen for
unallocated victims alone (whose candidates come from that list) against the
cheapest over every node of the pool.
"""

from __future__ import annotations

from typing import Any

from apportion.core import State
from apportion.core.cycle import Workload, _Cycle
from hypothesis import HealthCheck, given, settings

from .test_skip_doomed import Decided, alike, decided, histories, run_history

SIZES: list[int] = []
"""Length of each checked list (the tests require empty and non-empty ones)."""
CHEAPEST: list[bool] = []
"""Whether each checked search for unallocated victims alone found a node."""


class _CheckedCycle(_Cycle):
    def _roomy_nodes(self, key: tuple[str, int]) -> list[tuple[int, str]]:
        ranked = super()._roomy_nodes(key)
        free, unalloc = self.free, self.node_unalloc
        everything = sorted((-(free[n] + unalloc.get(n, 0)), n) for n in self.pool_nodes[key])
        assert ranked == [entry for entry in everything if entry[0]], key
        SIZES.append(len(ranked))
        return ranked

    def _cheapest_unallocated(self, c: Workload, key: tuple[str, int], g: int) -> str | None:
        name = super()._cheapest_unallocated(c, key, g)
        options = []
        for n in self.pool_nodes[key]:
            cost = self._unallocated_cost(n, g)
            if cost is not None and self._may_use(c, n):
                options.append((cost, n))
        assert name == (min(options)[1] if options else None), (c.id, key, g)
        CHEAPEST.append(name is not None)
        return name


def _checked(state: State) -> Decided:
    return decided(alike(state, _CheckedCycle, _Cycle))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=histories)
def test_the_roomy_nodes_are_their_definition(h: dict[str, Any]) -> None:
    run_history(_checked, **h)


def test_the_property_test_saw_empty_and_listed_pools() -> None:
    """Runs after the property test (file order): both cases were checked."""
    assert 0 in SIZES and any(SIZES)
    assert True in CHEAPEST and False in CHEAPEST
