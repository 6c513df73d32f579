"""Read models the gateway serves: queue, share, budget tree, explain (pure functions of state).

``History`` is what a follower remembers beyond the state: the last preemption
of each workload and the reasons for rejected submissions, for ``explain``, the
last cycle's basis and wake-up, for the start-time estimates
(:mod:`apportion.core.estimate`), and every workload's submission, attempts and
end (:class:`~apportion.services.job_history.JobHistory`), for ``explain`` of
an ended workload and ``apportion jobs``.

Times in text are ISO-8601 (UTC) with a relative part (``in 2 h 14 min``,
``3 min ago``) measured to ``now_ms``: the wall clock on a live stack, the
state's own time for history. JSON keeps the epoch milliseconds. Inside
:func:`simulated_clock` (offline answers from a simulation, whose time starts at
epoch 0) times read ``day D HH:MM`` instead of 1970 dates.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from fractions import Fraction
from typing import Any

import msgspec
from apportion.core.budget import ROOT, ancestors_of, parent_of
from apportion.core.cycle import decide
from apportion.core.estimate import ASSUMPTION, Estimates, estimate_starts
from apportion.core.history import fold_item
from apportion.core.ordering import FairShareView, SiblingKey, queue_order, sibling_key
from apportion.core.rules.contract import is_protected, may_use_reserved
from apportion.core.rules.federation import heard_until, peer_committed_paths
from apportion.core.rules.gpu_types import is_any, overlap, takes
from apportion.core.state import ClusterNode, State, Workload
from apportion.schemas.bounds import MAX_NAME_LEN, MAX_PATH_LEN
from apportion.schemas.events import (
    ANY_GPU_TYPE,
    HOUR_MS,
    InputRejected,
    NodeHealthChanged,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadSubmitted,
)
from apportion.schemas.history import HistoryItem, InputItem
from msgspec import UNSET, UnsetType

from .job_history import JobHistory, QueryError, job_json, job_words, parse_gpu_type

DAY_MS = 24 * 3_600_000
SIMULATED_BEFORE_MS = 946_684_800_000
"""2000-01-01T00:00:00Z: a history whose time is before this is a simulation's
(simulated time starts at epoch 0), and its times read ``day D HH:MM``."""

_SIM_CLOCK: ContextVar[bool] = ContextVar("apportion_simulated_clock", default=False)


def is_simulated(now_ms: int) -> bool:
    """Whether a history at ``now_ms`` is a simulation's (time before 2000)."""
    return now_ms < SIMULATED_BEFORE_MS


@contextmanager
def simulated_clock(on: bool = True) -> Iterator[None]:
    """Within it (``on``), :func:`iso` and :func:`when` write ``day D HH:MM``."""
    token = _SIM_CLOCK.set(on)
    try:
        yield
    finally:
        _SIM_CLOCK.reset(token)


def sim_time(ms: int) -> str:
    """Simulated time for people: ``day 3 14:05`` (day 0 starts at epoch 0, as the
    analyst views' ``day`` column counts)."""
    day, rest = divmod(ms, DAY_MS)
    hours, minutes = divmod(rest // 60_000, 60)
    return f"day {day} {hours:02d}:{minutes:02d}"


def iso(ms: int) -> str:
    """Epoch ms as ISO-8601 UTC, to the second (``2026-11-30T14:05:09Z``), or
    ``day D HH:MM`` within :func:`simulated_clock`."""
    if _SIM_CLOCK.get():
        return sim_time(ms)
    t = _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def span(ms: int) -> str:
    """A duration for people: ``45 s``, ``12 min``, ``2 h 14 min``, ``3 d 4 h``."""
    s = abs(ms) // 1000
    if s < 60:
        return f"{s} s"
    m = s // 60
    if m < 60:
        return f"{m} min"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h} h {m} min" if m else f"{h} h"
    d, h = divmod(h, 24)
    return f"{d} d {h} h" if h else f"{d} d"


def relative(ms: int, now_ms: int) -> str:
    """``in 2 h 14 min``, ``3 min ago`` or ``now`` (within a second)."""
    delta = ms - now_ms
    if abs(delta) < 1000:
        return "now"
    return f"in {span(delta)}" if delta > 0 else f"{span(delta)} ago"


def when(ms: int, now_ms: int) -> str:
    """``2026-11-30T16:19:00Z (in 2 h 14 min)``."""
    return f"{iso(ms)} ({relative(ms, now_ms)})"


def gpu_hours(gpu_ms: float) -> str:
    """GPU-milliseconds as GPU-hours with the unit (``12.5 GPU-h``)."""
    h = gpu_ms / HOUR_MS
    return f"{h:.3g} GPU-h" if h < 100 else f"{h:,.0f} GPU-h"


def is_federated(state: State) -> bool:
    """Whether usage on other clusters may count here: the policy names a peer, or a
    peer's usage summary was folded (a summary is taken from any cluster, listed or not)."""
    return state.policy.reports_usage or bool(state.peer_intervals) or bool(state.peer_committed)


SHARE_BASIS_CAPACITY = "capacity"
SHARE_BASIS_TREE_USAGE = "tree_usage"
SHARE_BASIS_WORDS = {
    SHARE_BASIS_CAPACITY: "of its share of this cluster's healthy GPUs over the window",
    SHARE_BASIS_TREE_USAGE: "of its share of what the whole tree used on every cluster",
}
"""What :func:`share_pct` is a percentage of, by ``share_basis``."""


def share_basis(state: State) -> str:
    """``capacity`` on a single cluster, ``tree_usage`` on a federated one
    (:func:`share_pct`)."""
    return SHARE_BASIS_TREE_USAGE if is_federated(state) else SHARE_BASIS_CAPACITY


def ranked_total(view: FairShareView, path: str) -> int:
    """What ranks ``path``: charged + committed, on every cluster. The root has no
    committed charge of its own in the view; its total is its children's."""
    if path != ROOT:
        return view.usage[path]
    return view.charged[ROOT] + sum(view.committed.get(c, 0) for c in view.tree.root.children)


def share_pct(state: State, view: FairShareView, path: str) -> float | None:
    """``path``'s usage (charged + committed, what ranks it) as a percentage of its
    share. On a single cluster the share is of the window's capacity: global share x
    healthy GPUs x lookback. On a federated cluster (:func:`is_federated`) usage
    counts every cluster's but only this cluster's capacity is known, so the share
    is of what the whole tree used: global share x the root's usage (100: it used
    exactly its share of what ran). ``None`` without capacity (or usage). Among
    siblings it orders exactly as the ratio usage / weight, on either basis."""
    gshare = float(state.budget.global_share(path))
    if is_federated(state):
        allocation = gshare * ranked_total(view, ROOT)
        return 100.0 * ranked_total(view, path) / allocation if allocation > 0 else None
    allocation = gshare * _capacity_gpus(state) * state.policy.lookback_ms
    if allocation <= 0:
        return None
    return 100.0 * view.usage[path] / allocation


class PeerRanking:
    """Where usage on other clusters is what ranks a leaf low: a level of its path
    whose place among its siblings would be better were every node's usage on other
    clusters (charged and reported committed) left out, its siblings' too. Empty on
    a single cluster; cached per path (the queue asks it per row)."""

    def __init__(self, state: State, view: FairShareView) -> None:
        self.view = view
        self.on = is_federated(state)
        self.peer: dict[str, int] = {}
        """Per node, its usage on other clusters: charged in the window plus committed."""
        if self.on:
            now, lookback = state.now_ms, state.policy.lookback_ms
            for path, node in state.budget.nodes.items():
                if (g := node.peer_charged(now, lookback)) > 0:
                    self.peer[path] = g
            for p, gpu_ms in peer_committed_paths(state).items():
                self.peer[p] = self.peer.get(p, 0) + gpu_ms
        self._lowered: dict[str, bool] = {}

    def lowered(self, leaf: str) -> list[tuple[str, int]]:
        """``(path, its usage on other clusters)`` of each level of ``leaf``'s path,
        top down, that ranks lower among its siblings because of such usage."""
        if not self.on:
            return []
        return [
            (p, self.peer.get(p, 0)) for p in [*ancestors_of(leaf)[1:], leaf] if self._is_lowered(p)
        ]

    def _is_lowered(self, path: str) -> bool:
        got = self._lowered.get(path)
        if got is None:
            v = self.view
            siblings = v.tree.nodes[parent_of(path)].children

            def key(c: str) -> SiblingKey:
                return sibling_key(v.usage[c] - self.peer.get(c, 0), v.scale[c], v.weight[c], c)

            mine = key(path)
            without = sum(1 for c in siblings if key(c) < mine)
            got = self._lowered[path] = without < v.rank(path)
        return got

    def words(self, leaf: str) -> str | None:
        """``llm (12 GPU-h there)``: the levels :meth:`lowered` names, or ``None``."""
        lowered = self.lowered(leaf)
        if not lowered:
            return None
        return ", ".join(f"{p} ({gpu_hours(g)} there)" for p, g in lowered)


def _ratio_rows(state: State, view: FairShareView, leaf: str) -> list[dict[str, Any]]:
    return [
        {
            "path": p,
            "usage_gpu_ms": u,
            "weight": wt,
            "ratio": _ratio(r),
            "share_pct": share_pct(state, view, p),
        }
        for p, u, wt, r in view.path_ratios(leaf)
    ]


def _ratio(r: Fraction) -> dict[str, Any]:
    return {"value": float(r), "exact": f"{r.numerator}/{r.denominator}"}


class History:
    """Facts ``explain`` needs that the fold forgets.

    Feed it each item with :meth:`observe` right after folding it (the job
    history needs the state of that moment) and, in order, with :meth:`record`
    (one item or many at a time)."""

    def __init__(self, cluster: str = "<cluster>", agent_work_dir: str | None = None) -> None:
        self.submit_ids: dict[str, str] = {}
        self.other_ids: dict[str, str] = {}
        self.rejected: dict[str, str] = {}
        self.preempted: dict[str, WorkloadPreempted] = {}
        self.placed: dict[str, WorkloadPlaced] = {}
        self.basis: int | None = None
        """Input the last decision batch was based on (``None``: none seen)."""
        self.next_wakeup_ms: int | None = None
        """The last cycle's wake-up (the last part of a cycle carries it)."""
        self.jobs = JobHistory()
        """Every workload's submission, attempts and end."""
        self.node_changes: dict[str, dict[str, Any]] = {}
        """Each host's last health change the fold took: ``{"at_ms","state","actor",
        "reason"}`` (``apportion nodes``; a host changed before this reader began has none)."""
        self.cluster = cluster
        self.agent_work_dir = agent_work_dir
        """The host agents' ``--work-dir``, where known (``apportion up --agents``):
        the log locations ``explain`` gives start with it (else ``<work-dir>``)."""

    def observe(self, item: HistoryItem, state: State, rejected: str | None) -> None:
        """``item`` was just folded into ``state`` (``rejected``: why an input changed nothing)."""
        self.jobs(item, state, rejected)
        if rejected is None and isinstance(item, InputItem):
            e = item.event
            if isinstance(e, NodeHealthChanged):
                self.node_changes[e.node] = {
                    "at_ms": item.at_ms,
                    "state": e.state,
                    "actor": e.actor,
                    "reason": "" if e.reason is UNSET else e.reason,
                }

    def job(self, workload: str) -> dict[str, Any] | None:
        """``workload``'s history as JSON (docs/formats.md), if it is kept."""
        job = self.jobs.get(workload)
        return None if job is None else job_json(job, self.cluster, self.agent_work_dir)

    def record(self, items: Iterable[HistoryItem]) -> None:
        for item in items:
            if isinstance(item, InputItem):
                e = item.event
                if isinstance(e, WorkloadSubmitted):
                    self.submit_ids[e.id] = e.workload
                elif e is not None and isinstance(workload := getattr(e, "workload", None), str):
                    self.other_ids[e.id] = workload
                continue
            self.basis = item.batch.basis
            self.next_wakeup_ms = item.batch.next_wakeup_ms
            for d in item.batch.decisions:
                if isinstance(d, WorkloadPreempted):
                    self.preempted[d.workload] = d
                elif isinstance(d, WorkloadPlaced):
                    self.placed[d.workload] = d
                elif isinstance(d, InputRejected) and d.ref in self.submit_ids:
                    self.rejected[self.submit_ids[d.ref]] = d.reason


def workload_json(w: Workload) -> dict[str, Any]:
    return {
        "workload": w.id,
        "owner": w.owner,
        "gpus": w.gpus,
        "gpu_type": w.gpu_type,
        "min_runtime_ms": w.min_runtime_ms,
        "resumable": w.resumable,
        "priority": w.priority,
        "allocated": w.allocated,
        "submitted_ms": w.submitted_ms,
        "queued_ms": w.queued_ms,
        "status": w.status,
        "attempt": w.attempt,
        "preemptions": w.preemptions,
        "duration_ms": w.duration_ms,
        "submitted_by": w.submitted_by,
        **({"held_by": w.held_by, "held_ms": w.held_ms} if w.held else {}),
    }


def estimate_context(state: State, history: History | None) -> dict[str, Any]:
    """How to estimate from ``state``: right after the cycle ``history`` saw last
    (``decided``, its wake-up known), or, when inputs were folded that no cycle has
    seen, with a cycle at once (keyword arguments of ``estimate_starts``)."""
    decided = history is not None and history.basis == state.input_seq
    wakeup = history.next_wakeup_ms if decided and history is not None else None
    return {"next_wakeup_ms": wakeup, "decided": decided}


def estimates_for(state: State, history: History | None, only: str | None = None) -> Estimates:
    """Start-time estimates (:func:`~apportion.core.estimate.estimate_starts`) for
    ``state`` (see :func:`estimate_context`)."""
    return estimate_starts(state, only=only, **estimate_context(state, history))


QUEUE_STATES = ("pending", "running")
"""The values of ``apportion queue --state`` and ``GET /v1/queue?state=``."""


def gpu_types_of(state: State) -> list[str]:
    """The GPU types of the cluster's nodes, sorted (what ``--gpu-type`` may name)."""
    return sorted({n.gpu_type for n in state.nodes.values()})


class QueueFilter(msgspec.Struct, frozen=True):
    """Which workloads ``queue`` shows (like ``squeue -u/-A/-t``): every filter given
    must hold; ``None``: any."""

    user: str | None = None
    """``submitted_by`` equals it."""
    team: str | None = None
    """The owner leaf is this budget path or below it (by whole segments)."""
    state: str | None = None
    """``pending`` or ``running``: the other section is left empty."""
    gpu_type: str | None = None
    """The GPU type the workload asked for (``any``: work that takes any type)."""

    @classmethod
    def parse(cls, query: Any, gpu_types: Iterable[str] = ()) -> QueueFilter:
        """From ``GET /v1/queue``'s parameters (``gpu_types``: the cluster's, that
        ``gpu_type`` must name); :class:`QueryError` names the first one out of its
        form or bound."""
        unknown = sorted(set(query) - {"user", "team", "state", "gpu_type"})
        if unknown:
            raise QueryError(
                f"unknown parameter {unknown[0][:64]!r} (known: user, team, state, gpu_type)"
            )
        user = query.get("user") or None
        if user is not None and len(user) > MAX_NAME_LEN:
            raise QueryError(f"user: at most {MAX_NAME_LEN} characters")
        team = query.get("team") or None
        if team is not None:
            if len(team) > MAX_PATH_LEN:
                raise QueryError(f"team: at most {MAX_PATH_LEN} characters")
            team = team.strip("/") or None
        state = query.get("state") or None
        if state is not None and state not in QUEUE_STATES:
            raise QueryError(f"state: {state[:64]!r} is not one of {', '.join(QUEUE_STATES)}")
        return cls(user, team, state, parse_gpu_type(query.get("gpu_type"), gpu_types))

    def matches(self, w: Workload) -> bool:
        if self.state is not None and w.status != self.state:
            return False
        if self.gpu_type is not None and (w.gpu_type or ANY_GPU_TYPE) != self.gpu_type:
            return False
        if self.user is not None and w.submitted_by != self.user:
            return False
        return not (
            self.team is not None
            and not (w.owner == self.team or w.owner.startswith(self.team + "/"))
        )

    def as_json(self) -> dict[str, str | None]:
        return {
            "user": self.user,
            "team": self.team,
            "state": self.state,
            "gpu_type": self.gpu_type,
        }


WAIT_REASONS: dict[str, str] = {
    "held": "held (apportion hold): no cycle places it until it is released",
    "fits_soon": "it fits in the free GPUs now: the next cycle places it",
    "waiting_for_notice": "runs preempted for it are stopping with notice; it starts when "
    "their GPUs come free",
    "holds_reservation": "it holds the reservation: nodes are kept for it until their "
    "protected runs end",
    "reserved_for_other": "the free GPUs it could use are kept for another workload: "
    "reserved for it (and this one would still be protected when the reservation starts), "
    "or on nodes whose runs are stopping for it",
    "unallocated_waits": "unallocated (min_runtime 0): it waits for free GPUs and never preempts",
    "outranked": "work ranked ahead of it wants the same nodes",
    "waiting_for_protection": "the GPUs it needs are held by runs still protected by their "
    "minimum runtime",
    "waiting_for_share": "the GPUs it needs are held by runs it may not preempt: its team is "
    "not under-served enough (by the preemption margin)",
    "no_nodes_of_type": "no healthy node of its GPU type",
    "gang_too_large": "more GPUs at once than the healthy nodes of its type can hold",
}
"""Why a pending workload waits: a stable code (docs/reasons.md, "Why a workload
waits") and its meaning. The first that applies, in this order, is its ``reason``."""


def _fits(gpus: int, nodes: Iterable[ClusterNode], free: bool) -> bool:
    """``gpus`` fit on ``nodes`` as the scheduler places them: on one node, or a gang of
    whole nodes of one size; ``free``: in the GPUs free now, else on empty nodes."""
    whole: dict[int, int] = {}
    for n in nodes:
        if gpus <= n.gpus and (not free or n.free >= gpus):
            return True
        if gpus > n.gpus and gpus % n.gpus == 0 and (not free or n.free == n.gpus):
            whole[n.gpus] = whole.get(n.gpus, 0) + 1
    return any(count * size >= gpus for size, count in whole.items())


class WaitContext:
    """What :func:`wait_reason` needs once per state: the queue order and the
    reservation the next cycle would make (one cycle's cost)."""

    def __init__(self, state: State) -> None:
        self.order = queue_order(state, FairShareView(state))
        self.rank = {w.id: i for i, w in enumerate(self.order)}
        self.reservation = decide(state, report_reservation=True).reservation
        self.held: dict[str, str] = {}
        """Node -> the workload its stopping runs were preempted for (held for it)."""
        for r in state.running.values():
            if r.stopping is not None and r.stopping.for_workload:
                for slot in r.placement:
                    self.held[slot.node] = r.stopping.for_workload
        self.notice_for = set(self.held.values())


def wait_reason(state: State, w: Workload, ctx: WaitContext) -> str:
    """Why pending ``w`` waits: the first code of :data:`WAIT_REASONS` that applies."""
    if w.held:
        return "held"
    fits = [n for n in state.nodes.values() if n.schedulable and takes(w.gpu_type, n.gpu_type)]
    if not fits:
        return "no_nodes_of_type"
    if not _fits(w.gpus, fits, free=False):
        return "gang_too_large"
    if w.id in ctx.notice_for:
        return "waiting_for_notice"
    reservation = ctx.reservation
    if reservation is not None and reservation.workload == w.id and w.allocated:
        return "holds_reservation"
    kept = {n for n, for_w in ctx.held.items() if for_w != w.id}
    if (
        reservation is not None
        and reservation.workload != w.id
        and not may_use_reserved(state.now_ms, w.min_runtime_ms, reservation.start_ms)
    ):
        kept.update(reservation.nodes)
    usable = [n for n in fits if n.node not in kept]
    if _fits(w.gpus, usable, free=True):
        return "fits_soon"
    if _fits(w.gpus, fits, free=True):
        return "reserved_for_other"
    if not w.allocated:
        return "unallocated_waits"
    rank = ctx.rank.get(w.id, 0)
    if any(a.allocated and overlap(a.gpu_type, w.gpu_type) for a in ctx.order[:rank]):
        return "outranked"
    if protections_bound(state, w, fits) is not None:
        return "waiting_for_protection"
    return "waiting_for_share"


def _estimate_fields(est: Estimates, wid: str, now_ms: int) -> dict[str, Any]:
    start = est.starts.get(wid)
    if start is None:
        return {"estimated_start_ms": None, "estimate_note": est.why_unknown(wid)}
    return {"estimated_start_ms": max(start, now_ms)}


def queue_view(
    state: State,
    history: History | None = None,
    *,
    now_ms: int | None = None,
    estimates: Estimates | None = None,
    only: QueueFilter | None = None,
    wait_context: WaitContext | None = None,
) -> dict[str, Any]:
    """Pending workloads in the order the next cycle considers them
    (:func:`~apportion.core.ordering.queue_order`) with the ratios that rank them
    and the estimated start; running ones after.

    ``now_ms`` (default: the state's time) is what waits are measured to: the
    gateway passes its wall clock. ``estimates`` default to :func:`estimates_for`.
    ``only``: the workloads shown (``position`` stays the place in the whole queue;
    ``totals`` counts every pending and running workload). Each pending row has a
    ``reason`` code (:data:`WAIT_REASONS`) and its ``reason_text``; ``wait_context``
    (made here when not given: one cycle's cost) is what they come from. On a
    federated cluster, a row whose team ranks low because of its usage on other
    clusters has ``other_clusters`` (:class:`PeerRanking`)."""
    now = max(state.now_ms, now_ms if now_ms is not None else state.now_ms)
    est = estimates if estimates is not None else estimates_for(state, history)
    view = FairShareView(state)
    only = only if only is not None else QueueFilter()
    ctx = wait_context if wait_context is not None else WaitContext(state)
    ranking = PeerRanking(state, view)
    pending = []
    for i, w in enumerate(ctx.order, start=1):
        if not only.matches(w):
            continue
        row = workload_json(w)
        row["position"] = i
        row["reason"] = code = wait_reason(state, w, ctx)
        row["reason_text"] = WAIT_REASONS[code]
        row["wait_ms"] = max(0, now - w.queued_ms)
        row["ratios"] = _ratio_rows(state, view, w.owner) if w.allocated else []
        if w.allocated and (lowered := ranking.words(w.owner)) is not None:
            row["other_clusters"] = lowered
        row.update(_estimate_fields(est, w.id, now))
        pending.append(row)
    # held work is out of the order the cycle walks: after it, by submit time
    for w in sorted(
        (w for w in state.pending.values() if w.held), key=lambda w: (w.submitted_ms, w.id)
    ):
        if not only.matches(w):
            continue
        row = workload_json(w)
        row["position"] = None
        row["reason"] = "held"
        row["reason_text"] = WAIT_REASONS["held"]
        row["wait_ms"] = max(0, now - w.queued_ms)
        row["ratios"] = []
        row["estimated_start_ms"] = None
        row["estimate_note"] = "no estimate: it is held until released"
        pending.append(row)
    running = []
    for w in sorted(state.running.values(), key=lambda w: (w.started_ms, w.id)):
        if not only.matches(w):
            continue
        row = workload_json(w)
        row["started_ms"] = w.started_ms
        row["protected_until_ms"] = w.protected_until_ms
        row["placement"] = [[s.node, s.gpus] for s in w.placement]
        end = est.ends.get(w.id)
        row["expected_end_ms"] = None if end is None else max(end, now)
        running.append(row)
    return {
        "at_ms": state.now_ms,
        "now_ms": now,
        "input_seq": state.input_seq,
        "estimate_assumption": ASSUMPTION,
        "pending": pending,
        "running": running,
        "filter": only.as_json(),
        "totals": {"pending": len(state.pending), "running": len(state.running)},
    }


NODE_STATES = ("healthy", "draining", "down")
"""The values of ``apportion nodes --state`` and ``GET /v1/nodes?state=``."""


def parse_node_query(query: Any) -> str | None:
    """The ``state`` filter of ``GET /v1/nodes`` (``None``: every node);
    :class:`QueryError` for an unknown parameter or state."""
    unknown = sorted(set(query) - {"state"})
    if unknown:
        raise QueryError(f"unknown parameter {unknown[0][:64]!r} (known: state)")
    text = query.get("state")
    if text is None or text == "":
        return None
    if text not in NODE_STATES:
        raise QueryError(f"state: {text[:64]!r} is not one of {', '.join(NODE_STATES)}")
    return str(text)


def nodes_view(
    state: State,
    history: History | None = None,
    *,
    only: str | None = None,
    now_ms: int | None = None,
) -> dict[str, Any]:
    """Every host (like ``sinfo``), by name: its GPU type, GPUs, free GPUs, health,
    whether a draining one is drained (empty), the workloads running on it, when
    the last protection of its runs ends, and its last health change (who, when,
    why) when ``history`` saw it. ``only``: hosts in this health state."""
    now = max(state.now_ms, now_ms if now_ms is not None else state.now_ms)
    changes = history.node_changes if history is not None else {}
    rows = []
    for name in sorted(state.nodes):
        n = state.nodes[name]
        if only is not None and n.health != only:
            continue
        runs = sorted(n.workloads)
        protected = [
            state.running[w].protected_until_ms
            for w in runs
            if w in state.running and is_protected(state.running[w], state.now_ms)
        ]
        rows.append(
            {
                "node": name,
                "gpu_type": n.gpu_type,
                "gpus": n.gpus,
                "free": n.free,
                "state": n.health,
                "drained": n.health == "draining" and n.drained,
                "workloads": runs,
                "protected_until_ms": max(protected) if protected else None,
                "last_change": changes.get(name),
            }
        )
    return {"at_ms": state.now_ms, "now_ms": now, "state": only, "nodes": rows}


def _capacity_gpus(state: State) -> int:
    return sum(n.gpus for n in state.nodes.values() if n.health != "down")


def budget_tree(state: State, detail: bool = False) -> dict[str, Any]:
    """The budget tree as nested ``{"path","weight","owner","global_share","usage_gpu_h",
    "committed_gpu_h","children"}``;
    with ``detail`` (the ``share`` view) also allocation against usage, like ``sshare``."""
    tree = state.budget
    view = FairShareView(state)
    root_usage = view.charged[ROOT]
    federated = is_federated(state)
    lookback = state.policy.lookback_ms
    capacity = _capacity_gpus(state)
    window_h = state.policy.lookback_ms / HOUR_MS
    running: dict[str, int] = {}
    pending: dict[str, int] = {}
    for w in state.workloads.values():
        if not w.allocated:
            continue
        target = running if w.status == "running" else pending
        path = w.owner
        while True:
            target[path] = target.get(path, 0) + w.gpus
            if path == ROOT:
                break
            path = path.rsplit("/", 1)[0] if "/" in path else ROOT

    def node(path: str) -> dict[str, Any]:
        n = tree.nodes[path]
        gshare = tree.global_share(path)
        out: dict[str, Any] = {
            "path": path,
            "weight": n.weight,
            "owner": n.owner,
            "global_share": float(gshare),
            "usage_gpu_h": view.charged[path] / HOUR_MS,
            "committed_gpu_h": view.committed.get(path, 0) / HOUR_MS,
        }
        if detail and federated:
            here = n.series.window(state.now_ms, lookback)
            out.update(
                usage_here_gpu_h=here / HOUR_MS,
                usage_peers_gpu_h=(view.charged[path] - here) / HOUR_MS,
                ranked_gpu_h=ranked_total(view, path) / HOUR_MS,
                share_pct=share_pct(state, view, path),
            )
        if detail:
            effective = Fraction(view.charged[path], root_usage) if root_usage else Fraction(0)
            out.update(
                share=float(tree.share(path)),
                allocation_gpu_h=float(gshare) * capacity * window_h,
                effective_usage=float(effective),
                usage_vs_share=float(effective / gshare) if gshare else 0.0,
                ratio=_ratio(view.ratio(path)),
                running_gpus=running.get(path, 0),
                pending_gpus=pending.get(path, 0),
            )
        out["children"] = [node(c) for c in n.children]
        return out

    top = node(ROOT)
    if detail and federated:
        top["federation"] = federation_json(state)
    return top


def peers_heard(state: State) -> list[dict[str, Any]]:
    """Per peer cluster (named by the policy, or heard from), what of its usage was
    folded: ``heard_until_ms``, the end of the last interval folded from it (``None``:
    nothing yet), ``heard_from_ms`` where the intervals kept start, and ``gaps``,
    the intervals between those not heard of (their usage is not counted yet)."""
    me = state.policy.cluster_name
    named = () if isinstance(state.policy.peers, UnsetType) else state.policy.peers
    rows = []
    for source in sorted({p for p in named if p != me} | set(state.peer_intervals)):
        spans = state.peer_intervals.get(source, [])
        rows.append(
            {
                "cluster": source,
                "heard_from_ms": spans[0][0] if spans else None,
                "heard_until_ms": heard_until(state, source),
                "gaps": [[a[1], b[0]] for a, b in zip(spans, spans[1:], strict=False)],
            }
        )
    return rows


def federation_json(state: State) -> dict[str, Any]:
    """The share view's word on the federation: this cluster, the peers heard from
    (:func:`peers_heard`) and what ``share_pct`` is a percentage of."""
    basis = share_basis(state)
    return {
        "cluster": state.policy.cluster_name,
        "peers": peers_heard(state),
        "share_basis": basis,
        "share_basis_text": SHARE_BASIS_WORDS[basis],
    }


def peers_words(peers: list[dict[str, Any]], now_ms: int) -> list[str]:
    """One line per peer cluster of :func:`peers_heard`: until when its usage is
    counted here, and the first interval not heard of, if any."""
    out = []
    for p in peers:
        until = p["heard_until_ms"]
        if until is None:
            out.append(f"{p['cluster']}: nothing heard yet (its usage is not counted)")
            continue
        line = f"{p['cluster']}: usage counted until {when(until, now_ms)}"
        if p["gaps"]:
            a, b = p["gaps"][0]
            more = f" and {len(p['gaps']) - 1} more" if len(p["gaps"]) > 1 else ""
            line += f"; not heard of: {iso(a)} to {iso(b)}{more}"
        out.append(line)
    return out


def explain(
    state: State,
    history: History,
    workload: str,
    *,
    now_ms: int | None = None,
    estimates: Estimates | None = None,
) -> dict[str, Any] | None:
    """Why ``workload`` is pending, running, preempted or ended; ``None`` if unknown.

    ``now_ms`` (default: the state's time) is what relative times are measured to;
    ``estimates`` default to :func:`estimates_for` (only for this workload)."""
    now = max(state.now_ms, now_ms if now_ms is not None else state.now_ms)
    w = state.workloads.get(workload)
    last_pre = history.preempted.get(workload)
    pre_txt = None
    if last_pre is not None:
        pre_txt = f"preempted at {when(last_pre.at_ms, now)} ({last_pre.reason}"
        if last_pre.for_workload:
            pre_txt += f", to make room for {last_pre.for_workload}"
        pre_txt += ", requeued)" if last_pre.requeued else ", not resumable: ended)"
    job = history.job(workload)
    if w is None:
        status = state.ended.get(workload)
        if status is None and job is not None and job["status"] == "rejected":
            status = "rejected"
        if status is None and workload in history.rejected:
            return {
                "workload": workload,
                "status": "rejected",
                "reasons": [history.rejected[workload]],
            }
        if status is None:
            return None
        if job is not None and job["status"] == status:
            return {
                "workload": workload,
                "status": status,
                "now_ms": now,
                "reasons": job_words(job, now),
                "job": job,
            }
        ended = [f"ended as {status}"]
        if status == "preempted" and pre_txt:
            ended.append(pre_txt)
        if job is None:
            ended.append(
                f"its attempts are not kept here any more (the last {history.jobs.max_ended:,} "
                "ended workloads are); the projection has them (apportion sql, explain --log)"
            )
        return {"workload": workload, "status": status, "reasons": ended}
    out: dict[str, Any] = {
        "workload": workload,
        "status": w.status,
        "detail": workload_json(w),
        "now_ms": now,
    }
    if job is not None:
        out["job"] = job
    reasons: list[str] = []
    view = FairShareView(state)
    if w.status == "running":
        nodes = ", ".join(f"{s.node}:{s.gpus}" for s in w.placement)
        reasons.append(f"running on {nodes} since {when(w.started_ms, now)} (attempt {w.attempt})")
        stop = w.stopping
        if stop is not None:
            reasons.append(
                f"stopping: preempted at {when(stop.from_ms, now)} with "
                f"{(stop.until_ms - stop.from_ms) / 1000:g} s notice, GPUs released at "
                f"{when(stop.until_ms, now)} at the latest"
            )
        elif not w.allocated:
            reasons.append(
                "unallocated (min_runtime 0): free, preemptible by any allocated workload at any moment"
            )
        elif is_protected(w, state.now_ms):
            reasons.append(
                f"protected from preemption until {when(w.protected_until_ms, now)} "
                "(its minimum runtime)"
            )
        else:
            reasons.append(
                "past its minimum runtime: preemptible by a clearly more under-served team"
            )
        est = estimates if estimates is not None else estimates_for(state, history, only="")
        end = est.ends.get(workload)
        if end is not None:
            out["expected_end_ms"] = max(end, now)
            reasons.append(f"expected to end {when(max(end, now), now)} (its duration hint)")
        if pre_txt:
            reasons.append(f"earlier: {pre_txt}")
        reasons.extend(_history_words(job, now))
        out["reasons"] = reasons
        return out
    if w.held:
        reasons.append(
            f"held by {w.held_by or '(no actor)'} at {when(int(w.held_ms or 0), now)}: "
            f"pending, but no cycle places it until it is released (apportion release "
            f"{workload}); it keeps its place in the queue (submitted {iso(w.submitted_ms)})"
        )
        if pre_txt:
            reasons.append(pre_txt)
        reasons.extend(_history_words(job, now))
        out.update(
            held_by=w.held_by,
            held_ms=w.held_ms,
            reason="held",
            reason_text=WAIT_REASONS["held"],
            position=None,
            estimated_start_ms=None,
            estimate_note="no estimate: it is held until released",
            reasons=reasons,
        )
        return out
    order = queue_order(state, view)
    pos = next(i for i, x in enumerate(order, start=1) if x.id == workload)
    ahead = order[: pos - 1]
    reasons.append(
        f"pending: position {pos} of {len(order)} in the queue, waiting "
        f"{span(max(0, now - w.queued_ms))} (since {iso(w.queued_ms)})"
    )
    est = estimates if estimates is not None else estimates_for(state, history, only=workload)
    out.update(_estimate_fields(est, workload, now))
    if out["estimated_start_ms"] is not None:
        reasons.append(f"estimated start: {when(out['estimated_start_ms'], now)}, {ASSUMPTION}")
    else:
        reasons.append(out["estimate_note"])
    out["estimate_assumption"] = ASSUMPTION
    if pre_txt:
        reasons.append(pre_txt)
    if not w.allocated:
        reasons.append(
            "unallocated (min_runtime 0): orders after every allocated workload and never preempts"
        )
    else:
        window = span(state.policy.lookback_ms)
        parts = []
        ranking = PeerRanking(state, view)
        of_tree = " of what the tree used" if ranking.on else ""
        for p, u, wt, _r in view.path_ratios(w.owner):
            pct = share_pct(state, view, p)
            used = f"{pct:.0f}% of its share{of_tree}" if pct is not None else "no capacity"
            peer = ranking.peer.get(p, 0)
            elsewhere = f", {gpu_hours(peer)} of it on other clusters" if peer else ""
            parts.append(
                f"{p} used {used} ({gpu_hours(u)} in the {window} window{elsewhere}, weight {wt})"
            )
        reasons.append(
            "sort key (lower share used ranks first among siblings): " + "; ".join(parts)
        )
        lowered = ranking.words(w.owner)
        if lowered is not None:
            out["other_clusters"] = lowered
            reasons.append(
                f"ranked low by usage on other clusters: {lowered}; without that usage it "
                "would rank ahead of a sibling it now follows"
            )
    fits = [n for n in state.nodes.values() if n.schedulable and takes(w.gpu_type, n.gpu_type)]
    kind = "" if is_any(w.gpu_type) else f" {w.gpu_type}"
    if not fits:
        reasons.append(f"no healthy node of gpu_type {w.gpu_type!r}")
    else:
        free = sum(n.free for n in fits)
        largest = max(n.free for n in fits)
        whole = sum(1 for n in fits if n.free == n.gpus)
        reasons.append(
            f"needs {w.gpus} GPUs at once; free on matching healthy{kind} nodes: {free} "
            f"(largest block {largest}, {whole} whole nodes)"
        )
        usable = {n.node for n in fits}
        blockers = [
            r
            for r in state.running.values()
            if is_protected(r, state.now_ms) and any(s.node in usable for s in r.placement)
        ]
        bound = protections_bound(state, w, fits)
        if blockers and bound is not None:
            until, b, node = bound
            reasons.append(
                f"{len(blockers)} running allocated workloads on{kind} nodes it could use are "
                f"protected; protections alone keep it waiting until {when(until, now)} "
                f"({b} on {node}, protected until then)"
            )
    competing = [a for a in ahead if overlap(a.gpu_type, w.gpu_type)]
    if competing:
        reasons.append(
            f"{len(competing)} workloads that could use the same nodes rank ahead of it, "
            f"needing {sum(a.gpus for a in competing)} GPUs"
        )
    ctx = WaitContext(state)
    out["reason"] = code = wait_reason(state, w, ctx)
    out["reason_text"] = WAIT_REASONS[code]
    reservation = ctx.reservation
    if reservation is not None and w.allocated:
        nodes = ", ".join(reservation.nodes)
        if reservation.workload == workload:
            reasons.append(
                f"holds a reservation: {nodes} become free or preemptible for it at "
                f"{when(reservation.start_ms, now)}; until then only work preemptible by then "
                "may use them"
            )
        elif not may_use_reserved(state.now_ms, w.min_runtime_ms, reservation.start_ms) and any(
            takes(w.gpu_type, state.nodes[n].gpu_type) for n in reservation.nodes
        ):
            reasons.append(
                f"may not use {nodes}: reserved for {reservation.workload} from "
                f"{when(reservation.start_ms, now)}, and it would still be protected then"
            )
        out["reservation"] = {
            "workload": reservation.workload,
            "nodes": list(reservation.nodes),
            "start_ms": reservation.start_ms,
        }
    reasons.extend(_history_words(job, now))
    out["position"] = pos
    out["reasons"] = reasons
    return out


def protections_bound(
    state: State, w: Workload, fits: list[ClusterNode]
) -> tuple[int, str, str] | None:
    """The earliest time at which protections alone stop keeping ``w`` from the nodes
    ``fits`` (counting every running GPU as free once its protection ends, and
    nothing about who may preempt whom), with the run whose protection ends then
    and its node; ``None`` if no protected run stands in the way.

    One node's worth or less: the first node where free GPUs plus those of runs
    whose protections have ended reach ``w.gpus``. A gang of ``k`` whole nodes: the
    ``k``-th node to be whole (a node is whole when its last protection ends), in
    one pool of nodes of one size, the earliest pool."""
    now = state.now_ms
    running = state.running
    best: tuple[int, str, str] | None = None
    by_size: dict[int, list[ClusterNode]] = {}
    for n in fits:
        by_size.setdefault(n.gpus, []).append(n)
    for size, nodes in sorted(by_size.items()):
        if w.gpus > size and w.gpus % size:
            continue
        k = 1 if w.gpus <= size else w.gpus // size
        want = min(w.gpus, size)
        times: list[tuple[int, str, str]] = []  # (when, run, node) per node
        for n in nodes:
            runs = sorted((max(running[wid].protected_until_ms, now), wid) for wid in n.workloads)
            have, at, who = n.free, now, ""
            for until, wid in runs:
                if have >= want:
                    break
                have += n.workloads[wid]
                at, who = until, wid
            if have >= want:
                times.append((at, who, n.node))
        if len(times) < k:
            continue
        times.sort()
        option = times[k - 1]
        if best is None or option < best:
            best = option
    if best is None or best[0] <= now or not best[1]:
        return None
    return best


def _history_words(job: dict[str, Any] | None, now: int) -> list[str]:
    """For a live workload: who submitted it, its command, its attempts so far and
    their logs (the lines :func:`~apportion.services.job_history.job_words` gives)."""
    return [] if job is None else job_words(job, now)


def replay_history(
    items: Iterable[HistoryItem], until_ms: int | None = None, cluster: str = ""
) -> tuple[State, History]:
    """Fold a canonical history (an event log) into the state and the
    :class:`History` ``explain`` reads, as a live follower does (``cluster``: its
    name, for the log locations of the job history); with ``until_ms``, stop before the first input stamped later (the history as it
    stood then: that input's batch and everything after are left out)."""
    state = State()
    history = History(cluster or "<cluster>")
    for item in items:
        if until_ms is not None and isinstance(item, InputItem) and item.at_ms > until_ms:
            break
        rejected = fold_item(state, item)
        history.observe(item, state, rejected)
        history.record([item])
    return state, history
