"""What lives for one cycle: the :class:`Scratch` every step reads and writes.

A cycle never changes ``state``: it works on a scratch copy of the free GPUs
and keeps, beside it, whom it moved, what it placed and held, the reservation,
its working usage (with the projected charges of its placements) and the
decisions it emits. The victim index (:mod:`.victims`), the per-pool lists of
roomy nodes (:mod:`.roomy`) and the outranking caches (:mod:`.subtrees`) live
here too, because every change of the free GPUs or of the running work has to
reach them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from apportion.schemas.events import Decision, Slot, WorkloadPlaced, WorkloadPreempted

from ..nodeindex import Pool
from ..ordering import FairShareView, FairShareWalk
from ..placement import FreeGPUs, Slots
from ..rules.contract import (
    effective_grace,
    is_allocated,
    is_protected,
    may_use_reserved,
    protected_until,
)
from ..rules.outranking import held_to_margin
from ..state import State, Workload
from .result import Reservation
from .roomy import RoomyNodes
from .subtrees import CycleOutranking
from .victims import VictimIndex

NEVER = 1 << 62
"""A release time that is not known (work that only ends when it finishes)."""


class Scratch:
    """Scratch state of one cycle. Reads ``state``, writes only its own fields."""

    def __init__(
        self,
        state: State,
        roomy: Callable[[Scratch], RoomyNodes] = RoomyNodes,
        outranking: Callable[..., CycleOutranking] = CycleOutranking,
    ) -> None:
        self.state = state
        self.t = state.now_ms
        self.decisions: list[Decision] = []
        self.view = FairShareView(state)
        self.usage = self.view.working()  # working usage, with projected charges
        index = state.node_index
        self.gpus = FreeGPUs(state)  # free GPUs as this cycle changes them
        self.free = self.gpus.free  # per node (read only: change with set_free)
        self.pool_free = self.gpus.pool_free  # read only
        self.pool_nodes = self.gpus.pool_nodes  # read only
        self.down_nodes = index.down  # read only
        self.draining_nodes = index.draining  # read only
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
        self.walk: FairShareWalk | None = None  # step 3's walk, when it skips (shortcuts)
        self._pool_sets: dict[Pool, frozenset[str]] = {}
        policy = state.policy
        self.outranking = outranking(self)
        """The outranking rule with the policy's margin (every candidate's when the
        margin has no wait)."""
        self.outranking_waited = self.outranking
        """The rule for candidates no longer held to the margin: without it, when the
        margin has a wait (:meth:`outranking_for`); the loosest rule any candidate
        of this cycle gets, so bounds (:mod:`.poolbound`) use it."""
        if policy.preemption_margin_ppm and policy.margin_wait_ms:
            self.outranking_waited = outranking(self, 0)
        self.victims = VictimIndex(self)
        self.roomy = roomy(self)

    def emit(self, kind: type, **fields: object) -> None:
        n = self.state.decisions_folded + len(self.decisions) + 1
        self.decisions.append(kind(id=f"d{n}", at_ms=self.t, **fields))

    # -- reading ----------------------------------------------------------
    @property
    def buckets(self) -> dict[Pool, dict[int, list[str]]]:
        """Healthy nodes by pool and free GPUs as this cycle changes them (read only;
        tests/replay/test_audit.py reads it to break best-fit ties the wrong way)."""
        return self.gpus.buckets

    def pools_for(self, w: Workload) -> list[Pool]:
        return self.gpus.pools_for(w.gpu_type)

    def pool_set(self, key: Pool) -> frozenset[str]:
        """The nodes of pool ``key``, as a set (cached)."""
        pool = self._pool_sets.get(key)
        if pool is None:
            pool = self._pool_sets[key] = frozenset(self.pool_nodes[key])
        return pool

    def outranking_for(self, c: Workload) -> CycleOutranking:
        """The outranking rule candidate ``c`` gets: with the margin while it is held
        to it (:func:`~apportion.core.rules.outranking.held_to_margin`), else without."""
        if self.outranking_waited is self.outranking or held_to_margin(
            self.state.policy, c, self.t
        ):
            return self.outranking
        return self.outranking_waited

    def charged(self, leaf: str) -> None:
        """A projected charge went to ``leaf``'s path: both rules see it (:mod:`.subtrees`)."""
        self.outranking.charged(leaf)
        if self.outranking_waited is not self.outranking:
            self.outranking_waited.charged(leaf)

    def may_use(self, w: Workload, name: str) -> bool:
        """The reservation gate on node ``name`` (:func:`~apportion.core.rules.contract.may_use_reserved`)."""
        held = self.held.get(name)
        if held is not None and held != w.id:
            return False
        start = self.reserved.get(name)
        return start is None or may_use_reserved(self.t, w.min_runtime_ms, start)

    def fit(self, w: Workload) -> Slots | None:
        """Step 3a (and 4): where ``w`` fits now
        (:meth:`~apportion.core.placement.FreeGPUs.fit`) on the nodes the
        reservation gate lets it use."""
        gate = partial(self.may_use, w) if self.reserved or self.held else None
        return self.gpus.fit(w.gpus, w.gpu_type, gate)

    # -- changing ---------------------------------------------------------
    def set_free(self, name: str, free: int) -> None:
        before = self.free[name]
        self.gpus.set(name, free)
        self.roomy.changed(name, before + self.victims.node_unalloc.get(name, 0), free - before)

    def preempt(
        self, w: Workload, reason: str, for_workload: str | None, requeue_now: bool = False
    ) -> int:
        """Preempt ``w``; returns the notice given (its GPUs stay taken meanwhile)."""
        self.gone[w.id] = reason
        if self.victims.ready and w.stopping is None and not is_protected(w, self.t):
            self.victims.count(w, -1)
        self.freed += 1
        grace = 0
        if reason != "node_down" and w.stopping is None:
            grace = effective_grace(w.grace_ms, self.state.policy.grace_ms)
        if grace:
            self.noticed[w.id] = self.t + grace
        else:
            for slot in w.placement:
                self.set_free(slot.node, self.free[slot.node] + slot.gpus)
        self.emit(
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

    def place(self, w: Workload, slots: Slots) -> None:
        for name, gpus in slots:
            self.set_free(name, self.free[name] - gpus)
            self.added.setdefault(name, []).append((w, gpus))
        self.emit(
            WorkloadPlaced,
            workload=w.id,
            placement=tuple(Slot(name, gpus) for name, gpus in slots),
            allocated=is_allocated(w),
            protected_until_ms=protected_until(self.t, w.min_runtime_ms),
            attempt=w.attempt + 1,
        )
