"""Issue 29's target "cycle cost per cluster unchanged within 10%": the steady cycle of
:mod:`bench_cycle` (128 x 8 GPUs full, 200 leaves, 10,000 pending; ``--quick``:
2,000) on one cluster alone and as one of two clusters sharing the tree.

Federated: the policy names the cluster ``a`` and its peer ``b`` (usage summaries
every 5 minutes, the default); a week of ``b``'s summaries is folded first (one
per 5 minutes), and during the steady cycles one more arrives every 5 minutes of
event time, while the cycle reports ``a``'s own usage (``UsageReported``) at the
end of every interval. ``b`` charges every leaf in proportion to its global
share (128 GPUs' worth in all, commitments likewise): every sibling's ratio then
moves by the same amount, so with no margin (both runs) the order, and every
placement and preemption, is the same as alone (checked), and the difference is the cost of the federation
itself: the peers' series read with the usage window, the summaries folded, the
reports made. Both runs see the same finishes and submissions, one minute apart,
and the cycle's decisions are applied. Each loop runs in its own process,
alternating (the garbage collector walks the whole heap: two states in one
process would share its cost). Printed: medians of p50 and p99 of the cycle
(``decide``) and of the CPU of the whole steady loop (folds included), and
federated / alone.

    .venv/bin/python benchmarks/bench_federation_cycle.py [--quick]
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgspec
from apportion.core import State, apply, fold
from apportion.core.cycle import decide
from apportion.schemas import encode
from apportion.schemas.events import (
    LeafCharge,
    PolicySet,
    UsageReported,
    UsageSummary,
)
from bench_cycle import HOUR, MIN, build_state, steady_inputs

INTERVAL = 5 * MIN


def proportional(state: State, gpu_ms: int) -> tuple[LeafCharge, ...]:
    """About ``gpu_ms`` split over every leaf exactly in proportion to its global share
    (rounded up to a multiple that makes every part a whole GPU-ms)."""
    shares = {leaf: state.budget.global_share(leaf) for leaf in state.budget.leaves()}
    unit = math.lcm(*(f.denominator for f in shares.values()))
    k = -(-gpu_ms // unit) * unit
    return tuple(LeafCharge(leaf, int(k * f)) for leaf, f in sorted(shares.items()))


def summary(state: State, start: int, charges: tuple, committed: tuple) -> UsageSummary:
    return UsageSummary(
        id=f"usage/b/{start}",
        at_ms=start + INTERVAL,
        source="b",
        start_ms=start,
        end_ms=start + INTERVAL,
        charges=charges,
        committed=committed,
        actor="root",
    )


class Steady:
    """The steady loop of one state, a cycle at a time."""

    def __init__(self, state: State, federated: bool) -> None:
        self.state, self.federated = state, federated
        self.rng = random.Random(2)
        self.leaves = state.budget.leaves()
        self.charges = proportional(state, 128 * INTERVAL)
        self.committed = proportional(state, 128 * HOUR)
        self.next_summary = (state.now_ms // INTERVAL) * INTERVAL
        self.times: list[float] = []
        self.cpu = 0.0
        self.reports = 0
        self.made: list[bytes] = []

    def cycle(self, i: int) -> None:
        """Inputs one minute on (a peer's summary every 5 minutes when federated, a
        finish, a submission), one cycle, its decisions applied."""
        state, rng = self.state, self.rng
        c0 = time.process_time()
        now = state.now_ms + MIN
        inputs: list = []
        if self.federated:
            while self.next_summary + INTERVAL <= now:
                inputs.append(summary(state, self.next_summary, self.charges, self.committed))
                self.next_summary += INTERVAL
        inputs += steady_inputs(state, rng, self.leaves, i, now)
        fold(inputs, state)
        t0 = time.perf_counter()
        result = decide(state)
        self.times.append((time.perf_counter() - t0) * 1000)
        for d in result.decisions:
            apply(state, d)
            if isinstance(d, UsageReported):
                self.reports += 1
            else:
                self.made.append(encode(msgspec.structs.replace(d, id="")))
        self.cpu += time.process_time() - c0


def federate(state: State) -> None:
    """Make ``state`` cluster ``a`` of ``a`` + ``b`` and fold a week of ``b``'s usage."""
    now = state.now_ms
    fold(
        [
            PolicySet(
                id="fed",
                at_ms=now,
                actor="root",
                preemption_margin_ppm=0,
                cluster="a",
                peers=("a", "b"),
            )
        ],
        state,
    )
    charges, committed = proportional(state, 128 * INTERVAL), proportional(state, 128 * HOUR)
    start = now - 7 * 24 * HOUR
    start -= start % INTERVAL
    summaries = []
    while start + INTERVAL <= now:
        summaries.append(summary(state, start, charges, committed))
        start += INTERVAL
    fold(summaries, state)
    assert not state.rejections, state.rejections[:3]


def _p(times: list[float], q: float) -> float:
    times = sorted(times)
    return statistics.median(times) if q == 0.5 else times[min(len(times) - 1, int(len(times) * q))]


def run_one(federated: bool, quick: bool) -> dict:
    """One loop in this process: its cycle times, CPU and decisions' digest."""
    pending = 2_000 if quick else 10_000
    cycles = 60 if quick else 300
    state = build_state(pending=pending)
    decide(state)  # the first cycle builds the pending index
    if federated:
        federate(state)
    else:  # a margin multiplies ratios: with one, a shift of all of them could matter
        fold(
            [PolicySet(id="alone", at_ms=state.now_ms, actor="root", preemption_margin_ppm=0)],
            state,
        )
    loop = Steady(state, federated)
    for i in range(cycles):
        loop.cycle(i)
    return {
        "p50": _p(loop.times, 0.5),
        "p99": _p(loop.times, 0.99),
        "cpu": loop.cpu,
        "cycles": cycles,
        "reports": loop.reports,
        "decisions": hashlib.sha256(b"".join(loop.made)).hexdigest(),
    }


def main(quick: bool = False) -> None:
    """Each loop in its own process (the garbage collector walks the whole heap, so
    two states in one process would share its cost), alternating A B A B."""
    pairs = 1 if quick else 3
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(pairs):
        for federated in (False, True):
            out = subprocess.run(
                [sys.executable, __file__, "--child", "fed" if federated else "alone"]
                + (["--quick"] if quick else []),
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[federated].append(json.loads(out))
    digests = {r["decisions"] for rs in runs.values() for r in rs}
    assert len(digests) == 1, "the proportional charges changed a decision"
    med = {
        f: {k: statistics.median(r[k] for r in rs) for k in ("p50", "p99", "cpu")}
        for f, rs in runs.items()
    }
    for federated, m in med.items():
        name = "two clusters (a of a+b)" if federated else "one cluster"
        print(
            f"steady cycle, {name}: p50 {m['p50']:.2f} ms, p99 {m['p99']:.1f} ms, "
            f"CPU {m['cpu']:.2f} s for {runs[federated][0]['cycles']} cycles (folds included), "
            f"{runs[federated][0]['reports']} usage reports (median of {pairs} processes)"
        )
    a, f = med[False], med[True]
    print(
        f"federated / alone: p50 {f['p50'] / a['p50']:.2f}x, p99 {f['p99'] / a['p99']:.2f}x, "
        f"CPU {f['cpu'] / a['cpu']:.2f}x"
    )


if __name__ == "__main__":
    if "--child" in sys.argv:
        which = sys.argv[sys.argv.index("--child") + 1]
        print(json.dumps(run_one(which == "fed", "--quick" in sys.argv)))
    else:
        main(quick="--quick" in sys.argv)
