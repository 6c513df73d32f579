"""Lost inputs (issue 24, item 4): a damaged INPUTS block of a stopped single
nats-server drops acknowledged inputs. Every service stays up and reports the
gap, the gateway refuses submits with 503 while the history is not whole,
``audit`` says so in one line, and ``apportion history accept-loss`` records the
loss as an input after which scheduling goes on (docs/services.md, "Lost inputs").

The damage is real: 64 bytes flipped in the middle of the first block file of
INPUTS (more than one block, so later sequences survive: a gap, as the issue saw)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from pathlib import Path

import aiohttp
import pytest
from apportion.services.bus import JetStreamLog
from apportion.services.direct import GAP_POLL_S
from apportion.services.gateway import Gateway
from apportion.services.scheduler import Scheduler
from conftest import NatsServer, nats_server_binary, production_server
from services_helpers import APPORTION_CMD, audit_live, eventually, small_cluster, submit

pytestmark = pytest.mark.nats

FILLER = 1300
"""Raw inputs of 8 KB: INPUTS spans two 8 MB blocks, the damage hits the first."""


async def publish_filler(log: JetStreamLog) -> None:
    """:data:`FILLER` undecodable inputs of 8 KB, published in rounds of 200 (by the
    operator, on a subject it may publish)."""
    subject = log.subjects.input_subject("WorkloadSubmitted")
    for start in range(0, FILLER, 200):
        futures = [
            await log.js.publish_async(subject, b"x" * 8000, headers={"Nats-Msg-Id": f"f-{i}"})
            for i in range(start, min(FILLER, start + 200))
        ]
        await asyncio.gather(*futures)


@pytest.fixture
def own_server(tmp_path: Path, cluster: str):
    """A nats-server of this test alone, with the users of production (it is stopped,
    damaged and started again)."""
    if nats_server_binary() is None:
        pytest.skip("needs the nats-server binary (its store is damaged on disk)")
    server = production_server(tmp_path / "store", cluster)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def damage_first_block(store: Path, stream: str) -> None:
    """Flip 64 bytes in the first block of ``stream`` under the JetStream store
    ``store`` (in whichever account holds it: APPORTION on a server with the
    accounts of production, the global account on one without users)."""
    [folder] = store.glob(f"jetstream/*/streams/{stream}/msgs")
    blocks = sorted(folder.glob("*.blk"), key=lambda p: int(p.stem))
    assert len(blocks) >= 2, blocks
    data = bytearray(blocks[0].read_bytes())
    at = len(data) // 2
    for k in range(64):
        data[at + k] ^= 0xFF
    blocks[0].write_bytes(bytes(data))


async def cli(*args: str) -> tuple[int, str, str]:
    """``apportion ARGS`` as a user runs it (not blocking the services of this loop)."""
    proc = await asyncio.create_subprocess_exec(
        *APPORTION_CMD, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_lost_input_is_reported_then_accepted_and_scheduling_resumes(
    own_server: NatsServer, cluster: str, creds
) -> None:
    """Each service connects as its own user; a record of the loss by someone who
    is not an operator bridges nothing (the fold refuses it: core/history.py,
    ``bridge_refusal``), the operator's does."""
    from apportion.schemas.events import InputsLost
    from apportion.services.bus import connect

    conns: list = []

    async def log_as(user: str) -> JetStreamLog:
        conns.append(await connect(own_server.url_as(user), name=f"test-{user}", timeout_s=10))
        return JetStreamLog(conns[-1].jetstream(), cluster)

    log = await log_as("scheduler")
    await log.setup()
    op = await log_as("operator")
    await op.publish_inputs(small_cluster())
    await publish_filler(op)
    await op.publish_input(submit("before", gpus=4))
    last = await log.last_input_seq()
    first_scheduler = Scheduler(log)  # snapshots in memory: a restart folds the log
    stop = asyncio.Event()
    task = asyncio.create_task(first_scheduler.run(stop))
    await eventually(lambda: first_scheduler.last_basis == last, what="the first cycles")
    stop.set()
    await task
    for nc in conns:
        await nc.close()
    conns.clear()

    own_server.stop()
    damage_first_block(own_server.store / "js", f"INPUTS_{cluster}")
    own_server.start()

    log = await log_as("scheduler")
    await log.setup()
    op = await log_as("operator")
    gaps = await log.input_gaps()
    assert len(gaps) == 1 and gaps[0].acceptance is None, gaps
    first, through = gaps[0].first, gaps[0].through
    assert 8 < first <= through < last
    url = own_server.url_as("auditor")  # audit, replay, history gaps: read only
    op_url = own_server.url_as("operator")  # accept-loss publishes an input

    stop = asyncio.Event()
    scheduler = Scheduler(log)
    gateway = Gateway(await log_as("gateway"), auth=creds.authenticator)
    tasks = [
        asyncio.create_task(scheduler.run(stop)),
        asyncio.create_task(gateway.serve(stop)),
    ]
    try:
        await gateway.ready.wait()
        await eventually(lambda: gateway.follower.gap == (first, through), what="the gap")
        await eventually(lambda: scheduler.gap == (first, through), what="the scheduler's gap")
        body = {"owner": "llm/a", "gpus": 4, "min_runtime_ms": 60_000, "id": "during"}
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{gateway.url}/v1/workloads", json=body, headers=creds.headers("ops")
            ) as r:
                assert r.status == 503 and "Retry-After" in r.headers
                answer = await r.json()
            assert answer["code"] == "history_incomplete"
            assert f"inputs {first}..{through} are missing" in answer["error"]
            assert "accept-loss" in answer["error"]
            async with http.get(f"{gateway.url}/v1/status") as r:
                status = await r.json()
            assert status["history"] == "incomplete"
            assert status["missing"] == {
                "first": first,
                "through": through,
                "count": through - first + 1,
            }
            async with http.get(f"{gateway.url}/metrics") as r:
                metrics = await r.text()
            assert f"apportion_inputs_missing {float(through - first + 1)}" in metrics
            async with http.get(f"{gateway.url}/v1/queue", headers=creds.headers("ops")) as r:
                assert r.status == 200  # reads still answer, from the history before the gap
        assert not any(t.done() for t in tasks)  # every service is up

        code, out, err = await cli(
            "status", "--url", gateway.url, "--token-file", str(creds.token_files["ops"])
        )
        assert code == 0 and "history NOT WHOLE" in out and f"--through {through}" in out, err
        code, out, err = await cli("audit", "--cluster", cluster, "--nats", url)
        assert code == 1 and "Traceback" not in out + err, err
        assert f"inputs {first:,}..{through:,} are missing from INPUTS" in out
        code, out, err = await cli("history", "gaps", "--cluster", cluster, "--nats", url)
        assert code == 1 and "no loss accepted" in out, err

        # a wrong --through is refused in one line
        code, out, err = await cli(
            "history", "accept-loss", "--cluster", cluster, "--nats", op_url,
            "--through", str(through + 1), "--actor", "ops",
        )  # fmt: skip
        assert code == 2 and err.count("\n") == 1 and f"--through {through}" in err
        # a record of the loss by someone who is not an operator bridges nothing (the
        # operator's credential could publish it: the fold refuses it, not NATS)
        code, out, err = await cli(
            "history", "accept-loss", "--cluster", cluster, "--nats", op_url,
            "--through", str(through), "--actor", "mallory",
        )  # fmt: skip
        assert code == 0 and "recorded" in out, err
        await op.publish_input(
            InputsLost(id="by-nobody", at_ms=0, first=first, through=through, actor="")
        )
        await asyncio.sleep(3 * GAP_POLL_S)  # the readers asked again, and again
        assert gateway.follower.gap == (first, through) and scheduler.gap == (first, through)
        code, out, err = await cli("history", "gaps", "--cluster", cluster, "--nats", url)
        assert code == 1 and "no loss accepted" in out, out + err
        code, out, err = await cli(
            "history", "accept-loss", "--cluster", cluster, "--nats", op_url,
            "--through", str(through), "--actor", "ops", "--note", "block 1 damaged",
        )  # fmt: skip
        assert code == 0 and "recorded" in out, err

        await eventually(lambda: gateway.follower.gap is None, what="the gateway going on")
        await eventually(lambda: scheduler.leading.is_set() and scheduler.gap is None)
        body = {"owner": "llm/a", "gpus": 4, "min_runtime_ms": 60_000, "id": "after"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{gateway.url}/v1/workloads", json=body, headers=creds.headers("ops")) as r,
        ):
            assert r.status == 202, await r.text()
        await eventually(lambda: "after" in gateway.state.running, what="placed after the loss")
        assert not any(t.done() for t in tasks)
    finally:
        stop.set()
        for t in tasks:
            with contextlib.suppress(Exception):
                await t
        for nc in conns:
            await nc.close()

    # audit and replay reproduce the history with the loss, one line about it
    done = audit_live(url, cluster)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all reproduced" in done.stdout
    assert f"inputs {first:,}..{through:,} were lost" in done.stdout
    assert "accepted by ops" in done.stdout and "mallory" not in done.stdout
    replay = subprocess.run(
        [*APPORTION_CMD, "replay", "--cluster", cluster, "--nats", url, "--log", "/dev/null"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert replay.returncode == 0 and "Traceback" not in replay.stderr, replay.stderr
    assert f"inputs {first:,}..{through:,} were lost" in replay.stdout
