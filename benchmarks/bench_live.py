"""Live services on a real nats-server (``make bench``; ``--quick`` for the small variant).

1. **Sustained throughput**: a 1,024-GPU cluster (128 nodes x 8); one process
   publishes submits and cancels (pipelined), the scheduler and the projector
   run in their own processes; the figure is inputs per second from the first
   publish until the projector has committed the last input and the batch
   after it (publish -> scheduler -> decisions -> projector).
2. **Submit-to-placement latency** on an idle cluster: submit one workload,
   wait until its ``WorkloadPlaced`` arrives on DECISIONS, cancel it; p50/p99.

Uses ``NATS_URL`` if set, else starts the ``nats-server`` from the venv.
Aims (issue 5): >= 5,000 inputs/s sustained; p50 <= 50 ms.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apportion.services.runner import serve_process  # an importable target for spawn

NODES = 128
GPUS_PER_NODE = 8
TEAMS = [
    ("llm/pretrain", 4),
    ("llm/finetune", 2),
    ("vision/det", 2),
    ("vision/seg", 1),
    ("rl/agents", 3),
    ("infra/ci", 1),
]


def cluster_events() -> list:
    from apportion.schemas.events import BudgetSet, NodeRegistered

    events: list = [
        NodeRegistered(
            actor="ops",
            id=f"node-{i}",
            at_ms=0,
            node=f"n{i:04d}",
            gpus=GPUS_PER_NODE,
            gpu_type="h100",
        )
        for i in range(NODES)
    ]
    events.append(BudgetSet(id="b-root", at_ms=0, path="", weight=1, owner="ops", actor="ops"))
    parents = sorted({t.split("/")[0] for t, _ in TEAMS})
    for p in parents:
        events.append(BudgetSet(id=f"b-{p}", at_ms=0, path=p, weight=2, owner=p, actor="ops"))
    for t, w in TEAMS:
        events.append(BudgetSet(id=f"b-{t}", at_ms=0, path=t, weight=w, owner="x", actor="ops"))
    return events


async def _throughput(url: str, n_inputs: int, tmp: Path) -> tuple[float, int]:
    from apportion.schemas.events import WorkloadCancelled, WorkloadSubmitted
    from apportion.services.bus import JetStreamLog, connect

    cluster = f"bench{uuid.uuid4().hex[:6]}"
    nc = await connect(url)
    log = JetStreamLog(nc.jetstream(), cluster, max_async_pending=20_000)
    await log.setup()
    await log.publish_inputs(cluster_events())
    ctx = mp.get_context("spawn")
    position = ctx.Value("q", 0)
    procs = []
    for kind in ("scheduler", "projector"):
        ready = ctx.Event()
        p = ctx.Process(
            target=serve_process,
            args=(kind, url, cluster, str(tmp / f"{cluster}.duckdb"), position, ready),
        )
        p.start()
        procs.append(p)
        ready.wait(60)
    try:
        base = await log.last_input_seq()
        while position.value < base:  # warm: services connected and caught up with the cluster
            await asyncio.sleep(0.05)
        events = []
        keep = 400  # live workloads stay bounded: each submit cancels the one 400 before it
        for i in range(n_inputs // 2):
            team = TEAMS[i % len(TEAMS)][0]
            events.append(
                WorkloadSubmitted(
                    submitted_by="ops",
                    id=f"s{i}",
                    at_ms=0,
                    workload=f"w{i}",
                    owner=team,
                    gpus=1 << (i % 4),
                    min_runtime_ms=900_000,
                )
            )
            if i >= keep:
                events.append(
                    WorkloadCancelled(actor="ops", id=f"c{i}", at_ms=0, workload=f"w{i - keep}")
                )
        t0 = time.perf_counter()
        chunk = 2000
        for j in range(0, len(events), chunk):
            await log.publish_inputs(events[j : j + chunk])
        last = base + len(events)
        while position.value < last:
            await asyncio.sleep(0.005)
        wall = time.perf_counter() - t0
        return len(events) / wall, len(events)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(30)
        await nc.close()


async def _latency(url: str, samples: int) -> list[float]:
    from apportion.schemas.events import WorkloadCancelled, WorkloadPlaced, WorkloadSubmitted
    from apportion.services.bus import JetStreamLog, connect

    cluster = f"lat{uuid.uuid4().hex[:6]}"
    nc = await connect(url)
    log = JetStreamLog(nc.jetstream(), cluster)
    await log.setup()
    await log.publish_inputs(cluster_events())
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    position = ctx.Value("q", 0)
    proc = ctx.Process(
        target=serve_process, args=("scheduler", url, cluster, None, position, ready)
    )
    proc.start()
    ready.wait(60)
    tail = log.tail_batches(1)
    out: list[float] = []
    try:
        # wait for the scheduler's first batch (it has folded the cluster)
        while not await tail.take(100, 1.0):
            pass
        for i in range(samples + 5):
            t0 = time.perf_counter()
            await log.publish_input(
                WorkloadSubmitted(
                    submitted_by="ops",
                    id=f"s{i}",
                    at_ms=0,
                    workload=f"w{i}",
                    owner="llm/pretrain",
                    gpus=8,
                    min_runtime_ms=900_000,
                )
            )
            placed = False
            while not placed:
                for sb in await tail.take(100, 10.0):
                    placed = placed or any(
                        isinstance(d, WorkloadPlaced) and d.workload == f"w{i}"
                        for d in sb.batch.decisions
                    )
            if i >= 5:  # the first few warm the connections
                out.append((time.perf_counter() - t0) * 1000)
            await log.publish_input(
                WorkloadCancelled(actor="ops", id=f"c{i}", at_ms=0, workload=f"w{i}")
            )
            await tail.take(100, 10.0)
    finally:
        await tail.close()
        proc.terminate()
        proc.join(30)
        await nc.close()
    return out


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main(quick: bool = False) -> None:
    import signal

    from apportion.services.stack import start_nats_server

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop our nats-server
    n_inputs = 4_000 if quick else 40_000
    samples = 30 if quick else 300
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        server = None
        url = os.environ.get("NATS_URL")
        if not url:
            server = start_nats_server(tmp / "nats")
            url = server.url
        try:
            rate, n = asyncio.run(_throughput(url, n_inputs, tmp))
            print(
                f"live sustained: {rate:,.0f} inputs/s ({n:,} inputs, {NODES * GPUS_PER_NODE} GPUs, publish -> scheduler -> decisions -> projector)"
            )
            lat = asyncio.run(_latency(url, samples))
            print(
                f"live submit-to-placement (idle {NODES * GPUS_PER_NODE} GPUs): p50 {statistics.median(lat):.1f} ms, "
                f"p99 {_pct(lat, 99):.1f} ms ({len(lat)} samples)"
            )
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
