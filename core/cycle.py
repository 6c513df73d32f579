"""The scheduling cycle: ``decide(state) -> CycleResult``, pure and deterministic.

At time ``t = state.now_ms`` (the time of the last event folded), the cycle runs
these steps over a scratch copy of the free GPUs and never changes ``state``:

0. **Rejections**: every input the fold recorded as rejected becomes an
   ``InputRejected`` decision.
1. **Down nodes**: every workload on a ``down`` node is lost at once
   (``node_down``; resumable ones requeue).
2. **Draining nodes**: unallocated work is preempted at once, allocated work as
   each reaches ``protected_until`` (``drain``); an empty draining node gets one
   ``NodeDrained``.
3. **Allocated work in fair-share order**
   (:class:`~apportion.core.ordering.FairShareWalk`), the order recomputed as
   the cycle goes: each placement adds its projected charge
   ``gpus * min_runtime`` to its path before the next workload is ranked. For
   each workload:

   a. place it if it fits (:meth:`~apportion.core.placement.FreeGPUs.fit`:
      best fit on one node, or whole nodes of one pool);
   b. otherwise try to preempt (:meth:`_Cycle.preemption`): the cheapest victim
      set that makes it fit, among victims it may preempt
      (:meth:`_Cycle.may_preempt`, the margin test of
      :func:`~apportion.core.ratio.clearly_below_pair`);
   c. otherwise, if it is the first allocated workload that could not be placed,
      reserve for it the nodes that become free or preemptible earliest
      (:meth:`_Cycle.reserve`); later (lower-ranked) work may use a reserved node
      only if it will be preemptible before the reservation starts
      (:func:`~apportion.core.contract.may_use_reserved`).

4. **Unallocated work** (``min_runtime == 0``) by submit time, then id: placed if
   it fits; it never preempts.

**Preemption notice** (grace, docs/semantics.md): a victim of steps 2-3 with an
effective grace > 0 keeps its GPUs until its stop deadline (``stopping``); its
beneficiary is not placed in this cycle, the nodes it would take are *held* for
it (no other work goes there), and while runs stop for it it does not preempt
again. Stopping runs are never victims; a draining node with one is not drained.

The contract (allocated, protected, the reservation gate) is
:mod:`apportion.core.contract`. Requeued work from steps 1-2 joins the walk of
step 3/4 in the same cycle; a victim of a fair-share preemption waits for the
next cycle (so one cycle never moves the same workload twice).

Every choice ends in a unique tie-break (node id, workload id), no ``set`` is
iterated, and ratios compare exactly, so the same state gives the same
decisions on any machine.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator
from functools import partial

import msgspec
from apportion.schemas.events import (
    ANY_GPU_TYPE,
    Decision,
    InputRejected,
    NodeDrained,
    Slot,
    WorkloadPlaced,
    WorkloadPreempted,
)

from .budget import ROOT, ancestors_of, parent_of
from .nodeindex import Pool
from .ordering import FairShareView, FairShareWalk
from .pendingindex import FreeKey, Shape, free_key
from .placement import FreeGPUs, Slots
from .ratio import clearly_below_pair
from .rules.contract import (
    effective_grace,
    is_allocated,
    is_protected,
    may_use_reserved,
    preemptible_from,
    protected,
    protected_until,
    unprotected,
)
from .state import ClusterNode, State, Workload, apply

_NEVER = 1 << 62
"""A release time that is not known (work that only ends when it finishes)."""


SetCost = tuple[int, int, int, tuple[str, ...], str]
"""Cost of a victim set, compared in order (see :meth:`_Cycle.preemption`)."""


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """Nodes held for ``workload`` from ``start_ms``: until then only work that
    will be preemptible before ``start_ms`` may run on them."""

    workload: str
    nodes: tuple[str, ...]
    start_ms: int


class CycleResult(msgspec.Struct, frozen=True, kw_only=True):
    decisions: tuple[Decision, ...]
    """In the order they must be folded: rejections, node-down and drain
    preemptions, NodeDrained, then placements each preceded by the preemptions
    that made room for it."""
    next_wakeup_ms: int | None
    """Earliest future time at which a decision could change with no new input
    (a protection expiry, a reservation start or the end of a preemption notice);
    ``None`` if none."""
    reservation: Reservation | None = None


def decide(state: State, *, report_reservation: bool = False) -> CycleResult:
    """One scheduling cycle at ``state.now_ms``; does not change ``state``.

    The reservation is computed only when it changes a decision (a later
    workload would otherwise use a node it holds); ``report_reservation=True``
    also computes it when it did not, so that :attr:`CycleResult.reservation`
    always tells (for ``explain`` and tests). The decisions are the same either way.
    """
    return _Cycle(state).run(report_reservation)


def step(state: State, *, report_reservation: bool = False) -> CycleResult:
    """``decide`` and fold the decisions back into ``state``."""
    result = decide(state, report_reservation=report_reservation)
    for decision in result.decisions:
        apply(state, decision)
    return result


_DOOM_FROM = 32
"""Pass over doomed shapes (:meth:`_Cycle._doom`) only in a leaf with at least this
many workloads left to walk: below it, visiting them costs less than the merge.
Either way the decisions are the same."""


class _Cycle:
    """Scratch state of one cycle. Reads ``state``, writes only its own fields."""

    def __init__(self, state: State, skip_doomed: bool = True) -> None:
        self.state = state
        self.t = state.now_ms
        self.margin = state.policy.preemption_margin_ppm
        self.decisions: list[Decision] = []
        self.view = FairShareView(state)
        self.usage = dict(self.view.usage)  # working usage, with projected charges
        self.weight = self.view.weight
        index = state.node_index
        self.gpus = FreeGPUs(state)  # free GPUs as this cycle changes them
        self.free = self.gpus.free  # per node (read only: change with _set_free)
        self.gone: dict[str, str] = {}  # workload -> why it left a node this cycle
        self.noticed: dict[str, int] = {}  # of those, preempted with notice -> stop deadline
        self.held: dict[str, str] = {}  # node -> the workload it waits for (notice; this cycle)
        self.waiting_for: dict[str, list[Workload]] = {}
        """pending workload -> the runs stopping (with notice) to make room for it"""
        for _, wid in state.stop_deadlines:
            run = state.running[wid]
            stop = run.stopping
            if stop is not None and stop.for_workload is not None:
                self.waiting_for.setdefault(stop.for_workload, []).append(run)
        self.added: dict[str, list[tuple[Workload, int]]] = {}  # node -> placed this cycle
        self.requeued: list[Workload] = []  # by steps 1-2, placed again this cycle
        self.reservation: Reservation | None = None
        self.to_reserve: Workload | None = None  # blocked, reservation not computed yet
        self.blocked = False  # an allocated workload could not be placed
        self.failing = False  # the last allocated workload tried could not be placed
        self.reserved: dict[str, int] = {}  # node -> reservation start
        self.freed = 0  # bumps on every preemption (the only way GPUs come free in a cycle)
        self.failed: dict[
            tuple[str, str, bool, bool], tuple[int, object, int, int, frozenset[Pool]]
        ] = {}
        """shape -> (``freed``, what the failure depended on (:meth:`_try`), priority, GPUs,
        the pools that could take them) of the last failure to place."""
        self._taking: dict[tuple[str, int], frozenset[Pool]] = {}
        self._every_pool: dict[str, frozenset[Pool]] = {}  # GPU type -> its pools
        self._paths: dict[str, tuple[str, ...]] = {}
        self.charges = 0  # bumps on every projected charge (ratios changed)
        self._subtrees: dict[str, tuple[int, tuple[int, ...], dict[str, None]]] = {}
        """leaf -> (``charges``, its families' charge counts, victim subtrees)"""
        self._above: dict[str, tuple[int, tuple[str, ...]]] = {}
        self.family_charges: dict[str, int] = {}  # parent -> charges to any of its children
        # who could be a victim at all, per node (fixed at the cycle start):
        # unallocated work, and allocated work past its protection
        self.victimable: dict[str, list[Workload]] = {}
        self.node_unalloc: dict[str, int] = {}
        self.path_nodes: dict[str, dict[str, int]] = {}  # budget path -> node -> expired GPUs
        self._roomy: dict[tuple[str, int], list[tuple[int, str]]] = {}
        """Per pool: ``(-(free + unallocated GPUs), node)`` sorted, of the nodes with
        any, kept up to date by :meth:`_room_changed` once built (:meth:`_roomy_nodes`)."""
        self.pool_free = self.gpus.pool_free  # read only
        self.pool_unalloc: dict[tuple[str, int], int] = {}
        self.pool_expired: dict[tuple[str, int], dict[str, int]] = {}
        self._victims_ready = False  # built on the first preemption search
        self.pool_nodes = self.gpus.pool_nodes  # read only
        self._pool_sets: dict[tuple[str, int], frozenset[str]] = {}
        self.down_nodes = index.down  # read only
        self.draining_nodes = index.draining  # read only
        self.skip_doomed = skip_doomed
        self.walk: FairShareWalk | None = None
        self.doomed: dict[tuple[str, str, bool], tuple[object, int, frozenset[Pool], int]] = {}
        """(leaf, GPU type, gate) -> (epoch token, fewest GPUs that failed in it, the pools
        that could take them, fewest GPUs no node can be had for)."""
        self._epochs: dict[str, tuple[int, dict[str, None], object]] = {}
        self._holder_leaves: tuple[int, set[str]] | None = None
        self._coverage: dict[int, tuple[dict[str, None], dict[str, bool]]] = {}
        self._expired_leaves_cache: tuple[int, list[tuple[int, str]]] | None = None
        """id(victim subtrees) -> (the subtrees, leaf -> in one of them): the object is
        kept, so an id is never taken for another object's while cached."""
        self._cheap: dict[
            tuple[tuple[str, int], int], tuple[list[tuple[SetCost, str]], dict[str, SetCost]]
        ] = {}
        """(pool, GPUs) -> nodes by :meth:`_unallocated_cost` (sorted, and by node)."""
        self._cheap_sizes: dict[tuple[str, int], list[int]] = {}
        self.victim_changes = 0  # bumps whenever the victim totals change
        self._expired: dict[tuple[str, tuple[str, int]], tuple[int, object, dict[str, int]]] = {}
        self._outranked: dict[tuple[str, tuple[str, int]], tuple[tuple[int, int], int]] = {}
        """(budget node, pool) -> (versions, GPUs): :meth:`_outranked_expired`."""
        self._not_pruned: dict[str, tuple[int, int, int]] = {}  # path -> when last checked
        self.pruned: list[str] = []  # budget nodes the walk passed over whole (_prunable)
        self._smallest: dict[str, dict[str, int]] = {}  # _smallest_requests
        self._waiting: set[str] | None = None  # _waiting_paths
        self._floors: dict[tuple[str, int], list[tuple[int, str]]] = {}  # _release_floors

    # ------------------------------------------------------------------
    def run(self, report_reservation: bool = False) -> CycleResult:
        state = self.state
        for ref, reason, code in state.rejections:
            self._emit(InputRejected, ref=ref, reason=reason, code=code)
        self._lose_down_nodes()
        self._drain()
        self._schedule_allocated()
        self._schedule_unallocated()
        if report_reservation:
            self._settle_reservation()
        return CycleResult(
            decisions=tuple(self.decisions),
            next_wakeup_ms=self._next_wakeup(),
            reservation=self.reservation,
        )

    def _emit(self, kind: type, **fields: object) -> None:
        n = self.state.decisions_folded + len(self.decisions) + 1
        self.decisions.append(kind(id=f"d{n}", at_ms=self.t, **fields))

    # -- steps 1 and 2 ---------------------------------------------------
    def _lose_down_nodes(self) -> None:
        state = self.state
        for name in self.down_nodes:
            node = state.nodes[name]
            if node.workloads:
                for wid in list(node.workloads):
                    if wid not in self.gone:
                        self._preempt(state.running[wid], "node_down", None, requeue_now=True)

    def _drain(self) -> None:
        state = self.state
        for name in self.draining_nodes:
            node = state.nodes[name]
            for wid in list(node.workloads):
                w = state.running[wid]
                if wid not in self.gone and w.stopping is None and not is_protected(w, self.t):
                    self._preempt(w, "drain", None, requeue_now=True)
            if not node.drained and all(
                wid in self.gone and wid not in self.noticed for wid in node.workloads
            ):  # stopping runs (with notice) still hold the node
                self._emit(NodeDrained, node=name)

    # -- scratch bookkeeping ----------------------------------------------
    def _index_victims(self) -> None:
        """Who could be a victim at all (unallocated work, and allocated work past
        its protection), per node and pool; built once, on the first search."""
        if self._victims_ready:
            return
        self._victims_ready = True
        gone = self.gone
        for w in unprotected(self.state.running.values(), self.t):
            if w.id not in gone and w.stopping is None:  # a stopping run is never a victim
                for slot in w.placement:
                    self.victimable.setdefault(slot.node, []).append(w)
                self._count_victimable(w, +1)

    def _count_victimable(self, w: Workload, sign: int) -> None:
        """Add (or remove) ``w``'s GPUs to the per-node and per-pool victim totals."""
        self.victim_changes += 1
        nodes = self.state.nodes
        if not is_allocated(w):
            for slot in w.placement:
                node = nodes[slot.node]
                key = (node.gpu_type, node.gpus)
                gpus = sign * slot.gpus
                before = self.node_unalloc.get(slot.node, 0)
                self.node_unalloc[slot.node] = before + gpus
                self.pool_unalloc[key] = self.pool_unalloc.get(key, 0) + gpus
                self._room_changed(slot.node, self.free[slot.node] + before, gpus)
            return
        path = self._path(w.owner)
        per_pool: dict[tuple[str, int], int] = {}
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

    def _set_free(self, name: str, free: int) -> None:
        before = self.free[name]
        self.gpus.set(name, free)
        self._room_changed(name, before + self.node_unalloc.get(name, 0), free - before)

    def _room_changed(self, name: str, room: int, delta: int) -> None:
        """Node ``name``'s free + unallocated GPUs went from ``room`` by ``delta``
        (or what it has of either changed): keep the per-pool lists up to date."""
        node = self.state.nodes[name]
        key = (node.gpu_type, node.gpus)
        ranked = self._roomy.get(key)
        if ranked is not None and delta:
            if room:  # listed, if a node of the pool
                i = bisect_left(ranked, (-room, name))
                listed = i < len(ranked) and ranked[i] == (-room, name)
                if listed:
                    del ranked[i]
            else:  # not listed (nothing to offer)
                listed = name in self._pool_sets_for(key)
            if listed and room + delta:
                insort(ranked, (-(room + delta), name))
        for g in self._cheap_sizes.get(key, ()):
            ranked_costs, costs = self._cheap[(key, g)]
            old = costs.pop(name, None)
            if old is not None:
                del ranked_costs[bisect_left(ranked_costs, (old, name))]
            elif name not in self._pool_sets_for(key):
                continue
            new = self._unallocated_cost(name, g)
            if new is not None:
                costs[name] = new
                insort(ranked_costs, (new, name))

    # -- the cheapest victim set of unallocated work only ----------------------
    # On a node whose free and unallocated GPUs reach ``g``, the cheapest victim
    # set takes unallocated work only (it comes first in :meth:`_victim_order`),
    # so its cost (no allocated victim; then GPUs freed beyond need, victim ids,
    # node) is the same for every candidate, and beats every node that needs an
    # allocated victim. Per pool and ``g`` the nodes are kept sorted by that cost.
    def _pool_sets_for(self, key: tuple[str, int]) -> frozenset[str]:
        """The nodes of pool ``key``, as a set (cached)."""
        pool = self._pool_sets.get(key)
        if pool is None:
            pool = self._pool_sets[key] = frozenset(self.pool_nodes[key])
        return pool

    def _unallocated_cost(self, name: str, g: int) -> SetCost | None:
        """The cost of the cheapest set of unallocated victims on ``name`` that frees
        ``g`` GPUs there, or ``None`` if its free and unallocated GPUs fall short."""
        free = self.free[name]
        if free + self.node_unalloc.get(name, 0) < g:
            return None
        gone = self.gone
        victims = [
            v for v in self.victimable.get(name, ()) if v.id not in gone and not is_allocated(v)
        ]
        node = self.state.nodes[name]
        chosen = self._cheapest_on_node(victims, node, free, g)
        freed = sum(node.workloads[v.id] for v in chosen)
        elsewhere = sum(v.gpus for v in chosen) - freed
        return self._set_cost(chosen, free + freed - g + elsewhere, name)

    def _cheapest_unallocated(self, c: Workload, key: tuple[str, int], g: int) -> str | None:
        """The node of pool ``key`` (``g`` <= its node size) that ``c`` may use where
        unallocated victims alone make ``g`` GPUs at the lowest cost, if any."""
        entry = self._cheap.get((key, g))
        if entry is None:
            costs: dict[str, SetCost] = {}
            for room, n in self._roomy_nodes(key):  # the nodes with g free + unallocated
                if -room < g:
                    break
                cost = self._unallocated_cost(n, g)
                if cost is not None:
                    costs[n] = cost
            entry = self._cheap[(key, g)] = (sorted((v, n) for n, v in costs.items()), costs)
            self._cheap_sizes.setdefault(key, []).append(g)
        for _, name in entry[0]:
            if self._may_use(c, name):
                return name
        return None

    def _preempt(
        self, w: Workload, reason: str, for_workload: str | None, requeue_now: bool = False
    ) -> int:
        """Preempt ``w``; returns the notice given (its GPUs stay taken meanwhile)."""
        self.gone[w.id] = reason
        if self._victims_ready and w.stopping is None and not is_protected(w, self.t):
            self._count_victimable(w, -1)
        self.freed += 1
        grace = 0
        if reason != "node_down" and w.stopping is None:
            grace = effective_grace(w.grace_ms, self.state.policy.grace_ms)
        if grace:
            self.noticed[w.id] = self.t + grace
        else:
            for slot in w.placement:
                self._set_free(slot.node, self.free[slot.node] + slot.gpus)
        self._emit(
            WorkloadPreempted,
            workload=w.id,
            reason=reason,
            requeued=w.resumable,
            for_workload=for_workload,
            grace_ms=grace,
        )
        if requeue_now and w.resumable and not grace:
            self.requeued.append(w)
        return grace

    def _place(self, w: Workload, slots: Slots) -> None:
        for name, gpus in slots:
            self._set_free(name, self.free[name] - gpus)
            self.added.setdefault(name, []).append((w, gpus))
        self._emit(
            WorkloadPlaced,
            workload=w.id,
            placement=tuple(Slot(name, gpus) for name, gpus in slots),
            allocated=is_allocated(w),
            protected_until_ms=protected_until(self.t, w.min_runtime_ms),
            attempt=w.attempt + 1,
        )

    @property
    def buckets(self) -> dict[tuple[str, int], dict[int, list[str]]]:
        """Healthy nodes by pool and free GPUs as this cycle changes them (read only;
        tests/replay/test_audit.py reads it to break best-fit ties the wrong way)."""
        return self.gpus.buckets

    def _pools_for(self, w: Workload) -> list[tuple[str, int]]:
        return self.gpus.pools_for(w.gpu_type)

    def _may_use(self, w: Workload, name: str) -> bool:
        """The reservation gate on node ``name`` (:func:`~apportion.core.contract.may_use_reserved`)."""
        held = self.held.get(name)
        if held is not None and held != w.id:
            return False
        start = self.reserved.get(name)
        return start is None or may_use_reserved(self.t, w.min_runtime_ms, start)

    # -- a. fit --------------------------------------------------------------
    def fit(self, w: Workload) -> Slots | None:
        """Where ``w`` fits now (:meth:`~apportion.core.placement.FreeGPUs.fit`) on
        the nodes the reservation gate lets it use."""
        gate = partial(self._may_use, w) if self.reserved or self.held else None
        return self.gpus.fit(w.gpus, w.gpu_type, gate)

    # -- b. preemption -------------------------------------------------------
    def _path(self, leaf: str) -> tuple[str, ...]:
        """``leaf`` and its ancestors below the root, top level first."""
        path = self._paths.get(leaf)
        if path is None:
            path = (*ancestors_of(leaf)[1:], leaf)
            self._paths[leaf] = path
        return path

    def victim_subtrees(self, leaf: str) -> dict[str, None]:
        """Budget nodes whose whole subtree a workload of ``leaf`` outranks clearly:
        for each ancestor ``a`` of ``leaf`` (and ``leaf``), the siblings ``s`` of
        ``a`` with ``ratio(a) < (1 - margin) * ratio(s)``. Their subtrees are
        disjoint. Recomputed when a projected charge changes a ratio on the way."""
        cached = self._subtrees.get(leaf)
        if cached is not None and cached[0] == self.charges:
            return cached[2]
        path = self._path(leaf)
        families = self.family_charges
        key = tuple(families.get(p, 0) for p in ancestors_of(leaf))  # the path's families
        if cached is not None and cached[1] == key:
            self._subtrees[leaf] = (self.charges, key, cached[2])
            return cached[2]
        out: dict[str, None] = {}
        parent = ROOT
        for a in path:
            out.update(dict.fromkeys(self._clearly_above(parent, a)))
            parent = a
        if cached is not None and cached[2] == out:
            out = cached[2]  # same content: keep the object, so failures stay remembered
        self._subtrees[leaf] = (self.charges, key, out)
        return out

    def _clearly_above(self, parent: str, a: str) -> tuple[str, ...]:
        """Siblings ``s`` of ``a`` with ``ratio(a) < (1 - margin) * ratio(s)``, cached
        until a child of ``parent`` is charged."""
        version = self.family_charges.get(parent, 0)
        cached = self._above.get(a)
        if cached is not None and cached[0] == version:
            return cached[1]
        usage, weight, margin = self.usage, self.weight, self.margin
        ua, wa = usage[a], weight[a]
        above = tuple(
            sib
            for sib in self.state.budget.nodes[parent].children
            if sib != a and clearly_below_pair(ua, wa, usage[sib], weight[sib], margin)
        )
        self._above[a] = (version, above)
        return above

    def may_preempt(self, c: Workload, v: Workload, subtrees: dict[str, None]) -> bool:
        """Whether ``c`` may preempt ``v`` once ``v`` is past its protection: every
        "candidate outranks victim" decision of the cycle is this one.

        Unallocated ``v``: always. Allocated: ``c`` outranks ``v`` clearly, i.e. at
        the first level where their paths part, ``ratio(c side) < (1 - margin) *
        ratio(v side)`` (``subtrees`` is :meth:`victim_subtrees` of ``c.owner``);
        inside one leaf, only a strictly higher priority outranks."""
        if not is_allocated(v):
            return True
        if v.owner == c.owner:
            return c.priority > v.priority
        return self._covered(v.owner, subtrees)

    def _covered(self, leaf: str, subtrees: dict[str, None]) -> bool:
        """Whether ``leaf`` lies in one of ``subtrees`` (cached per subtrees object)."""
        cached = self._coverage.get(id(subtrees))
        if cached is None or cached[0] is not subtrees:
            cached = self._coverage[id(subtrees)] = (subtrees, {})
        known = cached[1].get(leaf)
        if known is None:
            known = cached[1][leaf] = any(p in subtrees for p in self._path(leaf))
        return known

    def _roomy_nodes(self, key: tuple[str, int]) -> list[tuple[int, str]]:
        """``(-(free + unallocated GPUs), node)`` of the pool's nodes that have any, most
        first, then by id (a node with neither offers no request anything: in a full
        cluster that is most of them, so they are left out)."""
        ranked = self._roomy.get(key)
        if ranked is None:
            free, unalloc = self.free, self.node_unalloc
            pool = self._pool_sets_for(key)
            names = [n for f, on in self.gpus.buckets[key].items() if f for n in on]
            names += [n for n, gpus in unalloc.items() if gpus and not free[n] and n in pool]
            ranked = sorted((-(free[n] + unalloc.get(n, 0)), n) for n in names)
            self._roomy[key] = ranked
        return ranked

    def _candidate_nodes(
        self, c: Workload, key: tuple[str, int], want: int, subtrees: dict[str, None]
    ) -> list[str]:
        """Nodes of pool ``key`` that might offer ``want`` GPUs to ``c``, by id: an upper
        bound of what ``c`` could have there (free, unallocated and the expired work
        of its own leaf and of the subtrees it outranks) is at least ``want``."""
        free, unalloc = self.free, self.node_unalloc
        expired = self._expired_on(c.owner, key, subtrees)
        found: list[str] = []
        for room, n in self._roomy_nodes(key):
            if -room < want:
                break
            found.append(n)
        for n, gpus in expired.items():
            if free[n] + unalloc.get(n, 0) < want <= free[n] + unalloc.get(n, 0) + gpus:
                found.append(n)
        return sorted(found)

    def _expired_on(
        self, leaf: str, key: tuple[str, int], subtrees: dict[str, None]
    ) -> dict[str, int]:
        """Per node of pool ``key``: GPUs of expired work of ``leaf`` and of ``subtrees``
        (cached until the victims or the subtrees change)."""
        cached = self._expired.get((leaf, key))
        if cached is not None and cached[0] == self.victim_changes and cached[1] is subtrees:
            return cached[2]
        pool = self._pool_sets_for(key)
        expired: dict[str, int] = {}
        for p in (leaf, *subtrees):
            for n, gpus in self.path_nodes.get(p, {}).items():
                if n in pool:
                    expired[n] = expired.get(n, 0) + gpus
        self._expired[(leaf, key)] = (self.victim_changes, subtrees, expired)
        return expired

    def _victims_on(self, c: Workload, name: str, subtrees: dict[str, None]) -> list[Workload]:
        """Running workloads on ``name`` that ``c`` may preempt now."""
        gone = self.gone
        return [
            v
            for v in self.victimable.get(name, ())
            if v.id not in gone and self.may_preempt(c, v, subtrees)
        ]

    def _victim_order(self, v: Workload) -> tuple[int, int, int, str]:
        """Unallocated first, then the most over-served owners, then lower priority, then id."""
        if not is_allocated(v):
            return (0, 0, 0, v.id)
        return (1, -self.view.leaf_position(v.owner), v.priority, v.id)

    def _set_cost(self, victims: list[Workload], excess: int, name: str) -> SetCost:
        allocated = [v for v in victims if is_allocated(v)]
        least = min((self.view.leaf_position(v.owner) for v in allocated), default=0)
        return (len(allocated), -least, excess, tuple(sorted(v.id for v in victims)), name)

    def preemption(self, c: Workload) -> tuple[list[Workload], Slots] | None:
        """The cheapest victim set that makes ``c`` fit, and where ``c`` then goes.

        Possible victims: unallocated work, and allocated work past its
        protection that ``c`` outranks clearly (:meth:`may_preempt`). Cost,
        compared in order: fewest allocated victims (unallocated ones first),
        the most over-served owners (the least over-served victim as
        over-served as possible), fewest GPUs freed beyond need, victim ids,
        node ids."""
        self._index_victims()
        g = c.gpus
        subtrees: dict[str, None] | None = None  # computed once a pool passes the bound
        best: tuple[SetCost, list[Workload], list[tuple[str, int]]] | None = None
        for key in self._pools_for(c):
            size = key[1]
            if g > size and g % size:
                continue
            need = 1 if g <= size else g // size
            want = g if g <= size else size
            if self._pool_short(c.owner, key, g):
                continue  # not enough free and preemptible GPUs in the whole pool
            if subtrees is None:
                subtrees = self.victim_subtrees(c.owner)
            roomy = self._roomy_nodes(key) if g <= size else None
            if roomy and roomy[0][0] <= -g:
                name = self._cheapest_unallocated(c, key, g)
                if name is not None:  # the best of this pool: no need to look further
                    node = self.state.nodes[name]
                    victims = [
                        v
                        for v in self.victimable.get(name, ())
                        if v.id not in self.gone and not is_allocated(v)
                    ]
                    chosen = self._cheapest_on_node(victims, node, self.free[name], g)
                    cost = self._cheap[(key, g)][1][name]
                    if best is None or cost < best[0]:
                        best = (cost, chosen, [(name, g)])
                    continue
            names = [
                n for n in self._candidate_nodes(c, key, want, subtrees) if self._may_use(c, n)
            ]
            if len(names) < need:
                continue
            if g <= size:
                # Every node here needs an allocated victim (a node where unallocated
                # work alone would do was taken above), so a node's cost is at least
                # (1, -position of its most over-served possible victim): visit them
                # most over-served first and stop once that bound is above the best.
                positions = self._victim_positions(c, key, subtrees)
                names.sort(key=lambda n: (-positions.get(n, -1), n))
                for name in names:
                    if best is not None and (1, -positions.get(name, -1)) > best[0][:2]:
                        break
                    node = self.state.nodes[name]
                    free = self.free[name]
                    victims = self._victims_on(c, name, subtrees)
                    if free + sum(node.workloads[v.id] for v in victims) < g:
                        continue
                    if best is not None and self._cannot_beat(best[0], victims, node, free, g):
                        continue
                    chosen = self._cheapest_on_node(victims, node, free, g)
                    freed = sum(node.workloads[v.id] for v in chosen)
                    elsewhere = sum(v.gpus for v in chosen) - freed
                    cost = self._set_cost(chosen, free + freed - g + elsewhere, name)
                    if best is None or cost < best[0]:
                        best = (cost, chosen, [(name, g)])
            else:
                options: list[tuple[SetCost, str, list[Workload]]] = []
                for name in names:
                    if self.added.get(name):
                        continue  # holds work placed this cycle, which is protected
                    node = self.state.nodes[name]
                    victims = self._victims_on(c, name, subtrees)
                    if self.free[name] + sum(node.workloads[v.id] for v in victims) < size:
                        continue
                    options.append((self._set_cost(victims, 0, name), name, victims))
                if len(options) < need:
                    continue
                options.sort(key=lambda o: o[0])
                picked = options[:need]
                seen: dict[str, Workload] = {}
                for _, _, victims in picked:
                    for v in victims:
                        seen[v.id] = v
                chosen = sorted(seen.values(), key=lambda v: v.id)
                excess = sum(v.gpus for v in chosen) + sum(self.free[n] for _, n, _ in picked) - g
                cost = self._set_cost(chosen, excess, picked[0][1])
                if best is None or cost < best[0]:
                    best = (
                        cost,
                        chosen,
                        [(n, size) for _, n, _ in sorted(picked, key=lambda o: o[1])],
                    )
        if best is None or not best[1]:
            return None
        return best[1], best[2]

    def _pool_short(self, leaf: str, key: tuple[str, int], g: int) -> bool:
        """Whether pool ``key`` lacks ``g`` GPUs for work of ``leaf`` even counting every
        GPU it could free there: free, unallocated, and expired allocated work of
        ``leaf`` and of the subtrees it outranks (:meth:`victim_subtrees`)."""
        return self._room(leaf, key, g) < g

    def _room(self, path: str, key: tuple[str, int], need: int = _NEVER) -> int:
        """An upper bound of the GPUs any workload under budget node ``path`` could have
        in pool ``key`` (free, unallocated, and expired allocated work of its leaf and
        of the subtrees it outranks); for a leaf, exactly that total. Stops early once
        it is below ``need``.

        Decided from the top of the path down: at ancestor ``a``, the siblings ``a``
        outranks at this level and above, plus everything expired under ``a``
        itself (which holds the rest of a leaf's subtrees and the leaf), bound the
        total of every leaf below ``a``; the least of these bounds is kept. Most
        failing heads of a cycle stop at a level shared by many leaves, whose sums
        are cached (:meth:`_outranked_expired`)."""
        expired = self.pool_expired.get(key, {})
        have = self.pool_free.get(key, 0) + self.pool_unalloc.get(key, 0)
        room = _NEVER
        parent = ROOT
        for a in self._path(path):
            have += self._outranked_expired(parent, a, key, expired)
            room = min(room, have + expired.get(a, 0))
            if room < need:
                break
            parent = a
        return room

    def _outranked_expired(
        self, parent: str, a: str, key: tuple[str, int], expired: dict[str, int]
    ) -> int:
        """Expired allocated GPUs in pool ``key`` under the siblings of ``a`` that ``a``
        clearly outranks (:meth:`_clearly_above`), cached until a child of ``parent`` is
        charged or the victims change."""
        version = (self.family_charges.get(parent, 0), self.victim_changes)
        cached = self._outranked.get((a, key))
        if cached is not None and cached[0] == version:
            return cached[1]
        total = sum(expired.get(s, 0) for s in self._clearly_above(parent, a))
        self._outranked[(a, key)] = (version, total)
        return total

    def _victim_positions(
        self, c: Workload, key: tuple[str, int], subtrees: dict[str, None]
    ) -> dict[str, int]:
        """Per node of pool ``key`` with expired allocated work of ``c``'s leaf or of a
        leaf ``c`` outranks: the highest fair-share position among those leaves (the
        most over-served victim ``c`` could find there)."""
        pool = self._pool_sets_for(key)
        out: dict[str, int] = {}
        for position, leaf in self._expired_leaves():
            if leaf != c.owner and not self._covered(leaf, subtrees):
                continue
            for n in self.path_nodes[leaf]:
                if n in pool and n not in out:
                    out[n] = position
        return out

    def _expired_leaves(self) -> list[tuple[int, str]]:
        """``(fair-share position, leaf)`` of the leaves with expired allocated work
        running, most over-served first (cached until the victims change)."""
        cached = self._expired_leaves_cache
        if cached is None or cached[0] != self.victim_changes:
            nodes = self.state.budget.nodes
            leaves = sorted(
                (-self.view.leaf_position(p), p)
                for p, on in self.path_nodes.items()
                if on and not nodes[p].children
            )
            cached = self._expired_leaves_cache = (
                self.victim_changes,
                [(-neg, p) for neg, p in leaves],
            )
        return cached[1]

    def _cannot_beat(
        self, best: SetCost, victims: list[Workload], node: ClusterNode, free: int, g: int
    ) -> bool:
        """Whether no victim set on ``node`` can cost less than ``best``: a lower bound
        of its first two cost terms is above ``best``'s (at least the fewest allocated
        victims that free enough, the largest first; and no victim more over-served
        than the most over-served of them)."""
        if best[0] == 0:
            return False  # decided on later terms: not worth a bound
        need = g - free
        sizes: list[int] = []
        most = -1
        for v in victims:
            if is_allocated(v):
                sizes.append(node.workloads[v.id])
                most = max(most, self.view.leaf_position(v.owner))
            else:
                need -= node.workloads[v.id]
        if need <= 0:
            return False  # unallocated victims alone suffice: cost term 0
        sizes.sort(reverse=True)
        fewest = 0
        for size in sizes:
            fewest += 1
            need -= size
            if need <= 0:
                break
        return (fewest, -most) > best[:2]

    def _cheapest_on_node(
        self, victims: list[Workload], node: ClusterNode, free: int, g: int
    ) -> list[Workload]:
        """Victims in cost order until ``g`` GPUs are free, then drop any not needed."""
        chosen: list[Workload] = []
        have = free
        for v in sorted(victims, key=self._victim_order):
            if have >= g:
                break
            chosen.append(v)
            have += node.workloads[v.id]
        for v in reversed(list(chosen)):
            if have - node.workloads[v.id] >= g:
                chosen.remove(v)
                have -= node.workloads[v.id]
        return chosen

    # -- c. reservation ------------------------------------------------------
    def _release_time(
        self,
        c: Workload,
        name: str,
        subtrees: dict[str, None],
        memo: dict[tuple[str, int], bool],
        k: int | None,
    ) -> int:
        """When the ``k``-th GPU of ``name`` (``None``: the last one) becomes free or
        preemptible for ``c``: a GPU comes at the protection expiry of work ``c``
        outranks, at the end of a notice, never (as far as the contract tells) under
        work it does not outrank."""
        t = self.t
        times = self._gpu_release_times(c, name, subtrees, memo)
        if k is None:  # only the latest counts, and nothing comes after never
            last = t
            for at, _ in times:
                if at >= _NEVER:
                    return _NEVER
                last = max(last, at)
            return last
        have = 0
        for at, gpus in sorted(times):
            have += gpus
            if have >= k:
                return at
        raise AssertionError(f"{name} has fewer than {k} GPUs")  # pools hold nodes of >= k

    def _gpu_release_times(
        self,
        c: Workload,
        name: str,
        subtrees: dict[str, None],
        memo: dict[tuple[str, int], bool],
    ) -> Iterator[tuple[int, int]]:
        """``(when, GPUs)`` for the GPUs of node ``name`` (:meth:`_release_time`), each
        at or after the cycle's time."""
        t = self.t
        free = self.free[name]
        if free:
            yield (t, free)
        running = self.state.running
        for wid, gpus in self.state.nodes[name].workloads.items():
            if wid in self.gone:
                until = self.noticed.get(wid)
                if until is not None:  # preempted with notice this cycle
                    yield (until, gpus)
                continue
            v = running[wid]
            if v.stopping is not None:
                yield (v.stopping.until_ms, gpus)
                continue
            who = (v.owner, v.priority if is_allocated(v) else -1)
            ok = memo.get(who)
            if ok is None:
                ok = memo[who] = self.may_preempt(c, v, subtrees)
            yield (preemptible_from(v, t) if ok else _NEVER, gpus)
        for v, gpus in self.added.get(name, ()):
            ok = self.may_preempt(c, v, subtrees)
            yield (protected_until(t, v.min_runtime_ms) if ok else _NEVER, gpus)

    def _release_floors(self, key: tuple[str, int]) -> list[tuple[int, str]]:
        """``(floor, node)`` for the nodes of pool ``key``, sorted: the floor is the
        latest end of a protection or notice among the runs on the node (the cycle's
        time if later), so no GPU of the node comes free or preemptible for anyone
        before it. Computed on first use, after the node-down and drain steps; runs
        placed later in the cycle only come later, and runs preempted later were
        past their protection, so it stays a lower bound of :meth:`_release_time`
        with ``k=None`` for the rest of the cycle."""
        floors = self._floors.get(key)
        if floors is None:
            t = self.t
            nodes, running, gone = self.state.nodes, self.state.running, self.gone
            floors = []
            for n in self.pool_nodes[key]:
                floor = t
                for wid in nodes[n].workloads:
                    if wid in gone:  # as _gpu_release_times: freed, or stopping with notice
                        end = self.noticed.get(wid, t)
                    else:
                        v = running[wid]
                        stop = v.stopping
                        end = v.protected_until_ms if stop is None else stop.until_ms
                    if end > floor:
                        floor = end
                floors.append((floor, n))
            floors.sort()
            self._floors[key] = floors
        return floors

    def _earliest_whole(
        self,
        c: Workload,
        key: tuple[str, int],
        k: int,
        subtrees: dict[str, None],
        memo: dict[tuple[str, int], bool],
    ) -> list[tuple[int, str]]:
        """``(time the node comes whole for c, node)`` sorted, for at least the ``k``
        earliest nodes of pool ``key`` and every node as early as the ``k``-th: all a
        gang's reservation reads. Nodes are visited by their floor
        (:meth:`_release_floors`) and the visit stops at a floor later than the
        ``k``-th earliest time found, since no node after it can come sooner."""
        kth: list[int] = []  # the k earliest times so far, negated (a max-heap)
        ready: list[tuple[int, str]] = []
        for floor, n in self._release_floors(key):
            if len(kth) == k and floor > -kth[0]:
                break
            at = self._release_time(c, n, subtrees, memo, None)
            ready.append((at, n))
            if len(kth) < k:
                heapq.heappush(kth, -at)
            elif at < -kth[0]:
                heapq.heapreplace(kth, -at)
        ready.sort()
        return ready

    def reserve(self, c: Workload) -> None:
        """Hold for ``c`` the nodes that become free or preemptible for it earliest: for a
        gang of ``k`` nodes, the start is when the ``k``-th node comes whole, and of the
        nodes whole by then it holds the ``k`` that come whole last."""
        g = c.gpus
        subtrees = self.victim_subtrees(c.owner)
        memo: dict[tuple[str, int], bool] = {}
        best: tuple[int, tuple[str, ...]] | None = None
        option: tuple[int, tuple[str, ...]] | None
        for key in self._pools_for(c):
            size = key[1]
            names = self.pool_nodes[key]
            if g <= size:
                first = min(
                    ((self._release_time(c, n, subtrees, memo, g), n) for n in names),
                    default=None,
                )
                option = (first[0], (first[1],)) if first is not None else None
            elif g % size == 0 and len(names) >= g // size:
                k = g // size
                ready = self._earliest_whole(c, key, k, subtrees, memo)
                start = ready[k - 1][0]
                # Of the nodes whole by ``start``, hold those that come whole last: the
                # start is the same, and the nodes that come whole sooner stay usable
                # by protected work until then.
                held = [r for r in ready if r[0] <= start][-k:]
                option = (start, tuple(sorted(n for _, n in held)))
            else:
                option = None
            if option is not None and option[0] < _NEVER and (best is None or option < best):
                best = option
        if best is None or best[0] <= self.t:
            return
        start, nodes = best
        self.reservation = Reservation(workload=c.id, nodes=nodes, start_ms=start)
        for n in nodes:
            self.reserved[n] = start

    # -- steps 3 and 4 --------------------------------------------------------
    def _try(self, w: Workload) -> bool:
        """Place ``w`` (allocated ones may preempt); False if it stays pending.

        A failure is remembered per owner (allocated work only: unallocated work
        never preempts, so its owner does not matter), GPU type, contract kind
        and reservation gate: a later workload there with no higher priority and at
        least as many GPUs, which no pool takes that could not take the failed
        one's, fails too (:meth:`_pools_taking`), as long as no preemption freed
        GPUs and the owner's victim subtrees are the same (placements only take
        GPUs away; a reservation only restricts), so it is skipped without a
        search. When every pool was short before the subtrees were needed
        (:meth:`_pool_short`), the failure holds while no ratio and no victim
        changed either."""
        waiting = self.waiting_for.get(w.id)
        if waiting is not None:
            return self._try_waiting(w, waiting)
        allocated = is_allocated(w)
        failed = self.failed.get(self._shape(w, allocated))
        if (
            failed is not None
            and failed[0] == self.freed
            and w.priority <= failed[2]
            and w.gpus >= failed[3]
            and self._still_fails(w, allocated, failed[1])
            and self._rules_out(failed[4], w.gpu_type, w.gpus)
        ):
            return False
        found = self._find(w)
        if found is not None and self.to_reserve is not None:
            self._settle_reservation()
            if any(not self._may_use(w, name) for name, _ in found[1]):
                found = self._find(w)  # again, now that reserved nodes are gated
        if found is None:
            shape = self._shape(w, allocated)
            depends: object = None
            if allocated:
                if w.owner in self._subtrees:
                    depends = self.victim_subtrees(w.owner)
                else:  # every pool was short before its subtrees were needed
                    depends = (self.charges, self.victim_changes)
            taking = self._pools_taking(w.gpu_type, w.gpus)
            self.failed[shape] = (self.freed, depends, w.priority, w.gpus, taking)
            if allocated and self.walk is not None:
                self._doom(w, shape[3])
            return False
        victims, slots = found
        notice = 0
        for v in victims:
            notice += self._preempt(v, "fairshare" if is_allocated(v) else "unallocated", w.id)
        if notice:  # it is placed once they stop; until then nothing else goes there
            for name, _ in slots:
                self.held[name] = w.id
            return False
        self._place(w, slots)
        return True

    def _still_fails(self, w: Workload, allocated: bool, depends: object) -> bool:
        """Whether what a remembered failure of ``w``'s shape depended on is unchanged."""
        if not allocated:
            return depends is None
        if type(depends) is tuple:
            return depends == (self.charges, self.victim_changes)
        return depends is self.victim_subtrees(w.owner)

    def _pools_taking(self, gpu_type: str, gpus: int) -> frozenset[Pool]:
        """The pools a request of ``gpus`` GPUs of ``gpu_type`` could be placed in at
        all: one node's worth or less, or whole nodes. On those, more GPUs fail where
        fewer failed; a pool that takes a larger request but not a smaller one (two
        whole 4-GPU nodes for 8 GPUs, none for 6) is not ruled out by the smaller
        one's failure."""
        key = (gpu_type, gpus)
        taking = self._taking.get(key)
        if taking is None:
            every = self._every_pool.get(gpu_type)
            if every is None:
                every = self._every_pool[gpu_type] = frozenset(self.gpus.pools_for(gpu_type))
            taking = frozenset(p for p in every if gpus <= p[1] or gpus % p[1] == 0)
            if taking == every:
                taking = every  # the same object: :meth:`_rules_out` checks it first
            self._taking[key] = taking
        return taking

    def _rules_out(self, failed_in: frozenset[Pool], gpu_type: str, gpus: int) -> bool:
        """Whether a failure whose request the pools ``failed_in`` took rules out a
        larger request of ``gpus`` GPUs of ``gpu_type`` (every pool taking it took
        the failed one)."""
        return failed_in is self._every_pool.get(gpu_type) or failed_in.issuperset(
            self._pools_taking(gpu_type, gpus)
        )

    def _try_waiting(self, w: Workload, stopping: list[Workload]) -> bool:
        """``w`` has runs stopping with notice for it: it does not preempt again while
        they stop. It is placed if it fits now; otherwise the nodes where it fits once
        they have stopped are held for it (no other work goes there this cycle)."""
        slots = self.fit(w)
        if slots is not None and self.to_reserve is not None:
            self._settle_reservation()
            if any(not self._may_use(w, name) for name, _ in slots):
                slots = self.fit(w)
        if slots is not None:
            self._place(w, slots)
            return True
        extra: dict[str, int] = {}
        for v in stopping:
            if v.id not in self.gone:  # else lost with its node: its GPUs are free already
                for slot in v.placement:
                    extra[slot.node] = extra.get(slot.node, 0) + slot.gpus
        for name in sorted(extra):
            self.gpus.set(name, self.free[name] + extra[name])
        slots = self.fit(w)
        for name in sorted(extra):
            self.gpus.set(name, self.free[name] - extra[name])
        for name, _ in slots or ():
            self.held[name] = w.id
        return False

    def _shape(self, w: Workload, allocated: bool) -> tuple[str, str, bool, bool]:
        """What a failure to place depends on besides GPUs and priority: the owner
        (allocated work only), the GPU type, the contract kind, and whether the
        reservation gate lets ``w`` on reserved nodes (no reservation: it does)."""
        r = self.reservation
        gate = r is None or may_use_reserved(self.t, w.min_runtime_ms, r.start_ms)
        return (w.owner if allocated else "", w.gpu_type, allocated, gate)

    # The same rule for the rest of a leaf's queue, without visiting it: once
    # ``w`` failed, its leaf's later workloads (no higher priority: the leaf's
    # order) of the same GPU type and gate with at least as many GPUs fail too
    # while no preemption freed GPUs and the leaf's victim subtrees stay; the
    # walk passes over them by shape (:meth:`FairShareWalk.skip_doomed`).
    def _epoch(self, leaf: str) -> object:
        """A token for "no preemption since, same victim subtrees" for ``leaf``."""
        subtrees = self.victim_subtrees(leaf)
        cached = self._epochs.get(leaf)
        if cached is not None and cached[0] == self.freed and cached[1] is subtrees:
            return cached[2]
        token = object()
        self._epochs[leaf] = (self.freed, subtrees, token)
        return token

    def _doom(self, w: Workload, gate: bool) -> None:
        assert self.walk is not None
        if self.walk.left_in_leaf(w.owner) < _DOOM_FROM:
            return  # a short queue: the per-workload memo of :meth:`_try` is cheaper
        if self._holds(w.owner):
            return  # a workload there may use nodes held for it, which ``w`` may not
        token = self._epoch(w.owner)
        key = (w.owner, w.gpu_type, gate)
        prev = self.doomed.get(key)
        least, cap = w.gpus, _NEVER
        if prev is not None and prev[0] is token:
            least, cap = min(prev[1], w.gpus), prev[3]
        most, smallest = self._most_obtainable(w)
        if most < smallest:
            # no node can be had whole: neither a gang nor a request for more than
            # ``most`` GPUs on one node can be placed, in any pool (free GPUs only
            # get fewer)
            cap = min(cap, most + 1)
        self.doomed[key] = (token, least, self._pools_taking(w.gpu_type, least), cap)
        self.walk.skip_doomed(w.owner, self._is_doomed)

    def _most_obtainable(self, c: Workload) -> tuple[int, int]:
        """An upper bound of the GPUs ``c`` could have on any one node it may use (free,
        unallocated, and expired work of its leaf and of the subtrees it outranks),
        and the smallest node size of its pools."""
        subtrees = self.victim_subtrees(c.owner)
        free, unalloc = self.free, self.node_unalloc
        most, smallest = 0, _NEVER
        for key in self._pools_for(c):
            smallest = min(smallest, key[1])
            for room, n in self._roomy_nodes(key):
                if self._may_use(c, n):
                    most = max(most, -room)
                    break
            for n, gpus in self._expired_on(c.owner, key, subtrees).items():
                if self._may_use(c, n):
                    most = max(most, free[n] + unalloc.get(n, 0) + gpus)
        return most, smallest

    def _holds(self, leaf: str) -> bool:
        """Whether a workload of ``leaf`` has nodes held for it (runs stopping for it)."""
        if not self.held:
            return False
        cached = self._holder_leaves
        if cached is None or cached[0] != len(self.held):  # ``held`` only grows in a cycle
            pending = self.state.pending
            owners = {pending[w].owner for w in self.held.values() if w in pending}
            cached = self._holder_leaves = (len(self.held), owners)
        return leaf in cached[1]

    def _is_doomed(self, leaf: str, shape: Shape) -> object:
        """The epoch token if ``leaf``'s workloads of ``shape`` cannot be placed, else None."""
        gpu_type, gpus, min_runtime = shape
        r = self.reservation
        gate = r is None or may_use_reserved(self.t, min_runtime, r.start_ms)
        doomed = self.doomed.get((leaf, gpu_type, gate))
        if doomed is None or gpus < doomed[1]:
            return None
        if gpus < doomed[3] and not self._rules_out(doomed[2], gpu_type, gpus):
            return None  # a pool takes it that the smallest failure could not use
        token = self._epoch(leaf)
        return token if doomed[0] is token else None

    # Whole subtrees of the budget tree at once: while workloads fail (so after the
    # first failure, which the reservation is for), the walk passes over a budget node
    # whose pending work all fails now: for each GPU type, its smallest request
    # exceeds :meth:`_room` in every pool of the type (no fit either: free GPUs are
    # part of the room). Nothing changes while they fail, so the walk would have
    # visited them one after another with the same outcome.
    def _prunable(self, path: str) -> bool:
        """Whether none of the pending workloads under budget node ``path`` can be
        placed now (:class:`~apportion.core.ordering.FairShareWalk` then passes over
        them); rechecked only after a placement, a preemption or a victim change."""
        if not self.failing:
            return False  # (also before the first failure) work is being placed: try it
        epoch = (self.freed, self.victim_changes, self.charges)
        if self._not_pruned.get(path) == epoch:
            return False
        self._not_pruned[path] = epoch
        if path in self._waiting_paths():
            return False  # a workload with runs stopping for it takes its own path
        self._index_victims()
        pool_free, pool_unalloc = self.pool_free, self.pool_unalloc
        for gpu_type, gpus in self._smallest_requests(path).items():
            for key in self.gpus.pools_for(gpu_type):
                if pool_free.get(key, 0) + pool_unalloc.get(key, 0) >= gpus:
                    return False  # (the room starts there: no need to go down the path)
                if self._room(path, key, gpus) >= gpus:
                    return False
        self.pruned.append(path)
        return True

    def _smallest_requests(self, path: str) -> dict[str, int]:
        """Per GPU type, the fewest GPUs any pending allocated workload under ``path``
        asks for (those already walked included: a bound): a leaf's from its
        shapes, a budget node's from its children's with pending work below; each
        computed once per cycle."""
        smallest = self._smallest.get(path)
        if smallest is None:
            walk = self.walk
            assert walk is not None
            smallest = {}
            shapes = walk.shapes.get(path) if path in walk.queues else None
            if shapes is not None:
                for gpu_type, gpus, _ in shapes:
                    if gpus < smallest.get(gpu_type, _NEVER):
                        smallest[gpu_type] = gpus
            else:
                for child in walk.live.get(path, ()):
                    for gpu_type, gpus in self._smallest_requests(child).items():
                        if gpus < smallest.get(gpu_type, _NEVER):
                            smallest[gpu_type] = gpus
            self._smallest[path] = smallest
        return smallest

    def _waiting_paths(self) -> set[str]:
        """Budget nodes above (and the leaves of) workloads with runs stopping for them."""
        if self._waiting is None:
            pending = self.state.pending
            self._waiting = set()
            for wid in self.waiting_for:
                w = pending.get(wid)
                if w is not None:
                    self._waiting.update((*ancestors_of(w.owner), w.owner))
        return self._waiting

    def _find(self, w: Workload) -> tuple[list[Workload], Slots] | None:
        """Where ``w`` goes and whom it preempts for that: a fit, else (allocated work
        only) the cheapest victim set; ``None`` if neither."""
        slots = self.fit(w)
        if slots is not None:
            return [], slots
        if is_allocated(w):
            return self.preemption(w)
        return None

    def _schedule_allocated(self) -> None:
        walk = FairShareWalk(self.state, self.view, self.usage, self.requeued)
        self.walk = walk if self.skip_doomed else None
        if self.skip_doomed:
            walk.prune = self._prunable
        for w in walk:
            if self._try(w):
                self._charge(walk, w)
                self.failing = False
                continue
            self.failing = True
            if not self.blocked:
                self.blocked = True
                if self.state.policy.reservations:
                    self.to_reserve = w

    def _charge(self, walk: FairShareWalk, w: Workload) -> None:
        """Add ``w``'s projected charge (``walk`` re-ranks; ``self.usage`` is its working
        usage) and note which families' ratios changed, for :meth:`victim_subtrees`."""
        walk.charge(w)
        self.charges += 1
        families = self.family_charges
        for p in self._path(w.owner):
            family = parent_of(p)
            families[family] = families.get(family, 0) + 1

    def _settle_reservation(self) -> None:
        """Compute the reservation owed to the first blocked workload, if not yet done.

        Called before the first placement after the block (and at the end of
        the cycle when asked): until then only failures happened, which change
        nothing, so the result is what it would have been at the block."""
        if self.to_reserve is not None:
            w, self.to_reserve = self.to_reserve, None
            self.reserve(w)

    def _schedule_unallocated(self) -> None:
        """Unallocated work by submit time, then id, while any GPU is free.

        It never preempts, so GPUs only get fewer: once ``g`` GPUs of a type did
        not fit, no request of that type for ``g`` or more will, unless a pool
        takes it that could not take ``g`` (the same rule as :meth:`_try`'s memo,
        checked here without a call per workload)."""
        if not any(self.pool_free.values()):
            return
        pending = self.state.pending
        keys: Iterable[FreeKey] = self.state.pending_index.free
        requeued = {w.id: w for w in self.requeued if not is_allocated(w)}
        if requeued:
            keys = heapq.merge(keys, sorted(free_key(w) for w in requeued.values()))
        # fewest GPUs of a type that failed where every pool of the type took them (the
        # usual case, checked first: once per workload of a long queue), and where
        # only some did (nodes of several sizes; see :meth:`_pools_taking`)
        failed_everywhere: dict[str, int] = {}
        failed_partly: dict[str, tuple[int, frozenset[Pool]]] = {}
        for _, wid in keys:
            w = pending.get(wid) or requeued[wid]
            failed = failed_everywhere.get(w.gpu_type)
            if failed is not None and w.gpus >= failed:
                continue
            if failed_partly:
                partly = failed_partly.get(w.gpu_type)
                if (
                    partly is not None
                    and w.gpus >= partly[0]
                    and self._rules_out(partly[1], w.gpu_type, w.gpus)
                ):
                    continue
            if self._try(w):
                if not any(self.pool_free.values()):
                    return
                continue
            taking = self._pools_taking(w.gpu_type, w.gpus)
            if taking is self._every_pool[w.gpu_type]:
                if failed is None or w.gpus < failed:
                    failed_everywhere[w.gpu_type] = w.gpus
                if w.gpu_type == ANY_GPU_TYPE and w.gpus == 1:
                    return  # not one GPU free anywhere that this cycle may use
            else:
                partly = failed_partly.get(w.gpu_type)
                if partly is None or w.gpus < partly[0]:
                    failed_partly[w.gpu_type] = (w.gpus, taking)

    # -- next wake-up -----------------------------------------------------------
    def _next_wakeup(self) -> int | None:
        """The earliest future protection expiry that could change a decision (on a
        draining node, or anywhere while allocated work waits), the reservation start,
        or the end of a preemption notice (always: the fold ends the stop there)."""
        t = self.t
        waiting = self.blocked or any(
            r == "fairshare" and is_allocated(self.state.running[w]) for w, r in self.gone.items()
        )
        out = self.reservation.start_ms if self.reservation else None
        if waiting:
            watched: Iterable[Workload] = self.state.running.values()
        else:  # only protections on draining nodes can change a decision
            running = self.state.running
            watched = [
                running[wid] for n in self.draining_nodes for wid in self.state.nodes[n].workloads
            ]
        for w in protected(watched, t):
            if w.id in self.gone:
                continue
            if out is None or w.protected_until_ms < out:
                out = w.protected_until_ms
        # runs stopping with notice end at their deadline (the fold ends them there)
        ends = list(self.noticed.values())
        ends += [u for u, wid in self.state.stop_deadlines if wid not in self.gone][:1]
        for until in ends:
            if out is None or until < out:
                out = until
        if waiting:
            for entries in self.added.values():
                for v, _ in entries:
                    end = protected_until(t, v.min_runtime_ms)
                    if is_allocated(v) and (out is None or end < out):
                        out = end
        return out
