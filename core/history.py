"""One fold for the whole canonical history, and one cycle step.

Every consumer of history - the scheduler, the followers (gateway, executor),
the projector, the simulator, ``audit``, ``whatif`` and ``replay`` - is the
same loop::

    for item in source:
        rejected = fold_item(state, item)
        observer(item, state, rejected)

:func:`fold_item` is the only place that folds a history item: an input (a
decoded event, or bytes that did not decode, which are recorded as a rejected
input) or a decision batch. An input stored on a subject is checked against
it first (:mod:`apportion.core.rules.subjects`: the kind its subject names,
and a host agent's own host and identity). It checks canonical order: input ``k`` must follow
input ``k - 1`` and a batch must be based on the last input folded; anything
else raises :class:`HistoryOrderError` and changes nothing.

:func:`decide_batch` is the only place that turns a state into the decision
batch of a cycle (the scheduler publishes it before folding it back; the
simulator folds it at once).

A cycle's batch that would not fit in one message is published as several
**parts** (:func:`split_batch`): consecutive batches with the cycle's basis,
each saying how many decisions the history held before it
(``decisions_before``) and whether another part follows (``more``). Folding
the parts in order is folding the cycle's batch; :func:`fold_item` refuses a
part anywhere but right after the decisions before it. The cut depends only on
the batch and the byte limit; the audit does not need the limit: it cuts the
batch it recomputes where the recorded parts were cut (:func:`batch_part`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from apportion.schemas.bounds import clip_reason
from apportion.schemas.codec import encode
from apportion.schemas.events import DecisionBatch, InputsLost, kind_of
from apportion.schemas.history import HistoryItem, InputItem
from apportion.schemas.reasons import MALFORMED, Refusal
from msgspec import UNSET

from .cycle import CycleResult, decide
from .fold import apply, refuse
from .refusals import loss_refusal
from .rules.identity import identity_refusal, remember
from .rules.subjects import (
    as_agent,
    as_federation,
    host_refusal,
    subject_host,
    subject_refusal,
    subject_source,
)
from .state import CorruptHistory, State

Decider = Callable[[State], CycleResult]

BUDGET_LOGIC = "budget/2"
"""The version of the budget scheduler's decision logic that every batch it makes
records (:attr:`DecisionBatch.logic`). Bump the number in the same commit as any
change that makes the same history give different decisions (the golden logs
change with it), so that an audit of an older log names the version that made it."""


class HistoryOrderError(CorruptHistory):
    """An item that is not the next one in canonical order (a gap, a repeat, a
    batch before the input it is based on, a part of a cycle out of place)."""


class LossNotAccepted(HistoryOrderError):
    """An :class:`~apportion.schemas.events.InputsLost` placed at a gap that may not
    bridge it (:func:`bridge_refusal`): the history stays stopped at the gap, as if
    no loss had been accepted. ``refusal`` says why (its reason code)."""

    def __init__(self, message: str, refusal: Refusal) -> None:
        super().__init__(message)
        self.refusal = refusal


class Observer(Protocol):
    """Sees each item right after it was folded: ``state`` includes it, and
    ``rejected`` is the reason an input changed nothing (else ``None``)."""

    def __call__(self, item: HistoryItem, state: State, rejected: str | None, /) -> None: ...


def bridges_gap(input_seq: int, item: InputItem) -> bool:
    """``item`` is an :class:`~apportion.schemas.events.InputsLost` placed at the gap
    right after input ``input_seq``: it names the inputs ``input_seq + 1`` ..
    ``item.seq`` as lost (readers hand it on as input ``through``)."""
    e = item.event
    return (
        isinstance(e, InputsLost)
        and e.first == input_seq + 1
        and e.through == item.seq
        and e.first <= e.through
    )


def bridge_refusal(state: State, item: InputItem) -> Refusal | None:
    """Why the loss ``item`` (an :class:`~apportion.schemas.events.InputsLost`) may not
    bridge its gap in ``state`` (the state right before the gap), or ``None``: it
    must be stored on its own kind's subject (when the subject is known) and its
    actor must be an operator (:func:`~apportion.core.refusals.loss_refusal`), as
    at its own position. Readers ask this to choose the acceptance they hand on
    (the first one that may bridge); :func:`fold_item` refuses any other."""
    e = item.event
    if not isinstance(e, InputsLost):
        return None
    if item.subject is not None:  # its kind's subject, never a host agent's
        refusal = subject_refusal(item.subject, kind_of(e))
        if refusal is not None:
            return refusal
    return loss_refusal(state, e)


def lost_range(item: HistoryItem) -> tuple[int, int] | None:
    """``(first, through)`` when ``item`` is a loss placed at its gap (else ``None``)."""
    if isinstance(item, InputItem):
        e = item.event
        if isinstance(e, InputsLost) and e.through == item.seq and e.first <= e.through:
            return e.first, e.through
    return None


def fold_item(state: State, item: HistoryItem) -> str | None:
    """Fold ``item`` into ``state`` (in place); return why an input was rejected, if it was.

    An :class:`~apportion.schemas.events.InputsLost` placed at a gap
    (:func:`bridges_gap`) moves the input sequence over the lost inputs and
    changes nothing else (the clock included); one that may not
    (:func:`bridge_refusal`: not an operator's) raises :class:`LossNotAccepted`
    and changes nothing."""
    if isinstance(item, InputItem):
        if bridges_gap(state.input_seq, item):
            refusal = bridge_refusal(state, item)
            if refusal is not None:
                raise LossNotAccepted(
                    f"the loss of inputs {state.input_seq + 1} to {item.seq} recorded by "
                    f"{item.ref!r} may not bridge the gap ({refusal.code}: {refusal.message})",
                    refusal,
                )
            state.input_seq = item.seq
            return None
        if item.seq != state.input_seq + 1:
            raise HistoryOrderError(
                f"input {item.seq} arrived after input {state.input_seq}: "
                "a gap or a repeat in the history"
            )
        rejections = state.rejections
        before = len(rejections)
        event = item.event
        if event is not None:
            refusal = None
            subject = item.subject
            if subject is not None:  # None: simulations, older files
                refusal = subject_refusal(subject, kind_of(event))
                host = subject_host(subject) if refusal is None else None
                if host is not None:
                    event = as_agent(event, host)  # the actor is the subject's host's agent
                    refusal = host_refusal(state, host, event)
                source = subject_source(subject) if refusal is None else None
                if source is not None:  # the actor is the source cluster's
                    event, refusal = as_federation(event, source)
            if refusal is None:
                refusal = identity_refusal(state, item)  # folded once (rules/identity.py)
                if refusal is None:
                    remember(state, item)
            if refusal is None:
                apply(state, event)
            else:
                refuse(state, event, refusal)
        else:
            # bytes that did not decode: the clock and the sequence move, nothing else
            state.input_seq += 1
            if item.at_ms > state.now_ms:
                state.now_ms = item.at_ms
            reason = clip_reason(item.rejection or "malformed input")
            rejections.append((item.ref, reason, MALFORMED))
        return rejections[-1][1] if len(rejections) > before else None
    batch = item.batch
    basis = batch.basis
    if basis != state.input_seq:
        raise HistoryOrderError(
            f"decisions based on input {basis} arrived when input {state.input_seq} "
            "was the last one folded"
        )
    after = batch.decisions_before
    if isinstance(after, int) and after != state.decisions_folded:
        raise HistoryOrderError(
            f"a part of the cycle based on input {basis} belongs after decision {after}, "
            f"but {state.decisions_folded} decisions were folded: a part repeated, missing "
            "or out of order"
        )
    for decision in batch.decisions:
        apply(state, decision)
    return None


def decide_batch(
    state: State, decider: Decider = decide, logic: str = BUDGET_LOGIC
) -> tuple[DecisionBatch, CycleResult]:
    """The decision batch of one cycle at ``state``, based on its last input, made by
    ``decider`` whose version is ``logic``; ``state`` is unchanged."""
    result = decider(state)
    batch = DecisionBatch(
        basis=state.input_seq,
        decisions=result.decisions,
        next_wakeup_ms=result.next_wakeup_ms,
        logic=logic,
    )
    return batch, result


def batch_part(cycle: DecisionBatch, start: int, stop: int, decisions_before: int) -> DecisionBatch:
    """The part of the cycle's batch ``cycle`` that holds its decisions ``start:stop``,
    in a history that held ``decisions_before`` decisions when the cycle began.

    The last part (``stop`` at the end) carries the cycle's ``next_wakeup_ms``;
    every other one says ``more``."""
    last = stop >= len(cycle.decisions)
    return DecisionBatch(
        basis=cycle.basis,
        decisions=cycle.decisions[start:stop],
        next_wakeup_ms=cycle.next_wakeup_ms if last else None,
        v=cycle.v,
        logic=cycle.logic,
        decisions_before=decisions_before + start,
        more=UNSET if last else True,
    )


def split_batch(
    cycle: DecisionBatch, decisions_before: int, max_bytes: int, start: int = 0
) -> list[DecisionBatch]:
    """The batches that publish the cycle's batch ``cycle`` from its decision
    ``start`` on, each encoded (JSON) in at most ``max_bytes`` bytes.

    ``[cycle]`` itself when it fits whole (``start`` 0); else parts
    (:func:`batch_part`), filled in order as long as they fit; a single
    decision larger than ``max_bytes`` gets a part of its own. From ``start``
    at the end, the one part that closes the cycle. ``decisions_before`` is
    the number of decisions the history held when the cycle began."""
    decisions = cycle.decisions
    if start == 0 and len(encode(cycle)) <= max_bytes:
        return [cycle]
    # the largest envelope a part can have: the widest counter, ``more`` and the wake-up
    envelope = len(
        encode(
            DecisionBatch(
                basis=cycle.basis,
                decisions=(),
                next_wakeup_ms=cycle.next_wakeup_ms,
                v=cycle.v,
                decisions_before=decisions_before + len(decisions),
                more=True,
                logic=cycle.logic,
            )
        )
    )
    parts: list[DecisionBatch] = []
    first, size = start, envelope
    for i in range(start, len(decisions)):
        grow = len(encode(decisions[i])) + (1 if i > first else 0)  # a comma between decisions
        if i > first and size + grow > max_bytes:
            parts.append(batch_part(cycle, first, i, decisions_before))
            first, size, grow = i, envelope, grow - 1
        size += grow
    parts.append(batch_part(cycle, first, len(decisions), decisions_before))
    return parts


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
