"""Reading a stream without a consumer: batched direct gets.

A reader that may create JetStream consumers may also choose a consumer's
*deliver subject*, and the server then publishes the stream's messages there:
with the DECISIONS subject as the deliver subject, any reader could write into
the decisions log. So no role but the scheduler has consumer permissions
(docs/security.md); every reader reads with **batched direct gets** instead
(``$JS.API.DIRECT.GET.<stream>`` with ``{"seq": N, "batch": K}``; the stream has
``allow_direct``): the server answers with up to ``K`` stored messages from
sequence ``N`` on, then an end-of-batch status (``204 EOB``, with the number of
messages still pending), or ``404`` when nothing is stored from ``N`` on.

Waiting for new messages: a plain subscription on the stream's subjects wakes
the reader (subscribing reads, it cannot write). The wake-up can come before
the stream has stored the message, so a wake-up that finds nothing asks again
after 1, 2, 4, ... ms (up to :data:`RETRY_S` in all); a poll every
:data:`POLL_S` covers a wake-up that was missed.

A stream with no leader for a moment (a cluster electing one after its
leader died) answers ``503`` (no responders), or not at all: the reader waits
and asks again, within the caller's timeout, instead of failing; any other
status is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

T = TypeVar("T")

BATCH = 1000
"""Messages per direct-get request."""
POLL_S = 0.25
"""How often a waiting reader asks again even without a wake-up."""
RETRY_S = 0.1
"""How long a reader woken by a new message keeps asking for it before waiting again."""
REQUEST_TIMEOUT_S = 5.0
"""How long one batch may take to arrive (then the reader asks again)."""
MAX_SILENT_REQUESTS = 6
"""Requests in a row with no answer at all before the reader raises (about 30 s:
longer than a cluster's leader election, short enough to surface a refused
permission)."""


class DirectGetError(Exception):
    """The server refused a direct get (no permission, no such stream, no ``allow_direct``)."""


class DirectGetUnavailable(DirectGetError):
    """The stream answered ``503``: it has no leader now (a cluster electing one)."""


def stamp_ns(value: str) -> int:
    """``Nats-Time-Stamp`` (RFC 3339, UTC, up to nanoseconds) as epoch nanoseconds."""
    date, _, frac = value.rstrip("Z").partition(".")
    whole = datetime.fromisoformat(date).replace(tzinfo=UTC)
    ns = int((frac + "000000000")[:9]) if frac else 0
    return int(whole.timestamp()) * 1_000_000_000 + ns


class StoredMessage:
    """One message as a direct get returns it: its stream sequence, store time,
    subject, the publisher's headers and its bytes."""

    __slots__ = ("seq", "ts_ns", "subject", "headers", "data")

    @classmethod
    def of(cls, seq: int, ts_ns: int, subject: str, headers: dict[str, str], data: bytes) -> Any:
        """A message read another way (the stream leader's ``STREAM.MSG.GET``)."""
        m = cls.__new__(cls)
        m.seq, m.ts_ns, m.subject, m.headers, m.data = seq, ts_ns, subject, headers, data
        return m

    def __init__(self, msg: Any) -> None:
        h = msg.headers or {}
        self.seq = int(h["Nats-Sequence"])
        self.ts_ns = stamp_ns(h["Nats-Time-Stamp"])
        self.subject: str = h.get("Nats-Subject", "")
        self.headers: dict[str, str] = h
        self.data: bytes = msg.data


async def get_batch(
    nc: Any, stream: str, from_seq: int, batch: int, subject: str | None = None
) -> tuple[list[StoredMessage], int]:
    """Up to ``batch`` stored messages of ``stream`` from ``from_seq`` on (only those
    on ``subject`` when it is given), and how many are stored after the last one
    returned."""
    got: list[Any] = []
    end: list[Any] = []
    done = asyncio.Event()

    async def collect(msg: Any) -> None:
        if (msg.headers or {}).get("Status") is None:
            got.append(msg)
        else:
            end.append(msg)
            done.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=collect)
    try:
        ask: dict[str, Any] = {"seq": max(1, from_seq), "batch": batch}
        if subject is not None:
            ask["next_by_subj"] = subject
        request = json.dumps(ask).encode()
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}", request, reply=inbox)
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            await done.wait()
    finally:
        with contextlib.suppress(Exception):  # the connection may be gone already
            await sub.unsubscribe()
    headers = end[0].headers
    status = headers.get("Status")
    out = [StoredMessage(m) for m in got]
    if status == "204":  # end of batch
        return out, int(headers.get("Nats-Num-Pending", "0"))
    if status == "404":  # nothing stored from from_seq on
        return out, 0
    detail = headers.get("Description", "")
    error = DirectGetUnavailable if status == "503" else DirectGetError
    raise error(f"direct get on {stream}: {status} {detail}".strip())


async def last_sequence(
    nc: Any, stream: str, subjects: str, timeout_s: float = REQUEST_TIMEOUT_S
) -> int:
    """The sequence of the last message ``stream`` stores on ``subjects`` (a
    wildcard may be used), ``0`` if none: a direct get of ``last_by_subj``.

    Readers ask this instead of ``$JS.API.STREAM.INFO``: the JetStream API
    answers only inside the account that holds the streams, while a direct get
    is a service other accounts import (docs/security.md, "The bus")."""
    from nats.js.errors import APIError, ServiceUnavailableError

    request = json.dumps({"last_by_subj": subjects}).encode()
    # no responders (no such stream, or a cluster electing its leader) raises
    # nats' own NoRespondersError, a transient error to the services
    msg = await nc.request(f"$JS.API.DIRECT.GET.{stream}", request, timeout=timeout_s)
    headers = msg.headers or {}
    status = headers.get("Status")
    if status is None:
        return int(headers["Nats-Sequence"])
    if status == "404":
        return 0
    detail = f"direct get on {stream}: {headers.get('Description', '')}".strip()
    if status == "503":  # as stream info answered while the stream had no leader
        raise ServiceUnavailableError(code=503, description=detail)
    raise APIError(code=int(status) if status.isdigit() else None, description=detail)


Bridge = Callable[[int, int], Awaitable[Any]]
"""``bridge(first, next_seq)``: ``(item, stored_at)``, the item that stands for the
missing messages ``first`` .. ``next_seq - 1`` (an accepted loss) and the sequence
of the message it comes from, or ``None`` while there is none."""

GAP_POLL_S = 1.0
"""How often a reader stopped at a gap asks again whether the loss was accepted."""


class DirectTail(Generic[T]):
    """A :class:`~apportion.services.bus.Tail` over ``stream`` from ``from_seq``,
    by batched direct gets; ``convert`` turns a :class:`StoredMessage` into an item,
    or ``None`` for a message to skip (it logs why).

    With ``bridge``, the tail checks that sequences follow one another: at a gap
    (messages the store lost) it hands on what ``bridge`` gives for it (the
    record that the loss was accepted, placed at the gap) and goes on after the
    gap; while ``bridge`` gives nothing it stops there, says so in :attr:`gap`
    (logged once per gap) and asks again every :data:`GAP_POLL_S`."""

    def __init__(
        self,
        nc: Any,
        stream: str,
        wake_subject: str,
        from_seq: int,
        convert: Callable[[StoredMessage], T | None],
        bridge: Bridge | None = None,
        logger: Any = None,
        leader_get: Callable[[int], Awaitable[StoredMessage | None]] | None = None,
    ) -> None:
        self._nc = nc
        self._stream = stream
        self._wake_subject = wake_subject
        self._from = max(1, from_seq)
        self._convert = convert
        self._buf: list[StoredMessage] = []
        self._pending = 1
        self._woken = asyncio.Event()
        self._sub: Any = None
        self._lock = asyncio.Lock()
        self._timeouts = 0  # requests in a row that got no answer at all
        self._bridge = bridge
        self._leader_get = leader_get
        self._logger = logger
        self._gap: tuple[int, int] | None = None
        self.bridged: dict[int, int] = {}
        """For each gap passed over: the sequence of the item placed there -> the
        stream sequence where the record that bridged it is stored."""

    @property
    def caught_up(self) -> bool:
        return not self._buf and self._pending == 0 and self._gap is None

    @property
    def gap(self) -> tuple[int, int] | None:
        """``(first, through)``: the missing messages this tail stopped at (no loss
        accepted for them yet), or ``None``."""
        return self._gap

    async def _at_gap(self, deadline: float) -> T | None:
        """The buffer starts after a gap: the item that bridges it, or ``None``
        (then :attr:`gap` says where, and the call waited a while)."""
        assert self._bridge is not None
        first, next_seq = self._from, self._buf[0].seq
        found = await self._bridge(first, next_seq)
        if found is not None:
            placed, stored_at = found
            self.bridged[placed.seq] = stored_at
            if self._logger is not None:
                self._logger.warning(
                    "lost messages accepted; going on after them",
                    stream=self._stream,
                    first=first,
                    through=next_seq - 1,
                )
            self._gap = None
            self._from = next_seq
            return placed
        if self._gap != (first, next_seq - 1):
            self._gap = (first, next_seq - 1)
            if self._logger is not None:
                self._logger.error(
                    "messages missing from the stream: the history is not whole; "
                    "stopped before them until the loss is accepted "
                    "(apportion history accept-loss)",
                    stream=self._stream,
                    first=first,
                    through=next_seq - 1,
                    missing=next_seq - first,
                )
        left = deadline - asyncio.get_running_loop().time()
        if left > 0:
            await asyncio.sleep(min(left, GAP_POLL_S))
        return None

    @property
    def position(self) -> int:
        return self._from - 1

    @property
    def before_gap(self) -> bool:
        """The next message read is past a gap: the next :meth:`take` asks the bridge
        (a reader that judges the bridge by its state folds what it has first)."""
        return self._bridge is not None and bool(self._buf) and self._buf[0].seq > self._from

    async def _fill(self, want: int) -> None:
        if self._sub is None:

            async def wake(_msg: Any) -> None:
                self._woken.set()

            self._sub = await self._nc.subscribe(self._wake_subject, cb=wake)
        self._woken.clear()
        got, pending = await get_batch(self._nc, self._stream, self._from, min(BATCH, max(1, want)))
        self._buf.extend(got)
        self._pending = pending

    async def take(self, max_n: int, timeout: float) -> list[T]:
        async with self._lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            retry = 0.0  # > 0: woken, the message may not be stored yet
            unavailable = 0.0  # > 0: the stream had no leader; wait before asking again
            while True:
                if not self._buf:
                    try:
                        await self._fill(max_n)
                        unavailable = 0.0
                        self._timeouts = 0
                    except (DirectGetUnavailable, TimeoutError) as exc:
                        if isinstance(exc, TimeoutError):
                            # no answer at all: a leader change, or a permission the
                            # server refuses silently; the latter must surface
                            self._timeouts += 1
                            if self._timeouts > MAX_SILENT_REQUESTS:
                                raise DirectGetError(
                                    f"direct get on {self._stream}: no answer to "
                                    f"{self._timeouts} requests in a row (permissions?)"
                                ) from exc
                        unavailable = min(max(2 * unavailable, 0.05), 1.0)
                        left = deadline - loop.time()
                        if left <= 0:
                            return []
                        await asyncio.sleep(min(unavailable, left))
                        continue
                if self._buf:
                    break
                left = deadline - loop.time()
                if left <= 0:
                    return []
                if 0 < retry <= RETRY_S:
                    await asyncio.sleep(min(retry, left))
                    retry *= 2
                    continue
                retry = 0.0
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                # cancellation that arrives as the event fires, and the reader would
                # not stop
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, POLL_S)):
                        await self._woken.wait()
                    retry = 0.001
            out: list[T] = []
            buf = self._buf
            if self._bridge is not None and buf[0].seq > self._from:
                # a replica that answered may have lost what the stream holds: ask its leader
                held = await self._leader_get(self._from) if self._leader_get else None
                if held is not None and held.seq == self._from:
                    buf.insert(0, held)
                else:
                    placed = await self._at_gap(deadline)
                    if placed is None:
                        return out
                    out.append(placed)
            n = 0
            while n < len(buf) and len(out) < max_n:
                m = buf[n]
                if self._bridge is not None and m.seq != self._from:
                    break  # a gap: the next call hands on what bridges it
                n += 1
                self._from = m.seq + 1
                item = self._convert(m)
                if item is not None:
                    out.append(item)
            del buf[:n]
            return out

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
