"""Who clearly outranks whom: the rule behind every preemption of allocated work.

A candidate ``c`` **clearly outranks** a running allocated workload ``v`` when, at
the first level where their budget paths part (``a`` on ``c``'s side, ``b`` on
``v``'s), ``ratio(a) < (1 - margin) * ratio(b)``
(:func:`~apportion.core.ratio.clearly_below_pair`, the one place ratios are
compared); inside one leaf only a strictly higher priority outranks. Two
ratios inside the margin of each other are never clearly ordered, so
near-equal teams do not preempt each other back and forth.

**The margin has a wait** (policy ``preemption_margin_wait_ms``,
:func:`held_to_margin`): a candidate queued at least that long outranks on any
strictly lower ratio, as with no margin. The margin is hysteresis against
preemption back and forth; a workload that has waited that long cannot cause it
(it was not running), and without the wait a team whose ratio is only a little
below the holders' waits for the holders to end on their own, which for a gang
of half the cluster is never all at once.

Applied level by level: for each node ``a`` on ``c``'s path (top level first),
the siblings of ``a`` that ``a`` clearly outranks (:meth:`Outranking.clearly_above`)
are budget nodes whose *whole subtree* ``c`` outranks; together they are ``c``'s
**victim subtrees** (:meth:`Outranking.victim_subtrees`), disjoint, and ``c``
outranks ``v`` of another leaf exactly when ``v``'s leaf lies in one of them
(:meth:`Outranking.covered`), because the first level where the paths part is
the one where ``v``'s ancestor is a sibling of ``c``'s.

:meth:`Outranking.may_preempt` is the whole preemption rule (unallocated work:
always; allocated work past its protection: when clearly outranked), and
:meth:`Outranking.standing` the three-way answer ``replay/diagnose.py`` names
causes by: clearly outranked, lower but inside the margin, or not lower.

The scheduling cycle uses this class with caches kept while its projected
charges leave a family's ratios unchanged
(:class:`apportion.core.cycle.subtrees.CycleOutranking`); the rule is this one.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum

from ..budget import ROOT, BudgetTree, ancestors_of
from ..ratio import below_pair, clearly_below_pair
from ..state import Policy, Workload
from .contract import is_allocated


def held_to_margin(policy: Policy, c: Workload, t: int) -> bool:
    """Whether candidate ``c`` is held to the preemption margin at ``t``: there is a
    margin, and ``c`` has been queued (since its submission or last requeue) for
    less than ``preemption_margin_wait_ms`` (``0``: held however long it waits)."""
    wait = policy.margin_wait_ms
    return policy.preemption_margin_ppm > 0 and (wait == 0 or t - c.queued_ms < wait)


class Standing(IntEnum):
    """How a candidate stands against a running allocated workload."""

    OUTRANKS = 0
    """Clearly outranks it: it may preempt it once its protection ends."""
    INSIDE_MARGIN = 1
    """Its side's ratio is lower, but inside the preemption margin."""
    NOT_LOWER = 2
    """Its side's ratio is not lower (or, in one leaf, its priority not higher)."""


class Outranking:
    """The rule over one set of ratios: ``usage`` and ``weight`` per budget node."""

    __slots__ = ("budget", "usage", "weight", "margin", "_paths")

    def __init__(
        self,
        budget: BudgetTree,
        usage: Mapping[str, int],
        weight: Mapping[str, int],
        margin_ppm: int,
    ) -> None:
        self.budget = budget
        self.usage = usage
        """Usage per budget node (the cycle's working usage: it grows with the cycle's
        projected charges)."""
        self.weight = weight
        self.margin = margin_ppm
        self._paths: dict[str, tuple[str, ...]] = {}

    def path(self, leaf: str) -> tuple[str, ...]:
        """``leaf`` and its ancestors below the root, top level first (cached)."""
        path = self._paths.get(leaf)
        if path is None:
            path = self._paths[leaf] = (*ancestors_of(leaf)[1:], leaf)
        return path

    def clearly_above(self, parent: str, a: str) -> tuple[str, ...]:
        """One level of the rule: the siblings ``s`` of ``a`` (children of ``parent``)
        with ``ratio(a) < (1 - margin) * ratio(s)``, in the tree's order."""
        usage, weight, margin = self.usage, self.weight, self.margin
        ua, wa = usage[a], weight[a]
        return tuple(
            sib
            for sib in self.budget.nodes[parent].children
            if sib != a and clearly_below_pair(ua, wa, usage[sib], weight[sib], margin)
        )

    def victim_subtrees(self, leaf: str) -> dict[str, None]:
        """Budget nodes whose whole subtree a workload of ``leaf`` clearly outranks:
        :meth:`clearly_above` at every level of its path, top level first."""
        out: dict[str, None] = {}
        parent = ROOT
        for a in self.path(leaf):
            out.update(dict.fromkeys(self.clearly_above(parent, a)))
            parent = a
        return out

    def covered(self, leaf: str, subtrees: Mapping[str, None]) -> bool:
        """Whether ``leaf`` lies in one of ``subtrees`` (:meth:`victim_subtrees`)."""
        return any(p in subtrees for p in self.path(leaf))

    def may_preempt(self, c: Workload, v: Workload, subtrees: Mapping[str, None]) -> bool:
        """Whether ``c`` may preempt ``v`` once ``v`` is past its protection: every
        "candidate outranks victim" decision of the cycle is this one.

        Unallocated ``v``: always. Allocated: ``c`` outranks ``v`` clearly
        (``subtrees`` is :meth:`victim_subtrees` of ``c.owner``); inside one leaf,
        only a strictly higher priority outranks."""
        if not is_allocated(v):
            return True
        if v.owner == c.owner:
            return c.priority > v.priority
        return self.covered(v.owner, subtrees)

    def standing(self, c: Workload, v: Workload) -> Standing:
        """How ``c`` stands against allocated ``v`` at the first level where their
        paths part (inside one leaf: by priority), for explaining a block."""
        if c.owner == v.owner:
            return Standing.OUTRANKS if c.priority > v.priority else Standing.NOT_LOWER
        usage, weight = self.usage, self.weight
        for x, y in zip(self.path(c.owner), self.path(v.owner), strict=False):
            if x != y:
                ux, wx, uy, wy = usage[x], weight[x], usage[y], weight[y]
                if clearly_below_pair(ux, wx, uy, wy, self.margin):
                    return Standing.OUTRANKS
                return Standing.INSIDE_MARGIN if below_pair(ux, wx, uy, wy) else Standing.NOT_LOWER
        return Standing.NOT_LOWER
