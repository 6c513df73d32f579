"""Step 3: allocated work in fair-share order, each workload fit / preempt / reserve.

The walk (:class:`~apportion.core.ordering.FairShareWalk`) recomputes the order
as the cycle goes: each placement adds its projected charge
``gpus * min_runtime`` to its path before the next workload is ranked, so one
under-served team cannot sweep every free GPU in one cycle. Each workload gets
:meth:`~.attempt.Attempt.place` (a. fit, b. preempt); the first that cannot be
placed is owed the reservation (c., :mod:`.reservation`), computed when it
first matters. Work requeued by steps 1-2 joins the walk.

With the shortcuts on, the walk passes over shapes of a leaf that cannot be
placed (:mod:`.doomed`) and over whole budget nodes (:mod:`.prune`); the
decisions are the same without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ordering import FairShareWalk
from ..state import Workload
from .attempt import Attempt
from .prune import Pruning

if TYPE_CHECKING:
    from .scratch import Scratch


def place_allocated(s: Scratch, attempt: Attempt, pruning: Pruning | None) -> None:
    """Step 3 over every pending allocated workload (module docstring); ``pruning``
    ``None`` walks without the shortcuts."""
    walk = FairShareWalk(s.state, s.view, s.usage, s.requeued)
    if pruning is not None:
        s.walk = walk
        walk.prune = pruning.prunable
    place = attempt.place
    reservations = s.state.policy.reservations
    for w in walk:
        if place(w):
            charge(s, walk, w)
            s.failing = False
            continue
        s.failing = True
        if not s.blocked:
            s.blocked = True
            if reservations:
                s.to_reserve = w


def charge(s: Scratch, walk: FairShareWalk, w: Workload) -> None:
    """Add ``w``'s projected charge (``walk`` re-ranks; ``s.usage`` is its working
    usage) and note which families' ratios changed (:mod:`.subtrees`)."""
    walk.charge(w)
    s.charged(w.owner)
