"""Start-time estimates: when each pending workload starts if nothing new arrives.

:func:`estimate_starts` simulates the cluster forward on a copy of the state with
the real cycle (:func:`~apportion.core.cycle.step`), exactly as the simulator
drives it, but with **no new input**: no submission, cancel, health change or
budget edit. Time moves only to what is already known:

- the **known end** of a running workload: ``started + duration - progress``
  from its ``duration_ms`` hint (a run overdue is taken to end at once); a run
  without a hint never ends, as far as the estimate knows; a run stopping after
  a preemption with notice ends by its deadline at the latest;
- the **next wake-up** of the last cycle (a protection expiry, a reservation
  start) and of every simulated cycle after it;
- the known ends of the work the simulation itself places.

At each such time the finishes are folded (as ``WorkloadFinished`` from the
host's agent) or a ``ClockTicked``, then one cycle runs, so protections,
reservations, preemption and each workload's rank in the fair-share order all
play as they would live. A workload's estimate is the time of its first
placement in the simulation. The simulation stops once every asked-for
workload is placed, when nothing known is left to happen (the others wait on
work with no known end: no estimate), or at ``horizon_ms`` after now or
``max_cycles`` cycles (no estimate: "not within the horizon").

Cost: one state copy plus at most ``max_cycles`` cycles (each as costly as a
live scheduling cycle); callers cache the result per state (the gateway does).
Pure and deterministic: same state and arguments, same estimates.
"""

from __future__ import annotations

import heapq

import msgspec
from apportion.schemas.events import (
    DAY_MS,
    ClockTicked,
    Input,
    WorkloadPlaced,
)

from .cycle import step
from .fold import apply
from .rules.authority import run_ended
from .state import State

DEFAULT_HORIZON_MS = 7 * DAY_MS
"""How far ahead the simulation looks (a week: the default lookback window)."""
DEFAULT_MAX_CYCLES = 400
"""How many simulated cycles at most."""

ASSUMPTION = (
    "if nothing new arrives: no new submission, cancel or health change, and running "
    "work ends exactly when its duration hint says (work without one runs until the "
    "horizon)"
)
"""The assumption every estimate rests on, as shown to users."""

_FINISH = 0
_TICK = 1


class Estimates(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`estimate_starts` found."""

    at_ms: int
    """The state's time, where the simulation began."""
    starts: dict[str, int]
    """Pending workload -> estimated start (epoch ms, ``>= at_ms``)."""
    ends: dict[str, int]
    """Running workload with a duration hint -> its known end (``>= at_ms``)."""
    horizon_ms: int
    """The simulation covered ``[at_ms, horizon_ms]``: a workload without a start
    was not placed by then."""
    exhausted: bool
    """Nothing known was left to happen: a pending workload without a start waits
    on work with no known end (or can never fit)."""
    cycles: int
    """Simulated cycles (the cost)."""
    reached_ms: int = 0
    """The simulated time reached (the last cycle's)."""

    def why_unknown(self, workload: str) -> str:
        """Why ``workload`` has no estimate (when it has none), for people."""
        if self.exhausted:
            return "no estimate: it waits on running work whose end is not known (no duration)"
        return (
            f"no estimate: it does not start within the estimate's horizon ({self.cycles} "
            f"simulated cycles, {(self.reached_ms - self.at_ms) // 60_000} min ahead)"
        )


def known_end(started_ms: int, duration_ms: int | None, run_ms: int) -> int | None:
    """When a run placed at ``started_ms`` ends from its duration hint (``None``: unknown)."""
    if duration_ms is None:
        return None
    return started_ms + max(0, duration_ms - run_ms)


def estimate_starts(
    state: State,
    *,
    next_wakeup_ms: int | None = None,
    decided: bool = True,
    only: str | None = None,
    horizon_ms: int = DEFAULT_HORIZON_MS,
    max_cycles: int = DEFAULT_MAX_CYCLES,
    copy: bool = True,
) -> Estimates:
    """Estimated start of every pending workload of ``state`` (or only of ``only``).

    ``decided``: the state is right after a scheduling cycle (a reader at a batch
    boundary), whose ``next_wakeup_ms`` is given; the next cycle runs at the next
    known event. ``decided=False``: inputs were folded that no cycle has seen yet,
    so a cycle runs at ``state.now_ms`` first. ``state`` is not changed, unless
    ``copy=False`` (the caller hands over a copy of its own, e.g. to simulate in
    another thread).
    """
    t0 = state.now_ms
    ends: dict[str, int] = {}
    for w in state.running.values():
        end = known_end(w.started_ms, w.duration_ms, w.run_ms)
        if w.stopping is not None:  # preempted with notice: it ends by the deadline
            end = w.stopping.until_ms if end is None else min(end, w.stopping.until_ms)
        if end is not None:
            ends[w.id] = max(t0, end)
    limit = t0 + horizon_ms
    wanted = {only} if only is not None else set(state.pending)
    wanted &= {wid for wid, w in state.pending.items() if not w.held}  # held: never starts
    if not wanted:
        return Estimates(at_ms=t0, starts={}, ends=ends, horizon_ms=limit, exhausted=True, cycles=0)
    sim = state.copy() if copy else state
    heap: list[tuple[int, int, int, tuple[str, int] | None]] = []
    counter = 0
    for wid in sorted(ends):
        counter += 1
        heap.append((ends[wid], _FINISH, counter, (wid, sim.running[wid].attempt)))
    heapq.heapify(heap)
    wakeups: set[int] = set()
    starts: dict[str, int] = {}
    cycles = 0
    reached = t0

    def push_tick(at: int) -> None:
        nonlocal counter
        if at not in wakeups:
            wakeups.add(at)
            counter += 1
            heapq.heappush(heap, (at, _TICK, counter, None))

    def cycle(t: int) -> None:
        nonlocal cycles, counter, reached
        cycles += 1
        reached = t
        result = step(sim)
        for d in result.decisions:
            if not isinstance(d, WorkloadPlaced):
                continue
            if d.workload in wanted and d.workload not in starts:
                starts[d.workload] = t
            w = sim.running.get(d.workload)
            if w is not None:
                end = known_end(t, w.duration_ms, w.run_ms)
                if end is not None:
                    counter += 1
                    heapq.heappush(heap, (end, _FINISH, counter, (w.id, w.attempt)))
        nxt = result.next_wakeup_ms
        if nxt is not None and nxt > t:
            push_tick(nxt)

    if decided:
        if next_wakeup_ms is not None:
            push_tick(max(t0, next_wakeup_ms))
    else:
        cycle(t0)
    while heap and len(starts) < len(wanted) and cycles < max_cycles:
        t = heap[0][0]
        if t > limit:
            break
        inputs: list[Input] = []
        ticked = False
        while heap and heap[0][0] == t:
            _, kind, _, payload = heapq.heappop(heap)
            if kind == _TICK:
                ticked = True
                continue
            assert payload is not None
            wid, attempt = payload
            ended = run_ended(sim, wid, attempt, t, f"estimate-finished-{wid}-{attempt}")
            if ended is not None:
                inputs.append(ended)
        if not inputs:
            if not ticked:
                continue
            inputs.append(ClockTicked(id=f"estimate-tick-{t}", at_ms=t))
        for event in inputs:
            sim_apply(sim, event)
        cycle(t)
    return Estimates(
        at_ms=t0,
        starts=starts,
        ends=ends,
        horizon_ms=limit,
        exhausted=not heap and len(starts) < len(wanted),
        cycles=cycles,
        reached_ms=reached,
    )


def sim_apply(state: State, event: Input) -> None:
    """Fold one simulated input (a rejection, which should not happen, is dropped
    so that the next cycle does not announce it)."""
    before = len(state.rejections)
    apply(state, event)
    del state.rejections[before:]
