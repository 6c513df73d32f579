"""Pending workloads in the orders a scheduling cycle walks them, kept by the fold.

Derived from :attr:`State.pending` (rebuilt on restore, never snapshotted), so
that a cycle does not sort the whole queue again each time:

- ``by_leaf[leaf]``: allocated work of one leaf by ``(-priority, submit time, id)``;
- ``free``: unallocated work by ``(submit time, id)``.

Both are sorted lists of tuples (a total order ending in the workload id).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Protocol

from .contract import is_allocated


class _Pending(Protocol):
    id: str
    owner: str
    priority: int
    submitted_ms: int
    min_runtime_ms: int


LeafKey = tuple[int, int, str]
FreeKey = tuple[int, str]


def leaf_key(w: _Pending) -> LeafKey:
    return (-w.priority, w.submitted_ms, w.id)


def free_key(w: _Pending) -> FreeKey:
    return (w.submitted_ms, w.id)


class PendingIndex:
    __slots__ = ("by_leaf", "free")

    def __init__(self) -> None:
        self.by_leaf: dict[str, list[LeafKey]] = {}
        self.free: list[FreeKey] = []

    def add(self, w: _Pending) -> None:
        if is_allocated(w):
            insort(self.by_leaf.setdefault(w.owner, []), leaf_key(w))
        else:
            insort(self.free, free_key(w))

    def remove(self, w: _Pending) -> None:
        if is_allocated(w):
            keys = self.by_leaf[w.owner]
            del keys[bisect_left(keys, leaf_key(w))]
            if not keys:
                del self.by_leaf[w.owner]
        else:
            del self.free[bisect_left(self.free, free_key(w))]
