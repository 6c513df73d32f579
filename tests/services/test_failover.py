"""Crash failover: a scheduler process killed with SIGKILL, a standby takes over.

The leader runs as ``apportion serve scheduler`` in its own process against the
fixture nats-server; the standby runs in the test. The leader never releases its
lease (SIGKILL), so the standby can only lead once the lease's TTL expired. The
DECISIONS stream must hold no conflicting batches: bases strictly increasing,
every workload placed exactly once, and ``apportion audit`` reproduces every
batch from the canonical history.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

from apportion.schemas.events import WorkloadPlaced
from apportion.schemas.history import BatchItem
from apportion.services.bus import JetStreamLog
from apportion.services.scheduler import Scheduler
from services_helpers import (
    APPORTION_CMD,
    audit_live,
    eventually,
    kill_and_reap,
    small_cluster,
    submit,
)
from test_services import full_fold, read_all, running


class PlacedWatcher:
    """Follows DECISIONS and collects every ``WorkloadPlaced`` (with repeats)."""

    def __init__(self, log: JetStreamLog) -> None:
        self.tail = log.tail_batches(1)
        self.batches: list[BatchItem] = []
        self.placed: list[str] = []

    async def poll(self) -> set[str]:
        for sb in await self.tail.take(10_000, 0.05):
            self.batches.append(sb)
            self.placed += [d.workload for d in sb.batch.decisions if isinstance(d, WorkloadPlaced)]
        return set(self.placed)


async def test_sigkilled_scheduler_process_is_replaced_by_the_standby(
    nats_server,
    jlog: JetStreamLog,
    cluster: str,
    tmp_path: Path,
    oplog: JetStreamLog,
) -> None:
    await oplog.publish_inputs(small_cluster(nodes=4))  # 32 GPUs: every 1-GPU submission fits
    env = {**os.environ, "NATS_URL": nats_server.url_as("scheduler")}
    err_path = tmp_path / "leader.err"
    with open(err_path, "w") as err:
        leader = subprocess.Popen(
            [*APPORTION_CMD, "serve", "scheduler", "--cluster-name", cluster]
            + ["--log-level", "warning"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    watcher = PlacedWatcher(jlog)
    try:
        await oplog.publish_input(submit("w0", gpus=1))

        async def placed(*names: str) -> bool:
            assert leader.poll() in (None, -signal.SIGKILL), err_path.read_text()
            return set(names) <= await watcher.poll()

        await eventually(lambda: placed("w0"), timeout=60, what="the leader process placed w0")
        kv = await jlog.js.key_value(jlog.subjects.lease_bucket)
        leader_holder = (await kv.get("scheduler")).value
        standby = Scheduler(jlog, await jlog.snapshots(), await jlog.lease("standby"), name="b")
        async with running(standby):
            # Inputs keep arriving before, during and after the crash.
            names = [f"w{i}" for i in range(1, 25)]
            killed = asyncio.Event()

            async def publisher() -> None:
                for i, name in enumerate(names):
                    if i == 12:
                        await killed.wait()
                    await oplog.publish_input(submit(name, gpus=1))
                    await asyncio.sleep(0.02)  # pacing only: spread inputs over the crash

            pub = asyncio.create_task(publisher())
            await eventually(lambda: placed("w0", "w5"), timeout=60, what="leader placed w5")
            assert not standby.leading.is_set()  # the lease is held by the process
            leader.send_signal(signal.SIGKILL)  # no clean stop: the lease is never released
            assert leader.wait(30) == -signal.SIGKILL
            killed.set()
            await pub
            await eventually(
                lambda: standby.leading.is_set(), timeout=60, what="standby takes over"
            )
            await eventually(lambda: placed("w0", *names), timeout=60, what="all placed")
            assert (await kv.get("scheduler")).value == b"standby" != leader_holder
            assert standby.state is not None and set(standby.state.running) == {"w0", *names}
    finally:
        kill_and_reap(leader)
        await watcher.tail.close()

    inputs, batches = await read_all(jlog)
    bases = [sb.batch.basis for sb in batches]
    assert all(a < b for a, b in zip(bases, bases[1:], strict=False)), bases
    placed_all = [
        d.workload for sb in batches for d in sb.batch.decisions if isinstance(d, WorkloadPlaced)
    ]
    assert sorted(placed_all) == sorted({"w0", *names})  # each exactly once
    full_fold(inputs, batches)  # no CorruptHistory: no conflicting decision
    out = audit_live(nats_server.url_as("auditor"), cluster)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all reproduced" in out.stdout, out.stdout
    print(out.stdout)
