"""The outranking rule (:mod:`apportion.core.rules.outranking`) as one cycle asks it.

The cycle's ratios are its *working* usage, which grows with every projected
charge, so "whom does this leaf clearly outrank" changes as the cycle goes.
:class:`CycleOutranking` is the rule with caches that are exact because they
are keyed by what the answer depends on:

- one level (:meth:`CycleOutranking.clearly_above`) depends only on the ratios of
  one family, so it is kept until a child of that parent is charged
  (``family_charges``);
- a leaf's victim subtrees depend only on the families along its path, so they
  are kept while those families' charge counts are unchanged; when recomputed to
  the same content the old object is kept, so that failures remembered against
  it (:mod:`.memo`, :mod:`.doomed`) stay valid;
- whether a leaf lies in some victim subtrees is kept per subtrees object.

A cycle keeps two of them when the policy's margin has a wait
(:func:`~apportion.core.rules.outranking.held_to_margin`): the rule with the
margin, for candidates held to it, and the rule without, for candidates that
have waited (:meth:`~.scratch.Scratch.outranking_for`); both see every charge.

Guarded by ``tests/cycle/test_outranking_caches.py``: every answer during random
cycles is checked against the rule computed afresh, and the decisions against a
cycle without the caches. ``tests/core/test_outranking.py`` checks the rule
level by level against the first level where two paths part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..budget import ancestors_of, parent_of
from ..rules.outranking import Outranking

if TYPE_CHECKING:
    from .scratch import Scratch


class CycleOutranking(Outranking):
    """The rule over the cycle's working usage, with caches (module docstring)."""

    __slots__ = ("charges", "family_charges", "_subtrees", "_above", "_coverage")

    def __init__(self, s: Scratch, margin_ppm: int | None = None) -> None:
        """The rule over ``s``'s working usage with ``margin_ppm`` (``None``: the
        policy's margin)."""
        if margin_ppm is None:
            margin_ppm = s.state.policy.preemption_margin_ppm
        super().__init__(s.state.budget, s.usage, s.view.weight, margin_ppm)
        self.charges = 0
        """Bumps on every projected charge (ratios changed)."""
        self.family_charges: dict[str, int] = {}
        """parent -> charges to any of its children."""
        self._subtrees: dict[str, tuple[int, tuple[int, ...], dict[str, None]]] = {}
        """leaf -> (``charges``, its families' charge counts, victim subtrees)"""
        self._above: dict[str, tuple[int, tuple[str, ...]]] = {}
        self._coverage: dict[int, tuple[Mapping[str, None], dict[str, bool]]] = {}
        """id(victim subtrees) -> (the subtrees, leaf -> in one of them): the object is
        kept, so an id is never taken for another object's while cached."""

    def charged(self, leaf: str) -> None:
        """A projected charge went to ``leaf``'s path (the walk added it to the usage)."""
        self.charges += 1
        families = self.family_charges
        for p in self.path(leaf):
            family = parent_of(p)
            families[family] = families.get(family, 0) + 1

    def victim_subtrees(self, leaf: str) -> dict[str, None]:
        """:meth:`Outranking.victim_subtrees`, recomputed only when a projected charge
        changed a ratio in a family on the way (the same object while unchanged)."""
        cached = self._subtrees.get(leaf)
        if cached is not None and cached[0] == self.charges:
            return cached[2]
        families = self.family_charges
        key = tuple(families.get(p, 0) for p in ancestors_of(leaf))  # the path's families
        if cached is not None and cached[1] == key:
            self._subtrees[leaf] = (self.charges, key, cached[2])
            return cached[2]
        out = super().victim_subtrees(leaf)
        if cached is not None and cached[2] == out:
            out = cached[2]  # same content: keep the object, so failures stay remembered
        self._subtrees[leaf] = (self.charges, key, out)
        return out

    def known(self, leaf: str) -> bool:
        """Whether ``leaf``'s victim subtrees were computed in this cycle."""
        return leaf in self._subtrees

    def clearly_above(self, parent: str, a: str) -> tuple[str, ...]:
        """:meth:`Outranking.clearly_above`, cached until a child of ``parent`` is charged."""
        version = self.family_charges.get(parent, 0)
        cached = self._above.get(a)
        if cached is not None and cached[0] == version:
            return cached[1]
        above = super().clearly_above(parent, a)
        self._above[a] = (version, above)
        return above

    def covered(self, leaf: str, subtrees: Mapping[str, None]) -> bool:
        """:meth:`Outranking.covered`, cached per subtrees object."""
        cached = self._coverage.get(id(subtrees))
        if cached is None or cached[0] is not subtrees:
            cached = self._coverage[id(subtrees)] = (subtrees, {})
        known = cached[1].get(leaf)
        if known is None:
            known = cached[1][leaf] = super().covered(leaf, subtrees)
        return known
