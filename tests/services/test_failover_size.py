"""Failover that scales: a standby follows a leader (``apportion serve scheduler``)
holding a large state; the leader is killed with SIGKILL; the standby takes the
lease once it expired, keeps it (no lease lost, no restart from the snapshot in
a loop), places new work, and holds the state of the whole history. A scheduler
started cold then recovers the same state from the snapshot.

The short version runs in ``make test``; the 200,000-pending one is ``slow``.
Speed is measured by ``benchmarks/bench_takeover.py``, not asserted here.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
from apportion.core.history import fold_history
from apportion.schemas.events import BudgetSet, NodeRegistered, WorkloadSubmitted
from apportion.services.bus import JetStreamLog
from apportion.services.canonical import read_history
from apportion.services.scheduler import Scheduler
from services_helpers import APPORTION_CMD, audit_live, eventually, kill_and_reap

HOUR_MS = 3_600_000


def cluster() -> list:
    """One busy 8-GPU h100 node, one free a100 node; ``ops`` owns the root."""
    return [
        NodeRegistered(id="node-h", at_ms=0, node="h000", gpus=8, gpu_type="h100", actor="ops"),
        NodeRegistered(id="node-a", at_ms=0, node="a000", gpus=8, gpu_type="a100", actor="ops"),
        BudgetSet(id="b-root", at_ms=0, path="", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b-t", at_ms=0, path="team", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b-u", at_ms=0, path="team/u", weight=1, owner="u", actor="ops"),
    ]


def job(workload: str, gpus: int = 8, gpu_type: str = "h100", min_runtime_ms: int = HOUR_MS):
    return WorkloadSubmitted(
        id=f"submit-{workload}",
        at_ms=0,
        workload=workload,
        owner="team/u",
        gpus=gpus,
        gpu_type=gpu_type,
        min_runtime_ms=min_runtime_ms,
        submitted_by="u",
    )


async def failover_at(
    pending: int, url: str, jlog: JetStreamLog, oplog: JetStreamLog, name: str, tmp_path: Path
) -> None:
    """``url``: the scheduler's, for the leader (a process of its own)."""
    await oplog.publish_inputs(cluster())
    jobs = [job(f"w{i}") for i in range(pending + 1)]  # the first runs, the rest wait
    for i in range(0, len(jobs), 5000):
        await oplog.publish_inputs(jobs[i : i + 5000])
    last = await jlog.last_input_seq()
    with open(tmp_path / "leader.err", "w") as err:
        leader = subprocess.Popen(
            [*APPORTION_CMD, "serve", "scheduler", "--cluster-name", name]
            + ["--log-level", "warning"],
            env={**os.environ, "NATS_URL": url},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    snapshots = await jlog.snapshots()
    stop = asyncio.Event()
    task = None
    try:
        await eventually(
            lambda: jlog.last_batch_seq(), timeout=120, what="the leader's first batch"
        )
        standby = Scheduler(jlog, snapshots, await jlog.lease("standby"), name="standby")
        task = asyncio.create_task(standby.run(stop))
        await eventually(
            lambda: standby.last_basis >= last, timeout=300, what="standby followed the leader"
        )
        assert not standby.leading.is_set() and leader.poll() is None
        assert standby.state is not None and len(standby.state.pending) == pending

        kill_and_reap(leader)
        await oplog.publish_input(job("probe", gpus=1, gpu_type="a100", min_runtime_ms=0))
        await eventually(
            lambda: standby.state is not None and "probe" in standby.state.running,
            timeout=120,
            what="the standby took over and placed the probe",
        )
        # it keeps leading: a second probe is placed by the same leader, nothing was lost
        ack = await oplog.publish_input(job("probe2", gpus=1, gpu_type="a100", min_runtime_ms=0))
        await eventually(lambda: standby.last_basis >= ack.seq, what="probe2 decided")
        assert standby.state is not None and "probe2" in standby.state.running
        assert standby.leading.is_set()
        assert (standby.leases_lost, standby.fenced, standby.snapshots_rejected) == (0, 0, 0)
        digest = standby.state.digest()
    finally:
        stop.set()
        if task is not None:
            await task
        kill_and_reap(leader)
    history = await read_history(jlog, 60.0)
    assert fold_history(history).digest() == digest

    cold = Scheduler(jlog, snapshots, name="cold")
    await cold.recover()
    assert cold.recovered_from == "snapshot" and cold.state is not None
    assert cold.state.digest() == digest
    await cold._forget()


async def test_a_standby_takes_over_a_large_state(
    nats_server, jlog: JetStreamLog, oplog: JetStreamLog, cluster: str, tmp_path: Path
) -> None:
    await failover_at(10_000, nats_server.url_as("scheduler"), jlog, oplog, cluster, tmp_path)
    out = await asyncio.to_thread(audit_live, nats_server.url_as("auditor"), cluster)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
async def test_a_standby_takes_over_200k_pending(
    nats_server, jlog: JetStreamLog, oplog: JetStreamLog, cluster: str, tmp_path: Path
) -> None:
    await failover_at(200_000, nats_server.url_as("scheduler"), jlog, oplog, cluster, tmp_path)
