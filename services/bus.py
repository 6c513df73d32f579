"""The event log on NATS JetStream, behind a small port.

Subjects and streams for cluster ``C`` (a name of letters, digits, ``_``, ``-``):

| what | subject | stream |
|---|---|---|
| inputs | ``apportion.C.inputs.<kind>`` (``<kind>`` is the event tag, ``raw`` for anything else) | ``INPUTS_C`` |
| a host agent's inputs | ``apportion.C.inputs.<kind>.<node>`` | ``INPUTS_C`` |
| decision batches | ``apportion.C.decisions`` | ``DECISIONS_C`` |
| scheduler snapshots | object ``scheduler`` | object store ``apportion_C_snapshots`` |
| scheduler lease | key ``scheduler`` | KV bucket ``apportion_C_leases`` |
| host agents' heartbeats | ``apportion.C.heartbeat.<node>`` | none (plain NATS) |
| each attempt's output (the last MiB) | ``apportion.C.logs.<node>.<workload>.<attempt>.<slot>`` | ``LOGS_C`` (:mod:`~apportion.services.attempt_logs`) |

Both streams use file storage, ``num_replicas`` 1 or 3, and are created
idempotently. Inputs are published with ``Nats-Msg-Id = event.id`` (stored once
within the duplicate window); decision batches with
``Nats-Expected-Last-Sequence`` (a second or stale scheduler is fenced out).
A decision batch message holds at most :attr:`JetStreamLog.max_batch_bytes`
(:func:`batch_byte_limit`): the scheduler splits a larger cycle into parts.

An input's event time is the server's timestamp at ingestion: readers replace
``at_ms`` with it (the fold makes it non-decreasing). Bytes that do not decode
become an :class:`~apportion.schemas.history.InputItem` with ``event=None`` and a
``rejection``; the scheduler
turns them into ``InputRejected`` (``ref`` = the ``Nats-Msg-Id``, else
``seq:<n>``) and never crashes.

:class:`EventLog` is the port; :class:`MemoryLog` and :class:`JetStreamLog`
implement it (one contract test suite runs against both).

A message on ``DECISIONS`` that does not decode as a batch is logged and
skipped by the tails that read it (their :attr:`~Tail.position` still moves past it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import os
import re
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import msgspec
from apportion.core.rules.authority import AGENT_PREFIX
from apportion.core.rules.subjects import AGENT_KINDS
from apportion.schemas.codec import EventDecodeError, decode_batch, decode_input, encode
from apportion.schemas.events import DecisionBatch, Input, InputsLost, kind_of, kind_of_type
from apportion.schemas.history import BatchItem, InputItem, malformed_item

from . import attempt_logs, logs
from .direct import DirectTail, StoredMessage, get_batch, last_sequence

T = TypeVar("T")

_CLUSTER_RE = re.compile(r"^[A-Za-z0-9_-]+$")


BATCH_BYTES_CAP = 512 * 1024
"""The most bytes (JSON) a decision batch message holds, whatever the server
allows: half of NATS's default 1 MB ``max_payload``."""
PAYLOAD_HEADROOM = 4096
"""Room kept below the server's ``max_payload`` for a message's headers."""


def batch_byte_limit(max_payload: int | None = None, max_msg_size: int | None = None) -> int:
    """The byte limit of one decision batch: :data:`BATCH_BYTES_CAP`, or less when
    the server's ``max_payload`` or the stream's ``max_msg_size`` (minus the
    headers' :data:`PAYLOAD_HEADROOM`) is smaller."""
    limit = BATCH_BYTES_CAP
    for bound in (max_payload, max_msg_size):
        if bound is not None and bound > 0:
            limit = min(limit, bound - PAYLOAD_HEADROOM)
    return max(limit, 1)


class BatchTooLarge(Exception):
    """The server refused a decision batch for its size. Not transient: publishing
    it again fails again (the scheduler splits cycles so that this does not happen)."""


class SnapshotUnreadable(Exception):
    """A stored snapshot that cannot be used (its chunks missing or not matching its digest)."""


class HistoryGap(Exception):
    """Inputs ``first`` .. ``through`` are missing from INPUTS (the store lost them)
    and no loss was accepted for them: the history cannot be folded past them."""

    def __init__(self, first: int, through: int, *, held: bool = False) -> None:
        super().__init__(
            f"inputs {first}..{through} were folded by this reader but are recorded as lost"
            if held
            else f"inputs {first}..{through} are missing from INPUTS and no loss was accepted "
            "(apportion history accept-loss)"
        )
        self.first = first
        self.through = through
        self.held = held
        """The reader's state holds the lost inputs (it folded them before the loss)."""


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
        self.heartbeats = f"apportion.{cluster}.heartbeat.>"
        """Every host agent's heartbeat (plain NATS, not a stream)."""
        self.logs_stream = attempt_logs.stream_name(cluster)
        """Each attempt's output, shipped by the agents (:mod:`~apportion.services.attempt_logs`)."""

    def input_subject(self, kind: str, host: str | None = None) -> str:
        """``apportion.C.inputs.<kind>``, or the agent of ``host``'s own
        ``apportion.C.inputs.<kind>.<host>``."""
        if host is None:
            return f"{self.inputs_prefix}.{kind}"
        return f"{self.inputs_prefix}.{kind}.{host}"

    def subject_of(self, event: Input) -> str:
        """Where ``event`` is published: a host agent's input (an agent kind whose
        actor is ``agent:<host>``) on its host's subject, any other on its kind's.
        The fold binds both (:mod:`apportion.core.rules.subjects`), and NATS
        permissions let each credential publish on its own subjects only."""
        kind = kind_of(event)
        actor = getattr(event, "actor", "")
        if kind in AGENT_KINDS and actor.startswith(AGENT_PREFIX) and actor != AGENT_PREFIX:
            return self.input_subject(kind, actor[len(AGENT_PREFIX) :])
        return self.input_subject(kind)

    def heartbeat(self, node: str) -> str:
        """Where the agent of ``node`` heartbeats (JSON ``{"node", "addr", "at_ms", ...}``)."""
        return f"apportion.{self.cluster}.heartbeat.{node}"


# --------------------------------------------------------------------------
# What readers get
# --------------------------------------------------------------------------


class InputGap(msgspec.Struct, frozen=True, kw_only=True):
    """Inputs ``first`` .. ``through`` missing from INPUTS; ``acceptance`` is the id
    of the ``InputsLost`` that bridges them (``None``: no loss accepted yet) and
    ``accepted_by`` its actor."""

    first: int
    through: int
    acceptance: str | None = None
    accepted_by: str | None = None

    @property
    def count(self) -> int:
        return self.through - self.first + 1


class PublishResult(msgspec.Struct, frozen=True):
    seq: int
    duplicate: bool = False


def to_input_item(
    seq: int, at_ms: int, data: bytes, msg_id: str | None, subject: str | None = None
) -> InputItem:
    """Decode stored bytes; event time becomes ``at_ms`` (the log's ingestion time),
    and the ``at_ms`` the payload carries is kept as the time it was sent
    (``sent_ms``: its publisher stamps it, :func:`stamped`); ``subject`` is the
    one it was stored on (the fold checks the event against both)."""
    try:
        event = decode_input(data)
    except EventDecodeError as exc:
        return malformed_item(seq, at_ms, msg_id or f"seq:{seq}", str(exc))
    sent_ms = event.at_ms
    if sent_ms != at_ms:
        event = msgspec.structs.replace(event, at_ms=at_ms)
    return InputItem(
        seq=seq, at_ms=at_ms, ref=event.id, event=event, subject=subject, sent_ms=sent_ms
    )


def stamped(event: Input, now_ms: int | None = None) -> Input:
    """``event`` with ``at_ms`` the time it is sent (now): every publish stamps it
    again, a retry too (same id). Readers keep it as the input's ``sent_ms``, and
    the fold refuses an input sent too long before it was stored, or one whose id
    it folded within that window (:mod:`apportion.core.rules.identity`)."""
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    return msgspec.structs.replace(event, at_ms=now)


MayAccept = Callable[[InputItem], bool]
"""Whether an acceptance of lost inputs (an ``InputsLost`` as the history places it,
at its gap) may bridge the gap: a reader asks the fold's rule
(:func:`apportion.core.history.bridge_refusal`) with its state at the gap."""


class Tail(Protocol[T]):
    """A reader positioned in one stream that follows it as it grows."""

    async def take(self, max_n: int, timeout: float) -> list[T]:
        """Up to ``max_n`` items in order; waits at most ``timeout`` s for the first one."""
        ...

    @property
    def caught_up(self) -> bool:
        """Nothing known to be left unread (as of the last item taken)."""
        ...

    @property
    def position(self) -> int:
        """The stream sequence of the last message taken, one skipped as undecodable included."""
        ...

    @property
    def gap(self) -> tuple[int, int] | None:
        """``(first, through)``: stored messages missing (lost by the store, no loss
        accepted for them) where the tail stopped; ``None`` while the stream is whole."""
        ...

    async def close(self) -> None: ...


class EventLog(Protocol):
    """The port every service depends on: the two streams of one cluster."""

    subjects: Subjects
    max_batch_bytes: int
    """The most bytes one decision batch may encode to (:func:`batch_byte_limit`)."""

    async def setup(self) -> None: ...

    async def publish_input(self, event: Input) -> PublishResult: ...

    async def publish_inputs(self, events: list[Input]) -> list[PublishResult]: ...

    async def publish_raw_input(
        self, data: bytes, msg_id: str | None = None, kind: str = "raw"
    ) -> PublishResult:
        """Store ``data`` as it is on the subject of ``kind`` (tests: bytes a
        credential may send on its own subjects)."""
        ...

    async def publish_batch(self, batch: DecisionBatch, expected_last_seq: int) -> int:
        """Append ``batch``; raise :class:`Fenced` unless DECISIONS ends at ``expected_last_seq``."""
        ...

    async def last_input_seq(self) -> int: ...

    async def last_batch_seq(self) -> int: ...

    def tail_inputs(self, from_seq: int, *, may_accept: MayAccept | None = None) -> Tail[InputItem]:
        """A tail of INPUTS from ``from_seq``; at a gap it hands on the first
        acceptance of the loss that ``may_accept`` allows (the reader's state decides:
        :func:`apportion.core.history.bridge_refusal`)."""
        ...

    def tail_batches(self, from_seq: int) -> Tail[BatchItem]: ...

    async def publish_log(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """Store one region of an attempt's log (:mod:`~apportion.services.attempt_logs`)."""
        ...

    async def read_log(self, host: str, workload: str, attempt: int) -> attempt_logs.LogView:
        """What the log stream holds of ``attempt`` of ``workload`` on ``host``."""
        ...


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

    @property
    def position(self) -> int:
        return self._next  # items hold sequences 1, 2, ...

    @property
    def gap(self) -> tuple[int, int] | None:
        return None  # a list in memory loses nothing

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
        self.max_batch_bytes = BATCH_BYTES_CAP
        self.clock = clock or (lambda: time.time_ns() // 1_000_000)
        self.inputs: list[InputItem] = []
        self.batches: list[BatchItem] = []
        self._ids: dict[str, int] = {}
        self._input_waiters: list[asyncio.Event] = []
        self._batch_waiters: list[asyncio.Event] = []
        self._last_ms = 0
        self.log_regions: dict[str, tuple[bytes, dict[str, str]]] = {}
        """Each log slot subject's last message (as ``LOGS_<c>`` keeps one per subject)."""

    async def setup(self) -> None:
        return None

    async def publish_log(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        self.log_regions[subject] = (bytes(data), dict(headers))

    async def read_log(self, host: str, workload: str, attempt: int) -> attempt_logs.LogView:
        c = self.subjects.cluster
        slots = {
            attempt_logs.slot_subject(c, host, workload, attempt, k)
            for k in range(attempt_logs.SLOTS)
        }
        regions = [
            (int(h[attempt_logs.HDR_OFFSET]), d, h.get(attempt_logs.HDR_FINAL) == "1")
            for subject, (d, h) in self.log_regions.items()
            if subject in slots
        ]
        return attempt_logs.assemble(regions)

    def _now(self) -> int:
        self._last_ms = max(self._last_ms, self.clock())
        return self._last_ms

    def _append_input(self, data: bytes, msg_id: str | None, subject: str) -> PublishResult:
        if msg_id is not None and msg_id in self._ids:
            return PublishResult(seq=self._ids[msg_id], duplicate=True)
        seq = len(self.inputs) + 1
        self.inputs.append(to_input_item(seq, self._now(), data, msg_id, subject))
        if msg_id is not None:
            self._ids[msg_id] = seq
        for w in self._input_waiters:
            w.set()
        return PublishResult(seq=seq)

    async def publish_input(self, event: Input) -> PublishResult:
        sent = stamped(event, self._now())
        return self._append_input(encode(sent), event.id, self.subjects.subject_of(event))

    async def publish_inputs(self, events: list[Input]) -> list[PublishResult]:
        subject = self.subjects.subject_of
        return [
            self._append_input(encode(stamped(e, self._now())), e.id, subject(e)) for e in events
        ]

    async def publish_raw_input(
        self, data: bytes, msg_id: str | None = None, kind: str = "raw"
    ) -> PublishResult:
        return self._append_input(data, msg_id, self.subjects.input_subject(kind))

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

    def tail_inputs(
        self, from_seq: int, *, may_accept: MayAccept | None = None
    ) -> _MemoryTail[InputItem]:
        """A tail of the inputs (a memory log loses none: ``may_accept`` is never asked)."""
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
MESSAGE_TOO_LARGE = 10054
"""JetStream's "message size exceeds maximum allowed" (a stream's ``max_msg_size``)."""


def parse_ack_reply(reply: str) -> tuple[int, int, int]:
    """``(stream sequence, timestamp in ns, num_pending)`` from a JetStream delivery's reply subject.

    V1: ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>``;
    V2 adds ``<domain>.<account hash>`` after ``ACK`` and a trailing token.
    """
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[7]), int(tokens[8])
    return int(tokens[7]), int(tokens[9]), int(tokens[10])


def _convert_input(m: StoredMessage) -> InputItem:
    return to_input_item(
        m.seq, m.ts_ns // 1_000_000, m.data, m.headers.get(HDR_MSG_ID), m.subject or None
    )


def _convert_batch(m: StoredMessage) -> BatchItem | None:
    seq = m.seq
    try:
        return BatchItem(seq=seq, batch=decode_batch(m.data))
    except EventDecodeError as exc:
        logs.get("bus").warning(
            "skipped a DECISIONS message that is not a decision batch", seq=seq, error=str(exc)
        )
        return None


def append_only_config(
    name: str, subjects: list[str], replicas: int, duplicate_window_s: float = 0
) -> Any:
    """A stream that keeps every message: file storage, nothing deleted or purged by
    anyone, new messages refused when full, direct gets for the readers
    (services/direct.py); ``duplicate_window_s``: an id stored once within it (``0``:
    the server's default)."""
    from nats.js import api

    return api.StreamConfig(
        name=name,
        subjects=subjects,
        storage=api.StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=duplicate_window_s,
        retention=api.RetentionPolicy.LIMITS,
        discard=api.DiscardPolicy.NEW,
        allow_direct=True,  # readers use batched direct gets (services/direct.py)
        deny_delete=True,  # no message is ever deleted ...
        deny_purge=True,  # ... or purged, by anyone
    )


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
        self.max_batch_bytes = batch_byte_limit(self._max_payload())

    def _max_payload(self) -> int | None:
        """The connected server's ``max_payload`` (``None`` when it is not known)."""
        nc = getattr(self.js, "_nc", None)  # nats-py keeps its client there
        payload = getattr(nc, "max_payload", None)
        return payload if isinstance(payload, int) else None

    async def setup(self, attempts: int = 30) -> None:
        """Create (or update) both streams; retries while a cluster elects a leader."""
        from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

        s = self.subjects
        configs = [
            append_only_config(
                s.inputs_stream, [s.inputs_all], self.replicas, self.duplicate_window_s
            ),
            append_only_config(s.decisions_stream, [s.decisions], self.replicas),
        ]
        infos = []
        for config in configs:
            for attempt in range(attempts):
                try:
                    try:
                        info = await self.js.stream_info(config.name)
                        if not info.config.allow_direct:  # made by an older version
                            info = await self.js.update_stream(
                                dataclasses.replace(
                                    info.config,
                                    allow_direct=True,
                                    deny_delete=True,
                                    deny_purge=True,
                                )
                            )
                    except NotFoundError:
                        info = await self.js.add_stream(config)
                    infos.append(info)
                    break
                except (APIError, ServiceUnavailableError, TimeoutError):
                    if attempt == attempts - 1:
                        raise
                    await asyncio.sleep(0.5)
        max_msg_size = getattr(getattr(infos[-1], "config", None), "max_msg_size", None)
        self.max_batch_bytes = batch_byte_limit(self._max_payload(), max_msg_size)
        await self._setup_logs()

    async def _setup_logs(self, attempts: int = 3) -> bool:
        """Create (or update) ``LOGS_<c>``, each attempt's output (services/attempt_logs.py).
        Not fatal: a server whose accounts predate it (its NATS configuration not
        generated again) refuses; then the agents ship nothing and ``apportion logs``
        says so, and everything else works."""
        config = attempt_logs.stream_config(self.subjects.cluster, self.replicas)
        for attempt in range(attempts):
            try:
                try:
                    await self.js.stream_info(config.name)
                except Exception as exc:
                    from nats.js.errors import NotFoundError

                    if not isinstance(exc, NotFoundError):
                        raise
                    await self.js.add_stream(config)
                return True
            except Exception as exc:
                if attempt == attempts - 1:
                    logs.get("bus", cluster=self.subjects.cluster).warning(
                        "cannot create the log stream: attempts' logs will not be on the bus "
                        "(generate the NATS configuration again: apportion nats-config)",
                        stream=config.name,
                        error=f"{type(exc).__name__}: {exc}".rstrip(": ").splitlines()[0],
                    )
                    return False
                await asyncio.sleep(0.5)
        return False

    # -- publishing ---------------------------------------------------
    async def publish_input(self, event: Input) -> PublishResult:
        ack = await self.js.publish(
            self.subjects.subject_of(event),
            encode(stamped(event)),
            headers={HDR_MSG_ID: event.id},
        )
        return PublishResult(seq=ack.seq, duplicate=bool(ack.duplicate))

    async def publish_inputs(self, events: list[Input]) -> list[PublishResult]:
        """Pipelined publishes (``publish_async``), acknowledged together, in order."""
        futures = []
        subject = self.subjects.subject_of
        for event in events:
            futures.append(
                await self.js.publish_async(
                    subject(event), encode(stamped(event)), headers={HDR_MSG_ID: event.id}
                )
            )
        acks = await asyncio.gather(*futures)
        return [PublishResult(seq=a.seq, duplicate=bool(a.duplicate)) for a in acks]

    async def publish_raw_input(
        self, data: bytes, msg_id: str | None = None, kind: str = "raw"
    ) -> PublishResult:
        headers = {HDR_MSG_ID: msg_id} if msg_id else None
        ack = await self.js.publish(self.subjects.input_subject(kind), data, headers=headers)
        return PublishResult(seq=ack.seq, duplicate=bool(ack.duplicate))

    async def publish_batch(self, batch: DecisionBatch, expected_last_seq: int) -> int:
        from nats.errors import MaxPayloadError
        from nats.js.errors import APIError

        data = encode(batch)
        try:
            ack = await self.js.publish(
                self.subjects.decisions,
                data,
                headers={HDR_EXPECTED_LAST_SEQ: str(expected_last_seq)},
            )
        except MaxPayloadError:
            raise BatchTooLarge(
                f"a decision batch of {len(data):,} bytes is over the server's max_payload"
            ) from None
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                raise Fenced(expected_last_seq, str(exc.description or "")) from None
            if exc.err_code == MESSAGE_TOO_LARGE:
                raise BatchTooLarge(
                    f"a decision batch of {len(data):,} bytes: {exc.description}"
                ) from None
            raise
        return ack.seq

    # -- reading ------------------------------------------------------
    async def last_input_seq(self) -> int:
        s = self.subjects
        return await last_sequence(self.nc, s.inputs_stream, s.inputs_all)

    async def last_batch_seq(self) -> int:
        s = self.subjects
        return await last_sequence(self.nc, s.decisions_stream, s.decisions)

    def tail_inputs(
        self, from_seq: int, *, bridge: bool = True, may_accept: MayAccept | None = None
    ) -> DirectTail[InputItem]:
        """A tail of INPUTS from ``from_seq``; at a gap it hands on the loss's
        acceptance placed there that ``may_accept`` allows (:meth:`accepted_loss`),
        or stops until there is one (``bridge=False``: no check, sequences may jump)."""
        s = self.subjects

        async def accepted(first: int, next_seq: int) -> tuple[InputItem, int] | None:
            return await self.accepted_loss(first, next_seq, may_accept)

        return DirectTail(
            self.nc,
            s.inputs_stream,
            s.inputs_all,
            from_seq,
            _convert_input,
            bridge=accepted if bridge else None,
            logger=logs.get("bus", cluster=s.cluster),
            leader_get=self._leader_input if bridge else None,
        )

    async def _leader_input(self, seq: int) -> StoredMessage | None:
        """Input ``seq`` as the INPUTS leader holds it (``STREAM.MSG.GET``), or
        ``None``: a direct get may be answered by a replica whose store lost
        messages that the stream still holds."""
        try:
            raw = await self.js.get_msg(self.subjects.inputs_stream, seq)
        except Exception:  # not there, no leader now, not allowed: not held
            return None
        if raw.seq != seq or raw.time is None:
            return None
        ts_ns = int(raw.time.timestamp()) * 1_000_000_000 + raw.time.microsecond * 1000
        headers = {str(k): str(v) for k, v in (raw.headers or {}).items()}
        return StoredMessage.of(seq, ts_ns, raw.subject or "", headers, raw.data or b"")

    async def accepted_loss(
        self, first: int, next_seq: int, may_accept: MayAccept | None = None
    ) -> tuple[InputItem, int] | None:
        """The :class:`~apportion.schemas.events.InputsLost` stored at or after
        ``next_seq`` that names exactly the inputs ``first`` .. ``next_seq - 1``
        as lost (the first one, in stream order, that ``may_accept`` allows: an
        operator's), as the history places it (input ``next_seq - 1``, at the
        gap), with the sequence it is stored at. ``None`` when there is none."""
        subject = self.subjects.input_subject(kind_of_type(InputsLost))
        seq = next_seq
        while True:
            got, _pending = await get_batch(
                self.nc, self.subjects.inputs_stream, seq, 100, subject=subject
            )
            if not got:
                return None
            for m in got:
                item = _convert_input(m)
                e = item.event
                if isinstance(e, InputsLost) and e.first == first and e.through == next_seq - 1:
                    placed = InputItem(
                        seq=e.through, at_ms=item.at_ms, ref=item.ref, event=e, subject=item.subject
                    )
                    if may_accept is None or may_accept(placed):
                        return placed, m.seq
            seq = got[-1].seq + 1

    def tail_batches(self, from_seq: int) -> DirectTail[BatchItem]:
        s = self.subjects
        return DirectTail(self.nc, s.decisions_stream, s.decisions, from_seq, _convert_batch)

    async def publish_log(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        await self.js.publish(subject, data, headers=headers, timeout=5.0)

    async def read_log(self, host: str, workload: str, attempt: int) -> attempt_logs.LogView:
        return await attempt_logs.read_log(self.nc, self.subjects.cluster, host, workload, attempt)

    @property
    def nc(self) -> Any:
        """The NATS connection under ``js`` (nats-py keeps it there)."""
        return self.js._nc

    async def input_gaps(self, timeout: float = 10.0) -> list[InputGap]:
        """Every run of sequences missing from INPUTS (read through, from 1 to its
        last sequence), each with the acceptance that bridges it, if any."""
        from apportion.core.history import bridge_refusal, fold_item
        from apportion.core.state import State

        last = await self.last_input_seq()
        tail = self.tail_inputs(1, bridge=False)
        missing: list[tuple[int, int]] = []
        expected = 1
        # who may accept a loss (an operator) is judged as the fold judges it, in the
        # state of the inputs before the gap (operators depend on inputs alone)
        inputs_only, at_gap = State(), {}
        try:
            while tail.position < last:
                items = await tail.take(10_000, timeout)
                if not items:
                    break
                for item in items:
                    if item.seq > expected:
                        missing.append((expected, item.seq - 1))
                        at_gap[expected] = inputs_only.copy()
                        inputs_only.input_seq = item.seq - 1  # read on past the gap
                    expected = item.seq + 1
                    fold_item(inputs_only, item)
        finally:
            await tail.close()
        if expected <= last:
            missing.append((expected, last))  # at the end: nothing stored after them
        lost: list[tuple[int, int]] = []
        for first, through in missing:
            # the replica that answered may have lost what the stream's leader holds
            run_start: int | None = None
            for seq in range(first, through + 1):
                if await self._leader_input(seq) is None:
                    run_start = seq if run_start is None else run_start
                elif run_start is not None:
                    lost.append((run_start, seq - 1))
                    run_start = None
            if run_start is not None:
                lost.append((run_start, through))
        out = []
        for first, through in lost:
            state = next((at_gap[k] for k in sorted(at_gap, reverse=True) if k <= first), None)

            def may_accept(item: InputItem, state: State | None = state) -> bool:
                return state is None or bridge_refusal(state, item) is None

            found = await self.accepted_loss(first, through + 1, may_accept)
            placed = found[0] if found is not None else None
            event = placed.event if placed is not None else None
            out.append(
                InputGap(
                    first=first,
                    through=through,
                    accepted_by=getattr(event, "actor", None) if event is not None else None,
                    acceptance=placed.ref if placed is not None else None,
                )
            )
        return out

    async def snapshots(self) -> JetStreamSnapshots:
        return await JetStreamSnapshots.open(self.js, self.subjects.snapshot_bucket, self.replicas)

    async def lease(self, holder: str, ttl_s: float = 3.0) -> JetStreamLease:
        return await JetStreamLease.open(
            self.js, self.subjects.lease_bucket, holder, ttl_s, self.replicas
        )


class JetStreamSnapshots:
    """Snapshots in a JetStream object store (no 1 MB message limit)."""

    def __init__(self, obs: Any, js: Any = None, bucket: str = "") -> None:
        self.obs = obs
        self.js = js
        self.bucket = bucket

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
        return cls(obs, js, bucket)

    async def save(self, name: str, data: bytes) -> None:
        await self.obs.put(name, data)

    async def delete(self, name: str) -> bool:
        """Delete the object ``name``; ``False`` if there was none."""
        from nats.js.errors import NotFoundError, ObjectNotFoundError

        try:
            await self.obs.delete(name)
        except (ObjectNotFoundError, NotFoundError):
            return False
        return True

    async def load(self, name: str, idle_timeout_s: float = 5.0) -> bytes | None:
        """The object ``name``, checked against its stored SHA-256 digest (``None``
        if there is none; :class:`SnapshotUnreadable` if its chunks are missing or
        do not match).

        The chunks are gathered by one ordered consumer and joined once (nats-py's
        ``get`` appends to a bytes object chunk by chunk: minutes for 100 MB)."""
        from nats.js.errors import NotFoundError, ObjectNotFoundError

        try:
            info = await self.obs.get_info(name)
        except (ObjectNotFoundError, NotFoundError):
            return None
        if not info.size:
            return b""
        chunks: list[bytes] = []
        arrived = asyncio.Event()
        done = asyncio.Event()

        async def cb(msg: Any) -> None:
            chunks.append(msg.data)
            arrived.set()
            if parse_ack_reply(msg.reply)[2] == 0:
                done.set()

        sub = await self.js.subscribe(
            f"$O.{self.bucket}.C.{info.nuid}",
            cb=cb,
            ordered_consumer=True,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1 << 31,
        )
        try:
            while not done.is_set():
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), idle_timeout_s)
                except TimeoutError:
                    got = sum(len(c) for c in chunks)
                    raise SnapshotUnreadable(
                        f"snapshot {name!r}: its chunks stop at {got:,} of {info.size:,} bytes"
                    ) from None
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        data = b"".join(chunks)
        stored = str(info.digest or "")
        if stored.upper().startswith("SHA-256="):
            stored = stored[len("SHA-256=") :]
        try:
            expected = base64.urlsafe_b64decode(stored)
        except ValueError:
            expected = b""
        if len(data) != info.size or hashlib.sha256(data).digest() != expected:
            raise SnapshotUnreadable(
                f"snapshot {name!r}: {len(data):,} bytes that do not match its stored digest"
            )
        return data


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


TIMEOUT_ENV = "APPORTION_TIMEOUT"
DEFAULT_TIMEOUT_S = 10.0
"""How long a client waits for NATS (or the gateway) before it gives up, unless
``$APPORTION_TIMEOUT`` (seconds) says otherwise."""


def client_timeout_s() -> float:
    """``$APPORTION_TIMEOUT`` in seconds (a positive number), else :data:`DEFAULT_TIMEOUT_S`."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: give a number of seconds") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: give a positive number of seconds")
    return value


class NatsUnreachable(ConnectionError):
    """No NATS server answered within the connect timeout (one line: where, how long, why)."""


def _share_userinfo(servers: list[str]) -> list[str]:
    """The first server's ``user:password@`` given to every other that has none
    (``nats://u:p@a:4222,b:4222`` names one user on a cluster)."""
    first = servers[0]
    scheme, sep, rest = first.partition("://")
    if not sep or "@" not in rest:
        return servers
    userinfo = rest.rsplit("@", 1)[0]
    out = [first]
    for one in servers[1:]:
        s, sep2, r = one.partition("://")
        if not sep2:
            s, r = scheme, one
        out.append(one if "@" in r else f"{s}://{userinfo}@{r}")
    return out


async def connect(
    url: str, name: str = "apportion", *, timeout_s: float | None = None, reconnect: bool = True
) -> Any:
    """A nats-py connection, made within ``timeout_s`` (default :func:`client_timeout_s`)
    or :class:`NatsUnreachable`.

    ``url`` may list several servers separated by commas (a cluster). Once
    connected, a service (``reconnect=True``) keeps reconnecting as long as it
    runs (servers may restart under it) and logs each connection error as one
    line, never a traceback; a one-shot client (``reconnect=False``) tries each
    server a few more times, quietly, and then its requests fail."""
    from urllib.parse import unquote, urlparse

    import nats
    import nats.errors

    from .natsconf import inbox_prefix

    limit = client_timeout_s() if timeout_s is None else timeout_s
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise NatsUnreachable(f"no NATS server in the URL {url!r}")
    servers = _share_userinfo(servers)
    logger = logs.get("nats", name=name)
    last: list[BaseException] = []
    connected = False

    async def on_error(exc: Exception) -> None:
        if not connected:
            last[:] = [exc]  # reported once, if the connection is never made
        elif reconnect:
            logger.warning("nats error", error=f"{type(exc).__name__}: {exc}")

    options: dict[str, Any] = {
        "name": name,
        "inbox_prefix": inbox_prefix(unquote(urlparse(servers[0]).username or "")),
        "error_cb": on_error,
        "max_reconnect_attempts": -1,  # the first connection: until the time limit
        "reconnect_time_wait": 0.5,
        "connect_timeout": min(5.0, limit),
    }
    nc = nats.NATS()
    try:
        await asyncio.wait_for(nc.connect(servers, **options), limit)
    except (TimeoutError, OSError, ValueError, nats.errors.Error) as exc:
        with contextlib.suppress(Exception):
            await nc.close()
        cause = last[0] if last else exc
        why = f"{type(cause).__name__}: {cause}".rstrip(": ").splitlines()[0]
        raise NatsUnreachable(
            f"cannot reach NATS at {url}: {why} "
            f"(gave up within {limit:g} s; {TIMEOUT_ENV}=SECONDS waits longer)"
        ) from None
    connected = True
    if not reconnect:
        nc.options["max_reconnect_attempts"] = 3
    return nc
