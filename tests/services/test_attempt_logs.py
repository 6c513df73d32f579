"""``apportion logs``: each attempt's output on the bus (services/attempt_logs.py).

The unit part ships files with :class:`Shipper` into a :class:`MemoryLog` and
reads them back. The rest runs against a real nats-server with the real
accounts (``infra/accounts.conf``): a real agent (``apportion agent``, its own
NATS user) runs jobs that print lines, the gateway (its own user) serves them,
and ``apportion logs`` (a process) prints them. No timed assertions: every wait
is for a condition, with a bounded deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from apportion.services import attempt_logs as L
from apportion.services.bus import JetStreamLog, MemoryLog, connect
from apportion.services.direct import get_batch
from apportion.services.gateway import Gateway
from apportion.services.natsconf import agent_user
from apportion.services.runner import supervise_scheduler
from apportion.services.scheduler import Scheduler
from conftest import INFRA, NatsServer
from services_helpers import APPORTION_CMD
from test_agent import Cluster, _kill_leftovers, budget, job, py

H0, H1 = "h100-000", "h100-001"
"""Two hosts of the demo cluster (infra/accounts.conf has their agents' users)."""


# -- the shipper and the answer, in memory ---------------------------------------------


async def _ship(log: MemoryLog, path: Path, host: str, w: str, n: int) -> L.Shipper:
    s = L.Shipper(path=path, subject=lambda k: L.slot_subject("test", host, w, n, k))
    return s


async def test_a_log_is_shipped_in_regions_and_read_back_whole(tmp_path: Path) -> None:
    log = MemoryLog("test")
    out = tmp_path / "output.log"
    out.write_bytes(b"")
    s = await _ship(log, out, "h0", "w.1", 1)
    assert await s.ship(log.publish_log, final=False) == 0  # nothing yet
    text = b"".join(f"line {i}\n".encode() for i in range(20_000))  # ~200 KB: 4 regions
    out.write_bytes(text[:100])
    assert await s.ship(log.publish_log, final=False) == 1
    view = await log.read_log("h0", "w.1", 1)
    assert (view.start, view.data, view.final) == (0, text[:100], False)
    out.write_bytes(text)
    await s.ship(log.publish_log, final=False)
    await s.ship(log.publish_log, final=True)
    view = await log.read_log("h0", "w.1", 1)
    assert (view.start, view.data, view.final) == (0, text, True)
    # another attempt, another host, a host whose name is a prefix: nothing
    assert not (await log.read_log("h0", "w.1", 2)).found
    assert not (await log.read_log("h0.x", "w.1", 1)).found
    assert all(".w%2E1." in subject for subject in log.log_regions)


async def test_over_the_bound_the_first_bytes_are_dropped_and_said_so(tmp_path: Path) -> None:
    log = MemoryLog("test")
    out = tmp_path / "output.log"
    text = bytes(range(256)) * (L.BOUND_BYTES // 256 * 3 // 2 + 7)  # 1.5 MiB and a bit
    s = await _ship(log, out, "h0", "w", 1)
    with out.open("wb") as f:  # shipped as it grows, in three steps
        for part in (text[:300_000], text[300_000:1_000_000], text[1_000_000:]):
            f.write(part)
            f.flush()
            await s.ship(log.publish_log, final=False)
    await s.ship(log.publish_log, final=True)
    assert len(log.log_regions) == L.SLOTS
    view = await log.read_log("h0", "w", 1)
    assert view.final and view.size == len(text)
    assert view.start > len(text) - L.BOUND_BYTES and view.start % L.CHUNK_BYTES == 0
    assert view.data == text[view.start :]
    job_ = {
        "workload": "w",
        "status": "succeeded",
        "attempts": [
            {"attempt": 1, "end_ms": 5, "logs": [{"node": "h0", "started_ms": 1, "path": ""}]}
        ],
    }
    a, host = L.pick(job_, None, None)
    body = L.answer(job_, a, host, 0, view)
    assert body["dropped"] == view.start and body["complete"] and body["shipped"]
    assert f"first {view.start:,} bytes dropped: over the 1 MiB bound" in body["note"]
    again = L.answer(job_, a, host, body["next"], view)
    assert again["text"] == "" and again["next"] == len(text) and again["dropped"] == 0


def test_queries_that_name_nothing_are_refused_in_one_line() -> None:
    job_ = {
        "workload": "w",
        "status": "running",
        "attempts": [
            {"attempt": 1, "end_ms": 5, "logs": [{"node": "h0", "started_ms": 1, "path": ""}]}
        ],
    }
    for query in ({"attempt": "0"}, {"attempt": "x"}, {"from": "-1"}, {"attempt": "１"}):
        with pytest.raises(L.LogQueryError):
            L.parse_query(query)
    assert L.parse_query({"attempt": "2", "from": "10", "node": "h0"}) == (2, "h0", 10)
    with pytest.raises(L.LogQueryError, match="has no attempt 3"):
        L.pick(job_, 3, None)
    with pytest.raises(L.LogQueryError, match="did not run on 'h9'"):
        L.pick(job_, 1, "h9")
    with pytest.raises(L.LogQueryError, match="never placed"):
        L.pick({**job_, "attempts": [], "status": "pending"}, None, None)
    # a run no agent started (the executor emulator): no log, and it says so
    emulated = {
        **job_,
        "attempts": [{**job_["attempts"][0], "logs": [{"node": "h0", "started_ms": None}]}],
    }
    a, host = L.pick(emulated, None, None)
    body = L.answer(emulated, a, host, 0, L.LogView())
    assert not body["shipped"] and body["complete"]
    assert "executor emulator" in body["note"]


# -- the real thing: secure nats-server, a real agent, the gateway, the CLI -------------


def _url(port: int, user: str) -> str:
    return f"nats://{user}:{user}-secret@127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def secure_cluster(
    port: int, tmp_path: Path
) -> AsyncIterator[tuple[Cluster, Gateway, JetStreamLog]]:
    """The scheduler (user ``scheduler``), the agent of H0 (``agent-h100-000``, a
    process) and a gateway (``gateway``, no auth) on the demo cluster's accounts."""
    sched_nc = await connect(_url(port, "scheduler"), name="test-scheduler", timeout_s=10)
    gw_nc = await connect(_url(port, "gateway"), name="test-gateway", timeout_s=10)
    op_nc = await connect(_url(port, "operator"), name="test-operator", timeout_s=10)
    log = JetStreamLog(sched_nc.jetstream(), "demo")
    await log.setup()  # the three streams, LOGS_demo included
    op = JetStreamLog(op_nc.jetstream(timeout=5.0), "demo")  # submits the jobs
    await op.publish_inputs(budget())
    stop = asyncio.Event()
    gateway = Gateway(JetStreamLog(gw_nc.jetstream(timeout=5.0), "demo"), auth=None)
    tasks = [
        asyncio.create_task(supervise_scheduler(Scheduler(log), stop)),
        asyncio.create_task(gateway.serve(stop, port=0)),
    ]
    demo = NatsServer(f"nats://127.0.0.1:{port}", conf=(INFRA / "accounts.conf").read_text())
    c = Cluster(log, op, demo, tmp_path, [])
    try:
        c.start_agent(H0)
        await c.until(
            lambda: H0 in c.state.nodes and c.state.nodes[H0].health == "healthy",
            "the agent registered",
        )
        await gateway.ready.wait()
        yield c, gateway, op
    finally:
        for node in list(c.agents):
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.kill_agent(node, signal.SIGTERM)
        _kill_leftovers(tmp_path)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await c.follower.close()
        for nc in (sched_nc, gw_nc, op_nc):
            await nc.close()


async def apportion(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``apportion ARGS`` as a process (without blocking this event loop: the gateway runs here)."""
    proc = await asyncio.create_subprocess_exec(
        *APPORTION_CMD,
        *args,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**__import__("os").environ, "APPORTION_TOKEN": ""},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


PRINTER = """
import os, signal, sys, time
n = os.environ["APPORTION_ATTEMPT"]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
for i in range(int(sys.argv[1])):
    print(f"attempt {n} line {i}", flush=True)
if n == "1" and sys.argv[2] == "wait":
    while True:
        time.sleep(0.05)
print(f"attempt {n} done", flush=True)
"""


def job_lines(text: str) -> list[str]:
    """The job's own lines of a log (not the agent's ``[apportion <time>] ...``)."""
    return [line for line in text.splitlines() if not line.startswith("[apportion ")]


async def _gateway_has(gateway: Gateway, check: Any, what: str, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_apportion_logs_shows_a_real_agents_output(
    secure_server: int, tmp_path: Path
) -> None:
    """A job that prints lines on a real agent (its own NATS user): ``apportion
    logs`` shows them, ``--attempt`` selects, ``--tail`` cuts, ``--follow`` ends
    with the run; a workload with no log and bad input are one line."""
    async with secure_cluster(secure_server, tmp_path) as (c, gw, op):
        await op.publish_input(
            job("printer", py(PRINTER, "30", "wait"), gpus=2, min_runtime_ms=0, grace_ms=5_000)
        )
        await c.until(lambda: len(c.starts("printer")) == 1, "attempt 1 started")
        output = c.attempt_dirs(H0, "printer")[0] / "output.log"
        await c.until(lambda: "attempt 1 line 29" in output.read_text(), "attempt 1 printed")
        # while it runs: follow it from another process, then preempt it
        url = gw.url
        assert url is not None
        follower = asyncio.create_task(
            apportion("logs", "printer", "--attempt", "1", "--follow", "--url", url, cwd=tmp_path)
        )
        big = job("big", py("print('big ran')"), gpus=2, owner="llm/b")
        await op.publish_input(big)
        await c.until(lambda: c.status("big") == "succeeded", "the preempting job ran", 60)
        await c.until(lambda: c.status("printer") == "succeeded", "printer ran again", 60)
        await _gateway_has(
            gw,
            lambda: gw.state.status_of("printer") == "succeeded",
            "the gateway folded printer's end",
        )
        followed = await follower
        assert followed.returncode == 0, followed.stderr
        # it printed attempt 1 as it came, and stopped once attempt 1 had ended
        assert job_lines(followed.stdout) == [f"attempt 1 line {i}" for i in range(30)], (
            followed.stdout,
            followed.stderr,
        )
        assert "SIGTERM" in followed.stdout  # the agent's own line, in the log too

        last = await apportion("logs", "printer", "--url", url, cwd=tmp_path)
        assert last.returncode == 0, last.stderr
        assert job_lines(last.stdout) == [f"attempt 2 line {i}" for i in range(30)] + [
            "attempt 2 done"
        ]
        first = await apportion("logs", "printer", "--attempt", "1", "--url", url, cwd=tmp_path)
        assert first.returncode == 0, first.stderr
        assert first.stdout == followed.stdout
        tail = await apportion("logs", "printer", "--tail", "3", "--url", url, cwd=tmp_path)
        assert len(tail.stdout.splitlines()) == 3
        assert job_lines(tail.stdout) == ["attempt 2 line 29", "attempt 2 done"]
        as_json = await apportion("logs", "printer", "--json", "--url", url, cwd=tmp_path)
        body = json.loads(as_json.stdout)
        assert (body["attempt"], body["attempts"], body["node"]) == (2, [1, 2], H0)
        assert body["complete"] and body["dropped"] == 0 and body["note"] is None
        # bad input: one line, status 2; and the API's 4xx bodies
        for args, words in (
            (("--attempt", "3"), "has no attempt 3 (it has 1, 2)"),
            (("--node", "h9"), "did not run on 'h9'"),
        ):
            bad = await apportion("logs", "printer", *args, "--url", url, cwd=tmp_path)
            assert bad.returncode == 2 and words in bad.stderr, bad.stderr
            assert len(bad.stderr.strip().splitlines()) == 1
        unknown = await apportion("logs", "nope", "--url", url, cwd=tmp_path)
        assert unknown.returncode == 2 and "unknown workload 'nope'" in unknown.stderr
        import aiohttp

        async with aiohttp.ClientSession() as http:
            for path, status, code in (
                ("/v1/logs/printer?attempt=x", 400, "bad_query"),
                ("/v1/logs/printer?from=-3", 400, "bad_query"),
                ("/v1/logs/nope", 404, "unknown_workload"),
            ):
                async with http.get(url + path) as r:
                    assert r.status == status, path
                    assert (await r.json())["code"] == code
            async with http.get(url + "/v1/logs/printer?attempt=2&from=10") as r:
                assert (await r.json())["text"] == last.stdout[10:]
            # the dashboard's workload page shows the last attempt's output, ?attempt= another's
            cookie = {"Cookie": "apportion_token=ops"}  # a gateway without auth: a name
            async with http.get(url + "/ui/workload/printer", headers=cookie) as r:
                page = await r.text()
                assert r.status == 200 and "attempt 2 line 29" in page
                assert "attempt 1 line" not in page and "?attempt=1#log" in page
            async with http.get(url + "/ui/workload/printer?attempt=1", headers=cookie) as r:
                page = await r.text()
                assert "attempt 1 line 29" in page and "attempt 2 line" not in page


async def test_the_bound_truncates_and_says_so(secure_server: int, tmp_path: Path) -> None:
    """A job printing 1.5 MiB: the bus keeps the last MiB, and the log says what was dropped."""
    chatty = """
import sys
line = "x" * 99 + "\\n"
for i in range(16000):
    sys.stdout.write(f"{i:06d}" + line[6:])
print("the end", flush=True)
"""
    async with secure_cluster(secure_server, tmp_path) as (c, gw, op):
        await op.publish_input(job("chatty", py(chatty), gpus=1))
        await c.until(lambda: c.status("chatty") == "succeeded", "chatty ran")
        url = gw.url
        assert url is not None
        await _gateway_has(gw, lambda: gw.state.status_of("chatty") == "succeeded", "folded")
        out = await apportion("logs", "chatty", "--url", url, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        full = (c.attempt_dirs(H0, "chatty")[0] / "output.log").read_bytes()
        dropped = len(full) - len(out.stdout.encode())
        assert len(full) > L.BOUND_BYTES > len(out.stdout.encode()) >= L.BOUND_BYTES - L.CHUNK_BYTES
        assert full.endswith(out.stdout.encode()) and job_lines(out.stdout)[-1] == "the end"
        assert f"first {dropped:,} bytes dropped: over the 1 MiB bound" in out.stderr


async def test_an_agent_may_ship_only_its_own_hosts_logs(secure_server: int) -> None:
    """Under the real accounts: the agent of H1 cannot publish on H0's log subjects
    (nor a dotted name's that would look like them), only on its own; the gateway and
    the operator read LOGS, the agents, projector and auditor cannot."""
    import nats.errors

    conns: dict[str, Any] = {}

    async def as_user(user: str) -> Any:
        if user not in conns:
            conns[user] = await connect(_url(secure_server, user), name=f"t-{user}", timeout_s=10)
        return conns[user]

    try:
        sched = JetStreamLog((await as_user("scheduler")).jetstream(), "demo")
        await sched.setup()
        h1 = (await as_user(agent_user(H1))).jetstream(timeout=1.0)
        for subject in (
            L.slot_subject("demo", H0, "w", 1, 0),
            f"apportion.demo.logs.{H1}x.w.1.0",
            "apportion.demo.logs.w.1.0",
        ):
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await h1.publish(subject, b"forged", headers={L.HDR_OFFSET: "0"})
        await h1.publish(
            L.slot_subject("demo", H1, "w", 1, 0), b"mine", headers={L.HDR_OFFSET: "0"}
        )
        got, _ = await get_batch(await as_user("scheduler"), "LOGS_demo", 1, 100)
        assert [(m.subject, m.data) for m in got] == [
            (L.slot_subject("demo", H1, "w", 1, 0), b"mine")
        ]
        for reader in ("gateway", "operator"):
            view = await L.read_log(await as_user(reader), "demo", H1, "w", 1)
            assert view.data == b"mine"
        for outsider in (agent_user(H0), agent_user(H1), "projector", "auditor", "executor"):
            with pytest.raises(TimeoutError):  # the server drops the request
                async with asyncio.timeout(1.5):
                    await L.read_log(await as_user(outsider), "demo", H1, "w", 1)
    finally:
        for nc in conns.values():
            await nc.close()


async def test_the_emulators_runs_have_no_log_and_apportion_logs_says_so(
    jlog: JetStreamLog,
    tmp_path: Path,
    creds: Any,
    oplog: JetStreamLog,
    gwlog: JetStreamLog,
    exelog: JetStreamLog,
) -> None:
    """Under the executor emulator (no agent: nothing runs, nothing is shipped),
    ``apportion logs`` ends with one line saying why, status 2; with a token, as explain."""
    from apportion.services.executor import Executor
    from services_helpers import eventually, small_cluster, submit

    await oplog.publish_inputs(small_cluster())
    gateway = Gateway(gwlog, auth=creds.authenticator)
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(supervise_scheduler(Scheduler(jlog), stop)),
        asyncio.create_task(Executor(exelog).run(stop)),
        asyncio.create_task(gateway.serve(stop, port=0)),
    ]
    try:
        await oplog.publish_input(submit("w1", gpus=4, duration_ms=200))
        await eventually(lambda: gateway.state.status_of("w1") == "succeeded", what="w1 ran")
        url = gateway.url
        assert url is not None
        token = str(creds.token_files["alice"])  # any principal may read it, as explain
        body = await apportion(
            "logs", "w1", "--json", "--url", url, "--token-file", token, cwd=tmp_path
        )
        answer = json.loads(body.stdout)
        assert not answer["shipped"] and answer["complete"] and answer["text"] == ""
        out = await apportion("logs", "w1", "--url", url, "--token-file", token, cwd=tmp_path)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.strip().splitlines() == [
            f"apportion: w1: no agent reported starting attempt 1 on {answer['node']}: nothing "
            "was shipped (the executor emulator, and an executor without host agents, write "
            "no logs)"
        ]
        anonymous = await apportion("logs", "w1", "--url", url, cwd=tmp_path)
        assert anonymous.returncode == 2 and "not authenticated" in anonymous.stderr
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
