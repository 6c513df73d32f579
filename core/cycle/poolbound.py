"""Shortcut: pass over a pool when even all it could give is short of a request.

All a pool could give work of leaf ``l``: its free and unallocated GPUs plus the
expired allocated work of ``l`` and of the subtrees ``l`` clearly outranks. If
that is below the request, no victim set of the pool makes it fit, so the
preemption search (:mod:`.preemption`) passes over the pool. "Outranks" is
the cycle's loosest rule (:attr:`~.scratch.Scratch.outranking_waited`, without
the margin when the margin has a wait): exact for a candidate no longer held to
the margin, an upper bound for one still held to it.

**Level by level.** The sum is decided from the top of the leaf's path down
(:meth:`PoolBound.room`): at ancestor ``a``, the siblings ``a`` outranks (at this
level and above) plus everything expired under ``a`` itself (which holds the
rest of the leaf's victim subtrees and the leaf) bound the total of every leaf
below ``a`` from above; the least of these bounds is kept, and at the leaf it is
exactly the total. So the first level where the bound is short settles it,
usually a level shared by many leaves, without the leaf's own victim subtrees
being computed. The sums per level are kept per pool until a ratio in the
family is charged or the victims change (:meth:`PoolBound.outranked_expired`).
:mod:`.prune` reads the same bound at a budget node's level.

Guarded by ``tests/cycle/test_pool_bound.py``: every answer during random
cycles is checked against the plain sum over the leaf's victim subtrees, and
the decisions against a cycle that uses only the plain sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..budget import ROOT
from ..nodeindex import Pool
from .scratch import NEVER

if TYPE_CHECKING:
    from .scratch import Scratch


class PoolBound:
    """The level-by-level bound of what a pool could give (module docstring)."""

    def __init__(self, s: Scratch) -> None:
        self.s = s
        self._outranked: dict[tuple[str, Pool], tuple[tuple[int, int], int]] = {}
        """(budget node, pool) -> (versions, GPUs): :meth:`outranked_expired`."""

    def short(self, leaf: str, key: Pool, g: int) -> bool:
        """Whether pool ``key`` lacks ``g`` GPUs for work of ``leaf`` even counting every
        GPU it could free there: free, unallocated, and expired allocated work of
        ``leaf`` and of the subtrees it outranks."""
        return self.room(leaf, key, g) < g

    def room(self, path: str, key: Pool, need: int = NEVER) -> int:
        """An upper bound of the GPUs any workload under budget node ``path`` could have
        in pool ``key`` (free, unallocated, and expired allocated work of its leaf and
        of the subtrees it outranks); for a leaf, exactly that total. Stops early once
        it is below ``need`` (module docstring)."""
        s = self.s
        victims = s.victims
        expired = victims.pool_expired.get(key, {})
        have = s.pool_free.get(key, 0) + victims.pool_unalloc.get(key, 0)
        room = NEVER
        parent = ROOT
        for a in s.outranking_waited.path(path):
            have += self.outranked_expired(parent, a, key, expired)
            room = min(room, have + expired.get(a, 0))
            if room < need:
                break
            parent = a
        return room

    def outranked_expired(self, parent: str, a: str, key: Pool, expired: dict[str, int]) -> int:
        """Expired allocated GPUs in pool ``key`` under the siblings of ``a`` that ``a``
        clearly outranks, cached until a child of ``parent`` is charged or the
        victims change."""
        s = self.s
        outranking = s.outranking_waited
        version = (outranking.family_charges.get(parent, 0), s.victims.changes)
        cached = self._outranked.get((a, key))
        if cached is not None and cached[0] == version:
            return cached[1]
        total = sum(expired.get(sib, 0) for sib in outranking.clearly_above(parent, a))
        self._outranked[(a, key)] = (version, total)
        return total
