"""Pending workloads in the orders a scheduling cycle walks them, kept by the fold.

Derived from :attr:`State.pending` (rebuilt on restore, never snapshotted), so
that a cycle does not sort the whole queue again each time:

- ``by_leaf[leaf]``: allocated work of one leaf by ``(-priority, submit time, id)``;
- ``by_shape[leaf][shape]``: the same keys split by shape ``(gpu_type, gpus,
  min_runtime)``, so that a cycle can pass over every workload of a shape that
  cannot be placed without visiting them one by one
  (:class:`~apportion.core.ordering.FairShareWalk`);
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
    gpu_type: str
    gpus: int


LeafKey = tuple[int, int, str]
FreeKey = tuple[int, str]
Shape = tuple[str, int, int]
"""``(gpu_type, gpus, min_runtime_ms)``: what placing an allocated workload depends
on besides its owner and priority."""


def shape_of(w: _Pending) -> Shape:
    return (w.gpu_type, w.gpus, w.min_runtime_ms)


def leaf_key(w: _Pending) -> LeafKey:
    return (-w.priority, w.submitted_ms, w.id)


def free_key(w: _Pending) -> FreeKey:
    return (w.submitted_ms, w.id)


class PendingIndex:
    __slots__ = ("by_leaf", "by_shape", "free")

    def __init__(self) -> None:
        self.by_leaf: dict[str, list[LeafKey]] = {}
        self.by_shape: dict[str, dict[Shape, list[LeafKey]]] = {}
        self.free: list[FreeKey] = []

    def add(self, w: _Pending) -> None:
        if is_allocated(w):
            key = leaf_key(w)
            insort(self.by_leaf.setdefault(w.owner, []), key)
            insort(self.by_shape.setdefault(w.owner, {}).setdefault(shape_of(w), []), key)
        else:
            insort(self.free, free_key(w))

    def remove(self, w: _Pending) -> None:
        if is_allocated(w):
            key = leaf_key(w)
            keys = self.by_leaf[w.owner]
            del keys[bisect_left(keys, key)]
            if not keys:
                del self.by_leaf[w.owner]
            shapes = self.by_shape[w.owner]
            shape = shape_of(w)
            keys = shapes[shape]
            del keys[bisect_left(keys, key)]
            if not keys:
                del shapes[shape]
                if not shapes:
                    del self.by_shape[w.owner]
        else:
            del self.free[bisect_left(self.free, free_key(w))]
