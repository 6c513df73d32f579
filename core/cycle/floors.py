"""Shortcut: a gang's reservation without every node of the pool.

A gang of ``k`` whole nodes starts when its ``k``-th node comes whole, and holds,
of the nodes whole by then, the ``k`` that come whole last; so it reads only the
``k`` earliest nodes and any node as early as the ``k``-th
(:meth:`WholeNodes.earliest_whole`).

**Floors.** No GPU of a node comes free or preemptible before its floor: the
latest end of a protection or of a notice among the runs on it (the cycle's
time if later; runs that left the node this cycle count as they do in the
release times: freed, or stopping at their notice's end). A pool's nodes are
sorted by floor once, on the first reservation the cycle computes, and visited
in that order; the visit stops at the first floor later than the ``k``-th
earliest time found so far, since no node after it can come whole sooner.
Exact for the rest of the cycle: runs placed later only make nodes come whole
later, and runs preempted later were past their protection, so the floors stay
lower bounds of :meth:`~.reservation.Reserver.release_time`.

Guarded by ``tests/cycle/test_reservation_floors.py``: every call of random
cycles is checked against the reservation over every node (same start, same
nodes, floors never above a release time), and decisions, wake-ups and
reservations are compared with a cycle that reads every node.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from ..nodeindex import Pool
from ..state import Workload

if TYPE_CHECKING:
    from .reservation import Reserver
    from .scratch import Scratch


class WholeNodes:
    """When the nodes of a pool come whole for a gang (module docstring)."""

    def __init__(self, s: Scratch, reserver: Reserver) -> None:
        self.s = s
        self.reserver = reserver
        self._floors: dict[Pool, list[tuple[int, str]]] = {}

    def release_floors(self, key: Pool) -> list[tuple[int, str]]:
        """``(floor, node)`` for the nodes of pool ``key``, sorted: the floor is the
        latest end of a protection or notice among the runs on the node (the cycle's
        time if later), so no GPU of the node comes free or preemptible for anyone
        before it. Computed on first use, after the node-down and drain steps; it stays
        a lower bound of :meth:`~.reservation.Reserver.release_time` with ``k=None``
        for the rest of the cycle (module docstring)."""
        floors = self._floors.get(key)
        if floors is None:
            s = self.s
            t = s.t
            nodes, running, gone, noticed = s.state.nodes, s.state.running, s.gone, s.noticed
            floors = []
            for n in s.pool_nodes[key]:
                floor = t
                for wid in nodes[n].workloads:
                    if wid in gone:  # as gpu_release_times: freed, or stopping with notice
                        end = noticed.get(wid, t)
                    else:
                        v = running[wid]
                        stop = v.stopping
                        end = v.protected_until_ms if stop is None else stop.until_ms
                    if end > floor:
                        floor = end
                floors.append((floor, n))
            floors.sort()
            self._floors[key] = floors
        return floors

    def earliest_whole(
        self,
        c: Workload,
        key: Pool,
        k: int,
        subtrees: dict[str, None],
        memo: dict[tuple[str, int], int],
    ) -> list[tuple[int, str]]:
        """``(time the node comes whole for c, node)`` sorted, for at least the ``k``
        earliest nodes of pool ``key`` and every node as early as the ``k``-th: all a
        gang's reservation reads. Nodes are visited by their floor
        (:meth:`release_floors`) and the visit stops at a floor later than the
        ``k``-th earliest time found, since no node after it can come sooner."""
        release_time = self.reserver.release_time
        kth: list[int] = []  # the k earliest times so far, negated (a max-heap)
        ready: list[tuple[int, str]] = []
        for floor, n in self.release_floors(key):
            if len(kth) == k and floor > -kth[0]:
                break
            at = release_time(c, n, subtrees, memo, None)
            ready.append((at, n))
            if len(kth) < k:
                heapq.heappush(kth, -at)
            elif at < -kth[0]:
                heapq.heapreplace(kth, -at)
        ready.sort()
        return ready
