"""The scheduling cycle: ``decide(state) -> CycleResult`` (pure, deterministic).

(Being written; the interface below is fixed.)
"""

from __future__ import annotations

import msgspec

from apportion.schemas.events import Decision

from .state import State, apply


class CycleResult(msgspec.Struct, frozen=True, kw_only=True):
    decisions: tuple[Decision, ...]
    """In the order they must be folded: rejections, node-down and drain
    preemptions, NodeDrained, then placements each preceded by the preemptions
    that made room for it."""
    next_wakeup_ms: int | None
    """Earliest future time at which a decision could change with no new input
    (a protection expiry or a reservation start); ``None`` if none."""


def decide(state: State) -> CycleResult:
    """One scheduling cycle at ``state.now_ms``; does not change ``state``."""
    raise NotImplementedError


def step(state: State) -> CycleResult:
    """``decide`` and fold the decisions back into ``state``."""
    result = decide(state)
    for decision in result.decisions:
        apply(state, decision)
    return result
