"""One workload's turn (steps 3 and 4): fit, else preempt, else it stays pending.

:meth:`Attempt.place` is called for every workload the walk of step 3 and the
queue of step 4 hand out. It skips a workload a remembered failure rules out
(:mod:`.memo`), computes the reservation owed to the first blocked workload
before the first placement after the block (:meth:`~.reservation.Reserver.settle`),
and places ``w`` or preempts for it: with a notice (grace), the victims keep
their GPUs until their stop deadline and the nodes ``w`` would take are *held*
for it; while runs stop for it, ``w`` does not preempt again
(:meth:`Attempt.place_waiting`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..placement import Slots
from ..rules.contract import is_allocated
from ..state import Workload
from .doomed import DoomedShapes
from .memo import FailureMemo
from .preemption import Preemption
from .reservation import Reserver

if TYPE_CHECKING:
    from .scratch import Scratch


class Attempt:
    """Place one workload, preempting for it if allocated (module docstring)."""

    def __init__(
        self,
        s: Scratch,
        memo: FailureMemo,
        preemption: Preemption,
        reserver: Reserver,
        doomed: DoomedShapes,
    ) -> None:
        self.s = s
        self.memo = memo
        self.preemption = preemption
        self.reserver = reserver
        self.doomed = doomed

    def find(self, w: Workload) -> tuple[list[Workload], Slots] | None:
        """Where ``w`` goes and whom it preempts for that: a fit (step 3a), else
        (allocated work only) the cheapest victim set (step 3b); ``None`` if neither."""
        slots = self.s.fit(w)
        if slots is not None:
            return [], slots
        if is_allocated(w):
            return self.preemption.search(w)
        return None

    def place(self, w: Workload) -> bool:
        """Place ``w`` (allocated ones may preempt); False if it stays pending."""
        s = self.s
        waiting = s.waiting_for.get(w.id)
        if waiting is not None:
            return self.place_waiting(w, waiting)
        allocated = is_allocated(w)
        if self.memo.fails(w, allocated):
            return False
        found = self.find(w)
        if found is not None and s.to_reserve is not None:
            self.reserver.settle()
            if any(not s.may_use(w, name) for name, _ in found[1]):
                found = self.find(w)  # again, now that reserved nodes are gated
        if found is None:
            shape = self.memo.remember(w, allocated)
            if allocated and s.walk is not None:
                self.doomed.doom(w, shape[3])
            return False
        victims, slots = found
        notice = 0
        for v in victims:
            notice += s.preempt(v, "fairshare" if is_allocated(v) else "unallocated", w.id)
        if notice:  # it is placed once they stop; until then nothing else goes there
            for name, _ in slots:
                s.held[name] = w.id
            return False
        s.place(w, slots)
        return True

    def place_waiting(self, w: Workload, stopping: list[Workload]) -> bool:
        """``w`` has runs stopping with notice for it: it does not preempt again while
        they stop. It is placed if it fits now; otherwise the nodes where it fits once
        they have stopped are held for it (no other work goes there this cycle)."""
        s = self.s
        slots = s.fit(w)
        if slots is not None and s.to_reserve is not None:
            self.reserver.settle()
            if any(not s.may_use(w, name) for name, _ in slots):
                slots = s.fit(w)
        if slots is not None:
            s.place(w, slots)
            return True
        extra: dict[str, int] = {}
        for v in stopping:
            if v.id not in s.gone:  # else lost with its node: its GPUs are free already
                for slot in v.placement:
                    extra[slot.node] = extra.get(slot.node, 0) + slot.gpus
        for name in sorted(extra):
            s.gpus.set(name, s.free[name] + extra[name])
        slots = s.fit(w)
        for name in sorted(extra):
            s.gpus.set(name, s.free[name] - extra[name])
        for name, _ in slots or ():
            s.held[name] = w.id
        return False
