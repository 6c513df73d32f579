"""Shortcut: a workload is not searched again where a like one just failed.

A failure to place is remembered per *shape*: owner (allocated work only:
unallocated work never preempts, so its owner does not matter), GPU type,
contract kind, reservation gate and whether the workload is held to the
preemption margin (:meth:`FailureMemo.shape`). A later
workload of that shape with no higher priority and at least as many GPUs fails
too, as long as

- no preemption freed GPUs (placements only take GPUs away; a reservation only
  restricts),
- the owner's victim subtrees are the same object (:mod:`.subtrees` keeps the
  object while its content is unchanged); when every pool was short before the
  subtrees were needed (:mod:`.poolbound`), no ratio and no victim changed,
- and no pool takes the larger request that could not take the failed one
  (:meth:`FailureMemo.rules_out`): on nodes of 4 and 8 GPUs, 6 GPUs fit only an
  8-GPU node while 8 GPUs also fit two whole 4-GPU nodes.

so it is skipped without a search (:meth:`FailureMemo.fails`). Step 4 applies
the same rule to unallocated work without a call per workload
(:mod:`.unallocated`), and :mod:`.doomed` extends it to the rest of a leaf's queue.

Guarded by ``tests/cycle/test_mixed_node_sizes.py`` (requests a smaller failure
cannot rule out) and ``tests/cycle/test_skip_doomed.py`` (every cycle compared
with the shortcuts on and off, the memo's epochs included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..nodeindex import Pool
from ..rules.contract import may_use_reserved
from ..state import Workload

if TYPE_CHECKING:
    from .scratch import Scratch

FailShape = tuple[str, str, bool, bool, bool]
"""What a failure to place depends on besides GPUs and priority: owner, GPU type,
contract kind, reservation gate, held to the margin (its outranking rule)."""


class FailureMemo:
    """The last failure per shape, and the pools a request can be placed in at all."""

    def __init__(self, s: Scratch) -> None:
        self.s = s
        self.failed: dict[FailShape, tuple[int, object, int, int, frozenset[Pool]]] = {}
        """shape -> (``freed``, what the failure depended on, priority, GPUs, the pools
        that could take them) of the last failure to place."""
        self._taking: dict[tuple[str, int], frozenset[Pool]] = {}
        self.every_pool: dict[str, frozenset[Pool]] = {}  # GPU type -> its pools

    def shape(self, w: Workload, allocated: bool) -> FailShape:
        """What a failure to place depends on besides GPUs and priority: the owner
        (allocated work only), the GPU type, the contract kind, and whether the
        reservation gate lets ``w`` on reserved nodes (no reservation: it does), and
        whether ``w`` gets the cycle's rule with the margin
        (:meth:`~.scratch.Scratch.outranking_for`; unallocated work: no matter)."""
        s = self.s
        r = s.reservation
        gate = r is None or may_use_reserved(s.t, w.min_runtime_ms, r.start_ms)
        held = allocated and s.outranking_for(w) is s.outranking
        return (w.owner if allocated else "", w.gpu_type, allocated, gate, held)

    def fails(self, w: Workload, allocated: bool) -> bool:
        """Whether a remembered failure rules ``w`` out (module docstring)."""
        failed = self.failed.get(self.shape(w, allocated))
        return (
            failed is not None
            and failed[0] == self.s.freed
            and w.priority <= failed[2]
            and w.gpus >= failed[3]
            and self._still_fails(w, allocated, failed[1])
            and self.rules_out(failed[4], w.gpu_type, w.gpus)
        )

    def remember(self, w: Workload, allocated: bool) -> FailShape:
        """``w`` could not be placed: remember it under its shape (returned)."""
        s = self.s
        shape = self.shape(w, allocated)
        depends: object = None
        if allocated:
            outranking = s.outranking_for(w)
            if outranking.known(w.owner):
                depends = outranking.victim_subtrees(w.owner)
            else:  # every pool was short before its subtrees were needed
                depends = (outranking.charges, s.victims.changes)
        taking = self.pools_taking(w.gpu_type, w.gpus)
        self.failed[shape] = (s.freed, depends, w.priority, w.gpus, taking)
        return shape

    def _still_fails(self, w: Workload, allocated: bool, depends: object) -> bool:
        """Whether what a remembered failure of ``w``'s shape depended on is unchanged."""
        if not allocated:
            return depends is None
        outranking = self.s.outranking_for(w)
        if type(depends) is tuple:
            return depends == (outranking.charges, self.s.victims.changes)
        return depends is outranking.victim_subtrees(w.owner)

    def pools_taking(self, gpu_type: str, gpus: int) -> frozenset[Pool]:
        """The pools a request of ``gpus`` GPUs of ``gpu_type`` could be placed in at
        all: one node's worth or less, or whole nodes. On those, more GPUs fail where
        fewer failed; a pool that takes a larger request but not a smaller one (two
        whole 4-GPU nodes for 8 GPUs, none for 6) is not ruled out by the smaller
        one's failure."""
        key = (gpu_type, gpus)
        taking = self._taking.get(key)
        if taking is None:
            every = self.every_pool.get(gpu_type)
            if every is None:
                every = self.every_pool[gpu_type] = frozenset(self.s.gpus.pools_for(gpu_type))
            taking = frozenset(p for p in every if gpus <= p[1] or gpus % p[1] == 0)
            if taking == every:
                taking = every  # the same object: :meth:`rules_out` checks it first
            self._taking[key] = taking
        return taking

    def rules_out(self, failed_in: frozenset[Pool], gpu_type: str, gpus: int) -> bool:
        """Whether a failure whose request the pools ``failed_in`` took rules out a
        larger request of ``gpus`` GPUs of ``gpu_type`` (every pool taking it took
        the failed one)."""
        return failed_in is self.every_pool.get(gpu_type) or failed_in.issuperset(
            self.pools_taking(gpu_type, gpus)
        )
