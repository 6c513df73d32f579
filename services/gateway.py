"""The gateway: an HTTP JSON API in front of the event log (aiohttp).

It keeps its own folded state (a :class:`~apportion.services.canonical.Follower`
of the canonical history), validates requests with the same schemas and
checks the fold uses (through the command layer, :mod:`apportion.core.commands`),
answers 4xx with ``{"error": reason, "code": code}``, and publishes inputs with
``Nats-Msg-Id``. Its state
trails the scheduler by one cycle, so a request validated here may still be
rejected by the scheduler (an ``InputRejected`` decision) when two requests race.

| method | path | body / answer |
|---|---|---|
| POST | ``/v1/workloads`` | submit: ``{"owner","gpus","min_runtime_ms",...}`` -> 202 ``{"workload","seq","duplicate"}`` |
| POST | ``/v1/workloads/{id}/cancel`` | -> 202 |
| POST | ``/v1/workloads/{id}/hold`` | -> 202 (pending work is not placed until released) |
| POST | ``/v1/workloads/{id}/release`` | -> 202 (back at its old place in the queue) |
| GET | ``/v1/workloads/{id}`` | the workload's status |
| GET | ``/v1/queue`` | pending in order with position, sort-key ratios and a ``reason`` code; running (``?user=``, ``?team=``, ``?state=pending|running``, ``?gpu_type=``) |
| GET | ``/v1/share`` | budget tree with usage against allocation (``sshare``) |
| GET | ``/v1/explain/{id}`` | why pending / preempted / ended; an ended one's attempts, exit code, who cancelled, logs |
| GET | ``/v1/logs/{id}`` | an attempt's output as the agents shipped it (``?attempt=``, ``?node=``, ``?from=`` a byte offset; :mod:`~apportion.services.attempt_logs`) |
| GET | ``/v1/jobs`` | ended (or any) workloads, newest first (``?state=``, ``?user=``, ``?team=``, ``?id=``, ``?since=``, ``?limit=``, ``?gpu_type=``; :mod:`~apportion.services.job_history`) |
| GET | ``/v1/report`` | accounting: GPU-hours, owed and delivered per team, user or day (``?since=``, ``?until=``, ``?by=``, ``?team=``; :mod:`~apportion.services.report`) |
| GET | ``/v1/nodes`` | every host: type, GPUs, free, health, drained, running work, last health change (``?state=``) |
| POST | ``/v1/nodes/{node}/health`` | ``{"state": "healthy"|"draining"|"down", "reason"}`` -> 202 ``{"node","state","seq","duplicate"}`` (operators and the root's owner) |
| GET | ``/v1/budget`` | the budget tree |
| GET | ``/v1/usage/history`` | per team and user, owed / delivered / used GPU-ms hour by hour (``?team=``, ``?hours=``; :mod:`~apportion.services.usage_history`, served by the dashboard's module) |
| POST | ``/v1/budget`` | ``{"set":[{"path","weight","owner"}],"remove":[paths]}`` |
| GET | ``/v1/status`` | positions of the gateway's view (no credential needed: a health check) |
| GET | ``/openapi.json`` | this API as OpenAPI 3.1 (no credential needed) |
| GET | ``/metrics`` | Prometheus metrics (:mod:`~apportion.services.metrics`; no credential needed) |

Queue, explain and workload answers carry start-time estimates
(:mod:`apportion.core.estimate`, computed once per folded state) and measure
waits and relative times to the gateway's wall clock.

**Identity.** Every other ``/v1/...`` request carries ``Authorization: Bearer
<token>``; the gateway's :class:`~apportion.services.auth.Authenticator` turns
it into a principal, and a request without one, or with a token it does not
know, is answered 401 with ``WWW-Authenticate: Bearer``. The principal is the
actor of every input the gateway publishes (``submitted_by`` of a submission,
``actor`` of a cancel and of budget edits); an ``actor`` or ``submitted_by``
in the body is ignored. A gateway made with ``auth=None`` (``serve gateway
--no-auth``, ``up --no-auth``) authenticates nobody and takes the actor from
the body, as before; it logs a warning when it starts.

Every error is JSON ``{"error": reason, "code": code}``: ``code`` is a stable
reason code (:mod:`apportion.schemas.reasons`, docs/reasons.md) and the status
comes from it through one table, :data:`HTTP_STATUS`: 400 for a request that
does not decode or breaks a bound of the schemas (the reason names the field
and the bound) or a value the fold refuses, 401 (no or an unknown credential),
403 (the principal lacks the authority the fold checks), 404 (an unknown
workload, or an unknown path), 405, 409 (the state has moved on: an id already
used, a workload already ended), 413 for a body over :data:`MAX_BODY_BYTES`,
500 for a bug (logged; the gateway keeps serving) and 504 when NATS does not
acknowledge a publish in time: it may still be stored, and a retry of the same
request (the same workload id) is stored once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import msgspec
from aiohttp import web
from apportion.core import commands
from apportion.core.estimate import Estimates, estimate_starts
from apportion.core.state import State
from apportion.schemas import reasons as R
from apportion.schemas.bounds import (
    MAX_ARGS,
    MAX_ENV,
    MAX_NAME_LEN,
    MAX_PATH_LEN,
    Arg,
    DurationMs,
    EnvName,
    Gpus,
    Image,
    Name,
    Path,
    Priority,
    Reason,
    Weight,
    plain_bound,
)
from apportion.schemas.events import ANY_GPU_TYPE, HealthState
from apportion.schemas.reasons import Refusal
from apportion.schemas.times import with_iso
from msgspec import Meta

from . import attempt_logs, logs
from .auth import Authenticator, AuthError
from .bus import EventLog
from .canonical import Follower
from .job_history import DEFAULT_LIMIT as DEFAULT_JOBS_LIMIT
from .job_history import MAX_LIMIT as MAX_JOBS_LIMIT
from .job_history import JobQuery, QueryError, list_jobs
from .metrics import CONTENT_TYPE, GatewayMetrics, route_of
from .report import MAX_REPORT_MS, REPORT_BY, ReportQuery
from .report import report as accounting
from .usage_history import UsageHistory
from .views import (
    NODE_STATES,
    History,
    QueueFilter,
    WaitContext,
    budget_tree,
    estimate_context,
    explain,
    gpu_types_of,
    nodes_view,
    parse_node_query,
    queue_view,
    workload_json,
)

T = TypeVar("T")

MAX_BODY_BYTES = 64 * 1024
"""Largest request body; a larger one is answered 413 before it is read."""

REFUSAL_WAIT_S = 2.0
"""How long a refusal waits for the view to fold the inputs stored before it
(then it is answered 503 ``catching_up`` rather than a 4xx that may not be final)."""
RETRY_AFTER_S = 1
"""``Retry-After`` of a 503 ``catching_up``."""
GAP_RETRY_AFTER_S = 30
"""``Retry-After`` of a 503 ``history_incomplete`` (an operator has to act)."""

PUBLISH_UNACKNOWLEDGED = (
    "NATS did not acknowledge the publish in time ({cause}): it may still be stored. "
    "Retrying the same request is safe: a submit or cancel of the same workload id "
    "is stored once, and a budget change made twice changes nothing more"
)


# Request bodies: the fields of the events they become, with the same bounds.
class SubmitRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    owner: Path
    gpus: Gpus
    min_runtime_ms: DurationMs
    id: Name | None = None
    duration_ms: DurationMs | None = None
    priority: Priority = 0
    resumable: bool = True
    gpu_type: Name = ANY_GPU_TYPE
    submitted_by: Name = ""
    """Ignored by a gateway that authenticates (the credential's principal is used)."""
    command: Annotated[tuple[Arg, ...], Meta(max_length=MAX_ARGS)] = ()
    """What the host agents run (argv); see docs/agent.md."""
    env: Annotated[dict[EnvName, Arg], Meta(max_length=MAX_ENV)] = {}
    image: Image = ""
    grace_ms: DurationMs | None = None


class CancelRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    actor: Name = ""
    """Ignored by a gateway that authenticates (the credential's principal is used)."""


class HealthRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    state: HealthState
    reason: Reason = ""
    """Why, in words (printable, one line): kept in the history with the change."""
    actor: Name = ""
    """Ignored by a gateway that authenticates (the credential's principal is used);
    required by one that does not."""


class BudgetNodeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    path: Path
    weight: Weight
    owner: Name


class BudgetRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    actor: Name = ""
    """Ignored by a gateway that authenticates (the credential's principal is used);
    required by one that does not."""
    set: list[BudgetNodeRequest] = msgspec.field(default_factory=list)
    remove: list[Path] = msgspec.field(default_factory=list)


HTTP_STATUS: dict[str, int] = {
    # the fold's codes (docs/reasons.md)
    R.MALFORMED: 400,
    R.INVALID_NAME: 400,
    R.BAD_PATH: 400,
    R.NOT_POSITIVE: 400,
    R.INVALID_GPU_TYPE: 400,
    R.OUT_OF_RANGE: 400,
    R.OVER_CAP: 400,
    R.UNKNOWN_OWNER: 400,
    R.NOT_A_LEAF: 400,
    R.UNKNOWN_GPU_TYPE: 400,
    R.INVALID_GANG: 400,
    R.UNKNOWN_WORKLOAD: 404,
    R.UNKNOWN_NODE: 404,
    R.UNKNOWN_BUDGET_NODE: 404,
    R.UNKNOWN_PARENT: 400,
    R.NOT_AUTHORISED: 403,
    R.DUPLICATE_ID: 409,
    R.ALREADY_ENDED: 409,
    R.STALE_REPORT: 409,
    R.WRONG_NODE: 409,
    R.NO_CHANGE: 409,
    R.HAS_WORK: 409,
    R.HAS_CHILDREN: 409,
    R.ROOT_NOT_REMOVABLE: 400,
    R.WRONG_SUBJECT: 403,
    R.WRONG_HOST: 403,
    R.RESERVED_NAME: 400,
    R.INVALID_TEXT: 400,
    R.NOT_PENDING: 409,
    R.NOT_HELD: 409,
    R.DUPLICATE_INPUT: 409,
    R.STALE_INPUT: 409,
    R.USAGE_COUNTED: 409,
    R.OWN_USAGE: 400,
    R.BAD_USAGE: 400,
    # the gateway's own
    R.EMPTY_REQUEST: 400,
    R.NOT_AUTHENTICATED: 401,
    R.NO_SUCH_PATH: 404,
    R.METHOD_NOT_ALLOWED: 405,
    R.TOO_LARGE: 413,
    R.HTTP_ERROR: 400,
    R.INTERNAL_ERROR: 500,
    R.UNACKNOWLEDGED: 504,
    R.CATCHING_UP: 503,
    R.HISTORY_INCOMPLETE: 503,
    R.BAD_QUERY: 400,
}
"""The HTTP status of every reason code: the only place a refusal's status comes from."""

UNAUTHENTICATED_LOG_S = 60.0
"""At most one log line per this many seconds for requests answered 401 (each is
counted in ``apportion_gateway_unauthenticated_total``)."""

_HTTP_CODES = {404: R.NO_SUCH_PATH, 405: R.METHOD_NOT_ALLOWED, 413: R.TOO_LARGE}
"""The code of an error aiohttp raised itself (before a handler ran), by its status;
any other status keeps aiohttp's own with :data:`~apportion.schemas.reasons.HTTP_ERROR`."""


class _HttpError(Exception):
    """Answer ``{"error": reason, "code": code}`` with the code's status (raised by
    handlers, turned into a response by the error middleware)."""

    def __init__(self, code: str, reason: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.code = code
        self.status = HTTP_STATUS[code]
        self.reason = reason
        self.headers = headers


_CODE_KEY: Any = web.ResponseKey("code", str) if hasattr(web, "ResponseKey") else "apportion.code"
"""Where an error response keeps its reason code (``ResponseKey`` from aiohttp 3.13)."""


def publishes_input(method: str, path: str) -> bool:
    """A request that publishes an input when it is accepted: every ``/v1/...``
    request but a read (a refused one counts in ``apportion_rejections_total``)."""
    return path.startswith("/v1/") and method not in ("GET", "HEAD", "OPTIONS")


def _error(
    code: str,
    reason: str,
    *,
    status: int | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> web.Response:
    """The error body of ``code`` with its status (:data:`HTTP_STATUS`; ``status``
    only for an error of aiohttp's own that no code names)."""
    response = web.json_response(
        {"error": reason, "code": code, **extra},
        status=HTTP_STATUS[code] if status is None else status,
        headers=headers,
    )
    response[_CODE_KEY] = code  # for the metrics (a refused input, by its code)
    return response


_ISO_KEY: Any = web.ResponseKey("iso", bool) if hasattr(web, "ResponseKey") else "apportion.iso"
"""Set on an answer whose times already carry their ISO-8601 strings (:func:`_json`)."""


def _json(data: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON answer with an ISO-8601 UTC ``*_at`` beside every point-in-time ``*_ms``
    (:func:`~apportion.schemas.times.with_iso`; docs/formats.md, "Times")."""
    response = web.json_response(with_iso(data), status=status, headers=headers)
    response[_ISO_KEY] = True
    return response


def _refused(refusal: Refusal) -> web.Response:
    """A request the command layer refused: its code, status and message."""
    return _error(refusal.code, refusal.message)


_PRINCIPAL_KEY: Any = (
    web.RequestKey("principal", str) if hasattr(web, "RequestKey") else "apportion.principal"
)
"""Where an authenticated request keeps its principal (``RequestKey`` from aiohttp 3.13)."""

PUBLIC = {("GET", "/v1/status"), ("HEAD", "/v1/status")}
"""``/v1/...`` requests that need no credential (the health check)."""


def needs_credential(method: str, path: str) -> bool:
    """Every ``/v1/...`` request but :data:`PUBLIC` ones carries a credential."""
    return (path == "/v1" or path.startswith("/v1/")) and (method, path) not in PUBLIC


async def _body(request: web.Request, type_: Any) -> Any:
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise _HttpError(R.TOO_LARGE, f"request body over {MAX_BODY_BYTES} bytes")
    data = await request.read()  # chunked bodies: aiohttp stops at client_max_size (413)
    try:
        return msgspec.json.decode(data or b"{}", type=type_)
    except msgspec.ValidationError as exc:
        raise _HttpError(R.MALFORMED, f"invalid request: {plain_bound(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise _HttpError(R.MALFORMED, f"request body is not JSON: {exc}") from None


class _Unacknowledged(Exception):
    """A publish NATS did not acknowledge (``workload``: the submission's id, if any)."""

    def __init__(self, cause: BaseException, workload: str | None) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}".rstrip(": ").splitlines()[0])
        self.workload = workload


async def _published(publish: Awaitable[T], workload: str | None = None) -> T:
    """``await publish``; a NATS outage (a timeout, a closed or reconnecting
    connection, no JetStream responder) becomes :class:`_Unacknowledged`."""
    import nats.errors

    try:
        return await publish
    except (nats.errors.Error, TimeoutError, ConnectionError) as exc:
        raise _Unacknowledged(exc, workload) from None


class Gateway:
    """The HTTP API on ``log``.

    ``auth`` checks every request's credential (see the module doc); it must be
    given: ``None`` is the explicit choice of a gateway that authenticates
    nobody and takes actors from request bodies (it logs a warning at start)."""

    def __init__(
        self,
        log: EventLog,
        *,
        auth: Authenticator | None,
        extra_metrics: Callable[[], Awaitable[bytes]] | None = None,
        agent_work_dir: str | None = None,
        tree: Any = None,
    ) -> None:
        self.log = log
        self.tree = tree
        """In a federation: a JetStream context on the hub (as its ``gateway`` user).
        Budget edits are then published once, on the hub's tree, for every cluster
        (docs/federation.md); ``None``: on this cluster's INPUTS."""
        self.extra_metrics = extra_metrics
        """More Prometheus text for ``/metrics``: the other services of this process (``apportion up``)."""
        self.auth = auth
        self.follower = Follower(log)
        self.history = History(log.subjects.cluster, agent_work_dir)
        """What explain and the job history need beyond the state (``agent_work_dir``:
        the host agents' ``--work-dir``, when known, for the log locations)."""
        self.logger = logs.get("gateway", cluster=log.subjects.cluster)
        self.url: str | None = None
        self.ready = asyncio.Event()
        self.metrics = GatewayMetrics()
        self.start_batches: int | None = None
        """DECISIONS' last sequence when the gateway began to follow: until its view
        has folded that far it answers 503 ``catching_up`` (``None``: not known yet)."""
        self._wait_context: tuple[tuple[int, int, int | None], WaitContext] | None = None
        """The queue's reason codes' context, made once per folded state."""
        self._unauthenticated_logged_at = -float("inf")
        self._unauthenticated_unlogged = 0
        self._estimates: tuple[tuple[int, int, int | None], Estimates] | None = None
        self._estimating: tuple[tuple[int, int, int | None], asyncio.Future[Estimates]] | None = (
            None
        )
        self.app = web.Application(
            client_max_size=MAX_BODY_BYTES,
            middlewares=[
                self._measure,
                self._errors,
                self._authenticate,
                self._caught_up,
                self._iso_times,
            ],
        )
        r = self.app.router
        r.add_post("/v1/workloads", self.submit)
        r.add_get("/v1/workloads/{id}", self.get_workload)
        r.add_post("/v1/workloads/{id}/cancel", self.cancel)
        r.add_post("/v1/workloads/{id}/hold", self.hold)
        r.add_post("/v1/workloads/{id}/release", self.release)
        r.add_get("/v1/queue", self.queue)
        r.add_get("/v1/share", self.share)
        r.add_get("/v1/explain/{id}", self.explain)
        r.add_get("/v1/jobs", self.jobs)
        r.add_get("/v1/report", self.report)
        r.add_get("/v1/nodes", self.nodes)
        r.add_post("/v1/nodes/{node}/health", self.node_health)
        r.add_get("/v1/logs/{id}", self.get_log)
        r.add_get("/v1/budget", self.get_budget)
        r.add_post("/v1/budget", self.post_budget)
        r.add_get("/v1/status", self.status)
        r.add_get("/openapi.json", self.openapi)
        r.add_get("/metrics", self.get_metrics)
        from .dashboard import add_dashboard  # the web pages under /ui/ (docs/dashboard.md)

        add_dashboard(self.app, self)

    @property
    def state(self) -> State:
        return self.follower.state

    @property
    def caught_up(self) -> bool:
        """The view has folded every decision batch stored when the gateway began to
        follow (and so the inputs they are based on): it may answer from it."""
        target = self.start_batches
        return target is not None and self.follower.reader.batches_done >= target

    async def _measure_start(self, stop: asyncio.Event) -> None:
        """Set :attr:`start_batches` (asking again while NATS does not answer)."""
        while self.start_batches is None and not stop.is_set():
            try:
                self.start_batches = await asyncio.wait_for(self.log.last_batch_seq(), 5.0)
            except Exception as exc:  # NATS away or the stream not there yet: ask again
                self.logger.warning("could not read DECISIONS' last sequence", error=str(exc))
                await asyncio.sleep(0.5)
        self.logger.info("catching up", batches=self.start_batches)

    async def follow(self, stop: asyncio.Event) -> None:
        """Keep the view up to date until ``stop``."""
        try:
            await self._measure_start(stop)
            while not stop.is_set():
                items = await self.follower.poll(0.2, observer=self.history.observe)
                self.history.record(items)
                self.metrics.observe(items)
        finally:
            await self.follower.close()

    async def serve(self, stop: asyncio.Event, host: str = "127.0.0.1", port: int = 0) -> None:
        """Serve HTTP and follow the log until ``stop``; sets :attr:`url` once listening."""
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        server = site._server  # aiohttp exposes the bound port only here
        sockets = getattr(server, "sockets", None)  # an asyncio.Server once started
        bound = sockets[0].getsockname()[1] if sockets else port
        self.url = f"http://{host}:{bound}"
        self.ready.set()
        self.logger.info("listening", url=self.url, auth=self.auth is not None)
        if self.auth is None:
            self.logger.warning(
                "no authentication: anyone who reaches this gateway may act as anyone "
                "(actors are taken from request bodies)",
                url=self.url,
            )
        try:
            await self.follow(stop)
        finally:
            await runner.cleanup()

    # -- metrics --------------------------------------------------------
    @web.middleware
    async def _measure(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every request's latency into the histogram, by route template and status;
        a refused request that would have published an input into the rejections."""
        t0 = time.perf_counter()
        status = 500
        response: web.StreamResponse | None = None
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            self.metrics.request(
                route_of(request), request.method, status, time.perf_counter() - t0
            )
            if (
                response is not None
                and 400 <= status < 500
                and publishes_input(request.method, request.path)
            ):
                code = response.get(_CODE_KEY)
                self.metrics.refused(code if isinstance(code, str) else R.HTTP_ERROR)

    def now_ms(self) -> int:
        """The wall clock (never before the last event folded): what waits are measured to."""
        return max(self.state.now_ms, int(time.time() * 1000))

    async def estimates(self) -> Estimates:
        """Start-time estimates of the folded state, computed once per state: on a
        copy, in a worker thread (the event loop keeps serving meanwhile; requests
        for the same state share the computation). If the follower folds more while
        it runs, once more for the new state (at most three times)."""
        for _ in range(2):
            key = self._estimate_key()
            est = await self._estimate_once()
            if self._estimate_key() == key:
                return est
        return await self._estimate_once()

    def _estimate_key(self) -> tuple[int, int, int | None]:
        state = self.state
        return (state.input_seq, state.decisions_folded, self.history.basis)

    async def _estimate_once(self) -> Estimates:
        state = self.state
        key = (state.input_seq, state.decisions_folded, self.history.basis)
        if self._estimates is not None and self._estimates[0] == key:
            done: Estimates = self._estimates[1]
            return done
        if self._estimating is None or self._estimating[0] != key:
            context = estimate_context(state, self.history)
            snapshot = state.copy()
            future: asyncio.Future[Estimates] = asyncio.ensure_future(
                asyncio.to_thread(estimate_starts, snapshot, copy=False, **context)
            )
            self._estimating = (key, future)
        result: Estimates = await asyncio.shield(self._estimating[1])
        self._estimates = (key, result)
        return result

    # -- errors ---------------------------------------------------------
    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every error as JSON ``{"error": ..., "code": ...}``; a bug is a logged 500,
        never a stop."""
        try:
            return await handler(request)
        except _HttpError as exc:
            return _error(exc.code, exc.reason, headers=exc.headers)
        except web.HTTPException as exc:  # aiohttp's own: unknown path, method, body size
            if exc.status < 400:
                raise
            code = _HTTP_CODES.get(exc.status)
            reason = _http_reason(request, exc)
            if code is None:
                return _error(R.HTTP_ERROR, reason, status=exc.status)
            if isinstance(exc, web.HTTPMethodNotAllowed):  # RFC 9110: a 405 says what is allowed
                allow = ", ".join(sorted(exc.allowed_methods))
                return _error(code, reason, headers={"Allow": allow})
            return _error(code, reason)
        except _Unacknowledged as exc:
            self.logger.warning("publish not acknowledged", path=request.path, error=str(exc))
            extra: dict[str, Any] = {"workload": exc.workload} if exc.workload else {}
            return _error(R.UNACKNOWLEDGED, PUBLISH_UNACKNOWLEDGED.format(cause=exc), **extra)
        except Exception as exc:
            self.logger.exception("request failed", method=request.method, path=request.path)
            return _error(
                R.INTERNAL_ERROR, f"internal error ({type(exc).__name__}); see the gateway's log"
            )

    # -- identity -------------------------------------------------------
    @web.middleware
    async def _authenticate(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """401 for a ``/v1/...`` request without a valid credential (before its
        body is read); else the principal is kept for :meth:`_actor`."""
        if self.auth is not None and needs_credential(request.method, request.path):
            try:
                request[_PRINCIPAL_KEY] = self.auth.authenticate(request.headers)
            except AuthError as exc:
                self._not_authenticated(request, exc.reason)
                challenge = self.auth.challenge
                if exc.error:
                    challenge += f', error="{exc.error}"'
                raise _HttpError(
                    R.NOT_AUTHENTICATED,
                    f"not authenticated: {exc.reason}",
                    {"WWW-Authenticate": challenge},
                ) from None
        return await handler(request)

    # -- answering only from a caught-up, whole view ------------------------
    @web.middleware
    async def _caught_up(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """503 (``Retry-After``) for a ``/v1/...`` request (but the status) while
        the view has not caught up with the history, and for a ``POST`` while the
        history is not whole (inputs lost, no loss accepted)."""
        if needs_credential(request.method, request.path):
            gap = self.follower.gap
            if gap is not None:
                # the view cannot go past the gap: reads answer from the history before
                # it, nothing is published until the loss is accepted
                if request.method == "POST":
                    raise _HttpError(
                        R.HISTORY_INCOMPLETE,
                        f"the history is not whole: inputs {gap[0]}..{gap[1]} are missing "
                        "from INPUTS and no loss was accepted, so nothing new would be "
                        "scheduled; an operator accepts the loss with `apportion history "
                        "accept-loss` (docs/services.md, 'Lost inputs')",
                        {"Retry-After": str(GAP_RETRY_AFTER_S)},
                    )
            elif not self.caught_up:
                raise _HttpError(
                    R.CATCHING_UP,
                    "the gateway is catching up with the history (folded "
                    f"{self.follower.reader.batches_done:,} of "
                    f"{self.start_batches if self.start_batches is not None else '?'} decision "
                    "batches); retry shortly",
                    {"Retry-After": str(RETRY_AFTER_S)},
                )
        return await handler(request)

    @web.middleware
    async def _iso_times(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """A ``/v1/...`` JSON answer made elsewhere than :func:`_json` (the dashboard
        module's ``/v1/usage/history``) gets its ISO-8601 times here, so every API
        answer carries them."""
        response = await handler(request)
        if (
            request.path.startswith("/v1/")
            and isinstance(response, web.Response)
            and response.content_type == "application/json"
            and 200 <= response.status < 300
            and not response.get(_ISO_KEY)
            and isinstance(response.body, bytes)
        ):
            response.body = msgspec.json.encode(with_iso(msgspec.json.decode(response.body)))
            response[_ISO_KEY] = True
        return response

    async def _publish_checked(self, check: Callable[[], Any]) -> Any:
        """Publish the input ``check`` makes, or answer its refusal once it is final
        (:meth:`_final`): the publish ack, or the refusal's response."""
        event = check()
        if isinstance(event, Refusal):
            event = await self._final(event, check)
            if isinstance(event, Refusal):
                return _refused(event)
        return await _published(self.log.publish_input(event))

    async def _final(self, refused: Refusal, again: Callable[[], T | Refusal]) -> T | Refusal:
        """``refused`` if it is final: the view has folded every input stored. Else
        wait (at most :data:`REFUSAL_WAIT_S`) for the view to fold them, asking
        ``again`` as it moves; still behind: 503 ``catching_up``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REFUSAL_WAIT_S
        while True:
            try:
                stored = await asyncio.wait_for(self.log.last_input_seq(), 2.0)
            except Exception:  # NATS away: nothing could be published anyway
                return refused
            if self.state.input_seq >= stored:
                return refused
            if loop.time() >= deadline:
                raise _HttpError(
                    R.CATCHING_UP,
                    f"not final: {refused.message} in the gateway's view, which has folded "
                    f"{self.state.input_seq:,} of {stored:,} stored inputs (the scheduler has "
                    "not decided on the rest yet); retry shortly",
                    {"Retry-After": str(RETRY_AFTER_S)},
                )
            await asyncio.sleep(0.05)
            checked = again()
            if not isinstance(checked, Refusal):
                return checked
            refused = checked

    def _not_authenticated(self, request: web.Request, why: str) -> None:
        """Count a 401 (``apportion_gateway_unauthenticated_total``) and log it, at
        most one line every :data:`UNAUTHENTICATED_LOG_S` seconds (with how many
        came since the last line), so that a flood of bad requests cannot flood the log."""
        self.metrics.unauthenticated.inc()
        self._unauthenticated_unlogged += 1
        now = time.monotonic()
        if now - self._unauthenticated_logged_at < UNAUTHENTICATED_LOG_S:
            return
        self.logger.warning(
            "not authenticated",
            method=request.method,
            path=request.path,
            why=why,
            since_last_line=self._unauthenticated_unlogged,
        )
        self._unauthenticated_logged_at = now
        self._unauthenticated_unlogged = 0

    def _actor(self, request: web.Request, stated: str) -> str:
        """Who acts: the authenticated principal; ``stated`` (from the body) only
        when the gateway authenticates nobody."""
        if self.auth is None:
            return stated
        principal: str = request[_PRINCIPAL_KEY]
        return principal

    # -- handlers -------------------------------------------------------
    async def submit(self, request: web.Request) -> web.Response:
        body: SubmitRequest = await _body(request, SubmitRequest)
        workload = body.id or f"w-{uuid.uuid4().hex[:12]}"
        event = commands.submission(
            id=commands.submit_id(workload),
            at_ms=self.state.now_ms,
            workload=workload,
            owner=body.owner,
            gpus=body.gpus,
            min_runtime_ms=body.min_runtime_ms,
            gpu_type=body.gpu_type,
            resumable=body.resumable,
            priority=body.priority,
            submitted_by=self._actor(request, body.submitted_by),
            duration_ms=body.duration_ms,
            command=body.command,
            env=body.env,
            image=body.image,
            grace_ms=body.grace_ms,
        )
        checked = commands.submit(self.state, event)
        if isinstance(checked, Refusal):
            checked = await self._final(checked, lambda: commands.submit(self.state, event))
            if isinstance(checked, Refusal):
                return _refused(checked)
        ack = await _published(self.log.publish_input(event), workload)
        self.logger.info("submitted", workload=workload, seq=ack.seq, duplicate=ack.duplicate)
        return _json({"workload": workload, "seq": ack.seq, "duplicate": ack.duplicate}, status=202)

    async def cancel(self, request: web.Request) -> web.Response:
        workload = request.match_info["id"]
        body: CancelRequest = await _body(request, CancelRequest)
        actor = self._actor(request, body.actor)
        # the fold's rules, asked early for a 404, 409 or 403; the fold has the final word
        ack = await self._publish_checked(
            lambda: commands.cancel(self.state, workload, actor, self.state.now_ms)
        )
        if isinstance(ack, web.Response):
            return ack
        return _json({"workload": workload, "seq": ack.seq, "duplicate": ack.duplicate}, status=202)

    async def hold(self, request: web.Request) -> web.Response:
        """``POST /v1/workloads/{id}/hold``: keep a pending workload from being placed
        (by the same people as may cancel it); 404, 409 (``not_pending``) or 403 first."""
        return await self._hold(request, release=False)

    async def release(self, request: web.Request) -> web.Response:
        """``POST /v1/workloads/{id}/release``: let a held workload be placed again,
        at its old place in the queue; 404, 409 (``not_held``) or 403 first."""
        return await self._hold(request, release=True)

    async def _hold(self, request: web.Request, release: bool) -> web.Response:
        workload = request.match_info["id"]
        body: CancelRequest = await _body(request, CancelRequest)
        actor = self._actor(request, body.actor)
        what = "release" if release else "hold"
        event_id = f"{what}-{uuid.uuid4().hex}"

        def check() -> Any:
            return commands.hold(self.state, workload, actor, self.state.now_ms, event_id, release)

        ack = await self._publish_checked(check)
        if isinstance(ack, web.Response):
            return ack
        self.logger.info(what, workload=workload, actor=actor, seq=ack.seq)
        return _json({"workload": workload, "seq": ack.seq, "duplicate": ack.duplicate}, status=202)

    async def get_workload(self, request: web.Request) -> web.Response:
        workload = request.match_info["id"]
        w = self.state.workloads.get(workload)
        if w is not None:
            out = workload_json(w)
            est = await self.estimates()
            now = self.now_ms()
            if w.status == "pending":
                start = est.starts.get(workload)
                out["estimated_start_ms"] = None if start is None else max(start, now)
                if start is None:
                    out["estimate_note"] = est.why_unknown(workload)
            else:
                end = est.ends.get(workload)
                out["expected_end_ms"] = None if end is None else max(end, now)
            return _json(out)
        status = self.state.ended.get(workload) or (
            "rejected" if workload in self.history.rejected else None
        )
        if status is None:
            return _error(R.UNKNOWN_WORKLOAD, f"unknown workload {workload!r}")
        return _json({"workload": workload, "status": status})

    async def queue(self, request: web.Request) -> web.Response:
        """``GET /v1/queue``, with ``?user=``, ``?team=``, ``?state=pending|running``,
        ``?gpu_type=`` (a value out of its form or bound, a GPU type the cluster does
        not have: 400 ``bad_query``)."""
        try:
            only = QueueFilter.parse(request.query, gpu_types_of(self.state))
        except QueryError as exc:
            return _error(R.BAD_QUERY, str(exc))
        est = await self.estimates()
        key = self._estimate_key()
        if self._wait_context is None or self._wait_context[0] != key:
            self._wait_context = (key, WaitContext(self.state))
        return _json(
            queue_view(
                self.state,
                self.history,
                now_ms=self.now_ms(),
                estimates=est,
                only=only,
                wait_context=self._wait_context[1],
            )
        )

    async def share(self, request: web.Request) -> web.Response:
        return _json(budget_tree(self.state, detail=True))

    async def explain(self, request: web.Request) -> web.Response:
        workload = request.match_info["id"]
        est = await self.estimates()
        out = explain(self.state, self.history, workload, now_ms=self.now_ms(), estimates=est)
        if out is None:
            return _error(R.UNKNOWN_WORKLOAD, f"unknown workload {workload!r}")
        return _json(out)

    async def jobs(self, request: web.Request) -> web.Response:
        """``GET /v1/jobs``: ended (or any) workloads with filters (docs/formats.md,
        "Job history"); a parameter out of its bound is a 400 ``bad_query``."""
        now = self.now_ms()
        try:
            query = JobQuery.parse(request.query, now, gpu_types_of(self.state))
        except QueryError as exc:
            return _error(R.BAD_QUERY, str(exc))
        return _json(list_jobs(self.history.jobs, query, now))

    async def report(self, request: web.Request) -> web.Response:
        """``GET /v1/report``: GPU-hours, owed and delivered per team, user or day over
        the hours the usage history keeps (docs/formats.md, "Report"); a parameter
        out of its form or bound is a 400 ``bad_query``."""
        now = self.now_ms()
        try:
            query = ReportQuery.parse(request.query, now)
        except QueryError as exc:
            return _error(R.BAD_QUERY, str(exc))
        usage = getattr(self.history, "usage", None)
        if usage is None:  # a gateway without the dashboard's history keeps no usage
            usage = UsageHistory()
        return _json(accounting(usage, self.state.budget, query, now))

    async def read_log(
        self, workload: str, attempt: int | None, node: str | None, offset: int
    ) -> dict[str, Any]:
        """The answer of ``GET /v1/logs/{id}`` (:func:`.attempt_logs.answer`):
        :class:`_HttpError` 404 for an unknown workload, 400 ``bad_query`` for an
        attempt or host it does not have, 503 when NATS does not answer."""
        job = self.history.job(workload)
        if job is None:
            raise _HttpError(R.UNKNOWN_WORKLOAD, f"unknown workload {workload!r}")
        try:
            a, host = attempt_logs.pick(job, attempt, node)
        except attempt_logs.LogQueryError as exc:
            raise _HttpError(R.BAD_QUERY, str(exc)) from None
        try:
            view = await asyncio.wait_for(self.log.read_log(host, workload, a["attempt"]), 10.0)
        except Exception as exc:  # NATS away, the stream missing, a permission refused
            self.logger.warning("could not read a log", workload=workload, error=str(exc))
            raise _HttpError(
                R.CATCHING_UP,
                f"could not read the log from NATS ({type(exc).__name__}); try again",
                {"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        return attempt_logs.answer(job, a, host, offset, view)

    async def get_log(self, request: web.Request) -> web.Response:
        """``GET /v1/logs/{id}``: an attempt's output (docs/formats.md, "Logs"); read
        with explain's authority: any authenticated principal (docs/security.md)."""
        try:
            attempt, node, offset = attempt_logs.parse_query(request.query)
        except attempt_logs.LogQueryError as exc:
            return _error(R.BAD_QUERY, str(exc))
        return _json(await self.read_log(request.match_info["id"], attempt, node, offset))

    async def get_budget(self, request: web.Request) -> web.Response:
        return _json(budget_tree(self.state))

    async def nodes(self, request: web.Request) -> web.Response:
        """``GET /v1/nodes``: every host like ``sinfo`` (docs/formats.md, "Nodes");
        ``?state=healthy|draining|down``, else a 400 ``bad_query``."""
        try:
            only = parse_node_query(request.query)
        except QueryError as exc:
            return _error(R.BAD_QUERY, str(exc))
        return _json(nodes_view(self.state, self.history, only=only, now_ms=self.now_ms()))

    async def node_health(self, request: web.Request) -> web.Response:
        """``POST /v1/nodes/{node}/health``: publish a ``NodeHealthChanged`` by the
        principal; the fold's rules (an operator or the root's owner; a known host;
        a change) answer first: 403, 404, 409."""
        node = request.match_info["node"]
        body: HealthRequest = await _body(request, HealthRequest)
        if not body.reason.isprintable():
            return _error(
                R.MALFORMED, "invalid request: reason: printable text on one line, please"
            )
        actor = self._actor(request, body.actor)
        if not actor:
            return _error(
                R.MALFORMED, "invalid request: give 'actor' (this gateway does not authenticate)"
            )
        event_id = f"health-{uuid.uuid4().hex}"

        def check() -> Any:
            return commands.health(
                self.state, node, body.state, actor, self.state.now_ms, event_id, body.reason
            )

        ack = await self._publish_checked(check)
        if isinstance(ack, web.Response):
            return ack
        self.logger.info("node health", node=node, state=body.state, actor=actor, seq=ack.seq)
        return _json(
            {"node": node, "state": body.state, "seq": ack.seq, "duplicate": ack.duplicate},
            status=202,
        )

    async def post_budget(self, request: web.Request) -> web.Response:
        body: BudgetRequest = await _body(request, BudgetRequest)
        actor = self._actor(request, body.actor)
        if not actor:
            return _error(
                R.MALFORMED, "invalid request: give 'actor' (this gateway does not authenticate)"
            )

        def check() -> Any:
            return commands.budget(
                self.state,
                actor,
                [(n.path, n.weight, n.owner) for n in body.set],
                body.remove,
                self.state.now_ms,
                lambda: f"budget-{uuid.uuid4().hex}",
            )

        events = check()
        if isinstance(events, Refusal):
            events = await self._final(events, check)
            if isinstance(events, Refusal):
                return _refused(events)
        if self.tree is not None:
            from .federation import publish_tree_input

            tree = self.tree

            async def on_tree() -> list[Any]:
                return [await publish_tree_input(tree, e) for e in events]

            acks = await _published(on_tree())
            out = {"published": len(acks), "last_seq": acks[-1].seq, "on": "tree"}
            return _json(out, status=202)
        acks = await _published(self.log.publish_inputs(list(events)))
        return _json({"published": len(acks), "last_seq": acks[-1].seq}, status=202)

    async def status(self, request: web.Request) -> web.Response:
        r = self.follower.reader
        return _json(
            {
                "cluster": self.log.subjects.cluster,
                "input_seq": self.state.input_seq,
                "batches": r.batches_done,
                "now_ms": self.state.now_ms,
                "nodes": len(self.state.nodes),
                "pending": len(self.state.pending),
                "running": len(self.state.running),
                "caught_up": self.caught_up,
                **history_status(self.follower.gap, self.follower.reader.lost),
            }
        )

    async def get_metrics(self, request: web.Request) -> web.Response:
        """Prometheus text exposition; the lag asks NATS for INPUTS' last sequence."""
        try:
            stored: int | None = await asyncio.wait_for(self.log.last_input_seq(), 2.0)
        except Exception:  # NATS away: the other metrics still answer
            stored = None
        self.metrics.update(self.state, stored, self.now_ms())
        self.metrics.inputs.set_gap(self.follower.gap)
        body = self.metrics.render()
        if self.extra_metrics is not None:
            body += await self.extra_metrics()  # the scheduler's and projector's, under `up`
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())


def history_status(gap: tuple[int, int] | None, lost: list[tuple[int, int]]) -> dict[str, Any]:
    """The ``/v1/status`` fields about lost inputs: ``history`` (``whole``, or
    ``incomplete`` while inputs are missing with no loss accepted), ``missing``
    (``{"first","through","count"}`` of those, or ``None``) and ``lost`` (the
    accepted losses, ``[[first, through], ...]``)."""
    return {
        "history": "whole" if gap is None else "incomplete",
        "missing": None
        if gap is None
        else {"first": gap[0], "through": gap[1], "count": gap[1] - gap[0] + 1},
        "lost": [list(r) for r in lost],
    }


def _http_reason(request: web.Request, exc: web.HTTPException) -> str:
    """One line for an error aiohttp raised before a handler ran."""
    if exc.status == 404:
        return f"no such path: {request.method} {request.path}"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return f"method {request.method} not allowed on {request.path} (allowed: {allowed})"
    if exc.status == 413:
        return f"request body over {MAX_BODY_BYTES} bytes"
    return exc.reason


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 for the gateway; request schemas come from the msgspec Structs."""
    (submit, cancel, budget, health), components = msgspec.json.schema_components(
        [SubmitRequest, CancelRequest, BudgetRequest, HealthRequest],
        ref_template="#/components/schemas/{name}",
    )
    err = {
        "description": "error",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    components["Error"] = {
        "type": "object",
        "properties": {
            "error": {"type": "string", "description": "what went wrong, in words"},
            "code": {
                "type": "string",
                "enum": list(R.CODES),
                "description": "the stable reason code (docs/reasons.md)",
            },
            "workload": {"type": "string", "description": "504 of a submit: the id to retry with"},
        },
        "required": ["error", "code"],
    }
    publishing = {"413": err, "504": err}
    user_and_team = [  # the filters /v1/queue and /v1/jobs share
        {
            "name": "user",
            "in": "query",
            "description": "submitted by this principal",
            "schema": {"type": "string", "maxLength": MAX_NAME_LEN},
        },
        {
            "name": "team",
            "in": "query",
            "description": "owner leaf at or below this budget path",
            "schema": {"type": "string", "maxLength": MAX_PATH_LEN},
        },
    ]

    def query(name: str, description: str, **bounds: Any) -> dict[str, Any]:
        """A string query parameter (``bounds``: more of its schema, e.g. ``maxLength``)."""
        return {
            "name": name,
            "in": "query",
            "description": description,
            "schema": {"type": "string", **bounds},
        }

    gpu_type = query(  # the filter /v1/queue and /v1/jobs share
        "gpu_type",
        "the GPU type the work asked for: one of the cluster's (else 400, listing them) or any",
        maxLength=MAX_NAME_LEN,
    )
    unauthenticated = {
        "description": "no credential, or one the gateway does not know",
        "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    unavailable = {
        "description": "not caught up with the history yet (catching_up), or, for a POST, the "
        "history is not whole (history_incomplete): retry after Retry-After seconds",
        "headers": {"Retry-After": {"schema": {"type": "integer"}}},
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    ok = {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}
    accepted = {
        "description": "published to INPUTS",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
    wid = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]

    def body(schema: dict[str, Any]) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": schema}}}

    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "apportion gateway", "version": "1"},
        "paths": {
            "/v1/workloads": {
                "post": {
                    "summary": "Submit a workload",
                    "requestBody": body(submit),
                    "responses": {
                        "202": accepted,
                        "400": err,
                        "403": err,
                        "409": err,
                        **publishing,
                    },
                }
            },
            "/v1/workloads/{id}": {
                "get": {
                    "summary": "A workload's status",
                    "parameters": wid,
                    "responses": {"200": ok, "404": err},
                }
            },
            **{
                f"/v1/workloads/{{id}}/{what}": {
                    "post": {
                        "summary": summary,
                        "parameters": wid,
                        "requestBody": body(cancel),
                        "responses": {
                            "202": accepted,
                            "403": err,
                            "404": err,
                            "409": err,
                            **publishing,
                        },
                    }
                }
                for what, summary in (
                    ("cancel", "Cancel a workload"),
                    ("hold", "Hold a pending workload (it is not placed until released)"),
                    ("release", "Release a held workload (at its old place in the queue)"),
                )
            },
            "/v1/queue": {
                "get": {
                    "summary": "Pending workloads in order, with sort-key ratios; running ones",
                    "parameters": [
                        *user_and_team,
                        {
                            "name": "state",
                            "in": "query",
                            "description": "only this section (the other is empty)",
                            "schema": {"type": "string", "enum": ["pending", "running"]},
                        },
                        gpu_type,
                    ],
                    "responses": {"200": ok, "400": err},
                }
            },
            "/v1/share": {
                "get": {
                    "summary": "Budget tree with usage against allocation (like sshare)",
                    "responses": {"200": ok},
                }
            },
            "/v1/explain/{id}": {
                "get": {
                    "summary": "Why a workload is pending, running, preempted or ended",
                    "parameters": wid,
                    "responses": {"200": ok, "404": err},
                }
            },
            "/v1/jobs": {
                "get": {
                    "summary": "Ended (or any) workloads, newest first, with filters",
                    "parameters": [
                        query(
                            "state",
                            "statuses, comma-separated, or held, ended (default), live, all",
                        ),
                        *user_and_team,
                        query("id", "part of the workload id", maxLength=MAX_NAME_LEN),
                        query(
                            "since",
                            "ended since: a duration back (2d, 12h; at most a year), an "
                            "ISO-8601 time or epoch ms",
                        ),
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {
                                "type": "integer",
                                "minimum": 1,
                                "maximum": MAX_JOBS_LIMIT,
                                "default": DEFAULT_JOBS_LIMIT,
                            },
                        },
                        gpu_type,
                    ],
                    "responses": {"200": ok, "400": err},
                }
            },
            "/v1/report": {
                "get": {
                    "summary": "Accounting: GPU-hours used, owed and delivered per team, user "
                    "or day (like sreport)",
                    "parameters": [
                        *(
                            query(
                                name,
                                f"{words}: a duration back (7d, 12h), an ISO-8601 date or time "
                                "(UTC if no zone), epoch ms or simulated time (day 3 14:05); at "
                                f"most {MAX_REPORT_MS // 86_400_000} days in all",
                            )
                            for name, words in (
                                ("since", "from (default: the first hour kept)"),
                                ("until", "to (default: now)"),
                            )
                        ),
                        query(
                            "by",
                            f"group rows by one or two of {', '.join(REPORT_BY)}, "
                            "comma-separated (not team and user; default team)",
                        ),
                        query(
                            "team",
                            "only teams (and users) at or below this budget path",
                            maxLength=MAX_PATH_LEN,
                        ),
                    ],
                    "responses": {"200": ok, "400": err},
                }
            },
            "/v1/nodes": {
                "get": {
                    "summary": "Every host: type, GPUs, free, health, running work (like sinfo)",
                    "parameters": [
                        {
                            "name": "state",
                            "in": "query",
                            "description": "only hosts in this health state",
                            "schema": {"type": "string", "enum": list(NODE_STATES)},
                        }
                    ],
                    "responses": {"200": ok, "400": err},
                }
            },
            "/v1/nodes/{node}/health": {
                "post": {
                    "summary": "Drain, undrain or take down a host (operators, the root's owner)",
                    "parameters": [
                        {
                            "name": "node",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "requestBody": body(health),
                    "responses": {
                        "202": accepted,
                        "400": err,
                        "403": err,
                        "404": err,
                        "409": err,
                        **publishing,
                    },
                }
            },
            "/v1/logs/{id}": {
                "get": {
                    "summary": "An attempt's output as its host's agent shipped it (the last MiB)",
                    "parameters": [
                        *wid,
                        {
                            "name": "attempt",
                            "in": "query",
                            "description": "the attempt (default: the last)",
                            "schema": {"type": "integer", "minimum": 1},
                        },
                        {
                            "name": "node",
                            "in": "query",
                            "description": "the host (default: the first that started it)",
                            "schema": {"type": "string", "maxLength": MAX_NAME_LEN},
                        },
                        {
                            "name": "from",
                            "in": "query",
                            "description": "the byte offset to read from (a reply's next)",
                            "schema": {"type": "integer", "minimum": 0, "default": 0},
                        },
                    ],
                    "responses": {"200": ok, "400": err, "404": err},
                }
            },
            "/v1/budget": {
                "get": {"summary": "The budget tree", "responses": {"200": ok}},
                "post": {
                    "summary": "Set and remove budget nodes",
                    "requestBody": body(budget),
                    "responses": {
                        "202": accepted,
                        "400": err,
                        "403": err,
                        "404": err,
                        "409": err,
                        **publishing,
                    },
                },
            },
            "/v1/usage/history": {
                "get": {
                    "summary": "Owed, delivered and used GPU-ms per hour, per team and user",
                    "parameters": [
                        {"name": "team", "in": "query", "schema": {"type": "string"}},
                        {"name": "hours", "in": "query", "schema": {"type": "integer"}},
                    ],
                    "responses": {"200": ok, "400": err, "404": err},
                }
            },
            "/v1/status": {
                "get": {"summary": "Positions of the gateway's view", "responses": {"200": ok}}
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (text exposition format)",
                    "responses": {"200": {"description": "metrics"}},
                }
            },
        },
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "an apportion token (apt_...): apportion auth issue",
                }
            },
        },
        "security": [{"bearer": []}],
    }
    for path, item in doc["paths"].items():
        for operation in item.values():
            if path in ("/v1/status", "/metrics"):
                operation["security"] = []  # the health check needs no credential
            else:
                operation["responses"]["401"] = unauthenticated
                operation["responses"]["503"] = unavailable
    return doc
