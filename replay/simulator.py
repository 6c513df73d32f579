"""The simulator: the real core driven by a virtual clock that jumps from event to event.

Time moves only to the next thing that happens: a submission, a run's end
(its remaining ``duration``), a health change from the health CSV, or the
cycle's ``next_wakeup_ms`` (a protection expiry or a reservation start) - never
by fixed ticks. At each such millisecond the simulator publishes what the
services would (``WorkloadFinished`` for runs that are done, then
``NodeHealthChanged``, then ``WorkloadSubmitted`` in trace order, or a lone
``ClockTicked`` at a wake-up), folds them, runs one scheduling cycle (the budget
scheduler's :func:`~apportion.core.cycle.decide` or the baseline) and feeds the
inputs and the decision batch, in canonical order, to a
:class:`~apportion.replay.projection.Projection`. The projection's folded state
is the scheduler's state: everything is folded once.

Other inputs can be given ready-made (``timed_inputs``: any input event at its
own ``at_ms``, published after the finishes of that millisecond and before the
trace's submissions, in the order given); ``apportion whatif`` re-simulates a
log's submissions, health and budget changes that way. A ``sink`` (for example
:class:`apportion.replay.eventlog.LogWriter`) receives every input and decision
batch in canonical order, as the projection does. The closing ``ClockTicked``
at the end of the horizon is folded with no cycle after it, so every batch in
the history is one the policy computed.

Executor model: a placed workload finishes when its remaining duration has
run; a preempted resumable workload keeps its progress (``run_ms``) and
requeues; a non-resumable one ends as ``preempted``.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import duckdb
from apportion.core.cycle import CycleResult
from apportion.core.state import State
from apportion.schemas.events import (
    DAY_MS,
    ClockTicked,
    DecisionBatch,
    Event,
    InputRejected,
    NodeHealthChanged,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadSubmitted,
)

from .projection import Projection
from .trace import HealthRow, TraceRow

_FINISH, _HEALTH, _INPUT, _SUBMIT, _TICK = 0, 1, 2, 3, 4
POLICIES = ("budget", "priority")


class HistorySink(Protocol):
    """Receives the canonical history as the simulator makes it."""

    def add_input(self, seq: int, event: Event) -> None: ...

    def add_batch(self, batch: DecisionBatch) -> None: ...


class SimResult:
    """What a run produced: the projection (``con``) and a few counters."""

    def __init__(self, **kw: Any) -> None:
        self.con: duckdb.DuckDBPyConnection = kw["con"]
        self.policy: str = kw["policy"]
        self.start_ms: int = kw["start_ms"]
        self.end_ms: int = kw["end_ms"]
        self.wall_s: float = kw["wall_s"]
        self.inputs: int = kw["inputs"]
        self.decisions: int = kw["decisions"]
        self.cycles: int = kw["cycles"]
        self.rejected: list[tuple[str, str]] = kw["rejected"]
        """``(input id, reason)`` of every input the fold rejected (trace rows: ``sub/<id>``)."""
        self.state: State = kw["state"]

    @property
    def simulated_days(self) -> float:
        return (self.end_ms - self.start_ms) / DAY_MS


def policy_decider(policy: str) -> Callable[[State], CycleResult]:
    if policy == "budget":
        from apportion.core.cycle import decide

        return decide
    if policy == "priority":
        from apportion.core.baseline import decide_baseline, default_limits

        cache: dict[str, Any] = {}

        def decide_priority(state: State) -> CycleResult:
            # team limits depend only on the budget tree and the nodes; the simulator never edits them
            limits = cache.get("limits")
            if limits is None:
                limits = cache["limits"] = default_limits(state)
            return decide_baseline(state, limits)

        return decide_priority
    raise ValueError(f"unknown policy {policy!r} (budget or priority)")


def submission(row: TraceRow, at_ms: int) -> WorkloadSubmitted:
    return WorkloadSubmitted(
        id=f"sub/{row.id}",
        at_ms=at_ms,
        workload=row.id,
        owner=row.owner,
        gpus=row.gpus,
        min_runtime_ms=row.min_runtime_ms,
        gpu_type=row.gpu_type,
        resumable=row.resumable,
        priority=row.priority,
        submitted_by=row.owner.rsplit("/", 1)[-1],
        duration_ms=row.duration_ms,
        legacy_priority=row.legacy_priority,
        legacy_preemptible=row.legacy_preemptible,  # type: ignore[arg-type]
    )


def simulate(
    cluster_events: Sequence[Event],
    trace_rows: Iterable[TraceRow],
    health_rows: Iterable[HealthRow] = (),
    policy: str = "budget",
    days: float | None = None,
    *,
    con: duckdb.DuckDBPyConnection | None = None,
    decide: Callable[[State], CycleResult] | None = None,
    progress: Callable[[int], None] | None = None,
    commit_every_ms: int = 7 * DAY_MS,
    start_ms: int = 0,
    timed_inputs: Iterable[Event] = (),
    end_ms: int | None = None,
    sink: HistorySink | None = None,
) -> SimResult:
    """Simulate ``days`` (default: until the last submission or health change, rounded
    up to a whole day) from ``start_ms``; return the projection and counters.

    ``decide`` overrides the policy's cycle (tests use it before the real one lands).
    ``progress(ms)`` is called with the simulated time reached, about once a simulated hour.
    ``timed_inputs`` are input events published at their own (absolute) ``at_ms``;
    ``end_ms`` (absolute) overrides ``days``; ``sink`` gets every input and batch.
    """
    wall0 = time.perf_counter()
    decide = decide or policy_decider(policy)
    con = con if con is not None else duckdb.connect()
    proj = Projection(con)
    if proj.position != (0, 0):
        raise ValueError("the simulator needs an empty projection database")
    proj.set_meta("policy", policy)
    state = proj.state

    heap: list[tuple[int, int, int, Any]] = []
    last_ms = start_ms
    for row in trace_rows:
        t = start_ms + row.submit_ms
        heap.append((t, _SUBMIT, row.line or len(heap), row))
        last_ms = max(last_ms, t)
    for h in health_rows:
        t = start_ms + h.at_ms
        heap.append((t, _HEALTH, h.line or len(heap), h))
        last_ms = max(last_ms, t)
    for i, ev in enumerate(timed_inputs):
        heap.append((ev.at_ms, _INPUT, i, ev))
        last_ms = max(last_ms, ev.at_ms)
    heapq.heapify(heap)
    if end_ms is None:
        if days is None:
            days = -(-(last_ms - start_ms + 1) // DAY_MS)
        end_ms = start_ms + int(days * DAY_MS)

    seq = 0
    cycles = 0
    n_decisions = 0
    rejected: list[tuple[str, str]] = []
    wakeups: dict[int, bool] = {}
    counter = len(heap)

    def cycle(t: int) -> None:
        nonlocal cycles, n_decisions, counter
        result = decide(state)
        cycles += 1
        batch = DecisionBatch(
            basis=seq, decisions=result.decisions, next_wakeup_ms=result.next_wakeup_ms
        )
        proj.add_batch(batch)
        if sink is not None:
            sink.add_batch(batch)
        n_decisions += len(result.decisions)
        running = state.running
        for d in result.decisions:
            cls = type(d)
            if cls is WorkloadPlaced:
                w = running.get(d.workload)  # type: ignore[union-attr]
                if w is not None and w.attempt == d.attempt and w.duration_ms is not None:  # type: ignore[union-attr]
                    left = max(0, w.duration_ms - w.run_ms)
                    counter += 1
                    heapq.heappush(heap, (t + left, _FINISH, counter, (w.id, w.attempt)))
            elif cls is InputRejected:
                rejected.append((d.ref, d.reason))  # type: ignore[union-attr]
        nxt = result.next_wakeup_ms
        if nxt is not None and nxt > t and nxt not in wakeups:
            wakeups[nxt] = True
            counter += 1
            heapq.heappush(heap, (nxt, _TICK, counter, None))

    # 1. the cluster file: nodes, budget, policy, then one cycle
    for ev in cluster_events:
        seq += 1
        proj.add_input(seq, ev)
        if sink is not None:
            sink.add_input(seq, ev)
    cycle(state.now_ms)
    next_commit = start_ms + commit_every_ms
    next_progress = start_ms
    # 2. event to event
    while heap and heap[0][0] < end_ms:
        t = heap[0][0]
        if t >= next_commit:
            proj.commit()
            next_commit = t + commit_every_ms
        if progress is not None and t >= next_progress:
            progress(t - start_ms)
            next_progress = t + 3_600_000
        inputs: list[Event] = []
        ticked = False
        while heap and heap[0][0] == t:
            _, kind, _, payload = heapq.heappop(heap)
            if kind == _FINISH:
                wid, attempt = payload
                w = state.running.get(wid)
                if w is not None and w.attempt == attempt:
                    inputs.append(
                        WorkloadFinished(
                            id=f"fin/{wid}/{attempt}", at_ms=t, workload=wid, attempt=attempt
                        )
                    )
            elif kind == _SUBMIT:
                inputs.append(submission(payload, t))
            elif kind == _INPUT:
                inputs.append(payload)
            elif kind == _HEALTH:
                inputs.append(
                    NodeHealthChanged(
                        id=f"health/{payload.line or counter}/{payload.node}",
                        at_ms=t,
                        node=payload.node,
                        state=payload.state,
                    )
                )
            else:
                wakeups.pop(t, None)
                ticked = True
        if not inputs:
            if not ticked:
                continue
            inputs.append(ClockTicked(id=f"tick/{t}", at_ms=t))
        for ev in inputs:
            seq += 1
            proj.add_input(seq, ev)
            if sink is not None:
                sink.add_input(seq, ev)
        cycle(t)
    # the clock reaches the end of the horizon (no cycle: nothing after it is simulated)
    seq += 1
    closing = ClockTicked(id=f"tick/{end_ms}", at_ms=end_ms)
    proj.add_input(seq, closing)
    if sink is not None:
        sink.add_input(seq, closing)
    proj.commit()
    if progress is not None:
        progress(end_ms - start_ms)
    return SimResult(
        con=con,
        policy=policy,
        start_ms=start_ms,
        end_ms=end_ms,
        wall_s=time.perf_counter() - wall0,
        inputs=seq,
        decisions=n_decisions,
        cycles=cycles,
        rejected=rejected,
        state=state,
    )
