"""The simulator: the real core driven by a virtual clock that jumps from event to event.

Time moves only to the next thing that happens: a submission, a run's end
(its remaining ``duration``), a health change from the health CSV, or the
cycle's ``next_wakeup_ms`` (a protection expiry or a reservation start) - never
by fixed ticks. At each such millisecond the simulator publishes what the
services would (``WorkloadFinished`` for runs that are done, then
``NodeHealthChanged``, then ``WorkloadSubmitted`` in trace order, or a lone
``ClockTicked`` at a wake-up), then runs one scheduling cycle (the budget
scheduler's :func:`~apportion.core.cycle.decide` or the baseline). Inputs and
decision batches are history items folded by the one fold
(:func:`~apportion.core.history.fold_item`), exactly as the services fold
them, and shown to an observer: :func:`run_simulation` takes any (none by
default, the fastest); :func:`simulate` observes with a DuckDB
:class:`~apportion.replay.projection.Projection` (for KPIs) and optionally a
second observer such as an event-log writer.

Other inputs can be given ready-made (``timed_inputs``: any input event at its
own ``at_ms``, published after the finishes of that millisecond and before the
trace's submissions, in the order given); ``apportion whatif`` re-simulates a
log's submissions, health and budget changes that way. The closing
``ClockTicked`` at the end of the horizon is folded with no cycle after it, so
every batch in the history is one the policy computed.

Executor model: a placed workload finishes when its remaining duration has
run; a preempted resumable workload keeps its progress (``run_ms``) and
requeues; a non-resumable one ends as ``preempted``.

Start-time estimates (``estimate_every``): the simulator can sample what
:func:`~apportion.core.estimate.estimate_starts` would have told a user. Every
``estimate_every``-th submission (the 1st, the N+1-th, ... in the order the
inputs are folded) that is still pending after the cycle that saw it gets its
estimate computed right there, on the state after that cycle - "if nothing new
arrives" - and handed to ``on_estimate(workload, at_ms, estimated_start_ms or
None, note)``; :func:`simulate` stores them in the projection's ``estimates``
table. The sample depends only on the inputs, so a run stays deterministic.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import duckdb
from apportion.core import commands
from apportion.core.cycle import CycleResult
from apportion.core.cycle import decide as budget_decide
from apportion.core.estimate import estimate_starts
from apportion.core.history import (
    BUDGET_LOGIC,
    Decider,
    Observer,
    decide_batch,
    fold_item,
    observe_all,
)
from apportion.core.rules.authority import agent_of, run_ended
from apportion.core.state import State
from apportion.schemas.events import (
    DAY_MS,
    ClockTicked,
    Input,
    InputRejected,
    NodeHealthChanged,
    WorkloadPlaced,
    WorkloadSubmitted,
)
from apportion.schemas.history import BatchItem, input_item

from .projection import Projection
from .trace import HealthRow, TraceRow

_FINISH, _HEALTH, _INPUT, _SUBMIT, _TICK = 0, 1, 2, 3, 4

DEFAULT_ESTIMATE_EVERY = 0
"""The default sample of :func:`simulate`: the estimate of every N-th submission (0: none)."""

EstimateSink = Callable[[str, int, "int | None", "str | None"], None]
"""``(workload, at_ms, estimated_start_ms or None, note)``: one sampled estimate."""

NOTE_NO_KNOWN_END = "no_known_end"
"""No estimate: the workload waits on running work with no known end (no duration)."""
NOTE_HORIZON = "beyond_horizon"
"""No estimate: not placed within the estimate's horizon (7 days or 400 cycles)."""


class SimResult:
    """What a run produced: the final state and a few counters; ``con`` holds the
    projection when :func:`simulate` made one (``None`` from :func:`run_simulation`)."""

    def __init__(self, **kw: Any) -> None:
        self.con: duckdb.DuckDBPyConnection | None = kw.get("con")
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
        self.events: int | None = kw.get("events")
        """Events the projection observed (set by :func:`simulate`)."""


def sample_estimate(
    state: State, workload: str, next_wakeup_ms: int | None, sink: EstimateSink | None
) -> None:
    """Estimate when the pending ``workload`` starts (``state`` right after a cycle
    whose next wake-up is ``next_wakeup_ms``) and hand it to ``sink``."""
    if sink is None:
        return
    est = estimate_starts(state, next_wakeup_ms=next_wakeup_ms, only=workload)
    start = est.starts.get(workload)
    note = None if start is not None else NOTE_NO_KNOWN_END if est.exhausted else NOTE_HORIZON
    sink(workload, state.now_ms, start, note)


PRIORITY_LOGIC = "priority/1"
"""The version of the baseline policy's logic (see :data:`apportion.core.history.BUDGET_LOGIC`)."""


def policy_logic(policy: str) -> str:
    """The version of the logic of ``policy`` that its batches record."""
    return PRIORITY_LOGIC if policy == "priority" else BUDGET_LOGIC


def policy_decider(policy: str) -> Decider:
    """The cycle of ``policy``: the budget scheduler's, or a fresh baseline (no state shared)."""
    if policy == "budget":
        return budget_decide
    if policy == "priority":
        return PriorityPolicy()
    raise ValueError(f"unknown policy {policy!r} (budget or priority)")


class PriorityPolicy:
    """The baseline's cycle for one history. Team limits depend only on the
    budget tree and the nodes at the first cycle, so they are computed once;
    each history gets its own instance (nothing is shared between histories)."""

    def __init__(self) -> None:
        self.limits: dict[str, int] | None = None

    def __call__(self, state: State) -> CycleResult:
        from .baseline import decide_baseline, default_limits

        if self.limits is None:
            self.limits = default_limits(state)
        return decide_baseline(state, self.limits)


# The ids the simulator gives the inputs it makes, and how to read them back.
_SUBMIT_ID, _HEALTH_ID, _FINISH_ID, _TICK_ID = "sub/", "health/", "fin/", "tick/"


def input_origin(ref: str) -> tuple[str, str] | None:
    """Where an input the simulator made came from, by its id: ``("trace",
    workload id)``, ``("health", line number)``, ``None`` for the simulator's own
    inputs (finishes and clock ticks), ``("input", ref)`` for anything else."""
    if ref.startswith(_SUBMIT_ID):
        return ("trace", ref[len(_SUBMIT_ID) :])
    if ref.startswith(_HEALTH_ID):
        return ("health", ref[len(_HEALTH_ID) :].split("/", 1)[0])
    if ref.startswith((_FINISH_ID, _TICK_ID)):
        return None
    return ("input", ref)


def submission(row: TraceRow, at_ms: int, state: State) -> WorkloadSubmitted:
    """A trace row as submitted by the owner of its leaf (a row for a path that is
    not a node gets no submitter, and the fold says why it is refused)."""
    leaf = state.budget.nodes.get(row.owner)
    return commands.submission(
        id=f"{_SUBMIT_ID}{row.id}",
        at_ms=at_ms,
        workload=row.id,
        owner=row.owner,
        gpus=row.gpus,
        min_runtime_ms=row.min_runtime_ms,
        gpu_type=row.gpu_type,
        resumable=row.resumable,
        priority=row.priority,
        submitted_by=leaf.owner if leaf is not None else "",
        duration_ms=row.duration_ms,
        legacy_priority=row.legacy_priority,
        legacy_preemptible=row.legacy_preemptible,
    )


COMMIT_EVERY = 200_000
"""How many events the projection of a simulation buffers between commits."""


def simulate(
    cluster_events: Sequence[Input],
    trace_rows: Iterable[TraceRow],
    health_rows: Iterable[HealthRow] = (),
    policy: str = "budget",
    days: float | None = None,
    *,
    con: duckdb.DuckDBPyConnection | None = None,
    sink: Observer | None = None,
    commit_every: int = COMMIT_EVERY,
    estimate_every: int = DEFAULT_ESTIMATE_EVERY,
    history: bool = True,
    **kw: Any,
) -> SimResult:
    """:func:`run_simulation` observed by a DuckDB projection on ``con`` (a new
    in-memory database by default) and by ``sink`` (for example an event-log
    writer); the result's ``con`` holds the projection, committed. The sampled
    start-time estimates (``estimate_every``) go to its ``estimates`` table.
    ``history=False``: the projection keeps only the tables the KPIs read and
    counts the events (``result.events``; :class:`Projection`)."""
    con = con if con is not None else duckdb.connect()
    proj = Projection(con, commit_every=commit_every, history=history)
    if proj.position != (0, 0):
        raise ValueError("the simulator needs an empty projection database")
    proj.set_meta("policy", policy)
    result = run_simulation(
        cluster_events,
        trace_rows,
        health_rows,
        policy,
        days,
        observer=observe_all(proj, sink),
        estimate_every=estimate_every,
        on_estimate=proj.add_estimate if estimate_every > 0 else None,
        **kw,
    )
    proj.commit(result.state)
    result.con = con
    result.events = proj.events
    return result


def run_simulation(
    cluster_events: Sequence[Input],
    trace_rows: Iterable[TraceRow],
    health_rows: Iterable[HealthRow] = (),
    policy: str = "budget",
    days: float | None = None,
    *,
    observer: Observer | None = None,
    decide: Decider | None = None,
    progress: Callable[[int], None] | None = None,
    start_ms: int = 0,
    timed_inputs: Iterable[Input] = (),
    end_ms: int | None = None,
    estimate_every: int = 0,
    on_estimate: EstimateSink | None = None,
) -> SimResult:
    """Simulate ``days`` (default: until the last submission or health change, rounded
    up to a whole day) from ``start_ms``, showing every history item to ``observer``.

    ``decide`` overrides the policy's cycle (tests use it before the real one lands).
    ``progress(ms)`` is called with the simulated time reached, about once a simulated hour.
    ``timed_inputs`` are input events published at their own (absolute) ``at_ms``;
    ``end_ms`` (absolute) overrides ``days``.
    ``estimate_every`` > 0 with ``on_estimate``: sample start-time estimates (module docstring).
    """
    wall0 = time.perf_counter()
    run = ClusterRun(
        policy,
        observer=observer,
        decide=decide,
        estimate_every=estimate_every,
        on_estimate=on_estimate,
    )
    last_ms = run.add(trace_rows, health_rows, timed_inputs, start_ms)
    if end_ms is None:
        if days is None:
            days = -(-(last_ms - start_ms + 1) // DAY_MS)
        end_ms = start_ms + int(days * DAY_MS)
    # 1. the cluster file: nodes, budget, policy, then one cycle
    run.start(cluster_events)
    next_progress = start_ms
    # 2. event to event
    while (t := run.next_ms()) is not None and t < end_ms:
        if progress is not None and t >= next_progress:
            progress(t - start_ms)
            next_progress = t + 3_600_000
        run.advance(t)
    run.close(end_ms)
    if progress is not None:
        progress(end_ms - start_ms)
    return run.result(start_ms, end_ms, time.perf_counter() - wall0)


class ClusterRun:
    """One cluster's simulation, taken a millisecond at a time: its state, the
    heap of what happens next (submissions, finishes, health changes, inputs,
    wake-ups) and the history shown to ``observer``. :func:`run_simulation`
    drives one; :mod:`apportion.replay.federation` drives several in lockstep."""

    def __init__(
        self,
        policy: str = "budget",
        *,
        observer: Observer | None = None,
        decide: Decider | None = None,
        estimate_every: int = 0,
        on_estimate: EstimateSink | None = None,
    ) -> None:
        self.policy = policy
        self.decider = decide or policy_decider(policy)
        self.logic = policy_logic(policy)
        self.observer = observer
        self.state = State()
        self.heap: list[tuple[int, int, int, Any]] = []
        self.cycles = 0
        self.n_decisions = 0
        self.rejected: list[tuple[str, str]] = []
        self.wakeups: dict[int, bool] = {}
        self.counter = 0
        self.estimate_every = estimate_every
        self.on_estimate = on_estimate
        self.sampling = estimate_every > 0 and on_estimate is not None
        self.submitted = 0
        self.last_wakeup: int | None = None
        self.last_decisions: tuple[Any, ...] = ()
        """The decisions of the latest cycle."""

    def add(
        self,
        trace_rows: Iterable[TraceRow] = (),
        health_rows: Iterable[HealthRow] = (),
        timed_inputs: Iterable[Input] = (),
        start_ms: int = 0,
    ) -> int:
        """Queue rows and inputs (before :meth:`start`); the time of the last one."""
        heap = self.heap
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
        self.counter = len(heap)
        return last_ms

    def push_input(self, event: Input) -> None:
        """Publish ``event`` at its ``at_ms`` (after that millisecond's finishes and
        health changes, before its submissions)."""
        self.counter += 1
        heapq.heappush(self.heap, (event.at_ms, _INPUT, self.counter, event))

    def push_submission(self, row: TraceRow, at_ms: int) -> None:
        """Submit ``row`` at ``at_ms`` (a routed row, :mod:`apportion.replay.federation`)."""
        self.counter += 1
        heapq.heappush(self.heap, (at_ms, _SUBMIT, self.counter, row))

    def next_ms(self) -> int | None:
        return self.heap[0][0] if self.heap else None

    def fold_input(self, event: Input) -> None:
        state = self.state
        item = input_item(state.input_seq + 1, event)
        why = fold_item(state, item)
        if self.observer is not None:
            self.observer(item, state, why)

    def cycle(self, t: int) -> None:
        state = self.state
        heap = self.heap
        batch, result = decide_batch(state, self.decider, self.logic)
        self.cycles += 1
        item = BatchItem(seq=self.cycles, batch=batch)
        fold_item(state, item)
        if self.observer is not None:
            self.observer(item, state, None)
        self.n_decisions += len(batch.decisions)
        self.last_decisions = batch.decisions
        running = state.running
        for d in batch.decisions:
            if isinstance(d, WorkloadPlaced):
                w = running.get(d.workload)
                if w is not None and w.attempt == d.attempt and w.duration_ms is not None:
                    left = max(0, w.duration_ms - w.run_ms)
                    self.counter += 1
                    heapq.heappush(heap, (t + left, _FINISH, self.counter, (w.id, w.attempt)))
            elif isinstance(d, InputRejected):
                self.rejected.append((d.ref, d.reason))
        nxt = result.next_wakeup_ms
        self.last_wakeup = nxt
        if nxt is not None and nxt > t and nxt not in self.wakeups:
            self.wakeups[nxt] = True
            self.counter += 1
            heapq.heappush(heap, (nxt, _TICK, self.counter, None))

    def start(self, cluster_events: Iterable[Input]) -> None:
        """Fold the cluster file's inputs (nodes, budget, policy), then one cycle."""
        for ev in cluster_events:
            self.fold_input(ev)
        self.cycle(self.state.now_ms)

    def advance(self, t: int) -> bool:
        """Publish everything due at ``t`` (the heap's next time) and run one cycle
        (none if nothing was published); whether a cycle ran."""
        heap, state = self.heap, self.state
        inputs: list[Input] = []
        ticked = False
        while heap and heap[0][0] == t:
            _, kind, _, payload = heapq.heappop(heap)
            if kind == _FINISH:
                wid, attempt = payload
                ended = run_ended(state, wid, attempt, t, f"{_FINISH_ID}{wid}/{attempt}")
                if ended is not None:
                    inputs.append(ended)
            elif kind == _SUBMIT:
                inputs.append(submission(payload, t, state))
            elif kind == _INPUT:
                inputs.append(payload)
            elif kind == _HEALTH:
                inputs.append(
                    NodeHealthChanged(
                        id=f"{_HEALTH_ID}{payload.line or self.counter}/{payload.node}",
                        at_ms=t,
                        node=payload.node,
                        state=payload.state,
                        actor=agent_of(payload.node),
                    )
                )
            else:
                self.wakeups.pop(t, None)
                ticked = True
        if not inputs:
            if not ticked:
                return False
            inputs.append(ClockTicked(id=f"{_TICK_ID}{t}", at_ms=t))
        for ev in inputs:
            self.fold_input(ev)
        self.cycle(t)
        if self.sampling:
            self._sample(inputs, t)
        return True

    def _sample(self, inputs: list[Input], t: int) -> None:
        for ev in inputs:
            if not isinstance(ev, WorkloadSubmitted):
                continue
            self.submitted += 1
            if (self.submitted - 1) % self.estimate_every:
                continue
            w = self.state.pending.get(ev.workload)
            # still pending, and this submission's (not a refused duplicate id's)
            if w is not None and w.submitted_ms == t:
                sample_estimate(self.state, ev.workload, self.last_wakeup, self.on_estimate)

    def close(self, end_ms: int) -> None:
        """The clock reaches the end of the horizon (no cycle: nothing after it is simulated)."""
        self.fold_input(ClockTicked(id=f"{_TICK_ID}{end_ms}", at_ms=end_ms))

    def result(self, start_ms: int, end_ms: int, wall_s: float) -> SimResult:
        return SimResult(
            policy=self.policy,
            start_ms=start_ms,
            end_ms=end_ms,
            wall_s=wall_s,
            inputs=self.state.input_seq,
            decisions=self.n_decisions,
            cycles=self.cycles,
            rejected=self.rejected,
            state=self.state,
        )
