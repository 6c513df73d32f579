"""The folded state of one cluster: nodes and their health, workloads pending,
running and ended, the budget tree with its usage window, the policy, and the
rejected inputs not yet announced; its digest and its snapshot.

It changes only through the fold (:mod:`apportion.core.fold`, one handler per
event kind); why an input is refused is :mod:`apportion.core.refusals`, who may
do what :mod:`apportion.core.rules.authority`. Decisions come only from the
scheduler: a decision that cannot apply means the history is corrupt and
raises :class:`CorruptHistory`.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec
from apportion.schemas.events import (
    DAY_MS,
    HOUR_MS,
    MINUTE_MS,
    LeafCharge,
    Slot,
)
from apportion.schemas.reasons import Refusal
from msgspec import UNSET, UnsetType

from .budget import BudgetNode, BudgetTree
from .nodeindex import NodeIndex
from .pendingindex import PendingIndex
from .protectionindex import ProtectionIndex
from .rules.contract import is_allocated

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
    preemption_margin_wait_ms: int | UnsetType = UNSET
    """A candidate queued this long is no longer held to the margin
    (:func:`apportion.core.rules.outranking.held_to_margin`); unset while 0 (always
    held), so a state whose policy sets no wait encodes as it did before the field
    existed. Read it as :attr:`margin_wait_ms`."""

    cluster: str | UnsetType = UNSET
    """This cluster's name among its peers (unset while ``""``, as are the next two
    fields at their defaults, so a single cluster encodes as before they existed)."""
    peers: tuple[str, ...] | UnsetType = UNSET
    usage_summary_ms: int | UnsetType = UNSET

    @property
    def cluster_name(self) -> str:
        return "" if isinstance(self.cluster, UnsetType) else self.cluster

    @property
    def reports_usage(self) -> bool:
        """A peer other than the cluster itself: the cycle reports its usage."""
        peers = () if isinstance(self.peers, UnsetType) else self.peers
        return any(p != self.cluster_name for p in peers)

    @property
    def summary_ms(self) -> int:
        """Length of one reported usage interval."""
        s = self.usage_summary_ms
        return 5 * MINUTE_MS if isinstance(s, UnsetType) else s

    @property
    def margin_wait_ms(self) -> int:
        """``preemption_margin_wait_ms``, 0 when unset (held however long it waits)."""
        wait = self.preemption_margin_wait_ms
        return 0 if isinstance(wait, UnsetType) else wait


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
    held_by: str | UnsetType = UNSET
    """Who held it (``WorkloadHeld``), while it is held: it stays pending but out
    of the pending index, so no cycle places it. Unset (and then not encoded, so
    a state without holds encodes as before the field existed) otherwise."""
    held_ms: int | UnsetType = UNSET
    """When it was held (set with :attr:`held_by`)."""

    @property
    def held(self) -> bool:
        return self.held_by is not UNSET

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
    input_ids: list[tuple[str, int]] | UnsetType = UNSET
    """:attr:`State.input_ids` in the order remembered; written only while there are
    some (a state that never saw a sending time encodes as it did before)."""
    federation: FederationSnapshot | UnsetType = UNSET
    """What a federated cluster keeps (written only once it reports or has folded a
    usage summary; one field, so that a single cluster's snapshot encodes byte for
    byte as before: msgpack's map header grows with the number of fields)."""


class FederationSnapshot(msgspec.Struct, kw_only=True):
    reported_until_ms: int | None = None
    """:attr:`State.reported_until_ms`."""
    peer_intervals: list[tuple[str, list[tuple[int, int]]]] = msgspec.field(default_factory=list)
    """:attr:`State.peer_intervals`, by source."""
    peer_committed: list[tuple[str, int, tuple[LeafCharge, ...]]] = msgspec.field(
        default_factory=list
    )
    """:attr:`State.peer_committed`, by source."""


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
        "input_ids",
        "input_id_expiry",
        "reported_until_ms",
        "peer_intervals",
        "peer_committed",
        "peer_committed_paths",
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
        self.input_ids: dict[str, int] = {}
        """The id of each input sent within the identity window -> until when it is
        remembered (:mod:`apportion.core.rules.identity`: an input is folded once)."""
        self.input_id_expiry: list[tuple[int, str]] = []
        """``(until, id)`` of :attr:`input_ids`, a heap (derived, rebuilt on restore)."""
        self.reported_until_ms: int | None = None
        """While the policy names peers: the end of the last usage interval this
        cluster reported (``UsageReported``); the next one starts there."""
        self.peer_intervals: dict[str, list[tuple[int, int]]] = {}
        """Per peer cluster, the intervals ``[start, end)`` whose usage summaries were
        folded, merged, sorted and disjoint (those ended before the longest
        lookback dropped): what was heard, so a repeat or an overlap is refused."""
        self.peer_committed: dict[str, tuple[int, tuple[LeafCharge, ...]]] = {}
        """Per peer cluster, ``(end of the interval, committed charges)`` of the latest
        interval folded from it: the commitments it reported then."""
        self.peer_committed_paths: tuple[object, dict[str, int]] | None = None
        """Derived, never stored: :attr:`peer_committed` summed per budget path (each
        node and its ancestors but the root), with the version of the tree it was
        summed on (the object :meth:`~apportion.core.budget.BudgetTree.weights_and_scales`
        returns, new after every change of the tree); cleared when a summary
        changes :attr:`peer_committed` (:func:`~apportion.core.rules.federation.peer_committed_paths`)."""

    # -- reading -------------------------------------------------------
    def usage(self, path: str) -> int:
        """GPU-ms charged to ``path``'s subtree inside ``[now - lookback, now]``, on
        this cluster and (from their usage summaries) on its peers."""
        return self.budget.nodes[path].charged(self.now_ms, self.policy.lookback_ms)

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
            input_ids=list(self.input_ids.items()) if self.input_ids else UNSET,
            federation=(
                FederationSnapshot(
                    reported_until_ms=self.reported_until_ms,
                    peer_intervals=[
                        (src, list(spans)) for src, spans in sorted(self.peer_intervals.items())
                    ],
                    peer_committed=[
                        (src, end, c) for src, (end, c) in sorted(self.peer_committed.items())
                    ],
                )
                if self.reported_until_ms is not None or self.peer_intervals or self.peer_committed
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
            add_pool(state, n)
        for w in state.workloads.values():
            state.active_by_owner[w.owner] = state.active_by_owner.get(w.owner, 0) + 1
        for w in state.running.values():
            index_protection(state, w)
            if w.stopping is not None:
                state.stop_deadlines.append((w.stopping.until_ms, w.id))
        state.stop_deadlines.sort()
        if not isinstance(snap.input_ids, UnsetType):
            state.input_ids = dict(snap.input_ids)
            state.input_id_expiry = sorted((until, ref) for ref, until in snap.input_ids)
        fed = snap.federation
        if not isinstance(fed, UnsetType):
            state.reported_until_ms = fed.reported_until_ms
            state.peer_intervals = {
                src: [(a, b) for a, b in spans] for src, spans in fed.peer_intervals
            }
            state.peer_committed = {src: (end, tuple(c)) for src, end, c in fed.peer_committed}
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


def add_pool(state: State, node: ClusterNode) -> None:
    """Count ``node`` in its pool and index it (a new node, or one changing size)."""
    state.gang_errors.clear()
    key = (node.gpu_type, node.gpus)
    state.pools[key] = state.pools.get(key, 0) + 1
    index = state.node_index
    index.register(node.node)
    index.set_health(node.node, "healthy", node.health)
    if node.schedulable:
        index.add_healthy(node.node, key, node.free)


def remove_pool(state: State, node: ClusterNode) -> None:
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


def index_protection(state: State, w: Workload) -> None:
    """Note running ``w`` in the protection index if it is allocated and protected."""
    if is_allocated(w) and w.protected_until_ms > state.now_ms:
        state.protection_index.add(w.id, w.owner, w.gpus, w.protected_until_ms)
