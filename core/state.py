"""Scheduler state and the fold ``apply(state, event) -> state``.

The fold is a plain function of the state and one event, one mutator per event
kind. It reads time only from events (``at_ms``; an input stamped earlier than
the current time folds at the current time), never iterates a ``set``, and uses
integers for GPUs, milliseconds and GPU-milliseconds. For speed it updates the
state in place and returns it; :meth:`State.copy` (through a snapshot) gives an
independent copy when one is needed.

Inputs are validated here. An input that cannot apply (bad input, or a stale
report racing a decision) changes nothing but the clock and the input sequence,
and is recorded in :attr:`State.rejections` with its reason code and message
(a :class:`~apportion.schemas.reasons.Refusal`, from the check functions
``*_refusal`` that the command layer, :mod:`apportion.core.commands`, calls
too); the next scheduling cycle turns each into an
:class:`~apportion.schemas.events.InputRejected` decision, whose fold clears it. Decisions come only from the scheduler: a decision that cannot
apply means the history is corrupt and raises :class:`CorruptHistory`.
"""

from __future__ import annotations

import hashlib
from bisect import insort
from collections.abc import Callable, Iterable
from typing import Any, Literal

import msgspec
from apportion.schemas import reasons as R
from apportion.schemas.bounds import clip_reason
from apportion.schemas.events import (
    DAY_MS,
    HOUR_MS,
    MINUTE_MS,
    PPM,
    BudgetRemoved,
    BudgetSet,
    ClockTicked,
    Event,
    InputRejected,
    NodeDrained,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    Slot,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadStarted,
    WorkloadSubmitted,
)
from apportion.schemas.reasons import Refusal
from msgspec import UNSET, UnsetType

from .budget import ROOT, BudgetNode, BudgetTree, parent_of, path_error
from .nodeindex import NodeIndex
from .pendingindex import PendingIndex
from .protectionindex import ProtectionIndex
from .rules.contract import is_allocated, protected_until
from .rules.gpu_types import is_any, takes
from .usage import MAX_LOOKBACK_MS, change_rates

Rejection = tuple[str, str, str | UnsetType]
"""``(input id, reason, code)`` of an input the fold refused, not yet announced
(the code is unset only for a rejection restored from a snapshot made before codes)."""

Status = Literal["pending", "running", "succeeded", "failed", "cancelled", "preempted", "rejected"]


class CorruptHistory(Exception):
    """A decision that cannot apply to the state it was folded into."""


class Policy(msgspec.Struct, kw_only=True):
    lookback_ms: int = 7 * DAY_MS
    max_min_runtime_ms: int = 8 * HOUR_MS
    preemption_margin_ppm: int = 50_000
    reservations: bool = True
    operators: tuple[str, ...] = ()
    """Who may register hosts, change their health and report finishes, besides
    the root's owner."""
    grace_ms: int = 0
    """Preemption notice of a workload that does not set its own."""
    max_grace_ms: int = 15 * MINUTE_MS
    heartbeat_timeout_ms: int = 0
    """Read by the live scheduler only (it marks a silent node ``down``)."""


SCHEDULER = "scheduler"
"""The actor of the inputs the live scheduler itself publishes (a node marked
``down`` when its agent's heartbeat stops)."""


class ClusterNode(msgspec.Struct, kw_only=True):
    """A host: ``free`` GPUs and the GPUs each running workload holds on it."""

    node: str
    gpus: int
    gpu_type: str
    health: str = "healthy"
    free: int = 0
    workloads: dict[str, int] = msgspec.field(default_factory=dict)
    drained: bool = False
    """A ``NodeDrained`` decision has been folded since it began draining."""

    @property
    def schedulable(self) -> bool:
        return self.health == "healthy"


class Stopping(msgspec.Struct, frozen=True, kw_only=True):
    """A run preempted with notice (grace): it keeps its GPUs, and its charge,
    until ``until_ms`` or until its executor reports it ended, whichever is first;
    then the preemption's outcome applies (``requeue``, else it ends ``preempted``)."""

    from_ms: int
    """When the ``WorkloadPreempted`` was folded (the notice began)."""
    until_ms: int
    requeue: bool
    for_workload: str | None = None


class Workload(msgspec.Struct, kw_only=True, gc=False):
    """A live (pending or running) workload. Ended ones keep only their status.

    ``gc=False``: the cyclic garbage collector does not track workloads. A workload
    holds only strings, numbers, a tuple of slots and a frozen :class:`Stopping`,
    none of which can refer back to it, so it can never be part of a cycle; a deep
    queue keeps tens of thousands of them, and tracked, every placed one would
    lengthen the collector's passes (a field that can hold a mutable container
    would need ``gc=True`` again)."""

    id: str
    owner: str
    gpus: int
    gpu_type: str
    min_runtime_ms: int
    resumable: bool
    priority: int
    submitted_ms: int
    submitted_by: str = ""
    duration_ms: int | None = None
    status: str = "pending"
    queued_ms: int = 0
    """Start of the current queue episode (submit or requeue)."""
    placement: tuple[Slot, ...] = ()
    started_ms: int = 0
    protected_until_ms: int = 0
    attempt: int = 0
    """Number of placements so far; the current run's number while running."""
    run_ms: int = 0
    """Progress: time run in finished earlier runs (preemption keeps it)."""
    preemptions: int = 0
    first_placed_ms: int | None = None
    legacy_priority: str = "high"
    legacy_preemptible: bool = False
    grace_ms: int | None = None
    """Its own preemption notice (``None``: the policy's)."""
    stopping: Stopping | None = None
    """Set while the current run is preempted with notice (status stays ``running``)."""

    @property
    def allocated(self) -> bool:
        """Charged to its owner (``min_runtime > 0``) rather than free and preemptible."""
        return is_allocated(self)


class StateSnapshot(msgspec.Struct, kw_only=True):
    """Everything :class:`State` holds, in a deterministic order; round-trips exactly."""

    now_ms: int
    input_seq: int
    decisions_folded: int
    policy: Policy
    budget: list[BudgetNode]
    nodes: list[ClusterNode]
    workloads: list[Workload]
    pending: list[str]
    running: list[str]
    ended: list[tuple[str, str]]
    rejections: list[tuple[str, str]]
    rejection_codes: list[str] | UnsetType = UNSET
    """The codes of ``rejections``, in order; written only while there are some (so
    a state without pending rejections encodes as it did before codes). ``""``: a
    code not known (a rejection restored from an older snapshot)."""


_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(StateSnapshot)


class State:
    """The folded state of one cluster."""

    __slots__ = (
        "now_ms",
        "input_seq",
        "decisions_folded",
        "policy",
        "budget",
        "nodes",
        "workloads",
        "pending",
        "running",
        "ended",
        "rejections",
        "pools",
        "gang_errors",
        "node_index",
        "pending_index",
        "active_by_owner",
        "protection_index",
        "stop_deadlines",
    )

    def __init__(self) -> None:
        self.now_ms = 0
        self.input_seq = 0
        """Number of inputs folded: the sequence of the last input in ``INPUTS``."""
        self.decisions_folded = 0
        self.policy = Policy()
        self.budget = BudgetTree()
        self.nodes: dict[str, ClusterNode] = {}
        self.workloads: dict[str, Workload] = {}
        """Live workloads (pending or running) by id."""
        self.pending: dict[str, Workload] = {}
        """Pending workloads by id; the pending index reads this very dict (change it
        in place, never replace it)."""
        self.running: dict[str, Workload] = {}
        self.ended: dict[str, str] = {}
        """Status of every ended or rejected workload id."""
        self.rejections: list[Rejection] = []
        """``(input id, reason, code)`` not yet announced by an ``InputRejected`` decision."""
        # derived, rebuilt on restore:
        self.pools: dict[tuple[str, int], int] = {}
        """``(gpu_type, gpus_per_node) -> number of nodes``."""
        self.pending_index = PendingIndex(self.pending)
        """Pending work in walk order (:mod:`apportion.core.pendingindex`; built when
        first read)."""
        self.node_index = NodeIndex()
        """Nodes by pool, health and free GPUs (:mod:`apportion.core.nodeindex`)."""
        self.gang_errors: dict[tuple[str, int], Refusal | None] = {}
        """Cache of :func:`_gang_error` by ``(gpu_type, gpus)``; cleared when pools change."""
        self.active_by_owner: dict[str, int] = {}
        """Live workloads per owner leaf."""
        self.protection_index = ProtectionIndex()
        """Running allocated work inside its protection (:mod:`apportion.core.protectionindex`)."""
        self.stop_deadlines: list[tuple[int, str]] = []
        """``(stop until, workload)`` of the runs stopping with notice, sorted (few
        at a time; derived from :attr:`Workload.stopping`, rebuilt on restore)."""

    # -- reading -------------------------------------------------------
    def usage(self, path: str) -> int:
        """GPU-ms charged to ``path``'s subtree inside ``[now - lookback, now]``."""
        return self.budget.nodes[path].series.window(self.now_ms, self.policy.lookback_ms)

    def status_of(self, workload: str) -> str | None:
        live = self.workloads.get(workload)
        if live is not None:
            return live.status
        return self.ended.get(workload)

    # -- snapshots -----------------------------------------------------
    def snapshot(self) -> StateSnapshot:
        return StateSnapshot(
            now_ms=self.now_ms,
            input_seq=self.input_seq,
            decisions_folded=self.decisions_folded,
            policy=self.policy,
            budget=[self.budget.nodes[p] for p in self.budget.nodes],
            nodes=list(self.nodes.values()),
            workloads=list(self.workloads.values()),
            pending=list(self.pending),
            running=list(self.running),
            ended=list(self.ended.items()),
            rejections=[(ref, reason) for ref, reason, _ in self.rejections],
            rejection_codes=(
                [code if isinstance(code, str) else "" for _, _, code in self.rejections]
                if self.rejections
                else UNSET
            ),
        )

    def to_bytes(self) -> bytes:
        return _snapshot_encoder.encode(self.snapshot())

    @classmethod
    def from_bytes(cls, data: bytes) -> State:
        return cls.from_snapshot(_snapshot_decoder.decode(data))

    @classmethod
    def from_snapshot(cls, snap: StateSnapshot) -> State:
        state = cls()
        state.now_ms = snap.now_ms
        state.input_seq = snap.input_seq
        state.decisions_folded = snap.decisions_folded
        state.policy = snap.policy
        state.budget = BudgetTree({n.path: n for n in snap.budget})
        state.nodes = {n.node: n for n in snap.nodes}
        state.workloads = {w.id: w for w in snap.workloads}
        # into the dict the pending index reads (and builds itself from when first read)
        state.pending.update((i, state.workloads[i]) for i in snap.pending)
        state.running = {i: state.workloads[i] for i in snap.running}
        state.ended = dict(snap.ended)
        codes: list[str] = (
            [] if isinstance(snap.rejection_codes, UnsetType) else snap.rejection_codes
        )
        state.rejections = [
            (ref, reason, (codes[i] if i < len(codes) else "") or UNSET)
            for i, (ref, reason) in enumerate(snap.rejections)
        ]
        for n in state.nodes.values():
            _add_pool(state, n)
        for w in state.workloads.values():
            state.active_by_owner[w.owner] = state.active_by_owner.get(w.owner, 0) + 1
        for w in state.running.values():
            _index_protection(state, w)
            if w.stopping is not None:
                state.stop_deadlines.append((w.stopping.until_ms, w.id))
        state.stop_deadlines.sort()
        return state

    def copy(self) -> State:
        """An independent deep copy."""
        return State.from_bytes(self.to_bytes())

    def digest(self) -> str:
        """A stable SHA-256 of the whole state (same events -> same digest, anywhere)."""
        return hashlib.sha256(self.to_bytes()).hexdigest()


# ----------------------------------------------------------------------
# The fold
# ----------------------------------------------------------------------


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


# -- hosts ----------------------------------------------------------------


def is_operator(state: State, actor: str) -> bool:
    """The root's owner or one the policy names (anyone while the root has no owner)."""
    root = state.budget.root.owner
    return root == "" or (actor != "" and (actor == root or actor in state.policy.operators))


def agent_of(node: str) -> str:
    """The identity of a host's own agent."""
    return f"agent:{node}"


def run_ended(
    state: State, workload: str, attempt: int, at_ms: int, event_id: str
) -> WorkloadFinished | None:
    """The end report of ``workload``'s run ``attempt`` by the agent of its first host,
    as a simulated executor sends it; ``None`` if that run is no longer the current one."""
    w = state.running.get(workload)
    if w is None or w.attempt != attempt:
        return None
    return WorkloadFinished(
        id=event_id,
        at_ms=at_ms,
        workload=workload,
        attempt=attempt,
        actor=agent_of(w.placement[0].node),
    )


def may_manage_node(state: State, actor: str, node: str) -> bool:
    """Register ``node``, change its health: an operator or the host's own agent."""
    return actor == agent_of(node) or is_operator(state, actor)


def _not_operator(actor: str, what: str, agent: str = "the host's own agent") -> str:
    return (
        f"{actor or '(no actor)'!s} may not {what}: only an operator (the budget root's "
        f"owner or one the policy names) or {agent}"
    )


def registration_refusal(state: State, e: NodeRegistered) -> Refusal | None:
    """Why ``e`` cannot register its host, or ``None``; used by the fold and the
    command layer (:mod:`apportion.core.commands`)."""
    if not e.node:
        return Refusal(R.INVALID_NAME, "node name is empty")
    if e.node in _DOT_NAMES:
        return Refusal(
            R.INVALID_NAME, f"node name {e.node!r} is not allowed (it names a folder on hosts)"
        )
    if not may_manage_node(state, e.actor, e.node):
        return Refusal(R.NOT_AUTHORISED, _not_operator(e.actor, f"register node {e.node!r}"))
    if e.gpus <= 0:
        return Refusal(R.NOT_POSITIVE, f"node {e.node!r}: gpus must be positive, got {e.gpus}")
    if is_any(e.gpu_type):
        return Refusal(R.INVALID_GPU_TYPE, f"node {e.node!r}: gpu_type must name a real GPU type")
    known = state.nodes.get(e.node)
    if known is not None:
        if known.gpus == e.gpus and known.gpu_type == e.gpu_type:
            return Refusal(R.NO_CHANGE, f"node {e.node!r} is already registered (no change)")
        if known.workloads:
            return Refusal(
                R.HAS_WORK, f"node {e.node!r} has running work; drain it before changing its GPUs"
            )
    return None


def _node_registered(state: State, e: NodeRegistered) -> None:
    _tick(state, e)
    problem = registration_refusal(state, e)
    if problem:
        return _reject(state, e, problem)
    known = state.nodes.get(e.node)
    if known is not None:
        _remove_pool(state, known)
        known.gpus, known.gpu_type, known.free = e.gpus, e.gpu_type, e.gpus
        _add_pool(state, known)
        return None
    node = ClusterNode(node=e.node, gpus=e.gpus, gpu_type=e.gpu_type, free=e.gpus)
    state.nodes[e.node] = node
    _add_pool(state, node)
    return None


def _add_pool(state: State, node: ClusterNode) -> None:
    """Count ``node`` in its pool and index it (a new node, or one changing size)."""
    state.gang_errors.clear()
    key = (node.gpu_type, node.gpus)
    state.pools[key] = state.pools.get(key, 0) + 1
    index = state.node_index
    index.register(node.node)
    index.set_health(node.node, "healthy", node.health)
    if node.schedulable:
        index.add_healthy(node.node, key, node.free)


def _remove_pool(state: State, node: ClusterNode) -> None:
    state.gang_errors.clear()
    key = (node.gpu_type, node.gpus)
    state.pools[key] -= 1
    if not state.pools[key]:
        del state.pools[key]
    index = state.node_index
    index.node_ids.remove(node.node)
    index.set_health(node.node, node.health, "healthy")
    if node.schedulable:
        index.remove_healthy(node.node, key, node.free)


def health_refusal(state: State, e: NodeHealthChanged) -> Refusal | None:
    """Why ``e`` cannot change its host's health, or ``None``; used by the fold and
    the command layer."""
    node = state.nodes.get(e.node)
    if node is None:
        return Refusal(R.UNKNOWN_NODE, f"unknown node {e.node!r}")
    if not may_manage_node(state, e.actor, e.node) and not (
        e.actor == SCHEDULER and e.state == "down"
    ):
        return Refusal(
            R.NOT_AUTHORISED, _not_operator(e.actor, f"change the health of node {e.node!r}")
        )
    if node.health == e.state:
        return Refusal(R.NO_CHANGE, f"node {e.node!r} is already {e.state} (no change)")
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


# -- budget and policy ------------------------------------------------------


def budget_set_refusal(state: State, e: BudgetSet) -> Refusal | None:
    """Why ``e`` cannot set its budget node, or ``None``; used by the fold and the
    command layer."""
    tree = state.budget
    problem = path_error(e.path)
    if problem:
        return Refusal(R.BAD_PATH, problem)
    if e.weight <= 0:
        return Refusal(
            R.NOT_POSITIVE, f"budget {e.path!r}: weight must be a positive integer, got {e.weight}"
        )
    if not e.owner:
        return Refusal(R.INVALID_NAME, f"budget {e.path!r}: owner is empty")
    if e.path != ROOT:
        parent = parent_of(e.path)
        if parent not in tree.nodes:
            return Refusal(
                R.UNKNOWN_PARENT,
                f"budget {e.path!r}: parent {parent!r} does not exist; create it first",
            )
    if not tree.may_edit(e.actor, e.path):
        where = "the root" if e.path == ROOT else f"{parent_of(e.path)!r} or an ancestor"
        return Refusal(R.NOT_AUTHORISED, f"budget {e.path!r}: {e.actor!r} does not own {where}")
    if e.path not in tree.nodes and e.path != ROOT:
        parent = parent_of(e.path)
        if state.active_by_owner.get(parent, 0):
            return Refusal(
                R.HAS_WORK,
                f"budget {e.path!r}: parent {parent!r} has pending or running work; a node with work cannot get children",
            )
    return None


def _budget_set(state: State, e: BudgetSet) -> None:
    _tick(state, e)
    problem = budget_set_refusal(state, e)
    if problem:
        return _reject(state, e, problem)
    state.budget.set_node(e.path, e.weight, e.owner)
    return None


def budget_removal_refusal(state: State, e: BudgetRemoved) -> Refusal | None:
    """Why ``e`` cannot remove its budget node, or ``None``; used by the fold and the
    command layer."""
    tree = state.budget
    node = tree.nodes.get(e.path)
    if e.path == ROOT:
        return Refusal(R.ROOT_NOT_REMOVABLE, "the root of the budget tree cannot be removed")
    if node is None:
        return Refusal(R.UNKNOWN_BUDGET_NODE, f"unknown budget node {e.path!r}")
    if not tree.may_edit(e.actor, e.path):
        return Refusal(
            R.NOT_AUTHORISED,
            f"budget {e.path!r}: {e.actor!r} does not own {parent_of(e.path)!r} or an ancestor",
        )
    if node.children:
        return Refusal(R.HAS_CHILDREN, f"budget {e.path!r} has children; remove them first")
    active = state.active_by_owner.get(e.path, 0)
    if active:
        return Refusal(R.HAS_WORK, f"budget {e.path!r} has {active} pending or running workloads")
    return None


def _budget_removed(state: State, e: BudgetRemoved) -> None:
    _tick(state, e)
    problem = budget_removal_refusal(state, e)
    if problem:
        return _reject(state, e, problem)
    state.budget.remove_node(e.path)
    return None


def policy_refusal(state: State, e: PolicySet) -> Refusal | None:
    """Why ``e`` cannot become the policy, or ``None``; used by the fold and the
    command layer."""
    if not state.budget.may_edit(e.actor, ROOT):
        return Refusal(
            R.NOT_AUTHORISED, f"policy: {e.actor!r} does not own the root of the budget tree"
        )
    if not 0 < e.lookback_ms <= MAX_LOOKBACK_MS:
        return Refusal(
            R.OUT_OF_RANGE,
            f"policy: lookback must be between 1 ms and 90 days, got {e.lookback_ms} ms",
        )
    if not 0 <= e.max_min_runtime_ms <= e.lookback_ms:
        return Refusal(R.OUT_OF_RANGE, "policy: max_min_runtime must be between 0 and the lookback")
    if not 0 <= e.preemption_margin_ppm < PPM:
        return Refusal(R.OUT_OF_RANGE, "policy: preemption margin must be in [0, 1)")
    if e.grace_ms > e.max_grace_ms:
        return Refusal(
            R.OUT_OF_RANGE,
            f"policy: grace ({e.grace_ms} ms) must not exceed max_grace ({e.max_grace_ms} ms)",
        )
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
    )
    return None


# -- workloads ----------------------------------------------------------------


_DOT_NAMES = frozenset({".", ".."})
"""Ids an executor cannot use as a folder name (a workload's or a node's files live
under its id on the hosts)."""


def submission_refusal(state: State, e: WorkloadSubmitted) -> Refusal | None:
    """Why ``e`` cannot be queued, or ``None``; used by the fold and the command layer.

    Changes nothing but a cache of gang checks (derived, never snapshotted)."""
    if not e.workload:
        return Refusal(R.INVALID_NAME, "workload id is empty")
    if e.workload in _DOT_NAMES:
        return Refusal(
            R.INVALID_NAME,
            f"workload id {e.workload!r} is not allowed (it names a folder on hosts)",
        )
    if e.workload in state.workloads or e.workload in state.ended:
        return Refusal(
            R.DUPLICATE_ID, f"workload {e.workload!r} already exists; ids are never reused"
        )
    budget = state.budget
    owner = budget.nodes.get(e.owner)
    if owner is None or e.owner == ROOT:
        return Refusal(
            R.UNKNOWN_OWNER, f"unknown owner {e.owner!r}: submit to a leaf of the budget tree"
        )
    if owner.children:  # not budget.is_leaf(e.owner)
        return Refusal(
            R.NOT_A_LEAF, f"owner {e.owner!r} is not a leaf of the budget tree (it has children)"
        )
    if not budget.owns(e.submitted_by, e.owner):
        who = e.submitted_by or "(no submitter)"
        return Refusal(
            R.NOT_AUTHORISED,
            f"{who} may not submit to {e.owner!r}: only its owner or the owner of a node above it",
        )
    if e.gpus <= 0:
        return Refusal(R.NOT_POSITIVE, f"gpus must be positive, got {e.gpus}")
    cap = state.policy.max_min_runtime_ms
    if not 0 <= e.min_runtime_ms <= cap:
        return Refusal(
            R.OVER_CAP,
            f"min_runtime must be between 0 and {cap // 60_000} min, got {e.min_runtime_ms} ms",
        )
    if e.duration_ms is not None and e.duration_ms < 0:
        return Refusal(R.OUT_OF_RANGE, f"duration must not be negative, got {e.duration_ms} ms")
    grace_cap = state.policy.max_grace_ms
    if e.grace_ms is not None and not 0 <= e.grace_ms <= grace_cap:
        return Refusal(
            R.OVER_CAP,
            f"grace must be between 0 and {grace_cap // 1000} s (the policy's max_grace), got {e.grace_ms} ms",
        )
    key = (e.gpu_type, e.gpus)
    gang_errors = state.gang_errors
    if key in gang_errors:
        return gang_errors[key]
    gang_errors[key] = error = _gang_error(state, e.gpu_type, e.gpus)
    return error


def submission_error(state: State, e: WorkloadSubmitted) -> str | None:
    """The message of :func:`submission_refusal` (for callers that want words only)."""
    problem = submission_refusal(state, e)
    return None if problem is None else problem.message


def _gang_error(state: State, gpu_type: str, gpus: int) -> Refusal | None:
    """Why ``gpus`` GPUs of ``gpu_type`` is not a valid gang on the registered nodes."""
    pools = [(t, gpn, n) for (t, gpn), n in state.pools.items() if takes(gpu_type, t)]
    if not pools:
        known = sorted({t for t, _ in state.pools})
        return Refusal(
            R.UNKNOWN_GPU_TYPE,
            f"no nodes of gpu_type {gpu_type!r} (known types: {', '.join(known) or 'none'})",
        )
    for _, gpn, count in pools:
        if gpus <= gpn or (gpus % gpn == 0 and gpus <= gpn * count):
            return None
    sizes = ", ".join(f"{n} x {gpn} {t}" for t, gpn, n in sorted(pools))
    return Refusal(
        R.INVALID_GANG,
        f"{gpus} GPUs is not a valid gang: at most one node's GPUs, or a multiple of "
        f"the node size within one pool ({sizes})",
    )


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


def gone_refusal(state: State, workload: str) -> Refusal:
    """Why a cancel or a report of ``workload``, which is not live, cannot apply: it
    was never submitted, or it has ended. The fold prefixes what was asked and calls
    an ended one's report stale (:func:`_stale_reason`)."""
    status = state.ended.get(workload)
    if status is None:
        return Refusal(R.UNKNOWN_WORKLOAD, f"unknown workload {workload!r}")
    return Refusal(R.ALREADY_ENDED, f"workload {workload!r} already ended as {status}")


def _stale_reason(state: State, workload: str, what: str) -> Refusal:
    gone = gone_refusal(state, workload)
    stale = " (stale report)" if gone.code == R.ALREADY_ENDED else ""
    return Refusal(gone.code, f"{what}: {gone.message}{stale}")


def cancel_authority_error(state: State, actor: str, w: Workload) -> str | None:
    """Why ``actor`` may not cancel ``w``, or ``None``: its submitter, or the owner of
    its leaf or of a node above it, may. Used by the fold and the gateway."""
    if (actor and actor == w.submitted_by) or state.budget.owns(actor, w.owner):
        return None
    return (
        f"{actor or '(no actor)'} may not cancel {w.id!r}: only its submitter or the "
        f"owner of {w.owner!r} or a node above it"
    )


def _workload_cancelled(state: State, e: WorkloadCancelled) -> None:
    _tick(state, e)
    w = state.workloads.get(e.workload)
    if w is None:
        return _reject(state, e, _stale_reason(state, e.workload, "cancel"))
    problem = cancel_authority_error(state, e.actor, w)
    if problem:
        return _reject(state, e, Refusal(R.NOT_AUTHORISED, f"cancel: {problem}"))
    if w.status == "running":
        _end_run(state, w)
    else:
        del state.pending[w.id]
        state.pending_index.remove(w)
    _end(state, w, "cancelled")
    return None


def _workload_finished(state: State, e: WorkloadFinished) -> None:
    _tick(state, e)
    w = state.workloads.get(e.workload)
    if w is None:
        return _reject(state, e, _stale_reason(state, e.workload, "finished"))
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
                _not_operator(
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
        return _reject(state, e, _stale_reason(state, e.workload, "started"))
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
                _not_operator(e.actor, f"report the start of {e.workload!r}", "its agent"),
            ),
        )
    return None


def _clock_ticked(state: State, e: ClockTicked) -> None:
    _tick(state, e)


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


def _index_protection(state: State, w: Workload) -> None:
    """Note running ``w`` in the protection index if it is allocated and protected."""
    if is_allocated(w) and w.protected_until_ms > state.now_ms:
        state.protection_index.add(w.id, w.owner, w.gpus, w.protected_until_ms)


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
    if allocated and until > now:  # _index_protection, spelled inline
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
    WorkloadPlaced: _workload_placed,
    WorkloadPreempted: _workload_preempted,
    NodeDrained: _node_drained,
    InputRejected: _input_rejected,
}
