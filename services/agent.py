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
  ``MASTER_ADDR`` from it), renewing its **lease** with each one the server
  confirmed: once the lease is older than the self-fence bound the runs'
  supervisors stop them on their own (:mod:`~apportion.services.agent_fence`,
  :mod:`apportion.core.rules.fence`), and **probes** its health (``nvidia-smi`` when it
  discovered GPUs, ``--health-command``): failures make it publish
  ``NodeHealthChanged`` ``draining`` and then ``down``; once the probes pass it
  sets its host ``healthy`` again if the host was marked by itself or by the
  scheduler's heartbeat timeout (never over an operator).

A restarted agent re-adopts the supervisors still running (by their pid
files), reports the attempts that ended meanwhile, and never starts an attempt
whose folder exists: no double start, one report per attempt.

The rooms: this module follows the history (a
:class:`~apportion.core.reconcile.Ledger` beside the state), registers, runs
the rounds and publishes the reports; what to start and stop is the one
reconcile (:mod:`apportion.core.reconcile`, through
:func:`~apportion.services.executor_port.reconcile_once`); the processes are
:mod:`~apportion.services.agent_process` (on disk:
:mod:`~apportion.services.agent_runs`); heartbeats and probes are
:mod:`~apportion.services.agent_health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from apportion.core.reconcile import (
    Ledger,
    end_report,
    health_change,
    outcome_of,
    start_report_due,
    started_id,
)
from apportion.core.rules.authority import agent_of
from apportion.schemas.events import (
    Input,
    NodeHealthChanged,
    NodeRegistered,
    WorkloadStarted,
)

from . import agent_runs, attempt_logs, logs
from .agent_fence import Lease
from .agent_health import HostHealth, discover_gpus, error_text, gpu_type_of
from .agent_process import SLEEPER, ProcessRuntime, container_runtime, master_port
from .agent_runs import REPORTED, STARTED, Attempt
from .bus import EventLog
from .canonical import Follower
from .executor_port import finished, reconcile_once
from .runner import is_transient

__all__ = [
    "PUBLISH_TIMEOUT_S",
    "SLEEPER",
    "Agent",
    "container_runtime",
    "discover_gpus",
    "gpu_type_of",
    "master_port",
    "wall_ms",
]

PUBLISH_TIMEOUT_S = 10.0
"""Every publish is bounded by this many seconds (a failed report is retried)."""


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


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
        self.addr = advertise_addr
        self.register = register
        self.stop_on_exit = stop_on_exit
        self.clock = clock
        self.logger = logs.get("agent", cluster=cluster, node=node)
        self.follower = Follower(log)
        self.state = self.follower.state
        self.reader = self.follower.reader
        self.ledger = Ledger([node])
        """What the history says besides the state: submissions, preemptions, reports."""
        self.lease = Lease(self.root, self.logger)
        """Renewed by each heartbeat the server confirmed; the runs fence themselves
        when it runs out (:mod:`~apportion.services.agent_fence`)."""
        self.health = HostHealth(
            on_contact=self.lease.renew,
            max_interval_s=lambda: self.lease.fence_after_ms / 4000,
            node=node,
            addr=advertise_addr,
            gpus=gpus,
            gpu_type=gpu_type,
            logger=self.logger,
            clock=clock,
            heartbeat_s=heartbeat_s,
            health_command=health_command,
            health_interval_s=health_interval_s,
            drain_after=drain_after,
            down_after=down_after,
            probe_nvidia=probe_nvidia,
        )
        self.processes = ProcessRuntime(
            node=node,
            gpus=gpus,
            root=self.root,
            checkpoint_root=(checkpoint_root or work_dir / cluster / "checkpoints").resolve(),
            addr=advertise_addr,
            peers=self.health.peers,
            logger=self.logger,
            clock=clock,
            container=runtime,
            real_gpus=real_gpus,
            lease=self.lease,
        )
        self.ready = asyncio.Event()
        """Set once caught up with the history and registered."""
        self._health_sent: tuple[str, str] | None = None
        self._ticks = 0
        self.reported = 0

    @property
    def runs(self) -> dict[tuple[str, int], Attempt]:
        """Attempts on this host not done with (running, stopping, or to report)."""
        return self.processes.runs

    @property
    def started(self) -> int:
        return self.processes.started

    # -- the service ---------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tasks = [asyncio.create_task(self.health.heartbeats(self.log, stop), name="heartbeats")]
        try:
            await self._catch_up(stop)
            if stop.is_set():
                return
            self.lease.follow(self.state.policy.heartbeat_timeout_ms)
            if self.register:
                await self._register(stop)
            self.processes.adopt()
            if self.health.probing:
                tasks.append(asyncio.create_task(self.health.probes(stop), name="probe"))
            self.ready.set()
            self.logger.info(
                "ready", gpus=self.gpus, gpu_type=self.gpu_type, addr=self.addr, dir=str(self.root)
            )
            while not stop.is_set():
                self.lease.check()
                try:
                    await self._poll(0.2)
                    await self._round()
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    self.logger.warning("interrupted; retrying", error=error_text(exc))
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
        ledger, state = self.ledger, self.state
        for item, rejected in await self.follower.poll_folded(timeout):
            ledger(item, state, rejected)

    async def _round(self) -> None:
        """One round: the reconcile on the processes, the reports, the health."""
        self.lease.follow(self.state.policy.heartbeat_timeout_ms)
        await reconcile_once(self.processes, self.state, self.ledger, self.clock())
        for run in list(self.runs.values()):
            if not run.started_reported and not run.lost:
                await self._report_start(run)
            await self._ship_log(run)
            if run.exited and not run.end_reported:
                await self._report_end(run)
            if run.end_reported:
                self.processes.settle(run)
        await self._health()
        self._ticks += 1
        if self._ticks % 500 == 0:
            self._prune()

    # -- registration and health ---------------------------------------
    async def _publish(self, event: Input, what: str) -> bool:
        try:
            await asyncio.wait_for(self.log.publish_input(event), PUBLISH_TIMEOUT_S)
        except Exception as exc:  # retried on the next round
            self.logger.warning(f"{what} publish failed; retrying", error=error_text(exc))
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

    async def _health(self) -> None:
        """Bring the host's health in the history to what the probes say, where the agent may."""
        node = self.state.nodes.get(self.node)
        want = health_change(
            self.state, self.ledger, self.node, self.actor, self.health.probe_state
        )
        if node is None or want is None:
            return
        if node.health == want:
            self._health_sent = None
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

    # -- reports ----------------------------------------------------------
    async def _report_start(self, run: Attempt) -> None:
        if run.stopping or not start_report_due(self.state, self.ledger, run.key, self.node):
            run.started_reported = True
            return
        event = WorkloadStarted(
            id=started_id(run.key, self.node),
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
        code = run.exit_code
        why = end_report(self.state, self.ledger, run.key, run.rank, code, run.lost)
        if why:
            run.end_reported = True
            agent_runs.mark(run, REPORTED, json.dumps({"published": False, "why": why}) + "\n")
            self.logger.info(
                "ended", workload=run.workload, attempt=run.attempt, exit_code=code, report=why
            )
            return
        event = finished(run.key, self.node, self.clock(), code, run.lost)
        if await self._publish(event, "finish"):
            run.end_reported = True
            self.reported += 1
            agent_runs.mark(run, REPORTED, json.dumps({"published": True}) + "\n")
            self.logger.info(
                "finished",
                workload=run.workload,
                attempt=run.attempt,
                outcome=outcome_of(code, run.lost),
                exit_code=code,
                lost=run.lost,
            )

    async def _ship_log(self, run: Attempt) -> None:
        """Ship the run's new output to the log stream (every
        :data:`~apportion.services.attempt_logs.FLUSH_S` at most; all of it, marked
        final, once the run has ended): :mod:`~apportion.services.attempt_logs`."""
        shipper = run.meta.get("log")
        if shipper is None:
            cluster = self.log.subjects.cluster
            wid, n = run.workload, run.attempt
            shipper = run.meta["log"] = attempt_logs.Shipper(
                path=run.dir / agent_runs.OUTPUT,
                subject=lambda k: attempt_logs.slot_subject(cluster, self.node, wid, n, k),
            )
        await attempt_logs.ship_due(
            shipper,
            self.log.publish_log,
            run.exited,
            self.logger,
            {"workload": run.workload, "attempt": run.attempt},
        )

    async def _stop_all(self) -> None:
        """Stop every run (``stop_on_exit``), then report what ended."""
        live = await self.processes.stop_all(lambda w: self.ledger.grace_ms(self.state, w))
        for run in live:
            if run.exited:
                await self._ship_log(run)
            if run.exited and not run.end_reported:
                await self._report_end(run)

    def _prune(self) -> None:
        """Forget what belongs to ended workloads (bounded memory)."""
        live = self.state.workloads
        self.ledger.prune(self.state, keep=[r.workload for r in self.runs.values()])
        self.processes.prune(live)
