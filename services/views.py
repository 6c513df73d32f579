"""Read models the gateway serves: queue, share, budget tree, explain (pure functions of state).

``History`` is what a follower remembers beyond the state: the last preemption
of each workload and the reasons for rejected submissions, for ``explain``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from apportion.core.budget import ROOT
from apportion.core.contract import is_protected, may_use_reserved
from apportion.core.cycle import decide
from apportion.core.ordering import FairShareView, queue_order
from apportion.core.state import State, Workload
from apportion.schemas.events import (
    ANY_GPU_TYPE,
    HOUR_MS,
    InputRejected,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadSubmitted,
)
from apportion.schemas.history import HistoryItem, InputItem


def _ratio(r: Fraction) -> dict[str, Any]:
    return {"value": float(r), "exact": f"{r.numerator}/{r.denominator}"}


class History:
    """Facts ``explain`` needs that the fold forgets."""

    def __init__(self) -> None:
        self.submit_ids: dict[str, str] = {}
        self.other_ids: dict[str, str] = {}
        self.rejected: dict[str, str] = {}
        self.preempted: dict[str, WorkloadPreempted] = {}
        self.placed: dict[str, WorkloadPlaced] = {}

    def record(self, items: list[HistoryItem]) -> None:
        for item in items:
            if isinstance(item, InputItem):
                e = item.event
                if isinstance(e, WorkloadSubmitted):
                    self.submit_ids[e.id] = e.workload
                elif e is not None and isinstance(workload := getattr(e, "workload", None), str):
                    self.other_ids[e.id] = workload
                continue
            for d in item.batch.decisions:
                if isinstance(d, WorkloadPreempted):
                    self.preempted[d.workload] = d
                elif isinstance(d, WorkloadPlaced):
                    self.placed[d.workload] = d
                elif isinstance(d, InputRejected) and d.ref in self.submit_ids:
                    self.rejected[self.submit_ids[d.ref]] = d.reason


def workload_json(w: Workload) -> dict[str, Any]:
    return {
        "workload": w.id,
        "owner": w.owner,
        "gpus": w.gpus,
        "gpu_type": w.gpu_type,
        "min_runtime_ms": w.min_runtime_ms,
        "resumable": w.resumable,
        "priority": w.priority,
        "allocated": w.allocated,
        "submitted_ms": w.submitted_ms,
        "queued_ms": w.queued_ms,
        "status": w.status,
        "attempt": w.attempt,
        "preemptions": w.preemptions,
        "duration_ms": w.duration_ms,
        "submitted_by": w.submitted_by,
    }


def queue_view(state: State) -> dict[str, Any]:
    """Pending workloads in the order the next cycle considers them
    (:func:`~apportion.core.ordering.queue_order`) with the ratios that rank them; running ones after."""
    view = FairShareView(state)
    pending = []
    for i, w in enumerate(queue_order(state, view), start=1):
        row = workload_json(w)
        row["position"] = i
        row["wait_ms"] = max(0, state.now_ms - w.queued_ms)
        row["ratios"] = (
            [
                {"path": p, "usage_gpu_ms": u, "weight": wt, "ratio": _ratio(r)}
                for p, u, wt, r in view.path_ratios(w.owner)
            ]
            if w.allocated
            else []
        )
        pending.append(row)
    running = []
    for w in sorted(state.running.values(), key=lambda w: (w.started_ms, w.id)):
        row = workload_json(w)
        row["started_ms"] = w.started_ms
        row["protected_until_ms"] = w.protected_until_ms
        row["placement"] = [[s.node, s.gpus] for s in w.placement]
        running.append(row)
    return {
        "at_ms": state.now_ms,
        "input_seq": state.input_seq,
        "pending": pending,
        "running": running,
    }


def _capacity_gpus(state: State) -> int:
    return sum(n.gpus for n in state.nodes.values() if n.health != "down")


def budget_tree(state: State, detail: bool = False) -> dict[str, Any]:
    """The budget tree as nested ``{"path","weight","owner","global_share","usage_gpu_h",
    "committed_gpu_h","children"}``;
    with ``detail`` (the ``share`` view) also allocation against usage, like ``sshare``."""
    tree = state.budget
    view = FairShareView(state)
    root_usage = view.charged[ROOT]
    capacity = _capacity_gpus(state)
    window_h = state.policy.lookback_ms / HOUR_MS
    running: dict[str, int] = {}
    pending: dict[str, int] = {}
    for w in state.workloads.values():
        if not w.allocated:
            continue
        target = running if w.status == "running" else pending
        path = w.owner
        while True:
            target[path] = target.get(path, 0) + w.gpus
            if path == ROOT:
                break
            path = path.rsplit("/", 1)[0] if "/" in path else ROOT

    def node(path: str) -> dict[str, Any]:
        n = tree.nodes[path]
        gshare = tree.global_share(path)
        out: dict[str, Any] = {
            "path": path,
            "weight": n.weight,
            "owner": n.owner,
            "global_share": float(gshare),
            "usage_gpu_h": view.charged[path] / HOUR_MS,
            "committed_gpu_h": view.committed.get(path, 0) / HOUR_MS,
        }
        if detail:
            effective = Fraction(view.charged[path], root_usage) if root_usage else Fraction(0)
            out.update(
                share=float(tree.share(path)),
                allocation_gpu_h=float(gshare) * capacity * window_h,
                effective_usage=float(effective),
                usage_vs_share=float(effective / gshare) if gshare else 0.0,
                ratio=_ratio(view.ratio(path)),
                running_gpus=running.get(path, 0),
                pending_gpus=pending.get(path, 0),
            )
        out["children"] = [node(c) for c in n.children]
        return out

    return node(ROOT)


def explain(state: State, history: History, workload: str) -> dict[str, Any] | None:
    """Why ``workload`` is pending, running, preempted or ended; ``None`` if unknown."""
    w = state.workloads.get(workload)
    last_pre = history.preempted.get(workload)
    pre_txt = None
    if last_pre is not None:
        pre_txt = f"preempted at {last_pre.at_ms} ({last_pre.reason}"
        if last_pre.for_workload:
            pre_txt += f", to make room for {last_pre.for_workload}"
        pre_txt += ", requeued)" if last_pre.requeued else ", not resumable: ended)"
    if w is None:
        if workload in history.rejected:
            return {
                "workload": workload,
                "status": "rejected",
                "reasons": [history.rejected[workload]],
            }
        status = state.ended.get(workload)
        if status is None:
            return None
        ended = [f"ended as {status}"]
        if status == "preempted" and pre_txt:
            ended.append(pre_txt)
        return {"workload": workload, "status": status, "reasons": ended}
    out: dict[str, Any] = {"workload": workload, "status": w.status, "detail": workload_json(w)}
    reasons: list[str] = []
    if w.status == "running":
        nodes = ", ".join(f"{s.node}:{s.gpus}" for s in w.placement)
        reasons.append(f"running on {nodes} since {w.started_ms} (attempt {w.attempt})")
        if not w.allocated:
            reasons.append(
                "unallocated (min_runtime 0): free, preemptible by any allocated workload at any moment"
            )
        elif is_protected(w, state.now_ms):
            reasons.append(
                f"protected from preemption until {w.protected_until_ms} (its minimum runtime)"
            )
        else:
            reasons.append(
                "past its minimum runtime: preemptible by a clearly more under-served team"
            )
        if pre_txt:
            reasons.append(f"earlier: {pre_txt}")
        out["reasons"] = reasons
        return out
    view = FairShareView(state)
    order = queue_order(state, view)
    pos = next(i for i, x in enumerate(order, start=1) if x.id == workload)
    ahead = order[: pos - 1]
    reasons.append(f"pending: position {pos} of {len(order)} in the queue")
    if pre_txt:
        reasons.append(pre_txt)
    if not w.allocated:
        reasons.append(
            "unallocated (min_runtime 0): orders after every allocated workload and never preempts"
        )
    else:
        parts = [
            f"{p} ratio {float(r):.4g} (usage {u / HOUR_MS:.3g} GPU-h / weight {wt})"
            for p, u, wt, r in view.path_ratios(w.owner)
        ]
        reasons.append("sort key: " + "; ".join(parts))
    fits = [
        n
        for n in state.nodes.values()
        if n.schedulable and (w.gpu_type == ANY_GPU_TYPE or n.gpu_type == w.gpu_type)
    ]
    if not fits:
        reasons.append(f"no healthy node of gpu_type {w.gpu_type!r}")
    else:
        free = sum(n.free for n in fits)
        largest = max(n.free for n in fits)
        whole = sum(1 for n in fits if n.free == n.gpus)
        reasons.append(
            f"needs {w.gpus} GPUs at once; free on matching healthy nodes: {free} "
            f"(largest block {largest}, {whole} whole nodes)"
        )
        blockers = sorted(
            (r for r in state.running.values() if is_protected(r, state.now_ms)),
            key=lambda r: (r.protected_until_ms, r.id),
        )
        if blockers:
            b = blockers[0]
            reasons.append(
                f"{len(blockers)} running allocated workloads are protected; the first protection ends at "
                f"{b.protected_until_ms} ({b.id})"
            )
    if ahead:
        reasons.append(
            f"{len(ahead)} workloads rank ahead of it, needing {sum(a.gpus for a in ahead)} GPUs"
        )
    reservation = decide(state, report_reservation=True).reservation
    if reservation is not None and w.allocated:
        nodes = ", ".join(reservation.nodes)
        if reservation.workload == workload:
            reasons.append(
                f"holds a reservation: {nodes} become free or preemptible for it at "
                f"{reservation.start_ms}; until then only work preemptible by then may use them"
            )
        elif not may_use_reserved(state.now_ms, w.min_runtime_ms, reservation.start_ms):
            reasons.append(
                f"may not use {nodes}: reserved for {reservation.workload} from "
                f"{reservation.start_ms}, and it would still be protected then"
            )
    out["position"] = pos
    out["reasons"] = reasons
    return out
