"""The host agent's runtime: each run placed on the host as a real process.

:class:`ProcessRuntime` implements the executor port
(:class:`~apportion.services.executor_port.Runtime`) for one host: it claims an
attempt's folder, picks the local GPU indices (lowest free first; never two
live runs on one index), builds the workload's environment (its ``env``, then
the contract of docs/agent.md, which wins), starts it through the supervisor
(:mod:`~apportion.services.agent_runs`, :mod:`~apportion.services.agent_shim`),
in a container when the workload has an ``image``, and stops it with notice
(a ``preempt-notice`` file and SIGTERM to its process group, SIGKILL when the
notice ends). What to start and stop is the reconcile's
(:mod:`apportion.core.reconcile`), not this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Container, Iterable
from pathlib import Path
from typing import Any

from apportion.core.reconcile import DesiredRun, RunKey, Stop
from apportion.schemas.events import WorkloadSubmitted

from . import agent_runs
from .agent_fence import Lease
from .agent_runs import Attempt
from .agent_shim import NOTICE

SLEEPER = (
    "import signal, sys, time\n"
    "s = sys.argv[1] if len(sys.argv) > 1 else ''\n"
    "time.sleep(float(s)) if s else signal.pause()\n"
)
"""What a workload without a command runs: sleep for the rest of its ``duration_ms``
(forever without one), like the executor emulator."""

_SECRET_PREFIXES = ("NATS_", "APPORTION_")
"""The agent's own configuration (its NATS URL may hold a password) is not handed
to workloads."""


def master_port(workload: str, attempt: int) -> int:
    """A port in 20000-29999 from the workload id and attempt: every rank computes
    the same one, and a retry gets another (a port still in TIME_WAIT is avoided)."""
    digest = hashlib.sha256(f"{workload}/{attempt}".encode()).digest()
    return 20000 + int.from_bytes(digest[:4], "big") % 10000


def container_runtime(choice: str = "auto") -> str:
    """The container runtime to use for workloads with an ``image`` (``""``: none)."""
    if choice == "none":
        return ""
    if choice != "auto":
        return shutil.which(choice) or ""
    return shutil.which("docker") or shutil.which("podman") or ""


class ProcessRuntime:
    """The runs of host ``node`` as processes under ``root`` (``<work-dir>/<cluster>/<node>``)."""

    adopts_under_notice = False  # a run under notice it never started has no process here

    def __init__(
        self,
        *,
        node: str,
        gpus: int,
        root: Path,
        checkpoint_root: Path,
        addr: str,
        peers: dict[str, str],
        logger: Any,
        clock: Callable[[], int],
        container: str = "",
        real_gpus: bool = False,
        lease: Lease | None = None,
    ) -> None:
        self.host: str | None = node
        self.lease = lease
        """The agent's lease: nothing starts while it is out of date; each run's
        supervisor fences by it."""
        self.node = node
        self.gpus = gpus
        self.root = root
        self.checkpoint_root = checkpoint_root
        self.addr = addr
        self.peers = peers
        """Advertised addresses of the hosts heard from (heartbeats): ``MASTER_ADDR``."""
        self.logger = logger
        self.clock = clock
        self.container = container
        self.real_gpus = real_gpus
        self.runs: dict[RunKey, Attempt] = {}
        """Attempts on this host not done with (running, stopping, or to report)."""
        self.finished: set[RunKey] = set()
        """Attempts done with (reported, or a folder that existed): never started again."""
        self._waiting: set[RunKey] = set()
        self.started = 0

    # -- the port --------------------------------------------------------
    def held(self) -> Iterable[tuple[RunKey, bool]]:
        return [(key, run.exited) for key, run in self.runs.items()]

    def done(self) -> Container[RunKey]:
        return self.finished

    def probe(self) -> None:
        for run in self.runs.values():
            if not run.exited:
                agent_runs.check(run)

    def gone(self, key: RunKey) -> None:
        """Nothing to do: a live run is stopped (:meth:`stop`), an ended one is
        settled with its end report."""

    async def stop(self, stop: Stop) -> None:
        run = self.runs.get(stop.key)
        if run is None or run.exited:
            return
        now = time.monotonic()
        self._notice(run, stop.reason, stop.grace_ms, now)
        if run.stopping and not run.killed and run.kill_at is not None and now >= run.kill_at:
            run.killed = True
            agent_runs.note(run, "notice over: SIGKILL")
            await asyncio.to_thread(agent_runs.send, run, signal.SIGKILL)

    async def launch(self, run: DesiredRun) -> bool:
        key = run.key
        if self.lease is not None and not self.lease.valid():
            return self._wait(
                run, "fenced: no heartbeat confirmed by the bus within the self-fence bound"
            )
        free = self._free_indices()
        addr = self.addr if run.master == self.node else self.peers.get(run.master)
        if addr is None:
            return self._wait(run, f"no heartbeat heard from {run.master} (MASTER_ADDR)")
        if len(free) < run.slot_gpus:
            return self._wait(run, "GPUs still held by a stopping run")
        self._waiting.discard(key)
        await self._start(run, tuple(free[: run.slot_gpus]), addr)
        return True

    def _wait(self, run: DesiredRun, why: str) -> bool:
        """``run`` cannot start yet: say why once (until it starts); False."""
        if run.key not in self._waiting:
            self._waiting.add(run.key)
            self.logger.info(
                "waiting to start", workload=run.workload, attempt=run.attempt, why=why
            )
        return False

    # -- the rest ----------------------------------------------------------
    def adopt(self) -> None:
        """Take every attempt folder not done with (an agent starting again)."""
        for run in agent_runs.scan(self.root):
            self.runs[run.key] = run
            self.logger.info(
                "adopted" if not run.exited else "found ended",
                workload=run.workload,
                attempt=run.attempt,
                exit_code=run.exit_code,
                lost=run.lost,
            )

    def settle(self, run: Attempt) -> None:
        """``run`` is done with (its end reported or not needed)."""
        del self.runs[run.key]
        self.finished.add(run.key)

    def prune(self, live: Container[str]) -> None:
        self.finished = {k for k in self.finished if k[0] in live}

    def _notice(self, run: Attempt, reason: str, grace_ms: int, now: float) -> None:
        """Notice: SIGTERM to the run's group now, SIGKILL ``grace_ms`` later (an
        earlier deadline replaces a later one: a node lost during a notice)."""
        kill_at = now + grace_ms / 1000
        if run.kill_at is not None and run.kill_at <= kill_at:
            return
        first = run.kill_at is None
        run.kill_at, run.stop_reason = kill_at, reason
        if not first:
            return
        deadline_ms = self.clock() + grace_ms
        with contextlib.suppress(OSError):
            agent_runs.mark(
                run,
                NOTICE,
                json.dumps({"reason": reason, "grace_ms": grace_ms, "deadline_ms": deadline_ms})
                + "\n",
            )
        agent_runs.note(run, f"{reason}: SIGTERM, SIGKILL in {grace_ms / 1000:g} s")
        agent_runs.send(run, signal.SIGTERM)
        self.logger.info(
            "stopping", workload=run.workload, attempt=run.attempt, why=reason, grace_ms=grace_ms
        )

    async def stop_all(self, grace_ms: Callable[[str], int]) -> list[Attempt]:
        """Stop every live run (the agent stopping): SIGTERM, SIGKILL after its
        notice (5 s at most: within the stop's grace); returns them."""
        live = [r for r in self.runs.values() if not r.exited]
        if not live:
            return live
        now = time.monotonic()
        for run in live:
            self._notice(run, "agent stopping", min(grace_ms(run.workload), 5_000), now)
        deadline = now + 8.0
        while time.monotonic() < deadline:
            now = time.monotonic()
            for run in live:
                agent_runs.check(run)
                if not run.exited and not run.killed and run.kill_at and now >= run.kill_at:
                    run.killed = True
                    agent_runs.send(run, signal.SIGKILL)
            if all(r.exited for r in live):
                break
            await asyncio.sleep(0.1)
        return live

    def _free_indices(self) -> list[int]:
        used = {i for r in self.runs.values() if not r.exited for i in r.indices}
        return [i for i in range(self.gpus) if i not in used]

    async def _start(self, want: DesiredRun, indices: tuple[int, ...], addr: str) -> None:
        key = want.key
        wid, attempt = key
        path = agent_runs.attempt_dir(self.root, wid, attempt)
        if not agent_runs.claim(path):
            self.finished.add(key)
            self.logger.warning(
                "not starting an attempt whose folder exists", workload=wid, attempt=attempt
            )
            return
        sub = want.submission
        run = Attempt(
            workload=wid,
            attempt=attempt,
            dir=path,
            indices=indices,
            rank=want.rank,
            ranks=want.ranks,
        )
        self.runs[key] = run
        ckpt = self.checkpoint_root / wid
        ckpt.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(_SECRET_PREFIXES)}
        if sub is not None:
            env.update(sub.env)
        in_container = bool(sub is not None and sub.image)
        visible = indices
        if in_container and self.real_gpus:
            visible = tuple(range(len(indices)))  # the runtime maps the devices to 0..n-1
        contract = {
            "APPORTION_WORKLOAD": wid,
            "APPORTION_ATTEMPT": str(attempt),
            "APPORTION_NODE": self.node,
            "APPORTION_OWNER": want.owner,
            "APPORTION_GPUS": str(want.gpus),
            "APPORTION_CHECKPOINT_DIR": str(ckpt),
            "APPORTION_NOTICE_FILE": str(path / NOTICE),
            "APPORTION_ATTEMPT_DIR": str(path),
            "APPORTION_GRACE_S": f"{want.grace_ms / 1000:g}",
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in visible),
            "WORLD_SIZE": str(want.ranks),
            "NNODES": str(want.ranks),
            "RANK": str(want.rank),
            "NODE_RANK": str(want.rank),
            "LOCAL_WORLD_SIZE": str(want.slot_gpus),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(master_port(wid, attempt)),
        }
        env.update(contract)
        argv: list[str] | None
        if in_container:
            assert sub is not None
            argv = self._container_argv(run, sub, sorted(set(sub.env) | set(contract)))
            argv = argv if argv else None
        elif sub is not None and sub.command:
            argv = list(sub.command)
        else:
            left_ms = want.remaining_ms
            left = None if left_ms is None else left_ms / 1000
            argv = [sys.executable, "-c", SLEEPER, "" if left is None else f"{left:.3f}"]
        if argv is None:
            run.started_reported = True  # nothing started
            agent_runs.note(run, f"image {sub.image if sub else ''!r}: no container runtime here")
            agent_runs.mark(run, "exit", json.dumps({"exit_code": 127}) + "\n")
            return
        try:
            fence = None
            if self.lease is not None:
                fence = {"lease": str(self.lease.path), **self.lease.fields()}
            await asyncio.to_thread(agent_runs.launch, run, argv, env, str(ckpt), fence)
        except (OSError, subprocess.SubprocessError) as exc:
            run.started_reported = True  # nothing started
            agent_runs.note(run, f"cannot start the supervisor: {exc}")
            if not (path / "exit").exists():
                agent_runs.mark(run, "exit", json.dumps({"exit_code": 126}) + "\n")
            return
        self.started += 1
        self.logger.info(
            "started",
            workload=wid,
            attempt=attempt,
            rank=want.rank,
            ranks=want.ranks,
            gpus=",".join(map(str, indices)),
            dir=str(path),
        )

    def _container_argv(self, run: Attempt, sub: WorkloadSubmitted, names: list[str]) -> list[str]:
        """``docker|podman run`` for ``sub.image`` (``[]``: no runtime)."""
        if not self.container:
            return []
        name = f"apportion-{run.workload}-{run.attempt}-{self.node}"
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:128]
        run.container, run.runtime = name, self.container
        argv = [self.container, "run", "--rm", "--init", "--name", name, "--network", "host"]
        for mount in (run.dir, self.checkpoint_root / run.workload):
            argv += ["-v", f"{mount}:{mount}"]
        for k in names:
            argv += ["-e", k]
        if self.real_gpus and run.indices:
            devices = ",".join(map(str, run.indices))
            if Path(self.container).name == "podman":
                for i in run.indices:
                    argv += ["--device", f"nvidia.com/gpu={i}"]
            else:
                argv += ["--gpus", f'"device={devices}"']
        return [*argv, sub.image, *sub.command]
