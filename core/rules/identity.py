"""An input is folded once: its identity is its ``id`` (the ``Nats-Msg-Id`` it was
published with), and its writer stamps the time it sends it (docs/security.md,
"Re-appended bytes").

The threat: a writer can make the server append the bytes of an older stored
input again on its own input subjects (a direct get whose reply subject is one
it may publish on). Within JetStream's duplicate window (120 s) the
``Nats-Msg-Id`` stores it once; after it, the copy would be folded as a new
input (an admin's old budget edit undoing a later one). So the fold itself
refuses, for an input whose history item knows when it was sent
(:attr:`~apportion.schemas.history.InputItem.sent_ms`, the ``at_ms`` of its
payload, which the publisher stamps at each publish):

- one sent more than :data:`WINDOW_MS` before it is folded (``stale_input``):
  a copy of an input older than the window, or a writer whose clock is far
  off;
- one whose id was folded within the window (``duplicate_input``).

An input on a subject only stream sourcing writes (:func:`.subjects.is_sourced`:
a budget edit made on a federation's tree) is not refused as stale: the server
copied it, no writer re-appended it, and a cluster cut off from the hub takes
the edits made meanwhile when it rejoins, however long after. Its id is
remembered for the window after it is folded (a copy the source delivers again
is a duplicate).

So the fold remembers the ids of the inputs sent within the last
:data:`WINDOW_MS` only (:attr:`~apportion.core.state.State.input_ids`): memory
bounded by the inputs of one window, and every decision still a function of
the history alone. A history whose items carry no sending time (simulations,
files and projections written before) folds as before.
"""

from __future__ import annotations

import heapq

from apportion.schemas import reasons as R
from apportion.schemas.events import MINUTE_MS
from apportion.schemas.history import InputItem
from apportion.schemas.reasons import Refusal

from ..state import State
from .subjects import is_sourced

WINDOW_MS = 15 * MINUTE_MS
"""How long before it is stored an input may have been sent, and how long its id
is remembered. Wider than JetStream's duplicate window (120 s), and than any
clock difference between a writer's host and the servers (NTP keeps them within
a second); a writer that retries stamps the time again (same id)."""


def identity_refusal(state: State, item: InputItem) -> Refusal | None:
    """Why input ``item`` is not a new input, or ``None`` (then :func:`remember` it).
    Forgets the ids whose window has passed at the time ``item`` folds at."""
    sent = item.sent_ms
    if sent is None or item.event is None:
        return None
    at = max(state.now_ms, item.at_ms)
    _forget(state, at)
    if min(sent, item.at_ms) < at - WINDOW_MS and not is_sourced(item.subject):
        return Refusal(
            R.STALE_INPUT,
            f"input {item.ref!r} was sent at {sent}, more than {WINDOW_MS // MINUTE_MS} min "
            f"before it was folded at {at}: an old input appended again (or its writer's "
            "clock is wrong)",
        )
    if item.event.id in state.input_ids:
        return Refusal(
            R.DUPLICATE_INPUT,
            f"input {item.ref!r} was already folded: a copy of a stored input, not a new one",
        )
    return None


def remember(state: State, item: InputItem) -> None:
    """Remember the id of ``item`` (its :func:`identity_refusal` was ``None``) until
    the window after the time it was sent (or stored, if earlier) has passed."""
    sent = item.sent_ms
    if sent is None or item.event is None:
        return
    until = min(sent, item.at_ms) + WINDOW_MS
    at = max(state.now_ms, item.at_ms)
    if until < at:  # accepted though sent before the window: a sourced input
        until = at + WINDOW_MS  # remembered for the window after it is folded
    state.input_ids[item.event.id] = until
    heapq.heappush(state.input_id_expiry, (until, item.event.id))


def _forget(state: State, at: int) -> None:
    expiry, ids = state.input_id_expiry, state.input_ids
    while expiry and expiry[0][0] < at:
        until, ref = heapq.heappop(expiry)
        if ids.get(ref) == until:
            del ids[ref]
