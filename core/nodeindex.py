"""An index of the cluster's nodes that the fold keeps current, so that a
scheduling cycle starts in time proportional to the pools, not the nodes.

Derived from :attr:`State.nodes` (rebuilt on restore, never snapshotted).
Every list is sorted by node id, so reading it never depends on dict or set
order.
"""

from __future__ import annotations

from bisect import bisect_left, insort

Pool = tuple[str, int]
"""``(gpu_type, gpus per node)``"""


class NodeIndex:
    __slots__ = ("node_ids", "buckets", "pool_nodes", "pool_free", "down", "draining")

    def __init__(self) -> None:
        self.node_ids: list[str] = []
        """Every node."""
        self.buckets: dict[Pool, dict[int, list[str]]] = {}
        """Healthy nodes by pool and free GPUs."""
        self.pool_nodes: dict[Pool, list[str]] = {}
        """Healthy nodes by pool."""
        self.pool_free: dict[Pool, int] = {}
        """Free GPUs on the healthy nodes of each pool."""
        self.down: list[str] = []
        self.draining: list[str] = []

    def register(self, name: str) -> None:
        insort(self.node_ids, name)

    def add_healthy(self, name: str, pool: Pool, free: int) -> None:
        insort(self.buckets.setdefault(pool, {}).setdefault(free, []), name)
        insort(self.pool_nodes.setdefault(pool, []), name)
        self.pool_free[pool] = self.pool_free.get(pool, 0) + free

    def remove_healthy(self, name: str, pool: Pool, free: int) -> None:
        self._unbucket(name, pool, free)
        self.pool_nodes[pool].remove(name)
        self.pool_free[pool] -= free
        if not self.pool_nodes[pool]:
            del self.buckets[pool], self.pool_nodes[pool], self.pool_free[pool]

    def move(self, name: str, pool: Pool, old_free: int, new_free: int) -> None:
        """A healthy node's free GPUs changed (the fold's hot path: :meth:`_unbucket`
        spelled inline)."""
        buckets = self.buckets[pool]
        names = buckets[old_free]
        del names[bisect_left(names, name)]  # sorted by id
        if not names:
            del buckets[old_free]
        into = buckets.get(new_free)
        if into is None:
            buckets[new_free] = [name]
        else:
            insort(into, name)
        self.pool_free[pool] += new_free - old_free

    def _unbucket(self, name: str, pool: Pool, free: int) -> None:
        names = self.buckets[pool][free]
        del names[bisect_left(names, name)]  # sorted by id
        if not names:
            del self.buckets[pool][free]

    def set_health(self, name: str, old: str, new: str) -> None:
        """Keep the down and draining lists (healthy membership is the caller's)."""
        for health, names in (("down", self.down), ("draining", self.draining)):
            if old == health:
                names.remove(name)
            if new == health:
                insort(names, name)
