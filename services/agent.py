"""``apportion agent``: one per host; runs the workloads the scheduler places there.

The agent follows the canonical history (like every reader) and acts on it once
it has caught up:

- **registers** its host (``NodeRegistered`` as ``agent:<node>``) unless the
  history already holds it with the same GPUs;
- **starts** every run placed on its host as a real process, through a small
  supervisor (:mod:`~apportion.services.agent_shim`) in its own session, with
  ``CUDA_VISIBLE_DEVICES`` set to the local GPU indices it picks for the slot
  (lowest free first; never two live runs on one index), the workload's
  ``command`` and ``env`` from its ``WorkloadSubmitted``, the contract variables
  (docs/agent.md), and stdout/stderr in ``output.log`` of the attempt's folder;
  reports ``WorkloadStarted`` (``started-<workload>-<attempt>-<node>``);
- **reports** the end: ``WorkloadFinished`` (``finished-<workload>-<attempt>``,
  ``outcome`` and ``exit_code``) while that attempt is still the current run;
  a gang's rank > 0 that exits 0 leaves the report to rank 0, a rank that fails
  reports the gang failed at once;
- **stops** a run on ``WorkloadPreempted``: SIGTERM to its process group and a
  ``preempt-notice`` file, SIGKILL when the decision's ``grace_ms`` ends; a run
  ended by anything else (a cancel, another rank's report) is stopped the same
  way with the workload's own notice;
- **heartbeats** on ``apportion.<cluster>.heartbeat.<node>`` (plain NATS, JSON
  with its advertised address: the other hosts of a gang learn
  ``MASTER_ADDR`` from it), and **probes** its health (``nvidia-smi`` when it
  discovered GPUs, ``--health-command``): failures make it publish
  ``NodeHealthChanged`` ``draining`` and then ``down``; once the probes pass it
  sets its host ``healthy`` again if the host was marked by itself or by the
  scheduler's heartbeat timeout (never over an operator).

A restarted agent re-adopts the supervisors still running (by their pid
files), reports the attempts that ended meanwhile, and never starts an attempt
whose folder exists: no double start, one report per attempt.
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
from pathlib import Path
from typing import Any

from apportion.core.state import SCHEDULER, agent_of
from apportion.schemas.events import (
    HealthState,
    Input,
    NodeHealthChanged,
    NodeRegistered,
    Outcome,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadStarted,
    WorkloadSubmitted,
)
from apportion.schemas.history import InputItem

from . import agent_runs, logs
from .agent_runs import NOTICE, REPORTED, STARTED, Attempt
from .bus import EventLog
from .canonical import Follower
from .runner import is_transient

PUBLISH_TIMEOUT_S = 10.0
"""Every publish and probe is bounded by this many seconds (a failed report is retried)."""

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


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def master_port(workload: str, attempt: int) -> int:
    """A port in 20000-29999 from the workload id and attempt: every rank computes
    the same one, and a retry gets another (a port still in TIME_WAIT is avoided)."""
    digest = hashlib.sha256(f"{workload}/{attempt}".encode()).digest()
    return 20000 + int.from_bytes(digest[:4], "big") % 10000


def gpu_type_of(name: str) -> str:
    """A GPU type from an ``nvidia-smi`` name: ``NVIDIA H100 80GB HBM3`` -> ``h100``."""
    words = [w for w in re.split(r"[\s\-_/]+", name.lower()) if w and w != "nvidia"]
    for w in words:
        if re.fullmatch(r"[a-z]+\d+[a-z]*", w):
            return w
    return "-".join(re.sub(r"[^a-z0-9.]", "", w) for w in words)[:64] or "gpu"


def discover_gpus(timeout_s: float = 20.0) -> tuple[int, str] | None:
    """``(count, type)`` from ``nvidia-smi``, or ``None`` when it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
    return (len(names), gpu_type_of(names[0])) if names else None


def container_runtime(choice: str = "auto") -> str:
    """The container runtime to use for workloads with an ``image`` (``""``: none)."""
    if choice == "none":
        return ""
    if choice != "auto":
        return shutil.which(choice) or ""
    return shutil.which("docker") or shutil.which("podman") or ""


class Agent:
    """The agent of host ``node`` with ``gpus`` GPUs of ``gpu_type`` (see the module doc)."""

    def __init__(
        self,
        log: EventLog,
        *,
        node: str,
        gpus: int,
        gpu_type: str,
        work_dir: Path,
        advertise_addr: str = "127.0.0.1",
        heartbeat_s: float = 2.0,
        health_command: str | None = None,
        health_interval_s: float = 10.0,
        drain_after: int = 3,
        down_after: int = 10,
        probe_nvidia: bool = False,
        register: bool = True,
        stop_on_exit: bool = False,
        runtime: str = "",
        real_gpus: bool = False,
        checkpoint_root: Path | None = None,
        clock: Any = wall_ms,
    ) -> None:
        self.log = log
        self.node = node
        self.actor = agent_of(node)
        self.gpus = gpus
        self.gpu_type = gpu_type
        cluster = log.subjects.cluster
        self.root = (work_dir / cluster / node).resolve()
        self.checkpoint_root = (checkpoint_root or work_dir / cluster / "checkpoints").resolve()
        self.addr = advertise_addr
        self.heartbeat_s = heartbeat_s
        self.health_command = health_command
        self.health_interval_s = health_interval_s
        self.drain_after = drain_after
        self.down_after = down_after
        self.probe_nvidia = probe_nvidia
        self.register = register
        self.stop_on_exit = stop_on_exit
        self.runtime = runtime
        self.real_gpus = real_gpus
        self.clock = clock
        self.logger = logs.get("agent", cluster=cluster, node=node)
        self.follower = Follower(log)
        self.state = self.follower.state
        self.reader = self.follower.reader
        self.ready = asyncio.Event()
        """Set once caught up with the history and registered."""
        self.runs: dict[tuple[str, int], Attempt] = {}
        """Attempts on this host not done with (running, stopping, or to report)."""
        self.done: set[tuple[str, int]] = set()
        self.subs: dict[str, WorkloadSubmitted] = {}
        self.placed: dict[str, tuple[int, bool]] = {}
        """workload -> (attempt of its last placement, whether it included this host)"""
        self.preempted: dict[tuple[str, int], WorkloadPreempted] = {}
        self.seen: dict[str, str] = {}
        """Ids of the start and end reports in the history -> their workload."""
        self.peers: dict[str, str] = {node: advertise_addr}
        """Advertised addresses of the hosts heard from (heartbeats)."""
        self.health_by = ""
        """Who made the last accepted health change of this host."""
        self.probe_state: HealthState = "healthy"
        self._health_sent: tuple[str, str] | None = None
        self._waiting: set[tuple[str, int]] = set()
        self._ticks = 0
        self.started = 0
        self.reported = 0

    # -- the service ---------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tasks = [asyncio.create_task(self._heartbeats(stop), name="heartbeats")]
        try:
            await self._catch_up(stop)
            if stop.is_set():
                return
            if self.register:
                await self._register(stop)
            for run in agent_runs.scan(self.root):
                self.runs[run.key] = run
                self.logger.info(
                    "adopted" if not run.exited else "found ended",
                    workload=run.workload,
                    attempt=run.attempt,
                    exit_code=run.exit_code,
                    lost=run.lost,
                )
            if self.probe_nvidia or self.health_command:
                tasks.append(asyncio.create_task(self._probe(stop), name="probe"))
            self.ready.set()
            self.logger.info(
                "ready", gpus=self.gpus, gpu_type=self.gpu_type, addr=self.addr, dir=str(self.root)
            )
            while not stop.is_set():
                try:
                    await self._poll(0.2)
                    await self._reconcile()
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    self.logger.warning("interrupted; retrying", error=_why(exc))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.stop_on_exit:
                await self._stop_all()
            await self.follower.close()
            self.logger.info("stopped")

    async def _catch_up(self, stop: asyncio.Event) -> None:
        """Fold the history up to the last decision batch there is now (no action before)."""
        target = await asyncio.wait_for(self.log.last_batch_seq(), PUBLISH_TIMEOUT_S)
        while self.reader.batches_done < target and not stop.is_set():
            await self._poll(1.0)

    async def _poll(self, timeout: float) -> None:
        for item, rejected in await self.follower.poll_folded(timeout):
            if isinstance(item, InputItem):
                if item.event is not None and rejected is None:
                    self._note_input(item.event)
            else:
                for d in item.batch.decisions:
                    if isinstance(d, WorkloadPlaced):
                        here = any(s.node == self.node for s in d.placement)
                        self.placed[d.workload] = (d.attempt, here)
                    elif isinstance(d, WorkloadPreempted):
                        attempt, here = self.placed.get(d.workload, (0, False))
                        if here:
                            key = (d.workload, attempt)
                            known = self.preempted.get(key)
                            if known is None or d.grace_ms < known.grace_ms:
                                self.preempted[key] = d

    def _note_input(self, e: Input) -> None:
        if isinstance(e, WorkloadSubmitted):
            self.subs.setdefault(e.workload, e)
        elif isinstance(e, WorkloadFinished | WorkloadStarted):
            self.seen[e.id] = e.workload
        elif isinstance(e, NodeHealthChanged) and e.node == self.node:
            self.health_by = e.actor

    # -- registration and health ---------------------------------------
    async def _publish(self, event: Input, what: str) -> bool:
        try:
            await asyncio.wait_for(self.log.publish_input(event), PUBLISH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - retried on the next round
            self.logger.warning(f"{what} publish failed; retrying", error=_why(exc))
            return False
        return True

    async def _register(self, stop: asyncio.Event) -> None:
        known = self.state.nodes.get(self.node)
        if known is not None and known.gpus == self.gpus and known.gpu_type == self.gpu_type:
            return
        event = NodeRegistered(
            id=f"agent-register-{self.node}-{self.gpus}x{self.gpu_type}-{self.clock()}",
            at_ms=self.clock(),
            node=self.node,
            gpus=self.gpus,
            gpu_type=self.gpu_type,
            actor=self.actor,
        )
        while not await self._publish(event, "register"):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if stop.is_set():
                return
        self.logger.info("registered", gpus=self.gpus, gpu_type=self.gpu_type)

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        """Publish a heartbeat every ``heartbeat_s``; learn the other hosts' addresses."""
        nc = getattr(self.log, "nc", None)
        if nc is None:
            return
        subjects = self.log.subjects

        async def heard(msg: Any) -> None:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                data = json.loads(msg.data)
                node, addr = data.get("node"), data.get("addr")
                if isinstance(node, str) and isinstance(addr, str) and node != self.node:
                    self.peers[node] = addr

        try:
            sub = await nc.subscribe(subjects.heartbeats, cb=heard)
        except Exception as exc:  # noqa: BLE001 - no gang addresses then; heartbeats still go
            self.logger.error("cannot hear the other hosts' heartbeats", error=_why(exc))
            sub = None
        try:
            while not stop.is_set():
                payload = {
                    "node": self.node,
                    "addr": self.addr,
                    "gpus": self.gpus,
                    "gpu_type": self.gpu_type,
                    "at_ms": self.clock(),
                    "health": self.probe_state,
                }
                try:
                    await nc.publish(subjects.heartbeat(self.node), json.dumps(payload).encode())
                except Exception as exc:  # noqa: BLE001 - a reconnect; the next one may pass
                    self.logger.warning("heartbeat failed", error=_why(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.heartbeat_s)
        finally:
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _probe(self, stop: asyncio.Event) -> None:
        """Run the health probes every ``health_interval_s``; count failures in a row."""
        failures = 0
        while not stop.is_set():
            ok, why = await self._probe_once()
            if ok:
                if failures:
                    self.logger.info("health probe passes again", after=failures)
                failures = 0
                self.probe_state = "healthy"
            else:
                failures += 1
                self.logger.warning("health probe failed", failures=failures, why=why)
                if failures >= self.down_after:
                    self.probe_state = "down"
                elif failures >= self.drain_after:
                    self.probe_state = "draining"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.health_interval_s)

    async def _probe_once(self) -> tuple[bool, str]:
        probes: list[tuple[list[str], bool]] = []
        if self.probe_nvidia:
            probes.append((["nvidia-smi", "-L"], False))
        if self.health_command:
            probes.append((["/bin/sh", "-c", self.health_command], True))
        for argv, _shell in probes:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as exc:
                return False, f"{argv[0]}: {exc}"
            try:
                _out, err = await asyncio.wait_for(proc.communicate(), PUBLISH_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                return False, f"{' '.join(argv)}: no answer within {PUBLISH_TIMEOUT_S:g} s"
            if proc.returncode != 0:
                tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
                return False, f"{' '.join(argv)}: exit {proc.returncode} {' '.join(tail)}".strip()
        return True, ""

    async def _health(self) -> None:
        """Bring the host's health in the history to what the probes say, where the agent may."""
        node = self.state.nodes.get(self.node)
        if node is None:
            return
        want = self.probe_state
        if want == "down" and node.health == "healthy":
            want = "draining"  # always by way of draining: its history reads in order
        if node.health == want:
            self._health_sent = None
            return
        if want == "healthy" and self.health_by not in (SCHEDULER, self.actor):
            return  # an operator's drain or down stands until an operator lifts it
        if want == "draining" and node.health == "down":
            return
        if self._health_sent == (want, node.health):
            return  # published; waiting for it to be folded
        event = NodeHealthChanged(
            id=f"agent-health-{self.node}-{want}-{self.clock()}",
            at_ms=self.clock(),
            node=self.node,
            state=want,
            actor=self.actor,
        )
        if await self._publish(event, "health"):
            self._health_sent = (want, node.health)
            self.logger.info("health", state=want, was=node.health)

    # -- runs -----------------------------------------------------------
    def _current(self, run: Attempt) -> bool:
        w = self.state.running.get(run.workload)
        return w is not None and w.attempt == run.attempt

    def _grace_ms(self, workload: str) -> int:
        """The workload's notice: its own ``grace_ms``, else the policy's."""
        sub = self.subs.get(workload)
        if sub is not None and sub.grace_ms is not None:
            return sub.grace_ms
        return int(getattr(self.state.policy, "grace_ms", 0))

    async def _reconcile(self) -> None:
        now = time.monotonic()
        for run in self.runs.values():
            if not run.exited:
                agent_runs.check(run)
        for run in self.runs.values():
            if run.exited:
                continue
            preempted = self.preempted.get(run.key)
            if preempted is not None:
                grace = preempted.grace_ms  # the notice the scheduler gave (and charges)
                # what is left of the notice (all of it, unless the agent restarted during it)
                left = max(0, min(grace, preempted.at_ms + grace - self.clock()))
                self._stop(run, f"preempted ({preempted.reason})", left, now)
            elif not self._current(run):
                self._stop(run, "ended", self._grace_ms(run.workload), now)
            if run.stopping and not run.killed and run.kill_at is not None and now >= run.kill_at:
                run.killed = True
                agent_runs.note(run, "notice over: SIGKILL")
                await asyncio.to_thread(agent_runs.send, run, signal.SIGKILL)
        await self._start_placed()
        for run in list(self.runs.values()):
            if not run.started_reported and not run.lost:
                await self._report_start(run)
            if run.exited and not run.end_reported:
                await self._report_end(run)
            if run.end_reported:
                del self.runs[run.key]
                self.done.add(run.key)
        await self._health()
        self._ticks += 1
        if self._ticks % 500 == 0:
            self._prune()

    def _stop(self, run: Attempt, reason: str, grace_ms: int, now: float) -> None:
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

    def _free_indices(self) -> list[int]:
        used = {i for r in self.runs.values() if not r.exited for i in r.indices}
        return [i for i in range(self.gpus) if i not in used]

    async def _start_placed(self) -> None:
        node = self.state.nodes.get(self.node)
        if node is None:
            return
        for wid, slot_gpus in sorted(node.workloads.items()):
            w = self.state.running.get(wid)
            if w is None:
                continue
            key = (wid, w.attempt)
            if key in self.runs or key in self.done or key in self.preempted:
                continue
            if getattr(w, "stopping", None) is not None:
                continue  # stopping before we ever saw it run (a restart mid-notice)
            free = self._free_indices()
            master = w.placement[0].node
            addr = self.addr if master == self.node else self.peers.get(master)
            if len(free) < slot_gpus or addr is None:
                if key not in self._waiting:
                    self._waiting.add(key)
                    self.logger.info(
                        "waiting to start",
                        workload=wid,
                        attempt=w.attempt,
                        why="GPUs still held by a stopping run"
                        if addr is not None
                        else f"no heartbeat heard from {master} (MASTER_ADDR)",
                    )
                continue
            self._waiting.discard(key)
            await self._start(w, slot_gpus, tuple(free[:slot_gpus]), addr)

    async def _start(self, w: Any, slot_gpus: int, indices: tuple[int, ...], addr: str) -> None:
        key = (w.id, w.attempt)
        path = agent_runs.attempt_dir(self.root, w.id, w.attempt)
        if not agent_runs.claim(path):
            self.done.add(key)
            self.logger.warning(
                "not starting an attempt whose folder exists", workload=w.id, attempt=w.attempt
            )
            return
        nodes = [s.node for s in w.placement]
        rank = nodes.index(self.node)
        sub = self.subs.get(w.id)
        run = Attempt(
            workload=w.id,
            attempt=w.attempt,
            dir=path,
            indices=indices,
            rank=rank,
            ranks=len(nodes),
        )
        self.runs[key] = run
        ckpt = self.checkpoint_root / w.id
        ckpt.mkdir(parents=True, exist_ok=True)
        grace_ms = self._grace_ms(w.id)
        env = {k: v for k, v in os.environ.items() if not k.startswith(_SECRET_PREFIXES)}
        if sub is not None:
            env.update(sub.env)
        in_container = bool(sub is not None and sub.image)
        visible = indices
        if in_container and self.real_gpus:
            visible = tuple(range(len(indices)))  # the runtime maps the devices to 0..n-1
        contract = {
            "APPORTION_WORKLOAD": w.id,
            "APPORTION_ATTEMPT": str(w.attempt),
            "APPORTION_NODE": self.node,
            "APPORTION_OWNER": w.owner,
            "APPORTION_GPUS": str(w.gpus),
            "APPORTION_CHECKPOINT_DIR": str(ckpt),
            "APPORTION_NOTICE_FILE": str(path / NOTICE),
            "APPORTION_ATTEMPT_DIR": str(path),
            "APPORTION_GRACE_S": f"{grace_ms / 1000:g}",
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in visible),
            "WORLD_SIZE": str(len(nodes)),
            "NNODES": str(len(nodes)),
            "RANK": str(rank),
            "NODE_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(slot_gpus),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(master_port(w.id, w.attempt)),
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
            left = None if w.duration_ms is None else max(0, w.duration_ms - w.run_ms) / 1000
            argv = [sys.executable, "-c", SLEEPER, "" if left is None else f"{left:.3f}"]
        if argv is None:
            run.started_reported = True  # nothing started
            agent_runs.note(run, f"image {sub.image if sub else ''!r}: no container runtime here")
            agent_runs.mark(run, "exit", json.dumps({"exit_code": 127}) + "\n")
            return
        try:
            await asyncio.to_thread(agent_runs.launch, run, argv, env, str(ckpt))
        except (OSError, subprocess.SubprocessError) as exc:
            run.started_reported = True  # nothing started
            agent_runs.note(run, f"cannot start the supervisor: {exc}")
            if not (path / "exit").exists():
                agent_runs.mark(run, "exit", json.dumps({"exit_code": 126}) + "\n")
            return
        self.started += 1
        self.logger.info(
            "started",
            workload=w.id,
            attempt=w.attempt,
            rank=rank,
            ranks=len(nodes),
            gpus=",".join(map(str, indices)),
            dir=str(path),
        )

    def _container_argv(self, run: Attempt, sub: WorkloadSubmitted, names: list[str]) -> list[str]:
        """``docker|podman run`` for ``sub.image`` (``[]``: no runtime)."""
        if not self.runtime:
            return []
        name = f"apportion-{run.workload}-{run.attempt}-{self.node}"
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:128]
        run.container, run.runtime = name, self.runtime
        argv = [self.runtime, "run", "--rm", "--init", "--name", name, "--network", "host"]
        for mount in (run.dir, self.checkpoint_root / run.workload):
            argv += ["-v", f"{mount}:{mount}"]
        for k in names:
            argv += ["-e", k]
        if self.real_gpus and run.indices:
            devices = ",".join(map(str, run.indices))
            if Path(self.runtime).name == "podman":
                for i in run.indices:
                    argv += ["--device", f"nvidia.com/gpu={i}"]
            else:
                argv += ["--gpus", f'"device={devices}"']
        return [*argv, sub.image, *sub.command]

    async def _report_start(self, run: Attempt) -> None:
        event_id = f"started-{run.workload}-{run.attempt}-{self.node}"
        if event_id in self.seen or not self._current(run) or run.stopping:
            run.started_reported = True
            return
        event = WorkloadStarted(
            id=event_id,
            at_ms=self.clock(),
            workload=run.workload,
            attempt=run.attempt,
            node=self.node,
            actor=self.actor,
        )
        if await self._publish(event, "start"):
            run.started_reported = True
            agent_runs.mark(run, STARTED)

    async def _report_end(self, run: Attempt) -> None:
        event_id = f"finished-{run.workload}-{run.attempt}"
        code = run.exit_code
        why = ""
        if event_id in self.seen:
            why = "already reported"
        elif not self._current(run):
            why = "no longer the current run"
        elif run.rank > 0 and code == 0 and not run.lost:
            why = "rank 0 reports the gang"  # also during a notice: rank 0 says if it is done
        if why:
            run.end_reported = True
            agent_runs.mark(run, REPORTED, json.dumps({"published": False, "why": why}) + "\n")
            self.logger.info(
                "ended", workload=run.workload, attempt=run.attempt, exit_code=code, report=why
            )
            return
        outcome: Outcome = "succeeded" if code == 0 and not run.lost else "failed"
        event = WorkloadFinished(
            id=event_id,
            at_ms=self.clock(),
            workload=run.workload,
            attempt=run.attempt,
            outcome=outcome,
            actor=self.actor,
            exit_code=max(-255, min(255, code)) if code is not None else None,
        )
        if await self._publish(event, "finish"):
            run.end_reported = True
            self.reported += 1
            agent_runs.mark(run, REPORTED, json.dumps({"published": True}) + "\n")
            self.logger.info(
                "finished",
                workload=run.workload,
                attempt=run.attempt,
                outcome=outcome,
                exit_code=code,
                lost=run.lost,
            )

    async def _stop_all(self) -> None:
        """Stop every run (``stop_on_exit``): SIGTERM, SIGKILL after its notice (5 s at
        most: within the stop's grace), then report what ended."""
        live = [r for r in self.runs.values() if not r.exited]
        if not live:
            return
        now = time.monotonic()
        for run in live:
            self._stop(run, "agent stopping", min(self._grace_ms(run.workload), 5_000), now)
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
        for run in live:
            if run.exited and not run.end_reported:
                await self._report_end(run)

    def _prune(self) -> None:
        """Forget what belongs to ended workloads (bounded memory)."""
        live = self.state.workloads
        self.subs = {w: s for w, s in self.subs.items() if w in live}
        self.placed = {w: p for w, p in self.placed.items() if w in live}
        self.preempted = {k: p for k, p in self.preempted.items() if k[0] in live}
        self.done = {k for k in self.done if k[0] in live}
        keep = {r.workload for r in self.runs.values()} | set(live)
        self.seen = {i: w for i, w in self.seen.items() if w in keep}


def _why(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}".rstrip(": ")
