"""Executor emulator (demos and tests): runs placements for the duration given at submit.

It follows the canonical history (so it knows each workload's ``duration_ms``
and the progress kept across preemptions), and for every running workload
keeps a timer that fires ``duration_ms - progress`` after its start; the timer
publishes ``WorkloadFinished`` (id ``finished-<workload>-<attempt>``, so two
emulators or a retry report once). A preemption, cancel or node loss cancels
the timer (obeying the preemption); a workload without ``duration_ms`` runs
until it is preempted or cancelled.

Start times are the log's ingestion times (epoch ms), so a restarted emulator
re-arms every running workload's timer where it was.

Its Prometheus metrics (:class:`~apportion.services.metrics.ExecutorMetrics`,
rendered by :meth:`Executor.metrics_text`; ``apportion up`` appends them to the
gateway's ``/metrics``): runs started, runs finished by outcome, runs and
timers now, how late each timer fired, and how far its follower trails INPUTS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from apportion.core.state import agent_of
from apportion.schemas.events import WorkloadFinished
from apportion.schemas.history import BatchItem

from . import logs
from .bus import EventLog
from .canonical import Follower
from .metrics import ExecutorMetrics, stored_inputs


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


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
        self.timers: dict[str, tuple[int, asyncio.TimerHandle]] = {}
        self.due_ms: dict[str, float] = {}
        """When each armed timer should fire (epoch ms): its lag is measured against it."""
        self.runs: dict[str, int] = {}
        """Every run it emulates now: workload -> attempt (with or without a timer)."""
        self.finished = 0
        self.metrics = metrics if metrics is not None else ExecutorMetrics()
        """Its metrics (``apportion up`` passes one that outlives the emulator's restarts)."""
        self.logger = logs.get("executor", cluster=log.subjects.cluster)
        self._tasks: set[asyncio.Task[None]] = set()
        self._reporting: set[tuple[str, int]] = set()
        """End reports being published (no second timer meanwhile)."""
        self._reported: set[tuple[str, int]] = set()
        """End reports stored but not yet folded (counted once, as ``succeeded``)."""

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                items = await self.follower.poll(0.2)
                if any(isinstance(i, BatchItem) for i in items):
                    self.reconcile()
        finally:
            for _attempt, handle in self.timers.values():
                handle.cancel()
            self.timers.clear()
            self.due_ms.clear()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.follower.close()

    def reconcile(self) -> None:
        """One timer per running workload with a duration, for its current attempt."""
        running = self.follower.state.running
        for wid in [
            w for w in self.timers if w not in running or running[w].attempt != self.timers[w][0]
        ]:
            _attempt, handle = self.timers.pop(wid)
            self.due_ms.pop(wid, None)
            handle.cancel()
            self.logger.debug("stopped", workload=wid)
        for wid, attempt in [
            (w, a) for w, a in self.runs.items() if w not in running or running[w].attempt != a
        ]:
            del self.runs[wid]
            self._ended(wid, attempt)
        loop = asyncio.get_running_loop()
        now = self.clock()
        for wid, w in running.items():
            if self.runs.get(wid) != w.attempt:
                self.runs[wid] = w.attempt
                self.metrics.started.inc()
            if wid in self.timers or w.duration_ms is None or (wid, w.attempt) in self._reporting:
                continue
            remaining = max(0, w.duration_ms - w.run_ms)
            end_ms = w.started_ms + remaining / self.speedup
            delay = max(0.0, (end_ms - now) / 1000)
            handle = loop.call_later(delay, self._finish, wid, w.attempt)
            self.timers[wid] = (w.attempt, handle)
            self.due_ms[wid] = end_ms

    def _ended(self, workload: str, attempt: int) -> None:
        """Count the end of a run it emulated, by how it ended (its own report counted already)."""
        if (workload, attempt) in self._reported:
            self._reported.discard((workload, attempt))
            return
        state = self.follower.state
        if workload in state.workloads:
            outcome = "preempted"  # requeued (pending, or running again as a later attempt)
        else:
            status = state.ended.get(workload)
            outcome = status if status in ("preempted", "cancelled") else "ended"
        self.metrics.ended(outcome)

    async def metrics_text(self) -> bytes:
        """The metrics in Prometheus' text format; the lag asks NATS for INPUTS' last sequence."""
        self.metrics.update(
            running=len(self.runs),
            timers=len(self.timers),
            folded=self.follower.state.input_seq,
            stored=await stored_inputs(self.log),
        )
        return self.metrics.render()

    def _finish(self, workload: str, attempt: int) -> None:
        entry = self.timers.get(workload)
        if entry is None or entry[0] != attempt:
            return
        del self.timers[workload]
        due = self.due_ms.pop(workload, None)
        if due is not None:
            self.metrics.timer_lag.observe(max(0.0, (self.clock() - due) / 1000))
        self._reporting.add((workload, attempt))
        task = asyncio.ensure_future(self._publish(workload, attempt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, workload: str, attempt: int) -> None:
        # it reports as the agent of the (first) host the run is on
        w = self.follower.state.running.get(workload)
        event = WorkloadFinished(
            id=f"finished-{workload}-{attempt}",
            at_ms=self.clock(),
            workload=workload,
            attempt=attempt,
            actor=agent_of(w.placement[0].node) if w is not None and w.placement else "",
        )
        try:
            ack = await self.log.publish_input(event)
        except Exception as exc:  # noqa: BLE001 - keep emulating; the report can be retried
            self.logger.warning("finish publish failed", workload=workload, error=str(exc))
            self.metrics.ended("report_failed")
            return
        finally:
            self._reporting.discard((workload, attempt))
        if not ack.duplicate:
            self._reported.add((workload, attempt))
            self.metrics.ended("succeeded")
        self.finished += 1
        self.logger.info("finished", workload=workload, attempt=attempt)
