"""The scheduling cycle: ``decide(state) -> CycleResult``, pure and deterministic.

At time ``t = state.now_ms`` (the time of the last event folded), the cycle runs
these steps over a scratch copy of the free GPUs (:mod:`.scratch`) and never
changes ``state`` (docs/cycle.md; one module each):

0. **Rejections** (:mod:`.rejections`): every input the fold recorded as
   rejected becomes an ``InputRejected`` decision.
0b. **Usage reports** (:mod:`.reports`): a cluster whose policy names peers
   reports each usage interval that has ended (``UsageReported``).
1. **Down nodes** (:mod:`.nodes`): every workload on a ``down`` node is lost at
   once (``node_down``; resumable ones requeue).
2. **Draining nodes** (:mod:`.nodes`): unallocated work is preempted at once,
   allocated work as each reaches ``protected_until`` (``drain``); an empty
   draining node gets one ``NodeDrained``.
3. **Allocated work in fair-share order** (:mod:`.allocated`), the order
   recomputed as the cycle goes: each placement adds its projected charge
   ``gpus * min_runtime`` to its path before the next workload is ranked. For
   each workload (:mod:`.attempt`):

   a. place it if it fits (:meth:`~apportion.core.placement.FreeGPUs.fit`:
      best fit on one node, or whole nodes of one pool);
   b. otherwise try to preempt (:mod:`.preemption`): the cheapest victim set
      that makes it fit, among victims it may preempt
      (:mod:`apportion.core.rules.outranking`);
   c. otherwise, if it is the first allocated workload that could not be placed,
      reserve for it the nodes that become free or preemptible earliest
      (:mod:`.reservation`); later (lower-ranked) work may use a reserved node
      only if it will be preemptible before the reservation starts
      (:func:`~apportion.core.rules.contract.may_use_reserved`).

4. **Unallocated work** (:mod:`.unallocated`, ``min_runtime == 0``) by submit
   time, then id: placed if it fits; it never preempts.

Then the next wake-up (:mod:`.wakeup`).

**Preemption notice** (grace, docs/semantics.md): a victim of steps 2-3 with an
effective grace > 0 keeps its GPUs until its stop deadline (``stopping``); its
beneficiary is not placed in this cycle, the nodes it would take are *held* for
it (no other work goes there), and while runs stop for it it does not preempt
again. Stopping runs are never victims; a draining node with one is not drained.

The shortcuts that make it fast, each exact and guarded by a test that runs
cycles with and without it: :mod:`.memo`, :mod:`.doomed`, :mod:`.prune`,
:mod:`.poolbound`, :mod:`.roomy`, :mod:`.floors`, the caches of
:mod:`.subtrees`, and :mod:`.idle` (a cycle with nothing to decide).

The contract (allocated, protected, the reservation gate) is
:mod:`apportion.core.rules.contract`. Requeued work from steps 1-2 joins the walk of
step 3/4 in the same cycle; a victim of a fair-share preemption waits for the
next cycle (so one cycle never moves the same workload twice).

Every choice ends in a unique tie-break (node id, workload id), no ``set`` is
iterated, and ratios compare exactly, so the same state gives the same
decisions on any machine.
"""

from __future__ import annotations

from ..fold import apply
from ..state import State
from .idle import idle
from .result import CycleResult, Reservation
from .run import Cycle

__all__ = ["Cycle", "CycleResult", "Reservation", "decide", "step"]


def decide(state: State, *, report_reservation: bool = False) -> CycleResult:
    """One scheduling cycle at ``state.now_ms``; does not change ``state``.

    The reservation is computed only when it changes a decision (a later
    workload would otherwise use a node it holds); ``report_reservation=True``
    also computes it when it did not, so that :attr:`CycleResult.reservation`
    always tells (for ``explain`` and tests). The decisions are the same either way.
    """
    result = idle(state)  # nothing to decide: the cycle is not assembled (.idle)
    return result if result is not None else Cycle(state).run(report_reservation)


def step(state: State, *, report_reservation: bool = False) -> CycleResult:
    """``decide`` and fold the decisions back into ``state``."""
    result = decide(state, report_reservation=report_reservation)
    for decision in result.decisions:
        apply(state, decision)
    return result
