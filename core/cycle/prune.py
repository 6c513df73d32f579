"""Shortcut: the walk passes over whole budget nodes whose pending work all fails.

While workloads fail (so after the first failure of a cycle, which the
reservation is for), the walk asks, before entering a budget node, whether any
of its pending work could be placed now (:meth:`Pruning.prunable`): for each
GPU type, its smallest request (:meth:`Pruning.smallest_requests`) against the
node's room in every pool of the type (:meth:`~.poolbound.PoolBound.room`, the
pool bound taken at the node's level, which bounds every leaf below it; free
GPUs are part of the room, so no fit either). If none could, the walk passes
over the whole node: while its workloads fail nothing changes, so the plain walk
would have visited them one after another with the same outcome. A node holding
a workload with runs stopping for it is always entered (that workload holds
nodes even when it cannot be placed). The answer is kept until a placement, a
preemption or a victim change.

Guarded by ``tests/cycle/test_skip_doomed.py``: random histories run with this
and the shape skipping (:mod:`.doomed`) on and off, every decision compared,
and the test requires that budget nodes were passed over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..budget import ancestors_of
from .poolbound import PoolBound
from .scratch import NEVER

if TYPE_CHECKING:
    from .scratch import Scratch


class Pruning:
    """Whole budget nodes the walk may pass over (module docstring)."""

    def __init__(self, s: Scratch, bound: PoolBound) -> None:
        self.s = s
        self.bound = bound
        self.pruned: list[str] = []  # budget nodes the walk passed over whole
        self._not_pruned: dict[str, tuple[int, int, int]] = {}  # path -> when last checked
        self._smallest: dict[str, dict[str, int]] = {}  # smallest_requests
        self._waiting: set[str] | None = None  # waiting_paths

    def prunable(self, path: str) -> bool:
        """Whether none of the pending workloads under budget node ``path`` can be
        placed now (:class:`~apportion.core.ordering.FairShareWalk` then passes over
        them); rechecked only after a placement, a preemption or a victim change."""
        s = self.s
        if not s.failing:
            return False  # (also before the first failure) work is being placed: try it
        victims = s.victims
        epoch = (s.freed, victims.changes, s.outranking.charges)
        if self._not_pruned.get(path) == epoch:
            return False
        self._not_pruned[path] = epoch
        if path in self.waiting_paths():
            return False  # a workload with runs stopping for it takes its own path
        victims.index()
        pool_free, pool_unalloc = s.pool_free, victims.pool_unalloc
        room = self.bound.room
        for gpu_type, gpus in self.smallest_requests(path).items():
            for key in s.gpus.pools_for(gpu_type):
                if pool_free.get(key, 0) + pool_unalloc.get(key, 0) >= gpus:
                    return False  # (the room starts there: no need to go down the path)
                if room(path, key, gpus) >= gpus:
                    return False
        self.pruned.append(path)
        return True

    def smallest_requests(self, path: str) -> dict[str, int]:
        """Per GPU type, the fewest GPUs any pending allocated workload under ``path``
        asks for (those already walked included: a bound): a leaf's from its
        shapes, a budget node's from its children's with pending work below; each
        computed once per cycle."""
        smallest = self._smallest.get(path)
        if smallest is None:
            walk = self.s.walk
            assert walk is not None
            smallest = {}
            shapes = walk.shapes.get(path) if path in walk.queues else None
            if shapes is not None:
                for gpu_type, gpus, _ in shapes:
                    if gpus < smallest.get(gpu_type, NEVER):
                        smallest[gpu_type] = gpus
            else:
                for child in walk.live.get(path, ()):
                    for gpu_type, gpus in self.smallest_requests(child).items():
                        if gpus < smallest.get(gpu_type, NEVER):
                            smallest[gpu_type] = gpus
            self._smallest[path] = smallest
        return smallest

    def waiting_paths(self) -> set[str]:
        """Budget nodes above (and the leaves of) workloads with runs stopping for them."""
        if self._waiting is None:
            pending = self.s.state.pending
            self._waiting = set()
            for wid in self.s.waiting_for:
                w = pending.get(wid)
                if w is not None:
                    self._waiting.update((*ancestors_of(w.owner), w.owner))
        return self._waiting
