"""Scheduler take-over against state size (``make bench``; ``--quick`` for small sizes).

For each size N: a cluster of one 8-GPU h100 node (busy) and one a100 node
(free) with N pending 8-GPU h100 workloads. A leader runs as ``apportion serve
scheduler`` in its own process; a standby (in this process) follows the log.
Once both are caught up the leader is killed with SIGKILL and a probe (a
1-GPU a100 workload) is submitted. Figures:

- **kill -> leading**: until the standby leads (includes waiting for the dead
  leader's lease to expire: up to its TTL, 3 s);
- **catch-up**: from the standby winning the lease to leading (what state size
  could make long);
- **kill -> placed**: until the probe's ``WorkloadPlaced`` is folded;
- **cold start**: a scheduler with no state of its own, from the snapshot the
  new leader saved when it stopped;
- **full fold**: the same without a snapshot.

Uses ``NATS_URL`` if set, else starts the ``nats-server`` from the venv.
Aim (issue 11): take-over under 5 s at 50,000 pending.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOUR_MS = 3_600_000


def cluster_events() -> list:
    from apportion.schemas.events import BudgetSet, NodeRegistered

    return [
        NodeRegistered(id="node-h", at_ms=0, node="h000", gpus=8, gpu_type="h100"),
        NodeRegistered(id="node-a", at_ms=0, node="a000", gpus=8, gpu_type="a100"),
        BudgetSet(id="b-root", at_ms=0, path="", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b-t", at_ms=0, path="team", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b-u", at_ms=0, path="team/u", weight=1, owner="u", actor="ops"),
    ]


def pending_submissions(n: int) -> list:
    from apportion.schemas.events import WorkloadSubmitted

    return [
        WorkloadSubmitted(
            id=f"s{i}",
            at_ms=0,
            workload=f"w{i}",
            owner="team/u",
            gpus=8,
            gpu_type="h100",
            min_runtime_ms=HOUR_MS,
            submitted_by="u",
        )
        for i in range(n + 1)  # the first runs, n stay pending
    ]


class TimedLease:
    """A lease that notes when it was won."""

    def __init__(self, lease) -> None:
        self.lease = lease
        self.ttl_s = lease.ttl_s
        self.won_at: float | None = None

    async def acquire(self) -> bool:
        got = await self.lease.acquire()
        if got and self.won_at is None:
            self.won_at = time.perf_counter()
        return got

    async def renew(self) -> bool:
        return await self.lease.renew()

    async def release(self) -> None:
        await self.lease.release()


async def _takeover(url: str, n: int) -> dict[str, float]:
    from apportion.schemas.events import WorkloadSubmitted
    from apportion.services.bus import JetStreamLog, MemorySnapshots, connect
    from apportion.services.scheduler import SNAPSHOT_NAME, Scheduler

    cluster = f"takeover{uuid.uuid4().hex[:6]}"
    nc = await connect(url)
    log = JetStreamLog(nc.jetstream(), cluster, max_async_pending=20_000)
    await log.setup()
    await log.publish_inputs(cluster_events())
    events = pending_submissions(n)
    for j in range(0, len(events), 5000):
        await log.publish_inputs(events[j : j + 5000])
    last = await log.last_input_seq()
    leader = subprocess.Popen(
        [sys.executable, "-m", "apportion", "serve", "scheduler", "--cluster-name", cluster]
        + ["--log-level", "error"],
        env={**os.environ, "NATS_URL": url},
        stdout=subprocess.DEVNULL,
    )
    while await log.last_batch_seq() == 0:  # the leader holds the lease and decides
        assert leader.poll() is None, "the leader exited"
        await asyncio.sleep(0.05)
    snapshots = await log.snapshots()
    lease = TimedLease(await log.lease("standby"))
    standby = Scheduler(log, snapshots, lease, name="standby")
    stop = asyncio.Event()
    task = asyncio.create_task(standby.run(stop))
    out: dict[str, float] = {}
    try:
        while standby.last_basis < last:  # the leader decided everything, the standby followed
            await asyncio.sleep(0.05)
        assert not standby.leading.is_set() and leader.poll() is None
        state = standby.state
        assert state is not None and len(state.pending) == n, len(state.pending)
        t_kill = time.perf_counter()
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        await log.publish_input(
            WorkloadSubmitted(
                id="probe",
                at_ms=0,
                workload="probe",
                owner="team/u",
                gpus=1,
                gpu_type="a100",
                min_runtime_ms=0,
                submitted_by="u",
            )
        )
        while not standby.leading.is_set():
            await asyncio.sleep(0.005)
        out["leading"] = time.perf_counter() - t_kill
        assert lease.won_at is not None
        out["catch_up"] = time.perf_counter() - lease.won_at
        while standby.state is None or "probe" not in standby.state.running:
            await asyncio.sleep(0.005)
        out["placed"] = time.perf_counter() - t_kill
        out["leases_lost"] = standby.leases_lost
    finally:
        stop.set()
        await task
        if leader.poll() is None:
            leader.kill()
            leader.wait()
    # the new leader saved a snapshot when it stopped
    out["snapshot_mb"] = len(await snapshots.load(SNAPSHOT_NAME) or b"") / 1e6
    for key, store in (("cold", snapshots), ("full", MemorySnapshots())):
        cold = Scheduler(log, store, name=key)
        t0 = time.perf_counter()
        await cold.recover()
        out[key] = time.perf_counter() - t0
        await cold._forget()
    await nc.close()
    return out


def main(quick: bool = False) -> None:
    from apportion.services import logs
    from apportion.services.stack import start_nats_server

    logs.configure("error")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop our nats-server
    sizes = (2_000, 10_000) if quick else (10_000, 50_000, 200_000)
    with tempfile.TemporaryDirectory() as tmpdir:
        server = None
        url = os.environ.get("NATS_URL")
        if not url:
            server = start_nats_server(Path(tmpdir) / "nats")
            url = server.url
        try:
            for n in sizes:
                r = asyncio.run(_takeover(url, n))
                print(
                    f"takeover at {n:,} pending: kill -> leading {r['leading']:.2f} s "
                    f"(catch-up after winning the lease {r['catch_up']:.2f} s), "
                    f"kill -> probe placed {r['placed']:.2f} s, leases lost {r['leases_lost']:.0f}; "
                    f"cold start {r['cold']:.2f} s (snapshot {r['snapshot_mb']:.1f} MB + tail), "
                    f"full fold {r['full']:.2f} s",
                    flush=True,
                )
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
