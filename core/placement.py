"""Where a workload fits on the GPUs free now: the placement rule.

One node by **best fit** for a request of at most one node's GPUs: the node
with the fewest free GPUs that still fit, ties by node id, across every pool
of the right GPU type; a larger request takes ``gpus / node size`` **whole
free nodes of one pool**, lowest ids (a gang never mixes pools). Only healthy
nodes; ``gpu_type = "any"`` takes any type.

:class:`FreeGPUs` is the scratch copy of the free GPUs a decision cycle works
on (the scheduling cycle's and the simulator baseline's): it starts from the
fold's :class:`~apportion.core.nodeindex.NodeIndex` and copies a pool's
buckets only when it first changes them, so starting a cycle costs nothing per
node.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable

from .nodeindex import Pool
from .rules.gpu_types import takes
from .state import ClusterNode, State

Slots = list[tuple[str, int]]
"""``(node, GPUs)`` of a placement, by node id."""


class _FreeByNode(dict[str, int]):
    """Free GPUs per node: what this cycle set, else what the state holds."""

    def __init__(self, nodes: dict[str, ClusterNode]) -> None:
        super().__init__()
        self.nodes = nodes

    def __missing__(self, name: str) -> int:
        return self.nodes[name].free


class FreeGPUs:
    """Free GPUs per node, and of healthy nodes by pool, as one cycle changes them."""

    __slots__ = ("nodes", "free", "buckets", "_own", "pool_nodes", "pool_free", "_pools")

    def __init__(self, state: State) -> None:
        index = state.node_index
        self.nodes = state.nodes
        self.free: dict[str, int] = _FreeByNode(state.nodes)
        """Free GPUs of every node (read only: change them with :meth:`set`)."""
        self.buckets: dict[Pool, dict[int, list[str]]] = index.buckets
        """Healthy nodes by pool and free GPUs, each list sorted by id (the fold's
        until a pool first changes, then this cycle's copy)."""
        self._own: dict[Pool, None] = {}
        self.pool_nodes: dict[Pool, list[str]] = index.pool_nodes  # read only
        self.pool_free: dict[Pool, int] = dict(index.pool_free)
        """Free GPUs on the healthy nodes of each pool."""
        self._pools: dict[str, list[Pool]] = {}

    def set(self, name: str, free: int) -> None:
        """Node ``name`` has ``free`` GPUs from now on (in this cycle)."""
        node = self.nodes[name]
        old = self.free[name]
        self.free[name] = free
        if not node.schedulable:
            return
        key = (node.gpu_type, node.gpus)
        if key not in self._own:
            if not self._own:
                self.buckets = dict(self.buckets)
            self.buckets[key] = {f: list(names) for f, names in self.buckets[key].items()}
            self._own[key] = None
        pool = self.buckets[key]
        names = pool[old]
        del names[bisect_left(names, name)]  # each list is sorted by id
        insort(pool.setdefault(free, []), name)
        self.pool_free[key] += free - old

    def pools_for(self, gpu_type: str) -> list[Pool]:
        """The pools a request of ``gpu_type`` may use, in ``(type, node size)`` order
        (the pools do not change during a cycle: cached per type)."""
        pools = self._pools.get(gpu_type)
        if pools is None:
            pools = self._pools[gpu_type] = [
                key for key in sorted(self.buckets) if takes(gpu_type, key[0])
            ]
        return pools

    def fit(
        self, gpus: int, gpu_type: str, may_use: Callable[[str], bool] | None = None
    ) -> Slots | None:
        """Where ``gpus`` GPUs of ``gpu_type`` fit now (see the module docstring), on
        nodes ``may_use`` allows (all if ``None``); ``None`` if nowhere."""
        best: tuple[int, str] | None = None
        for key in self.pools_for(gpu_type):
            size = key[1]
            pool = self.buckets[key]
            if gpus <= size:
                for free in sorted(f for f in pool if f >= gpus and pool[f]):
                    if best is not None and free > best[0]:
                        break
                    for name in pool[free]:
                        if may_use is None or may_use(name):
                            if best is None or (free, name) < best:
                                best = (free, name)
                            break
            elif gpus % size == 0:
                whole = [n for n in pool.get(size, ()) if may_use is None or may_use(n)]
                if len(whole) >= gpus // size:
                    return [(n, size) for n in whole[: gpus // size]]
        if best is not None:
            return [(best[1], gpus)]
        return None
