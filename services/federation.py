"""Clusters joined through NATS itself: usage summaries and one budget tree (issue 29).

Each cluster keeps its own nats-server (or 3-node cluster), its own JetStream
**domain** (the cluster's name), streams and scheduler lease. Its server
joins a **hub** as a leaf node, binding its ``APPORTION`` account to the hub's
``FEDERATION`` account; the hub runs JetStream in the domain ``hub``
(:data:`HUB_DOMAIN`). Nothing but JetStream's own stream sourcing moves
messages between clusters (docs/federation.md):

| what | where it is published | how it reaches cluster ``C`` |
|---|---|---|
| cluster ``S``'s usage summaries | ``apportion.S.usage``, stream ``USAGE_S`` (domain ``S``), by ``S``'s scheduler | ``INPUTS_C`` sources ``USAGE_S`` from domain ``S``, transformed to ``apportion.C.inputs.UsageSummary.S`` |
| a budget edit, made once | ``apportion.tree.inputs.<Kind>``, stream ``TREE`` (domain ``hub``), by the tree's admin | ``INPUTS_C`` sources ``TREE`` from domain ``hub``, transformed to ``apportion.C.inputs.<Kind>.tree`` |

A source remembers the last sequence of the stream it sourced, so after a
partition (a leaf link down, a server restarted) it resumes where it left off:
nothing is lost or stored twice. The subject a summary is stored on names its
source (``...UsageSummary.<source>``) and is chosen by the *receiving*
cluster's source configuration, not by the sender; no user may publish on it.

The usage summaries themselves come from the cluster's decisions: the core
emits a ``UsageReported`` decision in its batches, and :class:`UsageForwarder`
(run beside the scheduler while it leads) publishes each one, after its batch
is stored, as a ``UsageSummary`` input on ``apportion.<C>.usage`` with
``Nats-Msg-Id = usage:<C>:<start_ms>``. It reads the batches as JSON and
passes the summary's fields on unchanged, so it needs no schema of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from apportion.core.rules.subjects import TREE_TOKEN

from . import logs
from .bus import append_only_config
from .direct import DirectGetError, get_batch

HUB_DOMAIN = "hub"
"""The JetStream domain of the hub (where ``TREE`` lives)."""
TREE_STREAM = "TREE"
TREE_PREFIX = "apportion.tree.inputs"
TREE_KINDS = ("BudgetSet", "BudgetRemoved")
"""The inputs made once for every cluster (published on the tree, sourced by each).
Not ``PolicySet``: a cluster's policy names the cluster itself (its ``cluster``
field), so each cluster's operator sets its own."""
REPORT_KIND = "UsageReported"
"""The decision a cluster's core emits with its charged usage of an interval."""
SUMMARY_KIND = "UsageSummary"
"""The input a peer folds it as."""
HDR_MSG_ID = "Nats-Msg-Id"
HDR_EXPECTED_LAST_SEQ = "Nats-Expected-Last-Sequence"
HDR_FROM = "Apportion-Decisions-Seq"
"""On a usage summary: ``<batch seq>.<index>``, the decision it was made from
(where the forwarder resumes)."""
WRONG_LAST_SEQUENCE = 10071
IDLE_S = 10.0
"""How often a forwarder whose cluster has not joined looks again, at most."""
FEDERATION_ACCOUNT = "FEDERATION"
"""The hub's account that every cluster's ``APPORTION`` joins as a leaf."""
TREE_ADMIN = "tree-admin"
"""The hub user who publishes budget edits on the tree (and creates ``TREE``)."""
TREE_GATEWAY = "gateway"
"""The hub user of the clusters' gateways (``serve gateway --hub``): it publishes
:data:`TREE_KINDS` on the tree, as each gateway's budget requests ask."""


def usage_stream(cluster: str) -> str:
    return f"USAGE_{cluster}"


def usage_subject(cluster: str) -> str:
    return f"apportion.{cluster}.usage"


def summary_subject(cluster: str, source: str) -> str:
    """Where cluster ``source``'s summaries are stored in ``cluster``'s INPUTS."""
    return f"apportion.{cluster}.inputs.{SUMMARY_KIND}.{source}"


def tree_subject(kind: str) -> str:
    return f"{TREE_PREFIX}.{kind}"


def deliver_prefix(cluster: str, source: str) -> str:
    """The deliver subject (prefix) of ``cluster``'s source of ``source`` (a peer or
    ``tree``): what crosses the leaf links, so the hub's permissions name it."""
    return f"apportion.fed.{cluster}.from.{source}"


def leaf_user(cluster: str) -> str:
    """The hub user cluster ``cluster``'s server connects its leaf link as."""
    return f"leaf-{cluster}"


def summary_id(source: str, start_ms: int) -> str:
    return f"usage:{source}:{start_ms}"


# -- the sources of a cluster's INPUTS ----------------------------------------


def usage_source(cluster: str, peer: str) -> Any:
    """``INPUTS_<cluster>``'s source of ``USAGE_<peer>`` in domain ``peer``."""
    from nats.js import api

    return api.StreamSource(
        name=usage_stream(peer),
        external=api.ExternalStream(api=f"$JS.{peer}.API", deliver=deliver_prefix(cluster, peer)),
        subject_transforms=[
            api.SubjectTransform(src=usage_subject(peer), dest=summary_subject(cluster, peer))
        ],
    )


def tree_source(cluster: str, hub_domain: str = HUB_DOMAIN) -> Any:
    """``INPUTS_<cluster>``'s source of the hub's ``TREE``: each kind onto the
    cluster's tree subject of that kind, ``apportion.<cluster>.inputs.<Kind>.tree``
    (no user may publish there; the fold takes an edit on it however late it
    arrives: a cluster cut off from the hub takes the edits made meanwhile)."""
    from nats.js import api

    return api.StreamSource(
        name=TREE_STREAM,
        external=api.ExternalStream(
            api=f"$JS.{hub_domain}.API", deliver=deliver_prefix(cluster, "tree")
        ),
        subject_transforms=[
            api.SubjectTransform(
                src=f"{TREE_PREFIX}.*",
                dest=f"apportion.{cluster}.inputs.{{{{wildcard(1)}}}}.{TREE_TOKEN}",
            )
        ],
    )


def _is_ours(source: Any) -> bool:
    """A source this module manages (a peer's usage, the tree)."""
    external = getattr(source, "external", None)
    return external is not None and (
        source.name == TREE_STREAM or str(source.name).startswith("USAGE_")
    )


def peers_of(sources: Iterable[Any]) -> list[str]:
    """The peers whose usage a list of sources brings in."""
    return sorted(
        str(s.name)[len("USAGE_") :]
        for s in sources
        if _is_ours(s) and str(s.name).startswith("USAGE_")
    )


def _inputs(cluster: str) -> str:
    return f"INPUTS_{cluster}"


async def _retrying(call: Callable[[], Any], timeout_s: float) -> Any:
    """``await call()`` until it succeeds or ``timeout_s`` passes (a stream
    electing its leader answers 503 or not at all for a moment)."""
    from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except (ServiceUnavailableError, NoStreamResponseError, TimeoutError):
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)


async def _ensure_stream(
    js: Any, name: str, subjects: list[str], replicas: int, timeout_s: float
) -> None:
    """Create stream ``name`` if it does not exist: append-only
    (:func:`~apportion.services.bus.append_only_config`), an id stored once within
    two minutes."""
    from nats.js.errors import NotFoundError

    async def make() -> None:
        try:
            await js.stream_info(name)
        except NotFoundError:
            await js.add_stream(append_only_config(name, subjects, replicas, 120.0))

    await _retrying(make, timeout_s)


async def ensure_usage_stream(
    js: Any, cluster: str, replicas: int = 1, timeout_s: float = 10.0
) -> None:
    """Create ``USAGE_<cluster>`` if it does not exist (connected as its scheduler)."""
    await _ensure_stream(js, usage_stream(cluster), [usage_subject(cluster)], replicas, timeout_s)


async def ensure_tree_stream(js: Any, replicas: int = 1, timeout_s: float = 10.0) -> None:
    """Create the hub's ``TREE`` if it does not exist (connected to the hub as
    :data:`TREE_ADMIN`)."""
    await _ensure_stream(js, TREE_STREAM, [f"{TREE_PREFIX}.*"], replicas, timeout_s)


async def set_sources(
    js: Any,
    cluster: str,
    peers: Iterable[str],
    *,
    tree: bool,
    hub_domain: str = HUB_DOMAIN,
    timeout_s: float = 10.0,
) -> list[str]:
    """Make ``INPUTS_<cluster>`` source exactly ``peers``' usage (and the tree if
    ``tree``), keeping any other source; a stream update, applied by the running
    server (no restart). A source kept keeps its position; a peer added starts at
    its first summary. Returns the stream's sources' names."""
    peers = sorted(set(peers) - {cluster})

    async def update() -> list[str]:
        info = await js.stream_info(_inputs(cluster))
        config = info.config
        current = {s.name: s for s in (config.sources or []) if _is_ours(s)}
        others = [s for s in (config.sources or []) if not _is_ours(s)]
        wanted = [current.get(usage_stream(p)) or usage_source(cluster, p) for p in peers]
        if tree:
            wanted.append(current.get(TREE_STREAM) or tree_source(cluster, hub_domain))
        sources = others + wanted
        if [s.name for s in sources] != [s.name for s in (config.sources or [])]:
            await js.update_stream(dataclasses.replace(config, sources=sources or None))
        return [s.name for s in sources]

    return list(await _retrying(update, timeout_s))


async def join(
    js: Any,
    cluster: str,
    peers: Iterable[str],
    *,
    tree: bool = True,
    hub_domain: str = HUB_DOMAIN,
    replicas: int = 1,
    timeout_s: float = 10.0,
) -> list[str]:
    """Join cluster ``cluster`` to ``peers`` (and to the tree): its own
    ``USAGE_<cluster>`` (what peers source), and its INPUTS sourcing each peer's
    usage (added to the peers it already sources). Connected as the cluster's
    scheduler (the one user with its JetStream API)."""
    if cluster == hub_domain or hub_domain in peers:
        raise ValueError(f"{hub_domain!r} is the hub's JetStream domain, not a cluster's")
    await ensure_usage_stream(js, cluster, replicas, timeout_s)
    info = await _retrying(lambda: js.stream_info(_inputs(cluster)), timeout_s)
    known = peers_of(info.config.sources or [])
    keep_tree = tree or any(s.name == TREE_STREAM for s in (info.config.sources or []))
    return await set_sources(
        js, cluster, [*known, *peers], tree=keep_tree, hub_domain=hub_domain, timeout_s=timeout_s
    )


async def leave(
    js: Any,
    cluster: str,
    peers: Iterable[str] | None = None,
    *,
    tree: bool = False,
    timeout_s: float = 10.0,
) -> list[str]:
    """Stop sourcing ``peers``' usage (every peer if ``None``), and the tree too if
    ``tree``. What was sourced stays in INPUTS (history is never rewritten);
    ``USAGE_<cluster>`` stays for peers that still source it."""
    info = await _retrying(lambda: js.stream_info(_inputs(cluster)), timeout_s)
    sources = info.config.sources or []
    known = peers_of(sources)
    gone = set(known if peers is None else peers)
    has_tree = any(s.name == TREE_STREAM for s in sources)
    return await set_sources(
        js,
        cluster,
        [p for p in known if p not in gone],
        tree=has_tree and not tree,
        timeout_s=timeout_s,
    )


@dataclasses.dataclass(frozen=True)
class SourceState:
    """What a cluster's INPUTS says of one of its federation sources."""

    name: str
    lag: int
    active_ms: int | None
    """Milliseconds since the source last heard from its stream (``None``: never)."""
    error: str | None


async def status(js: Any, cluster: str, timeout_s: float = 10.0) -> list[SourceState]:
    """The federation sources of ``INPUTS_<cluster>`` as the server reports them
    (the peers' by name, then the tree)."""
    info = await _retrying(lambda: js.stream_info(_inputs(cluster)), timeout_s)
    out = []
    for s in info.sources or []:
        if not (s.name == TREE_STREAM or str(s.name).startswith("USAGE_")):
            continue
        active = s.active if isinstance(s.active, int) and s.active >= 0 else None
        error = s.error.get("description") if isinstance(s.error, dict) else None
        out.append(
            SourceState(
                name=s.name,
                lag=int(s.lag or 0),
                active_ms=None if active is None else active // 1_000_000,
                error=error,
            )
        )
    return sorted(out, key=lambda s: (s.name == TREE_STREAM, s.name))


async def publish_tree_input(js: Any, event: Any) -> Any:
    """Publish one input (a budget edit: :data:`TREE_KINDS`) on the hub's tree,
    once: ``Nats-Msg-Id`` is its id, ``at_ms`` the time it is sent (as every
    publisher stamps it). Every joined cluster's INPUTS takes it on its own
    subject of that kind. Connected to the hub as :data:`TREE_ADMIN`."""
    from apportion.schemas.codec import encode
    from apportion.schemas.events import kind_of

    from .bus import stamped

    kind = kind_of(event)
    if kind not in TREE_KINDS:
        raise ValueError(f"{kind} is not made on the tree (only {', '.join(TREE_KINDS)})")
    return await js.publish(
        tree_subject(kind), encode(stamped(event)), headers={HDR_MSG_ID: event.id}
    )


# -- usage summaries from decision batches -----------------------------------


def summaries_of(batch: bytes, now_ms: int) -> list[tuple[str, bytes]]:
    """The ``UsageSummary`` inputs (message id, JSON bytes) made from the
    ``UsageReported`` decisions of one stored decision batch, in batch order.

    The batch is read as JSON, not through the decision schema: the summary
    takes the report's fields as they are (``cluster`` becomes ``source``), so
    this code moves them without knowing their types. ``at_ms`` is the time of
    sending, as every publisher stamps it. A batch that is not JSON has none."""
    try:
        body = msgspec.json.decode(batch)
    except msgspec.DecodeError:
        return []
    decisions = body.get("decisions") if isinstance(body, dict) else None
    out: list[tuple[str, bytes]] = []
    for d in decisions if isinstance(decisions, list) else []:
        if not isinstance(d, dict) or d.get("kind") != REPORT_KIND:
            continue
        source, start = d.get("cluster"), d.get("start_ms")
        if not isinstance(source, str) or not isinstance(start, int):
            continue
        msg_id = summary_id(source, start)
        summary = {k: v for k, v in d.items() if k not in ("kind", "id", "at_ms", "cluster")}
        summary = {"kind": SUMMARY_KIND, "id": msg_id, "at_ms": now_ms, "source": source, **summary}
        out.append((msg_id, msgspec.json.encode(summary)))
    return out


def _position(header: str | None) -> tuple[int, int]:
    """``(batch seq, index)`` of the last summary forwarded (``(0, -1)``: none)."""
    if not header:
        return 0, -1
    seq, _, index = header.partition(".")
    try:
        return int(seq), int(index or 0)
    except ValueError:
        return 0, -1


class UsageForwarder:
    """Publishes each ``UsageReported`` of the cluster's stored decision batches
    as a ``UsageSummary`` on ``apportion.<C>.usage`` (``USAGE_<C>``), in order,
    once.

    Where it is: the last message of ``USAGE_<C>`` names the decision it was
    made from (:data:`HDR_FROM`), so a forwarder started again (another process
    leading, a crash between two summaries of one batch) resumes after it. Each
    publish expects ``USAGE_<C>``'s last sequence (a second forwarder is fenced
    out, then reads where the other got to) and carries ``Nats-Msg-Id =
    usage:<C>:<start_ms>``. Between two looks it remembers the last batch it
    read, so it reads each batch once while ``USAGE_<C>`` moves only by its own
    hand. Idle while ``USAGE_<C>`` does not exist (the cluster has not joined)
    or while ``leading`` is clear. Runs with the scheduler's credential."""

    def __init__(
        self,
        nc: Any,
        cluster: str,
        *,
        leading: asyncio.Event | None = None,
        poll_s: float = 0.5,
        clock: Callable[[], int] | None = None,
        on_forward: Callable[[], object] | None = None,
    ) -> None:
        self.nc = nc
        self.on_forward = on_forward
        """Called once for each summary published (the scheduler's metrics)."""
        self.cluster = cluster
        self.leading = leading
        self.poll_s = poll_s
        self.clock = clock or (lambda: time.time_ns() // 1_000_000)
        self.forwarded = 0
        self.logger = logs.get("federation", cluster=cluster)
        self.joined = False
        """``USAGE_<C>`` was there at the last look."""
        self._usage_seq: int | None = None
        """``USAGE_<C>``'s last sequence as this forwarder left it (``None``: not known)."""
        self._done: tuple[int, int] = (0, -1)
        """The last decision forwarded: (batch sequence, index of the summary in it)."""
        self._read = 0
        """The last batch read through."""

    async def _locate(self) -> int | None:
        """``USAGE_<C>``'s last sequence (``None``: no such stream); when another
        hand moved it, where forwarding got to is read again from its last message."""
        import nats.errors

        request = json.dumps({"last_by_subj": usage_subject(self.cluster)}).encode()
        try:
            msg = await self.nc.request(
                f"$JS.API.DIRECT.GET.{usage_stream(self.cluster)}", request, timeout=5.0
            )
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return None
        headers = msg.headers or {}
        status_code = headers.get("Status")
        if status_code is not None and status_code != "404":
            return None
        last = int(headers["Nats-Sequence"]) if status_code is None else 0
        if last != self._usage_seq:
            self._done = _position(headers.get(HDR_FROM)) if last else (0, -1)
            self._read = max(self._done[0] - 1, 0)  # that batch may hold more summaries
            self._usage_seq = last
        return last

    async def forward_once(self) -> int:
        """Forward every summary not yet forwarded; returns how many were published."""
        from nats.js.errors import APIError

        last = await self._locate()
        self.joined = last is not None
        if last is None:
            return 0
        js = self.nc.jetstream(timeout=5.0)
        decisions = f"DECISIONS_{self.cluster}"
        sent = 0
        while True:
            try:
                got, pending = await get_batch(self.nc, decisions, self._read + 1, 1000)
            except DirectGetError:
                return sent
            for m in got:
                for i, (msg_id, data) in enumerate(summaries_of(m.data, self.clock())):
                    if (m.seq, i) <= self._done:
                        continue
                    try:
                        ack = await js.publish(
                            usage_subject(self.cluster),
                            data,
                            headers={
                                HDR_MSG_ID: msg_id,
                                HDR_FROM: f"{m.seq}.{i}",
                                HDR_EXPECTED_LAST_SEQ: str(self._usage_seq),
                            },
                        )
                    except APIError as exc:
                        if exc.err_code == WRONG_LAST_SEQUENCE:
                            self._usage_seq = None  # another forwarder moved on: read again
                            return sent
                        raise
                    self._usage_seq, self._done = ack.seq, (m.seq, i)
                    self.forwarded += 1
                    sent += 1
                    if self.on_forward is not None:
                        self.on_forward()
                self._read = m.seq
            if not got or not pending:
                return sent

    async def run(self, stop: asyncio.Event) -> None:
        """Forward until ``stop`` is set: every :attr:`poll_s` seconds while leading
        and joined; while ``USAGE_<C>`` is not there, asking again less and less
        often (up to every :data:`IDLE_S` seconds)."""
        wait = self.poll_s
        while not stop.is_set():
            if self.leading is None or self.leading.is_set():
                try:
                    n = await self.forward_once()
                    if n:
                        self.logger.debug("forwarded usage summaries", count=n)
                    wait = self.poll_s if self.joined else min(IDLE_S, wait * 2)
                except Exception as exc:  # a service keeps running: log one line, try again
                    self.logger.warning(
                        "cannot forward usage summaries",
                        error=f"{type(exc).__name__}: {exc}".splitlines()[0],
                    )
                    wait = min(IDLE_S, wait * 2)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await stop.wait()
