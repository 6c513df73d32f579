"""The level-by-level pool bound of the preemption search equals the plain one.

``PoolBound.short`` (core/cycle/poolbound.py) decides whether a pool lacks the
GPUs a workload asks for even counting every GPU it could free there, stopping
at the first ancestor of the workload's leaf where an upper bound is already
short. These tests check it, at every call made by real cycles over random
histories, against the plain sum over the leaf's victim subtrees, and check
that the cycles make the same decisions as the plain search.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from apportion.core import State
from apportion.core.cycle import Cycle
from apportion.core.cycle.poolbound import PoolBound
from apportion.core.cycle.scratch import Scratch
from hypothesis import HealthCheck, given, settings

from .test_skip_doomed import Decided, alike, decided, histories, run_history

CHECKED: list[bool] = []
"""Every answer of the checked bound (the tests require both answers to occur)."""


def _plain_total(s: Scratch, leaf: str, key: tuple[str, int]) -> int:
    """Free and unallocated GPUs of the pool, plus the expired work of ``leaf`` and
    of its victim subtrees."""
    victims = s.victims
    expired = victims.pool_expired.get(key, {})
    return (
        s.pool_free.get(key, 0)
        + victims.pool_unalloc.get(key, 0)
        + expired.get(leaf, 0)
        + sum(expired.get(p, 0) for p in s.outranking_waited.victim_subtrees(leaf))
    )


class _CheckedPoolBound(PoolBound):
    def short(self, leaf: str, key: tuple[str, int], g: int) -> bool:
        short = super().short(leaf, key, g)
        total = _plain_total(self.s, leaf, key)
        assert short == (total < g), (leaf, key, g, total)
        CHECKED.append(short)
        return short


class _PlainPoolBound(PoolBound):
    """The search with the plain bound only (its victim subtrees always computed)."""

    def short(self, leaf: str, key: tuple[str, int], g: int) -> bool:
        return _plain_total(self.s, leaf, key) < g


def _checked_equals_plain(state: State) -> Decided:
    return decided(
        alike(
            state,
            partial(Cycle, pool_bound=_CheckedPoolBound),
            partial(Cycle, pool_bound=_PlainPoolBound),
            Cycle,
        )
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=histories)
def test_the_pool_bound_is_the_plain_sum_and_changes_no_decision(h: dict[str, Any]) -> None:
    run_history(_checked_equals_plain, **h)


def test_the_property_test_saw_short_and_roomy_pools() -> None:
    """Runs after the property test (file order): both answers were checked."""
    assert True in CHECKED and False in CHECKED
