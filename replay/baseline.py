"""The policy apportion replaces (docs/semantics.md, "The baseline the simulator compares against"), for the simulator.

``decide_baseline(state, limits) -> CycleResult``: pure and deterministic like
:func:`apportion.core.cycle.decide` (no set iteration, no floats, ties broken
by ids, nothing kept between calls: the decisions are a function of
``state`` and ``limits`` alone), emitting the same decision events so the same
fold applies.

Rules, in the order the cycle applies them:

1. every input the fold rejected gets an ``InputRejected``;
2. workloads on a ``down`` node are lost at once (``node_down``; resumable ones requeue);
3. on a ``draining`` node, ``legacy_preemptible`` work is preempted at once
   (``drain``); non-preemptible work keeps running until it finishes (the host
   drains only then); an empty draining node gets ``NodeDrained``;
4. pending workloads in order: ``legacy_priority`` high, normal, low; then
   earlier submit time; then id (priority FIFO; a workload that does not fit
   does not block later ones, like Kueue's BestEffortFIFO);
5. a non-preemptible workload runs only while its team's non-preemptible GPUs
   stay within the team's concurrent-GPU limit; preemptible work ignores the
   limit and runs on idle GPUs;
6. placement is the budget scheduler's (:mod:`apportion.core.placement`): one
   node by best fit across the pools of the right type for
   ``gpus <= gpus_per_node``, else whole free nodes of one pool (lowest ids);
7. a workload that does not fit may preempt running ``legacy_preemptible``
   work of strictly lower legacy priority: lowest priority first, then the
   most recently started, then id; on the node (or the whole nodes) that
   frees what it needs at the least preempted GPUs, ties by node id. Such a
   preemption is recorded with reason ``fairshare`` and ``for_workload`` set
   (the event schema has no ``priority`` reason); non-preemptible work is
   never preempted except by a node going down.

Placements follow the contract (:mod:`apportion.core.rules.contract`) only as the
fold requires it: ``allocated`` and ``protected_until`` are recorded, but this
policy ignores protection and charges.

The **team** of a leaf is its parent (a budget node one level above the
leaves), or the leaf itself when it hangs directly under the root.
:func:`default_limits`: a team's concurrent-GPU limit is its global share of
the cluster's GPUs times 1.5 (limits were oversubscribed), rounded up to whole
nodes, and at least 64 GPUs (one large gang).
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

from apportion.core.cycle import CycleResult
from apportion.core.placement import FreeGPUs, Slots
from apportion.core.rules.classes import team_of
from apportion.core.rules.contract import is_allocated, protected_until
from apportion.core.state import State, Workload
from apportion.schemas.events import (
    Decision,
    InputRejected,
    NodeDrained,
    PreemptReason,
    Slot,
    WorkloadPlaced,
    WorkloadPreempted,
)

LEGACY_RANK = {"low": 0, "normal": 1, "high": 2}
LIMIT_OVERCOMMIT = Fraction(3, 2)
LIMIT_FLOOR_GPUS = 64


def default_limits(state: State) -> dict[str, int]:
    """Concurrent non-preemptible GPUs per team (see the module docstring)."""
    total = sum(n.gpus for n in state.nodes.values())
    node_gpus = max((n.gpus for n in state.nodes.values()), default=8)
    limits: dict[str, int] = {}
    for leaf in state.budget.leaves():
        team = team_of(leaf)
        if team in limits:
            continue
        raw = state.budget.global_share(team) * total * LIMIT_OVERCOMMIT
        gpus = -(-raw.numerator // raw.denominator)
        gpus = -(-gpus // node_gpus) * node_gpus
        limits[team] = max(gpus, LIMIT_FLOOR_GPUS)
    return limits


def _rank(w: Workload) -> int:
    """Legacy priority as a number, higher first (unknown values count as ``high``)."""
    return LEGACY_RANK.get(w.legacy_priority, 2)


def _order_key(w: Workload) -> tuple[int, int, str]:
    """Legacy priority high first, then submit time, then id."""
    return (-_rank(w), w.submitted_ms, w.id)


def _victim_key(v: Workload) -> tuple[int, int, str]:
    """Lowest legacy priority first, then the most recently started, then id."""
    return (_rank(v), -v.started_ms, v.id)


def decide_baseline(state: State, limits: Mapping[str, int] | None = None) -> CycleResult:
    """One cycle of the priority policy at ``state.now_ms``; does not change ``state``."""
    if limits is None:
        limits = default_limits(state)
    now = state.now_ms
    out: list[Decision] = []
    seq = state.input_seq

    def next_id() -> str:
        return f"baseline/{seq}/{len(out)}"

    for ref, reason, code in state.rejections:
        out.append(InputRejected(id=next_id(), at_ms=now, ref=ref, reason=reason, code=code))

    gpus = FreeGPUs(state)
    free = gpus.free
    on_node: dict[str, dict[str, int]] = {
        name: dict(n.workloads) for name, n in state.nodes.items()
    }
    gone: dict[str, bool] = {}

    def preempt(w: Workload, reason: PreemptReason, for_workload: str | None = None) -> None:
        out.append(
            WorkloadPreempted(
                id=next_id(),
                at_ms=now,
                workload=w.id,
                reason=reason,
                requeued=w.resumable,
                for_workload=for_workload,
            )
        )
        gone[w.id] = True
        for slot in w.placement:
            gpus.set(slot.node, free[slot.node] + slot.gpus)
            del on_node[slot.node][w.id]

    running = state.running
    for name, node in state.nodes.items():
        if node.health == "down":
            for wid in sorted(on_node[name]):
                if wid not in gone:
                    preempt(running[wid], "node_down")
    for name, node in state.nodes.items():
        if node.health == "draining":
            for wid in sorted(on_node[name]):
                w = running[wid]
                if w.legacy_preemptible and wid not in gone:
                    preempt(w, "drain")
            if not on_node[name] and not node.drained:
                out.append(NodeDrained(id=next_id(), at_ms=now, node=name))

    # non-preemptible GPUs per team, and the preemptible victims per legacy rank
    np_used: dict[str, int] = {}
    victims_below = [0, 0, 0]
    for w in running.values():
        if w.id in gone:
            continue
        if w.legacy_preemptible:
            victims_below[_rank(w)] += 1
        else:
            team = team_of(w.owner)
            np_used[team] = np_used.get(team, 0) + w.gpus

    pool_nodes = state.node_index.pool_nodes  # healthy nodes by pool, by id

    def fit_with_preemption(w: Workload, rank: int) -> tuple[Slots, list[Workload]] | None:
        def eligible(wid: str) -> Workload | None:
            v = running.get(wid)
            if v is not None and v.legacy_preemptible and _rank(v) < rank:
                return v
            return None

        best: tuple[int, str, Slots, list[Workload]] | None = None
        for key in gpus.pools_for(w.gpu_type):
            gpn = key[1]
            names = pool_nodes[key]
            if w.gpus <= gpn:
                for name in names:
                    have = free[name]
                    cands = sorted(
                        (v for wid in on_node[name] if (v := eligible(wid))), key=_victim_key
                    )
                    chosen: list[Workload] = []
                    cost = 0
                    for v in cands:
                        if have >= w.gpus:
                            break
                        chosen.append(v)
                        have += on_node[name][v.id]
                        cost += v.gpus
                    if (
                        have >= w.gpus
                        and chosen
                        and (best is None or (cost, name) < (best[0], best[1]))
                    ):
                        best = (cost, name, [(name, w.gpus)], chosen)
            elif w.gpus % gpn == 0:
                need = w.gpus // gpn
                options: list[tuple[int, str, list[Workload]]] = []
                for name in names:
                    vs: list[Workload] = []
                    ok = True
                    for wid in sorted(on_node[name]):
                        v = eligible(wid)
                        if v is None:
                            ok = False
                            break
                        vs.append(v)
                    if ok:
                        options.append((sum(v.gpus for v in vs), name, vs))
                if len(options) >= need:
                    options.sort(key=lambda o: (o[0], o[1]))
                    picked = options[:need]
                    cost = sum(o[0] for o in picked)
                    if cost > 0 and (best is None or (cost, picked[0][1]) < (best[0], best[1])):
                        chosen_d: dict[str, Workload] = {}
                        for o in picked:
                            for v in o[2]:
                                chosen_d[v.id] = v
                        slots = [(o[1], gpn) for o in sorted(picked, key=lambda o: o[1])]
                        best = (cost, picked[0][1], slots, [chosen_d[k] for k in sorted(chosen_d)])
        if best is None:
            return None
        return best[2], best[3]

    failed_fit: dict[tuple[int, str], bool] = {}
    failed_preempt: dict[tuple[int, str, int], bool] = {}
    total_free = sum(gpus.pool_free.values())
    for w in sorted(state.pending.values(), key=_order_key):
        rank = _rank(w)
        if total_free < w.gpus and not any(victims_below[:rank]):
            if total_free == 0 and not any(victims_below[:2]):
                break  # nothing is free and nothing can be preempted: no later workload can start
            continue
        team = team_of(w.owner)
        if not w.legacy_preemptible and np_used.get(team, 0) + w.gpus > limits.get(team, 0):
            continue
        placement = None
        fkey = (w.gpus, w.gpu_type)
        if total_free >= w.gpus and fkey not in failed_fit:
            placement = gpus.fit(w.gpus, w.gpu_type)
            if placement is None:
                failed_fit[fkey] = True
        if placement is None:
            pkey = (w.gpus, w.gpu_type, rank)
            if pkey in failed_preempt or not any(victims_below[:rank]):
                continue
            found = fit_with_preemption(w, rank)
            if found is None:
                failed_preempt[pkey] = True
                continue
            placement, victims = found
            for v in victims:
                victims_below[_rank(v)] -= 1
                preempt(v, "fairshare", w.id)
            total_free = sum(gpus.pool_free.values())
            failed_fit.clear()
            failed_preempt.clear()
        out.append(
            WorkloadPlaced(
                id=next_id(),
                at_ms=now,
                workload=w.id,
                placement=tuple(Slot(name, n) for name, n in placement),
                allocated=is_allocated(w),
                protected_until_ms=protected_until(now, w.min_runtime_ms),
                attempt=w.attempt + 1,
            )
        )
        for name, n in placement:
            gpus.set(name, free[name] - n)
            on_node[name][w.id] = n
        total_free -= w.gpus
        if not w.legacy_preemptible:
            np_used[team] = np_used.get(team, 0) + w.gpus
    # A placed workload is not a victim in the same cycle: it is not in state.running.
    return CycleResult(decisions=tuple(out), next_wakeup_ms=None)
