"""Running allocated work still inside its protection, summed per owner leaf.

The ordering counts *committed* usage: for each running allocated workload,
``gpus x (protected_until - now)`` while it is protected
(:func:`apportion.core.ordering.committed_charges`). Summing that over every
running workload costs a pass over all of them in every cycle; this index keeps,
per leaf, ``sum(gpus x protected_until)`` and ``sum(gpus)`` of the protected
ones, so the committed charge of a leaf at ``now`` is
``weighted - now x gpus``: a pass over the leaves instead. The same two sums
are kept per budget path too (the owner leaf and its ancestors below the root),
so a cycle reads the committed charge of the few budget nodes it looks at
(:meth:`ProtectionIndex.committed_under`) without summing every leaf up the tree.

A derived part of :class:`~apportion.core.state.State` (rebuilt on restore, not
in the snapshot). The fold adds a workload when it is placed and removes it
when its run ends; an entry whose protection has run out leaves when a later
reader asks (:meth:`ProtectionIndex.committed`). Time never goes back in the
fold, so an entry that ran out never counts again, and the sums are the same
whenever the pruning happens.
"""

from __future__ import annotations

import heapq

from .budget import ancestors_of


class ProtectionIndex:
    __slots__ = ("_heap", "_live", "_weighted", "_gpus", "_seq", "_under", "_chains")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, str]] = []
        """``(protected_until, entry number, workload)``; stale entries are skipped."""
        self._live: dict[str, tuple[str, int, int, int]] = {}
        """workload -> ``(leaf, gpus, protected_until, entry number)``."""
        self._weighted: dict[str, int] = {}
        self._gpus: dict[str, int] = {}
        self._seq = 0
        self._under: dict[str, tuple[int, int]] = {}
        """Per budget path (the owner leaves and their ancestors, not the root):
        ``(sum(gpus x protected_until), sum(gpus))`` of the runs under it."""
        self._chains: dict[str, tuple[str, ...]] = {}
        """leaf -> the paths it sums into: its ancestors below the root, then itself."""

    def _paths(self, leaf: str, gpus: int, weighted: int) -> None:
        """Add ``(weighted, gpus)`` (negative: take away) to every path of ``leaf``'s."""
        chain = self._chains.get(leaf)
        if chain is None:
            chain = self._chains[leaf] = (*ancestors_of(leaf)[1:], leaf)
        under = self._under
        for p in chain:
            old = under.get(p)
            if old is None:
                under[p] = (weighted, gpus)
            elif old[1] + gpus:
                under[p] = (old[0] + weighted, old[1] + gpus)
            else:  # the last run under ``p``: both sums are back to 0
                del under[p]

    def add(self, workload: str, leaf: str, gpus: int, protected_until_ms: int) -> None:
        """Index a protected run (the fold's hot path: :meth:`_sum` spelled inline)."""
        live = self._live
        if workload in live:
            self.remove(workload)
        self._seq = seq = self._seq + 1
        live[workload] = (leaf, gpus, protected_until_ms, seq)
        heapq.heappush(self._heap, (protected_until_ms, seq, workload))
        sums, weighted = self._gpus, self._weighted
        total = sums.get(leaf, 0) + gpus
        if total:
            sums[leaf] = total
            weighted[leaf] = weighted.get(leaf, 0) + gpus * protected_until_ms
        else:
            sums.pop(leaf, None)
            weighted.pop(leaf, None)
        self._paths(leaf, gpus, gpus * protected_until_ms)

    def remove(self, workload: str) -> None:
        """Drop a run, if indexed (the fold's hot path: :meth:`_sum` spelled inline)."""
        entry = self._live.pop(workload, None)
        if entry is not None:
            leaf, gpus, until, _ = entry
            sums, weighted = self._gpus, self._weighted
            total = sums.get(leaf, 0) - gpus
            if total:
                sums[leaf] = total
                weighted[leaf] = weighted.get(leaf, 0) - gpus * until
            else:  # the last one of the leaf: both sums are back to 0
                sums.pop(leaf, None)
                weighted.pop(leaf, None)
            self._paths(leaf, -gpus, -gpus * until)

    def _sum(self, leaf: str, gpus: int, until: int, sign: int) -> None:
        total = self._gpus.get(leaf, 0) + sign * gpus
        if total:
            self._gpus[leaf] = total
            self._weighted[leaf] = self._weighted.get(leaf, 0) + sign * gpus * until
        else:  # the last one of the leaf: both sums are back to 0
            self._gpus.pop(leaf, None)
            self._weighted.pop(leaf, None)
        self._paths(leaf, sign * gpus, sign * gpus * until)

    def expire(self, now_ms: int) -> None:
        """Drop the runs whose protection has run out by ``now_ms``."""
        self._expire(now_ms)

    def _expire(self, now_ms: int) -> None:
        heap, live = self._heap, self._live
        while heap and heap[0][0] <= now_ms:
            until, seq, workload = heapq.heappop(heap)
            entry = live.get(workload)
            if entry is not None and entry[3] == seq:
                del live[workload]
                self._sum(entry[0], entry[1], until, -1)

    def committed(self, now_ms: int) -> dict[str, int]:
        """Per leaf with protected running work: ``sum(gpus x (protected_until - now))``."""
        self._expire(now_ms)
        return {leaf: self._weighted[leaf] - now_ms * g for leaf, g in self._gpus.items()}

    def committed_under(self, path: str, now_ms: int) -> int:
        """``sum(gpus x (protected_until - now))`` of the protected runs whose owner leaf
        is ``path`` or lies under it (not the root): the sum of :meth:`committed` over
        those leaves. Call :meth:`expire` with ``now_ms`` first."""
        sums = self._under.get(path)
        return 0 if sums is None else sums[0] - now_ms * sums[1]

    def entry(self, workload: str) -> tuple[str, int, int] | None:
        """``(leaf, gpus, protected_until)`` of a workload in the index."""
        entry = self._live.get(workload)
        return None if entry is None else entry[:3]
