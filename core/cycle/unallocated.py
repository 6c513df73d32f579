"""Step 4: unallocated work (``min_runtime == 0``) by submit time, then id.

Placed if it fits, while any GPU is free; it never preempts. So GPUs only get
fewer: once ``g`` GPUs of a type did not fit, no request of that type for ``g``
or more will, unless a pool takes it that could not take ``g`` (the rule of
:mod:`.memo`, checked here without a call per workload). Work requeued by steps
1-2 joins the queue in order.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from ..nodeindex import Pool
from ..pendingindex import FreeKey, FreeShape, free_key
from ..rules.contract import is_allocated
from ..rules.gpu_types import is_any
from .attempt import Attempt
from .memo import FailureMemo

if TYPE_CHECKING:
    from .scratch import Scratch


def place_unallocated(s: Scratch, attempt: Attempt, memo: FailureMemo) -> None:
    """Step 4 (module docstring).

    The queue is walked as a merge of its sizes (``(gpu_type, gpus)``, each in
    submit order): a size that failed where every pool of its type took it, or a
    larger one of the type, leaves the merge whole, so a long queue of work that
    cannot fit costs a step per size, not per workload. The order of what is
    tried is the queue's own."""
    pool_free = s.pool_free
    if not any(pool_free.values()):
        return
    pending = s.state.pending
    sizes: dict[FreeShape, list[FreeKey]] = s.state.pending_index.free
    requeued = {w.id: w for w in s.requeued if not is_allocated(w)}
    if requeued:
        sizes = dict(sizes)
        for w in requeued.values():
            size = (w.gpu_type, w.gpus)
            sizes[size] = sorted([*sizes.get(size, ()), free_key(w)])
    # the head of each size: (its key, the size, where it is in the size's list)
    heads = [(keys[0], size, 0) for size, keys in sizes.items()]
    heapq.heapify(heads)
    # fewest GPUs of a type that failed where every pool of the type took them (the
    # usual case: its sizes leave the merge), and where only some did (nodes of
    # several sizes; see FailureMemo.pools_taking; checked workload by workload)
    failed_everywhere: dict[str, int] = {}
    failed_partly: dict[str, tuple[int, frozenset[Pool]]] = {}
    place = attempt.place
    while heads:
        (_, wid), size, i = heads[0]
        gpu_type, gpus = size
        failed = failed_everywhere.get(gpu_type)
        if failed is not None and gpus >= failed:
            heapq.heappop(heads)  # this size, and every later workload of it, cannot fit
            continue
        keys = sizes[size]
        if i + 1 < len(keys):
            heapq.heapreplace(heads, (keys[i + 1], size, i + 1))
        else:
            heapq.heappop(heads)
        if failed_partly:
            partly = failed_partly.get(gpu_type)
            if (
                partly is not None
                and gpus >= partly[0]
                and memo.rules_out(partly[1], gpu_type, gpus)
            ):
                continue
        w = pending.get(wid) or requeued[wid]
        if place(w):
            if not any(pool_free.values()):
                return
            continue
        taking = memo.pools_taking(gpu_type, gpus)
        if taking is memo.every_pool[gpu_type]:
            if failed is None or gpus < failed:
                failed_everywhere[gpu_type] = gpus
            if is_any(gpu_type) and gpus == 1:
                return  # not one GPU free anywhere that this cycle may use
        else:
            partly = failed_partly.get(gpu_type)
            if partly is None or gpus < partly[0]:
                failed_partly[gpu_type] = (gpus, taking)
