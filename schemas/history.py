"""The canonical history, one item at a time: the one type every reader and writer shares.

The history of a cluster is input 1, the decision batch based on input 1,
input 2, the batch based on 2, ... (a batch may be missing after an input when
the scheduler folded several inputs before deciding). Every source of history
yields these items in that order, and every consumer folds them with
:func:`apportion.core.history.fold_item`:

- the live streams (``INPUTS`` and ``DECISIONS`` on JetStream, merged by the
  services' canonical reader),
- a JSON-lines event log file, a DuckDB projection (``apportion replay|audit|whatif``),
- the simulator, which makes them as it goes.

:class:`InputItem` is input number ``seq`` of ``INPUTS``. Bytes that did not
decode have no ``event``; ``rejection`` then says why (``"malformed input:
..."``), and the fold records it as a rejected input like any other bad input.
:class:`BatchItem` is decision batch number ``seq`` of ``DECISIONS``.
"""

from __future__ import annotations

import re

import msgspec

from .bounds import EVENT_ID_PATTERN, MAX_EVENT_ID_LEN, MAX_TIME_MS, clip_reason
from .codec import bounds_error
from .events import DecisionBatch, Input

_EVENT_ID = re.compile(EVENT_ID_PATTERN)


class InputItem(msgspec.Struct, frozen=True, kw_only=True):
    """Input number ``seq`` of the history, stored at ``at_ms``.

    ``ref`` names it in an ``InputRejected`` (the event id, else the message id
    or ``seq:<n>``). ``event`` is ``None`` for bytes that did not decode; then
    ``rejection`` holds the reason the fold records."""

    seq: int
    at_ms: int
    ref: str
    event: Input | None = None
    rejection: str | None = None
    subject: str | None = None
    """The subject it was stored on (``apportion.<c>.inputs.<Kind>[.<host>]``);
    the fold binds the kind and, for a host agent's subject, the host and the
    actor to it (:mod:`apportion.core.rules.subjects`). ``None``: not known
    (simulations, files written before subjects were kept): not checked."""
    sent_ms: int | None = None
    """When its writer sent it: the ``at_ms`` its payload carries (the publisher
    stamps it at each publish), before readers replace it with the time it was
    stored. The fold refuses an input sent too long before it was stored, or
    whose id it has folded within that window (:mod:`apportion.core.rules.identity`).
    ``None``: not known (simulations, files written before): not checked."""

    @property
    def malformed(self) -> bool:
        return self.event is None


class BatchItem(msgspec.Struct, frozen=True, kw_only=True):
    """Decision batch number ``seq`` of the history (its basis is the input it follows)."""

    seq: int
    batch: DecisionBatch


HistoryItem = InputItem | BatchItem


def input_item(seq: int, event: Input) -> InputItem:
    """Input ``seq`` carrying an event made in Python (stored at the event's own ``at_ms``).

    The event is checked as the decoder checks bytes: one that breaks a bound of
    its schema becomes a malformed input, exactly as if it had been published."""
    problem = bounds_error(event)
    if problem is not None:
        at_ms = event.at_ms
        if not (isinstance(at_ms, int) and 0 <= at_ms <= MAX_TIME_MS):
            at_ms = 0  # folds at the current time
        return malformed_item(seq, at_ms, str(event.id), problem)
    return InputItem(seq=seq, at_ms=event.at_ms, ref=event.id, event=event)


def decoded_item(seq: int, event: Input) -> InputItem:
    """Input ``seq`` carrying an event a decoder of :mod:`apportion.schemas.codec`
    produced (``decode_input``): its bounds were checked as it decoded, so they are
    not checked again (:func:`input_item` is for events made in Python)."""
    return InputItem(seq=seq, at_ms=event.at_ms, ref=event.id, event=event)


def malformed_item(seq: int, at_ms: int, ref: str, error: str) -> InputItem:
    """Input ``seq`` whose bytes did not decode because of ``error``.

    ``ref`` (a message id anyone may have chosen) is kept only if it is a valid
    event id, else it becomes ``seq:<n>``; the reason is cut to its bound. So the
    ``InputRejected`` decision that announces it always fits its own schema."""
    if len(ref) > MAX_EVENT_ID_LEN or not _EVENT_ID.match(ref):
        ref = f"seq:{seq}"
    return InputItem(
        seq=seq, at_ms=at_ms, ref=ref, rejection=clip_reason(f"malformed input: {error}")
    )
