"""One scheduling cycle on a full cluster: 128 nodes x 8 GPUs, ~1,000 running and
10,000 pending workloads, 200 leaves; the preemption search runs.

Also prints the fragmentation scenario (tests/cycle/fragmentation.py): the wait of
a 256-GPU job among small jobs with and without reservations.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

from apportion.core import apply, fold
from apportion.core.cycle import decide, step
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    NodeRegistered,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadSubmitted,
)

MIN = 60_000
HOUR = 60 * MIN


def build_state(pending: int = 10_000, seed: int = 1):
    rng = random.Random(seed)
    events = [BudgetSet(id="root", at_ms=0, path="", weight=1, owner="root", actor="root")]
    leaves = []
    for p in range(4):
        events.append(
            BudgetSet(id=f"p{p}", at_ms=0, path=f"p{p}", weight=p + 1, owner="o", actor="root")
        )
        for t in range(10):
            team = f"p{p}/t{t}"
            events.append(
                BudgetSet(
                    id=team, at_ms=0, path=team, weight=rng.randint(1, 5), owner="o", actor="root"
                )
            )
            for u in range(5):
                leaf = f"{team}/u{u}"
                events.append(
                    BudgetSet(id=leaf, at_ms=0, path=leaf, weight=1, owner="o", actor="root")
                )
                leaves.append(leaf)
    for n in range(128):
        events.append(
            NodeRegistered(
                actor="root", id=f"n{n}", at_ms=0, node=f"n{n:03d}", gpus=8, gpu_type="h100"
            )
        )
    state = fold(events)
    # fill the cluster: ~1,000 running workloads from a third of the leaves, placed over 7 days
    busy = leaves[::3]
    k = 0
    gpus_left = 1024
    while gpus_left > 0:
        g = 8 if k % 40 == 0 else 1
        g = min(g, gpus_left)
        at = rng.randint(0, 6 * 24) * HOUR
        state = fold(
            [
                ClockTicked(id=f"c{k}", at_ms=at),
                WorkloadSubmitted(
                    submitted_by="root",
                    id=f"r{k}",
                    at_ms=at,
                    workload=f"run{k}",
                    owner=rng.choice(busy),
                    gpus=g,
                    min_runtime_ms=rng.choice([0, HOUR, 2 * HOUR, 8 * HOUR]),
                ),
            ],
            state,
        )
        step(state)
        gpus_left -= g
        k += 1
    now = 7 * 24 * HOUR
    fold([ClockTicked(id="now", at_ms=now)], state)
    for i in range(pending):
        g = rng.choice([1, 1, 1, 2, 4, 8, 8, 16, 64])
        fold(
            [
                WorkloadSubmitted(
                    submitted_by="root",
                    id=f"q{i}",
                    at_ms=now,
                    workload=f"pend{i}",
                    owner=rng.choice(leaves),
                    gpus=g,
                    min_runtime_ms=rng.choice([0, 10 * MIN, HOUR, 4 * HOUR]),
                    priority=rng.randint(0, 2),
                )
            ],
            state,
        )
    return state


def steady_inputs(state, rng: random.Random, leaves: list[str], i: int, now: int) -> list:
    """The steady loop's inputs at ``now``: a random running workload finishes, a
    1-8 GPU workload with a 10-minute or 1-hour contract arrives."""
    finished = sorted(state.running)[rng.randrange(len(state.running))]
    return [
        WorkloadFinished(actor="root", id=f"sf{i}", at_ms=now, workload=finished),
        WorkloadSubmitted(
            submitted_by="root",
            id=f"ss{i}",
            at_ms=now,
            workload=f"steady{i}",
            owner=rng.choice(leaves),
            gpus=rng.choice([1, 2, 4, 8]),
            min_runtime_ms=rng.choice([10 * MIN, HOUR]),
        ),
    ]


def _percentiles(times: list[float]) -> tuple[float, float]:
    times = sorted(times)
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))]


def main(quick: bool = False) -> None:
    state = build_state(pending=2_000 if quick else 10_000)
    print(
        f"cycle: {len(state.nodes)} nodes x 8 GPUs, {len(state.running)} running, "
        f"{len(state.pending)} pending, {len(state.budget.leaves())} leaves"
    )
    # 1. the burst: every pending workload arrived at once (worst case)
    runs = 3 if quick else 10
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        result = decide(state)
        times.append((time.perf_counter() - t0) * 1000)
    kinds: dict[str, int] = {}
    for d in result.decisions:
        kinds[type(d).__name__] = kinds.get(type(d).__name__, 0) + 1
    p50, p99 = _percentiles(times)
    print(
        f"cycle (burst: all pending arrived at once -> {kinds}): p50 {p50:.1f} ms, p99 {p99:.1f} ms"
    )
    step(state)
    # 2. steady state: the cluster stays full; each cycle follows one finish and
    #    one submission a minute later, and the preemption search runs for every
    #    workload that does not fit
    rng = random.Random(2)
    leaves = state.budget.leaves()
    times = []
    placed = preempted = 0
    cycles = 20 if quick else 200
    for i in range(cycles):
        now = state.now_ms + MIN
        fold(steady_inputs(state, rng, leaves, i, now), state)
        t0 = time.perf_counter()
        result = decide(state)
        times.append((time.perf_counter() - t0) * 1000)
        for d in result.decisions:
            apply(state, d)
            placed += isinstance(d, WorkloadPlaced)
            preempted += isinstance(d, WorkloadPreempted)
    p50, p99 = _percentiles(times)
    print(
        f"cycle (steady: {len(state.running)} running, {len(state.pending)} pending, "
        f"{sum(n.free for n in state.nodes.values())} GPUs free; "
        f"{placed} placements, {preempted} preemptions in {cycles} cycles): "
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms"
    )

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.cycle.fragmentation import fragmentation_scenario

    for reservations in (True, False):
        wait = fragmentation_scenario(reservations=reservations, hours=8)
        shown = f"{wait / 60000:.0f} min" if wait is not None else "not placed within 7 h"
        print(f"fragmentation: 256-GPU job wait with reservations={reservations}: {shown}")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
