"""One contract suite for the event log, run on the in-memory log and on JetStream."""

from __future__ import annotations

import pytest
from apportion.schemas.events import ClockTicked, DecisionBatch
from apportion.services.bus import Fenced, JetStreamLog, MemoryLog
from services_helpers import submit


@pytest.fixture(params=["memory", "jetstream"])
async def log(request: pytest.FixtureRequest, cluster: str, nats_server):
    if request.param == "memory":
        yield MemoryLog(cluster)
        return
    import nats

    nc = await nats.connect(nats_server.url)
    log = JetStreamLog(nc.jetstream(), cluster)
    await log.setup()
    yield log
    await nc.drain()


async def test_duplicate_publish_is_stored_once(log) -> None:
    first = await log.publish_input(submit("w1"))
    again = await log.publish_input(submit("w1"))
    assert not first.duplicate
    assert again.duplicate and again.seq == first.seq
    assert await log.last_input_seq() == 1


async def test_inputs_read_in_order_with_ingestion_time(log) -> None:
    events = [ClockTicked(id=f"t{i}", at_ms=5) for i in range(50)]
    await log.publish_inputs(events)
    tail = log.tail_inputs(11)
    got = []
    while len(got) < 40:
        got += await tail.take(100, 10.0)
    await tail.close()
    assert [g.seq for g in got] == list(range(11, 51))
    assert [g.event.id for g in got] == [f"t{i}" for i in range(10, 50)]
    assert all(g.event.at_ms == g.at_ms and g.at_ms > 1_000_000_000_000 for g in got)
    assert tail.caught_up


async def test_malformed_bytes_are_read_not_raised(log) -> None:
    await log.publish_raw_input(b"\xff not json", "bad-1")
    await log.publish_raw_input(b'{"kind": "Nope", "id": "x", "at_ms": 1}')
    tail = log.tail_inputs(1)
    got = []
    while len(got) < 2:
        got += await tail.take(10, 10.0)
    await tail.close()
    assert [g.event for g in got] == [None, None]
    assert [g.ref for g in got] == ["bad-1", "seq:2"]
    assert all(g.rejection for g in got)


async def test_batches_are_fenced(log) -> None:
    b1 = DecisionBatch(basis=1, decisions=())
    assert await log.publish_batch(b1, 0) == 1
    with pytest.raises(Fenced):
        await log.publish_batch(DecisionBatch(basis=2, decisions=()), 0)
    assert await log.publish_batch(DecisionBatch(basis=2, decisions=()), 1) == 2
    tail = log.tail_batches(1)
    got = []
    while len(got) < 2:
        got += await tail.take(10, 10.0)
    await tail.close()
    assert [g.batch.basis for g in got] == [1, 2]
