"""Fold throughput and fair-share sort keys (issue 2's benchmark).

(a) events folded per second over a pre-built history of mixed events: node
    registrations, a 200-leaf budget tree and occasional weight edits,
    submissions, placements, finishes, cancels, preemptions with and without
    requeue, health changes, clock ticks and stale reports with their
    ``InputRejected`` decisions. Only the fold is timed.
(b) the time to order 10,000 pending workloads under a 200-leaf tree with 7 days
    of charge history: ``FairShareView`` construction, every sort key, and the
    sort (``queue_order``), repeated; median and p99.

Targets (issue 2): >= 200,000 events/s; all 10,000 keys in <= 20 ms.
Run with ``make bench`` (or ``make bench ARGS=--quick``).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections import Counter
from itertools import islice

from apportion.core import FairShareView, State, fold, queue_order
from apportion.schemas.events import (
    DAY_MS,
    HOUR_MS,
    MINUTE_MS,
    BudgetSet,
    ClockTicked,
    Event,
    InputRejected,
    NodeHealthChanged,
    NodeRegistered,
    Slot,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadSubmitted,
    kind_of,
)

NODES = 500
GPUS_PER_NODE = 8


def tree_events(at_ms: int = 0) -> tuple[list[Event], list[str]]:
    """5 orgs x 8 teams x 5 users = 200 leaves (245 nodes with the root)."""
    events: list[Event] = [
        BudgetSet(id="b-root", at_ms=at_ms, path="", weight=1, owner="admin", actor="")
    ]
    leaves = []
    for o in range(5):
        org = f"org{o}"
        events.append(
            BudgetSet(
                id=f"b-{org}",
                at_ms=at_ms,
                path=org,
                weight=1 + o,
                owner=f"{org}-lead",
                actor="admin",
            )
        )
        for t in range(8):
            team = f"{org}/team{t}"
            events.append(
                BudgetSet(
                    id=f"b-{team}",
                    at_ms=at_ms,
                    path=team,
                    weight=1 + t % 3,
                    owner=f"{team}-lead",
                    actor=f"{org}-lead",
                )
            )
            for u in range(5):
                leaf = f"{team}/user{u}"
                events.append(
                    BudgetSet(
                        id=f"b-{leaf}",
                        at_ms=at_ms,
                        path=leaf,
                        weight=1,
                        owner=f"u{o}{t}{u}",
                        actor=f"{team}-lead",
                    )
                )
                leaves.append(leaf)
    return events, leaves


def node_events() -> list[Event]:
    return [
        NodeRegistered(
            actor="admin",
            id=f"n-{i}",
            at_ms=0,
            node=f"node{i:04d}",
            gpus=GPUS_PER_NODE,
            gpu_type="h100",
        )
        for i in range(NODES)
    ]


def mixed_history(n_events: int, seed: int = 7, backlog: int = 0) -> list[Event]:
    """A valid history of about ``n_events`` events (the scheduler's decisions included).

    Inputs advance time by 0-4 s (1,000,000 events span about 14 days, so
    charges slide out of the 7-day window and old breakpoints are pruned).
    ``backlog`` submissions at time 0 come first: the queue stays deep (placements
    take the oldest pending, so it turns over; the cluster starts full;
    ``bench_scale``'s deep-queue fold)."""
    rng = random.Random(seed)
    events, leaves = tree_events()
    events += node_events()
    free = [GPUS_PER_NODE] * NODES
    healthy = [True] * NODES
    spec: dict[str, tuple[int, bool, int]] = {}  # id -> (gpus, resumable, min_runtime)
    pending: dict[str, None] = {}  # ids in submit order
    running: list[str] = []
    where: dict[str, tuple[int, int, int]] = {}  # id -> (node, gpus, position in running)
    attempts: Counter[str] = Counter()
    ended: list[str] = []
    t = 0
    seq = 0
    cursor = 0

    def submit(eid: str, wid: str, at_ms: int) -> None:
        gpus = rng.choice((1, 1, 2, 4, 8, 8))
        min_runtime = rng.choice((0, 15 * MINUTE_MS, HOUR_MS, 2 * HOUR_MS, 8 * HOUR_MS))
        resumable = rng.random() < 0.8
        events.append(
            WorkloadSubmitted(
                submitted_by="admin",
                id=eid,
                at_ms=at_ms,
                workload=wid,
                owner=rng.choice(leaves),
                gpus=gpus,
                min_runtime_ms=min_runtime,
                resumable=resumable,
                priority=rng.randint(0, 2),
            )
        )
        spec[wid] = (gpus, resumable, min_runtime)
        pending[wid] = None

    def place(eid: str, wid: str, node: int, at_ms: int) -> None:
        gpus, _, min_runtime = spec[wid]
        del pending[wid]
        free[node] -= gpus
        where[wid] = (node, gpus, len(running))
        running.append(wid)
        attempts[wid] += 1
        events.append(
            WorkloadPlaced(
                id=eid,
                at_ms=at_ms,
                workload=wid,
                placement=(Slot(f"node{node:04d}", gpus),),
                allocated=min_runtime > 0,
                protected_until_ms=at_ms + min_runtime,
                attempt=attempts[wid],
            )
        )

    for i in range(backlog):
        submit(f"xb{i}", f"b{i}", 0)
    # with a backlog, the cluster starts full: the oldest pending placed first fit
    for wid in list(pending) if backlog else ():
        gpus = spec[wid][0]
        node = next((n for n in range(NODES) if free[n] >= gpus), None)
        if node is None:
            break
        place(f"xp{wid}", wid, node, 0)

    def stop(wid: str) -> None:
        node, gpus, pos = where.pop(wid)
        last = running.pop()
        if last != wid:
            running[pos] = last
            where[last] = (*where[last][:2], pos)
        free[node] += gpus

    while len(events) < n_events:
        seq += 1
        nt = t + rng.randint(0, 4_000)  # the time of the next input; decisions keep t
        eid = f"x{seq}"
        r = rng.random()
        if r < 0.29:
            t = nt
            submit(eid, f"w{seq}", t)
        elif r < 0.58 and pending:
            # the oldest pending that fits (with a backlog: any of the oldest 8)
            for wid in islice(pending, 8 if backlog else 1):
                gpus, _, min_runtime = spec[wid]
                for _ in range(16):
                    cursor = (cursor + 1) % NODES
                    if healthy[cursor] and free[cursor] >= gpus:
                        break
                else:
                    continue
                break
            else:
                continue
            place(eid, wid, cursor, t)
        elif r < 0.84 and running:
            wid = running[rng.randrange(len(running))]
            stop(wid)
            ended.append(wid)
            t = nt
            events.append(
                WorkloadFinished(
                    actor="admin",
                    id=eid,
                    at_ms=t,
                    workload=wid,
                    outcome="succeeded" if rng.random() < 0.9 else "failed",
                )
            )
        elif r < 0.87 and running:
            wid = running[rng.randrange(len(running))]
            stop(wid)
            resumable = spec[wid][1]
            t = nt
            events.append(ClockTicked(id=eid, at_ms=t))
            events.append(
                WorkloadPreempted(
                    id=f"{eid}p", at_ms=t, workload=wid, reason="fairshare", requeued=resumable
                )
            )
            if resumable:
                pending[wid] = None
            else:
                ended.append(wid)
        elif r < 0.89 and pending:
            wid = next(iter(pending))
            del pending[wid]
            ended.append(wid)
            t = nt
            events.append(WorkloadCancelled(actor="admin", id=eid, at_ms=t, workload=wid))
        elif r < 0.90 and ended:
            # a stale report, then the scheduler's InputRejected for it
            t = nt
            events.append(
                WorkloadFinished(
                    actor="admin", id=eid, at_ms=t, workload=ended[rng.randrange(len(ended))]
                )
            )
            events.append(InputRejected(id=f"{eid}r", at_ms=t, ref=eid, reason="stale"))
        elif r < 0.905:
            node = rng.randrange(NODES)
            healthy[node] = not healthy[node]
            t = nt
            state = "healthy" if healthy[node] else "draining"
            events.append(
                NodeHealthChanged(
                    actor="admin", id=eid, at_ms=t, node=f"node{node:04d}", state=state
                )
            )
        elif r < 0.906:
            leaf = rng.choice(leaves)
            team = leaf.rpartition("/")[0]
            t = nt
            events.append(
                BudgetSet(
                    id=eid,
                    at_ms=t,
                    path=leaf,
                    weight=rng.randint(1, 4),
                    owner="u",
                    actor=f"{team}-lead",
                )
            )
        else:
            t = nt
            events.append(ClockTicked(id=eid, at_ms=t))
    return events


def bench_fold(n_events: int, repeats: int) -> None:
    events = mixed_history(n_events)
    mix = Counter(kind_of(e) for e in events)
    print(
        f"fold: {len(events):,} pre-built events spanning {events[-1].at_ms / DAY_MS:.1f} simulated days"
    )
    print("fold: mix " + ", ".join(f"{k} {v / len(events):.1%}" for k, v in mix.most_common()))
    rates = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        state = fold(events)
        elapsed = time.perf_counter() - start
        rates.append(len(events) / elapsed)
        assert not state.rejections, state.rejections[:3]
    best, median = max(rates), statistics.median(rates)
    print(
        f"fold: {median:,.0f} events/s median, {best:,.0f} events/s best of {repeats} "
        f"({len(events) / median:.2f} s per pass)   target >= 200,000 events/s   "
        f"{'OK' if median >= 200_000 else 'MISSED'}"
    )
    print(
        f"fold: end state {len(state.running):,} running, {len(state.pending):,} pending, "
        f"{len(state.ended):,} ended; root usage over 7 d {state.usage('') / HOUR_MS:,.0f} GPU-h"
    )


def keys_state(n_pending: int, seed: int = 11) -> State:
    """200-leaf tree; 7 days of allocated runs (every leaf many times); then ``n_pending`` pending."""
    rng = random.Random(seed)
    events, leaves = tree_events()
    events += node_events()
    state = fold(events)
    # 7 days of history: runs start every ~20 s on round-robin nodes, 1-8 GPUs, 10 min to 6 h
    ends: list[tuple[int, str]] = []
    t = 0
    n = 0
    batch: list[Event] = []
    while t < 7 * DAY_MS:
        t += rng.randint(5_000, 35_000)
        n += 1
        ends.sort()
        while ends and ends[0][0] <= t:
            end, wid = ends.pop(0)
            batch.append(WorkloadFinished(actor="admin", id=f"f{wid}", at_ms=end, workload=wid))
        wid = f"h{n}"
        gpus = rng.choice((1, 2, 4, 8))
        batch.append(
            WorkloadSubmitted(
                submitted_by="admin",
                id=f"s{wid}",
                at_ms=t,
                workload=wid,
                owner=rng.choice(leaves),
                gpus=gpus,
                min_runtime_ms=HOUR_MS,
            )
        )
        node = state.nodes[f"node{n % NODES:04d}"]
        fold(batch, state)
        batch.clear()
        if node.free >= gpus:
            batch.append(
                WorkloadPlaced(
                    id=f"p{wid}",
                    at_ms=t,
                    workload=wid,
                    placement=(Slot(node.node, gpus),),
                    allocated=True,
                    protected_until_ms=t + HOUR_MS,
                    attempt=1,
                )
            )
            ends.append((t + rng.randint(10 * MINUTE_MS, 6 * HOUR_MS), wid))
        else:
            batch.append(WorkloadCancelled(actor="admin", id=f"c{wid}", at_ms=t, workload=wid))
    fold(batch, state)
    now = state.now_ms
    fold(
        (
            WorkloadSubmitted(
                submitted_by="admin",
                id=f"q{i}",
                at_ms=now,
                workload=f"q{i}",
                owner=rng.choice(leaves),
                gpus=rng.choice((1, 2, 4, 8, 16, 64)),
                min_runtime_ms=rng.choice((0, HOUR_MS, HOUR_MS, 4 * HOUR_MS)),
                priority=rng.randint(0, 3),
            )
            for i in range(n_pending)
        ),
        state,
    )
    assert not state.rejections, state.rejections[:3]
    return state


def bench_keys(n_pending: int, repeats: int) -> None:
    state = keys_state(n_pending)
    breakpoints = sum(len(n.series.times) for n in state.budget.nodes.values())
    print(
        f"keys: {len(state.pending):,} pending under {len(state.budget.leaves())} leaves "
        f"({len(state.budget.nodes)} nodes, {breakpoints:,} charge breakpoints over 7 days)"
    )
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        order = queue_order(state, FairShareView(state))
        times.append((time.perf_counter() - start) * 1000)
    assert len(order) == n_pending
    times.sort()
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    median = statistics.median(times)
    print(
        f"keys: view + {n_pending:,} sort keys + sort: median {median:.2f} ms, p99 {p99:.2f} ms, "
        f"min {times[0]:.2f} ms over {repeats} runs   target <= 20 ms   {'OK' if p99 <= 20 else 'MISSED'}"
    )


def main(quick: bool) -> None:
    bench_fold(50_000 if quick else 1_000_000, 2 if quick else 3)
    bench_keys(10_000, 20 if quick else 200)


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
