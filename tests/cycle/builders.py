"""Fluent builders and a tiny event-driven driver for cycle tests.

The driver is deliberately minimal (the real simulator lives in replay/): it
folds inputs in time order, runs a cycle after every batch of inputs at one
time, finishes each run after the rest of its duration, and jumps to the next
input, finish or wake-up.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from itertools import count

from apportion.core import State, apply, fold
from apportion.core.cycle import CycleResult, step
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    Event,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadSubmitted,
)

MIN = 60_000
HOUR = 60 * MIN


class Cluster:
    """``Cluster().team("a", 1).team("b", 1).nodes(2)`` builds the setup inputs."""

    def __init__(self) -> None:
        self._ids = count(1)
        self.events: list[Event] = [
            BudgetSet(id=self.next_id(), at_ms=0, path="", weight=1, owner="root", actor="root")
        ]
        self._node = 0

    def next_id(self) -> str:
        return f"e{next(self._ids)}"

    def team(self, path: str, weight: int, owner: str = "root") -> Cluster:
        self.events.append(
            BudgetSet(
                id=self.next_id(), at_ms=0, path=path, weight=weight, owner=owner, actor="root"
            )
        )
        return self

    def nodes(self, n: int, gpus: int = 8, gpu_type: str = "h100", prefix: str = "n") -> Cluster:
        for _ in range(n):
            self._node += 1
            self.events.append(
                NodeRegistered(
                    id=self.next_id(),
                    at_ms=0,
                    node=f"{prefix}{self._node:03d}",
                    gpus=gpus,
                    gpu_type=gpu_type,
                    actor="root",
                )
            )
        return self

    def policy(self, **fields: object) -> Cluster:
        self.events.append(PolicySet(id=self.next_id(), at_ms=0, actor="root", **fields))
        return self

    def state(self) -> State:
        return fold(self.events)


def submit(
    state: State,
    workload: str,
    owner: str,
    gpus: int,
    min_runtime_ms: int,
    at_ms: int | None = None,
    **fields: object,
) -> State:
    at = state.now_ms if at_ms is None else at_ms
    leaf = state.budget.nodes.get(owner)
    fields.setdefault("submitted_by", leaf.owner if leaf is not None else "root")
    return apply(
        state,
        WorkloadSubmitted(
            id=f"sub-{workload}",
            at_ms=at,
            workload=workload,
            owner=owner,
            gpus=gpus,
            min_runtime_ms=min_runtime_ms,
            **fields,
        ),
    )


def tick(state: State, at_ms: int) -> State:
    return apply(state, ClockTicked(id=f"tick-{at_ms}-{state.input_seq}", at_ms=at_ms))


def health(state: State, node: str, to: str, at_ms: int | None = None) -> State:
    at = state.now_ms if at_ms is None else at_ms
    return apply(
        state,
        NodeHealthChanged(
            id=f"h-{node}-{state.input_seq}", at_ms=at, node=node, state=to, actor="root"
        ),
    )


def finish(state: State, workload: str, at_ms: int | None = None) -> State:
    at = state.now_ms if at_ms is None else at_ms
    return apply(
        state,
        WorkloadFinished(
            id=f"fin-{workload}-{state.input_seq}", at_ms=at, workload=workload, actor="root"
        ),
    )


def placed(result: CycleResult) -> dict[str, tuple[str, ...]]:
    return {
        d.workload: tuple(s.node for s in d.placement)
        for d in result.decisions
        if isinstance(d, WorkloadPlaced)
    }


def preempted(result: CycleResult) -> dict[str, str]:
    return {d.workload: d.reason for d in result.decisions if isinstance(d, WorkloadPreempted)}


def drive(
    state: State,
    inputs: Iterable[Event],
    durations: dict[str, int],
    until_ms: int,
) -> list[tuple[int, Event]]:
    """Run ``inputs`` (sorted by time) through the cycle until ``until_ms``.

    A placed workload finishes after the rest of its duration (``durations``,
    progress kept across preemptions). Returns every decision with its time.
    """
    pending_inputs = sorted(inputs, key=lambda e: e.at_ms)
    i = 0
    finishes: list[tuple[int, str, int]] = []  # (time, workload, attempt)
    progress: dict[str, int] = {}
    started: dict[str, tuple[int, int]] = {}  # workload -> (start, attempt)
    log: list[tuple[int, Event]] = []
    wakeup: int | None = None
    ticks = count()
    while True:
        candidates = [t for t in (wakeup,) if t is not None]
        if i < len(pending_inputs):
            candidates.append(pending_inputs[i].at_ms)
        while finishes and (
            finishes[0][1] not in started or started[finishes[0][1]][1] != finishes[0][2]
        ):
            heapq.heappop(finishes)
        if finishes:
            candidates.append(finishes[0][0])
        if not candidates:
            break
        now = max(min(candidates), state.now_ms)
        if now > until_ms:
            break
        folded = False
        while i < len(pending_inputs) and pending_inputs[i].at_ms <= now:
            apply(state, pending_inputs[i])
            i += 1
            folded = True
        while finishes and finishes[0][0] <= now:
            _, w, attempt = heapq.heappop(finishes)
            if w in started and started[w][1] == attempt:
                start, _ = started.pop(w)
                progress[w] = progress.get(w, 0) + now - start
                apply(
                    state,
                    WorkloadFinished(
                        id=f"fin-{w}-{attempt}",
                        at_ms=now,
                        workload=w,
                        attempt=attempt,
                        actor="root",
                    ),
                )
                folded = True
        if not folded:
            apply(state, ClockTicked(id=f"tick{next(ticks)}", at_ms=now))
        result = step(state)
        wakeup = (
            result.next_wakeup_ms if result.next_wakeup_ms and result.next_wakeup_ms > now else None
        )
        for d in result.decisions:
            log.append((now, d))
            if isinstance(d, WorkloadPreempted) and d.workload in started:
                start, _ = started.pop(d.workload)
                progress[d.workload] = progress.get(d.workload, 0) + now - start
            elif isinstance(d, WorkloadPlaced):
                started[d.workload] = (now, d.attempt)
                rest = durations.get(d.workload, 10 * HOUR) - progress.get(d.workload, 0)
                heapq.heappush(finishes, (now + max(rest, 0), d.workload, d.attempt))
    return log
