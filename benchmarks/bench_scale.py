"""Scale rows (issue 14): how the cycle, the fold and the simulator grow with size.

``make bench ARGS="--only scale"`` runs only these rows; ``--quick`` the small
variants (about 5 minutes on 2 cores). Each measurement runs in its own Python
process, so its peak RSS (``ru_maxrss``) is its own. Every row prints wall and
CPU time (``time.process_time``) and the rows end as one markdown table, with
the command that produced it; the same rows go to ``build/bench-scale.json``
(compare two of those files before and after a change).

1. **Cycle**: one ``decide`` on 1,024 and 16,384 GPUs (8 per node) with 10k,
   100k and 300k pending under 200 leaves (:func:`bench_fold.tree_events`).
   The running set is the one ``bench_cycle.build_state`` fills (one 8-GPU run
   in 40, the rest 1 GPU; ~870 runs per 1,024 GPUs, started over 6 days, a
   third of the leaves busy), folded as submissions and placements instead of
   being placed cycle by cycle (so a 300k state builds in seconds); then the
   pending work arrives at once (the ``bench_cycle`` mix: 1-64 GPUs).
   *burst*: ``decide`` on that state (every pending workload arrived at once),
   repeated on the same state. *steady*: the burst's decisions folded (as in
   ``bench_cycle``: the running set is then the one the scheduler chose, fewer
   and larger runs), then each cycle follows ``1 + gpus // 4096`` finishes and
   as many submissions (1-8 GPUs) a minute later (1 at 1,024 GPUs, 5 at
   16,384). The first steady cycles at 16,384 GPUs still move thousands of
   runs (the burst's after-shocks): they are in the p99.
2. **Fold** on a deep-queue history: ``bench_fold.mixed_history`` with a
   backlog submitted first (tens of thousands pending all along; the cluster
   starts full and the oldest pending are placed as GPUs free), fold alone,
   JSON decode + fold (``schemas.codec.decode_event`` per event), the same
   history written as an event log file and read back by ``replay``'s reader
   and folded item by item (*read log+fold*: what ``apportion replay`` and
   ``audit`` do with a file; the decisions after each input become its batch;
   *read log*: the reader alone),
   and fold with the pending index kept from the first event on, as a
   scheduler keeps it (*index kept*; a fold that no cycle reads never builds it:
   :mod:`apportion.core.pendingindex`).
3. **Simulation**: the ``family`` scenario at 1x, 4x and 16x size (1,024 /
   4,096 / 16,384 GPUs; demand scales with the cluster, the tree with it: see
   :data:`SIM_SIZES`), ``simulate`` (the DuckDB projection observing, as
   ``apportion simulate``). CPU seconds per simulated day are measured over a
   window after a warm-up (from the first cycle at the end of the warm-up,
   where an extra ``ClockTicked`` makes one, to the end of the horizon;
   sizes that cost under 5 CPU s are run again, median of up to 9) and the
   growth exponent ``log(cost_k / cost_1) / log(k)`` is printed for 4x and
   16x: all sizes run the same window. Default: a 24 h warm-up and 1 measured
   day; ``--quick``: 6 h + 4 h (hours 6-10: night, then the first working
   hours with their debug jobs; the family's cost follows the time of day, so
   the per-day figure is that window's rate); ``--days N``: the 2-day warm-up
   of ``apportion simulate`` and N measured days (16x for ``--days 2`` takes
   tens of minutes).

The profile of one configuration: ``python benchmarks/bench_scale.py --profile
16384 100000`` writes ``build/profile-cycle-100k.txt`` (pyinstrument, steady
cycles only: the call tree and the top functions by cumulative time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_fold import mixed_history, tree_events  # noqa: E402

MIN = 60_000
HOUR = 60 * MIN
DAY = 24 * HOUR
NODE_GPUS = 8

CYCLE_GPUS = (1_024, 16_384)
CYCLE_PENDING = (10_000, 100_000, 300_000)
SIM_SIZES: dict[int, dict[str, int]] = {
    1: {"gpus": 1_024, "programs": 3, "teams": 8, "users": 3},
    4: {"gpus": 4_096, "programs": 12, "teams": 32, "users": 3},
    16: {"gpus": 16_384, "programs": 24, "teams": 64, "users": 6},
}
"""``family`` knobs per size: GPUs and users (leaves) scale by k (teams up to the
knob's limit of 64, then users per team); every other knob is per unit of size."""
OUT_JSON = ROOT / "build" / "bench-scale.json"
PROFILE_TXT = ROOT / "build" / "profile-cycle-100k.txt"


def peak_rss_mb() -> float:
    """This process's peak resident set so far, MB (``ru_maxrss`` is KiB on Linux)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def percentiles(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return statistics.median(values), values[min(len(values) - 1, int(len(values) * 0.99))]


# ----------------------------------------------------------------------
# 1. cycle
# ----------------------------------------------------------------------


def build_cycle_state(gpus: int, pending: int, seed: int = 1):
    """A full cluster of ``gpus`` (8 per node), ``bench_cycle``'s running set and mix of
    ``pending`` submissions at one instant (7 days in), folded from generated events."""
    from apportion.core import fold
    from apportion.schemas.events import (
        ClockTicked,
        Event,
        NodeRegistered,
        Slot,
        WorkloadPlaced,
        WorkloadSubmitted,
    )

    rng = random.Random(seed)
    tree, leaves = tree_events()
    nodes = gpus // NODE_GPUS
    events: list[Event] = list(tree)
    events += [
        NodeRegistered(
            actor="admin", id=f"n-{i}", at_ms=0, node=f"n{i:05d}", gpus=NODE_GPUS, gpu_type="h100"
        )
        for i in range(nodes)
    ]
    state = fold(events)
    # the running set: one 8-GPU run in 40, the rest 1 GPU, until every GPU is taken;
    # 8-GPU runs take whole nodes from the front, 1-GPU runs fill the rest
    busy = leaves[::3]
    sizes: list[int] = []
    left = gpus
    while left > 0:
        g = min(8 if len(sizes) % 40 == 0 else 1, left)
        sizes.append(g)
        left -= g
    whole = sum(1 for g in sizes if g == NODE_GPUS)
    small_node, small_used = whole, 0
    runs: list[tuple[int, int, str, int, int]] = []  # (start, k, node, gpus, min_runtime)
    big = 0
    for k, g in enumerate(sizes):
        if g == NODE_GPUS:
            node, big = big, big + 1
        else:
            if small_used + g > NODE_GPUS:
                small_node, small_used = small_node + 1, 0
            node, small_used = small_node, small_used + g
        start = rng.randint(0, 6 * 24) * HOUR
        runs.append((start, k, f"n{node:05d}", g, rng.choice([0, HOUR, 2 * HOUR, 8 * HOUR])))
    runs.sort()
    fill: list[Event] = []
    for start, k, node, g, min_runtime in runs:
        fill.append(ClockTicked(id=f"c{k}", at_ms=start))
        fill.append(
            WorkloadSubmitted(
                submitted_by="admin",
                id=f"r{k}",
                at_ms=start,
                workload=f"run{k}",
                owner=rng.choice(busy),
                gpus=g,
                min_runtime_ms=min_runtime,
            )
        )
        fill.append(
            WorkloadPlaced(
                id=f"p{k}",
                at_ms=start,
                workload=f"run{k}",
                placement=(Slot(node, g),),
                allocated=min_runtime > 0,
                protected_until_ms=start + min_runtime,
                attempt=1,
            )
        )
    fold(fill, state)
    now = 7 * DAY
    fold([ClockTicked(id="now", at_ms=now)], state)
    fold(
        (
            WorkloadSubmitted(
                submitted_by="admin",
                id=f"q{i}",
                at_ms=now,
                workload=f"pend{i}",
                owner=rng.choice(leaves),
                gpus=rng.choice([1, 1, 1, 2, 4, 8, 8, 16, 64]),
                min_runtime_ms=rng.choice([0, 10 * MIN, HOUR, 4 * HOUR]),
                priority=rng.randint(0, 2),
            )
            for i in range(pending)
        ),
        state,
    )
    assert not state.rejections, state.rejections[:3]
    # A running scheduler keeps the pending index from its first cycle on; build it
    # here, so that the burst row times the cycle, not that one-time build
    # (about 0.8 us per pending workload: core/pendingindex.py).
    state.pending_index.keep()
    return state


def steady_inputs(state, rng: random.Random, i: int, per_cycle: int) -> list:
    """``per_cycle`` finishes of random running work and as many submissions, a minute on."""
    from apportion.schemas.events import WorkloadFinished, WorkloadSubmitted

    now = state.now_ms + MIN
    running = list(state.running)
    leaves = state.budget.leaves()
    done = rng.sample(running, min(per_cycle, len(running)))
    events: list = [
        WorkloadFinished(actor="admin", id=f"sf{i}-{j}", at_ms=now, workload=w)
        for j, w in enumerate(done)
    ]
    events += [
        WorkloadSubmitted(
            submitted_by="admin",
            id=f"ss{i}-{j}",
            at_ms=now,
            workload=f"steady{i}-{j}",
            owner=rng.choice(leaves),
            gpus=rng.choice([1, 2, 4, 8]),
            min_runtime_ms=rng.choice([10 * MIN, HOUR]),
        )
        for j in range(per_cycle)
    ]
    return events


def _timed_decide(state) -> tuple[Any, float, float]:
    from apportion.core.cycle import decide

    c0, w0 = time.process_time(), time.perf_counter()
    result = decide(state)
    return result, (time.perf_counter() - w0) * 1000, (time.process_time() - c0) * 1000


def child_cycle(gpus: int, pending: int, quick: bool, profile: Path | None = None) -> list[dict]:
    """Build the state, time burst then steady cycles; one row for each."""
    from apportion.core import apply, fold
    from apportion.schemas.events import WorkloadPlaced, WorkloadPreempted

    c0, w0 = time.process_time(), time.perf_counter()
    state = build_cycle_state(gpus, pending)
    build = {"build_wall_s": time.perf_counter() - w0, "build_cpu_s": time.process_time() - c0}
    base = {
        "kind": "cycle",
        "gpus": gpus,
        "nodes": len(state.nodes),
        "running": len(state.running),
        "pending": len(state.pending),
        "leaves": len(state.budget.leaves()),
        **build,
    }
    rows = []
    big = gpus > 4_096 or pending >= 100_000  # a burst there takes seconds to a minute
    runs = (1 if big else 3) if quick else (3 if big else 10)
    if profile is None:
        walls, cpus = [], []
        for _ in range(runs):
            result, wall, cpu = _timed_decide(state)
            walls.append(wall)
            cpus.append(cpu)
        kinds = {
            "placed": sum(isinstance(d, WorkloadPlaced) for d in result.decisions),
            "preempted": sum(isinstance(d, WorkloadPreempted) for d in result.decisions),
        }
        rows.append(_cycle_row(base, "burst", walls, cpus, {**kinds, "cycles": runs}))
    else:
        result = _timed_decide(state)[0]
    for d in result.decisions:
        apply(state, d)
    rng = random.Random(2)
    per_cycle = 1 + gpus // 4096
    cycles = (10 if big else 20) if quick else (100 if big else 200)
    walls, cpus = [], []
    placed = preempted = 0
    profiler = None
    if profile is not None:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
    for i in range(cycles):
        fold(steady_inputs(state, rng, i, per_cycle), state)
        if profiler is not None:
            profiler.start()
        result, wall, cpu = _timed_decide(state)
        if profiler is not None:
            profiler.stop()
        walls.append(wall)
        cpus.append(cpu)
        for d in result.decisions:
            apply(state, d)
            placed += isinstance(d, WorkloadPlaced)
            preempted += isinstance(d, WorkloadPreempted)
    detail = {
        "cycles": cycles,
        "finishes_per_cycle": per_cycle,
        "submits_per_cycle": per_cycle,
        "placed": placed,
        "preempted": preempted,
        "running_after": len(state.running),
        "pending_after": len(state.pending),
    }
    rows.append(_cycle_row(base, "steady", walls, cpus, detail))
    if profiler is not None and profile is not None:
        write_profile(profiler, profile, rows[-1])
    return rows


def _cycle_row(base: dict, mode: str, walls: list[float], cpus: list[float], detail: dict) -> dict:
    wall50, wall99 = percentiles(walls)
    cpu50, cpu99 = percentiles(cpus)
    return {
        **base,
        "row": f"cycle {mode}",
        "mode": mode,
        "wall_p50_ms": round(wall50, 2),
        "wall_p99_ms": round(wall99, 2),
        "cpu_p50_ms": round(cpu50, 2),
        "cpu_p99_ms": round(cpu99, 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        **detail,
    }


def write_profile(profiler: Any, path: Path, row: dict) -> None:
    """The pyinstrument call tree and the top functions by cumulative time to ``path``."""
    session = profiler.last_session
    root = session.root_frame()
    cumulative: dict[tuple[str, str, int], float] = {}
    own: dict[tuple[str, str, int], float] = {}

    def walk(frame: Any, above: set) -> None:
        key = (frame.function or "?", frame.file_path_short or "", frame.line_no or 0)
        if frame.is_synthetic:  # pyinstrument's "[self]" leaves: in their parent's self time
            return
        if key not in above:  # a recursive call counts once, at its outermost frame
            cumulative[key] = cumulative.get(key, 0.0) + frame.time
        own[key] = own.get(key, 0.0) + frame.total_self_time
        for child in frame.children:
            walk(child, above | {key})

    if root is not None:
        walk(root, set())
    total = root.time if root is not None else 0.0
    lines = [
        f"pyinstrument profile: {row['cycles']} steady cycles, {row['gpus']:,} GPUs, "
        f"{row['pending']:,} pending, {row['running']:,} running "
        f"(p50 {row['wall_p50_ms']} ms wall, {row['cpu_p50_ms']} ms CPU, profiler on); "
        f"{total:.2f} s sampled (wall clock: pyinstrument samples wall time; "
        f"CPU time {getattr(session, 'cpu_time', float('nan')):.2f} s)",
        f"command: .venv/bin/python benchmarks/bench_scale.py --profile {row['gpus']} {row['pending']}",
        "",
        "top functions by cumulative time",
        f"{'cum s':>8} {'cum %':>6} {'self s':>8}  function (file:line)",
    ]
    for key, cum in sorted(cumulative.items(), key=lambda kv: -kv[1])[:40]:
        fn, file, line = key
        lines.append(
            f"{cum:8.3f} {100 * cum / total if total else 0:5.1f}% {own.get(key, 0):8.3f}  "
            f"{fn} ({file}:{line})"
        )
    lines += ["", "call tree", profiler.output_text(unicode=False, color=False, show_all=False)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print("\n".join(lines[:22]))
    print(f"profile written to {path}")


# ----------------------------------------------------------------------
# 2. fold on a deep queue
# ----------------------------------------------------------------------


def _wire_safe(event: Any) -> Any:
    """``event`` with '/' in the names of people (a budget node's owner, an actor) as '.' (``tree_events`` names team
    leads ``org0/team1-lead``, which the wire schema refuses; the same map everywhere
    keeps every authority check as it was)."""
    import msgspec

    people = ("owner", "actor") if type(event).__name__ == "BudgetSet" else ("actor",)
    changes = {
        f: getattr(event, f).replace("/", ".")
        for f in people
        if "/" in (getattr(event, f, "") or "")
    }
    return msgspec.structs.replace(event, **changes) if changes else event


def child_fold(quick: bool) -> list[dict]:
    from apportion.core import State, fold
    from apportion.replay.eventlog import Header, read_file, write_log
    from apportion.schemas.codec import decode_event, encode

    def fold_keeping_the_index() -> State:
        state = State()
        state.pending_index.keep()  # built now (empty), kept by every event
        return fold(events, state)

    def read_and_fold(path: Path) -> State:
        from apportion.core.history import fold_item

        state = State()
        for item in read_file(path):
            fold_item(state, item)
        return state

    n_events, backlog = (200_000, 20_000) if quick else (1_000_000, 40_000)
    events = [_wire_safe(e) for e in mixed_history(n_events, backlog=backlog)]
    blobs = [encode(e) for e in events]
    log_dir = tempfile.TemporaryDirectory()
    log_path = Path(log_dir.name) / "deep-queue.jsonl"
    items = write_log(log_path, Header(source="bench"), history_items(events))
    n_items = items.inputs + items.batches
    rows = []
    for mode in ("fold", "decode+fold", "read log", "read log+fold", "fold, index kept"):
        rates, cpu_s = [], []
        for _ in range(1 if quick else 3):
            c0, w0 = time.process_time(), time.perf_counter()
            if mode == "fold":
                state = fold(events)
            elif mode == "decode+fold":
                state = fold(decode_event(b) for b in blobs)
            elif mode == "read log":
                read = sum(1 for _ in read_file(log_path))
                assert read == n_items, read
            elif mode == "read log+fold":
                state = read_and_fold(log_path)
            else:
                state = fold_keeping_the_index()
            wall = time.perf_counter() - w0
            cpu_s.append(time.process_time() - c0)
            rates.append(len(events) / wall)
        assert not state.rejections, state.rejections[:3]
        rows.append(
            {
                "kind": "fold",
                "row": f"fold deep queue ({mode})",
                "mode": mode,
                "events": len(events),
                "backlog": backlog,
                "pending_end": len(state.pending),
                "running_end": len(state.running),
                "events_per_s": round(statistics.median(rates)),
                "wall_s": round(len(events) / statistics.median(rates), 3),
                "cpu_s": round(statistics.median(cpu_s), 3),
                "passes": len(rates),
                "peak_rss_mb": round(peak_rss_mb(), 1),
            }
        )
    return rows


def history_items(events: list[Any]) -> Iterator[Any]:
    """``events`` as history items: each input numbered, the decisions that follow
    it as one batch based on it."""
    from apportion.schemas.events import INPUT_TYPES, DecisionBatch
    from apportion.schemas.history import BatchItem, InputItem

    seq, batches, decisions = 0, 0, []
    for event in [*events, None]:
        if event is not None and not isinstance(event, INPUT_TYPES):
            decisions.append(event)
            continue
        if decisions:
            batches += 1
            yield BatchItem(seq=batches, batch=DecisionBatch(basis=seq, decisions=tuple(decisions)))
            decisions = []
        if event is not None:
            seq += 1
            yield InputItem(seq=seq, at_ms=event.at_ms, ref=event.id, event=event)


# ----------------------------------------------------------------------
# 3. simulation cost per simulated day
# ----------------------------------------------------------------------


def child_sim(k: int, warmup_h: float, measure_h: float) -> list[dict]:
    from apportion.core.cycle import decide
    from apportion.replay.cluster_file import cluster_from_dict
    from apportion.replay.family import Knobs, family
    from apportion.replay.run import scenario_cluster_doc
    from apportion.replay.simulator import simulate
    from apportion.schemas.events import ClockTicked

    knobs = SIM_SIZES[k]
    total_h = warmup_h + measure_h
    warm_ms = int(warmup_h * HOUR)
    c0 = time.process_time()
    sc = family(days=math.ceil(total_h / 24), seed=1, knobs=Knobs(**knobs))
    events = list(cluster_from_dict(scenario_cluster_doc(sc), "<scenario family>").events)
    gen_cpu = time.process_time() - c0
    mark: list[tuple[float, float]] = []  # (cpu s, wall s) when the first cycle at warm_ms starts

    def timed_decide(state: Any) -> Any:
        # the budget policy's cycle; notes the clocks when the measured window opens
        if not mark and state.now_ms >= warm_ms:
            mark.append((time.process_time(), time.perf_counter()))
        return decide(state)

    # small sizes cost a fraction of a second: repeat them (the same deterministic
    # run) until 5 CPU s are spent, at most 9 times, and keep the median window
    windows: list[tuple[float, float]] = []
    totals: list[tuple[float, float]] = []
    spent = 0.0
    while not windows or (spent < 5.0 and len(windows) < 9):
        mark.clear()
        c1, w1 = time.process_time(), time.perf_counter()
        result = simulate(
            events,
            sc.trace,
            sc.health,
            policy="budget",
            days=total_h / 24,
            decide=timed_decide,
            # a tick at the end of the warm-up: every size opens its window on a cycle there
            timed_inputs=[ClockTicked(id="bench-warmup-end", at_ms=warm_ms)],
        )
        c2, w2 = time.process_time(), time.perf_counter()
        windows.append((c2 - mark[0][0], w2 - mark[0][1]))
        totals.append((c2 - c1, w2 - w1))
        spent += c2 - c1
    window_days = measure_h / 24
    cpu = statistics.median(w[0] for w in windows)
    wall = statistics.median(w[1] for w in windows)
    return [
        {
            "kind": "sim",
            "row": f"simulate family {k}x",
            "size": k,
            **knobs,
            "workloads": len(sc.trace),
            "warmup_h": warmup_h,
            "measured_h": measure_h,
            "cpu_s_window": round(cpu, 2),
            "wall_s_window": round(wall, 2),
            "cpu_s_per_sim_day": round(cpu / window_days, 2),
            "wall_s_per_sim_day": round(wall / window_days, 2),
            "cpu_s_total": round(statistics.median(t[0] for t in totals), 2),
            "wall_s_total": round(statistics.median(t[1] for t in totals), 2),
            "runs": len(windows),
            "generate_cpu_s": round(gen_cpu, 2),
            "cycles": result.cycles,
            "pending_end": len(result.state.pending),
            "running_end": len(result.state.running),
            "peak_rss_mb": round(peak_rss_mb(), 1),
        }
    ]


# ----------------------------------------------------------------------
# the parent: one process per measurement, the table, the JSON
# ----------------------------------------------------------------------


def _spawn(args: list[str]) -> list[dict]:
    """Run this file as a child measuring ``args``; its last stdout line is the JSON rows."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"bench_scale: child {' '.join(args)} failed ({proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ms(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def table(rows: list[dict], command: str) -> str:
    out = [
        f"`{command}`",
        "",
        "| row | size | wall | CPU | peak RSS | detail |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        rss = f"{r['peak_rss_mb']:,.0f} MB" if "peak_rss_mb" in r else ""
        if r["kind"] == "cycle":
            size = f"{r['gpus']:,} GPUs, {r['pending'] // 1000}k pending"
            wall = f"p50 {_ms(r['wall_p50_ms'])} ms, p99 {_ms(r['wall_p99_ms'])} ms"
            cpu = f"p50 {_ms(r['cpu_p50_ms'])} ms, p99 {_ms(r['cpu_p99_ms'])} ms"
            if r["mode"] == "burst":
                detail = (
                    f"{r['running']:,} running; {r['placed']:,} placed, "
                    f"{r['preempted']:,} preempted per cycle; {r['cycles']} cycles; "
                    f"built in {r['build_wall_s']:.1f} s"
                )
            else:
                detail = (
                    f"{r['finishes_per_cycle']} finish + {r['submits_per_cycle']} submit per cycle, "
                    f"{r['cycles']} cycles after the burst's decisions: {r['placed']:,} placed, "
                    f"{r['preempted']:,} preempted; {r['running_after']:,} running at the end"
                )
        elif r["kind"] == "fold":
            size = f"{r['events']:,} events, {r['backlog'] // 1000}k backlog"
            wall = f"{r['events_per_s']:,} events/s ({r['wall_s']:.2f} s)"
            cpu = f"{r['cpu_s']:.2f} s"
            detail = (
                f"end: {r['pending_end']:,} pending, {r['running_end']:,} running; "
                f"median of {r['passes']}"
            )
        elif r["kind"] == "sim":
            size = f"{r['gpus']:,} GPUs ({r['size']}x), {r['teams']} teams x {r['users']} users"
            wall = f"{r['wall_s_per_sim_day']:,.1f} s / sim day"
            cpu = f"{r['cpu_s_per_sim_day']:,.1f} s / sim day"
            detail = (
                f"hours {r['warmup_h']:g}-{r['warmup_h'] + r['measured_h']:g}: "
                f"{r['cpu_s_window']:,.2f} CPU s; whole run {r['cpu_s_total']:,.1f} CPU s "
                f"(median of {r['runs']}), "
                f"{r['workloads']:,} workloads, {r['pending_end']:,} pending at the end"
            )
        else:  # growth exponent
            size = f"{r['size']}x vs 1x"
            wall = ""
            cpu = f"exponent {r['exponent']:.2f}"
            detail = f"cost ratio {r['ratio']:.1f}x for {r['size']}x the cluster (1.00 = linear)"
        out.append(f"| {r['row']} | {size} | {wall} | {cpu} | {rss} | {detail} |")
    return "\n".join(out)


def sim_window(quick: bool, days: float | None, warmup_h: float | None) -> tuple[float, float]:
    """(warm-up hours, measured hours)."""
    if days is not None:
        return (48.0 if warmup_h is None else warmup_h), days * 24
    if quick:
        return (6.0 if warmup_h is None else warmup_h), 4.0
    return (24.0 if warmup_h is None else warmup_h), 24.0


def main(
    quick: bool = False,
    days: float | None = None,
    warmup_hours: float | None = None,
    command: str | None = None,
) -> None:
    command = command or 'make bench ARGS="--only scale' + (' --quick"' if quick else '"')
    rows: list[dict] = []

    def add(new: list[dict]) -> None:
        for r in new:
            rows.append(r)
            print("  " + table([r], command).splitlines()[-1], flush=True)

    t0 = time.perf_counter()
    print(f"scale: {platform.node()} {os.cpu_count()} CPUs; python {platform.python_version()}")
    for gpus in CYCLE_GPUS:
        for pending in CYCLE_PENDING:
            add(_spawn(["cycle", str(gpus), str(pending), *(["--quick"] if quick else [])]))
    add(_spawn(["fold", *(["--quick"] if quick else [])]))
    warm, measure = sim_window(quick, days, warmup_hours)
    sims: dict[int, dict] = {}
    for k in SIM_SIZES:
        (row,) = _spawn(["sim", str(k), str(warm), str(measure)])
        sims[k] = row
        add([row])
    for k in SIM_SIZES:
        if k == 1:
            continue
        ratio = sims[k]["cpu_s_per_sim_day"] / max(sims[1]["cpu_s_per_sim_day"], 1e-9)
        add(
            [
                {
                    "kind": "growth",
                    "row": f"simulation growth {k}x",
                    "size": k,
                    "ratio": round(ratio, 2),
                    "exponent": round(math.log(ratio) / math.log(k), 3),
                }
            ]
        )
    elapsed = time.perf_counter() - t0
    text = table(rows, command)
    print()
    print(text)
    print(f"\n(scale rows took {elapsed:.0f} s wall)")
    OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
    OUT_JSON.write_text(
        json.dumps(
            {
                "command": command,
                "quick": quick,
                "sim_window_hours": [warm, measure],
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "elapsed_s": round(elapsed, 1),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"rows written to {OUT_JSON.relative_to(ROOT)}")


def _cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--days", type=float, default=None, help="measured simulated days")
    parser.add_argument("--warmup-hours", type=float, default=None)
    parser.add_argument(
        "--profile",
        nargs=2,
        type=int,
        metavar=("GPUS", "PENDING"),
        help="profile the steady cycles of one configuration (pyinstrument)",
    )
    parser.add_argument("--out", type=Path, default=PROFILE_TXT, help="where --profile writes")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        what, *rest = args.child
        if what == "cycle":
            rows = child_cycle(int(rest[0]), int(rest[1]), args.quick)
        elif what == "fold":
            rows = child_fold(args.quick)
        elif what == "sim":
            rows = child_sim(int(rest[0]), float(rest[1]), float(rest[2]))
        else:
            raise SystemExit(f"unknown child {what!r}")
        print(json.dumps(rows))
        return
    if args.profile:
        gpus, pending = args.profile
        child_cycle(gpus, pending, quick=False, profile=args.out)
        return
    main(
        quick=args.quick,
        days=args.days,
        warmup_hours=args.warmup_hours,
        command="python benchmarks/bench_scale.py " + " ".join(sys.argv[1:]),
    )


if __name__ == "__main__":
    _cli()
