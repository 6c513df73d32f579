"""Readers that heal: a damaged or missing projection file is rebuilt from the
streams; a supervised child that dies is started again (a service task, and the
nats-server `apportion up` started)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import duckdb
import msgspec
import pytest
from apportion.services import logs
from apportion.services.auth import read_token_file
from apportion.services.bus import JetStreamLog
from apportion.services.projector import Projector, open_projection, open_projection_for
from apportion.services.runner import Supervisor
from apportion.services.scheduler import Scheduler
from apportion.services.stack import Stack, load_cluster_spec, start_nats_server
from services_helpers import eventually, small_cluster
from services_helpers import submit as _submit_as_nobody
from test_services import TABLES, running


def submit(workload: str, **kw):
    """A submission by ``ops``, who owns the root of the test budget tree."""
    return msgspec.structs.replace(_submit_as_nobody(workload, **kw), submitted_by="ops")


def tables(con: duckdb.DuckDBPyConnection) -> dict[str, list[tuple]]:
    return {t: con.execute(f"SELECT * FROM {t} ORDER BY ALL").fetchall() for t in TABLES}


async def _projected(
    jlog: JetStreamLog, oplog: JetStreamLog, projlog: JetStreamLog, path: Path
) -> dict[str, list[tuple]]:
    """A history decided by a scheduler and projected into ``path``; its tables."""
    await oplog.publish_inputs(small_cluster(nodes=2))
    await oplog.publish_inputs(
        [submit(f"w{i}", owner=("llm/a", "vision")[i % 2], gpus=4) for i in range(12)]
        + [submit("bad", owner="nope", gpus=1)]
    )
    last = await jlog.last_input_seq()
    projector = Projector(projlog, open_projection(path))
    scheduler = Scheduler(jlog)
    async with running(scheduler, projector):
        await eventually(lambda: projector.position[0] >= last, what="projector caught up")
    con = projector.projection.con
    out = tables(con)
    con.close()
    return out


def _flip_bytes(path: Path) -> None:
    """Flip one byte in every 16 KB of the file after its headers: every block in use is hit."""
    data = bytearray(path.read_bytes())
    for at in range(12_288 + 100, len(data), 16_384):
        data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "missing"])
async def test_a_damaged_projection_file_is_rebuilt_from_the_streams(
    jlog: JetStreamLog,
    tmp_path: Path,
    damage: str,
    oplog: JetStreamLog,
    projlog: JetStreamLog,
) -> None:
    path = tmp_path / "live.duckdb"
    before = await _projected(jlog, oplog, projlog, path)
    assert before["workloads"] and before["events"]
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "bit-flipped":
        _flip_bytes(path)
    else:
        path.unlink()
    projection = open_projection(path)
    aside = sorted(tmp_path.glob("live.duckdb.corrupt-*"))
    assert len(aside) == (0 if damage == "missing" else 1)
    assert projection.position == (0, 0)
    projector = Projector(projlog, projection)
    last = await jlog.last_input_seq()
    async with running(projector):
        await eventually(lambda: projector.position[0] >= last, what="projector rebuilt")
    assert tables(projection.con) == before
    projection.con.close()


async def test_a_projection_ahead_of_the_streams_is_rebuilt(
    js,
    jlog: JetStreamLog,
    oplog: JetStreamLog,
    projlog: JetStreamLog,
    another_cluster: str,
    log_as,
    tmp_path: Path,
) -> None:
    path = tmp_path / "live.duckdb"
    before = await _projected(jlog, oplog, projlog, path)
    # the same cluster after an OS crash lost the tail of its streams: fewer inputs
    shorter = JetStreamLog(js, another_cluster)
    await shorter.setup()
    await (await log_as("operator", another_cluster)).publish_inputs(small_cluster(nodes=2))
    projection = await open_projection_for(path, shorter)
    assert projection.position == (0, 0)
    assert len(sorted(tmp_path.glob("live.duckdb.corrupt-*"))) == 1
    projection.con.close()
    kept = await open_projection_for(path, jlog)  # not ahead of its own streams: kept
    assert kept.position == (0, 0) and before["events"]
    kept.con.close()


async def test_a_killed_or_failed_child_is_started_again(
    jlog: JetStreamLog,
    tmp_path: Path,
    oplog: JetStreamLog,
    projlog: JetStreamLog,
) -> None:
    path = tmp_path / "p.duckdb"
    await oplog.publish_inputs(small_cluster(nodes=2))
    stop = asyncio.Event()
    sup = Supervisor(stop, logs.get("test"), first_delay_s=0.05)
    projectors: list[Projector] = []

    async def start_projector() -> None:
        projector = Projector(projlog, open_projection(path))
        projectors.append(projector)
        await projector.run(stop)

    async def caught_up() -> bool:
        last = await jlog.last_input_seq()
        return bool(projectors) and projectors[-1].position[0] >= last

    scheduler = Scheduler(jlog)
    async with running(scheduler):
        supervised = asyncio.create_task(sup.run("projector", start_projector))
        await oplog.publish_input(submit("a"))
        await eventually(caught_up, what="first projector")
        sup.tasks["projector"].cancel()  # killed
        await eventually(lambda: len(projectors) == 2, what="projector started again")
        assert sup.restarts["projector"] == 1 and "cancelled" in sup.last_error["projector"]
        await oplog.publish_input(submit("b"))
        await eventually(caught_up, what="second projector")
        projectors[-1].projection.con.close()  # its database fails under it
        await oplog.publish_input(submit("c"))
        await eventually(lambda: len(projectors) == 3, what="projector started after a failure")
        assert "ConnectionException" in sup.last_error["projector"]
        await eventually(caught_up, what="third projector")
        stop.set()
        await supervised
    con = projectors[-1].projection.con
    count, max_pos = con.execute("SELECT count(*), max(pos) FROM events").fetchone()
    assert count == max_pos == con.execute("SELECT count(DISTINCT pos) FROM events").fetchone()[0]
    assert {r[0] for r in con.execute("SELECT workload FROM workloads").fetchall()} == {
        "a",
        "b",
        "c",
    }
    con.close()


async def _submit(url: str, body: dict, token: str) -> bool:
    try:
        async with (
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http,
            http.post(
                f"{url}/v1/workloads", json=body, timeout=aiohttp.ClientTimeout(total=5)
            ) as r,
        ):
            return r.status == 202
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _status(url: str, workload: str, token: str) -> str | None:
    try:
        async with (
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http,
            http.get(f"{url}/v1/workloads/{workload}", timeout=aiohttp.ClientTimeout(total=5)) as r,
        ):
            return (await r.json()).get("status") if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def test_up_restarts_its_nats_server_and_its_services(tmp_path: Path) -> None:
    server = start_nats_server(tmp_path / "nats")
    stop = asyncio.Event()
    stack = Stack(
        server.url,
        load_cluster_spec(None),
        data_dir=tmp_path,
        port=0,
        executor=False,
        nats=server,
        grace_s=5,
    )
    task = asyncio.create_task(stack.run(stop))
    try:
        await eventually(stack.started.is_set, what="up started")
        assert stack.gateway is not None and stack.supervisor is not None
        url = stack.gateway.url
        token = read_token_file(stack.tokens["alice"])  # up made a token for each owner
        job = {
            "owner": "llm/pretrain",
            "gpus": 8,
            "min_runtime_ms": 900_000,
            "submitted_by": "alice",
        }
        await eventually(lambda: _submit(url, {**job, "id": "one"}, token), what="first submit")
        await eventually(lambda: _is(url, "one", "running", token), what="one running")

        killed = server.proc.pid
        os.kill(killed, signal.SIGKILL)
        sup = stack.supervisor
        await eventually(
            lambda: sup.restarts.get("nats-server", 0) == 1 and server.proc.pid != killed,
            what="nats-server started again",
        )
        assert "exited" in sup.last_error["nats-server"]
        # the services reconnected: a new submission is decided, the first one still runs
        await eventually(
            lambda: _submit(url, {**job, "id": "two"}, token), timeout=60, what="submit"
        )
        await eventually(lambda: _is(url, "two", "running", token), timeout=60, what="two running")
        assert await _status(url, "one", token) == "running"

        sup.tasks["projector"].cancel()  # a service task killed
        await eventually(lambda: sup.restarts.get("projector", 0) == 1, what="projector again")
        assert stack.gateway.url == url
    finally:
        stop.set()
        await task
        server.stop()
    assert task.exception() is None


async def _is(url: str, workload: str, status: str, token: str) -> bool:
    return await _status(url, workload, token) == status
