"""The event log on NATS JetStream, behind a small port.

Subjects and streams for cluster ``C`` (a name of letters, digits, ``_``, ``-``):

| what | subject | stream |
|---|---|---|
| inputs | ``apportion.C.inputs.<kind>`` (``<kind>`` is the event tag, ``raw`` for anything else) | ``INPUTS_C`` |
| decision batches | ``apportion.C.decisions`` | ``DECISIONS_C`` |
| scheduler snapshots | object ``scheduler`` | object store ``apportion_C_snapshots`` |
| scheduler lease | key ``scheduler`` | KV bucket ``apportion_C_leases`` |

Both streams use file storage, ``num_replicas`` 1 or 3, and are created
idempotently. Inputs are published with ``Nats-Msg-Id = event.id`` (stored once
within the duplicate window); decision batches with
``Nats-Expected-Last-Sequence`` (a second or stale scheduler is fenced out).

An input's event time is the server's timestamp at ingestion: readers replace
``at_ms`` with it (the fold makes it non-decreasing). Bytes that do not decode
become an :class:`~apportion.schemas.history.InputItem` with ``event=None`` and a
``rejection``; the scheduler
turns them into ``InputRejected`` (``ref`` = the ``Nats-Msg-Id``, else
``seq:<n>``) and never crashes.

:class:`EventLog` is the port; :class:`MemoryLog` and :class:`JetStreamLog`
implement it (one contract test suite runs against both).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import msgspec
from apportion.schemas.codec import EventDecodeError, decode_batch, decode_input, encode
from apportion.schemas.events import DecisionBatch, Input, kind_of
from apportion.schemas.history import BatchItem, InputItem, malformed_item

T = TypeVar("T")

_CLUSTER_RE = re.compile(r"^[A-Za-z0-9_-]+$")


class Fenced(Exception):
    """A decision batch was refused: the log's last sequence is not the one expected."""

    def __init__(self, expected: int, detail: str = "") -> None:
        super().__init__(
            f"DECISIONS moved past sequence {expected} (another scheduler wrote) {detail}".strip()
        )
        self.expected = expected


class Subjects:
    """Names of every subject, stream and bucket of one cluster."""

    def __init__(self, cluster: str) -> None:
        if not _CLUSTER_RE.match(cluster):
            raise ValueError(f"cluster name {cluster!r}: use letters, digits, '_' and '-'")
        self.cluster = cluster
        self.inputs_stream = f"INPUTS_{cluster}"
        self.decisions_stream = f"DECISIONS_{cluster}"
        self.inputs_prefix = f"apportion.{cluster}.inputs"
        self.inputs_all = f"{self.inputs_prefix}.>"
        self.decisions = f"apportion.{cluster}.decisions"
        self.snapshot_bucket = f"apportion_{cluster}_snapshots"
        self.lease_bucket = f"apportion_{cluster}_leases"

    def input_subject(self, kind: str) -> str:
        return f"{self.inputs_prefix}.{kind}"


# --------------------------------------------------------------------------
# What readers get
# --------------------------------------------------------------------------


class PublishResult(msgspec.Struct, frozen=True):
    seq: int
    duplicate: bool = False


def to_input_item(seq: int, at_ms: int, data: bytes, msg_id: str | None) -> InputItem:
    """Decode stored bytes; event time becomes ``at_ms`` (the log's ingestion time)."""
    try:
        event = decode_input(data)
    except EventDecodeError as exc:
        return malformed_item(seq, at_ms, msg_id or f"seq:{seq}", str(exc))
    if event.at_ms != at_ms:
        event = msgspec.structs.replace(event, at_ms=at_ms)
    return InputItem(seq=seq, at_ms=at_ms, ref=event.id, event=event)


class Tail(Protocol[T]):
    """A reader positioned in one stream that follows it as it grows."""

    async def take(self, max_n: int, timeout: float) -> list[T]:
        """Up to ``max_n`` items in order; waits at most ``timeout`` s for the first one."""
        ...

    @property
    def caught_up(self) -> bool:
        """Nothing known to be left unread (as of the last item taken)."""
        ...

    async def close(self) -> None: ...


class EventLog(Protocol):
    """The port every service depends on: the two streams of one cluster."""

    subjects: Subjects

    async def setup(self) -> None: ...

    async def publish_input(self, event: Input) -> PublishResult: ...

    async def publish_inputs(self, events: list[Input]) -> list[PublishResult]: ...

    async def publish_raw_input(self, data: bytes, msg_id: str | None = None) -> PublishResult: ...

    async def publish_batch(self, batch: DecisionBatch, expected_last_seq: int) -> int:
        """Append ``batch``; raise :class:`Fenced` unless DECISIONS ends at ``expected_last_seq``."""
        ...

    async def last_input_seq(self) -> int: ...

    async def last_batch_seq(self) -> int: ...

    def tail_inputs(self, from_seq: int) -> Tail[InputItem]: ...

    def tail_batches(self, from_seq: int) -> Tail[BatchItem]: ...


class SnapshotStore(Protocol):
    async def save(self, name: str, data: bytes) -> None: ...

    async def load(self, name: str) -> bytes | None: ...


class Lease(Protocol):
    """Who may write decisions. Fencing keeps the log right even if two believe they hold it."""

    async def acquire(self) -> bool:
        """Try once; ``True`` if this holder now has the lease (or still has it)."""
        ...

    async def renew(self) -> bool: ...

    async def release(self) -> None: ...

    ttl_s: float


# --------------------------------------------------------------------------
# In memory
# --------------------------------------------------------------------------


class _MemoryTail(Generic[T]):
    def __init__(self, items: list[T], start: int, waiters: list[asyncio.Event]) -> None:
        self._items = items
        self._next = start - 1  # index into items
        self._changed = asyncio.Event()
        self._waiters = waiters
        waiters.append(self._changed)

    @property
    def caught_up(self) -> bool:
        return self._next >= len(self._items)

    async def take(self, max_n: int, timeout: float) -> list[T]:
        if self._next >= len(self._items):
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                return []
        out = self._items[self._next : self._next + max_n]
        self._next += len(out)
        return out

    async def close(self) -> None:
        if self._changed in self._waiters:
            self._waiters.remove(self._changed)


class MemoryLog:
    """An :class:`EventLog` in memory (tests, the simulator's way of driving services)."""

    def __init__(self, cluster: str = "test", clock: Callable[[], int] | None = None) -> None:
        self.subjects = Subjects(cluster)
        self.clock = clock or (lambda: time.time_ns() // 1_000_000)
        self.inputs: list[InputItem] = []
        self.batches: list[BatchItem] = []
        self._ids: dict[str, int] = {}
        self._input_waiters: list[asyncio.Event] = []
        self._batch_waiters: list[asyncio.Event] = []
        self._last_ms = 0

    async def setup(self) -> None:
        return None

    def _now(self) -> int:
        self._last_ms = max(self._last_ms, self.clock())
        return self._last_ms

    def _append_input(self, data: bytes, msg_id: str | None) -> PublishResult:
        if msg_id is not None and msg_id in self._ids:
            return PublishResult(seq=self._ids[msg_id], duplicate=True)
        seq = len(self.inputs) + 1
        self.inputs.append(to_input_item(seq, self._now(), data, msg_id))
        if msg_id is not None:
            self._ids[msg_id] = seq
        for w in self._input_waiters:
            w.set()
        return PublishResult(seq=seq)

    async def publish_input(self, event: Input) -> PublishResult:
        return self._append_input(encode(event), event.id)

    async def publish_inputs(self, events: list[Input]) -> list[PublishResult]:
        return [self._append_input(encode(e), e.id) for e in events]

    async def publish_raw_input(self, data: bytes, msg_id: str | None = None) -> PublishResult:
        return self._append_input(data, msg_id)

    async def publish_batch(self, batch: DecisionBatch, expected_last_seq: int) -> int:
        if len(self.batches) != expected_last_seq:
            raise Fenced(expected_last_seq, f"(last is {len(self.batches)})")
        seq = len(self.batches) + 1
        self.batches.append(BatchItem(seq=seq, batch=decode_batch(encode(batch))))
        for w in self._batch_waiters:
            w.set()
        return seq

    async def last_input_seq(self) -> int:
        return len(self.inputs)

    async def last_batch_seq(self) -> int:
        return len(self.batches)

    def tail_inputs(self, from_seq: int) -> _MemoryTail[InputItem]:
        return _MemoryTail(self.inputs, from_seq, self._input_waiters)

    def tail_batches(self, from_seq: int) -> _MemoryTail[BatchItem]:
        return _MemoryTail(self.batches, from_seq, self._batch_waiters)


class MemorySnapshots:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    async def save(self, name: str, data: bytes) -> None:
        self.objects[name] = data

    async def load(self, name: str) -> bytes | None:
        return self.objects.get(name)


class MemoryLease:
    """Always granted: one process, one scheduler."""

    ttl_s = 1.0

    async def acquire(self) -> bool:
        return True

    async def renew(self) -> bool:
        return True

    async def release(self) -> None:
        return None


# --------------------------------------------------------------------------
# JetStream
# --------------------------------------------------------------------------

HDR_MSG_ID = "Nats-Msg-Id"
HDR_EXPECTED_LAST_SEQ = "Nats-Expected-Last-Sequence"
WRONG_LAST_SEQUENCE = 10071


def parse_ack_reply(reply: str) -> tuple[int, int, int]:
    """``(stream sequence, timestamp in ns, num_pending)`` from a JetStream delivery's reply subject.

    V1: ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>``;
    V2 adds ``<domain>.<account hash>`` after ``ACK`` and a trailing token.
    """
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[7]), int(tokens[8])
    return int(tokens[7]), int(tokens[9]), int(tokens[10])


class _JsTail(Generic[T]):
    """An ordered push consumer starting at ``from_seq``, buffered into a deque."""

    def __init__(
        self,
        log: JetStreamLog,
        subject: str,
        stream: str,
        from_seq: int,
        convert: Callable[[Any], T],
    ) -> None:
        self._log = log
        self._subject = subject
        self._stream = stream
        self._from = from_seq
        self._convert = convert
        self._buf: deque[Any] = deque()
        self._arrived = asyncio.Event()
        self._sub: Any = None
        self._pending = 1
        self._lock = asyncio.Lock()

    async def _ensure(self) -> None:
        if self._sub is not None:
            return
        from nats.js import api

        async def cb(msg: Any) -> None:
            self._buf.append(msg)
            self._arrived.set()

        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(1, self._from),
            inactive_threshold=60.0,
        )
        self._sub = await self._log.js.subscribe(
            self._subject,
            stream=self._stream,
            cb=cb,
            config=config,
            ordered_consumer=True,
            idle_heartbeat=2.0,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1 << 30,
        )

    @property
    def caught_up(self) -> bool:
        return not self._buf and self._pending == 0

    async def take(self, max_n: int, timeout: float) -> list[T]:
        async with self._lock:
            await self._ensure()
            if not self._buf:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout)
                except TimeoutError:
                    return []
            out: list[T] = []
            buf = self._buf
            convert = self._convert
            while buf and len(out) < max_n:
                msg = buf.popleft()
                seq, ts_ns, pending = parse_ack_reply(msg.reply)
                if seq < self._from:
                    continue  # a reset ordered consumer may redeliver
                self._from = seq + 1
                self._pending = pending
                out.append(convert((seq, ts_ns, msg)))
            return out

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):  # the connection may be gone already
                await self._sub.unsubscribe()
            self._sub = None


def _convert_input(item: tuple[int, int, Any]) -> InputItem:
    seq, ts_ns, msg = item
    headers = msg.headers or {}
    return to_input_item(seq, ts_ns // 1_000_000, msg.data, headers.get(HDR_MSG_ID))


def _convert_batch(item: tuple[int, int, Any]) -> BatchItem:
    seq, _ts, msg = item
    return BatchItem(seq=seq, batch=decode_batch(msg.data))


class JetStreamLog:
    """An :class:`EventLog` on a JetStream context ``js`` (nats-py)."""

    def __init__(
        self,
        js: Any,
        cluster: str,
        replicas: int = 1,
        duplicate_window_s: float = 120.0,
        max_async_pending: int = 4000,
    ) -> None:
        self.js = js
        self.subjects = Subjects(cluster)
        self.replicas = replicas
        self.duplicate_window_s = duplicate_window_s
        self.max_async_pending = max_async_pending

    async def setup(self, attempts: int = 30) -> None:
        """Create (or update) both streams; retries while a cluster elects a leader."""
        from nats.js import api
        from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

        s = self.subjects
        configs = [
            api.StreamConfig(
                name=s.inputs_stream,
                subjects=[s.inputs_all],
                storage=api.StorageType.FILE,
                num_replicas=self.replicas,
                duplicate_window=self.duplicate_window_s,
                retention=api.RetentionPolicy.LIMITS,
                discard=api.DiscardPolicy.NEW,
            ),
            api.StreamConfig(
                name=s.decisions_stream,
                subjects=[s.decisions],
                storage=api.StorageType.FILE,
                num_replicas=self.replicas,
                retention=api.RetentionPolicy.LIMITS,
                discard=api.DiscardPolicy.NEW,
            ),
        ]
        for config in configs:
            for attempt in range(attempts):
                try:
                    try:
                        await self.js.stream_info(config.name)
                    except NotFoundError:
                        await self.js.add_stream(config)
                    break
                except (APIError, ServiceUnavailableError, TimeoutError):
                    if attempt == attempts - 1:
                        raise
                    await asyncio.sleep(0.5)

    # -- publishing ---------------------------------------------------
    async def publish_input(self, event: Input) -> PublishResult:
        ack = await self.js.publish(
            self.subjects.input_subject(kind_of(event)),
            encode(event),
            headers={HDR_MSG_ID: event.id},
        )
        return PublishResult(seq=ack.seq, duplicate=bool(ack.duplicate))

    async def publish_inputs(self, events: list[Input]) -> list[PublishResult]:
        """Pipelined publishes (``publish_async``), acknowledged together, in order."""
        futures = []
        subject = self.subjects.input_subject
        for event in events:
            futures.append(
                await self.js.publish_async(
                    subject(kind_of(event)), encode(event), headers={HDR_MSG_ID: event.id}
                )
            )
        acks = await asyncio.gather(*futures)
        return [PublishResult(seq=a.seq, duplicate=bool(a.duplicate)) for a in acks]

    async def publish_raw_input(self, data: bytes, msg_id: str | None = None) -> PublishResult:
        headers = {HDR_MSG_ID: msg_id} if msg_id else None
        ack = await self.js.publish(self.subjects.input_subject("raw"), data, headers=headers)
        return PublishResult(seq=ack.seq, duplicate=bool(ack.duplicate))

    async def publish_batch(self, batch: DecisionBatch, expected_last_seq: int) -> int:
        from nats.js.errors import APIError

        try:
            ack = await self.js.publish(
                self.subjects.decisions,
                encode(batch),
                headers={HDR_EXPECTED_LAST_SEQ: str(expected_last_seq)},
            )
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                raise Fenced(expected_last_seq, str(exc.description or "")) from None
            raise
        return ack.seq

    # -- reading ------------------------------------------------------
    async def last_input_seq(self) -> int:
        info = await self.js.stream_info(self.subjects.inputs_stream)
        return info.state.last_seq

    async def last_batch_seq(self) -> int:
        info = await self.js.stream_info(self.subjects.decisions_stream)
        return info.state.last_seq

    def tail_inputs(self, from_seq: int) -> _JsTail[InputItem]:
        s = self.subjects
        return _JsTail(self, s.inputs_all, s.inputs_stream, from_seq, _convert_input)

    def tail_batches(self, from_seq: int) -> _JsTail[BatchItem]:
        s = self.subjects
        return _JsTail(self, s.decisions, s.decisions_stream, from_seq, _convert_batch)

    async def snapshots(self) -> JetStreamSnapshots:
        return await JetStreamSnapshots.open(self.js, self.subjects.snapshot_bucket, self.replicas)

    async def lease(self, holder: str, ttl_s: float = 3.0) -> JetStreamLease:
        return await JetStreamLease.open(
            self.js, self.subjects.lease_bucket, holder, ttl_s, self.replicas
        )


class JetStreamSnapshots:
    """Snapshots in a JetStream object store (no 1 MB message limit)."""

    def __init__(self, obs: Any) -> None:
        self.obs = obs

    @classmethod
    async def open(cls, js: Any, bucket: str, replicas: int = 1) -> JetStreamSnapshots:
        from nats.js import api
        from nats.js.errors import BucketNotFoundError, NotFoundError

        try:
            obs = await js.object_store(bucket)
        except (BucketNotFoundError, NotFoundError):
            obs = await js.create_object_store(
                bucket,
                config=api.ObjectStoreConfig(storage=api.StorageType.FILE, replicas=replicas),
            )
        return cls(obs)

    async def save(self, name: str, data: bytes) -> None:
        await self.obs.put(name, data)

    async def load(self, name: str) -> bytes | None:
        from nats.js.errors import NotFoundError, ObjectNotFoundError

        try:
            result = await self.obs.get(name)
        except (ObjectNotFoundError, NotFoundError):
            return None
        return result.data


class JetStreamLease:
    """A KV key that expires ``ttl_s`` after its last write; the holder renews it
    with compare-and-set on the revision, a standby creates it once it is gone."""

    def __init__(self, kv: Any, holder: str, ttl_s: float, key: str = "scheduler") -> None:
        self.kv = kv
        self.holder = holder
        self.ttl_s = ttl_s
        self.key = key
        self.revision: int | None = None

    @classmethod
    async def open(
        cls, js: Any, bucket: str, holder: str, ttl_s: float, replicas: int = 1
    ) -> JetStreamLease:
        from nats.js.errors import BucketNotFoundError, NotFoundError

        try:
            kv = await js.key_value(bucket)
        except (BucketNotFoundError, NotFoundError):
            kv = await js.create_key_value(bucket=bucket, ttl=ttl_s, history=1, replicas=replicas)
        return cls(kv, holder, ttl_s)

    async def acquire(self) -> bool:
        from nats.js.errors import KeyWrongLastSequenceError

        if self.revision is not None:
            return await self.renew()
        try:
            self.revision = await self.kv.create(self.key, self.holder.encode())
        except KeyWrongLastSequenceError:
            return False
        return True

    async def renew(self) -> bool:
        from nats.js.errors import KeyWrongLastSequenceError

        if self.revision is None:
            return False
        try:
            self.revision = await self.kv.update(self.key, self.holder.encode(), last=self.revision)
        except KeyWrongLastSequenceError:
            self.revision = None
            return False
        return True

    async def release(self) -> None:
        from nats.js.errors import KeyWrongLastSequenceError

        if self.revision is None:
            return
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self.kv.delete(self.key, last=self.revision)
        self.revision = None


async def connect(url: str, name: str = "apportion") -> Any:
    """A nats-py connection that keeps retrying (servers may restart under it).

    ``url`` may list several servers separated by commas (a cluster)."""
    import nats

    servers = [
        u.strip() for u in url.split(",") if u.strip()
    ]  # NATS_URL may list a cluster's nodes
    return await nats.connect(
        servers,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
    )
