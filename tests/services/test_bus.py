"""One contract suite for the event log, run on the in-memory log and on JetStream."""

from __future__ import annotations

import pytest
from apportion.schemas.events import ClockTicked, DecisionBatch
from apportion.services.bus import Fenced, MemoryLog
from services_helpers import submit


class Logs:
    """The log as the scheduler sees it (``sched``: decisions, ticks) and as the
    operator does (``op``: submissions, and bytes on its own subjects); on the
    in-memory log both are the same."""

    def __init__(self, sched, op) -> None:
        self.sched, self.op = sched, op


@pytest.fixture(params=["memory", "jetstream"])
async def log(request: pytest.FixtureRequest, cluster: str, jlog, oplog) -> Logs:
    if request.param == "memory":
        memory = MemoryLog(cluster)
        return Logs(memory, memory)
    return Logs(jlog, oplog)


async def test_duplicate_publish_is_stored_once(log: Logs) -> None:
    first = await log.op.publish_input(submit("w1"))
    again = await log.op.publish_input(submit("w1"))
    assert not first.duplicate
    assert again.duplicate and again.seq == first.seq
    assert await log.op.last_input_seq() == 1


async def test_inputs_read_in_order_with_ingestion_time(log: Logs) -> None:
    events = [ClockTicked(id=f"t{i}", at_ms=5) for i in range(50)]
    await log.sched.publish_inputs(events)
    tail = log.op.tail_inputs(11)
    got = []
    while len(got) < 40:
        got += await tail.take(100, 10.0)
    await tail.close()
    assert [g.seq for g in got] == list(range(11, 51))
    assert [g.event.id for g in got] == [f"t{i}" for i in range(10, 50)]
    assert all(g.event.at_ms == g.at_ms and g.at_ms > 1_000_000_000_000 for g in got)
    # the publisher stamped the time it sent each (not the 5 given): core/rules/identity.py
    assert all(abs(g.sent_ms - g.at_ms) < 60_000 for g in got)
    assert tail.caught_up


async def test_malformed_bytes_are_read_not_raised(log: Logs) -> None:
    # bytes on a subject the operator may publish (no credential publishes on "raw")
    await log.op.publish_raw_input(b"\xff not json", "bad-1", kind="WorkloadSubmitted")
    await log.op.publish_raw_input(
        b'{"kind": "Nope", "id": "x", "at_ms": 1}', kind="WorkloadSubmitted"
    )
    tail = log.op.tail_inputs(1)
    got = []
    while len(got) < 2:
        got += await tail.take(10, 10.0)
    await tail.close()
    assert [g.event for g in got] == [None, None]
    assert [g.ref for g in got] == ["bad-1", "seq:2"]
    assert all(g.rejection for g in got)


async def test_batches_are_fenced(log: Logs) -> None:
    sched = log.sched
    b1 = DecisionBatch(basis=1, decisions=())
    assert await sched.publish_batch(b1, 0) == 1
    with pytest.raises(Fenced):
        await sched.publish_batch(DecisionBatch(basis=2, decisions=()), 0)
    assert await sched.publish_batch(DecisionBatch(basis=2, decisions=()), 1) == 2
    tail = log.op.tail_batches(1)
    got = []
    while len(got) < 2:
        got += await tail.take(10, 10.0)
    await tail.close()
    assert [g.batch.basis for g in got] == [1, 2]
