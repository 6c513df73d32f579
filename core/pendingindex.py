"""Pending workloads in the orders a scheduling cycle walks them, kept by the fold.

Derived from :attr:`State.pending` (never snapshotted), so that a cycle does not
sort the whole queue again each time:

- ``by_leaf[leaf]``: allocated work of one leaf by ``(-priority, submit time, id)``;
- ``by_shape[leaf][shape]``: the same keys split by shape ``(gpu_type, gpus,
  min_runtime)``, so that a cycle can pass over every workload of a shape that
  cannot be placed without visiting them one by one
  (:class:`~apportion.core.ordering.FairShareWalk`);
- ``free[(gpu_type, gpus)]``: unallocated work of one size by ``(submit time,
  id)``, so that a cycle can drop every request of a size that can no longer be
  placed without visiting them one by one (:mod:`~apportion.core.cycle.unallocated`).

A held workload (``WorkloadHeld``) is pending but in none of them: the fold
removes it when it is held and adds it back, with its old keys, when it is
released, so no cycle walks it and it keeps its place.

All are sorted lists of tuples (a total order ending in the workload id), so
they are the same however they were built.

The index is built from the pending workloads the first time any of the three
is read, and kept current by the fold from then on. A fold that no cycle reads
(a replay, an audit, a projector or standby following the log, a restore) never
pays for it; a scheduler, whose every cycle reads it, keeps it from its first
cycle on, and that first cycle pays for the build (a sort: under a microsecond
per pending workload, about 80 ms at 100,000). Keeping it costs about a third
of a deep-queue fold's time (``benchmarks/bench_scale.py``, rows "fold deep
queue (fold)" and "(fold, index kept)"), mostly the cache misses of bisecting
long lists of tuples.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping
from typing import Protocol

from msgspec import UNSET, UnsetType

from .budget import ROOT, parent_of
from .rules.contract import is_allocated


class _Pending(Protocol):
    id: str
    owner: str
    priority: int
    submitted_ms: int
    min_runtime_ms: int
    gpu_type: str
    gpus: int
    held_by: str | UnsetType


LeafKey = tuple[int, int, str]
FreeKey = tuple[int, str]
FreeShape = tuple[str, int]
"""``(gpu_type, gpus)`` of an unallocated workload."""
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
    """The index of ``pending`` (the state's pending workloads by id, read once to
    build the index); the fold calls :meth:`add` and :meth:`remove` as
    workloads enter and leave it, which change nothing until the index is built.

    :meth:`add` and :meth:`remove` are the fold's hot path: :func:`leaf_key`,
    :func:`shape_of` and :func:`free_key` are spelled inline."""

    __slots__ = ("_by_leaf", "_by_shape", "_free", "_pending", "kept", "_paths")

    def __init__(self, pending: Mapping[str, _Pending]) -> None:
        self._pending = pending
        self.kept = False
        """Built (at the first read) and kept current by :meth:`add` and :meth:`remove`."""
        self._by_leaf: dict[str, list[LeafKey]] = {}
        self._by_shape: dict[str, dict[Shape, list[LeafKey]]] = {}
        self._free: dict[FreeShape, list[FreeKey]] = {}
        self._paths: tuple[dict[str, int], dict[str, list[str]]] | None = None
        """:meth:`live_paths`, until a leaf's queue appears or empties."""

    @property
    def by_leaf(self) -> dict[str, list[LeafKey]]:
        self.keep()
        return self._by_leaf

    @property
    def by_shape(self) -> dict[str, dict[Shape, list[LeafKey]]]:
        self.keep()
        return self._by_shape

    @property
    def free(self) -> dict[FreeShape, list[FreeKey]]:
        self.keep()
        return self._free

    def keep(self) -> None:
        """Build the index now, if it is not built yet, and keep it from then on (what
        the first read does; a caller that will read it anyway may pay for it here)."""
        if not self.kept:
            self._build()

    def _build(self) -> None:
        """Every pending workload into its lists, then each list sorted (the same
        lists as :meth:`add` one by one, faster: :meth:`add` spelled inline)."""
        by_leaf: dict[str, list[LeafKey]] = {}
        by_shape: dict[str, dict[Shape, list[LeafKey]]] = {}
        free: dict[FreeShape, list[FreeKey]] = {}
        for w in self._pending.values():
            if w.held_by is not UNSET:  # held: pending, but no cycle walks it
                continue
            if is_allocated(w):
                key = (-w.priority, w.submitted_ms, w.id)
                shape = (w.gpu_type, w.gpus, w.min_runtime_ms)
                owner = w.owner
                keys = by_leaf.get(owner)
                if keys is None:
                    by_leaf[owner] = [key]
                    by_shape[owner] = {shape: [key]}
                    continue
                keys.append(key)
                shapes = by_shape[owner]
                same = shapes.get(shape)
                if same is None:
                    shapes[shape] = [key]
                else:
                    same.append(key)
            else:
                size = free.get((w.gpu_type, w.gpus))
                if size is None:
                    free[(w.gpu_type, w.gpus)] = [(w.submitted_ms, w.id)]
                else:
                    size.append((w.submitted_ms, w.id))
        for keys in by_leaf.values():
            keys.sort()
        for shapes in by_shape.values():
            for keys in shapes.values():
                keys.sort()
        for sized in free.values():
            sized.sort()
        self._by_leaf, self._by_shape, self._free = by_leaf, by_shape, free
        self._paths = None
        self.kept = True

    def live_paths(self) -> tuple[dict[str, int], dict[str, list[str]]]:
        """The budget paths (the root excepted) with pending allocated work at or
        below them, each mapped to 0, and per budget node its children among them:
        what :class:`~apportion.core.ordering.FairShareWalk` starts from. Kept until
        a leaf's queue appears or empties; read only (the walk copies the first)."""
        paths = self._paths
        if paths is None:
            paths = self._paths = paths_above(self.by_leaf)
        return paths

    def add(self, w: _Pending) -> None:
        if not self.kept:
            return
        if is_allocated(w):
            key = (-w.priority, w.submitted_ms, w.id)
            owner = w.owner
            keys = self._by_leaf.get(owner)
            if keys is None:
                self._by_leaf[owner] = [key]
                self._by_shape[owner] = {(w.gpu_type, w.gpus, w.min_runtime_ms): [key]}
                self._paths = None
                return
            insort(keys, key)
            shapes = self._by_shape[owner]
            shape = (w.gpu_type, w.gpus, w.min_runtime_ms)
            same = shapes.get(shape)
            if same is None:
                shapes[shape] = [key]
            else:
                insort(same, key)
        else:
            size = self._free.get((w.gpu_type, w.gpus))
            if size is None:
                self._free[(w.gpu_type, w.gpus)] = [(w.submitted_ms, w.id)]
            else:
                insort(size, (w.submitted_ms, w.id))

    def remove(self, w: _Pending) -> None:
        if not self.kept:
            return
        if is_allocated(w):
            key = (-w.priority, w.submitted_ms, w.id)
            owner = w.owner
            keys = self._by_leaf[owner]
            del keys[bisect_left(keys, key)]
            if not keys:  # the leaf's last: its one shape list is empty too
                del self._by_leaf[owner], self._by_shape[owner]
                self._paths = None
                return
            shapes = self._by_shape[owner]
            shape = (w.gpu_type, w.gpus, w.min_runtime_ms)
            same = shapes[shape]
            del same[bisect_left(same, key)]
            if not same:
                del shapes[shape]
        else:
            size = self._free[(w.gpu_type, w.gpus)]
            del size[bisect_left(size, (w.submitted_ms, w.id))]
            if not size:
                del self._free[(w.gpu_type, w.gpus)]


def paths_above(leaves: Iterable[str]) -> tuple[dict[str, int], dict[str, list[str]]]:
    """The budget paths (the root excepted) at or above ``leaves``, each mapped to 0,
    and per budget node its children among them (in the order first met)."""
    seen: dict[str, int] = {}
    live: dict[str, list[str]] = {}
    for leaf in leaves:
        path = leaf
        while path not in seen:  # up to the first ancestor already seen
            seen[path] = 0
            parent = parent_of(path)
            live.setdefault(parent, []).append(path)
            if parent == ROOT:
                break
            path = parent
    return seen, live
