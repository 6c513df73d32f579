"""Who could be a victim at all, and in what order victims go.

The victim index holds, per node, the running work that could be preempted
(unallocated work, and allocated work past its protection; never a stopping
run) and totals of those GPUs per node, pool and budget path. It is built on
the first preemption search of a cycle (:meth:`VictimIndex.index`) and kept up
to date as the cycle preempts; ``changes`` bumps at every change, so caches
built on it (here, :mod:`.poolbound`, :mod:`.prune`) know when to recompute.

The victim order and the cost of a victim set (:meth:`VictimIndex.order`,
:meth:`VictimIndex.set_cost`) are the rule of docs/cycle.md, step 3 "preempt":
unallocated work first, then the most over-served owners, then lower
priority, then ids; a set costs (allocated victims, minus the least
over-served victim's position, GPUs freed beyond need, victim ids, node).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..nodeindex import Pool
from ..rules.contract import is_allocated, unprotected
from ..state import ClusterNode, Workload

if TYPE_CHECKING:
    from .scratch import Scratch

SetCost = tuple[int, int, int, tuple[str, ...], str]
"""Cost of a victim set, compared in order (:meth:`VictimIndex.set_cost`)."""


class VictimIndex:
    """Possible victims per node, pool and budget path (module docstring)."""

    def __init__(self, s: Scratch) -> None:
        self.s = s
        self.ready = False  # built on the first preemption search
        self.changes = 0  # bumps whenever the victim totals change
        # who could be a victim at all, per node (fixed at the cycle start):
        # unallocated work, and allocated work past its protection
        self.victimable: dict[str, list[Workload]] = {}
        self.node_unalloc: dict[str, int] = {}
        self.pool_unalloc: dict[Pool, int] = {}
        self.pool_expired: dict[Pool, dict[str, int]] = {}
        self.path_nodes: dict[str, dict[str, int]] = {}  # budget path -> node -> expired GPUs
        self._expired: dict[tuple[str, Pool], tuple[int, object, dict[str, int]]] = {}
        self._expired_leaves: tuple[int, list[tuple[int, str]]] | None = None

    def index(self) -> None:
        """Who could be a victim at all (unallocated work, and allocated work past
        its protection), per node and pool; built once, on the first search."""
        if self.ready:
            return
        self.ready = True
        gone = self.s.gone
        victimable = self.victimable
        for w in unprotected(self.s.state.running.values(), self.s.t):
            if w.id not in gone and w.stopping is None:  # a stopping run is never a victim
                for slot in w.placement:
                    victimable.setdefault(slot.node, []).append(w)
                self.count(w, +1)

    def count(self, w: Workload, sign: int) -> None:
        """Add (or remove) ``w``'s GPUs to the per-node and per-pool victim totals."""
        self.changes += 1
        s = self.s
        nodes = s.state.nodes
        if not is_allocated(w):
            free, changed = s.free, s.roomy.changed
            for slot in w.placement:
                node = nodes[slot.node]
                key = (node.gpu_type, node.gpus)
                gpus = sign * slot.gpus
                before = self.node_unalloc.get(slot.node, 0)
                self.node_unalloc[slot.node] = before + gpus
                self.pool_unalloc[key] = self.pool_unalloc.get(key, 0) + gpus
                changed(slot.node, free[slot.node] + before, gpus)
            return
        path = s.outranking.path(w.owner)
        per_pool: dict[Pool, int] = {}
        for slot in w.placement:
            node = nodes[slot.node]
            key = (node.gpu_type, node.gpus)
            per_pool[key] = per_pool.get(key, 0) + sign * slot.gpus
        for key, gpus in per_pool.items():
            by_pool = self.pool_expired.setdefault(key, {})
            for p in path:
                by_pool[p] = by_pool.get(p, 0) + gpus
        for p in path:
            on = self.path_nodes.setdefault(p, {})
            for slot in w.placement:
                left = on.get(slot.node, 0) + sign * slot.gpus
                if left:
                    on[slot.node] = left
                else:
                    del on[slot.node]

    def on(self, c: Workload, name: str, subtrees: dict[str, None]) -> list[Workload]:
        """Running workloads on ``name`` that ``c`` may preempt now."""
        gone = self.s.gone
        may_preempt = self.s.outranking.may_preempt
        return [
            v
            for v in self.victimable.get(name, ())
            if v.id not in gone and may_preempt(c, v, subtrees)
        ]

    def unallocated_on(self, name: str) -> list[Workload]:
        """Unallocated running workloads on ``name`` (anyone allocated may preempt them)."""
        gone = self.s.gone
        return [
            v for v in self.victimable.get(name, ()) if v.id not in gone and not is_allocated(v)
        ]

    def expired_on(self, leaf: str, key: Pool, subtrees: dict[str, None]) -> dict[str, int]:
        """Per node of pool ``key``: GPUs of expired work of ``leaf`` and of ``subtrees``
        (cached until the victims or the subtrees change)."""
        cached = self._expired.get((leaf, key))
        if cached is not None and cached[0] == self.changes and cached[1] is subtrees:
            return cached[2]
        pool = self.s.pool_set(key)
        expired: dict[str, int] = {}
        for p in (leaf, *subtrees):
            for n, gpus in self.path_nodes.get(p, {}).items():
                if n in pool:
                    expired[n] = expired.get(n, 0) + gpus
        self._expired[(leaf, key)] = (self.changes, subtrees, expired)
        return expired

    def expired_leaves(self) -> list[tuple[int, str]]:
        """``(fair-share position, leaf)`` of the leaves with expired allocated work
        running, most over-served first (cached until the victims change)."""
        cached = self._expired_leaves
        if cached is None or cached[0] != self.changes:
            nodes = self.s.state.budget.nodes
            position = self.s.view.leaf_position
            leaves = sorted(
                (-position(p), p)
                for p, on in self.path_nodes.items()
                if on and not nodes[p].children
            )
            cached = self._expired_leaves = (self.changes, [(-neg, p) for neg, p in leaves])
        return cached[1]

    # -- the victim order and the cost of a set --------------------------------
    def order(self, v: Workload) -> tuple[int, int, int, str]:
        """Unallocated first, then the most over-served owners, then lower priority, then id."""
        if not is_allocated(v):
            return (0, 0, 0, v.id)
        return (1, -self.s.view.leaf_position(v.owner), v.priority, v.id)

    def set_cost(self, victims: list[Workload], excess: int, name: str) -> SetCost:
        allocated = [v for v in victims if is_allocated(v)]
        position = self.s.view.leaf_position
        least = min((position(v.owner) for v in allocated), default=0)
        return (len(allocated), -least, excess, tuple(sorted(v.id for v in victims)), name)

    def cheapest_on_node(
        self, victims: list[Workload], node: ClusterNode, free: int, g: int
    ) -> list[Workload]:
        """Victims in cost order until ``g`` GPUs are free, then drop any not needed."""
        chosen: list[Workload] = []
        have = free
        for v in sorted(victims, key=self.order):
            if have >= g:
                break
            chosen.append(v)
            have += node.workloads[v.id]
        for v in reversed(list(chosen)):
            if have - node.workloads[v.id] >= g:
                chosen.remove(v)
                have -= node.workloads[v.id]
        return chosen
