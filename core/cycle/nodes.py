"""Steps 1 and 2: down and draining nodes.

1. Every workload on a ``down`` node is lost at once (``node_down``; resumable
   ones requeue and join steps 3-4 of the same cycle). A gang spanning several
   nodes is lost whole.
2. On a draining node, unallocated work is preempted at once, allocated work as
   each reaches ``protected_until`` (``drain``); a stopping run (preempted with
   notice) is left to stop. When nothing is left on the node, one ``NodeDrained``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from apportion.schemas.events import NodeDrained

from ..rules.contract import is_protected

if TYPE_CHECKING:
    from .scratch import Scratch


def lose_down_nodes(s: Scratch) -> None:
    """Step 1 (module docstring)."""
    state = s.state
    for name in s.down_nodes:
        node = state.nodes[name]
        if node.workloads:
            for wid in list(node.workloads):
                if wid not in s.gone:
                    s.preempt(state.running[wid], "node_down", None, requeue_now=True)


def drain(s: Scratch) -> None:
    """Step 2 (module docstring)."""
    state = s.state
    for name in s.draining_nodes:
        node = state.nodes[name]
        for wid in list(node.workloads):
            w = state.running[wid]
            if wid not in s.gone and w.stopping is None and not is_protected(w, s.t):
                s.preempt(w, "drain", None, requeue_now=True)
        if not node.drained and all(
            wid in s.gone and wid not in s.noticed for wid in node.workloads
        ):  # stopping runs (with notice) still hold the node
            s.emit(NodeDrained, node=name)
