"""The scheduler service: fold -> decide -> publish, one writer at a time.

The loop, as numbered steps:

1. **Lease**: wait until this instance holds the scheduler lease (a KV key with
   a TTL that the holder renews); a standby retries every third of the TTL and
   takes over when the holder stops or its key expires.
2. **Recover**: load the latest snapshot (state bytes, the input sequence and
   the DECISIONS sequence it contains), then fold only the tail in canonical
   order, re-folding the batches already published instead of deciding again.
3. **Fold** the inputs as they arrive (bytes that do not decode are queued as
   rejections).
4. **Decide** once caught up (or after ``max_inputs_per_cycle`` inputs):
   ``core.cycle.decide(state)``, one batch per cycle stamped with its basis (the
   last input folded), even when it holds no decision, so readers know the
   cycle happened.
5. **Publish** the batch fenced with ``Nats-Expected-Last-Sequence``; fold its
   decisions only once the log accepted it. Fenced means another scheduler
   wrote: drop the state and go back to step 1.
6. **Tick**: at the cycle's ``next_wakeup_ms`` with nothing else arriving,
   publish ``ClockTicked`` (id ``tick-<basis>-<wakeup>``, so two instances
   produce one tick).
7. **Snapshot** every ``snapshot_every`` inputs and when stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import msgspec
from apportion.core.cycle import decide as budget_decide
from apportion.core.history import Decider, decide_batch, fold_item
from apportion.core.state import State
from apportion.schemas.events import ClockTicked, DecisionBatch
from apportion.schemas.history import BatchItem, InputItem

from . import logs
from .bus import (
    EventLog,
    Fenced,
    Lease,
    MemoryLease,
    MemorySnapshots,
    SnapshotStore,
    Tail,
)

SNAPSHOT_NAME = "scheduler"


class SchedulerSnapshot(msgspec.Struct, kw_only=True):
    """What the scheduler saves: the state after input ``input_seq`` and DECISIONS
    sequence ``batch_seq`` (whose basis was ``last_basis``)."""

    input_seq: int
    batch_seq: int
    last_basis: int
    digest: str
    state: bytes
    v: int = 1


_snap_encoder = msgspec.msgpack.Encoder()
_snap_decoder = msgspec.msgpack.Decoder(SchedulerSnapshot)


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class Scheduler:
    def __init__(
        self,
        log: EventLog,
        snapshots: SnapshotStore | None = None,
        lease: Lease | None = None,
        *,
        name: str = "scheduler",
        snapshot_every: int = 5000,
        max_inputs_per_cycle: int = 2000,
        clock: Callable[[], int] = wall_ms,
        decide: Decider | None = None,
    ) -> None:
        self.log = log
        self.snapshots = snapshots or MemorySnapshots()
        self.lease = lease or MemoryLease()
        self.name = name
        self.snapshot_every = snapshot_every
        self.max_inputs_per_cycle = max_inputs_per_cycle
        self.clock = clock
        self.decider: Decider = decide or budget_decide
        self.logger = logs.get("scheduler", instance=name, cluster=log.subjects.cluster)
        self.state: State | None = None
        self.batch_seq = 0
        self.last_basis = 0
        self.next_wakeup_ms: int | None = None
        self.leading = asyncio.Event()
        self.cycles = 0
        self.fenced = 0
        self._snapshot_at = 0
        self._ticked_basis = -1
        self._tail: Tail[InputItem] | None = None

    # -- 1 + 2 ----------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; stand by while another instance leads."""
        log = self.logger
        standby_logged = False
        try:
            while not stop.is_set():
                if not await self.lease.acquire():
                    if not standby_logged:
                        log.info("standby", reason="another scheduler holds the lease")
                        standby_logged = True
                    await _wait(stop, self.lease.ttl_s / 3)
                    continue
                standby_logged = False
                log.info("leading")
                try:
                    await self._lead(stop)
                    state = self.state
                    if stop.is_set() and state is not None and state.input_seq == self.last_basis:
                        await self.save_snapshot()
                except Fenced as exc:
                    self.fenced += 1
                    log.warning("fenced", detail=str(exc))
                finally:
                    self.leading.clear()
                    if self._tail is not None:
                        await self._tail.close()
                        self._tail = None
        finally:
            await self.lease.release()
            log.info("stopped")

    async def recover(self, use_snapshot: bool = True) -> None:
        """Snapshot + canonical tail: the state after the last published batch and
        every input after it that is already in the log."""
        state = State()
        self.batch_seq = self.last_basis = 0
        raw = await self.snapshots.load(SNAPSHOT_NAME) if use_snapshot else None
        if raw is not None:
            snap = _snap_decoder.decode(raw)
            state = State.from_bytes(snap.state)
            self.batch_seq, self.last_basis = snap.batch_seq, snap.last_basis
        from_snapshot = state.input_seq
        end = await self.log.last_batch_seq()
        btail = self.log.tail_batches(self.batch_seq + 1)
        itail = self.log.tail_inputs(state.input_seq + 1)
        refolded = 0
        try:
            while self.batch_seq < end:
                for sb in await btail.take(1000, 5.0):
                    basis = sb.batch.basis
                    if basis < state.input_seq:
                        # The snapshot is past a batch it never folded: not canonical. Start over.
                        self.logger.warning(
                            "snapshot ahead of a batch; full fold", basis=basis, batch_seq=sb.seq
                        )
                        await itail.close()
                        await btail.close()
                        return await self.recover(use_snapshot=False)
                    while state.input_seq < basis:
                        for item in await itail.take(basis - state.input_seq, 5.0):
                            fold_item(state, item)
                    fold_item(state, sb)
                    refolded += 1
                    self.batch_seq, self.last_basis = sb.seq, basis
            last_input = await self.log.last_input_seq()
            while state.input_seq < last_input:
                for item in await itail.take(last_input - state.input_seq, 5.0):
                    fold_item(state, item)
        finally:
            await btail.close()
        self.state = state
        self._tail = itail
        self._snapshot_at = state.input_seq
        self.logger.info(
            "recovered",
            snapshot_input_seq=from_snapshot,
            input_seq=state.input_seq,
            batch_seq=self.batch_seq,
            batches_refolded=refolded,
        )

    async def _lead(self, stop: asyncio.Event) -> None:
        await self.recover()
        self.leading.set()
        assert self.state is not None and self._tail is not None
        state, tail = self.state, self._tail
        renew_every = self.lease.ttl_s / 3
        renew_at = time.monotonic() + renew_every
        since_cycle = 0
        while not stop.is_set():
            # 1. keep the lease
            if time.monotonic() >= renew_at:
                if not await self.lease.renew():
                    self.logger.warning("lease lost; standing by")
                    return
                renew_at = time.monotonic() + renew_every
            # 3. fold what has arrived
            timeout = min(renew_every, 0.25)
            if (
                self.next_wakeup_ms is not None
                and since_cycle == 0
                and self._ticked_basis != self.last_basis
            ):
                timeout = max(0.0, min(timeout, (self.next_wakeup_ms - self.clock()) / 1000))
            items = await tail.take(self.max_inputs_per_cycle - since_cycle, timeout)
            for item in items:
                fold_item(state, item)
            since_cycle += len(items)
            # 4. + 5. decide and publish once caught up
            caught_up = tail.caught_up or not items
            if state.input_seq > self.last_basis and (
                caught_up or since_cycle >= self.max_inputs_per_cycle
            ):
                await self.cycle()
                since_cycle = 0
            # 6. tick
            if (
                not items
                and self.next_wakeup_ms is not None
                and self.clock() >= self.next_wakeup_ms
            ):
                await self._tick()

    async def cycle(self) -> DecisionBatch | None:
        state = self.state
        assert state is not None
        if state.input_seq <= self.last_basis:
            return None
        batch, result = decide_batch(state, self.decider)
        seq = await self.log.publish_batch(batch, self.batch_seq)  # raises Fenced
        fold_item(state, BatchItem(seq=seq, batch=batch))
        self.batch_seq, self.last_basis = seq, batch.basis
        wake = result.next_wakeup_ms
        # A wake-up at or before the state's time cannot move it: ignore it rather than tick forever.
        self.next_wakeup_ms = wake if wake is not None and wake > state.now_ms else None
        self.cycles += 1
        if result.decisions:
            self.logger.debug(
                "decided", basis=batch.basis, batch_seq=seq, decisions=len(result.decisions)
            )
        # 7. snapshot
        if state.input_seq - self._snapshot_at >= self.snapshot_every:
            await self.save_snapshot()
        return batch

    async def _tick(self) -> None:
        if self._ticked_basis == self.last_basis:
            return
        wake = self.next_wakeup_ms
        self._ticked_basis = self.last_basis
        event = ClockTicked(id=f"tick-{self.last_basis}-{wake}", at_ms=max(self.clock(), wake or 0))
        await self.log.publish_input(event)
        self.logger.debug("tick", wakeup_ms=wake, basis=self.last_basis)

    async def save_snapshot(self) -> None:
        state = self.state
        assert state is not None
        snap = SchedulerSnapshot(
            input_seq=state.input_seq,
            batch_seq=self.batch_seq,
            last_basis=self.last_basis,
            digest=state.digest(),
            state=state.to_bytes(),
        )
        await self.snapshots.save(SNAPSHOT_NAME, _snap_encoder.encode(snap))
        self._snapshot_at = state.input_seq
        self.logger.info(
            "snapshot", input_seq=state.input_seq, batch_seq=self.batch_seq, bytes=len(snap.state)
        )


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def load_snapshot(raw: bytes) -> tuple[SchedulerSnapshot, State]:
    snap = _snap_decoder.decode(raw)
    return snap, State.from_bytes(snap.state)
