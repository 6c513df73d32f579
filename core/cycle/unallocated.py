"""Step 4: unallocated work (``min_runtime == 0``) by submit time, then id.

Placed if it fits, while any GPU is free; it never preempts. So GPUs only get
fewer: once ``g`` GPUs of a type did not fit, no request of that type for ``g``
or more will, unless a pool takes it that could not take ``g`` (the rule of
:mod:`.memo`, checked here without a call per workload). Work requeued by steps
1-2 joins the queue in order.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..nodeindex import Pool
from ..pendingindex import FreeKey, free_key
from ..rules.contract import is_allocated
from ..rules.gpu_types import is_any
from .attempt import Attempt
from .memo import FailureMemo

if TYPE_CHECKING:
    from .scratch import Scratch


def place_unallocated(s: Scratch, attempt: Attempt, memo: FailureMemo) -> None:
    """Step 4 (module docstring)."""
    pool_free = s.pool_free
    if not any(pool_free.values()):
        return
    pending = s.state.pending
    keys: Iterable[FreeKey] = s.state.pending_index.free
    requeued = {w.id: w for w in s.requeued if not is_allocated(w)}
    if requeued:
        keys = heapq.merge(keys, sorted(free_key(w) for w in requeued.values()))
    # fewest GPUs of a type that failed where every pool of the type took them (the
    # usual case, checked first: once per workload of a long queue), and where
    # only some did (nodes of several sizes; see FailureMemo.pools_taking)
    failed_everywhere: dict[str, int] = {}
    failed_partly: dict[str, tuple[int, frozenset[Pool]]] = {}
    place = attempt.place
    for _, wid in keys:
        w = pending.get(wid) or requeued[wid]
        failed = failed_everywhere.get(w.gpu_type)
        if failed is not None and w.gpus >= failed:
            continue
        if failed_partly:
            partly = failed_partly.get(w.gpu_type)
            if (
                partly is not None
                and w.gpus >= partly[0]
                and memo.rules_out(partly[1], w.gpu_type, w.gpus)
            ):
                continue
        if place(w):
            if not any(pool_free.values()):
                return
            continue
        taking = memo.pools_taking(w.gpu_type, w.gpus)
        if taking is memo.every_pool[w.gpu_type]:
            if failed is None or w.gpus < failed:
                failed_everywhere[w.gpu_type] = w.gpus
            if is_any(w.gpu_type) and w.gpus == 1:
                return  # not one GPU free anywhere that this cycle may use
        else:
            partly = failed_partly.get(w.gpu_type)
            if partly is None or w.gpus < partly[0]:
                failed_partly[w.gpu_type] = (w.gpus, taking)
