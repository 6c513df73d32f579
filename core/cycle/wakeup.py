"""After the steps: the next wake-up.

The earliest future time at which a decision could change with no new input:
a protection expiry on a draining node, or anywhere while allocated work waits
(blocked, or a fair-share victim waiting to be replaced; work placed in this
cycle included); the reservation start; the end of a preemption notice (always:
the fold ends the stop there); while allocated work is blocked, the moment
the next waiting workload stops being held to the preemption margin (its rule
changes then, :func:`~apportion.core.rules.outranking.held_to_margin`); the end
of the usage interval being counted, while the cluster reports usage to peers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..rules.contract import is_allocated, protected, protected_until
from ..rules.federation import next_report_ms
from ..state import Workload

if TYPE_CHECKING:
    from .scratch import Scratch


def next_wakeup(s: Scratch) -> int | None:
    """The next wake-up (module docstring); ``None`` if none."""
    t = s.t
    state = s.state
    waiting = s.blocked or any(
        r == "fairshare" and is_allocated(state.running[w]) for w, r in s.gone.items()
    )
    out = next_report_ms(state, t)  # the usage interval being counted ends
    if s.reservation and (out is None or s.reservation.start_ms < out):
        out = s.reservation.start_ms
    if waiting:
        watched: Iterable[Workload] = state.running.values()
    else:  # only protections on draining nodes can change a decision
        running = state.running
        watched = [running[wid] for n in s.draining_nodes for wid in state.nodes[n].workloads]
    for w in protected(watched, t):
        if w.id in s.gone:
            continue
        if out is None or w.protected_until_ms < out:
            out = w.protected_until_ms
    # runs stopping with notice end at their deadline (the fold ends them there)
    ends = list(s.noticed.values())
    ends += [u for u, wid in state.stop_deadlines if wid not in s.gone][:1]
    for until in ends:
        if out is None or until < out:
            out = until
    if s.blocked and s.outranking_waited is not s.outranking:
        wait = state.policy.margin_wait_ms
        for w in state.pending.values():
            end = w.queued_ms + wait
            if end > t and is_allocated(w) and not w.held and (out is None or end < out):
                out = end
    if waiting:
        for entries in s.added.values():
            for v, _ in entries:
                end = protected_until(t, v.min_runtime_ms)
                if is_allocated(v) and (out is None or end < out):
                    out = end
    return out
