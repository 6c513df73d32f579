"""Batches that always fit: a cycle over the message limit is published in parts,
every reader folds the parts, and the audit reproduces them; a leader stopped
between two parts is completed by the next; a refused batch is never retried."""

from __future__ import annotations

import asyncio
from pathlib import Path

import duckdb
import msgspec
import pytest
from apportion.core.history import decide_batch, fold_history, split_batch
from apportion.replay.projection import Projection
from apportion.schemas.codec import encode
from apportion.schemas.events import InputRejected, WorkloadPlaced
from apportion.services.bus import BATCH_BYTES_CAP, BatchTooLarge, JetStreamLog
from apportion.services.canonical import Follower, read_history
from apportion.services.projector import Projector
from apportion.services.runner import is_transient, supervise_scheduler
from apportion.services.scheduler import Scheduler
from services_helpers import audit_live, eventually, small_cluster
from services_helpers import submit as _submit_as_nobody
from test_services import read_all, running


def submit(workload: str, **kw):
    """A submission by ``ops``, who owns the root of the test budget tree."""
    return msgspec.structs.replace(_submit_as_nobody(workload, **kw), submitted_by="ops")


REJECTED = 2000
PLACED = 500


def big_cycle_inputs() -> list:
    """64 nodes x 8 GPUs, 500 one-GPU submissions that fit and 2,000 to an unknown
    owner with ids of about 480 characters: one cycle decides them all, over 1 MB."""
    events = small_cluster(nodes=64)
    events += [submit(f"ok{i}", gpus=1) for i in range(PLACED)]
    long = "x" * 470
    events += [
        msgspec.structs.replace(submit(f"bad{i}", owner="nope", gpus=1), id=f"bad{i}-{long}")
        for i in range(REJECTED)
    ]
    return events


async def test_an_oversized_cycle_is_split_and_every_reader_folds_it(
    nats_server,
    jlog: JetStreamLog,
    cluster: str,
    tmp_path: Path,
    oplog: JetStreamLog,
    projlog: JetStreamLog,
) -> None:
    assert jlog.max_batch_bytes <= BATCH_BYTES_CAP
    await oplog.publish_inputs(big_cycle_inputs())  # all in INPUTS before any scheduler runs
    last = await jlog.last_input_seq()
    projection = Projection(duckdb.connect(str(tmp_path / "p.duckdb")))
    scheduler, projector, follower = Scheduler(jlog), Projector(projlog, projection), Follower(jlog)
    async with running(scheduler, projector):
        await eventually(lambda: scheduler.last_basis >= last, what="the big cycle published")
        await eventually(lambda: projector.position[0] >= last, what="projector caught up")
        while follower.state.input_seq < last or follower.reader.batches_done < scheduler.batch_seq:
            await follower.poll(1.0)
    inputs, batches = await read_all(jlog)
    big = [b for b in batches if b.batch.basis == last]
    assert len(big) >= 3, "the cycle fits no single message: it comes in parts"
    assert all(len(encode(b.batch)) <= jlog.max_batch_bytes for b in batches)
    assert [b.batch.continued for b in big] == [True] * (len(big) - 1) + [False]
    decisions = [d for b in big for d in b.batch.decisions]
    assert sum(isinstance(d, InputRejected) for d in decisions) == REJECTED
    assert sum(isinstance(d, WorkloadPlaced) for d in decisions) == PLACED
    # every reader holds the state of the whole history
    history = await read_history(jlog, 10.0)
    digest = fold_history(history).digest()
    assert follower.state.digest() == digest
    assert projector.state.digest() == digest
    counts = projection.con.execute(
        "SELECT status, count(*) FROM workloads GROUP BY status ORDER BY status"
    ).fetchall()
    assert counts == [("rejected", REJECTED), ("running", PLACED)]
    again = Scheduler(jlog)
    await again.recover()
    assert again.state is not None and again.state.digest() == digest
    await again._forget()
    await follower.close()
    # and the audit recomputes the cycle and compares every part, bit for bit
    out = await asyncio.to_thread(audit_live, nats_server.url_as("auditor"), cluster)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(batches):,} decision batches, all reproduced" in out.stdout


async def test_a_cycle_left_in_parts_is_completed_by_the_next_leader(
    nats_server,
    jlog: JetStreamLog,
    cluster: str,
    oplog: JetStreamLog,
) -> None:
    await oplog.publish_inputs(big_cycle_inputs())
    # a leader decided the cycle, published two of its parts and died
    history = await read_history(jlog, 10.0)
    state = fold_history(history)
    batch, _ = decide_batch(state)
    parts = split_batch(batch, state.decisions_folded, 64 * 1024)
    assert len(parts) > 4
    for i, part in enumerate(parts[:2]):
        await jlog.publish_batch(part, i)
    scheduler = Scheduler(jlog)
    async with running(scheduler):
        await eventually(
            lambda: scheduler.leading.is_set() and scheduler.last_basis == batch.basis,
            what="the cycle completed",
        )
    _inputs, batches = await read_all(jlog)
    assert [b.batch.basis for b in batches] == [batch.basis] * len(batches)
    assert tuple(d for b in batches for d in b.batch.decisions) == batch.decisions
    assert not batches[-1].batch.continued
    placed = [
        d.workload for b in batches for d in b.batch.decisions if isinstance(d, WorkloadPlaced)
    ]
    assert len(placed) == len(set(placed)) == PLACED
    out = await asyncio.to_thread(audit_live, nats_server.url_as("auditor"), cluster)
    assert out.returncode == 0, out.stdout + out.stderr


async def test_a_batch_the_server_refuses_is_not_retried(
    jlog: JetStreamLog, oplog: JetStreamLog
) -> None:
    import nats.errors

    assert not is_transient(nats.errors.MaxPayloadError())
    assert is_transient(nats.errors.TimeoutError())
    await oplog.publish_inputs(big_cycle_inputs())
    jlog.max_batch_bytes = 64 * 1024 * 1024  # as if the scheduler did not split: one huge batch
    scheduler = Scheduler(jlog)
    stop = asyncio.Event()
    with pytest.raises(BatchTooLarge):
        await asyncio.wait_for(supervise_scheduler(scheduler, stop), 60)
    assert await jlog.last_batch_seq() == 0
    assert scheduler.cycles == 0
