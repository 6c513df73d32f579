"""Shortcut: a cycle with nothing to decide is not assembled.

When no input waits to be rejected, the cluster reports no usage to peers, no
node is down or draining and no workload is pending (held work aside: no cycle
walks it), every step of docs/cycle.md finds nothing to do: step 0 has no
rejection, 0b no interval, steps 1-2 no node, so nothing is requeued, and steps
3-4 an empty queue. The cycle then emits nothing and holds no reservation, and
its wake-up (:mod:`.wakeup`) is the end of the first notice still running
(``state.stop_deadlines``, sorted; the fold ends the stop there), or none: no
allocated work waits, no node drains and nothing was placed or preempted, so
no protection expiry and no margin wait can change a decision.

:func:`idle` gives that result without building the cycle's scratch (the
fair-share view, the free GPUs, the victim index and the shortcuts' caches). A
lightly loaded cluster spends half its cycles there: on Philly Oct-Nov 2017,
62,697 of 125,118 cycles start with nothing pending.

Guarded by ``tests/cycle/test_cycle_properties.py``: every cycle of its random
histories (submissions, finishes, cancels, notices, drains, nodes down, late
inputs) is also run as the whole cycle (:class:`~.run.Cycle`), which must give
the same result, and the shortcut must have been taken.
"""

from __future__ import annotations

from ..state import State
from .result import CycleResult


def idle(state: State) -> CycleResult | None:
    """The result of a cycle on ``state`` with nothing to decide (module docstring),
    or ``None`` when it may have something."""
    if state.rejections or state.reported_until_ms is not None:
        return None
    nodes = state.node_index
    if nodes.down or nodes.draining:
        return None
    pending = state.pending_index
    if pending.by_leaf or pending.free:
        return None
    stops = state.stop_deadlines
    return CycleResult(decisions=(), next_wakeup_ms=stops[0][0] if stops else None)
