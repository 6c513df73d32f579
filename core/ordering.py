"""Hierarchical fair-share ordering of pending workloads.

The order (DESIGN "Ordering"), a total order, lowest key first:

1. allocated workloads (``min_runtime > 0``) before unallocated ones;
2. allocated: the ancestors' ratios ``usage / weight`` from the top level down,
   compared lexicographically, each only against its siblings (lower = more
   under-served = first); ties between siblings: larger weight first, then path;
3. inside one leaf: higher ``priority`` first;
4. earlier submit time first (a requeued workload keeps its original submit time);
5. workload id.

Unallocated workloads order by submit time, then id.

Because ratios are only ever compared among siblings, comparing two ratio
sequences lexicographically is the same as comparing the sequences of the
ancestors' *ranks among their siblings*; :class:`FairShareView` computes those
ranks once per time ``t`` (exactly, see :mod:`apportion.core.ratio`), so a key
is a tuple of small integers and sorting 10,000 workloads is cheap.
"""

from __future__ import annotations

from fractions import Fraction

from .budget import ROOT, ancestors_of
from .ratio import ratio, sibling_scales
from .state import State, Workload

SortKey = tuple[int, tuple[int, ...], int, int, str]


class FairShareView:
    """Usage, ratio and sibling rank of every budget node at ``state.now_ms``."""

    __slots__ = ("tree", "usage", "weight", "scale", "_rank", "leaf_ranks")

    def __init__(self, state: State) -> None:
        tree = state.budget
        self.tree = tree
        now, lookback = state.now_ms, state.policy.lookback_ms
        self.usage: dict[str, int] = {
            path: node.series.window(now, lookback) for path, node in tree.nodes.items()
        }
        self.weight: dict[str, int] = {path: node.weight for path, node in tree.nodes.items()}
        self.scale: dict[str, int] = {ROOT: 1}
        """``usage * scale`` orders siblings exactly by ratio (:func:`sibling_scales`)."""
        for node in tree.nodes.values():
            if node.children:
                self.scale.update(sibling_scales({c: self.weight[c] for c in node.children}))
        self._rank: dict[str, int] | None = None
        self.leaf_ranks: dict[str, tuple[int, ...]] = {}

    def ratio(self, path: str) -> Fraction:
        return ratio(self.usage[path], self.weight[path])

    def sibling_key(self, path: str) -> tuple[int, int, str]:
        """Siblings order by ratio (exactly, as ``usage * scale``), then larger weight first, then path."""
        return (self.usage[path] * self.scale[path], -self.weight[path], path)

    @property
    def rank(self) -> dict[str, int]:
        """Each node's rank among its siblings (computed on first use)."""
        if self._rank is None:
            self._rank = {ROOT: 0}
            for node in self.tree.nodes.values():
                for i, child in enumerate(sorted(node.children, key=self.sibling_key)):
                    self._rank[child] = i
        return self._rank

    def ranks_of(self, leaf: str) -> tuple[int, ...]:
        """Ranks among siblings of ``leaf``'s ancestors (top level down) and of ``leaf``."""
        ranks = self.leaf_ranks.get(leaf)
        if ranks is None:
            ranks = tuple(self.rank[p] for p in [*ancestors_of(leaf)[1:], leaf])
            self.leaf_ranks[leaf] = ranks
        return ranks

    def sort_key(self, w: Workload) -> SortKey:
        if w.min_runtime_ms > 0:
            return (0, self.ranks_of(w.owner), -w.priority, w.submitted_ms, w.id)
        return (1, (), 0, w.submitted_ms, w.id)

    def path_ratios(self, leaf: str) -> list[tuple[str, int, int, Fraction]]:
        """``(path, usage_gpu_ms, weight, ratio)`` from the top level down to ``leaf``."""
        return [
            (p, self.usage[p], self.weight[p], self.ratio(p))
            for p in [*ancestors_of(leaf)[1:], leaf]
        ]


def queue_order(state: State, view: FairShareView | None = None) -> list[Workload]:
    """Pending workloads in scheduling order."""
    view = view or FairShareView(state)
    return sorted(state.pending.values(), key=view.sort_key)
