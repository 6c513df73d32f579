"""Step 3b: the cheapest victim set that makes a workload fit.

Possible victims: unallocated work, and allocated work past its protection that
the candidate clearly outranks (:meth:`~apportion.core.rules.outranking.Outranking.may_preempt`).
Cost, compared in order (:meth:`~.victims.VictimIndex.set_cost`): fewest
allocated victims (unallocated ones first), the most over-served owners (the
least over-served victim as over-served as possible), fewest GPUs freed beyond
need, victim ids, node ids.

The search reaches that minimum without visiting every node (docs/cycle.md,
"Speed"); each step below keeps the candidates and their costs, so the choice
is the plain search's:

- a pool that could not give the request even counting every GPU it could free
  is passed over (:mod:`.poolbound`);
- for a request of one node or less, a node where free and unallocated GPUs
  reach it gives the cheapest set of its pool, unallocated work alone, found in
  the kept per-pool lists (:mod:`.roomy`);
- otherwise every node needs an allocated victim, so a node's cost is at least
  ``(1, -position of its most over-served possible victim)``: nodes are visited
  in that order and the search stops once the bound is above the best set; a
  node whose fewest allocated victims cannot beat the best is skipped before its
  set is built (:meth:`Preemption.cannot_beat`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..nodeindex import Pool
from ..placement import Slots
from ..rules.contract import is_allocated
from ..state import ClusterNode, Workload
from .poolbound import PoolBound
from .victims import SetCost

if TYPE_CHECKING:
    from .scratch import Scratch


class Preemption:
    """The victim search of step 3b (module docstring)."""

    def __init__(self, s: Scratch, bound: PoolBound) -> None:
        self.s = s
        self.bound = bound

    def search(self, c: Workload) -> tuple[list[Workload], Slots] | None:
        """The cheapest victim set that makes ``c`` fit, and where ``c`` then goes."""
        s = self.s
        victims = s.victims
        victims.index()
        roomy = s.roomy
        may_use, free_of, nodes, gone = s.may_use, s.free, s.state.nodes, s.gone
        victimable = victims.victimable
        g = c.gpus
        subtrees: dict[str, None] | None = None  # computed once a pool passes the bound
        best: tuple[SetCost, list[Workload], list[tuple[str, int]]] | None = None
        for key in s.pools_for(c):
            size = key[1]
            if g > size and g % size:
                continue
            need = 1 if g <= size else g // size
            want = g if g <= size else size
            if self.bound.short(c.owner, key, g):
                continue  # not enough free and preemptible GPUs in the whole pool
            if subtrees is None:
                subtrees = s.outranking_for(c).victim_subtrees(c.owner)
            ranked = roomy.nodes(key) if g <= size else None
            if ranked and ranked[0][0] <= -g:
                name = roomy.cheapest_unallocated(c, key, g)
                if name is not None:  # the best of this pool: no need to look further
                    node = nodes[name]
                    unalloc = [
                        v
                        for v in victimable.get(name, ())
                        if v.id not in gone and not is_allocated(v)
                    ]
                    chosen = victims.cheapest_on_node(unalloc, node, free_of[name], g)
                    cost = roomy.cost(key, g, name)
                    if best is None or cost < best[0]:
                        best = (cost, chosen, [(name, g)])
                    continue
            names = [n for n in self.candidate_nodes(c, key, want, subtrees) if may_use(c, n)]
            if len(names) < need:
                continue
            if g <= size:
                # Every node here needs an allocated victim (a node where unallocated
                # work alone would do was taken above), so a node's cost is at least
                # (1, -position of its most over-served possible victim): visit them
                # most over-served first and stop once that bound is above the best.
                positions = self.victim_positions(c, key, subtrees)
                names.sort(key=lambda n: (-positions.get(n, -1), n))
                for name in names:
                    if best is not None and (1, -positions.get(name, -1)) > best[0][:2]:
                        break
                    node = nodes[name]
                    free = free_of[name]
                    on = victims.on(c, name, subtrees)
                    if free + sum(node.workloads[v.id] for v in on) < g:
                        continue
                    if best is not None and self.cannot_beat(best[0], on, node, free, g):
                        continue
                    chosen = victims.cheapest_on_node(on, node, free, g)
                    freed = sum(node.workloads[v.id] for v in chosen)
                    elsewhere = sum(v.gpus for v in chosen) - freed
                    cost = victims.set_cost(chosen, free + freed - g + elsewhere, name)
                    if best is None or cost < best[0]:
                        best = (cost, chosen, [(name, g)])
            else:
                best = self._whole_nodes(c, key, names, need, subtrees, best)
        if best is None or not best[1]:
            return None
        return best[1], best[2]

    def _whole_nodes(
        self,
        c: Workload,
        key: Pool,
        names: list[str],
        need: int,
        subtrees: dict[str, None],
        best: tuple[SetCost, list[Workload], list[tuple[str, int]]] | None,
    ) -> tuple[SetCost, list[Workload], list[tuple[str, int]]] | None:
        """``best``, or the cheapest ``need`` whole nodes of pool ``key`` for a gang if
        they cost less."""
        s = self.s
        victims = s.victims
        size = key[1]
        g = c.gpus
        options: list[tuple[SetCost, str, list[Workload]]] = []
        for name in names:
            if s.added.get(name):
                continue  # holds work placed this cycle, which is protected
            node = s.state.nodes[name]
            on = victims.on(c, name, subtrees)
            if s.free[name] + sum(node.workloads[v.id] for v in on) < size:
                continue
            options.append((victims.set_cost(on, 0, name), name, on))
        if len(options) < need:
            return best
        options.sort(key=lambda o: o[0])
        picked = options[:need]
        seen: dict[str, Workload] = {}
        for _, _, on in picked:
            for v in on:
                seen[v.id] = v
        chosen = sorted(seen.values(), key=lambda v: v.id)
        excess = sum(v.gpus for v in chosen) + sum(s.free[n] for _, n, _ in picked) - g
        cost = victims.set_cost(chosen, excess, picked[0][1])
        if best is None or cost < best[0]:
            return (cost, chosen, [(n, size) for _, n, _ in sorted(picked, key=lambda o: o[1])])
        return best

    def candidate_nodes(
        self, c: Workload, key: Pool, want: int, subtrees: dict[str, None]
    ) -> list[str]:
        """Nodes of pool ``key`` that might offer ``want`` GPUs to ``c``, by id: an upper
        bound of what ``c`` could have there (free, unallocated and the expired work
        of its own leaf and of the subtrees it outranks) is at least ``want``."""
        s = self.s
        free, unalloc = s.free, s.victims.node_unalloc
        expired = s.victims.expired_on(c.owner, key, subtrees)
        found: list[str] = []
        for room, n in s.roomy.nodes(key):
            if -room < want:
                break
            found.append(n)
        for n, gpus in expired.items():
            if free[n] + unalloc.get(n, 0) < want <= free[n] + unalloc.get(n, 0) + gpus:
                found.append(n)
        return sorted(found)

    def victim_positions(self, c: Workload, key: Pool, subtrees: dict[str, None]) -> dict[str, int]:
        """Per node of pool ``key`` with expired allocated work of ``c``'s leaf or of a
        leaf ``c`` outranks: the highest fair-share position among those leaves (the
        most over-served victim ``c`` could find there)."""
        s = self.s
        pool = s.pool_set(key)
        covered = s.outranking_for(c).covered
        path_nodes = s.victims.path_nodes
        out: dict[str, int] = {}
        for position, leaf in s.victims.expired_leaves():
            if leaf != c.owner and not covered(leaf, subtrees):
                continue
            for n in path_nodes[leaf]:
                if n in pool and n not in out:
                    out[n] = position
        return out

    def cannot_beat(
        self, best: SetCost, victims: list[Workload], node: ClusterNode, free: int, g: int
    ) -> bool:
        """Whether no victim set on ``node`` can cost less than ``best``: a lower bound
        of its first two cost terms is above ``best``'s (at least the fewest allocated
        victims that free enough, the largest first; and no victim more over-served
        than the most over-served of them)."""
        if best[0] == 0:
            return False  # decided on later terms: not worth a bound
        need = g - free
        sizes: list[int] = []
        most = -1
        position = self.s.view.leaf_position
        for v in victims:
            if is_allocated(v):
                sizes.append(node.workloads[v.id])
                most = max(most, position(v.owner))
            else:
                need -= node.workloads[v.id]
        if need <= 0:
            return False  # unallocated victims alone suffice: cost term 0
        sizes.sort(reverse=True)
        fewest = 0
        for size in sizes:
            fewest += 1
            need -= size
            if need <= 0:
                break
        return (fewest, -most) > best[:2]
