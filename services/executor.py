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


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class Executor:
    def __init__(
        self, log: EventLog, clock: Callable[[], int] = wall_ms, speedup: float = 1.0
    ) -> None:
        self.log = log
        self.clock = clock
        self.speedup = speedup
        self.follower = Follower(log)
        self.timers: dict[str, tuple[int, asyncio.TimerHandle]] = {}
        self.finished = 0
        self.logger = logs.get("executor", cluster=log.subjects.cluster)
        self._tasks: set[asyncio.Task[None]] = set()

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
            handle.cancel()
            self.logger.debug("stopped", workload=wid)
        loop = asyncio.get_running_loop()
        now = self.clock()
        for wid, w in running.items():
            if wid in self.timers or w.duration_ms is None:
                continue
            remaining = max(0, w.duration_ms - w.run_ms)
            end_ms = w.started_ms + remaining / self.speedup
            delay = max(0.0, (end_ms - now) / 1000)
            handle = loop.call_later(delay, self._finish, wid, w.attempt)
            self.timers[wid] = (w.attempt, handle)

    def _finish(self, workload: str, attempt: int) -> None:
        entry = self.timers.get(workload)
        if entry is None or entry[0] != attempt:
            return
        del self.timers[workload]
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
            await self.log.publish_input(event)
        except Exception as exc:  # noqa: BLE001 - keep emulating; the report can be retried
            self.logger.warning("finish publish failed", workload=workload, error=str(exc))
            return
        self.finished += 1
        self.logger.info("finished", workload=workload, attempt=attempt)
