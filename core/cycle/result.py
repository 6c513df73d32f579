"""What a cycle returns: its decisions, the next wake-up and the reservation."""

from __future__ import annotations

import msgspec
from apportion.schemas.events import Decision


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """Nodes held for ``workload`` from ``start_ms``: until then only work that
    will be preemptible before ``start_ms`` may run on them."""

    workload: str
    nodes: tuple[str, ...]
    start_ms: int


class CycleResult(msgspec.Struct, frozen=True, kw_only=True):
    decisions: tuple[Decision, ...]
    """In the order they must be folded: rejections, node-down and drain
    preemptions, NodeDrained, then placements each preceded by the preemptions
    that made room for it."""
    next_wakeup_ms: int | None
    """Earliest future time at which a decision could change with no new input
    (a protection expiry, a reservation start or the end of a preemption notice);
    ``None`` if none."""
    reservation: Reservation | None = None
