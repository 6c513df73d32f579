"""The scheduling contract (docs/semantics.md, "Vocabulary": minimum runtime), in one place.

A workload declares a minimum runtime ``min_runtime_ms`` (at most the policy's
``max_min_runtime_ms``):

- ``min_runtime > 0``: **allocated**. Charged to its owner for all the time it
  runs, and protected from preemption for ``min_runtime`` after each placement
  (until ``protected_until = placement time + min_runtime``); past that, only
  work that outranks it clearly may preempt it.
- ``min_runtime == 0``: **unallocated**. Free (never charged), and preemptible
  by any allocated work at any moment.

**Preemption notice** (grace): a run preempted for fair share, for unallocated
capacity or by a drain keeps its GPUs (and its charge) for its effective grace
(:func:`effective_grace`) so it can checkpoint; it is never a victim again.

The **reservation gate**: a node reserved for a blocked workload from
``start_ms`` takes, until then, only work that will be preemptible by then.

Every rule here is a plain function of integers (or of a workload's
``min_runtime_ms`` / ``protected_until_ms``), so the fold, the cycle, the
baseline and the read models all ask the same question the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class _Contract(Protocol):
    @property
    def min_runtime_ms(self) -> int: ...


class _Running(_Contract, Protocol):
    @property
    def protected_until_ms(self) -> int: ...


R = TypeVar("R", bound=_Running)


def is_allocated(w: _Contract) -> bool:
    """Allocated (``min_runtime > 0``): charged to its owner, protected after placement."""
    return w.min_runtime_ms > 0


def protected_until(placed_ms: int, min_runtime_ms: int) -> int:
    """End of the protection of a run placed at ``placed_ms``."""
    return placed_ms + min_runtime_ms


def is_protected(w: _Running, t: int) -> bool:
    """A running workload that may not be preempted at ``t`` (except by its node
    going down): allocated, and ``t < protected_until``."""
    return t < w.protected_until_ms and is_allocated(w)


def preemptible_from(w: _Running, t: int) -> int:
    """The earliest time from ``t`` on at which the contract lets a running ``w``
    be preempted: ``t`` if it is not protected, else ``protected_until`` (an
    unallocated run's ``protected_until`` is its placement time, at or before ``t``)."""
    return max(t, w.protected_until_ms)


def protected(ws: Iterable[R], t: int) -> list[R]:
    """Those of ``ws`` that are protected at ``t`` (:func:`is_protected`)."""
    return [w for w in ws if is_protected(w, t)]


def unprotected(ws: Iterable[R], t: int) -> list[R]:
    """Those of ``ws`` that are not protected at ``t`` (possible victims)."""
    return [w for w in ws if not is_protected(w, t)]


def may_use_reserved(t: int, min_runtime_ms: int, start_ms: int) -> bool:
    """The reservation gate: work placed at ``t`` may use a node reserved from
    ``start_ms`` only if it will be preemptible by then (``t + min_runtime <= start``)."""
    return protected_until(t, min_runtime_ms) <= start_ms


def effective_grace(own_grace_ms: int | None, policy_grace_ms: int) -> int:
    """The preemption notice a run gets when preempted for fair share, for unallocated
    capacity or by a drain: its own ``grace_ms`` if it set one, else the policy's
    (a node going down gives none)."""
    return policy_grace_ms if own_grace_ms is None else own_grace_ms
