"""Hierarchical fair-share ordering of pending workloads.

The order (docs/semantics.md, "The ordering"), a total order, first to last:

1. allocated workloads (``min_runtime > 0``) before unallocated ones;
2. allocated: the ancestors' ratios ``(usage + committed) / weight`` from the top
   level down (``committed``: :func:`committed_charges`),
   compared lexicographically, each only against its siblings (lower = more
   under-served = first); ties between siblings: larger weight first, then path
   (:func:`sibling_key`, the one spelling of this rule);
3. inside one leaf: higher ``priority`` first;
4. earlier submit time first (a requeued workload keeps its original submit time);
5. workload id.

Unallocated workloads order by submit time, then id.

Criteria 3-5 and the unallocated order are the keys of the fold's
:class:`~apportion.core.pendingindex.PendingIndex` (``leaf_key``,
``free_key``), which keeps pending work sorted by them. Criterion 2 is
:class:`FairShareWalk`: it walks the budget tree from the root, taking at each
node the child with the lowest :func:`sibling_key`, and exhausts a leaf's
queue before ranking again. The scheduling cycle walks allocated work with it,
adding each placement's projected charge to the working usage as it goes (so
the order changes during a cycle); :func:`queue_order` is the same walk with
nothing charged, followed by the unallocated work: the order the next cycle
would consider pending work in.

Ratios are compared exactly (see :mod:`apportion.core.ratio`): siblings'
``usage * scale`` are integers in the same order as their ratios.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction

from .budget import ROOT, ancestors_of, parent_of
from .pendingindex import LeafKey, Shape, leaf_key, paths_above, shape_of
from .ratio import ratio
from .rules.contract import is_allocated
from .rules.federation import peer_committed_paths
from .state import State, Workload

SiblingKey = tuple[int, int, str]


def sibling_key(usage: int, scale: int, weight: int, path: str) -> SiblingKey:
    """Siblings order by ratio (exactly, as ``usage * scale``, see
    :func:`~apportion.core.ratio.sibling_scales`), then larger weight first, then path."""
    return (usage * scale, -weight, path)


def committed_by_leaf(state: State) -> dict[str, int]:
    """Per owner leaf: GPUs x the rest of the protection of its running allocated
    workloads on this cluster (but those on a ``down`` node, lost in the coming cycle)."""
    per_leaf = state.protection_index.committed(state.now_ms)  # a pass over the leaves
    for leaf, gpu_ms in _lost_commitments(state):
        per_leaf[leaf] -= gpu_ms
    return per_leaf


def _lost_commitments(state: State) -> list[tuple[str, int]]:
    """``(owner leaf, rest of its commitment)`` of the protected runs on ``down``
    nodes, lost in the coming cycle (each run once, a gang on several down nodes
    too). Expires the protection index to ``state.now_ms``."""
    now = state.now_ms
    index = state.protection_index
    index.expire(now)
    lost: dict[str, None] = {}
    for name in state.node_index.down:
        lost.update(dict.fromkeys(state.nodes[name].workloads))
    out = []
    for wid in lost:
        entry = index.entry(wid)
        if entry is not None:
            leaf, gpus, until = entry
            out.append((leaf, gpus * (until - now)))
    return out


def committed_charges(state: State) -> dict[str, int]:
    """Per budget path (the owner leaf and its ancestors, not the root): GPUs x the
    rest of the protection of its running allocated workloads (but those on a
    ``down`` node), the charge their contract commits them to; on a federated
    cluster, plus what each peer last reported committed
    (:func:`~apportion.core.rules.federation.peer_committed`). Ranking counts it as
    usage, so work placed a moment ago weighs on its team's ratio at once, not
    only as it runs."""
    out: dict[str, int] = {}
    for leaf, gpu_ms in committed_by_leaf(state).items():
        for p in (*ancestors_of(leaf)[1:], leaf):
            out[p] = out.get(p, 0) + gpu_ms
    if state.peer_committed:
        for p, gpu_ms in peer_committed_paths(state).items():
            out[p] = out.get(p, 0) + gpu_ms
    return out


def _committed_extra(state: State) -> dict[str, int]:
    """What :func:`committed_charges` adds to the protection index's sums per path
    (:meth:`~apportion.core.protectionindex.ProtectionIndex.committed_under`): minus
    the work on ``down`` nodes, plus what peers last reported committed. Empty on a
    single cluster with no node down. Expires the index to ``state.now_ms``."""
    out: dict[str, int] = {}
    if state.node_index.down:
        for leaf, gpu_ms in _lost_commitments(state):
            for p in (*ancestors_of(leaf)[1:], leaf):
                out[p] = out.get(p, 0) - gpu_ms
    if state.peer_committed:
        for p, gpu_ms in peer_committed_paths(state).items():
            out[p] = out.get(p, 0) + gpu_ms
    return out


class _Lazy(dict[str, int]):
    """A budget node's value computed on its first read (``[]`` or ``get``) by
    ``fill``, then kept: a cycle reads a few families of a large tree (on a 10-day
    ai2 log, 27 of 168 nodes per cycle). Read by key only: iterating it gives the
    nodes read so far."""

    __slots__ = ("fill", "nodes")

    def __init__(self, fill: Callable[[str], int], nodes: Mapping[str, object] | None) -> None:
        """``nodes``: the paths ``get`` fills (``None``: every path)."""
        super().__init__()
        self.fill = fill
        self.nodes = nodes

    def __missing__(self, path: str) -> int:
        value = self[path] = self.fill(path)
        return value

    def get(self, path: str, default: int | None = None) -> int | None:  # type: ignore[override]
        if path in self or self.nodes is None or path in self.nodes:
            return self[path]
        return default


class FairShareView:
    """Usage, ratio and sibling rank of every budget node at ``state.now_ms``.

    ``charged``, ``committed`` and ``usage`` are computed per node on first read
    (by key: ``view.usage[path]``), so a cycle pays only for the nodes it looks at:
    a view is of one moment, read it before ``state`` folds anything more (the
    charge series and the protection index it reads change with the fold)."""

    __slots__ = (
        "tree",
        "charged",
        "committed",
        "usage",
        "weight",
        "scale",
        "_rank",
        "_leaf_pos",
        "_now",
        "_lookback",
        "_index",
        "_extra",
    )

    def __init__(self, state: State) -> None:
        tree = state.budget
        self.tree = tree
        self._now, self._lookback = state.now_ms, state.policy.lookback_ms
        self.charged: dict[str, int] = _Lazy(self._charged, tree.nodes)
        """GPU-ms charged inside the lookback window (on every cluster of a federation)."""
        self._index = state.protection_index
        self._index.expire(self._now)
        self._extra = _committed_extra(state)
        self.committed: dict[str, int] = _Lazy(self._committed, None)
        """GPU-ms that running allocated work will be charged for the rest of its
        protection (:func:`committed_charges`, per path on first read)."""
        self.usage: dict[str, int] = _Lazy(self._usage, tree.nodes)
        """What ratios are computed from: charged + committed."""
        self.weight, self.scale = tree.weights_and_scales()
        """Weights, and scales: ``usage * scale`` orders siblings exactly by ratio
        (:func:`~apportion.core.ratio.sibling_scales`). The tree's own dicts, kept
        until it changes: read only."""
        self._rank: dict[str, int] = {}
        self._leaf_pos: dict[str, int] = {}

    def _charged(self, path: str) -> int:
        return self.tree.nodes[path].charged(self._now, self._lookback)

    def _committed(self, path: str) -> int:
        value = self._index.committed_under(path, self._now)
        return value + self._extra[path] if path in self._extra else value

    def _usage(self, path: str) -> int:
        # ``charged[path] + committed[path]``, spelled without their dicts: a cycle
        # reads usage only (the fill is its hot path), other readers fill them
        now = self._now
        value = self.tree.nodes[path].charged(now, self._lookback)
        value += self._index.committed_under(path, now)
        return value + self._extra[path] if path in self._extra else value

    def working(self) -> dict[str, int]:
        """A working copy of ``usage`` to add projected charges to (filled from
        ``usage`` on first read, as ``usage`` is)."""
        return _Lazy(self.usage.__getitem__, self.tree.nodes)

    def ratio(self, path: str) -> Fraction:
        return ratio(self.usage[path], self.weight[path])

    def sibling_key(self, path: str) -> SiblingKey:
        return sibling_key(self.usage[path], self.scale[path], self.weight[path], path)

    def rank(self, path: str) -> int:
        """``path``'s rank among its siblings, most under-served first (each family
        sorted when first asked)."""
        rank = self._rank.get(path)
        if rank is None:
            if path == ROOT:
                return 0
            siblings = self.tree.nodes[parent_of(path)].children
            for i, child in enumerate(sorted(siblings, key=self.sibling_key)):
                self._rank[child] = i
            rank = self._rank[path]
        return rank

    def leaf_position(self, leaf: str) -> int:
        """Where ``leaf`` stands among all leaves in fair-share order (criterion 2):
        higher = more over-served; -1 for a path that is not a leaf. Compare
        positions only (they are not consecutive): the ranks of the leaf's
        ancestors and its own, top level first, as the digits of one number in
        base :meth:`~apportion.core.budget.BudgetTree.shape`'s radix, padded to
        the deepest leaf. Orders leaves as sorting their rank tuples does (no leaf's
        tuple is a prefix of another's), reading only the families on its path."""
        pos = self._leaf_pos.get(leaf)
        if pos is None:
            if not self.tree.is_leaf(leaf):
                return -1
            radix, depth = self.tree.shape()
            path = [*ancestors_of(leaf)[1:], leaf]
            pos = 0
            for p in path:
                pos = pos * radix + self.rank(p)
            pos *= radix ** (depth - len(path))
            self._leaf_pos[leaf] = pos
        return pos

    def path_ratios(self, leaf: str) -> list[tuple[str, int, int, Fraction]]:
        """``(path, usage_gpu_ms, weight, ratio)`` from the top level down to ``leaf``."""
        return [
            (p, self.usage[p], self.weight[p], self.ratio(p))
            for p in [*ancestors_of(leaf)[1:], leaf]
        ]


class FairShareWalk:
    """Pending allocated workloads in fair-share order, re-ranked after each charge.

    Each internal budget node keeps a heap of its children keyed by
    :func:`sibling_key` on the *working* usage (``usage``, which :meth:`charge`
    increases); a charge pushes fresh keys for the charged path and stale heap
    entries are skipped by version. Each leaf's workloads come from the fold's
    pending index, sorted by (-priority, submit time, id).
    """

    def __init__(
        self,
        state: State,
        view: FairShareView,
        usage: dict[str, int] | None = None,
        requeued: Iterable[Workload] = (),
    ) -> None:
        """``usage``: the working usage to rank by and to charge (default: a copy of
        the view's); ``requeued``: workloads back in the queue that ``state.pending``
        does not hold yet (preempted earlier in the same cycle)."""
        self.usage = view.working() if usage is None else usage
        self.weight = view.weight
        self.scale = view.scale
        self.workloads = state.pending
        # each leaf's keys in order (the fold's lists, read only) and a cursor
        self.queues: dict[str, list[LeafKey]] = state.pending_index.by_leaf
        back = [w for w in requeued if is_allocated(w)]
        if back:
            self.queues = dict(self.queues)
            self.workloads = {**state.pending, **{w.id: w for w in back}}
            for w in back:
                self.queues[w.owner] = sorted([*self.queues.get(w.owner, ()), leaf_key(w)])
        self.shapes: dict[str, dict[Shape, list[LeafKey]]] = state.pending_index.by_shape
        if back:
            self.shapes = dict(self.shapes)
            for w in back:
                mine = self.shapes[w.owner] = dict(self.shapes.get(w.owner, {}))
                shape = shape_of(w)
                mine[shape] = sorted([*mine.get(shape, ()), leaf_key(w)])
        self.pos: dict[str, int] = dict.fromkeys(self.queues, 0)
        self.merged: dict[str, _ShapeMerge] = {}
        """Leaves walked by shape (:meth:`skip_doomed`)."""
        self.doomed: Callable[[str, Shape], object] | None = None
        self.prune: Callable[[str], bool] | None = None
        """If set, asked before the walk enters a budget node: True passes over
        everything under it, as if exhausted (the cycle's ``Pruning.prunable``, core/cycle/prune.py)."""
        self.current: str | None = None  # the leaf being walked
        self.heaps: dict[str, list[tuple[SiblingKey, int]]] = {}
        """Per budget node the walk entered: its children with pending work below, by
        :func:`sibling_key` (built on entry, :meth:`_heap`)."""
        self.version: dict[str, int]
        """Per budget path with pending work below: bumps with each charge (stale heap
        entries are skipped), -1 once passed over or exhausted."""
        self.live: dict[str, list[str]]
        """Per budget node: its children with pending allocated work below (read only:
        the pending index's, kept across cycles, unless work was requeued)."""
        if not back:
            paths, self.live = state.pending_index.live_paths()
            self.version = dict(paths)
            return
        self.version, self.live = paths_above(self.queues)

    def _heap(self, path: str) -> list[tuple[SiblingKey, int]] | None:
        """The heap of ``path``'s children with pending work below, built from their
        working usage when the walk first enters ``path`` (most families of a large
        tree are passed over whole or never reached)."""
        heap = self.heaps.get(path)
        if heap is None:
            children = self.live.get(path)
            if children is None:
                return None
            heap = [self._entry(child) for child in children]
            heapq.heapify(heap)
            self.heaps[path] = heap
        return heap

    def _entry(self, path: str) -> tuple[SiblingKey, int]:
        key = sibling_key(self.usage[path], self.scale[path], self.weight[path], path)
        return (key, self.version[path])

    def __iter__(self) -> FairShareWalk:
        return self

    def __next__(self) -> Workload:
        w = self.next()
        if w is None:
            raise StopIteration
        return w

    def next(self) -> Workload | None:
        """The next workload in fair-share order. While nothing was charged since
        the last one, the order has not changed and the next workload is the
        next one of the same leaf (a leaf's workloads are consecutive)."""
        if self.current is not None:
            w = self._take(self.current)
            if w is not None:
                return w
        return self._best(ROOT)

    def left_in_leaf(self, leaf: str) -> int:
        """How many workloads of ``leaf`` the walk has still to give (an upper bound
        once the leaf is walked by shape)."""
        if leaf in self.merged:
            return len(self.queues[leaf])
        return len(self.queues[leaf]) - self.pos[leaf]

    def skip_doomed(self, leaf: str, doomed: Callable[[str, Shape], object]) -> None:
        """From now on, pass over the workloads of ``leaf`` whose shape ``doomed`` says
        cannot be placed: ``doomed(leaf, shape)`` returns ``None`` for a shape that
        may be, else a token that stays equal (``==``) for as long as the verdict
        holds. A passed-over shape is looked at again once the token changes,
        from where the walk is in the leaf then. The order of the workloads
        that are not passed over does not change."""
        self.doomed = doomed
        if leaf in self.merged:
            return
        i = self.pos[leaf]
        last = self.queues[leaf][i - 1] if i else None
        self.merged[leaf] = _ShapeMerge(self.shapes[leaf], last)

    def _take(self, leaf: str) -> Workload | None:
        """The next workload of ``leaf``, or ``None`` when it has none left."""
        merged = self.merged.get(leaf)
        if merged is not None:
            key = merged.take(leaf, self.doomed)  # type: ignore[arg-type]
            if key is None:
                return None
            self.current = leaf
            return self.workloads[key[2]]
        queue = self.queues[leaf]
        i = self.pos[leaf]
        if i == len(queue):
            return None
        self.pos[leaf] = i + 1
        self.current = leaf
        return self.workloads[queue[i][2]]

    def _best(self, path: str) -> Workload | None:
        if path in self.queues:
            return self._take(path)
        heap = self._heap(path)
        while heap:
            key, version = heap[0]
            child = key[2]
            if version != self.version[child]:
                heapq.heappop(heap)
                continue
            if self.prune is not None and self.prune(child):
                heapq.heappop(heap)
                self.version[child] = -1  # passed over
                continue
            w = self._best(child)
            if w is not None:
                return w
            heapq.heappop(heap)
            self.version[child] = -1  # exhausted
        return None

    def charge(self, w: Workload) -> None:
        """Add ``w``'s projected charge ``gpus * min_runtime`` to its path (the
        working usage) and re-rank the path."""
        charge = w.gpus * w.min_runtime_ms
        self.current = None
        usage = self.usage
        for p in [*ancestors_of(w.owner), w.owner]:
            usage[p] += charge
            if p == ROOT or self.version.get(p, -1) < 0:
                continue
            self.version[p] += 1
            heap = self.heaps.get(parent_of(p))
            if heap is not None:  # (else built from the current usage on entry)
                heapq.heappush(heap, self._entry(p))


class _ShapeMerge:
    """One leaf's queue as a merge of its per-shape lists (all in leaf order), so
    that the lists of shapes that cannot be placed are passed over whole."""

    __slots__ = ("lists", "cursor", "heap", "parked", "token", "last")

    def __init__(self, lists: dict[Shape, list[LeafKey]], last: LeafKey | None) -> None:
        self.lists = lists
        self.cursor: dict[Shape, int] = {}
        self.heap: list[tuple[LeafKey, Shape]] = []
        self.parked: list[Shape] = []
        self.token: object = None
        self.last = last  # the last key taken from the leaf
        heap, cursor = self.heap, self.cursor
        for shape, keys in lists.items():
            i = 0 if last is None else bisect_right(keys, last)
            cursor[shape] = i
            if i < len(keys):
                heap.append((keys[i], shape))
        heapq.heapify(heap)

    def _resume(self, shape: Shape) -> None:
        keys = self.lists[shape]
        i = 0 if self.last is None else bisect_right(keys, self.last)
        self.cursor[shape] = i
        if i < len(keys):
            heapq.heappush(self.heap, (keys[i], shape))

    def take(self, leaf: str, doomed: Callable[[str, Shape], object]) -> LeafKey | None:
        # verdicts only grow while their token stays: a changed token may free them all
        if self.parked and doomed(leaf, self.parked[0]) is not self.token:
            parked, self.parked = self.parked, []
            for shape in parked:
                self._resume(shape)
        heap = self.heap
        while heap:
            key, shape = heap[0]
            token = doomed(leaf, shape)
            if token is not None:
                heapq.heappop(heap)
                self.parked.append(shape)
                self.token = token
                continue
            keys = self.lists[shape]
            i = self.cursor[shape] + 1
            self.cursor[shape] = i
            if i < len(keys):
                heapq.heapreplace(heap, (keys[i], shape))
            else:
                heapq.heappop(heap)
            self.last = key
            return key
        return None


def queue_order(state: State, view: FairShareView | None = None) -> list[Workload]:
    """Pending workloads in the order the next cycle considers them with nothing
    charged yet: allocated work by :class:`FairShareWalk`, then unallocated work
    by submit time, then id."""
    walk = FairShareWalk(state, view or FairShareView(state))
    pending = state.pending
    free = heapq.merge(*state.pending_index.free.values())
    return [*walk, *(pending[wid] for _, wid in free)]
