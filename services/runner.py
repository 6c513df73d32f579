"""Run one service in its own process (``apportion serve KIND``; benchmarks), and
the supervision both ``serve`` and ``apportion up`` use.

``apportion up`` runs every service in one event loop; in production each runs
as its own process (several gateways, two schedulers for take-over, one
projector per DuckDB file), all pointed at the same NATS cluster.

- :func:`supervise_scheduler` runs the scheduler again after a transient NATS
  error (:func:`is_transient`); any other error ends it (logged).
- :class:`Supervisor` keeps named children running: one that ends before the
  stop (an error, a cancelled task, a process that exited) is logged with why
  and started again after a back-off that doubles while it keeps failing.
- :func:`stop_within` bounds a stop: the children get a grace period, then are
  cancelled; :func:`exit_watchdog` ends a process whose event loop does not
  come back at all (the in-process equivalent of escalating to SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from . import logs
from .bus import JetStreamLog, client_timeout_s, connect

KINDS = ("scheduler", "projector", "gateway", "executor")

STOP_GRACE_S = 10.0
"""How long a stopping service may take before it is cancelled (and, for a whole
process, before the watchdog ends it)."""


def is_transient(exc: BaseException) -> bool:
    """An error a NATS (cluster) outage raises: no responders, no stream leader,
    a timeout, a reset connection. A message the server refuses (too large, a
    4xx JetStream answer) is not: sending it again fails again."""
    import nats.errors
    from nats.js.errors import APIError

    if isinstance(exc, nats.errors.MaxPayloadError):
        return False
    if isinstance(exc, APIError):
        return exc.code is None or exc.code >= 500
    return isinstance(exc, nats.errors.Error | TimeoutError | OSError)


async def supervise_scheduler(scheduler: Any, stop: asyncio.Event, retry_s: float = 0.5) -> None:
    """``scheduler.run(stop)``, started again after a transient NATS error.

    A stream or KV leader lost in a cluster (a node killed) makes a publish or a
    lease renewal fail until a new leader is elected. That is no reason to stop
    scheduling: run again, which recovers from the snapshot and the log (a batch
    whose acknowledgement was lost is found there; fencing keeps the log right).
    Any other error (a batch the server refuses, a corrupt history) is logged
    and raised: retrying it would fail the same way.
    """
    while True:
        try:
            await scheduler.run(stop)
            return
        except Exception as exc:
            if stop.is_set():
                return  # stopping anyway; an unreleased lease just expires
            if not is_transient(exc):
                scheduler.logger.error("stopped by an error", error=_why(exc))
                raise
            scheduler.logger.warning("interrupted; recovering", error=_why(exc))
            scheduler.leading.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), retry_s)


async def run_scheduler(scheduler: Any, stop: asyncio.Event) -> None:
    """:func:`supervise_scheduler`, with the usage forwarder of a federated cluster
    beside it (:class:`~apportion.services.federation.UsageForwarder`: it
    forwards while this scheduler leads, and idles while the cluster has no
    ``USAGE_<c>``, so a cluster joins with no restart). A log in memory has none."""
    nc = getattr(scheduler.log, "nc", None)
    if nc is None:
        await supervise_scheduler(scheduler, stop)
        return
    from .federation import UsageForwarder

    forwarder = UsageForwarder(
        nc,
        scheduler.log.subjects.cluster,
        leading=scheduler.leading,
        on_forward=scheduler.metrics.usage_forwarded.inc,
    )
    beside = asyncio.create_task(forwarder.run(stop), name="usage-forwarder")
    try:
        await supervise_scheduler(scheduler, stop)
    finally:
        beside.cancel()
        with contextlib.suppress(BaseException):
            await beside


def _why(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}".rstrip(": ")


class Supervisor:
    """Keeps named children running until ``stop`` is set.

    A child is a coroutine factory; each start runs it as its own task (in
    :attr:`tasks`, so it can be killed by cancelling it). When it ends before
    ``stop`` -- an error, a cancellation, or returning -- the supervisor logs
    which child and why, waits, and starts it again. The wait starts at
    ``first_delay_s`` and doubles after each failure up to ``max_delay_s``; a
    child that ran ``healthy_s`` seconds starts again from the first delay.
    """

    def __init__(
        self,
        stop: asyncio.Event,
        logger: Any,
        *,
        first_delay_s: float = 0.5,
        max_delay_s: float = 30.0,
        healthy_s: float = 60.0,
    ) -> None:
        self.stop = stop
        self.logger = logger
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.healthy_s = healthy_s
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        """The running task of each child."""
        self.restarts: dict[str, int] = {}
        self.last_error: dict[str, str] = {}
        self.failed: dict[str, asyncio.Event] = {}
        """Set each time the child ends before the stop."""

    def failed_event(self, name: str) -> asyncio.Event:
        """The event set each time child ``name`` ends before the stop."""
        return self.failed.setdefault(name, asyncio.Event())

    async def run(self, name: str, start: Callable[[], Awaitable[Any]]) -> None:
        """Run child ``name`` (``start()``) until the stop, restarting it as it dies."""
        delay = self.first_delay_s
        self.restarts.setdefault(name, 0)
        failed = self.failed_event(name)
        while not self.stop.is_set():
            began = time.monotonic()
            child = asyncio.ensure_future(start())
            self.tasks[name] = child
            try:
                await asyncio.wait([child])
            except asyncio.CancelledError:
                child.cancel()
                await asyncio.gather(child, return_exceptions=True)
                raise
            if self.stop.is_set() and not child.cancelled() and child.exception() is None:
                return
            if child.cancelled():
                why = "cancelled (killed)"
            elif child.exception() is not None:
                exc = child.exception()
                assert exc is not None
                why = _why(exc)
            else:
                why = "ended on its own"
            if self.stop.is_set():
                self.logger.warning("child ended while stopping", child=name, why=why)
                return
            if time.monotonic() - began >= self.healthy_s:
                delay = self.first_delay_s
            self.last_error[name] = why
            failed.set()
            self.logger.error("child died; restarting", child=name, why=why, restart_in_s=delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)
            delay = min(delay * 2, self.max_delay_s)
            if not self.stop.is_set():
                self.restarts[name] += 1
                self.logger.info("restarted", child=name, restarts=self.restarts[name])


async def stop_within(tasks: Iterable[asyncio.Task[Any]], grace_s: float, logger: Any) -> None:
    """Wait up to ``grace_s`` for ``tasks`` (told to stop already), then cancel the
    ones still running and wait up to ``grace_s`` more; log what would not stop."""
    pending = {t for t in tasks if not t.done()}
    if pending:
        _done, pending = await asyncio.wait(pending, timeout=grace_s)
    if pending:
        names = sorted(t.get_name() for t in pending)
        logger.warning("did not stop within the grace period; cancelling", tasks=names)
        for t in pending:
            t.cancel()
        _done, pending = await asyncio.wait(pending, timeout=grace_s)
    if pending:
        logger.error("still running after cancel", tasks=sorted(t.get_name() for t in pending))


def exit_watchdog(
    grace_s: float, logger: Any, before_exit: Callable[[], None] | None = None
) -> threading.Timer:
    """A timer thread that ends the process (status 1) if it still runs after
    ``grace_s`` seconds: for a stop whose event loop is stuck. Cancel it once
    the process stopped cleanly, and join it."""

    def fire() -> None:
        logger.error("did not stop within the grace period; exiting", grace_s=grace_s)
        if before_exit is not None:
            with contextlib.suppress(Exception):
                before_exit()
        os._exit(1)

    timer = threading.Timer(grace_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def _has_user(url: str) -> bool:
    """Whether the (first) server of ``url`` names a user."""
    from urllib.parse import urlparse

    first = url.split(",")[0].strip()
    return bool(urlparse(first if "://" in first else f"nats://{first}").username)


async def serve(
    kind: str,
    url: str,
    cluster: str,
    *,
    db: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8642,
    replicas: int = 1,
    snapshot_every: int = 5000,
    position: Any = None,
    ready: Any = None,
    stop: asyncio.Event | None = None,
    grace_s: float = STOP_GRACE_S,
    credentials: str | Path | None = None,
    insecure: bool = False,
    metrics_port: int | None = None,
    agent_work_dir: str | None = None,
    hub_url: str | None = None,
) -> None:
    """Run service ``kind`` until SIGINT/SIGTERM (or ``stop``).

    The gateway authenticates with the credentials file ``credentials``
    (:class:`~apportion.services.auth.TokenAuthenticator`); without one it needs
    ``insecure=True`` (it then authenticates nobody, and says so in its log).

    ``position`` (a ``multiprocessing.Value``) receives the projector's committed
    input sequence; ``ready`` (an ``Event``) is set once the service starts.
    ``metrics_port`` (scheduler, projector, executor; ``None``: none) serves the service's
    Prometheus metrics at ``http://<host>:<metrics_port>/metrics`` (0: any free
    port, logged); the gateway serves its own on its port. ``agent_work_dir``
    (gateway): the host agents' ``--work-dir``, for the log locations ``explain`` gives.
    ``hub_url`` (gateway, in a federation): the hub, where budget edits are then
    published once for every cluster (docs/federation.md).
    A signal gives the service ``grace_s`` seconds to stop, then it is
    cancelled; a process still alive ``2 * grace_s`` after the signal exits.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown service {kind!r}; one of {', '.join(KINDS)}")
    if metrics_port is not None and kind == "gateway":
        raise ValueError(
            "--metrics-port is not for the gateway: it serves /metrics on its own port"
        )
    gateway_auth = None
    if kind == "gateway":
        from .auth import TokenAuthenticator

        if credentials is not None:
            gateway_auth = TokenAuthenticator(credentials)  # a bad file fails before connecting
        elif not insecure:
            raise ValueError(
                "the gateway needs a credentials file (--credentials FILE or "
                "$APPORTION_CREDENTIALS), or --no-auth to run without authentication"
            )
    if hub_url is not None and kind != "gateway":
        raise ValueError("the hub's URL is for the gateway only")
    nc = await connect(url, name=f"apportion-{kind}")
    hub = None
    if hub_url is not None:
        try:
            hub = await connect(hub_url, name=f"apportion-{kind}-hub")
        except BaseException:
            await nc.close()
            raise
    log = JetStreamLog(nc.jetstream(), cluster, replicas=replicas)
    stop = stop or asyncio.Event()
    logger = logs.get(kind, cluster=cluster)
    loop = asyncio.get_running_loop()
    watchdog: list[threading.Timer] = []

    def on_signal() -> None:
        stop.set()
        if not watchdog:
            watchdog.append(exit_watchdog(2 * grace_s, logger))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    reporter = None
    metrics_runner = None
    try:
        if kind == "scheduler" or not _has_user(url):
            await log.setup()
        # else: the scheduler sets the streams up; a service with a user of its own
        # has no JetStream API (an account of its own: docs/security.md) and reads
        # with direct gets, which wait for the streams to exist
        service: Any
        if kind == "scheduler":
            from .scheduler import Scheduler

            service = Scheduler(
                log,
                await log.snapshots(),
                await log.lease(holder=f"{socket.gethostname()}-{id(log)}"),
                snapshot_every=snapshot_every,
            )
            main = run_scheduler(service, stop)
        elif kind == "projector":
            from .metrics import ProjectorMetrics
            from .projector import Projector, open_projection_for

            pmetrics = ProjectorMetrics()  # counts a rebuild at open too
            service = Projector(
                log, await open_projection_for(db, log, metrics=pmetrics), metrics=pmetrics
            )
            if position is not None:

                async def report() -> None:
                    while not stop.is_set():
                        position.value = service.projection.position[0]
                        await asyncio.sleep(0.01)

                reporter = asyncio.ensure_future(report())
            main = service.run(stop)
        elif kind == "gateway":
            from .gateway import Gateway

            service = Gateway(
                log,
                auth=gateway_auth,
                agent_work_dir=agent_work_dir,
                tree=None if hub is None else hub.jetstream(timeout=client_timeout_s()),
            )
            main = service.serve(stop, host, port)
        else:
            from .executor import Executor

            service = Executor(log)
            main = service.run(stop)
        if metrics_port is not None:
            from .metrics import start_metrics_server

            try:
                metrics_runner, metrics_url = await start_metrics_server(
                    service.metrics_text, host, metrics_port
                )
            except BaseException:
                main.close()  # never started
                raise
            logger.info("metrics", url=metrics_url)
        if ready is not None:
            ready.set()
        task = asyncio.ensure_future(main)
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not task.done():
            await stop_within([task], grace_s, logger)
        if not task.cancelled():
            task.result()  # a service's error ends the process with it
    finally:
        if reporter is not None:
            reporter.cancel()
        if metrics_runner is not None:
            with contextlib.suppress(Exception):
                await metrics_runner.cleanup()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), grace_s)
        if hub is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(hub.close(), grace_s)
        for timer in watchdog:
            timer.cancel()
            timer.join()  # gone before the interpreter ends (a live daemon thread can abort it)


def serve_process(
    kind: str, url: str, cluster: str, db: str | None, position: Any, ready: Any
) -> None:
    """``multiprocessing`` target (importable, so ``spawn`` finds it)."""
    logs.configure("warning")
    asyncio.run(
        serve(kind, url, cluster, db=db, position=position, ready=ready, snapshot_every=50_000)
    )
