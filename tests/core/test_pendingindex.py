"""The pending index against its definition (:mod:`apportion.core.pendingindex`):
whenever it is first read (before any change, part way, or only at the end), and
kept by every change after, it is the literal sort of the pending workloads."""

from __future__ import annotations

import random

import pytest
from apportion.core.pendingindex import (
    FreeKey,
    FreeShape,
    LeafKey,
    PendingIndex,
    Shape,
    free_key,
    leaf_key,
    shape_of,
)
from apportion.core.state import Workload


def definition(
    pending: dict[str, Workload],
) -> tuple[
    dict[str, list[LeafKey]], dict[str, dict[Shape, list[LeafKey]]], dict[FreeShape, list[FreeKey]]
]:
    by_leaf: dict[str, list[LeafKey]] = {}
    by_shape: dict[str, dict[Shape, list[LeafKey]]] = {}
    free: dict[FreeShape, list[FreeKey]] = {}
    for w in pending.values():
        if w.min_runtime_ms > 0:
            by_leaf.setdefault(w.owner, []).append(leaf_key(w))
            by_shape.setdefault(w.owner, {}).setdefault(shape_of(w), []).append(leaf_key(w))
        else:
            free.setdefault((w.gpu_type, w.gpus), []).append(free_key(w))
    for keys in [
        *by_leaf.values(),
        *(k for s in by_shape.values() for k in s.values()),
        *free.values(),
    ]:
        keys.sort()
    return by_leaf, by_shape, free


def assert_is_definition(index: PendingIndex, pending: dict[str, Workload]) -> None:
    by_leaf, by_shape, free = definition(pending)
    assert index.by_leaf == by_leaf
    assert index.free == free
    assert index.by_shape == by_shape


@pytest.mark.parametrize("first_read", [0, 150, 1_000, None])
def test_the_index_is_its_definition_whenever_it_is_first_read(
    first_read: int | None,
) -> None:
    rng = random.Random(first_read or 0)
    pending: dict[str, Workload] = {}
    index = PendingIndex(pending)
    off_queue: list[Workload] = []  # placed once, may come back (requeued, same key)
    for step in range(1_500):
        if step == first_read:
            assert not index.kept  # nothing read it yet: the changes so far cost nothing
            assert_is_definition(index, pending)
        r = rng.random()
        if r < 0.45 or not pending:
            w = Workload(
                id=f"w{step}",
                owner=rng.choice(("a", "b", "c/d")),
                gpus=rng.choice((1, 2, 8)),
                gpu_type=rng.choice(("h100", "a100")),
                min_runtime_ms=rng.choice((0, 60_000, 3_600_000)),
                resumable=True,
                priority=rng.randint(-1, 2),
                submitted_ms=rng.randrange(step // 10 + 1) * 1_000,  # ties in time: by id
            )
        elif r < 0.55 and off_queue:
            w = off_queue.pop(rng.randrange(len(off_queue)))
        else:
            w = pending.pop(rng.choice(sorted(pending)))
            index.remove(w)
            if rng.random() < 0.5:
                off_queue.append(w)
            continue
        pending[w.id] = w
        index.add(w)
        if first_read is not None and step >= first_read and step % 50 == 0:
            assert_is_definition(index, pending)
    assert_is_definition(index, pending)
    assert index.kept
    # everything leaves: no empty lists or leaves stay behind
    for wid in sorted(pending):
        index.remove(pending.pop(wid))
    assert (index.by_leaf, index.by_shape, index.free) == ({}, {}, {})
