"""The canonical history: input 1, the batch based on 1, input 2, the batch based on 2, ...

The scheduler publishes one batch per cycle (possibly with no decisions) and
the bases of successive batches strictly increase; so an input ``k`` may be
handed on as soon as a batch with basis ``>= k`` is known: no later batch can
belong before it. Readers therefore trail the scheduler by one cycle, and wait
for it when it is down.

The items are the history items every consumer shares
(:mod:`apportion.schemas.history`); folding them is
:func:`apportion.core.history.fold_item`'s job, here as everywhere.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from apportion.core.history import (
    HistoryOrderError,
    Observer,
    bridge_refusal,
    fold_item,
    lost_range,
)
from apportion.core.state import State
from apportion.replay.eventlog import CanonicalLog, Header, LogError
from apportion.schemas.history import BatchItem, HistoryItem, InputItem

from . import logs
from .bus import EventLog, JetStreamLog, MayAccept, Tail, connect


class SkippingFold:
    """The one loop that folds history items and passes over a decision batch out
    of canonical order: the follower, the projector and the scheduler fold with it.

    A batch that :func:`~apportion.core.history.fold_item` refuses
    (:class:`~apportion.core.history.HistoryOrderError`) changes nothing: it is
    logged on ``logger`` (``skipped a decision batch out of canonical order``,
    with its ``seq`` and ``why``), counted in :attr:`skipped`, shown to
    ``on_skip`` (a metric, a position), and left out of what :meth:`fold`
    yields. An input out of order is a broken reader, not a rogue message: it
    raises."""

    def __init__(
        self, logger: Any, on_skip: Callable[[BatchItem, str], None] | None = None
    ) -> None:
        self.logger = logger
        self.on_skip = on_skip
        self.skipped = 0
        """Decision batches out of canonical order, skipped."""

    def fold(
        self, state: State, items: Iterable[HistoryItem]
    ) -> Iterator[tuple[HistoryItem, str | None]]:
        """Fold ``items`` into ``state`` in order, yielding each item right after it
        was folded (an observer sees the state with it and no later one) with the
        reason an input was refused (``None`` if it was not); skipped batches are
        not yielded."""
        for item in items:
            try:
                why = fold_item(state, item)
            except HistoryOrderError as exc:
                if not isinstance(item, BatchItem):
                    raise
                self.skip(item, str(exc))
                continue
            yield item, why

    def skip(self, item: BatchItem, why: str) -> None:
        """Pass over batch ``item`` (logged, counted, shown to ``on_skip``)."""
        self.skipped += 1
        self.logger.warning(
            "skipped a decision batch out of canonical order", seq=item.seq, why=why
        )
        if self.on_skip is not None:
            self.on_skip(item, why)


def judged_by(state: Callable[[], State | None]) -> MayAccept:
    """Which acceptance of lost inputs may bridge its gap, as the fold judges it
    (:func:`~apportion.core.history.bridge_refusal`: an operator's) in the reader's
    state at the gap, ``state()``."""

    def may_accept(item: InputItem) -> bool:
        now = state()
        return now is not None and bridge_refusal(now, item) is None

    return may_accept


class CanonicalReader:
    """Merges the two streams of ``log`` into canonical order, from a position.

    ``may_accept`` judges the acceptances of lost inputs (:func:`judged_by` the
    consumer's state): at a gap, :meth:`read` returns what it read before it, so
    that the consumer folds it before the acceptance is judged."""

    def __init__(
        self,
        log: EventLog,
        inputs_done: int = 0,
        batches_done: int = 0,
        may_accept: MayAccept | None = None,
    ) -> None:
        self._log = log
        self.skipped = 0
        """Decision batches left out: based on an input that INPUTS does not hold."""
        self.inputs_done = inputs_done
        self.batches_done = batches_done
        self._itail = log.tail_inputs(inputs_done + 1, may_accept=may_accept)
        self._btail = log.tail_batches(batches_done + 1)
        self._batches: deque[BatchItem] = deque()
        self.lost: list[tuple[int, int]] = []
        """``(first, through)`` of every accepted loss read so far: decision batches
        based on those inputs are not part of the history (left out, logged)."""
        self._left_out: list[tuple[int, int]] = []
        """For each accepted loss, the bases of batches left out: from its first lost
        input up to its record (made before the loss was known)."""
        self.dropped = 0
        """Decision batches left out: based on a lost input, or made before the loss
        was accepted on an input after it."""

    @property
    def gap(self) -> tuple[int, int] | None:
        """``(first, through)``: inputs missing from INPUTS, no loss accepted for
        them, where reading stopped (the history is not whole); else ``None``."""
        return self._itail.gap

    def _based_on_lost(self, head: BatchItem) -> bool:
        basis = head.batch.basis
        for first, until in self._left_out:
            if first <= basis <= until:
                logs.get("canonical").warning(
                    "left out a decision batch made on inputs since lost",
                    seq=head.seq,
                    basis=basis,
                    lost=[first, until],
                )
                self.dropped += 1
                return True
        return False

    async def read(self, timeout: float, limit: int = 2000) -> list[HistoryItem]:
        """The next items in canonical order (empty after ``timeout`` s with nothing new)."""
        out: list[HistoryItem] = []
        if not self._batches:
            got = await self._btail.take(limit, timeout)
            if not got:
                return out
            self._batches.extend(got)
        elif not self._btail.caught_up:
            self._batches.extend(await self._btail.take(limit, 0))
        batches = self._batches
        while batches and len(out) < limit:
            head = batches[0]
            basis = head.batch.basis
            if basis <= self.inputs_done:
                batches.popleft()
                self.batches_done = head.seq
                if not self._based_on_lost(head):
                    out.append(head)
                continue
            inputs = await self._itail.take(
                min(basis - self.inputs_done, limit - len(out)), timeout
            )
            if not inputs:
                if self._itail.caught_up and basis > await self._log.last_input_seq():
                    # the scheduler publishes a batch only after its basis is stored
                    batches.popleft()
                    self.batches_done = head.seq
                    self.skipped += 1
                    logs.get("canonical").warning(
                        "skipped a decision batch based on an input not in INPUTS",
                        seq=head.seq,
                        basis=basis,
                    )
                    continue
                break
            for item in inputs:
                lost = lost_range(item)
                if lost is not None and lost[0] == self.inputs_done + 1:
                    self.lost.append(lost)
                    stored_at = getattr(self._itail, "bridged", {}).get(item.seq, lost[1] + 1)
                    self._left_out.append((lost[0], stored_at - 1))
                self.inputs_done = item.seq
            out.extend(inputs)
            if getattr(self._itail, "before_gap", False):
                break  # the consumer folds these before the gap's acceptance is judged
        return out

    async def close(self) -> None:
        await self._itail.close()
        await self._btail.close()


class Follower:
    """A :class:`State` kept up to date from the canonical history (gateway, executor)."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.state = State()
        self.reader = CanonicalReader(log, may_accept=judged_by(lambda: self.state))
        self._fold = SkippingFold(logs.get("canonical"))

    @property
    def skipped(self) -> int:
        """Decision batches out of canonical order, skipped."""
        return self._fold.skipped

    @property
    def gap(self) -> tuple[int, int] | None:
        """Inputs missing where the view stopped (:attr:`CanonicalReader.gap`)."""
        return self.reader.gap

    async def poll(self, timeout: float, observer: Observer | None = None) -> list[HistoryItem]:
        """Fold what arrived; return it (a batch out of canonical order is skipped,
        logged and not returned). ``observer`` sees each item right after it was
        folded (the state with it and no later one) and why an input was refused."""
        out: list[HistoryItem] = []
        for item, why in self._fold.fold(self.state, await self.reader.read(timeout)):
            if observer is not None:
                observer(item, self.state, why)
            out.append(item)
        return out

    async def poll_folded(self, timeout: float) -> list[tuple[HistoryItem, str | None]]:
        """:meth:`poll`, each item with what folding it gave: the reason an input
        was refused, or ``None``."""
        return list(self._fold.fold(self.state, await self.reader.read(timeout)))

    async def close(self) -> None:
        await self.reader.close()


# --------------------------------------------------------------------------
# The whole history of a live cluster, as a log (``replay|audit --nats``)
# --------------------------------------------------------------------------


async def _read_all(
    tail: Tail[Any], n: int, timeout: float, what: str, inputs_only: State | None = None
) -> list[Any]:
    """The items of a stream tail's first ``n`` messages (a message the tail skips
    gives none), then close it. An input tail stopped at a gap (lost inputs, no
    loss accepted) ends there: what it read before the gap. ``inputs_only``: the
    inputs read are folded into it (without decisions) as they come."""
    got: list[Any] = []
    try:
        while tail.position < n:
            more = await tail.take(10_000, timeout)
            if not more and tail.gap is not None:
                break
            if not more and tail.position < n:
                raise LogError(f"{what} stopped at message {tail.position} of {n}")
            got.extend(more)
            if inputs_only is not None:
                for item in more:
                    fold_item(inputs_only, item)
    finally:
        await tail.close()
    return got


async def read_history(
    log: EventLog,
    timeout: float,
    foreign: list[str] | None = None,
    gaps: list[str] | None = None,
    missing: list[tuple[int, int]] | None = None,
) -> list[HistoryItem]:
    """Both streams of ``log``, up to their last messages now, merged in canonical order.

    A DECISIONS message that is not a decision batch, or a batch out of canonical
    order (based on an input before the last batch's, again on the same input
    without being the next part of a cycle, or on an input not in INPUTS), is left
    out and described in ``foreign``: it is not part of the history.

    Lost inputs (docs/services.md, "Lost inputs"): an accepted loss is in the
    history at its gap, and the batches based on a lost input are left out; both
    are described in ``gaps``. Inputs missing with no loss accepted end the
    history before them (described in ``gaps`` too)."""
    cluster = log.subjects.cluster
    n_batches = await log.last_batch_seq()
    n_inputs = await log.last_input_seq()
    # the acceptances of lost inputs are judged, as the fold judges them, in the state
    # of the inputs before each gap (who the operators are depends on inputs alone:
    # the root's owner and the policy)
    inputs_only = State()
    itail = log.tail_inputs(1, may_accept=judged_by(lambda: inputs_only))
    inputs: list[InputItem] = await _read_all(
        itail, n_inputs, timeout, f"nats {cluster}: INPUTS", inputs_only
    )
    batches: list[BatchItem] = await _read_all(
        log.tail_batches(1), n_batches, timeout, f"nats {cluster}: DECISIONS"
    )
    notes: list[str] = [] if foreign is None else foreign
    gap_notes: list[str] = [] if gaps is None else gaps
    lost: list[tuple[int, int]] = []
    accepted_by: list[str] = []
    previous = 0
    until: list[int] = []
    for item in inputs:
        found = lost_range(item)
        if found is not None and found[0] == previous + 1:
            lost.append(found)
            until.append(getattr(itail, "bridged", {}).get(item.seq, found[1] + 1) - 1)
            accepted_by.append(f"{getattr(item.event, 'actor', '') or '(no actor)'} ({item.ref})")
        previous = item.seq
    stopped = itail.gap
    if stopped is not None and missing is not None:
        missing.append(stopped)
    decoded = {b.seq for b in batches}
    notes += [
        f"DECISIONS message {seq}: not a decision batch"
        for seq in range(1, n_batches + 1)
        if seq not in decoded
    ]
    out: list[HistoryItem] = []
    last_input = inputs[-1].seq if inputs else 0
    ii, last_basis, continued = 0, 0, False
    left_out = [0] * (len(lost) + 1)  # per accepted loss, then after a gap not accepted
    for b in batches:
        basis = b.batch.basis
        where_lost = [i for i, (first, _) in enumerate(lost) if first <= basis <= until[i]]
        if where_lost or (stopped is not None and basis >= stopped[0]):
            left_out[where_lost[0] if where_lost else -1] += 1
            continue
        in_order = basis > last_basis or (basis == last_basis and continued and basis > 0)
        if not in_order or basis > last_input:
            where = "not in INPUTS" if basis > last_input else "out of canonical order"
            notes.append(f"DECISIONS message {b.seq}: based on input {basis}, {where}")
            continue
        while ii < len(inputs) and inputs[ii].seq <= basis:
            out.append(inputs[ii])
            ii += 1
        out.append(b)
        last_basis, continued = basis, b.batch.continued
    out.extend(inputs[ii:])
    for i, (first, through) in enumerate(lost):
        gap_notes.append(
            f"inputs {first:,}..{through:,} were lost ({through - first + 1:,} inputs), the loss "
            f"accepted by {accepted_by[i]}; {left_out[i]:,} decision batches made on them left out"
        )
    if stopped is not None:
        gap_notes.append(
            f"inputs {stopped[0]:,}..{stopped[1]:,} are missing from INPUTS and no loss was "
            f"accepted (apportion history accept-loss): the history stops at input "
            f"{stopped[0] - 1:,}; {left_out[-1]:,} decision batches after it left out"
        )
    return out


async def _read_nats(
    url: str,
    cluster: str,
    timeout: float,
    foreign: list[str],
    gaps: list[str],
    missing: list[tuple[int, int]],
) -> list[HistoryItem]:
    nc = await connect(url, name="apportion-history", reconnect=False)
    try:
        log = JetStreamLog(nc.jetstream(), cluster)
        return await read_history(log, timeout, foreign, gaps, missing)
    finally:
        await nc.close()


def read_nats(url: str, cluster: str, timeout: float = 10.0) -> CanonicalLog:
    """A live cluster's history, up to its last messages now, as a :class:`CanonicalLog`."""
    foreign: list[str] = []
    gaps: list[str] = []
    missing: list[tuple[int, int]] = []
    try:
        items = asyncio.run(_read_nats(url, cluster, timeout, foreign, gaps, missing))
    except LogError:
        raise
    except ValueError as exc:
        raise LogError(f"nats {cluster}: {exc}") from None
    except Exception as exc:  # connection refused, no such stream, ...
        first = str(exc).splitlines()[0][:200] if str(exc) else "no answer"
        raise LogError(f"nats {url} cluster {cluster}: {type(exc).__name__}: {first}") from None
    return CanonicalLog(
        Header(policy="budget", source="nats", cluster=cluster),
        items,
        f"nats:{cluster}",
        foreign=foreign,
        gaps=gaps,
        whole=not missing,
    )
