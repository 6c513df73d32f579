"""The cycle's outranking caches give the rule's answers and change no decision.

``CycleOutranking`` (core/cycle/subtrees.py) keeps one level's answer until a
child of that family is charged, a leaf's victim subtrees while the families on
its path are uncharged (the same object when recomputed to the same content),
and coverage per subtrees object. These tests check every answer a cycle gets
over random histories against the rule computed afresh
(core/rules/outranking.py), and check that a cycle without the caches (a fresh
object at every call, so no failure memo or doomed shape ever matches) makes
the same decisions.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from apportion.core import State
from apportion.core.cycle import Cycle
from apportion.core.cycle.subtrees import CycleOutranking
from apportion.core.rules.outranking import Outranking
from hypothesis import HealthCheck, given, settings

from .test_skip_doomed import Decided, alike, decided, histories, run_history

CHARGED: list[int] = []
"""Charges seen by checked answers (the tests require answers after charges)."""


def _afresh(o: Outranking) -> Outranking:
    """The rule over the same (working) ratios, with no cache."""
    return Outranking(o.budget, o.usage, o.weight, o.margin)


class _CheckedOutranking(CycleOutranking):
    def victim_subtrees(self, leaf: str) -> dict[str, None]:
        got = super().victim_subtrees(leaf)
        assert got == _afresh(self).victim_subtrees(leaf), leaf
        CHARGED.append(self.charges)
        return got

    def clearly_above(self, parent: str, a: str) -> tuple[str, ...]:
        got = super().clearly_above(parent, a)
        assert got == _afresh(self).clearly_above(parent, a), (parent, a)
        return got

    def covered(self, leaf: str, subtrees: Mapping[str, None]) -> bool:
        got = super().covered(leaf, subtrees)
        assert got == _afresh(self).covered(leaf, subtrees), leaf
        return got


class _PlainOutranking(CycleOutranking):
    """The rule without the caches (the charge counts are still kept)."""

    def victim_subtrees(self, leaf: str) -> dict[str, None]:
        return _afresh(self).victim_subtrees(leaf)

    def clearly_above(self, parent: str, a: str) -> tuple[str, ...]:
        return _afresh(self).clearly_above(parent, a)

    def covered(self, leaf: str, subtrees: Mapping[str, None]) -> bool:
        return _afresh(self).covered(leaf, subtrees)


def _checked_equals_plain(state: State) -> Decided:
    return decided(
        alike(
            state,
            partial(Cycle, outranking=_CheckedOutranking),
            partial(Cycle, outranking=_PlainOutranking),
            Cycle,
        )
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=histories)
def test_the_cached_outranking_is_the_rule_and_changes_no_decision(h: dict[str, Any]) -> None:
    run_history(_checked_equals_plain, **h)


def test_the_property_test_saw_answers_after_charges() -> None:
    """Runs after the property test (file order): answers were checked after the
    cycle's projected charges had changed ratios, not only at its start."""
    assert 0 in CHARGED and any(CHARGED)
