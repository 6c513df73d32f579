"""The Slurm bridge's latency on a real Slurm 22.05 (``make bench``; ``--quick``: fewer samples).

A slurmctld and 3 slurmd with fake GPUs on this machine (the tests' fixture,
tests/services/slurm_cluster.py), a real nats-server, the scheduler and the
bridge (``apportion slurm``, its default ``--interval`` of 0.5 s) in this
process. One 1-GPU job at a time is submitted with ``sbatch`` (held by the
submit rule); each sample times:

- **sbatch -> placed**: ``sbatch`` returned -> its ``WorkloadPlaced`` seen on the bus;
- **placed -> RUNNING**: that decision -> ``squeue`` shows the job RUNNING (polled
  every 20 ms): the bridge's round, pin + release, Slurm's own scheduling;
- **placed -> script**: that decision -> the job's script wrote its first line.

Skipped (one line says why) where Slurm cannot run: not root, or not installed.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "services"))


def _pct(xs: list[float], p: int) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def _samples(url: str, slurm: Any, n: int, interval_s: float) -> list[tuple[float, ...]]:
    from apportion.schemas.events import BudgetSet, WorkloadPlaced
    from apportion.schemas.history import BatchItem
    from apportion.services.bus import JetStreamLog, connect
    from apportion.services.canonical import Follower
    from apportion.services.runner import supervise_scheduler
    from apportion.services.scheduler import Scheduler
    from apportion.services.slurm import SlurmBridge
    from apportion.services.slurm_jobs import SlurmCli

    env = slurm.env
    nc = await connect(url)
    log = JetStreamLog(nc.jetstream(), f"benchslurm{os.getpid()}")
    await log.setup()
    await log.publish_inputs(
        [
            BudgetSet(id="b-root", at_ms=0, path="", weight=1, owner="ops", actor="ops"),
            BudgetSet(id="b-lab", at_ms=0, path="lab", weight=1, owner="root", actor="ops"),
            BudgetSet(id="b-a", at_ms=0, path="lab/a", weight=1, owner="root", actor="root"),
        ]
    )
    stop = asyncio.Event()
    sched = asyncio.create_task(supervise_scheduler(Scheduler(log), stop))
    bridge = SlurmBridge(log, partitions=["gpu"], cli=SlurmCli(env), interval_s=interval_s)
    bridge_task = asyncio.create_task(bridge.run(stop))
    follower = Follower(log)
    placed_at: dict[str, float] = {}

    async def watch() -> None:
        while not stop.is_set():
            for item in await follower.poll(0.05):
                if isinstance(item, BatchItem):
                    now = time.time()
                    for d in item.batch.decisions:
                        if isinstance(d, WorkloadPlaced):
                            placed_at.setdefault(d.workload, now)

    watcher = asyncio.create_task(watch())
    out: list[tuple[float, ...]] = []
    try:
        await asyncio.wait_for(bridge.ready.wait(), 30)
        while len(follower.state.nodes) < 3:
            await asyncio.sleep(0.05)
        for i in range(n):
            stamp = slurm.root / f"start-{i}"
            submitted = time.time()
            job = slurm.sbatch(
                "--gres=gpu:1",
                "--account=lab.a",
                script=f"date +%s.%N > {stamp}.tmp && mv {stamp}.tmp {stamp}\nsleep 30\n",
            )
            wid = f"slurm-{slurm.name}-{job}"
            running = None
            deadline = time.time() + 60
            while running is None or not stamp.exists() or wid not in placed_at:
                if running is None:
                    state = subprocess.run(
                        ["squeue", "-h", "-j", str(job), "-o", "%T"],
                        env=env,
                        capture_output=True,
                        text=True,
                    ).stdout.strip()
                    if state == "RUNNING":
                        running = time.time()
                if time.time() > deadline:
                    raise RuntimeError(f"job {job} did not start")
                await asyncio.sleep(0.02)
            script = float(stamp.read_text().split()[0])
            placed = placed_at[wid]
            out.append((placed - submitted, running - placed, script - placed))
            slurm.run("scancel", str(job))
    finally:
        stop.set()
        for t in (bridge_task, sched, watcher):
            await asyncio.gather(t, return_exceptions=True)
        await follower.close()
        await nc.close()
    return out


def main(quick: bool = False) -> None:
    from apportion.services import logs
    from apportion.services.stack import start_nats_server
    from slurm_cluster import SlurmCluster, skip_reason

    reason = skip_reason()
    if reason:
        print(f"slurm bridge latency: skipped ({reason})")
        return
    logs.configure("warning")
    n = 5 if quick else 20
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        slurm = SlurmCluster(tmp / "slurm", nodes=3, gpus=4)
        server = None
        try:
            slurm.start()
            url = os.environ.get("NATS_URL")
            if not url:
                server = start_nats_server(tmp / "nats")
                url = server.url
            rows = asyncio.run(_samples(url, slurm, n, 0.5))
        finally:
            slurm.stop()
            if server is not None:
                server.stop()
    for i, name in enumerate(("sbatch -> placed", "placed -> RUNNING", "placed -> script")):
        xs = [r[i] * 1000 for r in rows]
        print(
            f"slurm bridge {name}: p50 {statistics.median(xs):,.0f} ms, p90 {_pct(xs, 90):,.0f} ms, "
            f"max {max(xs):,.0f} ms ({len(xs)} jobs, --interval 0.5 s, Slurm 22.05, backfill, batch_sched_delay=0)"
        )


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
