"""Builders and condition waits for the services tests (no timed assertions)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

from apportion.schemas.events import (
    BudgetSet,
    Input,
    NodeRegistered,
    WorkloadSubmitted,
)
from apportion.services.bus import JetStreamLog
from apportion.services.gateway import Gateway
from apportion.services.runner import supervise_scheduler
from apportion.services.scheduler import Scheduler

PRINCIPALS = ("ops", "alice", "a", "b", "vic", "mallory")
"""Who the tests' gateway credentials name: the owners of :func:`small_cluster`, and
``mallory``, who owns nothing."""


def cli_env(url: str, token_file: Any) -> dict[str, str]:
    """The environment of a command-line client of the gateway at ``url``, acting as
    the principal of ``token_file``."""
    import os

    return {**os.environ, "APPORTION_URL": url, "APPORTION_TOKEN_FILE": str(token_file)}


def small_cluster(nodes: int = 2, gpus: int = 8) -> list[Input]:
    """``nodes`` h100 nodes of ``gpus`` GPUs; budget root(ops) -> llm(alice) -> llm/a, llm/b; vision."""
    events: list[Input] = [
        NodeRegistered(id=f"node-{i}", at_ms=0, node=f"h{i:03d}", gpus=gpus, gpu_type="h100")
        for i in range(nodes)
    ]
    events += [
        BudgetSet(id="b-root", at_ms=0, path="", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b-llm", at_ms=0, path="llm", weight=3, owner="alice", actor="ops"),
        BudgetSet(id="b-llm-a", at_ms=0, path="llm/a", weight=1, owner="a", actor="alice"),
        BudgetSet(id="b-llm-b", at_ms=0, path="llm/b", weight=1, owner="b", actor="alice"),
        BudgetSet(id="b-vision", at_ms=0, path="vision", weight=1, owner="vic", actor="ops"),
    ]
    return events


def submit(
    workload: str, owner: str = "llm/a", gpus: int = 4, min_runtime_ms: int = 60_000, **kw
) -> WorkloadSubmitted:
    kw.setdefault("submitted_by", "ops")  # the root's owner may submit anywhere
    return WorkloadSubmitted(
        id=f"submit-{workload}",
        at_ms=0,
        workload=workload,
        owner=owner,
        gpus=gpus,
        min_runtime_ms=min_runtime_ms,
        **kw,
    )


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], timeout: float = 30.0, what: str = "condition"
) -> None:
    """Wait until ``check()`` is true; fail after a generous ``timeout`` (never a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


# -- processes (subprocess-based tests: crash failover, clusters, `apportion up`) --

APPORTION_CMD = [sys.executable, "-m", "apportion"]


def audit_live(url: str, cluster: str) -> subprocess.CompletedProcess[str]:
    """``apportion audit --cluster NAME --nats URL`` as a user runs it."""
    return subprocess.run(
        [*APPORTION_CMD, "audit", "--cluster", cluster, "--nats", url],
        capture_output=True,
        text=True,
        timeout=120,
    )


def processes_with_arg(arg: str) -> list[int]:
    """Pids of live processes whose command line has ``arg`` as one argument (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and arg.encode() in argv:
            pids.append(int(entry.name))
    return pids


def kill_and_reap(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.wait(30)


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Wait until something listens on loopback ``port``; fail if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"process exited with {proc.returncode}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.05)


class Roles(NamedTuple):
    """One cluster's log as the scheduler, the operator and the gateway see it (each
    connected with its own credential: tests/services/conftest.py, ``roles``)."""

    sched: JetStreamLog
    op: JetStreamLog
    gw: JetStreamLog


@contextlib.asynccontextmanager
async def gateway_on(roles: Roles, auth: Any, **options: Any) -> AsyncIterator[Gateway]:
    """A supervised scheduler (the scheduler's log) and a gateway (the gateway's;
    checking ``auth``, ``None``: no auth; ``options``: the gateway's others) with
    :func:`small_cluster` published first by the operator, the gateway caught up with it."""
    await roles.op.publish_inputs(small_cluster())
    scheduler, gateway = Scheduler(roles.sched), Gateway(roles.gw, auth=auth, **options)
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(supervise_scheduler(scheduler, stop)),
        asyncio.create_task(gateway.serve(stop, port=0)),
    ]
    try:
        await gateway.ready.wait()
        await eventually(lambda: gateway.state.input_seq >= len(small_cluster()), what="caught up")
        yield gateway
    finally:
        stop.set()
        await asyncio.gather(*tasks)
