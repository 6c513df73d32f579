"""Executor emulator (demos and tests): runs placements for the duration given at submit.

It follows the canonical history (so it knows each workload's ``duration_ms``
and the progress kept across preemptions) and, after each decision batch, runs
the one reconcile (:mod:`apportion.core.reconcile`, through
:func:`~apportion.services.executor_port.reconcile_once`) on a simulated
runtime, :class:`SimulatedRuntime`: every run once, as its first host. A run
started keeps a timer that fires ``duration_ms - progress`` after its start;
the timer publishes ``WorkloadFinished`` (id ``finished-<workload>-<attempt>``,
so two emulators or a retry report once). A run that is no longer current
(preempted, cancelled, its node lost) loses its timer; a run under notice keeps
it (the emulated job works through its notice); a workload without
``duration_ms`` runs until it is preempted or cancelled.

Start times are the log's ingestion times (epoch ms), so a restarted emulator
re-arms every running workload's timer where it was (a run under notice
included: its runs are a function of the history).

Its Prometheus metrics (:class:`~apportion.services.metrics.ExecutorMetrics`,
rendered by :meth:`Executor.metrics_text`; ``apportion up`` appends them to the
gateway's ``/metrics``): runs started, runs finished by outcome, runs and
timers now, how late each timer fired, and how far its follower trails INPUTS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

from apportion.core.reconcile import DesiredRun, Ledger, RunKey, Stop, end_report
from apportion.core.state import State
from apportion.schemas.history import BatchItem

from . import logs
from .bus import EventLog
from .canonical import Follower
from .executor_port import finished, reconcile_once
from .metrics import ExecutorMetrics, stored_inputs


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class _Run:
    """A run the emulator times."""

    run: DesiredRun
    timer: asyncio.TimerHandle | None = None
    due_ms: float | None = None
    """When its timer should fire (epoch ms): its lag is measured against it."""
    ended: bool = False
    """Its timer fired: the end is to be reported (or was)."""
    reported: bool = False


class SimulatedRuntime:
    """The executor port on timers: every run once, as its first host (see the module doc)."""

    host: str | None = None
    adopts_under_notice = True

    def __init__(
        self,
        state: State,
        *,
        clock: Callable[[], int],
        speedup: float,
        metrics: ExecutorMetrics,
        logger: Any,
        on_end: Callable[[RunKey], None],
    ) -> None:
        self.state = state
        self.clock = clock
        self.speedup = speedup
        self.metrics = metrics
        self.logger = logger
        self.on_end = on_end
        self.runs: dict[RunKey, _Run] = {}
        self.reported: set[RunKey] = set()
        """End reports stored but not yet folded (counted once, as ``succeeded``)."""

    # -- the port --------------------------------------------------------
    def held(self) -> Iterable[tuple[RunKey, bool]]:
        return [(key, r.ended) for key, r in self.runs.items()]

    def done(self) -> Container[RunKey]:
        return ()  # a run it let go of is never current again

    def probe(self) -> None:
        """Nothing to learn: its runs end by their timers."""

    async def launch(self, run: DesiredRun) -> bool:
        entry = self.runs[run.key] = _Run(run)
        self.metrics.started.inc()
        remaining = run.remaining_ms
        if remaining is not None:
            end_ms = run.started_ms + remaining / self.speedup
            delay = max(0.0, (end_ms - self.clock()) / 1000)
            loop = asyncio.get_running_loop()
            entry.timer = loop.call_later(delay, self._fire, run.key)
            entry.due_ms = end_ms
        return True

    async def stop(self, stop: Stop) -> None:
        """A run no longer current loses its timer; a notice changes nothing (the
        emulated job works on until its end or until the history ends the run)."""
        entry = self.runs.get(stop.key)
        if stop.ended and entry is not None and entry.timer is not None:
            entry.timer.cancel()
            entry.timer = entry.due_ms = None
            self.logger.debug("stopped", workload=stop.key[0])

    def gone(self, key: RunKey) -> None:
        """Count the end of a run it emulated, by how it ended (its own report counted already)."""
        entry = self.runs.pop(key, None)
        if entry is not None and entry.timer is not None:
            entry.timer.cancel()
        if key in self.reported:
            self.reported.discard(key)
            return
        workload = key[0]
        state = self.state
        if workload in state.workloads:
            outcome = "preempted"  # requeued (pending, or running again as a later attempt)
        else:
            status = state.ended.get(workload)
            outcome = status if status in ("preempted", "cancelled") else "ended"
        self.metrics.ended(outcome)

    # -- timers ----------------------------------------------------------
    @property
    def timers(self) -> int:
        return sum(1 for r in self.runs.values() if r.timer is not None)

    def cancel_all(self) -> None:
        for r in self.runs.values():
            if r.timer is not None:
                r.timer.cancel()
                r.timer = r.due_ms = None

    def _fire(self, key: RunKey) -> None:
        entry = self.runs.get(key)
        if entry is None or entry.timer is None:
            return
        due = entry.due_ms
        entry.timer = entry.due_ms = None
        if due is not None:
            self.metrics.timer_lag.observe(max(0.0, (self.clock() - due) / 1000))
        entry.ended = True
        self.on_end(key)


class Executor:
    def __init__(
        self,
        log: EventLog,
        clock: Callable[[], int] = wall_ms,
        speedup: float = 1.0,
        *,
        metrics: ExecutorMetrics | None = None,
    ) -> None:
        self.log = log
        self.clock = clock
        self.speedup = speedup
        self.follower = Follower(log)
        self.ledger = Ledger()
        self.finished = 0
        self.metrics = metrics if metrics is not None else ExecutorMetrics()
        """Its metrics (``apportion up`` passes one that outlives the emulator's restarts)."""
        self.logger = logs.get("executor", cluster=log.subjects.cluster)
        self.runtime = SimulatedRuntime(
            self.follower.state,
            clock=clock,
            speedup=speedup,
            metrics=self.metrics,
            logger=self.logger,
            on_end=self._report,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._reporting: set[RunKey] = set()
        """End reports being published."""
        self._rounds = 0

    @property
    def runs(self) -> dict[str, int]:
        """Every run it emulates now: workload -> attempt (with or without a timer)."""
        return {w: a for (w, a) in self.runtime.runs}

    async def run(self, stop: asyncio.Event) -> None:
        ledger, state = self.ledger, self.follower.state
        try:
            while not stop.is_set():
                folded = await self.follower.poll_folded(0.2)
                for item, rejected in folded:
                    ledger(item, state, rejected)
                if any(isinstance(i, BatchItem) for i, _ in folded):
                    await self.reconcile()
        finally:
            self.runtime.cancel_all()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.follower.close()

    async def reconcile(self) -> None:
        """One round of the reconcile: a timer per current run with a duration."""
        state = self.follower.state
        await reconcile_once(self.runtime, state, self.ledger, self.clock())
        for key, entry in self.runtime.runs.items():
            if entry.ended and not entry.reported and key not in self._reporting:
                self._report(key)  # a report that failed: again
        self._rounds += 1
        if self._rounds % 500 == 0:
            self.ledger.prune(state, keep=[w for w, _ in self.runtime.runs])

    async def metrics_text(self) -> bytes:
        """The metrics in Prometheus' text format; the lag asks NATS for INPUTS' last sequence."""
        self.metrics.update(
            running=len(self.runtime.runs),
            timers=self.runtime.timers,
            folded=self.follower.state.input_seq,
            stored=await stored_inputs(self.log),
        )
        return self.metrics.render()

    def _report(self, key: RunKey) -> None:
        self._reporting.add(key)
        task = asyncio.ensure_future(self._publish(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, key: RunKey) -> None:
        workload, attempt = key
        entry = self.runtime.runs.get(key)
        why = end_report(self.follower.state, self.ledger, key, 0, 0, False)
        if entry is None or why:
            self._reporting.discard(key)
            if entry is not None:
                entry.reported = True
            self.logger.debug("not reported", workload=workload, attempt=attempt, why=why)
            return
        # it reports as the agent of the (first) host the run is on
        event = finished(key, entry.run.node, self.clock(), with_exit=False)
        try:
            ack = await self.log.publish_input(event)
        except Exception as exc:  # keep emulating; the report can be retried
            self.logger.warning("finish publish failed", workload=workload, error=str(exc))
            self.metrics.ended("report_failed")
            return
        finally:
            self._reporting.discard(key)
        entry.reported = True
        if not ack.duplicate:
            self.runtime.reported.add(key)
            self.metrics.ended("succeeded")
        self.finished += 1
        self.logger.info("finished", workload=workload, attempt=attempt)
