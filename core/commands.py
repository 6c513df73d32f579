"""The command layer: a request becomes input events, or a typed refusal.

Pure (it imports only :mod:`apportion.schemas` and the core): whoever takes a
request - the gateway, the CLI's direct paths, the simulator - builds the
input here and asks here whether the folded state would take it. The answer
comes from the very checks the fold runs (:func:`apportion.core.refusals.submission_refusal`,
:func:`~apportion.core.rules.authority.cancel_authority_error`, the budget, health and
policy checks, ...): one definition, so a request refused here is exactly one
the fold would refuse, with the same :class:`~apportion.schemas.reasons.Refusal`
code. (The state a caller asks may trail the log: an accepted request can still
be refused by the fold when two requests race.)

A request either yields its input event(s), ready to publish, or a
:class:`Refusal` ``(code, message)``; nothing here publishes or changes the
state it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import msgspec
from apportion.schemas import reasons as R
from apportion.schemas.codec import bounds_error
from apportion.schemas.events import (
    ANY_GPU_TYPE,
    BudgetRemoved,
    BudgetSet,
    HealthState,
    Input,
    LegacyPriority,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    UsageSummary,
    WorkloadCancelled,
    WorkloadHeld,
    WorkloadReleased,
    WorkloadSubmitted,
)
from apportion.schemas.reasons import Refusal

from .fold import apply
from .refusals import (
    budget_removal_refusal,
    budget_set_refusal,
    cancel_refusal,
    health_refusal,
    hold_refusal,
    policy_refusal,
    registration_refusal,
    submission_refusal,
)
from .rules.federation import summary_refusal
from .state import State

__all__ = [
    "Refusal",
    "budget",
    "cancel",
    "cancel_id",
    "cancel_refusal",
    "check",
    "check_all",
    "health",
    "hold",
    "submission",
    "submit",
    "submit_id",
]

SUBMIT_ID_PREFIX = "submit-"
"""The live services' id of a submission: ``submit-<workload>`` (a retry is stored once)."""
CANCEL_ID_PREFIX = "cancel-"


def submit_id(workload: str) -> str:
    """The id of a live submission of ``workload`` (deterministic: a retry is stored once)."""
    return f"{SUBMIT_ID_PREFIX}{workload}"


def cancel_id(workload: str) -> str:
    """The id of a live cancel of ``workload``."""
    return f"{CANCEL_ID_PREFIX}{workload}"


def submission(
    *,
    id: str,
    at_ms: int,
    workload: str,
    owner: str,
    gpus: int,
    min_runtime_ms: int,
    gpu_type: str = ANY_GPU_TYPE,
    resumable: bool = True,
    priority: int = 0,
    submitted_by: str = "",
    duration_ms: int | None = None,
    legacy_priority: LegacyPriority = "high",
    legacy_preemptible: bool = False,
    command: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    image: str = "",
    grace_ms: int | None = None,
) -> WorkloadSubmitted:
    """The one builder of a :class:`WorkloadSubmitted`, field by field (the
    gateway, the CLI's direct paths, the simulator and the demo call it); the
    defaults are the event's own."""
    return WorkloadSubmitted(
        id=id,
        at_ms=at_ms,
        workload=workload,
        owner=owner,
        gpus=gpus,
        min_runtime_ms=min_runtime_ms,
        gpu_type=gpu_type,
        resumable=resumable,
        priority=priority,
        submitted_by=submitted_by,
        duration_ms=duration_ms,
        legacy_priority=legacy_priority,
        legacy_preemptible=legacy_preemptible,
        command=tuple(command),
        env=dict(env) if env else {},
        image=image,
        grace_ms=grace_ms,
    )


# -- checks ---------------------------------------------------------------------


def _trial(state: State, event: Input) -> Refusal | None:
    """The fold's own answer, on a copy: for the inputs whose checks depend on the
    run in progress (reports of executors, clock ticks)."""
    trial = state.copy()
    before = len(trial.rejections)
    apply(trial, event)
    if len(trial.rejections) == before:
        return None
    _ref, reason, code = trial.rejections[-1]
    return Refusal(code if isinstance(code, str) else R.MALFORMED, reason)


def check(state: State, event: Input) -> Refusal | None:
    """Why the fold would refuse ``event`` if it came next, or ``None``.

    First the bounds of the schemas (an event made in Python that breaks one is a
    malformed input, as if it had been published), then the fold's check for its
    kind. ``state`` is not changed."""
    problem = bounds_error(event)
    if problem is not None:
        return Refusal(R.MALFORMED, f"malformed input: {problem}")
    if isinstance(event, WorkloadSubmitted):
        return submission_refusal(state, event)
    if isinstance(event, WorkloadCancelled):
        return cancel_refusal(state, event.workload, event.actor)
    if isinstance(event, WorkloadHeld | WorkloadReleased):
        return hold_refusal(
            state, event.workload, event.actor, release=isinstance(event, WorkloadReleased)
        )
    if isinstance(event, BudgetSet):
        return budget_set_refusal(state, event)
    if isinstance(event, BudgetRemoved):
        return budget_removal_refusal(state, event)
    if isinstance(event, NodeHealthChanged):
        return health_refusal(state, event)
    if isinstance(event, NodeRegistered):
        return registration_refusal(state, event)
    if isinstance(event, PolicySet):
        return policy_refusal(state, event)
    if isinstance(event, UsageSummary):
        return summary_refusal(state, event)
    return _trial(state, event)


def check_all(state: State, events: Sequence[Input]) -> Refusal | None:
    """The first refusal of ``events`` folded in order (each checked against the
    state the ones before it leave, on a copy), or ``None``."""
    if len(events) <= 1:
        return check(state, events[0]) if events else None
    trial = state.copy()
    for event in events:
        problem = check(trial, event)
        if problem is not None:
            return problem
        apply(trial, event)
    return None


# -- requests -------------------------------------------------------------------


def submit(state: State, event: WorkloadSubmitted) -> WorkloadSubmitted | Refusal:
    """A submission (built by :func:`submission`) to publish, or why not."""
    return check(state, event) or event


def cancel(
    state: State, workload: str, actor: str, at_ms: int, id: str | None = None
) -> WorkloadCancelled | Refusal:
    """A cancel of ``workload`` by ``actor`` (id ``cancel-<workload>``), or why not."""
    problem = cancel_refusal(state, workload, actor)
    if problem is not None:
        return problem
    return WorkloadCancelled(
        id=cancel_id(workload) if id is None else id, at_ms=at_ms, workload=workload, actor=actor
    )


def hold(
    state: State, workload: str, actor: str, at_ms: int, id: str, release: bool = False
) -> WorkloadHeld | WorkloadReleased | Refusal:
    """A hold (``release``: a release) of ``workload`` by ``actor`` with id ``id``, or
    why not (the fold's message for it, without its ``hold: `` prefix)."""
    problem = hold_refusal(state, workload, actor, release)
    if problem is not None:
        return problem
    kind = WorkloadReleased if release else WorkloadHeld
    return kind(id=id, at_ms=at_ms, workload=workload, actor=actor)


def budget(
    state: State,
    actor: str,
    sets: Sequence[tuple[str, int, str]],
    removes: Sequence[str],
    at_ms: int,
    new_id: Callable[[], str],
) -> tuple[BudgetSet | BudgetRemoved, ...] | Refusal:
    """Budget edits by ``actor``: ``sets`` of ``(path, weight, owner)`` then
    ``removes`` of paths, in that order, each id from ``new_id()``; or the first
    refusal, checked in order (a later edit may rely on an earlier one)."""
    events: list[BudgetSet | BudgetRemoved] = [
        BudgetSet(id=new_id(), at_ms=at_ms, path=path, weight=weight, owner=owner, actor=actor)
        for path, weight, owner in sets
    ]
    events += [BudgetRemoved(id=new_id(), at_ms=at_ms, path=path, actor=actor) for path in removes]
    if not events:
        return Refusal(R.EMPTY_REQUEST, "nothing to change: give 'set' and/or 'remove'")
    problem = check_all(state, events)
    return problem if problem is not None else tuple(events)


def health(
    state: State,
    node: str,
    health_state: HealthState,
    actor: str,
    at_ms: int,
    id: str,
    reason: str = "",
) -> NodeHealthChanged | Refusal:
    """A health change of ``node`` by ``actor`` (``reason``: why, in words; left
    out of the event when empty), or why not."""
    event = NodeHealthChanged(
        id=id,
        at_ms=at_ms,
        node=node,
        state=health_state,
        actor=actor,
        reason=reason if reason else msgspec.UNSET,
    )
    return check(state, event) or event
