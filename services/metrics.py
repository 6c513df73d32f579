"""Prometheus metrics of the gateway (``GET /metrics``), with the official ``prometheus_client``.

Counters count what the gateway's follower has folded since the gateway
started (it folds the whole history from input 1, so after a restart they
count the history again, as a restarted exporter should: Prometheus' ``rate``
and ``increase`` handle the reset). Gauges are read from the follower's state
when Prometheus scrapes. Every metric is listed in docs/services.md ("Metrics").

``/metrics`` needs no token (like ``/v1/status``); docs/security.md's threat
model says what it shows.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from apportion.core.budget import ROOT
from apportion.core.rules.classes import team_of
from apportion.core.state import State
from apportion.schemas import reasons as R
from apportion.schemas.events import InputRejected, WorkloadPreempted
from apportion.schemas.history import BatchItem, HistoryItem
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from .views import is_federated, peers_heard

CONTENT_TYPE = CONTENT_TYPE_LATEST

REJECTION_CLASSES = ("malformed", "stale", "authority", "duplicate", "invalid")
REJECTION_SOURCES = ("scheduler", "gateway")
"""Where an input was refused: ``scheduler`` (an ``InputRejected`` decision folded)
or ``gateway`` (a 4xx answer to a request that would have published an input)."""


_CLASS_OF_CODE = {
    R.MALFORMED: "malformed",
    R.STALE_REPORT: "stale",
    R.ALREADY_ENDED: "stale",
    R.NO_CHANGE: "stale",
    R.NOT_PENDING: "stale",
    R.NOT_HELD: "stale",
    R.NOT_AUTHORISED: "authority",
    R.NOT_AUTHENTICATED: "authority",  # the gateway's own (401)
    R.DUPLICATE_ID: "duplicate",
}


def rejection_class(reason: str, code: str | None = None) -> str:
    """The class of an ``InputRejected`` (a small, fixed label set):
    ``malformed`` (bytes or a version that did not decode), ``stale`` (a report
    that raced a decision, a repeat), ``authority`` (the actor may not),
    ``duplicate`` (a workload id used before), ``invalid`` (anything else: an
    unknown owner, a bound, not a valid gang ...).

    From its reason ``code``; a decision recorded before codes has none, and is
    classed by the words of its reason as it always was."""
    if code is not None:
        return _CLASS_OF_CODE.get(code, "invalid")
    if reason.startswith("malformed") or "decode" in reason:
        return "malformed"
    if "stale report" in reason or "(no change)" in reason or "already ended" in reason:
        return "stale"
    if "may not" in reason or "does not own" in reason:
        return "authority"
    if "already exists" in reason:
        return "duplicate"
    return "invalid"


class GatewayMetrics:
    """The gateway's metrics, in a registry of their own (several gateways in one
    process, as in the tests, do not collide)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter(
            "apportion_decisions",
            "Decisions folded by the gateway, by kind",
            ["kind"],
            registry=r,
        )
        self.preemptions = Counter(
            "apportion_preemptions",
            "WorkloadPreempted decisions folded, by reason",
            ["reason"],
            registry=r,
        )
        self.rejections = Counter(
            "apportion_rejections",
            "Inputs refused, by source (scheduler: InputRejected decisions folded; "
            "gateway: 4xx answers to requests that would publish an input) and reason class",
            ["source", "reason_class"],
            registry=r,
        )
        self.pending = Gauge(
            "apportion_queue_pending_workloads",
            "Pending workloads, allocated (min_runtime > 0) or unallocated",
            ["contract"],
            registry=r,
        )
        self.pending_gpus = Gauge(
            "apportion_queue_pending_gpus",
            "GPUs asked for by pending workloads",
            ["contract"],
            registry=r,
        )
        self.running = Gauge(
            "apportion_running_workloads", "Running workloads", ["contract"], registry=r
        )
        self.gpus_in_use = Gauge(
            "apportion_gpus_in_use", "GPUs held by running workloads", ["contract"], registry=r
        )
        self.gpus = Gauge(
            "apportion_gpus", "GPUs of registered nodes, by node health", ["health"], registry=r
        )
        self.inputs = InputPosition("apportion", "the gateway's follower", r)
        self.state_age = Gauge(
            "apportion_state_age_seconds",
            "Wall clock minus the time of the last event the gateway folded",
            registry=r,
        )
        self.team_usage = Gauge(
            "apportion_team_usage_gpu_seconds",
            "GPU-seconds charged to a team inside the lookback window (on every cluster "
            "of a federation)",
            ["team"],
            registry=r,
        )
        self.team_share = Gauge(
            "apportion_team_usage_of_share_ratio",
            "A team's charged usage / its share of the window (one cluster: global share "
            "x healthy GPUs x lookback; a federated one: global share x the whole tree's "
            "charged usage on every cluster); 1 = at share",
            ["team"],
            registry=r,
        )
        self.node_usage = Gauge(
            "apportion_budget_usage_gpu_seconds",
            "On a cluster that shares its tree with others: GPU-seconds charged to each "
            "budget node's subtree in the lookback window, on this cluster (scope=here) "
            "or on the others, from their usage summaries (scope=peers); path / is the root",
            ["path", "scope"],
            registry=r,
        )
        self.peer_heard = Gauge(
            "apportion_peer_heard_until_seconds",
            "Per peer cluster: the end (epoch seconds) of the last usage interval folded "
            "from it (0: none yet)",
            ["source"],
            registry=r,
        )
        self.unauthenticated = Counter(
            "apportion_gateway_unauthenticated",
            "Requests answered 401 (no, a malformed or an unknown bearer token)",
            registry=r,
        )
        self.latency = Histogram(
            "apportion_gateway_request_seconds",
            "Gateway request latency, by route, method and status",
            ["route", "method", "status"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        for kind in ("WorkloadPlaced", "WorkloadPreempted", "NodeDrained", "InputRejected"):
            self.decisions.labels(kind)
        for source in REJECTION_SOURCES:
            for c in REJECTION_CLASSES:
                self.rejections.labels(source, c)

    def observe(self, items: Iterable[HistoryItem]) -> None:
        """Count the decisions of the batches among ``items`` (as they are folded)."""
        for item in items:
            if not isinstance(item, BatchItem):
                continue
            for d in item.batch.decisions:
                self.decisions.labels(type(d).__name__).inc()
                if isinstance(d, WorkloadPreempted):
                    self.preemptions.labels(d.reason).inc()
                elif isinstance(d, InputRejected):
                    code = d.code if isinstance(d.code, str) else None
                    self.rejections.labels("scheduler", rejection_class(d.reason, code)).inc()

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.latency.labels(route, method, str(status)).observe(seconds)

    def refused(self, code: str) -> None:
        """A request that would have published an input, answered 4xx with ``code``:
        it never reaches the log, so no ``InputRejected`` will count it."""
        self.rejections.labels("gateway", rejection_class("", code)).inc()

    def update(self, state: State, inputs_stored: int | None, now_ms: int | None = None) -> None:
        """Set the gauges from ``state`` (``inputs_stored``: INPUTS' last sequence,
        ``None`` when NATS did not answer: the lag is left as it was)."""
        counts: dict[str, list[int]] = {"allocated": [0, 0], "unallocated": [0, 0]}
        for w in state.pending.values():
            c = counts["allocated" if w.allocated else "unallocated"]
            c[0] += 1
            c[1] += w.gpus
        for contract, (n, g) in counts.items():
            self.pending.labels(contract).set(n)
            self.pending_gpus.labels(contract).set(g)
        counts = {"allocated": [0, 0], "unallocated": [0, 0]}
        for w in state.running.values():
            c = counts["allocated" if w.allocated else "unallocated"]
            c[0] += 1
            c[1] += w.gpus
        for contract, (n, g) in counts.items():
            self.running.labels(contract).set(n)
            self.gpus_in_use.labels(contract).set(g)
        health = {"healthy": 0, "draining": 0, "down": 0}
        for node in state.nodes.values():
            health[node.health] = health.get(node.health, 0) + node.gpus
        for h, g in health.items():
            self.gpus.labels(h).set(g)
        self.inputs.set(state.input_seq, inputs_stored)
        now = now_ms if now_ms is not None else int(time.time() * 1000)
        self.state_age.set(max(0, now - state.now_ms) / 1000)
        healthy = health["healthy"]
        lookback = state.policy.lookback_ms
        tree = state.budget
        teams = sorted({team_of(leaf) for leaf in tree.leaves() if leaf != ROOT})
        self.team_usage.clear()  # a removed team leaves no stale series
        self.team_share.clear()
        federated = is_federated(state)
        # one cluster: of its capacity; several: of what the tree used (share_pct)
        window = state.usage(ROOT) if federated else healthy * lookback
        for team in teams:
            usage = state.usage(team)
            self.team_usage.labels(team).set(usage / 1000)  # GPU-ms -> GPU-seconds
            allocation = float(tree.global_share(team)) * window
            self.team_share.labels(team).set(usage / allocation if allocation > 0 else 0.0)
        self.node_usage.clear()
        self.peer_heard.clear()
        if federated:
            for path, budget_node in tree.nodes.items():
                label = path or "/"
                here = budget_node.series.window(state.now_ms, lookback)
                self.node_usage.labels(label, "here").set(here / 1000)
                self.node_usage.labels(label, "peers").set((state.usage(path) - here) / 1000)
            for p in peers_heard(state):
                until = p["heard_until_ms"]
                self.peer_heard.labels(p["cluster"]).set(0 if until is None else until / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def route_of(request: Any) -> str:
    """A request's route template (``/v1/workloads/{id}``), so that ids do not
    become label values; ``other`` for a path no route matches."""
    info = getattr(request, "match_info", None)
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    canonical = getattr(resource, "canonical", None)
    return canonical if isinstance(canonical, str) else "other"


# -- the scheduler, the projector and the executor emulator -------------------------
# Each service object owns a registry of its own (tests run several in one
# process). ``apportion serve scheduler|projector|executor --metrics-port N`` exposes it
# over HTTP (:func:`start_metrics_server`); ``apportion up`` appends it to the
# gateway's ``/metrics`` (all services share one process there).

DECISION_KINDS = ("WorkloadPlaced", "WorkloadPreempted", "NodeDrained", "InputRejected")

CYCLE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class SchedulerMetrics:
    """A scheduler's metrics. Counters move on the hot path (one histogram
    observation and a few increments per cycle); gauges are set at each scrape
    (:meth:`update`)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.cycle_seconds = Histogram(
            "apportion_scheduler_cycle_seconds",
            "Scheduler cycle latency: decide, publish (every part) and fold one cycle",
            buckets=CYCLE_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "apportion_scheduler_decisions",
            "Decisions the scheduler published, by kind",
            ["kind"],
            registry=r,
        )
        self.batches = Counter(
            "apportion_scheduler_batches",
            "Decision batches (cycles) the scheduler published, empty ones included",
            registry=r,
        )
        self.parts = Counter(
            "apportion_scheduler_batch_parts",
            "DECISIONS messages the scheduler published (a cycle too large for one is several parts)",
            registry=r,
        )
        self.ticks = Counter(
            "apportion_scheduler_ticks", "ClockTicked inputs the scheduler published", registry=r
        )
        self.snapshots_saved = Counter(
            "apportion_scheduler_snapshots_saved", "Snapshots the scheduler saved", registry=r
        )
        self.snapshots_rejected = Counter(
            "apportion_scheduler_snapshots_rejected",
            "Stored snapshots found unusable (the whole log folded instead)",
            registry=r,
        )
        self.leases_lost = Counter(
            "apportion_scheduler_leases_lost",
            "Times the lease could not be renewed while leading",
            registry=r,
        )
        self.fenced = Counter(
            "apportion_scheduler_fenced",
            "Publishes refused because another scheduler wrote (fencing)",
            registry=r,
        )
        self.leader = Gauge(
            "apportion_scheduler_leader", "1 while this scheduler leads, 0 on standby", registry=r
        )
        self.inputs = InputPosition(
            "apportion_scheduler", "the scheduler's state (0 with no state loaded)", r
        )
        self._kinds = {k: self.decisions.labels(k) for k in DECISION_KINDS}
        self.usage_forwarded = Counter(
            "apportion_scheduler_usage_summaries_forwarded",
            "Usage summaries this process's forwarder published to USAGE_<c> for the peers "
            "(docs/federation.md)",
            registry=r,
        )
        self.source_lag = Gauge(
            "apportion_federation_source_lag",
            "Messages a federation source of INPUTS is behind its stream, as the server says",
            ["source"],
            registry=r,
        )
        self.source_heard = Gauge(
            "apportion_federation_source_heard_seconds",
            "Seconds since a federation source of INPUTS last heard from its stream (-1: never)",
            ["source"],
            registry=r,
        )
        self.source_error = Gauge(
            "apportion_federation_source_error",
            "1 while the server reports an error for a federation source of INPUTS",
            ["source"],
            registry=r,
        )

    def cycle(self, seconds: float, decisions: Iterable[Any], parts: int) -> None:
        """One cycle published: ``decisions`` (the ones this scheduler published) in ``parts`` messages."""
        self.cycle_seconds.observe(seconds)
        self.batches.inc()
        self.parts.inc(parts)
        kinds = self._kinds
        for d in decisions:
            name = type(d).__name__
            child = kinds.get(name)
            if child is None:
                child = kinds[name] = self.decisions.labels(name)
            child.inc()

    def update(self, *, leading: bool, folded: int, stored: int | None) -> None:
        self.leader.set(1 if leading else 0)
        self.inputs.set(folded, stored)

    def sources(self, states: Iterable[Any]) -> None:
        """The federation sources of INPUTS (:func:`apportion.services.federation.status`)."""
        for gauge in (self.source_lag, self.source_heard, self.source_error):
            gauge.clear()
        for s in states:
            self.source_lag.labels(s.name).set(s.lag)
            heard = -1.0 if s.active_ms is None else s.active_ms / 1000
            self.source_heard.labels(s.name).set(heard)
            self.source_error.labels(s.name).set(1 if s.error else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ProjectorMetrics:
    """A projector's metrics; one object may outlive several projectors (``apportion
    up`` makes a new one at each restart), so the rebuilds count across them."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.commits = Counter(
            "apportion_projector_commits", "Transactions the projector committed", registry=r
        )
        self.items = Counter(
            "apportion_projector_items_committed",
            "History items (inputs and decision batches) committed to the DuckDB file, by kind",
            ["kind"],
            registry=r,
        )
        self.skipped = Counter(
            "apportion_projector_batches_skipped",
            "Decision batches skipped as out of canonical order",
            registry=r,
        )
        self.errors = Counter(
            "apportion_projector_errors",
            "History events whose rows the projection could not derive (each logged and "
            "recorded in projection_errors; the projector went on)",
            registry=r,
        )
        self.rebuilds = Counter(
            "apportion_projector_rebuilds",
            "Projection files moved aside (unreadable, or ahead of the streams) and rebuilt",
            registry=r,
        )
        self.input_seq = Gauge(
            "apportion_projector_input_seq", "Last input sequence committed", registry=r
        )
        self.batch_seq = Gauge(
            "apportion_projector_batch_seq", "Last DECISIONS sequence committed", registry=r
        )
        self.inputs_stored = Gauge(
            "apportion_projector_inputs_stored", "Last sequence of the INPUTS stream", registry=r
        )
        self.input_lag = Gauge(
            "apportion_projector_input_lag",
            "Inputs stored but not yet committed by the projector (stored - committed)",
            registry=r,
        )
        self.inputs_missing = Gauge(
            "apportion_projector_inputs_missing",
            "Inputs missing from INPUTS where the projector stopped, no loss accepted for them "
            "(0: the history is whole; docs/services.md, 'Lost inputs')",
            registry=r,
        )
        self._inputs = self.items.labels("input")
        self._batches = self.items.labels("batch")

    def committed(self, before: tuple[int, int], after: tuple[int, int]) -> None:
        self.commits.inc()
        self._inputs.inc(max(0, after[0] - before[0]))
        self._batches.inc(max(0, after[1] - before[1]))
        self.input_seq.set(after[0])
        self.batch_seq.set(after[1])

    def update(self, position: tuple[int, int], stored: int | None) -> None:
        self.input_seq.set(position[0])
        self.batch_seq.set(position[1])
        if stored is not None:
            self.inputs_stored.set(stored)
            self.input_lag.set(max(0, stored - position[0]))

    def render(self) -> bytes:
        return generate_latest(self.registry)


EXECUTOR_OUTCOMES = ("succeeded", "preempted", "cancelled", "ended", "report_failed")
"""How a run the executor emulator followed ended, from its side: ``succeeded``
(its own end report was stored), ``preempted`` (the scheduler took it back,
requeued or not), ``cancelled``, ``ended`` (someone else reported its end), and
``report_failed`` (its end report was not acknowledged; it tries again)."""

TIMER_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ExecutorMetrics:
    """The executor emulator's metrics. Counters move as it follows the history and
    reports ends; gauges are set at each scrape (:meth:`update`)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.started = Counter(
            "apportion_executor_runs_started",
            "Runs (placements, each attempt once) the executor emulator began to emulate",
            registry=r,
        )
        self.finished = Counter(
            "apportion_executor_runs_finished",
            "Runs the executor emulator stopped emulating, by outcome",
            ["outcome"],
            registry=r,
        )
        self.running = Gauge(
            "apportion_executor_runs_running",
            "Runs the executor emulator emulates now (running workloads it follows)",
            registry=r,
        )
        self.timers = Gauge(
            "apportion_executor_timers",
            "End timers armed now (running workloads with a duration)",
            registry=r,
        )
        self.timer_lag = Histogram(
            "apportion_executor_timer_lag_seconds",
            "How late an end timer fired: the wall clock when it ran minus the end its "
            "duration set (a restarted emulator catching up shows here)",
            buckets=TIMER_LAG_BUCKETS,
            registry=r,
        )
        self.inputs = InputPosition("apportion_executor", "the executor emulator's follower", r)
        self._outcomes = {o: self.finished.labels(o) for o in EXECUTOR_OUTCOMES}

    def ended(self, outcome: str) -> None:
        self._outcomes[outcome].inc()

    def update(self, *, running: int, timers: int, folded: int, stored: int | None) -> None:
        self.running.set(running)
        self.timers.set(timers)
        self.inputs.set(folded, stored)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class InputPosition:
    """The gauges of a follower's position in ``INPUTS``: ``<prefix>_inputs_folded``,
    ``<prefix>_inputs_stored`` (the stream's last sequence) and ``<prefix>_input_lag``
    (stored - folded: inputs waiting)."""

    def __init__(self, prefix: str, who: str, registry: CollectorRegistry) -> None:
        self.folded = Gauge(f"{prefix}_inputs_folded", f"Inputs folded by {who}", registry=registry)
        self.stored = Gauge(
            f"{prefix}_inputs_stored", "Last sequence of the INPUTS stream", registry=registry
        )
        self.lag = Gauge(
            f"{prefix}_input_lag",
            f"Inputs stored but not yet folded by {who} (stored - folded)",
            registry=registry,
        )
        self.missing = Gauge(
            f"{prefix}_inputs_missing",
            f"Inputs missing from INPUTS where {who} stopped, no loss accepted for them "
            "(0: the history is whole; docs/services.md, 'Lost inputs')",
            registry=registry,
        )

    def set_gap(self, gap: tuple[int, int] | None) -> None:
        """The gap (``(first, through)``) the reader stopped at, or ``None``."""
        self.missing.set(0 if gap is None else gap[1] - gap[0] + 1)

    def set(self, folded: int, stored: int | None) -> None:
        """``stored``: ``None`` when NATS did not answer (the stored gauges keep their value)."""
        self.folded.set(folded)
        if stored is not None:
            self.stored.set(stored)
            self.lag.set(max(0, stored - folded))


async def stored_inputs(log: Any, timeout_s: float = 2.0) -> int | None:
    """INPUTS' last sequence, or ``None`` when NATS does not answer within ``timeout_s``."""
    import asyncio

    try:
        return int(await asyncio.wait_for(log.last_input_seq(), timeout_s))
    except Exception:  # NATS away: the other metrics still answer
        return None


async def start_metrics_server(
    render: Callable[[], Awaitable[bytes]], host: str, port: int
) -> tuple[Any, str]:
    """Serve ``GET /metrics`` (``render()``'s text) on ``host:port`` (0: any free
    port) in this event loop; returns the aiohttp runner (``await
    runner.cleanup()`` to stop) and the URL it listens on."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=await render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # aiohttp exposes the bound port only here
    sockets = getattr(server, "sockets", None)
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, f"http://{host}:{bound}/metrics"
