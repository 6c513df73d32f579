"""The budget tree: nodes named by slash paths, each with a weight and an owner.

The root is the path ``""``. A node's share is ``weight / sum(sibling weights)``;
its global share is the product of shares up to the root. Every node keeps a
:class:`~apportion.core.usage.ChargeSeries` of the allocated GPU time charged to
its subtree; a charge to a leaf is a charge to every ancestor, so a parent's
series is the sum of its children's (plus history of removed children).
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

import msgspec
from msgspec import UNSET, UnsetType

from .ratio import sibling_scales
from .usage import ChargeSeries, PeerSeries

ROOT = ""
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class BudgetNode(msgspec.Struct, kw_only=True):
    path: str
    weight: int
    owner: str
    children: list[str] = msgspec.field(default_factory=list)
    """Child paths in the order they were created."""
    series: ChargeSeries = msgspec.field(default_factory=ChargeSeries)
    peer: PeerSeries | UnsetType = UNSET
    """The subtree's charges on the other clusters of a federation (usage
    summaries); unset, and then not encoded, until one charges it."""

    def charged(self, now_ms: int, lookback_ms: int) -> int:
        """GPU-ms charged to the subtree inside the window, on this cluster and,
        from their summaries, on its peers."""
        own = self.series.window(now_ms, lookback_ms)
        peer = self.peer
        return own if isinstance(peer, UnsetType) else own + peer.window(now_ms, lookback_ms)

    def peer_charged(self, now_ms: int, lookback_ms: int) -> int:
        """The part of :meth:`charged` used on other clusters."""
        peer = self.peer
        return 0 if isinstance(peer, UnsetType) else peer.window(now_ms, lookback_ms)


def parent_of(path: str) -> str:
    """``"a/b/c" -> "a/b"``, ``"a" -> ""`` (the root)."""
    cut = path.rfind("/")
    return path[:cut] if cut >= 0 else ROOT


@lru_cache(maxsize=1 << 16)
def ancestors_of(path: str) -> tuple[str, ...]:
    """Proper ancestors from the root down: ``"a/b/c" -> ("", "a", "a/b")`` (a pure
    function of the string, cached: the fold and every cycle ask it per workload)."""
    if not path:
        return ()
    parts = path.split("/")
    return (ROOT, *("/".join(parts[:i]) for i in range(1, len(parts))))


def path_error(path: str) -> str | None:
    """Why ``path`` is not a well-formed node path, or ``None``."""
    if path == ROOT:
        return None
    for segment in path.split("/"):
        if not _SEGMENT.match(segment):
            return (
                f"bad budget path {path!r}: segments are letters, digits, '_', '.', '-' "
                "separated by '/'"
            )
    return None


class BudgetTree:
    """Nodes by path plus the derived caches the fold needs (rebuilt, never stored)."""

    __slots__ = ("nodes", "_chains", "_owners", "_weights", "_shape")

    def __init__(self, nodes: dict[str, BudgetNode] | None = None) -> None:
        self.nodes: dict[str, BudgetNode] = (
            nodes if nodes is not None else {ROOT: BudgetNode(path=ROOT, weight=1, owner="")}
        )
        self._chains: dict[str, tuple[ChargeSeries, ...]] = {}
        self._owners: dict[str, tuple[str, ...]] = {}
        self._weights: tuple[dict[str, int], dict[str, int]] | None = None
        """:meth:`weights_and_scales`, cleared by every change of the tree."""
        self._shape: tuple[int, int] | None = None
        """:meth:`shape`, cleared by every change of the tree."""
        """The owners of ``path`` and of its ancestors (for :meth:`owns`); cleared by
        every change of the tree (an owner changes only in :meth:`set_node`)."""

    # -- reading -------------------------------------------------------
    @property
    def root(self) -> BudgetNode:
        return self.nodes[ROOT]

    def is_leaf(self, path: str) -> bool:
        node = self.nodes.get(path)
        return node is not None and path != ROOT and not node.children

    def leaves(self) -> list[str]:
        return [p for p, n in self.nodes.items() if p != ROOT and not n.children]

    def chain(self, path: str) -> tuple[ChargeSeries, ...]:
        """The charge series of ``path`` and all its ancestors (the root included)."""
        chain = self._chains.get(path)
        if chain is None:
            chain = tuple(self.nodes[p].series for p in [*ancestors_of(path), path])
            self._chains[path] = chain
        return chain

    def deepest(self, path: str) -> str:
        """``path`` if the tree has it, else its nearest ancestor that it has."""
        nodes = self.nodes
        while path not in nodes:
            path = parent_of(path)
        return path

    def weights_and_scales(self) -> tuple[dict[str, int], dict[str, int]]:
        """Every node's weight, and its scale among its siblings
        (:func:`~apportion.core.ratio.sibling_scales`; the root's is 1). Computed once
        per version of the tree (every cycle asks): read only."""
        if self._weights is None:
            weight = {path: node.weight for path, node in self.nodes.items()}
            scale = {ROOT: 1}
            for node in self.nodes.values():
                if node.children:
                    scale.update(sibling_scales({c: weight[c] for c in node.children}))
            self._weights = (weight, scale)
        return self._weights

    def shape(self) -> tuple[int, int]:
        """``(radix, depth)``: the most children any node has (at least 1) and the
        depth of the deepest leaf (top level = 1). Computed once per version of the
        tree."""
        if self._shape is None:
            radix = max((len(n.children) for n in self.nodes.values()), default=1)
            depth = max((p.count("/") + 1 for p in self.nodes if p != ROOT), default=0)
            self._shape = (max(radix, 1), depth)
        return self._shape

    def may_edit(self, actor: str, path: str) -> bool:
        """``actor`` owns a proper ancestor of ``path`` (for the root: owns the root,
        or the root has no owner yet)."""
        if path == ROOT:
            owner = self.root.owner
            return owner == "" or owner == actor
        return any(self.nodes[a].owner == actor for a in ancestors_of(path) if a in self.nodes)

    def owns(self, actor: str, path: str) -> bool:
        """``actor`` owns ``path`` or a node above it (the root included)."""
        if not actor:
            return False
        owners = self._owners.get(path)
        if owners is None:
            nodes = self.nodes
            owners = tuple(nodes[a].owner for a in (*ancestors_of(path), path) if a in nodes)
            self._owners[path] = owners
        return actor in owners

    def share(self, path: str) -> Fraction:
        """``weight / sum(sibling weights)`` (1 for the root)."""
        if path == ROOT:
            return Fraction(1)
        node = self.nodes[path]
        parent = self.nodes[parent_of(path)]
        total = sum(self.nodes[c].weight for c in parent.children)
        return Fraction(node.weight, total)

    def global_share(self, path: str) -> Fraction:
        """Product of shares from ``path`` up to the root."""
        out = Fraction(1)
        p = path
        while p != ROOT:
            out *= self.share(p)
            p = parent_of(p)
        return out

    def depth_first(self) -> list[str]:
        """Every path, parents before children, children in creation order."""
        out: list[str] = []
        stack = [ROOT]
        while stack:
            p = stack.pop()
            out.append(p)
            stack.extend(reversed(self.nodes[p].children))
        return out

    # -- changing (validated by the caller) -----------------------------
    def set_node(self, path: str, weight: int, owner: str) -> None:
        self._owners.clear()
        self._weights = None
        self._shape = None
        node = self.nodes.get(path)
        if node is not None:
            node.weight = weight
            node.owner = owner
            return
        self.nodes[path] = BudgetNode(path=path, weight=weight, owner=owner)
        self.nodes[parent_of(path)].children.append(path)
        self._chains.clear()

    def remove_node(self, path: str) -> None:
        del self.nodes[path]
        self.nodes[parent_of(path)].children.remove(path)
        self._chains.clear()
        self._owners.clear()
        self._weights = None
        self._shape = None
