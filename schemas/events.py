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
integer in parts per million so that the core compares it exactly. Every field
has a bound (:mod:`apportion.schemas.bounds`) that the decoders enforce.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from .bounds import (
    MAX_ARGS,
    MAX_ENV,
    MAX_LEAF_CHARGES,
    MAX_OPERATORS,
    MAX_PEERS,
    Arg,
    Count,
    DeadlineMs,
    DurationMs,
    EnvName,
    EventId,
    ExitCode,
    GpuMs,
    Gpus,
    Image,
    Name,
    Path,
    Ppm,
    Priority,
    Reason,
    ReasonCode,
    TimeMs,
    Weight,
)

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

    id: EventId
    at_ms: TimeMs
    v: Count = SCHEMA_VERSION


# --------------------------------------------------------------------------
# Inputs: published by anyone authorised, folded in the order of the INPUTS log.
# --------------------------------------------------------------------------


class NodeRegistered(Event, frozen=True, kw_only=True, tag="NodeRegistered"):
    """A host joins the cluster (healthy) with ``gpus`` GPUs of ``gpu_type``.

    ``actor`` must be an operator (the root's owner or one the policy names) or
    the host's own agent, ``agent:<node>`` (anyone while the root has no owner)."""

    node: Name
    gpus: Gpus
    gpu_type: Name
    actor: Name = ""


class NodeHealthChanged(Event, frozen=True, kw_only=True, tag="NodeHealthChanged"):
    """A host becomes ``healthy``, ``draining`` (finish protected work, take none) or ``down``.

    ``actor``: as for :class:`NodeRegistered`. ``reason``: why, in words (``apportion
    node drain --reason``); unset when none was given, and then not encoded."""

    node: Name
    state: HealthState
    actor: Name = ""
    reason: Reason | msgspec.UnsetType = msgspec.UNSET


class BudgetSet(Event, frozen=True, kw_only=True, tag="BudgetSet"):
    """Create or edit the budget node ``path`` (``""`` is the root).

    ``actor`` must own the parent of ``path`` or one of its ancestors; the root
    is edited by its own owner (or by anyone while it has none).
    """

    path: Path
    weight: Weight
    owner: Name
    actor: Name


class BudgetRemoved(Event, frozen=True, kw_only=True, tag="BudgetRemoved"):
    """Remove a budget node that has no children and no pending or running work."""

    path: Path
    actor: Name


class PolicySet(Event, frozen=True, kw_only=True, tag="PolicySet"):
    """Scheduler policy; ``actor`` must own the root of the budget tree.

    ``operators`` may register hosts, change their health and report finishes,
    besides the root's owner."""

    lookback_ms: DurationMs = 7 * DAY_MS
    max_min_runtime_ms: DurationMs = 8 * HOUR_MS
    preemption_margin_ppm: Ppm = 50_000
    actor: Name = ""
    reservations: bool = True
    operators: Annotated[tuple[Name, ...], Meta(max_length=MAX_OPERATORS)] = ()
    grace_ms: DurationMs = 0
    """Preemption notice: a preempted run keeps its GPUs (and is charged) for up
    to this long after its ``WorkloadPreempted`` so it can checkpoint; the
    executor sends SIGTERM at once and SIGKILL when it ends. ``0``: none."""
    max_grace_ms: DurationMs = 15 * MINUTE_MS
    """The cap on a workload's own ``grace_ms``."""
    heartbeat_timeout_ms: DurationMs = 0
    """A node whose agent has not been heard from for this long is marked
    ``down`` by the scheduler (actor ``scheduler``). ``0``: never."""
    preemption_margin_wait_ms: DurationMs = 0
    """How long a waiting workload is held to the preemption margin: once queued
    this long, it outranks any running workload whose side's ratio is strictly
    higher than its own (no margin). ``0``: held to it however long it waits."""
    cluster: Name | msgspec.UnsetType = msgspec.UNSET
    """This cluster's own name among its peers (unset or ``""``: not federated). Required
    when ``peers`` names another cluster; it is the ``cluster`` of the
    :class:`UsageReported` decisions and a :class:`UsageSummary` from it is
    refused (a cluster never counts its own usage twice)."""
    peers: Annotated[tuple[Name, ...], Meta(max_length=MAX_PEERS)] | msgspec.UnsetType = (
        msgspec.UNSET
    )
    """The clusters sharing this budget tree (unset or ``()``: a single cluster). While it
    names a cluster other than ``cluster``, the cycle reports this cluster's
    charges every ``usage_summary_ms`` (:class:`UsageReported`). The cluster's own
    name may be listed (the same list can go to every cluster); it is ignored."""
    usage_summary_ms: DurationMs | msgspec.UnsetType = msgspec.UNSET
    """Length of one usage interval a federated cluster reports, 10 s to 1 h (unset:
    5 min). The three federation fields are not encoded while unset, so a policy
    of a single cluster encodes as before they existed."""


class WorkloadSubmitted(Event, frozen=True, kw_only=True, tag="WorkloadSubmitted"):
    """A gang of ``gpus`` GPUs asks to run for ``owner`` (a leaf of the budget tree).

    ``min_runtime_ms`` is the scheduling contract: protected from preemption for
    that long after each placement, charged for all the time it runs; ``0``
    means free (unallocated) and preemptible at any moment. ``duration_ms`` is
    a hint for executors and simulators; the scheduler never reads it.
    """

    workload: Name
    owner: Path
    gpus: Gpus
    min_runtime_ms: DurationMs
    gpu_type: Name = ANY_GPU_TYPE
    resumable: bool = True
    priority: Priority = 0
    submitted_by: Name = ""
    duration_ms: DurationMs | None = None
    legacy_priority: LegacyPriority = "high"
    """For the baseline priority policy only (simulation); the budget scheduler ignores it."""
    legacy_preemptible: bool = False
    """For the baseline priority policy only (simulation); the budget scheduler ignores it."""
    command: Annotated[tuple[Arg, ...], Meta(max_length=MAX_ARGS)] = ()
    """What an agent runs (argv; ``()``: nothing to run, for emulators and
    simulators). The scheduler never reads it."""
    env: Annotated[dict[EnvName, Arg], Meta(max_length=MAX_ENV)] = {}
    """Environment for the command, on top of the agent's contract variables."""
    image: Image = ""
    """A container image to run ``command`` in (``docker``/``podman``), or ``""``."""
    grace_ms: DurationMs | None = None
    """This workload's preemption notice (``None``: the policy's ``grace_ms``);
    at most the policy's ``max_grace_ms``."""


class WorkloadCancelled(Event, frozen=True, kw_only=True, tag="WorkloadCancelled"):
    """``actor`` must be the workload's submitter or own its leaf or a node above it."""

    workload: Name
    actor: Name = ""


class WorkloadFinished(Event, frozen=True, kw_only=True, tag="WorkloadFinished"):
    """The executor reports the end of a run.

    ``attempt`` (from :class:`WorkloadPlaced`) makes a late report of an
    earlier run stale instead of ending the current one; ``None`` means the
    current run.
    """

    workload: Name
    outcome: Outcome = "succeeded"
    attempt: Count | None = None
    actor: Name = ""
    """An operator, or the agent of a host the run is on (``agent:<node>``)."""
    exit_code: ExitCode | None = None
    """The process's exit status as the agent saw it (negative: killed by that
    signal); informational, the scheduler reads only ``outcome``."""


class WorkloadStarted(Event, frozen=True, kw_only=True, tag="WorkloadStarted"):
    """An executor reports that attempt ``attempt`` of a placed run has started
    its process(es) on ``node``. Informational: it changes no scheduling state
    (a report for an attempt that is not the current run is stale and
    recorded as rejected). ``actor``: as for :class:`WorkloadFinished`."""

    workload: Name
    attempt: Count
    node: Name
    actor: Name = ""


class WorkloadHeld(Event, frozen=True, kw_only=True, tag="WorkloadHeld"):
    """Keep pending ``workload`` out of scheduling until it is released (like
    ``scontrol hold``): it stays pending, keeps its place in the queue, and no
    cycle places it. ``actor``: as for :class:`WorkloadCancelled`. Refused unless
    the workload is pending and not held already."""

    workload: Name
    actor: Name = ""


class WorkloadReleased(Event, frozen=True, kw_only=True, tag="WorkloadReleased"):
    """Let held ``workload`` be scheduled again, at its old place in the queue (its
    submit time is unchanged). ``actor``: as for :class:`WorkloadCancelled`.
    Refused unless the workload is held."""

    workload: Name
    actor: Name = ""


class ClockTicked(Event, frozen=True, kw_only=True, tag="ClockTicked"):
    """Time moves with nothing else happening (for example a protection expiry)."""


class InputsLost(Event, frozen=True, kw_only=True, tag="InputsLost"):
    """An operator's record that inputs ``first`` .. ``through`` of ``INPUTS`` are
    gone (the store lost them) and that the history goes on without them
    (``apportion history accept-loss``; docs/services.md, "Lost inputs").

    It is stored after the gap, but the history places it **at the gap**: readers
    that find input ``first - 1`` followed by ``through + 1`` hand on this event as
    input ``through`` (the fold moves the sequence over the gap and changes
    nothing else, not even the clock), then the inputs stored after the gap. At
    its own position it is folded again as a record: the clock moves to its
    time, nothing else changes (``actor`` must be an operator, else it is
    refused like any input by someone not allowed). Decisions based on a lost
    input are not part of the history."""

    first: Count
    through: Count
    actor: Name = ""
    note: Reason = ""


class LeafCharge(msgspec.Struct, frozen=True, array_like=True):
    """``gpu_ms`` GPU-milliseconds charged to budget node ``leaf`` (a path as the
    tree names it) in one usage interval, not counting its children's (a leaf's
    own work; for an inner node, the history of a child removed meanwhile)."""

    leaf: Path
    gpu_ms: GpuMs


LeafCharges = Annotated[tuple[LeafCharge, ...], Meta(max_length=MAX_LEAF_CHARGES)]


class UsageSummary(Event, frozen=True, kw_only=True, tag="UsageSummary"):
    """What cluster ``source`` charged in ``[start_ms, end_ms)``, per budget node:
    the :class:`UsageReported` of a peer, published into this cluster's inputs.

    The fold adds each charge at ``end_ms`` to the node (the deepest node of its
    path this tree has) and to every ancestor, so ratios count the team's usage on
    every cluster. Keyed by ``(source, start_ms)``: a repeat or an overlap of an
    interval already folded from ``source`` is refused and changes nothing.
    ``actor``: an operator or ``federation:<source>`` (on the subject
    ``apportion.<cluster>.inputs.UsageSummary.<source>`` it is that, whatever
    the payload says)."""

    source: Name
    start_ms: TimeMs
    end_ms: TimeMs
    charges: LeafCharges = ()
    actor: Name = ""
    committed: LeafCharges = ()
    """The source's committed charges when it reported (see :class:`UsageReported`);
    the summary of the latest interval replaces what an earlier one said."""


# --------------------------------------------------------------------------
# Decisions: published by the scheduler alone, computed from the inputs.
# --------------------------------------------------------------------------


class Slot(msgspec.Struct, frozen=True, array_like=True):
    """``gpus`` GPUs on ``node``: one element of a placement."""

    node: Name
    gpus: Gpus


class WorkloadPlaced(Event, frozen=True, kw_only=True, tag="WorkloadPlaced"):
    workload: Name
    placement: tuple[Slot, ...]
    allocated: bool
    protected_until_ms: DeadlineMs
    attempt: Count


class WorkloadPreempted(Event, frozen=True, kw_only=True, tag="WorkloadPreempted"):
    """``for_workload`` names the workload the preemption made room for, if any."""

    workload: Name
    reason: PreemptReason
    requeued: bool
    for_workload: Name | None = None
    grace_ms: DurationMs = 0
    """The notice given: the run keeps its GPUs until ``at_ms + grace_ms`` or
    until its executor reports it stopped, whichever comes first (``0`` on
    ``node_down``: the host is gone)."""


class NodeDrained(Event, frozen=True, kw_only=True, tag="NodeDrained"):
    """A draining node is empty and ready for repair."""

    node: Name


class InputRejected(Event, frozen=True, kw_only=True, tag="InputRejected"):
    """An input that changed nothing: ``ref`` is its id, ``reason`` says why and
    ``code`` is the stable reason code (:mod:`apportion.schemas.reasons`; unset in
    a history recorded before codes, and then not encoded)."""

    ref: EventId
    reason: Reason
    code: ReasonCode | msgspec.UnsetType = msgspec.UNSET


class UsageReported(Event, frozen=True, kw_only=True, tag="UsageReported"):
    """This cluster's exact charges in ``[start_ms, end_ms)`` per budget node
    (:class:`LeafCharge`; nodes charged nothing are left out, so ``()`` means
    nothing was used). A cluster whose policy names peers reports every interval
    in turn, none skipped, as soon as its time reaches ``end_ms``; each becomes a
    :class:`UsageSummary` in every peer's inputs."""

    cluster: Name
    start_ms: TimeMs
    end_ms: TimeMs
    charges: LeafCharges = ()
    committed: LeafCharges = ()
    """Per owner leaf, the GPU-ms its running allocated work is still committed to
    at the report's time (GPUs x the rest of its protection): peers count it in
    the ratio as this cluster does, so work just placed here weighs at once there
    too, not only as its charge arrives interval by interval."""


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
    | WorkloadStarted
    | InputsLost
    | WorkloadHeld
    | WorkloadReleased
    | UsageSummary
)
Decision = WorkloadPlaced | WorkloadPreempted | NodeDrained | InputRejected | UsageReported
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
    WorkloadStarted,
    InputsLost,
    WorkloadHeld,
    WorkloadReleased,
    UsageSummary,
)
DECISION_TYPES: tuple[type[Event], ...] = (
    WorkloadPlaced,
    WorkloadPreempted,
    NodeDrained,
    InputRejected,
    UsageReported,
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
    state after folding input ``basis`` (its sequence in ``INPUTS``).

    A cycle whose batch would not fit in one message is published as several
    consecutive **parts**, all with the cycle's basis: their decisions, in
    order, are the cycle's decisions, and the last part carries its
    ``next_wakeup_ms``. Only parts carry ``decisions_before`` and ``more``
    (unset fields are not encoded), so a cycle in one batch encodes as before.
    """

    basis: int
    decisions: tuple[Decision, ...]
    next_wakeup_ms: int | None = None
    v: int = SCHEMA_VERSION
    decisions_before: int | msgspec.UnsetType = msgspec.UNSET
    """On a part: how many decisions the history holds before this part (the
    folded state's ``decisions_folded``). A part folds only at exactly that
    point, so a repeated, missing or reordered part is refused."""
    more: bool | msgspec.UnsetType = msgspec.UNSET
    """``True`` on every part of a cycle but the last: the next batch continues
    the cycle."""
    logic: str | msgspec.UnsetType = msgspec.UNSET
    """Which version of the decision logic made the batch (``budget/N`` for the
    budget scheduler, ``priority/N`` for the simulator's baseline; N grows by one
    whenever a change makes the same history give different decisions). Unset in
    logs written before versions were recorded. ``apportion audit`` names both
    versions when a recomputed batch differs from one made by another version."""

    @property
    def is_part(self) -> bool:
        """One part of a cycle split over several batches."""
        return self.decisions_before is not msgspec.UNSET

    @property
    def continued(self) -> bool:
        """More parts of this cycle follow in the next batch."""
        return self.more is True
