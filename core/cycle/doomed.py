"""Shortcut: pass over the rest of a leaf's queue of a shape that cannot be placed.

Once allocated ``w`` failed (no fit, no victim set), every later workload of its
leaf with no higher priority (the leaf's order guarantees that), the same GPU
type and reservation gate and at least as many GPUs fails too (when ``w`` is no
longer held to the preemption margin, or the margin has no wait: a later
workload may have waited longer than ``w``, and gets no looser rule than ``w``
had only then), as long as no
preemption freed GPUs and the leaf's victim subtrees are the same (an *epoch*,
:meth:`DoomedShapes.epoch`), provided no pool takes the larger request that
could not take the smaller one (:meth:`~.memo.FailureMemo.rules_out`). When the
failing workload also shows that no single node could be had whole (an upper
bound of free, unallocated and preemptible GPUs per node,
:meth:`DoomedShapes.most_obtainable`, below the smallest node size), every
request for more GPUs than that bound fails too, gangs included.

The pending index keeps each leaf's queue split by shape (GPU type, GPUs,
minimum runtime), so the walk (:meth:`~apportion.core.ordering.FairShareWalk.skip_doomed`)
goes on by merging the shapes' lists and sets aside a whole shape that
:meth:`DoomedShapes.is_doomed` rules out, instead of visiting its workloads one
by one; a shape set aside comes back, from where the walk is, when its epoch
ends. Leaves with fewer than :data:`DOOM_FROM` workloads left are walked one by
one (cheaper), and so are leaves where a workload has nodes held for it.

Guarded by ``tests/cycle/test_skip_doomed.py``: random histories with deep leaf
queues run with the shortcuts on and off, every cycle compared; and by
``tests/cycle/test_mixed_node_sizes.py`` (a deep queue of a shape another pool
takes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..nodeindex import Pool
from ..pendingindex import Shape
from ..rules.contract import may_use_reserved
from ..state import Workload
from .memo import FailureMemo
from .scratch import NEVER

if TYPE_CHECKING:
    from .scratch import Scratch

DOOM_FROM = 32
"""Pass over doomed shapes only in a leaf with at least this many workloads left to
walk: below it, visiting them costs less than the merge. Either way the decisions
are the same."""


class DoomedShapes:
    """What the walk may pass over by shape (module docstring)."""

    def __init__(self, s: Scratch, memo: FailureMemo) -> None:
        self.s = s
        self.memo = memo
        self.doomed: dict[tuple[str, str, bool], tuple[object, int, frozenset[Pool], int]] = {}
        """(leaf, GPU type, gate) -> (epoch token, fewest GPUs that failed in it, the pools
        that could take them, fewest GPUs no node can be had for)."""
        self._epochs: dict[str, tuple[int, dict[str, None], object]] = {}
        self._holder_leaves: tuple[int, set[str]] | None = None

    def epoch(self, leaf: str) -> object:
        """A token for "no preemption since, same victim subtrees" for ``leaf`` (under
        the loosest rule of the cycle, the one a doomed workload had)."""
        s = self.s
        subtrees = s.outranking_waited.victim_subtrees(leaf)
        cached = self._epochs.get(leaf)
        if cached is not None and cached[0] == s.freed and cached[1] is subtrees:
            return cached[2]
        token = object()
        self._epochs[leaf] = (s.freed, subtrees, token)
        return token

    def doom(self, w: Workload, gate: bool) -> None:
        """``w`` (allocated) failed: note it so the walk passes over its shape's rest."""
        walk = self.s.walk
        assert walk is not None
        if walk.left_in_leaf(w.owner) < DOOM_FROM:
            return  # a short queue: the per-workload memo (.memo) is cheaper
        if self.holds(w.owner):
            return  # a workload there may use nodes held for it, which ``w`` may not
        if self.s.outranking_for(w) is not self.s.outranking_waited:
            return  # held to the margin: a later one may have waited and outrank more
        token = self.epoch(w.owner)
        key = (w.owner, w.gpu_type, gate)
        prev = self.doomed.get(key)
        least, cap = w.gpus, NEVER
        if prev is not None and prev[0] is token:
            least, cap = min(prev[1], w.gpus), prev[3]
        most, smallest = self.most_obtainable(w)
        if most < smallest:
            # no node can be had whole: neither a gang nor a request for more than
            # ``most`` GPUs on one node can be placed, in any pool (free GPUs only
            # get fewer)
            cap = min(cap, most + 1)
        self.doomed[key] = (token, least, self.memo.pools_taking(w.gpu_type, least), cap)
        walk.skip_doomed(w.owner, self.is_doomed)

    def most_obtainable(self, c: Workload) -> tuple[int, int]:
        """An upper bound of the GPUs ``c`` could have on any one node it may use (free,
        unallocated, and expired work of its leaf and of the subtrees it outranks),
        and the smallest node size of its pools."""
        s = self.s
        subtrees = s.outranking_for(c).victim_subtrees(c.owner)
        free, unalloc = s.free, s.victims.node_unalloc
        may_use = s.may_use
        most, smallest = 0, NEVER
        for key in s.pools_for(c):
            smallest = min(smallest, key[1])
            for room, n in s.roomy.nodes(key):
                if may_use(c, n):
                    most = max(most, -room)
                    break
            for n, gpus in s.victims.expired_on(c.owner, key, subtrees).items():
                if may_use(c, n):
                    most = max(most, free[n] + unalloc.get(n, 0) + gpus)
        return most, smallest

    def holds(self, leaf: str) -> bool:
        """Whether a workload of ``leaf`` has nodes held for it (runs stopping for it)."""
        held = self.s.held
        if not held:
            return False
        cached = self._holder_leaves
        if cached is None or cached[0] != len(held):  # ``held`` only grows in a cycle
            pending = self.s.state.pending
            owners = {pending[w].owner for w in held.values() if w in pending}
            cached = self._holder_leaves = (len(held), owners)
        return leaf in cached[1]

    def is_doomed(self, leaf: str, shape: Shape) -> object:
        """The epoch token if ``leaf``'s workloads of ``shape`` cannot be placed, else None."""
        gpu_type, gpus, min_runtime = shape
        s = self.s
        r = s.reservation
        gate = r is None or may_use_reserved(s.t, min_runtime, r.start_ms)
        doomed = self.doomed.get((leaf, gpu_type, gate))
        if doomed is None or gpus < doomed[1]:
            return None
        if gpus < doomed[3] and not self.memo.rules_out(doomed[2], gpu_type, gpus):
            return None  # a pool takes it that the smallest failure could not use
        token = self.epoch(leaf)
        return token if doomed[0] is token else None
