"""Snapshots verified: a truncated, undecodable or tampered snapshot, or one ahead of
the streams (which lost their tail), is logged and
replaced by a full fold of the streams, which reaches the same state as a clean
recovery; the scheduler keeps deciding and writes a good snapshot again."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from apportion.core.history import decide_batch, fold_history, fold_item
from apportion.core.state import State
from apportion.schemas.history import BatchItem, input_item
from apportion.services.bus import JetStreamLog
from apportion.services.canonical import read_history
from apportion.services.scheduler import (
    SNAPSHOT_NAME,
    Scheduler,
    SchedulerSnapshot,
    SnapshotInvalid,
    load_snapshot,
)
from services_helpers import eventually, small_cluster
from services_helpers import submit as _submit_as_nobody
from test_services import running


def submit(workload: str, **kw):
    """A submission by ``ops``, who owns the root of the test budget tree."""
    return msgspec.structs.replace(_submit_as_nobody(workload, **kw), submitted_by="ops")


async def _history_with_a_snapshot(jlog: JetStreamLog, oplog: JetStreamLog, snapshots) -> bytes:
    """30 submissions decided by a scheduler that saved a snapshot, then a tail of 5 more."""
    await oplog.publish_inputs(small_cluster(nodes=4))
    first = Scheduler(jlog, snapshots, snapshot_every=5)
    async with running(first):
        for i in range(30):
            await oplog.publish_input(submit(f"w{i}", owner=("llm/a", "vision")[i % 2], gpus=2))
        last = await jlog.last_input_seq()
        await eventually(lambda: first.last_basis >= last, what="first scheduler caught up")
    await oplog.publish_inputs([submit(f"x{i}", owner="llm/b", gpus=1) for i in range(5)])
    raw = await snapshots.load(SNAPSHOT_NAME)
    assert raw is not None
    return raw


def _tampered(raw: bytes) -> bytes:
    """The same snapshot with one workload's priority changed and the old digest kept."""
    snap = msgspec.msgpack.decode(raw, type=SchedulerSnapshot)
    state = State.from_bytes(snap.state)
    victim = sorted(state.workloads)[0]
    state.workloads[victim].priority += 7
    snap.state = state.to_bytes()
    return msgspec.msgpack.encode(snap)


async def _recovered(jlog: JetStreamLog, snapshots) -> Scheduler:
    s = Scheduler(jlog, snapshots)
    await s.recover()
    return s


def _ahead(raw: bytes, history: list) -> bytes:
    """A valid snapshot (digest and batch boundary right) of a state past the streams'
    end: three inputs and a cycle the log does not hold (lost in an OS crash)."""
    snap = msgspec.msgpack.decode(raw, type=SchedulerSnapshot)
    state = fold_history(history)
    n = state.input_seq
    for i in range(3):
        fold_item(state, input_item(n + i + 1, submit(f"lost{i}", owner="llm/a", gpus=1)))
    batch, _ = decide_batch(state)
    fold_item(state, BatchItem(seq=snap.batch_seq + 99, batch=batch))
    data = state.to_bytes()
    ahead = SchedulerSnapshot(
        input_seq=state.input_seq,
        batch_seq=snap.batch_seq + 99,
        last_basis=state.input_seq,
        digest=hashlib.sha256(data).hexdigest(),
        state=data,
    )
    return msgspec.msgpack.encode(ahead)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "tampered", "ahead"])
async def test_a_bad_snapshot_means_a_full_fold_to_the_same_state(
    jlog: JetStreamLog,
    damage: str,
    oplog: JetStreamLog,
) -> None:
    snapshots = await jlog.snapshots()
    raw = await _history_with_a_snapshot(jlog, oplog, snapshots)
    clean = await _recovered(jlog, snapshots)
    assert clean.recovered_from == "snapshot" and clean.snapshots_rejected == 0
    assert clean.state is not None
    digest = clean.state.digest()
    assert digest == fold_history(await read_history(jlog, 10.0)).digest()
    await clean._forget()

    if damage == "ahead":
        damaged = _ahead(raw, await read_history(jlog, 10.0))
        load_snapshot(damaged)  # valid in itself: only the streams show it is ahead
    else:
        damaged = {
            "truncated": raw[: len(raw) // 2],
            "garbage": b"\x93not a snapshot",
            "tampered": _tampered(raw),
        }[damage]
        with pytest.raises(SnapshotInvalid):
            load_snapshot(damaged)
    await snapshots.save(SNAPSHOT_NAME, damaged)
    again = await _recovered(jlog, snapshots)
    assert again.recovered_from == "log" and again.snapshots_rejected == 1
    assert again.state is not None and again.state.digest() == digest
    await again._forget()

    # a scheduler started on the damaged snapshot leads, schedules, and saves a good one
    live = Scheduler(jlog, snapshots)
    async with running(live):
        ack = await oplog.publish_input(submit("after", owner="llm/a", gpus=1))
        await eventually(lambda: live.last_basis >= ack.seq, what="a cycle after the new input")
    assert live.snapshots_rejected == 1
    snap, state = load_snapshot(await snapshots.load(SNAPSHOT_NAME) or b"")
    assert state.status_of("after") == "pending" and snap.input_seq == ack.seq
    assert state.digest() == fold_history(await read_history(jlog, 10.0)).digest()
