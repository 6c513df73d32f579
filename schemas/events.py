"""Every event apportion knows, as frozen, keyword-only msgspec Structs.

Each event carries the envelope fields ``id`` (unique; the dedup key and the
``Nats-Msg-Id``), ``at_ms`` (integer epoch milliseconds, or simulated
milliseconds) and ``v`` (schema version), then its own fields. The ``kind``
tag names the event on the wire.

Rules for evolving this file (see msgspec's schema-evolution guide):

1. add fields only at the end of a Struct, always with a default;
2. never change the type of a field or the meaning of a tag;
3. a breaking change is a new tag (or a new ``v``) plus a tested upcaster in
   :mod:`apportion.schemas.codec`.

GPUs, durations (``*_ms``) and times are integers. The preemption margin is an
integer in parts per million so that the core compares it exactly.
"""

from __future__ import annotations

from typing import Literal

import msgspec

SCHEMA_VERSION = 1
"""The version this code writes. :data:`SUPPORTED_VERSIONS` lists what it reads."""

SUPPORTED_VERSIONS = frozenset({1})

HealthState = Literal["healthy", "draining", "down"]
Outcome = Literal["succeeded", "failed"]
PreemptReason = Literal["fairshare", "unallocated", "drain", "node_down"]
LegacyPriority = Literal["low", "normal", "high"]

ANY_GPU_TYPE = "any"
"""``gpu_type`` of a workload that runs on any type (one type per gang)."""

MINUTE_MS = 60_000
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS
PPM = 1_000_000


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """The envelope every event shares."""

    id: str
    at_ms: int
    v: int = SCHEMA_VERSION


# --------------------------------------------------------------------------
# Inputs: published by anyone authorised, folded in the order of the INPUTS log.
# --------------------------------------------------------------------------


class NodeRegistered(Event, frozen=True, kw_only=True, tag="NodeRegistered"):
    """A host joins the cluster (healthy) with ``gpus`` GPUs of ``gpu_type``."""

    node: str
    gpus: int
    gpu_type: str


class NodeHealthChanged(Event, frozen=True, kw_only=True, tag="NodeHealthChanged"):
    """A host becomes ``healthy``, ``draining`` (finish protected work, take none) or ``down``."""

    node: str
    state: HealthState


class BudgetSet(Event, frozen=True, kw_only=True, tag="BudgetSet"):
    """Create or edit the budget node ``path`` (``""`` is the root).

    ``actor`` must own the parent of ``path`` or one of its ancestors; the root
    is edited by its own owner (or by anyone while it has none).
    """

    path: str
    weight: int
    owner: str
    actor: str


class BudgetRemoved(Event, frozen=True, kw_only=True, tag="BudgetRemoved"):
    """Remove a budget node that has no children and no pending or running work."""

    path: str
    actor: str


class PolicySet(Event, frozen=True, kw_only=True, tag="PolicySet"):
    """Scheduler policy; ``actor`` must own the root of the budget tree."""

    lookback_ms: int = 7 * DAY_MS
    max_min_runtime_ms: int = 8 * HOUR_MS
    preemption_margin_ppm: int = 50_000
    actor: str = ""
    reservations: bool = True


class WorkloadSubmitted(Event, frozen=True, kw_only=True, tag="WorkloadSubmitted"):
    """A gang of ``gpus`` GPUs asks to run for ``owner`` (a leaf of the budget tree).

    ``min_runtime_ms`` is the scheduling contract: protected from preemption for
    that long after each placement, charged for all the time it runs; ``0``
    means free (unallocated) and preemptible at any moment. ``duration_ms`` is
    a hint for executors and simulators; the scheduler never reads it.
    """

    workload: str
    owner: str
    gpus: int
    min_runtime_ms: int
    gpu_type: str = ANY_GPU_TYPE
    resumable: bool = True
    priority: int = 0
    submitted_by: str = ""
    duration_ms: int | None = None
    legacy_priority: LegacyPriority = "high"
    """For the baseline priority policy only (simulation); the budget scheduler ignores it."""
    legacy_preemptible: bool = False
    """For the baseline priority policy only (simulation); the budget scheduler ignores it."""


class WorkloadCancelled(Event, frozen=True, kw_only=True, tag="WorkloadCancelled"):
    workload: str
    actor: str = ""


class WorkloadFinished(Event, frozen=True, kw_only=True, tag="WorkloadFinished"):
    """The executor reports the end of a run.

    ``attempt`` (from :class:`WorkloadPlaced`) makes a late report of an
    earlier run stale instead of ending the current one; ``None`` means the
    current run.
    """

    workload: str
    outcome: Outcome = "succeeded"
    attempt: int | None = None


class ClockTicked(Event, frozen=True, kw_only=True, tag="ClockTicked"):
    """Time moves with nothing else happening (for example a protection expiry)."""


# --------------------------------------------------------------------------
# Decisions: published by the scheduler alone, computed from the inputs.
# --------------------------------------------------------------------------


class Slot(msgspec.Struct, frozen=True, array_like=True):
    """``gpus`` GPUs on ``node``: one element of a placement."""

    node: str
    gpus: int


class WorkloadPlaced(Event, frozen=True, kw_only=True, tag="WorkloadPlaced"):
    workload: str
    placement: tuple[Slot, ...]
    allocated: bool
    protected_until_ms: int
    attempt: int


class WorkloadPreempted(Event, frozen=True, kw_only=True, tag="WorkloadPreempted"):
    """``for_workload`` names the workload the preemption made room for, if any."""

    workload: str
    reason: PreemptReason
    requeued: bool
    for_workload: str | None = None


class NodeDrained(Event, frozen=True, kw_only=True, tag="NodeDrained"):
    """A draining node is empty and ready for repair."""

    node: str


class InputRejected(Event, frozen=True, kw_only=True, tag="InputRejected"):
    """An input that changed nothing: ``ref`` is its id, ``reason`` says why."""

    ref: str
    reason: str


Input = (
    NodeRegistered
    | NodeHealthChanged
    | BudgetSet
    | BudgetRemoved
    | PolicySet
    | WorkloadSubmitted
    | WorkloadCancelled
    | WorkloadFinished
    | ClockTicked
)
Decision = WorkloadPlaced | WorkloadPreempted | NodeDrained | InputRejected
AnyEvent = Input | Decision

INPUT_TYPES: tuple[type[Event], ...] = (
    NodeRegistered,
    NodeHealthChanged,
    BudgetSet,
    BudgetRemoved,
    PolicySet,
    WorkloadSubmitted,
    WorkloadCancelled,
    WorkloadFinished,
    ClockTicked,
)
DECISION_TYPES: tuple[type[Event], ...] = (
    WorkloadPlaced,
    WorkloadPreempted,
    NodeDrained,
    InputRejected,
)
ALL_TYPES = INPUT_TYPES + DECISION_TYPES


def kind_of_type(type_: type[msgspec.Struct]) -> str:
    """The wire tag of an event type (``"WorkloadSubmitted"``, ...)."""
    tag = type_.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{type_.__name__} is not a tagged event type")
    return tag


def kind_of(event: Event) -> str:
    """The wire tag of an event (``"WorkloadSubmitted"``, ...)."""
    return kind_of_type(type(event))


class DecisionBatch(msgspec.Struct, frozen=True, kw_only=True):
    """What the scheduler publishes to ``DECISIONS``: decisions computed from the
    state after folding input ``basis`` (its sequence in ``INPUTS``)."""

    basis: int
    decisions: tuple[Decision, ...]
    next_wakeup_ms: int | None = None
    v: int = SCHEMA_VERSION
