"""Run one service in its own process (``apportion serve KIND``; benchmarks).

``apportion up`` runs every service in one event loop; in production each runs
as its own process (several gateways, two schedulers for take-over, one
projector per DuckDB file), all pointed at the same NATS cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from pathlib import Path
from typing import Any

from . import logs
from .bus import JetStreamLog, connect

KINDS = ("scheduler", "projector", "gateway", "executor")


def transient_errors() -> tuple[type[BaseException], ...]:
    """Errors a NATS (cluster) outage raises: no responders, no stream leader, timeouts, resets."""
    import nats.errors

    return (nats.errors.Error, TimeoutError, OSError)


async def supervise_scheduler(scheduler: Any, stop: asyncio.Event, retry_s: float = 0.5) -> None:
    """``scheduler.run(stop)``, started again after a transient NATS error.

    A stream or KV leader lost in a cluster (a node killed) makes a publish or a
    lease renewal fail until a new leader is elected. That is no reason to stop
    scheduling: run again, which recovers from the snapshot and the log (a batch
    whose acknowledgement was lost is found there; fencing keeps the log right).
    """
    transient = transient_errors()
    while True:
        try:
            await scheduler.run(stop)
            return
        except transient as exc:
            if stop.is_set():
                return  # stopping anyway; an unreleased lease just expires
            scheduler.logger.warning(
                "interrupted; recovering", error=f"{type(exc).__name__}: {exc}"
            )
            scheduler.leading.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), retry_s)


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
) -> None:
    """Run service ``kind`` until SIGINT/SIGTERM (or ``stop``).

    ``position`` (a ``multiprocessing.Value``) receives the projector's committed
    input sequence; ``ready`` (an ``Event``) is set once the service starts.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown service {kind!r}; one of {', '.join(KINDS)}")
    nc = await connect(url, name=f"apportion-{kind}")
    log = JetStreamLog(nc.jetstream(), cluster, replicas=replicas)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    reporter = None
    try:
        await log.setup()
        service: Any
        if kind == "scheduler":
            from .scheduler import Scheduler

            service = Scheduler(
                log,
                await log.snapshots(),
                await log.lease(holder=f"{socket.gethostname()}-{id(log)}"),
                snapshot_every=snapshot_every,
            )
            task = supervise_scheduler(service, stop)
        elif kind == "projector":
            from .projector import Projector, open_projection

            service = Projector(log, open_projection(db))
            if position is not None:

                async def report() -> None:
                    while not stop.is_set():
                        position.value = service.projection.position[0]
                        await asyncio.sleep(0.01)

                reporter = asyncio.ensure_future(report())
            task = service.run(stop)
        elif kind == "gateway":
            from .gateway import Gateway

            service = Gateway(log)
            task = service.serve(stop, host, port)
        else:
            from .executor import Executor

            service = Executor(log)
            task = service.run(stop)
        if ready is not None:
            ready.set()
        await task
    finally:
        if reporter is not None:
            reporter.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await nc.close()


def serve_process(
    kind: str, url: str, cluster: str, db: str | None, position: Any, ready: Any
) -> None:
    """``multiprocessing`` target (importable, so ``spawn`` finds it)."""
    logs.configure("warning")
    asyncio.run(
        serve(kind, url, cluster, db=db, position=position, ready=ready, snapshot_every=50_000)
    )
