"""The fold ``apply(state, event) -> state``: one mutator per event kind.

The fold is a plain function of the state and one event. It reads time only
from events (``at_ms``; an input stamped earlier than the current time folds at
the current time), never iterates a ``set``, and uses integers for GPUs,
milliseconds and GPU-milliseconds. For speed it updates the state in place and
returns it; :meth:`~apportion.core.state.State.copy` (through a snapshot) gives
an independent copy when one is needed.

An input that cannot apply (bad input, or a stale report racing a decision:
:mod:`apportion.core.refusals`) changes nothing but the clock and the input
sequence, and is recorded in :attr:`~apportion.core.state.State.rejections`
with its reason code and message; the next scheduling cycle turns each into an
:class:`~apportion.schemas.events.InputRejected` decision, whose fold clears it.
Decisions come only from the scheduler: a decision that cannot apply means the
history is corrupt and raises :class:`~apportion.core.state.CorruptHistory`."""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable, Iterable
from typing import Any

from apportion.schemas import reasons as R
from apportion.schemas.bounds import clip_reason
from apportion.schemas.events import (
    BudgetRemoved,
    BudgetSet,
    ClockTicked,
    Event,
    InputRejected,
    InputsLost,
    NodeDrained,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    UsageReported,
    UsageSummary,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadHeld,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadReleased,
    WorkloadStarted,
    WorkloadSubmitted,
)
from apportion.schemas.reasons import Refusal
from msgspec import UNSET

from .refusals import (
    asked,
    budget_removal_refusal,
    budget_set_refusal,
    cancel_refusal,
    health_refusal,
    hold_refusal,
    loss_refusal,
    policy_refusal,
    registration_refusal,
    stale_refusal,
    submission_refusal,
)
from .rules.authority import (
    agent_of,
    is_operator,
    not_operator,
)
from .rules.contract import is_allocated, protected_until
from .rules.federation import first_interval_start, fold_summary, summary_refusal
from .rules.gpu_types import takes
from .state import (
    ClusterNode,
    CorruptHistory,
    Policy,
    State,
    Stopping,
    Workload,
    add_pool,
    remove_pool,
)
from .usage import change_rates


def apply(state: State, event: Event) -> State:
    """Fold one input or decision event into ``state`` (in place) and return it."""
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"not an apportion event: {type(event).__name__}")
    handler(state, event)
    return state


def fold(events: Iterable[Event], state: State | None = None) -> State:
    """Fold ``events`` in order, starting from ``state`` or an empty state."""
    state = State() if state is None else state
    handlers = _HANDLERS
    for event in events:
        handlers[type(event)](state, event)
    return state


def refuse(state: State, event: Event, refusal: Refusal) -> State:
    """Fold input ``event`` as refused before its own checks (the subject it came
    on does not allow it: :mod:`apportion.core.rules.subjects`): the clock and the
    input sequence move, and the refusal is recorded; nothing else changes."""
    _tick(state, event)
    _reject(state, event, refusal)
    return state


def _tick(state: State, event: Event) -> None:
    """Advance the clock for an input; time never goes backwards. Runs stopping
    with notice whose deadline the clock reaches end first, each at its deadline."""
    state.input_seq += 1
    at = event.at_ms
    if at > state.now_ms:
        stops = state.stop_deadlines
        if stops and stops[0][0] <= at:
            _end_stops(state, at)
        state.now_ms = at


def _end_stops(state: State, at_ms: int) -> None:
    """End, in deadline order (then workload id), every stop due by ``at_ms``,
    with the clock at its deadline (its charge and progress run exactly to it)."""
    stops = state.stop_deadlines
    while stops and stops[0][0] <= at_ms:
        until, wid = stops[0]
        state.now_ms = until
        _end_stop(state, state.running[wid])


def _end_stop(state: State, w: Workload) -> None:
    """The run of stopping ``w`` ends now: the preemption's outcome applies."""
    stop = w.stopping
    assert stop is not None
    _end_run(state, w)
    if stop.requeue:
        _requeue(state, w)
    else:
        _end(state, w, "preempted")


def _reject(state: State, event: Event, refusal: Refusal) -> None:
    state.rejections.append((event.id, clip_reason(refusal.message), refusal.code))


def _node_registered(state: State, e: NodeRegistered) -> None:
    _tick(state, e)
    problem = registration_refusal(state, e)
    if problem:
        return _reject(state, e, problem)
    known = state.nodes.get(e.node)
    if known is not None:
        remove_pool(state, known)
        known.gpus, known.gpu_type, known.free = e.gpus, e.gpu_type, e.gpus
        add_pool(state, known)
        return None
    node = ClusterNode(node=e.node, gpus=e.gpus, gpu_type=e.gpu_type, free=e.gpus)
    state.nodes[e.node] = node
    add_pool(state, node)
    return None


def _node_health_changed(state: State, e: NodeHealthChanged) -> None:
    _tick(state, e)
    problem = health_refusal(state, e)
    if problem:
        return _reject(state, e, problem)
    node = state.nodes[e.node]
    index, key = state.node_index, (node.gpu_type, node.gpus)
    if node.schedulable:
        index.remove_healthy(node.node, key, node.free)
    index.set_health(node.node, node.health, e.state)
    node.health = e.state
    node.drained = False
    if node.schedulable:
        index.add_healthy(node.node, key, node.free)
    return None


def _budget_set(state: State, e: BudgetSet) -> None:
    _tick(state, e)
    problem = budget_set_refusal(state, e)
    if problem:
        return _reject(state, e, problem)
    state.budget.set_node(e.path, e.weight, e.owner)
    return None


def _budget_removed(state: State, e: BudgetRemoved) -> None:
    _tick(state, e)
    problem = budget_removal_refusal(state, e)
    if problem:
        return _reject(state, e, problem)
    state.budget.remove_node(e.path)
    return None


def _policy_set(state: State, e: PolicySet) -> None:
    _tick(state, e)
    problem = policy_refusal(state, e)
    if problem:
        return _reject(state, e, problem)
    state.policy = Policy(
        lookback_ms=e.lookback_ms,
        max_min_runtime_ms=e.max_min_runtime_ms,
        preemption_margin_ppm=e.preemption_margin_ppm,
        reservations=e.reservations,
        operators=e.operators,
        grace_ms=e.grace_ms,
        max_grace_ms=e.max_grace_ms,
        heartbeat_timeout_ms=e.heartbeat_timeout_ms,
        preemption_margin_wait_ms=e.preemption_margin_wait_ms or UNSET,
        cluster=e.cluster or UNSET,
        peers=e.peers or UNSET,
        usage_summary_ms=e.usage_summary_ms,
    )
    if not state.policy.reports_usage:
        state.reported_until_ms = None
    elif state.reported_until_ms is None:
        state.reported_until_ms = first_interval_start(state.now_ms, state.policy.summary_ms)
    return None


def _workload_submitted(state: State, e: WorkloadSubmitted) -> None:
    _tick(state, e)
    problem = submission_refusal(state, e)
    if problem:
        return _reject(state, e, problem)
    w = Workload(
        id=e.workload,
        owner=e.owner,
        gpus=e.gpus,
        gpu_type=e.gpu_type,
        min_runtime_ms=e.min_runtime_ms,
        resumable=e.resumable,
        priority=e.priority,
        submitted_ms=state.now_ms,
        submitted_by=e.submitted_by,
        duration_ms=e.duration_ms,
        queued_ms=state.now_ms,
        legacy_priority=e.legacy_priority,
        legacy_preemptible=e.legacy_preemptible,
        grace_ms=e.grace_ms,
    )
    state.workloads[w.id] = w
    state.pending[w.id] = w
    state.pending_index.add(w)
    state.active_by_owner[w.owner] = state.active_by_owner.get(w.owner, 0) + 1
    return None


def _workload_cancelled(state: State, e: WorkloadCancelled) -> None:
    _tick(state, e)
    problem = cancel_refusal(state, e.workload, e.actor)
    if problem is not None:
        return _reject(state, e, asked("cancel", problem))
    w = state.workloads[e.workload]
    if w.status == "running":
        _end_run(state, w)
    else:
        del state.pending[w.id]
        if w.held:
            w.held_by = w.held_ms = UNSET
        else:
            state.pending_index.remove(w)
    _end(state, w, "cancelled")
    return None


def _workload_held(state: State, e: WorkloadHeld) -> None:
    """Pending ``w`` leaves the pending index (no cycle walks it), stays pending."""
    _tick(state, e)
    problem = hold_refusal(state, e.workload, e.actor, release=False)
    if problem is not None:
        return _reject(state, e, asked("hold", problem))
    w = state.workloads[e.workload]
    state.pending_index.remove(w)
    w.held_by = e.actor
    w.held_ms = state.now_ms
    return None


def _workload_released(state: State, e: WorkloadReleased) -> None:
    """Held ``w`` goes back into the pending index with its old keys (submit time
    unchanged: it keeps its place in the queue)."""
    _tick(state, e)
    problem = hold_refusal(state, e.workload, e.actor, release=True)
    if problem is not None:
        return _reject(state, e, asked("release", problem))
    w = state.workloads[e.workload]
    w.held_by = w.held_ms = UNSET
    state.pending_index.add(w)
    return None


def _workload_finished(state: State, e: WorkloadFinished) -> None:
    _tick(state, e)
    w = state.workloads.get(e.workload)
    if w is None:
        return _reject(state, e, stale_refusal(state, e.workload, "finished"))
    if w.status != "running":
        return _reject(
            state,
            e,
            Refusal(
                R.STALE_REPORT,
                f"finished: workload {e.workload!r} is {w.status}, not running (stale report)",
            ),
        )
    if e.attempt is not None and e.attempt != w.attempt:
        return _reject(
            state,
            e,
            Refusal(
                R.STALE_REPORT,
                f"finished: report for attempt {e.attempt} of {e.workload!r}, which is on attempt {w.attempt} (stale report)",
            ),
        )
    if not is_operator(state, e.actor) and not any(
        e.actor == agent_of(s.node) for s in w.placement
    ):
        return _reject(
            state,
            e,
            Refusal(
                R.NOT_AUTHORISED,
                not_operator(
                    e.actor, f"report the end of {e.workload!r}", "the agent of a host it runs on"
                ),
            ),
        )
    if w.stopping is not None and e.outcome == "failed":
        _end_stop(state, w)  # stopped during its notice: the preemption's outcome stands
        return None
    _end_run(state, w)
    _end(state, w, e.outcome)
    return None


def _workload_started(state: State, e: WorkloadStarted) -> None:
    """Informational: checked (current attempt, a host it runs on) but changes nothing."""
    _tick(state, e)
    w = state.workloads.get(e.workload)
    if w is None:
        return _reject(state, e, stale_refusal(state, e.workload, "started"))
    if w.status != "running" or e.attempt != w.attempt:
        return _reject(
            state,
            e,
            Refusal(
                R.STALE_REPORT,
                f"started: attempt {e.attempt} of {e.workload!r} is not its current run (stale report)",
            ),
        )
    if all(s.node != e.node for s in w.placement):
        return _reject(
            state,
            e,
            Refusal(R.WRONG_NODE, f"started: {e.workload!r} is not placed on {e.node!r}"),
        )
    if e.actor != agent_of(e.node) and not is_operator(state, e.actor):
        return _reject(
            state,
            e,
            Refusal(
                R.NOT_AUTHORISED,
                not_operator(e.actor, f"report the start of {e.workload!r}", "its agent"),
            ),
        )
    return None


def _usage_summary(state: State, e: UsageSummary) -> None:
    """A peer cluster's usage (:mod:`apportion.core.rules.federation`)."""
    _tick(state, e)
    problem = summary_refusal(state, e)
    if problem is not None:
        return _reject(state, e, problem)
    fold_summary(state, e)
    return None


def _clock_ticked(state: State, e: ClockTicked) -> None:
    _tick(state, e)


def _inputs_lost(state: State, e: InputsLost) -> None:
    """The record of a loss at its own position in ``INPUTS``: the clock moves,
    nothing else (its effect, moving over the gap, happened where the history
    places it: :func:`apportion.core.history.fold_item`). Only an operator may
    record a loss."""
    _tick(state, e)
    refusal = loss_refusal(state, e)
    if refusal is not None:
        _reject(state, e, refusal)


# -- runs: the only places that move GPUs and charges ------------------------


def _end_run(state: State, w: Workload) -> None:
    """Stop ``w``'s current run at ``now``: free its GPUs, stop its charge, keep its progress."""
    now = state.now_ms
    nodes = state.nodes
    index = state.node_index
    wid = w.id
    for slot in w.placement:
        node = nodes[slot.node]
        free = node.free
        node.free = free + slot.gpus
        if node.health == "healthy":
            index.move(node.node, (node.gpu_type, node.gpus), free, node.free)
        del node.workloads[wid]
    if is_allocated(w):
        change_rates(state.budget.chain(w.owner), now, -w.gpus)
        state.protection_index.remove(wid)  # it indexes allocated runs only
    w.run_ms += now - w.started_ms
    w.placement = ()
    del state.running[wid]
    if w.stopping is not None:
        state.stop_deadlines.remove((w.stopping.until_ms, w.id))
        w.stopping = None


def _requeue(state: State, w: Workload) -> None:
    """``w``'s run ended by preemption: back to the queue (original submit time, progress kept)."""
    w.status = "pending"
    w.queued_ms = state.now_ms
    state.pending[w.id] = w
    state.pending_index.add(w)


def _end(state: State, w: Workload, status: str) -> None:
    del state.workloads[w.id]
    state.ended[w.id] = status
    w.status = status
    n = state.active_by_owner[w.owner] - 1
    if n:
        state.active_by_owner[w.owner] = n
    else:
        del state.active_by_owner[w.owner]


def _decision_time(state: State, e: Event) -> None:
    state.decisions_folded += 1
    if e.at_ms > state.now_ms:
        raise CorruptHistory(
            f"decision {e.id!r} at {e.at_ms} is later than the input it was based on ({state.now_ms})"
        )


def _workload_placed(state: State, e: WorkloadPlaced) -> None:
    _decision_time(state, e)
    w = state.pending.get(e.workload)
    if w is None:
        raise CorruptHistory(f"placed {e.workload!r}, which is not pending")
    if w.held_by is not UNSET:
        raise CorruptHistory(f"placed {e.workload!r}, which is held")
    allocated = is_allocated(w)
    if e.allocated != allocated:
        raise CorruptHistory(
            f"placed {e.workload!r} with allocated={e.allocated} against its contract"
        )
    placement = e.placement
    if len(placement) > 1 and len({s.node for s in placement}) != len(placement):
        # each node once: a repeated node would be checked against its free GPUs
        # slot by slot (overcommitting it) and could not be freed again later
        raise CorruptHistory(f"placed {e.workload!r} on {placement}, which names a node twice")
    now = state.now_ms
    nodes = state.nodes
    gpu_type = w.gpu_type
    total = 0
    for slot in placement:
        node = nodes.get(slot.node)
        if node is None or node.free < slot.gpus or node.health != "healthy" or slot.gpus <= 0:
            raise CorruptHistory(
                f"placed {e.workload!r} on {slot.node!r}, which cannot take {slot.gpus} GPUs"
            )
        if not takes(gpu_type, node.gpu_type):
            raise CorruptHistory(f"placed {e.workload!r} on {slot.node!r} of the wrong GPU type")
        total += slot.gpus
    if total != w.gpus:
        raise CorruptHistory(f"placed {e.workload!r} on {placement} for {w.gpus} GPUs")
    index = state.node_index
    wid = w.id
    for slot in placement:
        node = nodes[slot.node]
        free = node.free
        node.free = free - slot.gpus
        index.move(node.node, (node.gpu_type, node.gpus), free, node.free)
        node.workloads[wid] = slot.gpus
    if allocated:
        change_rates(state.budget.chain(w.owner), now, w.gpus)
    del state.pending[wid]
    state.pending_index.remove(w)
    state.running[wid] = w
    w.status = "running"
    w.placement = placement
    w.started_ms = now
    w.protected_until_ms = until = protected_until(now, w.min_runtime_ms)
    w.attempt += 1
    if w.first_placed_ms is None:
        w.first_placed_ms = now
    if allocated and until > now:  # index_protection, spelled inline
        state.protection_index.add(wid, w.owner, w.gpus, until)


def _workload_preempted(state: State, e: WorkloadPreempted) -> None:
    _decision_time(state, e)
    w = state.running.get(e.workload)
    if w is None:
        raise CorruptHistory(f"preempted {e.workload!r}, which is not running")
    if e.requeued and not w.resumable:
        raise CorruptHistory(f"preempted {e.workload!r} with requeue, but it is not resumable")
    if w.stopping is not None:
        # only the loss of its host ends a stop early, at once
        if e.reason != "node_down" or e.grace_ms:
            raise CorruptHistory(f"preempted {e.workload!r}, which is already stopping")
    else:
        w.preemptions += 1
        if e.grace_ms > 0:
            until = state.now_ms + e.grace_ms
            w.stopping = Stopping(
                from_ms=state.now_ms,
                until_ms=until,
                requeue=e.requeued,
                for_workload=e.for_workload,
            )
            insort(state.stop_deadlines, (until, w.id))
            return
    _end_run(state, w)
    if e.requeued:
        _requeue(state, w)
    else:
        _end(state, w, "preempted")


def _node_drained(state: State, e: NodeDrained) -> None:
    _decision_time(state, e)
    node = state.nodes.get(e.node)
    if node is None or node.health != "draining" or node.workloads:
        raise CorruptHistory(f"node {e.node!r} announced drained while not an empty draining node")
    node.drained = True


def _usage_reported(state: State, e: UsageReported) -> None:
    """The cluster reported the next usage interval: reporting moves on to its end."""
    _decision_time(state, e)
    if state.reported_until_ms is None or e.start_ms != state.reported_until_ms:
        raise CorruptHistory(
            f"usage reported from {e.start_ms}, but the next interval to report starts at "
            f"{state.reported_until_ms}"
        )
    if e.cluster != state.policy.cluster_name or not e.start_ms < e.end_ms <= state.now_ms:
        raise CorruptHistory(
            f"usage reported for {e.cluster!r} [{e.start_ms}, {e.end_ms}) at {state.now_ms}"
        )
    state.reported_until_ms = e.end_ms


def _input_rejected(state: State, e: InputRejected) -> None:
    _decision_time(state, e)
    for i, (ref, _reason, _code) in enumerate(state.rejections):
        if ref == e.ref:
            del state.rejections[i]
            return
    raise CorruptHistory(f"InputRejected for {e.ref!r}, which was not rejected")


_HANDLERS: dict[type, Callable[[State, Any], None]] = {
    NodeRegistered: _node_registered,
    NodeHealthChanged: _node_health_changed,
    BudgetSet: _budget_set,
    BudgetRemoved: _budget_removed,
    PolicySet: _policy_set,
    WorkloadSubmitted: _workload_submitted,
    WorkloadCancelled: _workload_cancelled,
    WorkloadFinished: _workload_finished,
    ClockTicked: _clock_ticked,
    WorkloadStarted: _workload_started,
    InputsLost: _inputs_lost,
    WorkloadHeld: _workload_held,
    WorkloadReleased: _workload_released,
    UsageSummary: _usage_summary,
    WorkloadPlaced: _workload_placed,
    WorkloadPreempted: _workload_preempted,
    NodeDrained: _node_drained,
    InputRejected: _input_rejected,
    UsageReported: _usage_reported,
}
