"""The scheduler service: fold -> decide -> publish, one writer at a time.

The loop, as numbered steps:

1. **Follow**: before contending for the lease, bring a state up to the log's
   last decision batch: the latest snapshot (its digest checked; a snapshot
   that is truncated, does not decode or does not match its digest is logged
   and the whole log is folded instead), then the log after it in canonical
   order. A standby repeats this every third of the lease's TTL, so it always
   trails the leader by about one cycle: taking over folds a short tail,
   whatever the size of the state.
2. **Lease**: a KV key with a TTL that the holder renews (a background task,
   every third of the TTL, also while it catches up); a standby takes over
   when the holder stops or its key expires.
3. **Catch up**: fold the rest of the log, the inputs after the last batch
   included. If the last cycle in the log was left in parts (its leader
   stopped between two), decide it again and publish the parts still missing.
4. **Fold** the inputs as they arrive (bytes that do not decode are queued as
   rejections).
5. **Decide** once caught up (or after ``max_inputs_per_cycle`` inputs):
   ``core.cycle.decide(state)``, one batch per cycle stamped with its basis (the
   last input folded), even when it holds no decision, so readers know the
   cycle happened. A batch over the log's ``max_batch_bytes`` is published as
   several parts (:func:`apportion.core.history.split_batch`).
6. **Publish** the batch fenced with ``Nats-Expected-Last-Sequence``; fold its
   decisions only once the log accepted it. Fenced means another scheduler
   wrote: drop the state and go back to step 1. A batch the server refuses for
   its size (:class:`~apportion.services.bus.BatchTooLarge`: one decision
   larger than a message) is logged and stops the scheduler; it is never retried.
7. **Tick**: at the cycle's ``next_wakeup_ms`` with nothing else arriving,
   publish ``ClockTicked`` (id ``tick-<basis>-<wakeup>``, so two instances
   produce one tick).
8. **Snapshot** every ``snapshot_every`` inputs, at most once every
   ``snapshot_interval_s`` seconds, and when stopping.
9. **Heartbeats**: every instance listens to the host agents' heartbeats
   (``apportion.<c>.heartbeat.<node>``, plain NATS) and keeps the last time it
   heard each node; the leader marks a node ``down`` (``NodeHealthChanged``,
   actor ``scheduler``) once the heartbeat timeout passes without one, once per
   silence (:mod:`apportion.core.rules.fence`: the policy's
   ``heartbeat_timeout_ms``, or 300 s for the hosts heard from when it is 0).
   With a policy's timeout every host not down counts as heard when an
   instance first checks, so a host already silent when the scheduler started
   is marked down as well. The timeout exceeds the agents' self-fence bound
   plus their notice plus a margin: a host marked down has stopped its runs.

Readers skip what is not history: a ``DECISIONS`` message that does not decode
(the bus skips it) or a batch out of canonical order is logged and passed over.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable

import msgspec
from apportion.core.cycle import decide as budget_decide
from apportion.core.history import Decider, decide_batch, fold_item, lost_range, split_batch
from apportion.core.rules.fence import effective_timeout_ms, watches_every_host
from apportion.core.state import SCHEDULER, State
from apportion.schemas.events import ClockTicked, DecisionBatch, InputsLost, NodeHealthChanged
from apportion.schemas.history import BatchItem, InputItem

from . import logs
from .bus import (
    BatchTooLarge,
    EventLog,
    Fenced,
    HistoryGap,
    Lease,
    MemoryLease,
    MemorySnapshots,
    SnapshotStore,
    SnapshotUnreadable,
    Tail,
)
from .canonical import SkippingFold, judged_by
from .metrics import SchedulerMetrics, stored_inputs

SNAPSHOT_NAME = "scheduler"
CHUNK = 2000
"""Inputs folded between two chances for the event loop to run something else."""


class SchedulerSnapshot(msgspec.Struct, kw_only=True):
    """What the scheduler saves: the state after input ``input_seq`` and DECISIONS
    sequence ``batch_seq`` (whose basis was ``last_basis``), and the state's
    :meth:`~apportion.core.state.State.digest`, checked on load."""

    input_seq: int
    batch_seq: int
    last_basis: int
    digest: str
    state: bytes
    v: int = 1


class SnapshotInvalid(ValueError):
    """Snapshot bytes that cannot be trusted: truncated, undecodable, or not matching their digest."""


_snap_encoder = msgspec.msgpack.Encoder()
_snap_decoder = msgspec.msgpack.Decoder(SchedulerSnapshot)


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def load_snapshot(raw: bytes) -> tuple[SchedulerSnapshot, State]:
    """The snapshot in ``raw`` and its state, verified: it decodes, the state's
    digest is the one stored, and it was taken at a batch boundary; else
    :class:`SnapshotInvalid` says why."""
    try:
        snap = _snap_decoder.decode(raw)
        state = State.from_bytes(snap.state)
    except Exception as exc:  # any failure to rebuild the state means: do not use it
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise SnapshotInvalid(f"does not decode ({type(exc).__name__}: {first})") from None
    digest = state.digest()
    if digest != snap.digest:
        raise SnapshotInvalid(
            f"its state's digest {digest[:16]} is not the stored {snap.digest[:16]}"
        )
    if not (state.input_seq == snap.input_seq == snap.last_basis):
        raise SnapshotInvalid(
            f"it is not at a batch boundary (input {state.input_seq}, stored input "
            f"{snap.input_seq}, basis {snap.last_basis})"
        )
    return snap, state


class _Ahead(Exception):
    """The state folded an input past a batch's basis: it is not a prefix of the history."""


class _LeaseLost(Exception):
    """The lease could not be renewed: another scheduler may lead now."""


class Scheduler:
    def __init__(
        self,
        log: EventLog,
        snapshots: SnapshotStore | None = None,
        lease: Lease | None = None,
        *,
        name: str = "scheduler",
        snapshot_every: int = 5000,
        snapshot_interval_s: float = 10.0,
        max_inputs_per_cycle: int = 2000,
        clock: Callable[[], int] = wall_ms,
        decide: Decider | None = None,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.log = log
        self.snapshots = snapshots or MemorySnapshots()
        self.lease = lease or MemoryLease()
        self.name = name
        self.snapshot_every = snapshot_every
        self.snapshot_interval_s = snapshot_interval_s
        self.max_inputs_per_cycle = max_inputs_per_cycle
        self.clock = clock
        self.decider: Decider = decide or budget_decide
        self.metrics = metrics or SchedulerMetrics()
        """Prometheus metrics (docs/services.md, "Metrics"); :meth:`metrics_text` renders them."""
        self.logger = logs.get("scheduler", instance=name, cluster=log.subjects.cluster)
        self._fold = SkippingFold(self.logger, self._passed_over)
        self.state: State | None = None
        self.batch_seq = 0
        """The last DECISIONS sequence read (folded, held as an open part, or skipped)."""
        self.last_basis = 0
        """The basis of the last cycle folded whole."""
        self.next_wakeup_ms: int | None = None
        self.leading = asyncio.Event()
        self.cycles = 0
        self.fenced = 0
        self.leases_lost = 0
        self.snapshots_rejected = 0
        """Snapshots found unusable (and replaced by a full fold)."""
        self.recovered_from = ""
        """Where the state came from: ``snapshot``, ``log`` (a full fold) or ``kept`` (followed)."""
        self._open: list[BatchItem] = []
        """Parts of a cycle whose last part is not in the log yet (not folded)."""
        self._snapshot_at = 0
        self._snapshot_time = -float("inf")
        self._ticked_basis = -1
        self._inputs_known = 0
        self._tail: Tail[InputItem] | None = None
        self._btail: Tail[BatchItem] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self.gap: tuple[int, int] | None = None
        """Inputs missing where the scheduler stopped (no loss accepted), or ``None``."""
        self._lost: list[tuple[int, int, int]] = []
        self._may_accept = judged_by(lambda: self.state)
        """Which acceptance of lost inputs may bridge a gap: an operator's, in the state
        at the gap (the fold refuses any other: ``LossNotAccepted``)."""
        """Accepted losses folded, ``(first, through, until)``: inputs ``first`` ..
        ``through`` lost, and batches based on ``first`` .. ``until`` (up to the
        record of the loss) not part of the history."""
        self._trust_snapshot = True
        """``False`` after a gap: a snapshot may hold inputs that readers no longer have."""
        self.heard: dict[str, tuple[float, int]] = {}
        """node -> (monotonic time of its last heartbeat, its ``at_ms``)"""
        self._marked_down: dict[str, int] = {}
        """node -> the ``at_ms`` of the last heartbeat before it was marked down"""
        self._reconnects = 0
        self._heartbeat_sub: object | None = None
        """The connection's reconnect count at the last heartbeat check."""

    # -- 9. heartbeats ------------------------------------------------------
    async def _listen_heartbeats(self) -> object | None:
        """Subscribe to the agents' heartbeats (a log without NATS has none)."""
        nc = getattr(self.log, "nc", None)
        if nc is None:
            return None

        async def heard(msg: object) -> None:
            try:
                data = msgspec.json.decode(getattr(msg, "data", b""))
                node, at_ms = data["node"], int(data.get("at_ms", 0))
            except (msgspec.DecodeError, KeyError, TypeError, ValueError):
                return
            if isinstance(node, str):
                self.heard[node] = (time.monotonic(), at_ms)

        self._heartbeat_sub = await nc.subscribe(self.log.subjects.heartbeats, cb=heard)
        return self._heartbeat_sub

    async def _check_heartbeats(self) -> None:
        """Leader: mark ``down`` each node silent for longer than the policy allows.

        The timeout and which hosts it watches come from
        :mod:`apportion.core.rules.fence`: a policy's ``heartbeat_timeout_ms``
        watches every host not down; the default (0) watches the hosts heard
        from, with 300 s. A silence is never this instance's own: while its
        connection is down nothing is marked, after a reconnect every host
        counts as heard again, and a host that looks silent is marked only
        after a round trip to the server (and a chance for the heartbeats
        already received to be handled) still finds it silent. So a host is
        marked ``down`` only once its agent has surely fenced its runs."""
        state = self.state
        if state is None:
            return
        policy_ms = getattr(state.policy, "heartbeat_timeout_ms", 0)
        timeout_ms = effective_timeout_ms(policy_ms)
        nc = getattr(self.log, "nc", None)
        now = time.monotonic()
        if nc is not None:
            if not getattr(nc, "is_connected", True):
                return
            reconnects = getattr(nc, "stats", {}).get("reconnects", 0)
            if reconnects != self._reconnects:
                self._reconnects = reconnects
                for node, (_seen, at_ms) in list(self.heard.items()):
                    self.heard[node] = (now, at_ms)  # heard while this instance could not hear
        if watches_every_host(policy_ms):
            # every host not down is watched from the first check on, heard or not: a
            # host silent since before this instance started is marked down too
            for node, registered in state.nodes.items():
                if node not in self.heard and registered.health != "down":
                    self.heard[node] = (now, self.clock())
        silent = [
            node
            for node, (seen, at_ms) in self.heard.items()
            if (now - seen) * 1000 >= timeout_ms and self._marked_down.get(node) != at_ms
        ]
        if not silent:
            return
        if nc is not None:
            # the heartbeats the server sent before this round trip are handled first
            try:
                await nc.flush(timeout=2.0)
            except Exception:
                return  # no round trip: this instance may be the one cut off
            for _ in range(40):
                await asyncio.sleep(0.05)
                if not getattr(self._heartbeat_sub, "pending_msgs", 0):
                    break
            now = time.monotonic()
        for node in silent:
            seen, at_ms = self.heard[node]
            if (now - seen) * 1000 < timeout_ms or self._marked_down.get(node) == at_ms:
                continue
            known = state.nodes.get(node)
            if known is None or known.health == "down":
                continue
            await self.log.publish_input(
                NodeHealthChanged(
                    id=f"heartbeat-down-{node}-{at_ms}",
                    at_ms=self.clock(),
                    node=node,
                    state="down",
                    actor=SCHEDULER,
                )
            )
            self._marked_down[node] = at_ms
            self.logger.warning(
                "node silent; marked down",
                node=node,
                silent_ms=int((now - seen) * 1000),
                timeout_ms=timeout_ms,
            )

    # -- 1 + 2 ----------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; follow the log while another instance leads."""
        log = self.logger
        standby_logged = False
        heartbeats = await self._listen_heartbeats()
        try:
            while not stop.is_set():
                try:
                    await self.follow()
                except HistoryGap as exc:
                    await self._at_gap(exc, stop)
                    continue
                if not await self.lease.acquire():
                    if not standby_logged:
                        log.info("standby", reason="another scheduler holds the lease")
                        standby_logged = True
                    await _wait(stop, self.lease.ttl_s / 3)
                    continue
                standby_logged = False
                log.info("leading")
                gap: HistoryGap | None = None
                try:
                    await self._lead(stop)
                    if stop.is_set() and self._at_cycle_end():
                        await self.save_snapshot()
                except Fenced as exc:
                    self.fenced += 1
                    self.metrics.fenced.inc()
                    log.warning("fenced", detail=str(exc))
                except HistoryGap as exc:
                    gap = exc
                finally:
                    self.leading.clear()
                    await self._stop_renewing()
                    if not self._at_cycle_end():
                        # inputs folded past the last batch: not a state a follower may keep
                        await self._forget()
                if gap is not None:
                    await self.lease.release()  # another instance may find the loss accepted first
                    await self._at_gap(gap, stop)
        finally:
            if heartbeats is not None:
                with contextlib.suppress(Exception):
                    await heartbeats.unsubscribe()  # type: ignore[attr-defined]
            await self.lease.release()
            await self._forget()
            log.info("stopped")

    async def _at_gap(self, gap: HistoryGap, stop: asyncio.Event) -> None:
        """Inputs are missing and no loss was accepted: report it, let go of the
        state, and wait (the service stays up) until the loss is accepted; then the
        next catch-up folds the log again from the start (a snapshot may hold
        inputs that the stream lost)."""
        from_snapshot = self.recovered_from == "snapshot" and self._trust_snapshot
        await self._forget()
        self._trust_snapshot = False
        if gap.held:
            self.logger.warning(
                "the state holds inputs recorded as lost; folding the whole log again",
                first=gap.first,
                through=gap.through,
            )
            return
        if from_snapshot:
            # the gap may start inside what the snapshot folded: fold the log from input 1
            self.logger.warning(
                "inputs missing after the snapshot; folding the whole log",
                first=gap.first,
                through=gap.through,
            )
            return
        if self.gap != (gap.first, gap.through):
            self.gap = (gap.first, gap.through)
            self.metrics.inputs.set_gap(self.gap)
            self.logger.error(
                "history not whole: inputs missing from INPUTS; not deciding until the "
                "loss is accepted (apportion history accept-loss)",
                first=gap.first,
                through=gap.through,
                missing=gap.through - gap.first + 1,
            )
        accepted = getattr(self.log, "accepted_loss", None)
        waited = 0.0
        while not stop.is_set() and waited < 30.0:
            if accepted is not None:
                try:
                    if await accepted(gap.first, gap.through + 1, self._may_accept) is not None:
                        return
                except Exception as exc:  # NATS away: ask again
                    self.logger.warning("could not look for an accepted loss", error=str(exc))
            await _wait(stop, 1.0)
            waited += 1.0

    def _folded(self, item: InputItem, tail: Tail[InputItem]) -> None:
        """Note an accepted loss just folded: batches based on an input from its
        first lost one up to its record were made before the loss was known (on
        inputs that are gone) and are not history.

        The record of a loss folded at its own position for inputs this state did
        not pass over at their gap means the state holds inputs that the stream
        lost (it was folded, or its snapshot taken, before the loss): raise
        :class:`HistoryGap` so that the state is dropped and the log folded again
        from input 1."""
        lost = lost_range(item)
        if lost is None:
            e = item.event
            state = self.state
            if (
                isinstance(e, InputsLost)
                and state is not None
                and not any(
                    (first, through) == (e.first, e.through) for first, through, _ in self._lost
                )
                and self._may_accept(item)  # another's record bridges nothing: refused
                and e.first <= e.through < state.input_seq
            ):
                raise HistoryGap(e.first, e.through, held=True)
            return
        stored_at = getattr(tail, "bridged", {}).get(item.seq, lost[1] + 1)
        entry = (lost[0], lost[1], stored_at - 1)
        if entry not in self._lost:
            self._lost.append(entry)
        if self.gap is not None:
            self.gap = None
            self.metrics.inputs.set_gap(None)

    def _in_lost(self, basis: int) -> tuple[int, int] | None:
        """``(first, until)`` of the accepted loss whose batches leave out ``basis``."""
        for first, _through, until in self._lost:
            if first <= basis <= until:
                return first, until
        return None

    @staticmethod
    def _gap_of(tail: Tail[InputItem]) -> None:
        """Raise :class:`HistoryGap` when ``tail`` stopped at missing inputs."""
        gap = tail.gap
        if gap is not None:
            raise HistoryGap(*gap)

    async def follow(self) -> None:
        """Bring the state up to the log's last batch (loading it first if there is none)."""
        await self._catch_up(final=False)

    async def recover(self) -> None:
        """The state a new leader starts from: the snapshot and the whole log after
        it, the inputs after the last batch included."""
        await self._forget()
        await self._catch_up(final=True)

    def _at_cycle_end(self) -> bool:
        state = self.state
        return state is not None and state.input_seq == self.last_basis and not self._open

    async def _forget(self) -> None:
        self.state = None
        self._open = []
        if self._tail is not None:
            await self._tail.close()
            self._tail = None
        await self._stop_following()

    async def _stop_following(self) -> None:
        if self._btail is not None:
            await self._btail.close()
            self._btail = None

    # -- loading and catching up -------------------------------------------
    async def _load(self, use_snapshot: bool) -> None:
        """A starting state: the verified snapshot, else (none, unusable, or not
        ``use_snapshot``) the empty state before input 1."""
        await self._forget()
        state, batch_seq, last_basis = State(), 0, 0
        loaded = await self._read_snapshot() if use_snapshot else None
        if loaded is not None:
            snap, state = loaded
            batch_seq, last_basis = snap.batch_seq, snap.last_basis
        self.recovered_from = "snapshot" if loaded is not None else "log"
        self.state = state
        self.batch_seq, self.last_basis = batch_seq, last_basis
        self._snapshot_at = state.input_seq
        self._tail = self.log.tail_inputs(state.input_seq + 1, may_accept=self._may_accept)

    async def _read_snapshot(self) -> tuple[SchedulerSnapshot, State] | None:
        """The stored snapshot, verified (decoded in a thread: the lease and other
        services keep running), or ``None`` (logged) when it cannot be used."""
        why = ""
        for _attempt in range(3):
            try:
                raw = await self.snapshots.load(SNAPSHOT_NAME)
            except SnapshotUnreadable as exc:
                why = str(exc)  # replaced while being read, or damaged: read it again
                await asyncio.sleep(0.2)
                continue
            if raw is None:
                return None
            try:
                snap, state = await asyncio.to_thread(load_snapshot, raw)
            except SnapshotInvalid as exc:
                why = f"snapshot of {len(raw):,} bytes {exc}"
                break
            inputs, batches = await self.log.last_input_seq(), await self.log.last_batch_seq()
            if snap.input_seq > inputs or snap.batch_seq > batches:
                # the streams lost their tail (an OS crash before an fsync): the snapshot
                # holds inputs that no longer exist, or that will be numbered anew
                why = (
                    f"snapshot at input {snap.input_seq}, batch {snap.batch_seq} is ahead "
                    f"of the streams (input {inputs}, batch {batches})"
                )
                break
            return snap, state
        self.snapshots_rejected += 1
        self.metrics.snapshots_rejected.inc()
        self.logger.warning("snapshot unusable; folding the whole log", reason=why)
        return None

    async def _catch_up(self, final: bool) -> None:
        """Fold what the log holds now (with ``final``, the inputs after its last
        batch too), from the state kept, else the snapshot, else from scratch:
        a state found ahead of a batch falls back to the next of these."""
        sources = ["kept", "snapshot", "log"] if self.state is not None else ["snapshot", "log"]
        if not self._trust_snapshot:
            sources.remove("snapshot")
        for source in sources:
            if source != "kept":
                await self._load(use_snapshot=source == "snapshot")
            state = self.state
            assert state is not None
            start_input, start_batch = state.input_seq, self.batch_seq
            try:
                refolded = await self._fold_log(final, skip_ahead=source == "log")
            except _Ahead as exc:
                self.logger.warning(
                    "state ahead of a decision batch; starting over", detail=str(exc)
                )
                continue
            if self.gap is not None or not self._trust_snapshot:
                self._trust_snapshot = True  # folded past every gap from input 1
                if self.gap is not None:
                    self.gap = None
                    self.metrics.inputs.set_gap(None)
            if source != "kept" or final:
                self.logger.info(
                    "recovered" if final else "following",
                    source=self.recovered_from if source != "kept" else "kept",
                    from_input_seq=start_input,
                    from_batch_seq=start_batch,
                    input_seq=state.input_seq,
                    batch_seq=self.batch_seq,
                    batches_refolded=refolded,
                )
            return

    async def _fold_log(self, final: bool, skip_ahead: bool) -> int:
        """Fold every batch in the log now, each after the inputs it is based on;
        with ``final`` also every input after the last one, unless the last cycle
        is still in parts (it must be decided on its basis first). Returns the
        number of batches folded."""
        if self._btail is None:
            self._btail = self.log.tail_batches(self.batch_seq + 1)
        state, itail, btail = self.state, self._tail, self._btail
        assert state is not None and itail is not None
        end = await self.log.last_batch_seq()
        folded = 0
        while btail.position < end:
            for sb in await btail.take(1000, 5.0):
                folded += await self._take_batch(sb, skip_ahead)
            await self._pause()
        self.batch_seq = max(self.batch_seq, btail.position)
        if final and not self._open:
            last = await self.log.last_input_seq()
            while state.input_seq < last:
                items = await itail.take(min(CHUNK, last - state.input_seq), 5.0)
                if not items:
                    self._gap_of(itail)
                for item in items:
                    fold_item(state, item)
                    self._folded(item, itail)
                await self._pause()
        return folded

    async def _pause(self) -> None:
        """Between two chunks of a long fold: let the lease renewal (and any other
        service in this event loop) run, and stop if the lease was lost. A tail
        whose messages are buffered already returns without ever suspending."""
        await asyncio.sleep(0)
        self._check_lease()

    async def _take_batch(self, sb: BatchItem, skip_ahead: bool) -> int:
        """Fold batch ``sb`` after the inputs it is based on (a part of a cycle is
        held until the cycle's last part is in); returns the batches folded."""
        state, itail = self.state, self._tail
        assert state is not None and itail is not None
        basis = sb.batch.basis
        if sb.seq <= self.batch_seq:
            return 0  # already held (a tail started again may deliver it once more)
        lost = self._in_lost(basis)
        if lost is not None:
            self.batch_seq = sb.seq
            self.logger.warning(
                "left out a decision batch made on inputs since lost",
                seq=sb.seq,
                basis=basis,
                lost=list(lost),
            )
            return 0
        if basis < state.input_seq:
            if not skip_ahead:
                raise _Ahead(f"batch {sb.seq} is based on input {basis}, after {state.input_seq}")
            return self._skip(sb, f"based on input {basis}, after input {state.input_seq}")
        if basis > self._inputs_known:
            self._inputs_known = await self.log.last_input_seq()
            if basis > self._inputs_known:
                return self._skip(sb, f"based on input {basis}, which is not in INPUTS")
        while state.input_seq < basis:
            items = await itail.take(min(CHUNK, basis - state.input_seq), 5.0)
            if not items:
                self._gap_of(itail)
            for item in items:
                fold_item(state, item)
                self._folded(item, itail)
            await self._pause()
            if self._in_lost(basis) is not None:
                return await self._take_batch(sb, skip_ahead)  # now known to be lost
        self.batch_seq = sb.seq
        self._open.append(sb)
        if sb.batch.continued:
            return 0  # the cycle goes on in the next batch
        parts, self._open = self._open, []
        for _folded in self._fold.fold(state, parts):
            pass
        self.last_basis = basis
        return len(parts)

    @property
    def skipped(self) -> int:
        """Decision batches passed over as out of canonical order."""
        return self._fold.skipped

    def _skip(self, sb: BatchItem, why: str) -> int:
        self._fold.skip(sb, why)
        return 0

    def _passed_over(self, sb: BatchItem, _why: str) -> None:
        self.batch_seq = max(self.batch_seq, sb.seq)

    # -- the lease --------------------------------------------------------
    def _check_lease(self) -> None:
        """Raise :class:`_LeaseLost` (or the renewal's error) once renewing failed."""
        task = self._renewer
        if task is not None and task.done():
            task.result()  # a transient NATS error goes to the supervisor
            raise _LeaseLost()

    async def _renew(self) -> None:
        """Renew the lease every third of its TTL; return when it cannot be."""
        while True:
            await asyncio.sleep(self.lease.ttl_s / 3)
            if not await self.lease.renew():
                return

    async def _stop_renewing(self) -> None:
        task, self._renewer = self._renewer, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    # -- 3 .. 7 --------------------------------------------------------------
    async def _lead(self, stop: asyncio.Event) -> None:
        self._renewer = asyncio.create_task(self._renew(), name=f"{self.name}-lease")
        try:
            await self._catch_up(final=True)
            await self._stop_following()  # a leader folds its own batches: no need to read them
            if self._open:
                self.logger.warning(
                    "the last cycle was left in parts; completing it",
                    basis=self._open[0].batch.basis,
                    parts=len(self._open),
                )
                await self.cycle()
            self.leading.set()
            await self._loop(stop)
        except _LeaseLost:
            self.leases_lost += 1
            self.metrics.leases_lost.inc()
            self.logger.warning("lease lost; standing by")

    async def _loop(self, stop: asyncio.Event) -> None:
        state, tail = self.state, self._tail
        assert state is not None and tail is not None
        since_cycle = 0
        while not stop.is_set():
            self._check_lease()
            # 4. fold what has arrived
            timeout = min(self.lease.ttl_s / 3, 0.25)
            if since_cycle == 0 and state.input_seq > self.last_basis:
                timeout = 0.0  # inputs folded while catching up wait for a decision
            elif (
                self.next_wakeup_ms is not None
                and since_cycle == 0
                and self._ticked_basis != self.last_basis
            ):
                timeout = max(0.0, min(timeout, (self.next_wakeup_ms - self.clock()) / 1000))
            items = await tail.take(self.max_inputs_per_cycle - since_cycle, timeout)
            if not items and tail.gap is not None:
                raise HistoryGap(*tail.gap)
            for item in items:
                fold_item(state, item)
                self._folded(item, tail)
            since_cycle += len(items)
            # 5. + 6. decide and publish once caught up; never on an accepted loss
            # itself (batches based on a lost input are not history): on the input after it
            caught_up = tail.caught_up or not items
            at_loss = self._in_lost(state.input_seq) is not None
            if (
                state.input_seq > self.last_basis
                and not at_loss
                and (caught_up or since_cycle >= self.max_inputs_per_cycle)
            ):
                await self.cycle()
                since_cycle = 0
            await self._check_heartbeats()
            # 7. tick
            if (
                not items
                and self.next_wakeup_ms is not None
                and self.clock() >= self.next_wakeup_ms
            ):
                await self._tick()

    async def cycle(self) -> DecisionBatch | None:
        """Decide, publish (in parts if it does not fit one message) and fold one
        cycle; returns its batch (``None`` when there is nothing new to decide).

        A cycle a previous leader left in parts is decided again: its parts in
        the log must be the start of this decision, and only the rest is published."""
        state = self.state
        assert state is not None
        published, self._open = self._open, []
        if state.input_seq <= self.last_basis and not published:
            return None
        started = time.perf_counter()
        batch, result = decide_batch(state, self.decider)
        cycle_start = state.decisions_folded
        done = [d for sb in published for d in sb.batch.decisions]
        for sb in published:
            fold_item(state, sb)
        if tuple(done) != batch.decisions[: len(done)]:
            # not this code's decision: close the cycle as it stands, naming both versions
            made_by = published[0].batch.logic
            self.logger.error(
                "the published parts of a cycle differ from its decision; closing it",
                basis=batch.basis,
                parts_logic=None if made_by is msgspec.UNSET else made_by,
                logic=batch.logic,
            )
            batch = msgspec.structs.replace(batch, decisions=tuple(done), logic=made_by)
        parts = split_batch(batch, cycle_start, self.log.max_batch_bytes, start=len(done))
        for part in parts:
            try:
                seq = await self.log.publish_batch(part, self.batch_seq)  # raises Fenced
            except BatchTooLarge as exc:
                self.logger.error(
                    "decision batch refused for its size; stopping",
                    error=str(exc),
                    basis=part.basis,
                    decisions=len(part.decisions),
                    limit=self.log.max_batch_bytes,
                )
                raise
            fold_item(state, BatchItem(seq=seq, batch=part))
            self.batch_seq = seq
        self.last_basis = batch.basis
        wake = result.next_wakeup_ms
        # A wake-up at or before the state's time cannot move it: ignore it rather than tick forever.
        self.next_wakeup_ms = wake if wake is not None and wake > state.now_ms else None
        self.cycles += 1
        self.metrics.cycle(
            time.perf_counter() - started, (d for p in parts for d in p.decisions), len(parts)
        )
        if batch.decisions or len(parts) > 1:
            self.logger.debug(
                "decided",
                basis=batch.basis,
                batch_seq=self.batch_seq,
                decisions=len(batch.decisions),
                parts=len(parts),
            )
        # 8. snapshot
        if (
            state.input_seq - self._snapshot_at >= self.snapshot_every
            and time.monotonic() - self._snapshot_time >= self.snapshot_interval_s
        ):
            await self.save_snapshot()
        return batch

    async def metrics_text(self) -> bytes:
        """The metrics in Prometheus' text format; the lag asks NATS for INPUTS' last sequence."""
        state = self.state
        self.metrics.update(
            leading=self.leading.is_set(),
            folded=state.input_seq if state is not None else self.last_basis,
            stored=await stored_inputs(self.log),
        )
        js = getattr(self.log, "js", None)
        if js is not None:  # a federated cluster's sources (none: nothing shown)
            from .federation import status

            with contextlib.suppress(Exception):
                self.metrics.sources(await status(js, self.log.subjects.cluster, timeout_s=2.0))
        return self.metrics.render()

    async def _tick(self) -> None:
        if self._ticked_basis == self.last_basis:
            return
        wake = self.next_wakeup_ms
        self._ticked_basis = self.last_basis
        event = ClockTicked(id=f"tick-{self.last_basis}-{wake}", at_ms=max(self.clock(), wake or 0))
        await self.log.publish_input(event)
        self.metrics.ticks.inc()
        self.logger.debug("tick", wakeup_ms=wake, basis=self.last_basis)

    async def save_snapshot(self) -> None:
        state = self.state
        assert state is not None
        data = state.to_bytes()
        snap = SchedulerSnapshot(
            input_seq=state.input_seq,
            batch_seq=self.batch_seq,
            last_basis=self.last_basis,
            digest=hashlib.sha256(data).hexdigest(),  # what State.digest() computes
            state=data,
        )
        await self.snapshots.save(SNAPSHOT_NAME, _snap_encoder.encode(snap))
        self._snapshot_at = state.input_seq
        self._snapshot_time = time.monotonic()
        self.metrics.snapshots_saved.inc()
        self.logger.info(
            "snapshot", input_seq=state.input_seq, batch_seq=self.batch_seq, bytes=len(data)
        )


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
