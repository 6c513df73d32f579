"""Shortcut: per pool, only the nodes that have free or unallocated GPUs.

**Roomy nodes.** :meth:`RoomyNodes.nodes` lists ``(-(free + unallocated GPUs),
node)`` of a pool's nodes that have any, most first, then by id. A node with
neither offers no request anything without an allocated victim, and in a full
cluster that is most nodes, so they are left out. Built on first use from the
free-GPU buckets and the nodes with unallocated work, then kept up to date by
:meth:`RoomyNodes.changed` at every change of a node's free or unallocated GPUs
(:meth:`~.scratch.Scratch.set_free`, :meth:`~.victims.VictimIndex.count`).
Exact: it is the pool's whole sorted list with the zero entries dropped, and
every reader stops at (or skips) entries below what it needs.

**The cheapest set of unallocated victims.** On a node whose free and
unallocated GPUs reach ``g``, the cheapest victim set takes unallocated work
only (it comes first in the victim order), so its cost (no allocated victim,
then GPUs freed beyond need, victim ids, node) is the same for every
candidate, and beats every node that needs an allocated victim. Per pool and
``g`` the nodes are kept sorted by that cost
(:meth:`RoomyNodes.cheapest_unallocated` takes the first one the reservation
gate lets the candidate use), found among the roomy nodes and updated with them.

Guarded by ``tests/cycle/test_roomy_nodes.py``: every list a cycle reads is
checked against the pool's whole sorted list, every node chosen for
unallocated victims alone against the cheapest over every node of the pool,
and the decisions against the cycle without the checks.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING

from ..nodeindex import Pool
from ..state import Workload
from .victims import SetCost

if TYPE_CHECKING:
    from .scratch import Scratch


class RoomyNodes:
    """The roomy-node lists and the cheapest unallocated sets per pool (module docstring)."""

    def __init__(self, s: Scratch) -> None:
        self.s = s
        self._roomy: dict[Pool, list[tuple[int, str]]] = {}
        """Per pool: ``(-(free + unallocated GPUs), node)`` sorted, of the nodes with
        any, kept up to date by :meth:`changed` once built (:meth:`nodes`)."""
        self._cheap: dict[
            tuple[Pool, int], tuple[list[tuple[SetCost, str]], dict[str, SetCost]]
        ] = {}
        """(pool, GPUs) -> nodes by :meth:`unallocated_cost` (sorted, and by node)."""
        self._cheap_sizes: dict[Pool, list[int]] = {}

    def nodes(self, key: Pool) -> list[tuple[int, str]]:
        """``(-(free + unallocated GPUs), node)`` of the pool's nodes that have any, most
        first, then by id (a node with neither offers no request anything: in a full
        cluster that is most of them, so they are left out)."""
        ranked = self._roomy.get(key)
        if ranked is None:
            s = self.s
            free, unalloc = s.free, s.victims.node_unalloc
            pool = s.pool_set(key)
            names = [n for f, on in s.gpus.buckets[key].items() if f for n in on]
            names += [n for n, gpus in unalloc.items() if gpus and not free[n] and n in pool]
            ranked = sorted((-(free[n] + unalloc.get(n, 0)), n) for n in names)
            self._roomy[key] = ranked
        return ranked

    def changed(self, name: str, room: int, delta: int) -> None:
        """Node ``name``'s free + unallocated GPUs went from ``room`` by ``delta``
        (or what it has of either changed): keep the per-pool lists up to date."""
        s = self.s
        node = s.state.nodes[name]
        key = (node.gpu_type, node.gpus)
        ranked = self._roomy.get(key)
        if ranked is not None and delta:
            if room:  # listed, if a node of the pool
                i = bisect_left(ranked, (-room, name))
                listed = i < len(ranked) and ranked[i] == (-room, name)
                if listed:
                    del ranked[i]
            else:  # not listed (nothing to offer)
                listed = name in s.pool_set(key)
            if listed and room + delta:
                insort(ranked, (-(room + delta), name))
        for g in self._cheap_sizes.get(key, ()):
            ranked_costs, costs = self._cheap[(key, g)]
            old = costs.pop(name, None)
            if old is not None:
                del ranked_costs[bisect_left(ranked_costs, (old, name))]
            elif name not in s.pool_set(key):
                continue
            new = self.unallocated_cost(name, g)
            if new is not None:
                costs[name] = new
                insort(ranked_costs, (new, name))

    def unallocated_cost(self, name: str, g: int) -> SetCost | None:
        """The cost of the cheapest set of unallocated victims on ``name`` that frees
        ``g`` GPUs there, or ``None`` if its free and unallocated GPUs fall short."""
        s = self.s
        victims = s.victims
        free = s.free[name]
        if free + victims.node_unalloc.get(name, 0) < g:
            return None
        node = s.state.nodes[name]
        chosen = victims.cheapest_on_node(victims.unallocated_on(name), node, free, g)
        freed = sum(node.workloads[v.id] for v in chosen)
        elsewhere = sum(v.gpus for v in chosen) - freed
        return victims.set_cost(chosen, free + freed - g + elsewhere, name)

    def cost(self, key: Pool, g: int, name: str) -> SetCost:
        """The kept cost of :meth:`cheapest_unallocated`'s node ``name``."""
        return self._cheap[(key, g)][1][name]

    def cheapest_unallocated(self, c: Workload, key: Pool, g: int) -> str | None:
        """The node of pool ``key`` (``g`` <= its node size) that ``c`` may use where
        unallocated victims alone make ``g`` GPUs at the lowest cost, if any."""
        entry = self._cheap.get((key, g))
        if entry is None:
            costs: dict[str, SetCost] = {}
            for room, n in self.nodes(key):  # the nodes with g free + unallocated
                if -room < g:
                    break
                cost = self.unallocated_cost(n, g)
                if cost is not None:
                    costs[n] = cost
            entry = self._cheap[(key, g)] = (sorted((v, n) for n, v in costs.items()), costs)
            self._cheap_sizes.setdefault(key, []).append(g)
        may_use = self.s.may_use
        for _, name in entry[0]:
            if may_use(c, name):
                return name
        return None
