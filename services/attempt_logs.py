"""Each attempt's output on the bus: the agents ship it, readers fetch it with direct gets.

An agent writes each attempt's stdout and stderr to ``output.log`` in the
attempt's folder (docs/agent.md, "Folders and logs"). So that ``apportion
logs``, ``GET /v1/logs/{id}`` and the dashboard can show it without a shell on
the host, the agent also **ships** it to the stream ``LOGS_<c>`` (created by the
scheduler in the account ``APPORTION``, like the other streams):

- the log is cut into **regions** of :data:`CHUNK_BYTES` (64 KiB): region ``k``
  holds bytes ``k * 64 KiB`` .. ``(k + 1) * 64 KiB - 1``;
- region ``k`` of attempt ``n`` of ``workload`` on ``host`` is published on the
  slot subject ``apportion.<c>.logs.<host>.<workload>.<n>.<k mod 16>``
  (:func:`slot_subject`; ``host`` and ``workload`` as :func:`token` spells them,
  with no dots), with the header :data:`HDR_OFFSET` (its first byte's offset);
  the last one with :data:`HDR_FINAL` once the run has ended;
- the stream keeps **one message per subject** (``max_msgs_per_subject = 1``,
  discard old) for at most :data:`MAX_AGE_S` (7 days): a region is published
  again as it grows (while the run lives, at most every :data:`FLUSH_S`), and
  region ``k + 16`` replaces region ``k``. So an attempt holds at most
  :data:`SLOTS` x :data:`CHUNK_BYTES` = 1 MiB on the bus (:data:`BOUND_BYTES`):
  the **last** MiB of its output; the first bytes of a longer log are dropped,
  and readers say so.

Readers (the gateway) fetch an attempt's slots with one batched direct get
(``next_by_subj`` on ``...<n>.*``, :func:`read_log`), the service every
reader already imports, so they never need the JetStream API; the newest
region and the regions before it that join it make the log (:class:`LogView`).

Who may publish what (docs/security.md, "The bus"): the agent of ``host`` may
publish on ``apportion.<c>.logs.<host>.>`` only (an import of its own, as for
its input subjects); the gateway and the operator may read ``LOGS_<c>`` (a
direct-get import); nobody else may do either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHUNK_BYTES = 64 * 1024
"""Bytes per region (and at most per message)."""
SLOTS = 16
"""Regions kept per attempt (and host): the slot of region ``k`` is ``k % SLOTS``."""
BOUND_BYTES = CHUNK_BYTES * SLOTS
"""The most an attempt's log holds on the bus (1 MiB): its last bytes."""
MAX_AGE_S = 7 * 24 * 3600.0
"""How long a log stays on the bus (the stream's ``max_age``)."""
MAX_MSG_BYTES = 2 * CHUNK_BYTES
"""The stream's ``max_msg_size``: a region with its headers, with room to spare."""
FLUSH_S = 0.5
"""How often a live run's new output is shipped (at most)."""
RETRY_S = 5.0
"""After a failed publish (the stream missing, NATS away), the next try."""
FINAL_TRIES = 5
"""Failed tries to ship the end of a log before the agent gives up on it (logged)."""

HDR_OFFSET = "Apportion-Log-Offset"
"""The offset in ``output.log`` of the message's first byte."""
HDR_FINAL = "Apportion-Log-Final"
"""``1`` on the last region once the run has ended: nothing more will come."""


def token(name: str) -> str:
    """``name`` (a host or workload: letters, digits and ``_.:@+-``) as one subject
    token: ``%`` and ``.`` percent-encoded, so that no name spans two tokens and
    one host's subjects are never a prefix of another's."""
    return name.replace("%", "%25").replace(".", "%2E")


def stream_name(cluster: str) -> str:
    return f"LOGS_{cluster}"


def logs_prefix(cluster: str) -> str:
    return f"apportion.{cluster}.logs"


def host_subjects(cluster: str, host: str) -> str:
    """Every log subject of ``host``'s agent: what its credential may publish."""
    return f"{logs_prefix(cluster)}.{token(host)}.>"


def attempt_subjects(cluster: str, host: str, workload: str, attempt: int) -> str:
    """The slot subjects of one attempt on one host (a wildcard)."""
    return f"{logs_prefix(cluster)}.{token(host)}.{token(workload)}.{attempt}.*"


def slot_subject(cluster: str, host: str, workload: str, attempt: int, region: int) -> str:
    return f"{logs_prefix(cluster)}.{token(host)}.{token(workload)}.{attempt}.{region % SLOTS}"


def stream_config(cluster: str, replicas: int = 1) -> Any:
    """``LOGS_<c>``: one message per subject (each slot's latest), 7 days, discard old."""
    from nats.js import api

    return api.StreamConfig(
        name=stream_name(cluster),
        subjects=[f"{logs_prefix(cluster)}.>"],
        storage=api.StorageType.FILE,
        num_replicas=replicas,
        retention=api.RetentionPolicy.LIMITS,
        discard=api.DiscardPolicy.OLD,
        max_msgs_per_subject=1,
        max_age=MAX_AGE_S,
        max_msg_size=MAX_MSG_BYTES,
        allow_direct=True,  # readers use direct gets, never consumers
        deny_delete=True,
        deny_purge=True,
    )


# -- reading ---------------------------------------------------------------------


@dataclass
class LogView:
    """What the bus holds of one attempt's log on one host."""

    found: bool = False
    """Anything stored at all."""
    start: int = 0
    """Offset of the first byte held (``> 0``: the first bytes were dropped)."""
    data: bytes = b""
    final: bool = False
    """The run ended and its agent shipped the end: nothing more will come."""

    @property
    def size(self) -> int:
        """Bytes of the log as far as it was shipped."""
        return self.start + len(self.data)


Region = tuple[int, bytes, bool]
"""``(offset, bytes, final)`` of one stored region."""


def assemble(regions: list[Region]) -> LogView:
    """The newest region and the ones before it that join it, in order."""
    if not regions:
        return LogView()
    ordered = sorted(regions, key=lambda r: r[0])
    newest = ordered[-1]
    kept = [newest]
    for r in reversed(ordered[:-1]):
        if r[0] + len(r[1]) != kept[-1][0]:
            break
        kept.append(r)
    kept.reverse()
    return LogView(found=True, start=kept[0][0], data=b"".join(r[1] for r in kept), final=newest[2])


async def read_log(nc: Any, cluster: str, host: str, workload: str, attempt: int) -> LogView:
    """The log of ``attempt`` of ``workload`` on ``host`` as ``LOGS_<c>`` holds it: one
    batched direct get of its slots (``DirectGetError`` if refused)."""
    from .direct import get_batch

    got, _ = await get_batch(
        nc,
        stream_name(cluster),
        1,
        SLOTS + 1,
        subject=attempt_subjects(cluster, host, workload, attempt),
    )
    regions: list[Region] = []
    for m in got:
        try:
            offset = int(m.headers.get(HDR_OFFSET, ""))
        except ValueError:
            continue
        regions.append((offset, bytes(m.data), m.headers.get(HDR_FINAL) == "1"))
    return assemble(regions)


# -- shipping (the agent) ----------------------------------------------------------

Publish = Callable[[str, bytes, dict[str, str]], Awaitable[None]]
"""``publish(subject, data, headers)``, acknowledged by the stream."""


@dataclass
class Shipper:
    """Ships one attempt's ``output.log`` (see the module doc)."""

    path: Path
    subject: Callable[[int], str]
    """Region -> its slot subject."""
    sent: int = 0
    """Bytes shipped so far."""
    final_sent: bool = False
    next_try: float = 0.0
    """Monotonic time before which nothing is shipped (a flush interval, a retry)."""
    failures: int = 0
    warned: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def due(self, final: bool, now: float) -> bool:
        if self.final_sent:
            return False
        if final:
            return now >= self.next_try or self.failures == 0
        return now >= self.next_try

    async def ship(self, publish: Publish, final: bool) -> int:
        """Publish the regions that changed since the last call (only the last
        :data:`SLOTS`: earlier ones would be replaced at once); with ``final``, the
        last one carries :data:`HDR_FINAL`. Returns the messages published."""
        try:
            size = os.path.getsize(self.path)
        except OSError:
            size = 0
        if size < self.sent:  # the file was replaced: ship it again
            self.sent = 0
        if size == self.sent and not final and self.sent > 0:
            return 0
        if size == 0 and not final:
            return 0
        last = max(0, (size - 1) // CHUNK_BYTES)
        first = min(self.sent // CHUNK_BYTES, last)
        first = max(first, last - SLOTS + 1)
        n = 0
        with contextlib.ExitStack() as stack:
            f = stack.enter_context(open(self.path, "rb")) if size else None
            for k in range(first, last + 1):
                start = k * CHUNK_BYTES
                length = min(size, start + CHUNK_BYTES) - start
                data = b""
                if f is not None and length > 0:
                    f.seek(start)
                    data = f.read(length)
                headers = {HDR_OFFSET: str(start)}
                if final and k == last:
                    headers[HDR_FINAL] = "1"
                await publish(self.subject(k), data, headers)
                n += 1
        self.sent = size
        if final:
            self.final_sent = True
        return n


async def ship_due(
    shipper: Shipper, publish: Publish, final: bool, logger: Any, what: dict[str, Any]
) -> None:
    """Ship what is due of ``shipper``'s log, bounded in time; a failure is logged
    (once until it works again) and tried again after :data:`RETRY_S`; the end of
    a log is given up after :data:`FINAL_TRIES` failures."""
    now = time.monotonic()
    if not shipper.due(final, now):
        return
    try:
        await asyncio.wait_for(shipper.ship(publish, final), 10.0)
    except Exception as exc:
        shipper.failures += 1
        shipper.next_try = now + RETRY_S
        if not shipper.warned:
            shipper.warned = True
            logger.warning(
                "could not ship the log to the bus; retrying",
                error=f"{type(exc).__name__}: {exc}".rstrip(": ").splitlines()[0],
                **what,
            )
        if final and shipper.failures >= FINAL_TRIES:
            shipper.final_sent = True
            logger.warning("gave up shipping the end of the log", **what)
        return
    shipper.failures = 0
    shipper.warned = False
    shipper.next_try = now + FLUSH_S


# -- answering (the gateway: GET /v1/logs/{id}, apportion logs, the dashboard) ------


class LogQueryError(ValueError):
    """A query of a log that names no attempt or host of the workload (one line)."""


MAX_OFFSET = 2**53
_DIGITS = re.compile(r"^[0-9]{1,16}\Z")
NO_EXECUTOR_LOG = (
    "no agent reported starting attempt {n} on {node}: nothing was shipped "
    "(the executor emulator, and an executor without host agents, write no logs)"
)


def pick(job: dict[str, Any], attempt: int | None, node: str | None) -> tuple[dict[str, Any], str]:
    """The attempt (default: the last) and host (default: the first whose agent
    started it, else the placement's first) of ``job`` (:func:`job_history.job_json`)."""
    attempts = job["attempts"]
    if not attempts:
        raise LogQueryError(
            f"{job['workload']} was never placed ({job['status']}): no attempt, no log"
        )
    if attempt is None:
        a = attempts[-1]
    else:
        found = [a for a in attempts if a["attempt"] == attempt]
        if not found:
            numbers = ", ".join(str(a["attempt"]) for a in attempts)
            raise LogQueryError(f"{job['workload']} has no attempt {attempt} (it has {numbers})")
        a = found[0]
    hosts = [g["node"] for g in a["logs"]]
    if node is None:
        started = [g["node"] for g in a["logs"] if g["started_ms"] is not None]
        node = (started or hosts)[0]
    elif node not in hosts:
        raise LogQueryError(
            f"attempt {a['attempt']} of {job['workload']} did not run on {node!r} "
            f"(it ran on {', '.join(hosts)})"
        )
    return a, node


def _utf8_whole(data: bytes) -> int:
    """The length of ``data`` without an incomplete UTF-8 sequence at its end."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back
            continue
        if b & 0x80 == 0:
            return len(data)
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4
        return len(data) if back >= need else len(data) - back
    return len(data)


def answer(
    job: dict[str, Any], a: dict[str, Any], node: str, offset: int, view: LogView | None
) -> dict[str, Any]:
    """``GET /v1/logs/{id}``'s body (docs/formats.md, "Logs"): the log of attempt
    ``a`` on ``node`` from byte ``offset`` on, as far as the bus holds it
    (``view``; ``None``: no agent started it there, so nothing was shipped)."""
    ended = a["end_ms"] is not None
    out: dict[str, Any] = {
        "workload": job["workload"],
        "status": job["status"],
        "attempt": a["attempt"],
        "attempts": [x["attempt"] for x in job["attempts"]],
        "node": node,
        "nodes": [g["node"] for g in a["logs"]],
        "attempt_ended": ended,
        "bound_bytes": BOUND_BYTES,
        "from": offset,
        "start": 0,
        "size": 0,
        "dropped": 0,
        "next": offset,
        "text": "",
        "complete": False,
        "shipped": False,
        "note": None,
    }
    started = {g["node"]: g["started_ms"] for g in a["logs"]}
    if view is None:
        out["note"] = NO_EXECUTOR_LOG.format(n=a["attempt"], node=node)
        out["complete"] = ended  # nothing will come
        return out
    data = view.data[max(0, offset - view.start) :]
    if not view.final:
        data = data[: _utf8_whole(data)]
    out.update(
        start=view.start,
        size=view.size,
        dropped=max(0, view.start - offset),
        next=max(offset, view.start) + len(data) if offset <= view.size else offset,
        text=data.decode("utf-8", "replace"),
        complete=view.final,
        shipped=view.found,
    )
    if view.start > 0:
        out["note"] = (
            f"first {view.start:,} bytes dropped: over the {BOUND_BYTES // 1024 // 1024} MiB "
            "bound (the bus keeps the last MiB of each attempt's log; the host's output.log "
            "has it all)"
        )
    elif not view.found:
        out["note"] = (
            "nothing shipped yet"
            if not ended
            else "no log on the bus: nothing was shipped, or it is over 7 days old"
        )
    if not view.found and started.get(node) is None:
        out["note"] = NO_EXECUTOR_LOG.format(n=a["attempt"], node=node)
        out["complete"] = ended  # nothing will come
    return out


def parse_query(query: Any) -> tuple[int | None, str | None, int]:
    """``attempt``, ``node`` and ``from`` of a logs query (:class:`LogQueryError`;
    any other parameter too)."""
    other = sorted(set(query) - {"attempt", "node", "from"})
    if other:
        raise LogQueryError(f"unknown parameter {other[0][:40]!r} (attempt, node, from)")
    attempt: int | None = None
    text = query.get("attempt")
    if text is not None:
        if not _DIGITS.match(text) or not 0 < int(text) < MAX_OFFSET:
            raise LogQueryError(f"attempt={text[:40]!r}: give a positive whole number")
        attempt = int(text)
    node = query.get("node")
    if node is not None and (not node or len(node) > 128):
        raise LogQueryError("node: give a host name (1 to 128 characters)")
    offset = 0
    text = query.get("from")
    if text is not None:
        if not _DIGITS.match(text) or int(text) >= MAX_OFFSET:
            raise LogQueryError(f"from={text[:40]!r}: give a byte offset (a whole number >= 0)")
        offset = int(text)
    return attempt, node, offset
