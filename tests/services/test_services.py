"""The services on a real nats-server: end to end, projector, snapshots, fencing, bad input, gateway."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import aiohttp
import duckdb
import pytest
from apportion.core import cycle
from apportion.core.history import fold_history, fold_item
from apportion.core.state import State
from apportion.replay.projection import Projection
from apportion.schemas.events import InputRejected, WorkloadPlaced
from apportion.schemas.history import BatchItem, HistoryItem, InputItem
from apportion.services.bus import Fenced, JetStreamLog, MemoryLease
from apportion.services.canonical import read_history
from apportion.services.executor import Executor
from apportion.services.gateway import Gateway
from apportion.services.projector import Projector
from apportion.services.scheduler import Scheduler, load_snapshot
from services_helpers import eventually, small_cluster, submit

if TYPE_CHECKING:
    from conftest import Credentials

TABLES = ("events", "workloads", "runs", "waits", "nodes", "health", "budget")


class Service(Protocol):
    async def run(self, stop: asyncio.Event) -> None: ...


@contextlib.asynccontextmanager
async def running(*services: Service | Gateway) -> AsyncIterator[asyncio.Event]:
    """Run each service's ``run(stop)`` (or ``serve``) until the block ends; re-raise their errors."""
    stop = asyncio.Event()
    tasks = []
    for s in services:
        if isinstance(s, Gateway):
            tasks.append(asyncio.create_task(s.serve(stop, port=0)))
        else:
            tasks.append(asyncio.create_task(s.run(stop)))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def read_all(log: JetStreamLog) -> tuple[list[InputItem], list[BatchItem]]:
    """Every input and batch in the log, as stored."""
    history = await read_history(log, 10.0)
    inputs = [i for i in history if isinstance(i, InputItem)]
    return inputs, [b for b in history if isinstance(b, BatchItem)]


def full_fold(inputs: list[InputItem], batches: list[BatchItem]) -> State:
    """The state after folding the inputs and batches in canonical order."""
    merged: list[HistoryItem] = []
    it = iter(batches)
    pending = next(it, None)
    for item in [None, *inputs]:
        if item is not None:
            merged.append(item)
        seq = 0 if item is None else item.seq
        while pending is not None and pending.batch.basis == seq:
            merged.append(pending)
            pending = next(it, None)
    assert pending is None, "a batch based on an input that is not in the log"
    return fold_history(merged)


async def test_submit_placed_finished_end_to_end(
    jlog: JetStreamLog,
    tmp_path: Path,
    creds: Credentials,
    oplog: JetStreamLog,
    gwlog: JetStreamLog,
    exelog: JetStreamLog,
) -> None:
    await oplog.publish_inputs(small_cluster())
    scheduler = Scheduler(jlog)
    executor = Executor(exelog)
    gateway = Gateway(gwlog, auth=creds.authenticator)
    async with running(scheduler, executor, gateway):
        await eventually(
            lambda: gateway.state.input_seq >= len(small_cluster()), what="gateway caught up"
        )
        await oplog.publish_input(submit("w1", gpus=4, duration_ms=300))
        await eventually(lambda: gateway.history.placed.get("w1") is not None, what="w1 placed")
        await eventually(lambda: gateway.state.status_of("w1") == "succeeded", what="w1 finished")
    placed = gateway.history.placed["w1"]
    assert placed.attempt == 1 and sum(s.gpus for s in placed.placement) == 4
    assert executor.finished == 1


async def test_projector_tables_equal_the_simulator_side_projection(
    jlog: JetStreamLog,
    tmp_path: Path,
    oplog: JetStreamLog,
    projlog: JetStreamLog,
    exelog: JetStreamLog,
) -> None:
    await oplog.publish_inputs(small_cluster(nodes=2))
    projection = Projection(duckdb.connect(str(tmp_path / "live.duckdb")))
    scheduler, executor, projector = (
        Scheduler(jlog),
        Executor(exelog),
        Projector(projlog, projection),
    )
    async with running(scheduler, executor, projector):
        await oplog.publish_inputs(
            [
                submit("a1", owner="llm/a", gpus=8, duration_ms=200),
                submit("b1", owner="llm/b", gpus=8, duration_ms=5000),
                submit("v1", owner="vision", gpus=8, duration_ms=100),
                submit("u1", owner="vision", gpus=4, min_runtime_ms=0, duration_ms=100),
                submit("bad", owner="nope", gpus=4),
            ]
        )
        await oplog.publish_raw_input(b"not an event", "junk-1", kind="WorkloadSubmitted")
        await eventually(
            lambda: scheduler.state is not None and len(scheduler.state.ended) >= 3,
            what="three finished",
        )
        await oplog.publish_input(submit("c1", owner="llm/a", gpus=2, duration_ms=100))
        last = await jlog.last_input_seq()
        await eventually(
            lambda: projector.position[0] >= last and scheduler.last_basis >= last,
            what="projector caught up",
        )
    history = await read_history(jlog, 10.0)
    # The simulator side: fold the same history, decide at the same bases, project.
    sim = Projection(duckdb.connect(":memory:"))
    state = State()
    for item in history:
        if isinstance(item, BatchItem):
            result = cycle.decide(state)
            assert result.decisions == item.batch.decisions, (
                f"batch {item.seq} is not what the core decides"
            )
        sim(item, state, fold_item(state, item))
    sim.commit(state)
    live = projection.con
    for table in TABLES:
        q = f"SELECT * FROM {table} ORDER BY ALL"
        assert live.execute(q).fetchall() == sim.con.execute(q).fetchall(), table
    assert live.execute("SELECT count(*) FROM workloads WHERE status = 'rejected'").fetchone() == (
        1,
    )
    # Restart: a new projector on the same file resumes with no duplicate and no gap.
    before = live.execute("SELECT count(*), max(pos) FROM events").fetchone()
    live.close()
    again = Projection(duckdb.connect(str(tmp_path / "live.duckdb")))
    await oplog.publish_input(submit("d1", owner="llm/a", gpus=1))
    scheduler2, projector2 = Scheduler(jlog), Projector(projlog, again)
    async with running(scheduler2, projector2):
        last = await jlog.last_input_seq()
        await eventually(lambda: projector2.position[0] >= last, what="projector resumed")
    count, max_pos = again.con.execute("SELECT count(*), max(pos) FROM events").fetchone()
    assert count == max_pos and count > before[0]
    assert again.con.execute("SELECT count(DISTINCT pos) FROM events").fetchone() == (count,)


async def test_restart_from_snapshot_reaches_the_full_fold_digest(
    jlog: JetStreamLog, oplog: JetStreamLog
) -> None:
    snapshots = await jlog.snapshots()
    await oplog.publish_inputs(small_cluster(nodes=4))
    first = Scheduler(jlog, snapshots, snapshot_every=4, max_inputs_per_cycle=3)
    async with running(first):
        for i in range(12):
            await oplog.publish_input(
                submit(f"w{i}", owner=("llm/a", "llm/b", "vision")[i % 3], gpus=4)
            )
        last = await jlog.last_input_seq()
        await eventually(lambda: first.last_basis >= last, what="first scheduler caught up")
    # More inputs arrive while no scheduler runs; the restarted one folds only the tail.
    await oplog.publish_inputs([submit(f"x{i}", owner="vision", gpus=2) for i in range(3)])
    raw = await snapshots.load("scheduler")
    snap, _ = load_snapshot(raw)
    assert snap.input_seq > 0
    second = Scheduler(jlog, snapshots)
    await second.recover()
    history = await read_history(jlog, 10.0)
    assert second.state.digest() == fold_history(history).digest()
    assert second.state.input_seq == await jlog.last_input_seq()
    await second._tail.close()


async def test_a_second_scheduler_is_fenced(jlog: JetStreamLog, oplog: JetStreamLog) -> None:
    a = Scheduler(jlog, lease=MemoryLease(), name="a")
    b = Scheduler(jlog, lease=MemoryLease(), name="b")
    await a.recover()
    await b.recover()
    events = small_cluster() + [submit("w1")]
    await oplog.publish_inputs(events)
    for s in (a, b):
        while s.state.input_seq < len(events):
            for item in await s._tail.take(100, 10.0):
                fold_item(s.state, item)
    batch = await a.cycle()
    assert batch is not None and any(isinstance(d, WorkloadPlaced) for d in batch.decisions)
    with pytest.raises(Fenced):
        await b.cycle()
    assert await jlog.last_batch_seq() == 1
    await b._tail.close()
    await b.recover()
    assert b.state.digest() == a.state.digest()
    for s in (a, b):
        await s._tail.close()


async def test_standby_takes_over_when_the_leader_stops(
    jlog: JetStreamLog, oplog: JetStreamLog
) -> None:
    lease_a = await jlog.lease("a", ttl_s=2.0)
    lease_b = await jlog.lease("b", ttl_s=2.0)
    a = Scheduler(jlog, lease=lease_a, name="a")
    b = Scheduler(jlog, lease=lease_b, name="b")
    await oplog.publish_inputs(small_cluster())
    stop_a = asyncio.Event()
    task_a = asyncio.create_task(a.run(stop_a))
    await eventually(lambda: a.leading.is_set(), what="a leads")
    async with running(b):
        await oplog.publish_input(submit("w1"))
        await eventually(
            lambda: a.state is not None and "w1" in a.state.running, what="a placed w1"
        )
        assert not b.leading.is_set()
        stop_a.set()
        await task_a
        await eventually(lambda: b.leading.is_set(), what="b takes over")
        await oplog.publish_input(submit("w2"))
        await eventually(
            lambda: b.state is not None and "w2" in b.state.running, what="b placed w2"
        )
    inputs, batches = await read_all(jlog)
    bases = [sb.batch.basis for sb in batches]
    assert bases == sorted(set(bases))
    placed = [
        d.workload for sb in batches for d in sb.batch.decisions if isinstance(d, WorkloadPlaced)
    ]
    assert placed == ["w1", "w2"]
    full_fold(inputs, batches)  # folds without CorruptHistory: no conflicting decision


async def test_bad_input_yields_input_rejected_and_changes_nothing(
    jlog: JetStreamLog, oplog: JetStreamLog
) -> None:
    await oplog.publish_inputs(small_cluster())
    scheduler = Scheduler(jlog)
    async with running(scheduler):
        last = await jlog.last_input_seq()
        await eventually(lambda: scheduler.last_basis >= last, what="caught up")
        before = scheduler.state.snapshot()
        await oplog.publish_raw_input(b"\x00\x01 garbage", "garbage-1", kind="WorkloadSubmitted")
        await oplog.publish_raw_input(
            b'{"kind": "WorkloadSubmitted", "id": "v9", "at_ms": 1, "v": 9}',
            "future-1",
            kind="WorkloadSubmitted",
        )
        await oplog.publish_input(submit("x", owner="no/such/team"))
        await oplog.publish_input(submit("y", min_runtime_ms=9 * 3_600_000))
        await oplog.publish_input(submit("z", gpus=12))
        last = await jlog.last_input_seq()
        await eventually(lambda: scheduler.last_basis >= last, what="bad inputs decided")
        after = scheduler.state.snapshot()
    _inputs, batches = await read_all(jlog)
    rejected = {
        d.ref: d.reason
        for sb in batches
        for d in sb.batch.decisions
        if isinstance(d, InputRejected)
    }
    assert set(rejected) == {"garbage-1", "future-1", "submit-x", "submit-y", "submit-z"}
    assert "malformed" in rejected["garbage-1"] and "unknown owner" in rejected["submit-x"]
    for field in ("budget", "nodes", "workloads", "pending", "running", "ended", "policy"):
        assert getattr(after, field) == getattr(before, field), field
    assert after.rejections == [] and after.input_seq == before.input_seq + 5


async def test_gateway_answers_4xx_with_a_json_reason(
    jlog: JetStreamLog,
    creds: Credentials,
    oplog: JetStreamLog,
    gwlog: JetStreamLog,
) -> None:
    await oplog.publish_inputs(small_cluster())
    scheduler, gateway = Scheduler(jlog), Gateway(gwlog, auth=creds.authenticator)
    async with running(scheduler, gateway), aiohttp.ClientSession() as http:
        await gateway.ready.wait()
        await eventually(
            lambda: gateway.state.input_seq >= len(small_cluster()), what="gateway caught up"
        )
        url = gateway.url

        async def call(method: str, path: str, as_: str = "a", **kw: object) -> tuple[int, dict]:
            async with http.request(method, url + path, headers=creds.headers(as_), **kw) as r:
                return r.status, await r.json()

        cases = [
            (
                "POST",
                "/v1/workloads",
                {"json": {"owner": "nope", "gpus": 1, "min_runtime_ms": 0}},
                400,
                "unknown owner",
            ),
            (
                "POST",
                "/v1/workloads",
                {"json": {"owner": "llm/a", "gpus": "x", "min_runtime_ms": 0}},
                400,
                "invalid request",
            ),
            ("POST", "/v1/workloads", {"data": b"{not json"}, 400, "not JSON"),
            (
                "POST",
                "/v1/workloads",
                {"json": {"owner": "llm", "gpus": 1, "min_runtime_ms": 0}},
                400,
                "not a leaf",
            ),
            (
                "POST",
                "/v1/workloads",
                {"json": {"owner": "llm/a", "gpus": 1, "min_runtime_ms": 10 * 3_600_000}},
                400,
                "min_runtime",
            ),
            ("POST", "/v1/workloads/ghost/cancel", {"json": {}}, 404, "unknown workload"),
            ("GET", "/v1/explain/ghost", {}, 404, "unknown workload"),
            (
                "POST",
                "/v1/budget",
                {
                    "as_": "mallory",
                    "json": {"set": [{"path": "llm/c", "weight": 1, "owner": "m"}]},
                },
                403,
                "does not own",
            ),
        ]
        for method, path, kw, status, reason in cases:
            got_status, body = await call(method, path, **kw)
            assert got_status == status, (path, body)
            assert reason in body["error"], (path, body)
        status, body = await call(
            "POST",
            "/v1/workloads",
            json={"id": "ok1", "owner": "llm/a", "gpus": 4, "min_runtime_ms": 60_000},
        )
        assert status == 202 and body["workload"] == "ok1"
        await eventually(lambda: "ok1" in gateway.state.running, what="ok1 running")
        status, body = await call(
            "POST",
            "/v1/workloads",
            json={"id": "ok1", "owner": "llm/a", "gpus": 4, "min_runtime_ms": 60_000},
        )
        assert status == 409 and "already exists" in body["error"]
        status, doc = await call("GET", "/openapi.json")
        assert status == 200 and doc["openapi"].startswith("3.") and "/v1/queue" in doc["paths"]
        status, q = await call("GET", "/v1/queue")
        assert status == 200 and [r["workload"] for r in q["running"]] == ["ok1"]
        status, tree = await call("GET", "/v1/budget")
        assert status == 200 and {c["path"] for c in tree["children"]} == {"llm", "vision"}
        status, ex = await call("GET", "/v1/explain/ok1")
        assert status == 200 and ex["status"] == "running"


async def test_clock_ticks_at_the_protection_expiry(
    jlog: JetStreamLog, creds: Credentials, oplog: JetStreamLog, gwlog: JetStreamLog
) -> None:
    """Nothing arrives after the second submit; only the scheduler's ClockTicked lets
    v1 preempt a1 once a1's minimum runtime has passed."""
    await oplog.publish_inputs(small_cluster(nodes=1))
    scheduler, gateway = Scheduler(jlog), Gateway(gwlog, auth=creds.authenticator)
    async with running(scheduler, gateway):
        await oplog.publish_input(submit("a1", owner="llm/a", gpus=8, min_runtime_ms=400))
        await eventually(lambda: "a1" in gateway.state.running, what="a1 running")
        await oplog.publish_input(submit("v1", owner="vision", gpus=8, min_runtime_ms=60_000))
        await eventually(
            lambda: "v1" in gateway.state.running, what="v1 placed after a1's protection"
        )
    inputs, _batches = await read_all(jlog)
    assert any(i.event is not None and i.event.id.startswith("tick-") for i in inputs)
    assert gateway.history.preempted["a1"].for_workload == "v1"
