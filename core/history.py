"""One fold for the whole canonical history, and one cycle step.

Every consumer of history - the scheduler, the followers (gateway, executor),
the projector, the simulator, ``audit``, ``whatif`` and ``replay`` - is the
same loop::

    for item in source:
        rejected = fold_item(state, item)
        observer(item, state, rejected)

:func:`fold_item` is the only place that folds a history item: an input (a
decoded event, or bytes that did not decode, which are recorded as a rejected
input) or a decision batch. It checks canonical order: input ``k`` must follow
input ``k - 1`` and a batch must be based on the last input folded; anything
else raises :class:`HistoryOrderError` and changes nothing.

:func:`decide_batch` is the only place that turns a state into the decision
batch of a cycle (the scheduler publishes it before folding it back; the
simulator folds it at once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from apportion.schemas.events import DecisionBatch
from apportion.schemas.history import HistoryItem, InputItem

from .cycle import CycleResult, decide
from .state import CorruptHistory, State, apply

Decider = Callable[[State], CycleResult]


class HistoryOrderError(CorruptHistory):
    """An item that is not the next one in canonical order (a gap, a repeat, a
    batch before the input it is based on)."""


class Observer(Protocol):
    """Sees each item right after it was folded: ``state`` includes it, and
    ``rejected`` is the reason an input changed nothing (else ``None``)."""

    def __call__(self, item: HistoryItem, state: State, rejected: str | None, /) -> None: ...


def fold_item(state: State, item: HistoryItem) -> str | None:
    """Fold ``item`` into ``state`` (in place); return why an input was rejected, if it was."""
    if isinstance(item, InputItem):
        if item.seq != state.input_seq + 1:
            raise HistoryOrderError(
                f"input {item.seq} arrived after input {state.input_seq}: "
                "a gap or a repeat in the history"
            )
        rejections = state.rejections
        before = len(rejections)
        if item.event is not None:
            apply(state, item.event)
        else:
            # bytes that did not decode: the clock and the sequence move, nothing else
            state.input_seq += 1
            if item.at_ms > state.now_ms:
                state.now_ms = item.at_ms
            rejections.append((item.ref, item.rejection or "malformed input"))
        return rejections[-1][1] if len(rejections) > before else None
    basis = item.batch.basis
    if basis != state.input_seq:
        raise HistoryOrderError(
            f"decisions based on input {basis} arrived when input {state.input_seq} "
            "was the last one folded"
        )
    for decision in item.batch.decisions:
        apply(state, decision)
    return None


def decide_batch(state: State, decider: Decider = decide) -> tuple[DecisionBatch, CycleResult]:
    """The decision batch of one cycle at ``state``, based on its last input; ``state`` is unchanged."""
    result = decider(state)
    batch = DecisionBatch(
        basis=state.input_seq, decisions=result.decisions, next_wakeup_ms=result.next_wakeup_ms
    )
    return batch, result


def fold_history(
    items: Iterable[HistoryItem],
    state: State | None = None,
    observer: Observer | None = None,
) -> State:
    """Fold ``items`` in order into ``state`` (a new one by default), showing each to ``observer``."""
    state = State() if state is None else state
    if observer is None:
        for item in items:
            fold_item(state, item)
    else:
        for item in items:
            observer(item, state, fold_item(state, item))
    return state


def observe_all(*observers: Observer | None) -> Observer | None:
    """One observer that shows each item to every given one, in order (``None``s dropped)."""
    live = [o for o in observers if o is not None]
    if not live:
        return None
    if len(live) == 1:
        return live[0]

    def each(item: HistoryItem, state: State, rejected: str | None) -> None:
        for o in live:
            o(item, state, rejected)

    return each
