"""The canonical history: input 1, the batch based on 1, input 2, the batch based on 2, ...

The scheduler publishes one batch per cycle (possibly with no decisions) and
the bases of successive batches strictly increase; so an input ``k`` may be
handed on as soon as a batch with basis ``>= k`` is known: no later batch can
belong before it. Readers therefore trail the scheduler by one cycle, and wait
for it when it is down.

:func:`fold_input` is the one place that folds a stored input, including the
bytes that did not decode (they advance the input sequence and the clock, and
queue a rejection that the next cycle announces as ``InputRejected``).
"""

from __future__ import annotations

from collections import deque

from apportion.core.state import State, apply
from apportion.schemas.events import DecisionBatch

from .bus import EventLog, StoredBatch, StoredInput

Item = StoredInput | StoredBatch


def fold_input(state: State, item: StoredInput) -> None:
    """Fold input ``item`` (which must be input ``state.input_seq + 1``)."""
    if item.event is not None:
        apply(state, item.event)
        return
    state.input_seq += 1
    if item.at_ms > state.now_ms:
        state.now_ms = item.at_ms
    state.rejections.append((item.ref, f"malformed input: {item.error}"))


def fold_batch(state: State, batch: DecisionBatch) -> None:
    for decision in batch.decisions:
        apply(state, decision)


class CanonicalReader:
    """Merges the two streams of ``log`` into canonical order, from a position."""

    def __init__(self, log: EventLog, inputs_done: int = 0, batches_done: int = 0) -> None:
        self.inputs_done = inputs_done
        self.batches_done = batches_done
        self._itail = log.tail_inputs(inputs_done + 1)
        self._btail = log.tail_batches(batches_done + 1)
        self._batches: deque[StoredBatch] = deque()

    async def read(self, timeout: float, limit: int = 2000) -> list[Item]:
        """The next items in canonical order (empty after ``timeout`` s with nothing new)."""
        out: list[Item] = []
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
                out.append(batches.popleft())
                self.batches_done = head.seq
                continue
            got = await self._itail.take(min(basis - self.inputs_done, limit - len(out)), timeout)
            if not got:
                break
            out.extend(got)
            self.inputs_done = got[-1].seq
        return out

    async def close(self) -> None:
        await self._itail.close()
        await self._btail.close()


class Follower:
    """A :class:`State` kept up to date from the canonical history (gateway, executor)."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.state = State()
        self.reader = CanonicalReader(log)

    async def poll(self, timeout: float) -> list[Item]:
        items = await self.reader.read(timeout)
        state = self.state
        for item in items:
            if isinstance(item, StoredInput):
                fold_input(state, item)
            else:
                fold_batch(state, item.batch)
        return items

    async def close(self) -> None:
        await self.reader.close()
