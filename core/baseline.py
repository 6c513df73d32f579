"""The policy apportion replaces (DESIGN "The baseline it replaces"), for the simulator.

``decide_baseline(state, limits) -> CycleResult``: pure and deterministic like
:func:`apportion.core.cycle.decide` (no set iteration, no floats, ties broken
by ids), emitting the same decision events so the same fold applies.

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
6. placement as in the budget scheduler: one node by best fit for
   ``gpus <= gpus_per_node``, else whole free nodes (lowest ids);
7. a workload that does not fit may preempt running ``legacy_preemptible``
   work of strictly lower legacy priority: lowest priority first, then the
   most recently started, then id; on the node (or the whole nodes) that
   frees what it needs at the least preempted GPUs, ties by node id. Such a
   preemption is recorded with reason ``fairshare`` and ``for_workload`` set
   (the event schema has no ``priority`` reason); non-preemptible work is
   never preempted except by a node going down.

The **team** of a leaf is its parent (a budget node one level above the
leaves), or the leaf itself when it hangs directly under the root.
:func:`default_limits`: a team's concurrent-GPU limit is its global share of
the cluster's GPUs times 1.5 (limits were oversubscribed), rounded up to whole
nodes, and at least 64 GPUs (one large gang).
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

from apportion.schemas.events import (
    ANY_GPU_TYPE,
    Decision,
    InputRejected,
    NodeDrained,
    Slot,
    WorkloadPlaced,
    WorkloadPreempted,
)

from .budget import ROOT, parent_of
from .cycle import CycleResult
from .state import State, Workload, apply

LEGACY_RANK = {"low": 0, "normal": 1, "high": 2}
LIMIT_OVERCOMMIT = Fraction(3, 2)
LIMIT_FLOOR_GPUS = 64


_TEAM_CACHE: dict[str, str] = {}


def team_of(leaf: str) -> str:
    """The team of an owner leaf: its parent, or itself directly under the root."""
    team = _TEAM_CACHE.get(leaf)
    if team is None:
        parent = parent_of(leaf)
        team = _TEAM_CACHE[leaf] = leaf if parent == ROOT else parent
    return team


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


_KEY_CACHE: dict[str, tuple[int, int, str]] = {}


def _order_key(w: Workload) -> tuple[int, int, str]:
    """Legacy priority high first, then submit time, then id (a workload's key never changes)."""
    key = _KEY_CACHE.get(w.id)
    if key is None:
        key = _KEY_CACHE[w.id] = (-LEGACY_RANK.get(w.legacy_priority, 2), w.submitted_ms, w.id)
    return key


def decide_baseline(state: State, limits: Mapping[str, int] | None = None) -> CycleResult:
    """One cycle of the priority policy at ``state.now_ms``; does not change ``state``."""
    if limits is None:
        limits = default_limits(state)
    now = state.now_ms
    out: list[Decision] = []
    seq = state.input_seq

    def next_id() -> str:
        return f"baseline/{seq}/{len(out)}"

    for ref, reason in state.rejections:
        out.append(InputRejected(id=next_id(), at_ms=now, ref=ref, reason=reason))

    free: dict[str, int] = {name: n.free for name, n in state.nodes.items()}
    on_node: dict[str, dict[str, int]] = {
        name: dict(n.workloads) for name, n in state.nodes.items()
    }
    gone: dict[str, bool] = {}

    def preempt(w: Workload, reason: str, for_workload: str | None = None) -> None:
        requeued = w.resumable
        out.append(
            WorkloadPreempted(
                id=next_id(),
                at_ms=now,
                workload=w.id,
                reason=reason,  # type: ignore[arg-type]
                requeued=requeued,
                for_workload=for_workload,
            )
        )
        gone[w.id] = True
        for slot in w.placement:
            free[slot.node] += slot.gpus
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
            victims_below[LEGACY_RANK.get(w.legacy_priority, 2)] += 1
        else:
            team = team_of(w.owner)
            np_used[team] = np_used.get(team, 0) + w.gpus

    # nodes by pool, in id order
    pools: dict[tuple[str, int], list[str]] = {}
    for name in sorted(state.nodes):
        n = state.nodes[name]
        if n.health == "healthy":
            pools.setdefault((n.gpu_type, n.gpus), []).append(name)
    pool_keys = sorted(pools)

    def fit(w: Workload) -> tuple[Slot, ...] | None:
        for key in pool_keys:
            gtype, gpn = key
            if w.gpu_type != ANY_GPU_TYPE and gtype != w.gpu_type:
                continue
            names = pools[key]
            if w.gpus <= gpn:
                best: str | None = None
                best_free = 0
                for name in names:
                    f = free[name]
                    if f >= w.gpus and (best is None or f < best_free):
                        best, best_free = name, f
                if best is not None:
                    return (Slot(best, w.gpus),)
            elif w.gpus % gpn == 0:
                need = w.gpus // gpn
                chosen = [name for name in names if free[name] == gpn][:need]
                if len(chosen) == need:
                    return tuple(Slot(name, gpn) for name in chosen)
        return None

    def victim_key(v: Workload) -> tuple[int, int, str]:
        return (LEGACY_RANK.get(v.legacy_priority, 2), -v.started_ms, v.id)

    def fit_with_preemption(
        w: Workload, rank: int
    ) -> tuple[tuple[Slot, ...], list[Workload]] | None:
        def eligible(wid: str) -> Workload | None:
            v = running.get(wid)
            if (
                v is not None
                and v.legacy_preemptible
                and LEGACY_RANK.get(v.legacy_priority, 2) < rank
            ):
                return v
            return None

        best: tuple[int, str, tuple[Slot, ...], list[Workload]] | None = None
        for key in pool_keys:
            gtype, gpn = key
            if w.gpu_type != ANY_GPU_TYPE and gtype != w.gpu_type:
                continue
            names = pools[key]
            if w.gpus <= gpn:
                for name in names:
                    have = free[name]
                    cands = sorted(
                        (v for wid in on_node[name] if (v := eligible(wid))), key=victim_key
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
                        best = (cost, name, (Slot(name, w.gpus),), chosen)
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
                        slots = tuple(Slot(o[1], gpn) for o in sorted(picked, key=lambda o: o[1]))
                        best = (cost, picked[0][1], slots, [chosen_d[k] for k in sorted(chosen_d)])
        if best is None:
            return None
        return best[2], best[3]

    failed_fit: dict[tuple[int, str], bool] = {}
    failed_preempt: dict[tuple[int, str, int], bool] = {}
    healthy = [name for key in pool_keys for name in pools[key]]
    total_free = sum(free[name] for name in healthy)
    for w in sorted(state.pending.values(), key=_order_key):
        rank = LEGACY_RANK.get(w.legacy_priority, 2)
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
            placement = fit(w)
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
                victims_below[LEGACY_RANK.get(v.legacy_priority, 2)] -= 1
                for slot in v.placement:
                    if state.nodes[slot.node].health == "healthy":
                        total_free += slot.gpus
                preempt(v, "fairshare", w.id)
            failed_fit.clear()
            failed_preempt.clear()
        out.append(
            WorkloadPlaced(
                id=next_id(),
                at_ms=now,
                workload=w.id,
                placement=placement,
                allocated=w.min_runtime_ms > 0,
                protected_until_ms=now + w.min_runtime_ms,
                attempt=w.attempt + 1,
            )
        )
        for slot in placement:
            free[slot.node] -= slot.gpus
            on_node[slot.node][w.id] = slot.gpus
        total_free -= w.gpus
        if not w.legacy_preemptible:
            np_used[team] = np_used.get(team, 0) + w.gpus
    # A placed workload is not a victim in the same cycle: it is not in state.running.
    return CycleResult(decisions=tuple(out), next_wakeup_ms=None)


def step_baseline(state: State, limits: Mapping[str, int] | None = None) -> CycleResult:
    """``decide_baseline`` and fold its decisions into ``state``."""
    result = decide_baseline(state, limits)
    for decision in result.decisions:
        apply(state, decision)
    return result
