"""One cycle, assembled: :class:`Cycle` wires the steps and the shortcuts over one
:class:`~.scratch.Scratch`, and :meth:`Cycle.run` takes the steps of docs/cycle.md
in order."""

from __future__ import annotations

from collections.abc import Callable

from ..state import State
from .allocated import place_allocated
from .attempt import Attempt
from .doomed import DoomedShapes
from .floors import WholeNodes
from .memo import FailureMemo
from .nodes import drain, lose_down_nodes
from .poolbound import PoolBound
from .preemption import Preemption
from .prune import Pruning
from .rejections import reject_inputs
from .reports import report_usage
from .reservation import Reserver
from .result import CycleResult
from .roomy import RoomyNodes
from .scratch import Scratch
from .subtrees import CycleOutranking
from .unallocated import place_unallocated
from .wakeup import next_wakeup


class Cycle:
    """One scheduling cycle over ``state`` (read only).

    ``skip_doomed=False`` walks step 3 without passing over doomed shapes and whole
    budget nodes (:mod:`.doomed`, :mod:`.prune`); ``roomy``, ``pool_bound``,
    ``whole_nodes`` and ``outranking`` choose the implementations of the other
    shortcuts (tests pass checked and plain variants). The decisions are the same
    either way."""

    def __init__(
        self,
        state: State,
        skip_doomed: bool = True,
        *,
        roomy: Callable[[Scratch], RoomyNodes] = RoomyNodes,
        pool_bound: Callable[[Scratch], PoolBound] = PoolBound,
        whole_nodes: Callable[[Scratch, Reserver], WholeNodes] = WholeNodes,
        outranking: Callable[[Scratch], CycleOutranking] = CycleOutranking,
    ) -> None:
        s = self.scratch = Scratch(state, roomy, outranking)
        self.memo = FailureMemo(s)
        self.pool_bound = pool_bound(s)
        self.preemption = Preemption(s, self.pool_bound)
        self.reserver = Reserver(s, whole_nodes)
        self.doomed = DoomedShapes(s, self.memo)
        self.pruning = Pruning(s, self.pool_bound)
        self.attempt = Attempt(s, self.memo, self.preemption, self.reserver, self.doomed)
        self.skip_doomed = skip_doomed

    def run(self, report_reservation: bool = False) -> CycleResult:
        s = self.scratch
        reject_inputs(s)  # 0. rejected inputs
        report_usage(s)  # 0b. usage intervals ended, for the peers
        lose_down_nodes(s)  # 1. down nodes
        drain(s)  # 2. draining nodes
        # 3. allocated work in fair-share order: fit / preempt / reserve
        place_allocated(s, self.attempt, self.pruning if self.skip_doomed else None)
        place_unallocated(s, self.attempt, self.memo)  # 4. unallocated work
        if report_reservation:
            self.reserver.settle()
        return CycleResult(
            decisions=tuple(s.decisions),
            next_wakeup_ms=next_wakeup(s),  # then the next wake-up
            reservation=s.reservation,
        )
