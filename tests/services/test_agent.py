"""``apportion agent`` on real processes: agents (``apportion agent`` subprocesses with
fake GPUs) on localhost, a real nats-server and a real scheduler.

No timed assertions: every wait is for a condition, with a bounded deadline
that fails the test with a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from apportion.schemas.events import (
    BudgetSet,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    WorkloadFinished,
    WorkloadStarted,
    WorkloadSubmitted,
)
from apportion.schemas.history import InputItem
from apportion.services.bus import JetStreamLog, connect
from apportion.services.canonical import Follower
from apportion.services.natsconf import agent_user, user_url
from apportion.services.runner import supervise_scheduler
from apportion.services.scheduler import Scheduler
from conftest import password
from services_helpers import APPORTION_CMD

pytestmark = pytest.mark.nats

GPUS = 2
"""Fake GPUs per agent."""


def budget(heartbeat_timeout_ms: int = 0) -> list[Any]:
    return [
        BudgetSet(id="b-root", at_ms=0, path="", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b-llm", at_ms=0, path="llm", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b-llm-a", at_ms=0, path="llm/a", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b-llm-b", at_ms=0, path="llm/b", weight=1, owner="ops", actor="ops"),
        PolicySet(
            id="policy",
            at_ms=0,
            actor="ops",
            preemption_margin_ppm=0,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        ),
    ]


def job(
    workload: str,
    command: list[str],
    gpus: int = 1,
    owner: str = "llm/a",
    min_runtime_ms: int = 60_000,
    **kw: Any,
) -> WorkloadSubmitted:
    return WorkloadSubmitted(
        id=f"submit-{workload}",
        at_ms=0,
        workload=workload,
        owner=owner,
        gpus=gpus,
        min_runtime_ms=min_runtime_ms,
        submitted_by="ops",
        command=tuple(command),
        **kw,
    )


def py(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code), *args]


class Cluster:
    """A scheduler (in this process), agents (processes), and a follower of the history."""

    def __init__(
        self, log: JetStreamLog, op: JetStreamLog, nats: Any, work: Path, args: list[str]
    ) -> None:
        self.args = args
        self.log = log
        """The scheduler's log (it runs the scheduler, and follows the history)."""
        self.op = op
        """The operator's: who sets the cluster up and submits the jobs."""
        self.nats = nats
        self.work = work
        self.follower = Follower(log)
        self.inputs: list[Any] = []
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def state(self) -> Any:
        return self.follower.state

    def start_agent(self, node: str, url: str | None = None) -> None:
        """An agent for ``node``, with its own credential (``agent-<node>``), connected
        to the server or to ``url`` (a proxy in front of it)."""
        user = agent_user(node)
        url = self.nats.url_as(user) if url is None else user_url(url, user, password(user))
        err = open(self.work / f"agent-{node}.log", "ab")  # noqa: SIM115 - kept by the process
        self.agents[node] = subprocess.Popen(
            [
                *APPORTION_CMD,
                "agent",
                "--node",
                node,
                "--cluster-name",
                self.log.subjects.cluster,
                "--nats",
                url,
                "--gpus",
                str(GPUS),
                "--gpu-type",
                "h100",
                "--work-dir",
                str(self.work),
                "--heartbeat-interval",
                "0.3",
                "--stop-on-exit",
                "--log-level",
                "info",
                *self.args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        err.close()

    def kill_agent(self, node: str, sig: int = signal.SIGKILL) -> None:
        proc = self.agents.pop(node)
        proc.send_signal(sig)
        proc.wait(30)

    async def sync(self) -> None:
        for item in await self.follower.poll(0.05):
            if isinstance(item, InputItem) and item.event is not None:
                self.inputs.append(item.event)

    async def until(self, check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await self.sync()
            if check():
                return
            for node, proc in self.agents.items():
                if proc.poll() is not None:
                    log = (self.work / f"agent-{node}.log").read_text()[-3000:]
                    raise AssertionError(f"agent {node} exited ({proc.returncode}):\n{log}")
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")

    async def settle(self) -> None:
        """Fold everything INPUTS holds now (before asserting that something is absent)."""
        last = await self.log.last_input_seq()
        await self.until(lambda: self.state.input_seq >= last, f"input {last} folded")

    def status(self, workload: str) -> str | None:
        return self.state.status_of(workload)

    def finishes(self, workload: str) -> list[WorkloadFinished]:
        return [
            e for e in self.inputs if isinstance(e, WorkloadFinished) and e.workload == workload
        ]

    def starts(self, workload: str) -> list[WorkloadStarted]:
        return [e for e in self.inputs if isinstance(e, WorkloadStarted) and e.workload == workload]

    def node_of(self, workload: str) -> list[str]:
        w = self.state.running.get(workload)
        return [s.node for s in w.placement] if w is not None else []

    def attempt_dirs(self, node: str, workload: str) -> list[Path]:
        return sorted((self.work / self.log.subjects.cluster / node / workload).glob("attempt-*"))

    def checkpoint(self, workload: str) -> Path:
        return self.work / self.log.subjects.cluster / "checkpoints" / workload


def _kill_leftovers(work: Path) -> None:
    """End the workloads (process groups) and supervisors this test's agents started,
    by the pids their attempt folders name."""
    for name in ("pid", "shim.pid"):
        for f in work.rglob(name):
            try:
                pid = int(f.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if name == "shim.pid" and str(f.parent).encode() not in cmdline:
                continue  # not that supervisor any more
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if name == "pid":
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def cluster_of(
    nats_server: Any,
    js: Any,
    name: str,
    tmp_path: Path,
    nodes: int,
    heartbeat_timeout_ms: int = 0,
    args: tuple[str, ...] = (),
) -> AsyncIterator[Cluster]:
    log = JetStreamLog(js, name)
    await log.setup()
    op_nc = await connect(nats_server.url_as("operator"), name="test-operator", timeout_s=10)
    op = JetStreamLog(op_nc.jetstream(), name)
    await op.publish_inputs(budget(heartbeat_timeout_ms))
    scheduler = Scheduler(log)
    stop = asyncio.Event()
    task = asyncio.create_task(supervise_scheduler(scheduler, stop))
    c = Cluster(log, op, nats_server, tmp_path, list(args))
    try:
        for i in range(nodes):
            c.start_agent(f"h{i}")
        await c.until(
            lambda: (
                len(c.state.nodes) == nodes
                and all(n.health == "healthy" for n in c.state.nodes.values())
            ),
            f"{nodes} agents registered",
        )
        yield c
    finally:
        for node in list(c.agents):
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.kill_agent(node, signal.SIGTERM)
        _kill_leftovers(tmp_path)
        stop.set()
        await task
        await c.follower.close()
        await op_nc.close()


ENV_JOB = """
import json, os, sys, time
keys = ["APPORTION_WORKLOAD", "APPORTION_ATTEMPT", "APPORTION_CHECKPOINT_DIR",
        "APPORTION_NOTICE_FILE", "APPORTION_GRACE_S", "CUDA_VISIBLE_DEVICES", "WORLD_SIZE",
        "RANK", "NODE_RANK", "NNODES", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MY_VAR"]
env = {k: os.environ.get(k) for k in keys}
path = os.path.join(os.environ["APPORTION_CHECKPOINT_DIR"], f"env-{os.environ['RANK']}.json")
with open(path, "w") as f:
    json.dump(env, f)
print("hello from rank", os.environ["RANK"], flush=True)
if os.environ["RANK"] == "0":
    time.sleep(float(sys.argv[2]))
sys.exit(int(sys.argv[1]))
"""


async def test_jobs_run_and_report_exit_codes(nats_server, js, cluster, tmp_path) -> None:
    """A job runs as a real process with its env and GPUs, its output is captured, its
    exit code is reported; a failing job is reported failed."""
    async with cluster_of(nats_server, js, cluster, tmp_path, nodes=3) as c:
        await c.op.publish_inputs(
            [
                job("ok", py(ENV_JOB, "0", "0"), gpus=2, env={"MY_VAR": "x y"}),
                job("bad", py(ENV_JOB, "3", "0"), gpus=1),
            ]
        )
        await c.until(
            lambda: c.status("ok") == "succeeded" and c.status("bad") == "failed",
            "ok succeeded and bad failed",
        )
        (ok,), (bad,) = c.finishes("ok"), c.finishes("bad")
        assert (ok.outcome, ok.exit_code, ok.attempt) == ("succeeded", 0, 1)
        assert (bad.outcome, bad.exit_code) == ("failed", 3)
        assert ok.id == "finished-ok-1" and ok.actor.startswith("agent:h")
        assert [s.attempt for s in c.starts("ok")] == [1]
        env = json.loads((c.checkpoint("ok") / "env-0.json").read_text())
        assert env["MY_VAR"] == "x y"
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["WORLD_SIZE"] == "1" and env["RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["APPORTION_WORKLOAD"] == "ok" and env["APPORTION_ATTEMPT"] == "1"
        node = ok.actor.removeprefix("agent:")
        (attempt,) = c.attempt_dirs(node, "ok")
        assert "hello from rank 0" in (attempt / "output.log").read_text()
        assert json.loads((attempt / "exit").read_text()) == {"exit_code": 0}


RESUMABLE_JOB = """
import json, os, signal, sys, time
ck = os.environ["APPORTION_CHECKPOINT_DIR"]
state, journal = os.path.join(ck, "state.json"), os.path.join(ck, "journal")
total = int(sys.argv[1])
step = json.load(open(state))["step"] if os.path.exists(state) else 0
def note(text):
    with open(journal, "a") as f:
        f.write(f"{os.environ['APPORTION_ATTEMPT']} {text}\\n")
note(f"start {step}")
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
while step < total:
    if stopping:
        with open(state + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(state + ".tmp", state)
        notice = json.load(open(os.environ["APPORTION_NOTICE_FILE"]))
        note(f"sigterm {step} {notice['reason']}")
        sys.exit(143)
    time.sleep(0.02)
    step += 1
note(f"done {step}")
"""


async def test_preempted_job_checkpoints_and_resumes(nats_server, js, cluster, tmp_path) -> None:
    """Free work preempted (with notice) for another team's allocated gang gets SIGTERM,
    saves a checkpoint, is requeued, resumes from it and does exactly the total work."""
    async with cluster_of(nats_server, js, cluster, tmp_path, nodes=3) as c:
        total = 200
        await c.op.publish_input(
            job(
                "free",
                py(RESUMABLE_JOB, str(total)),
                gpus=2,
                min_runtime_ms=0,
                grace_ms=20_000,
            )
        )
        journal = c.checkpoint("free") / "journal"
        await c.until(lambda: journal.exists(), "the free job started")
        await c.op.publish_input(
            job("big", py("import time; time.sleep(0.5)"), gpus=6, owner="llm/b")
        )
        await c.until(lambda: c.status("big") == "succeeded", "the gang ran", timeout=60)
        await c.until(lambda: c.status("free") == "succeeded", "the free job resumed and ended")
        lines = journal.read_text().split()
        text = journal.read_text().splitlines()
        assert text[0] == "1 start 0", text
        assert text[1].startswith("1 sigterm ") and text[1].endswith("(unallocated)"), text
        saved = int(text[1].split()[2])
        assert 0 < saved < total
        assert text[2:] == [f"2 start {saved}", f"2 done {total}"], text
        assert lines  # the whole journal was read
        ends = c.finishes("free")
        assert [(e.attempt, e.outcome, e.exit_code) for e in ends] == [
            (1, "failed", 143),
            (2, "succeeded", 0),
        ]


async def test_two_node_gang(nats_server, js, cluster, tmp_path) -> None:
    """Both ranks of a two-host gang start with consistent variables; rank 1 ending
    first does not end the gang; the gang is reported once."""
    async with cluster_of(nats_server, js, cluster, tmp_path, nodes=3) as c:
        await c.op.publish_input(job("gang", py(ENV_JOB, "0", "1.0"), gpus=4))
        await c.until(lambda: c.status("gang") == "succeeded", "the gang succeeded")
        await c.settle()
        envs = [json.loads((c.checkpoint("gang") / f"env-{r}.json").read_text()) for r in (0, 1)]
        for rank, env in enumerate(envs):
            assert env["RANK"] == env["NODE_RANK"] == str(rank)
            assert env["WORLD_SIZE"] == env["NNODES"] == "2"
            assert env["LOCAL_WORLD_SIZE"] == "2" and env["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == "127.0.0.1"
        assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
        (end,) = c.finishes("gang")
        assert end.outcome == "succeeded"
        assert len(c.starts("gang")) == 2


async def test_gang_rank_failure_stops_the_others(nats_server, js, cluster, tmp_path) -> None:
    """A rank that fails ends the gang failed at once; the other rank is stopped."""
    code = """
    import os, sys, time
    if os.environ["RANK"] == "1":
        sys.exit(7)
    time.sleep(120)
    """
    async with cluster_of(nats_server, js, cluster, tmp_path, nodes=2) as c:
        await c.op.publish_input(job("g", py(code), gpus=4))
        await c.until(lambda: c.status("g") == "failed", "the gang failed")
        (end,) = c.finishes("g")
        assert end.exit_code == 7
        rank0 = next(n for n in ("h0", "h1") if n != end.actor.removeprefix("agent:"))
        (attempt,) = c.attempt_dirs(rank0, "g")
        await c.until(lambda: (attempt / "exit").exists(), "rank 0 stopped")
        assert json.loads((attempt / "exit").read_text())["exit_code"] == -signal.SIGTERM


MARKER_JOB = """
import os, signal, sys, time
ck = os.environ["APPORTION_CHECKPOINT_DIR"]
attempt = os.environ["APPORTION_ATTEMPT"]
def mark(text):
    with open(os.path.join(ck, "marks"), "a") as f:
        f.write(f"{attempt} {text}\\n")
def alive(pid):
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
owner = os.path.join(ck, "owner")
prev = int(open(owner).read()) if os.path.exists(owner) else None
mark(f"start previous-alive={prev is not None and alive(prev)}")
with open(owner, "w") as f:
    f.write(str(os.getpid()))
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
n = 0
while not stop:
    mark(f"write {n}")
    n += 1
    time.sleep(0.05)
mark("checkpoint")
sys.exit(143)
"""
"""Writes its attempt's markers into the checkpoint folder (the same for every attempt)
until SIGTERM; at its start, whether the previous attempt's process is still alive
(every agent of these tests runs on this host)."""


def assert_one_attempt_at_a_time(marks: Path) -> None:
    """Every marker of attempt 1 was written before the first of attempt 2, and attempt
    2 found attempt 1's process gone: the two never wrote the folder at once."""
    lines = marks.read_text().splitlines()
    attempts = [int(line.split()[0]) for line in lines]
    assert attempts == sorted(attempts), lines
    first2 = attempts.index(2)
    assert lines[first2] == "2 start previous-alive=False", lines[first2 - 2 : first2 + 2]
    # attempt 1 ended by its checkpoint after SIGTERM, or (a very slow machine) by the
    # SIGKILL at the end of the fence's notice
    assert lines[first2 - 1].startswith("1 "), lines[first2 - 2 : first2 + 2]


class Proxy:
    """A TCP proxy in front of the nats-server: ``partition()`` cuts every connection
    through it and refuses new ones (the agent behind it stays alive but cannot
    reach the bus); ``heal()`` lets connections through again."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.cut = False
        self.links: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self.links += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def partition(self) -> None:
        self.cut = True
        for w in self.links:
            w.transport.abort()
        self.links.clear()

    def heal(self) -> None:
        self.cut = False

    async def close(self) -> None:
        self.partition()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_partitioned_agent_fences_its_run_before_the_requeue(
    nats_server, js, cluster, tmp_path
) -> None:
    """An agent alive but cut off from the bus (its connection through a proxy that
    stops passing anything) stops its run on its own (the fence: notice, SIGTERM,
    the job checkpoints) before the scheduler marks its host down and the run is
    started elsewhere: the two attempts never write the checkpoint folder at once.
    Healed, the agent brings its host back; attempt 2 runs on."""
    port = int(nats_server.url.rsplit(":", 1)[1])  # the agent's proxy: its credential added
    proxy = Proxy(port)
    await proxy.start()
    try:
        async with cluster_of(
            nats_server, js, cluster, tmp_path, nodes=0, heartbeat_timeout_ms=6_000
        ) as c:
            c.start_agent("h0", url=proxy.url)
            await c.until(lambda: "h0" in c.state.nodes, "h0 registered")
            await c.op.publish_input(job("long", py(MARKER_JOB), gpus=2))
            marks = c.checkpoint("long") / "marks"
            await c.until(lambda: marks.exists(), "the job started on h0")
            c.start_agent("h1")
            await c.until(lambda: "h1" in c.state.nodes, "h1 registered")
            proxy.partition()
            await c.until(lambda: c.state.nodes["h0"].health == "down", "h0 marked down")
            await c.until(
                lambda: any(s.attempt == 2 and s.node == "h1" for s in c.starts("long")),
                "the job restarted on h1",
            )
            await c.until(lambda: "2 write 3" in marks.read_text(), "attempt 2 writing")
            assert c.agents["h0"].poll() is None  # alive all along: it fenced itself
            (fenced,) = c.attempt_dirs("h0", "long")
            assert json.loads((fenced / "exit").read_text())["exit_code"] in (143, -9)
            notice = json.loads((fenced / "preempt-notice").read_text())
            assert notice["reason"].startswith("fenced: ")
            assert notice["grace_ms"] == 600  # N for H = 6 s
            assert "fence" in (fenced / "output.log").read_text()
            assert_one_attempt_at_a_time(marks)
            proxy.heal()
            await c.until(lambda: c.state.nodes["h0"].health == "healthy", "h0 back")
            await c.until(lambda: (fenced / "reported").exists(), "the fenced attempt settled")
            await c.settle()
            # cut off, the agent still took attempt 1 for the current run: a report it
            # made then arrives stale and changes nothing
            assert [e.attempt for e in c.finishes("long")] in ([], [1])
            assert c.state.running["long"].attempt == 2
    finally:
        await proxy.close()


async def test_killed_agent_fences_its_run_before_the_requeue(
    nats_server, js, cluster, tmp_path
) -> None:
    """An agent killed (SIGKILL): its run does not outlive it unfenced: the run's
    supervisor stops it (notice, then SIGKILL) once the agent's lease runs out, before
    the scheduler marks the node down and the run is requeued elsewhere (the history's
    1.5 s timeout is read as 5 s: the smallest that leaves time to fence). The agent
    started again reports nothing for the old attempt and brings its node back."""
    async with cluster_of(
        nats_server, js, cluster, tmp_path, nodes=2, heartbeat_timeout_ms=1500
    ) as c:
        await c.op.publish_input(job("long", py(MARKER_JOB), gpus=2, min_runtime_ms=0))
        marks = c.checkpoint("long") / "marks"
        await c.until(lambda: len(c.starts("long")) == 1 and marks.exists(), "the job started")
        (first,) = c.node_of("long")
        other = next(n for n in ("h0", "h1") if n != first)
        c.kill_agent(first)
        (orphan,) = c.attempt_dirs(first, "long")
        await c.until(lambda: (orphan / "exit").exists(), "the orphan fenced by its supervisor")
        await c.until(lambda: c.state.nodes[first].health == "down", "the node marked down")
        downs = [e for e in c.inputs if isinstance(e, NodeHealthChanged) and e.state == "down"]
        assert [(e.node, e.actor) for e in downs] == [(first, "scheduler")]
        await c.until(
            lambda: any(s.attempt == 2 and s.node == other for s in c.starts("long")),
            "the job restarted on the other node",
        )
        await c.until(lambda: "2 write 3" in marks.read_text(), "attempt 2 writing")
        assert json.loads((orphan / "exit").read_text())["exit_code"] in (143, -9)
        assert "fence" in (orphan / "output.log").read_text()
        assert_one_attempt_at_a_time(marks)
        c.start_agent(first)
        await c.until(lambda: (orphan / "reported").exists(), "the orphan settled")
        await c.until(lambda: c.state.nodes[first].health == "healthy", "the node back")
        await c.settle()
        assert c.finishes("long") == []
        assert c.state.running["long"].attempt == 2


async def test_a_host_silent_before_the_scheduler_started_is_marked_down(
    nats_server, js, cluster, tmp_path
) -> None:
    """A host registered by an operator that never heartbeats (its agent died before
    this scheduler started): the scheduler marks it down one timeout later."""
    async with cluster_of(
        nats_server, js, cluster, tmp_path, nodes=1, heartbeat_timeout_ms=1500
    ) as c:
        await c.op.publish_input(
            NodeRegistered(
                id="silent", at_ms=0, node="silent", gpus=2, gpu_type="h100", actor="ops"
            )
        )
        await c.until(lambda: "silent" in c.state.nodes, "the silent host registered")
        await c.until(lambda: c.state.nodes["silent"].health == "down", "the silent host down")
        downs = [e for e in c.inputs if isinstance(e, NodeHealthChanged) and e.state == "down"]
        assert [(e.node, e.actor) for e in downs] == [("silent", "scheduler")]
        assert c.state.nodes["h0"].health == "healthy"  # its agent heartbeats


async def test_restarted_agent_starts_nothing_twice(nats_server, js, cluster, tmp_path) -> None:
    """An agent killed and started again re-adopts the run still going, reports the one
    that ended meanwhile, and starts neither again: one start, one report each."""
    code = """
    import os, sys, time
    with open(os.path.join(os.environ["APPORTION_CHECKPOINT_DIR"], "starts"), "a") as f:
        f.write("start\\n")
    gate = os.path.join(os.environ["APPORTION_CHECKPOINT_DIR"], "go")
    while not os.path.exists(gate):
        time.sleep(0.02)
    sys.exit(int(sys.argv[1]))
    """
    async with cluster_of(nats_server, js, cluster, tmp_path, nodes=1) as c:
        await c.op.publish_inputs([job("a", py(code, "0")), job("b", py(code, "5"))])
        await c.until(
            lambda: all((c.checkpoint(w) / "starts").exists() for w in "ab"), "both started"
        )
        c.kill_agent("h0")
        (c.checkpoint("b") / "go").touch()
        (b_attempt,) = c.attempt_dirs("h0", "b")
        await c.until(lambda: (b_attempt / "exit").exists(), "b ended while the agent was down")
        c.start_agent("h0")
        await c.until(lambda: c.status("b") == "failed", "b reported after the restart")
        (c.checkpoint("a") / "go").touch()
        await c.until(lambda: c.status("a") == "succeeded", "a reported by the new agent")
        await c.settle()
        for w in "ab":
            assert (c.checkpoint(w) / "starts").read_text() == "start\n", w
            assert len(c.finishes(w)) == 1, w
        assert c.finishes("b")[0].exit_code == 5


async def test_failing_health_probe_drains_then_downs(nats_server, js, cluster, tmp_path) -> None:
    """--health-command failing: the agent sets its host draining, then down; passing
    again, healthy. Each change is the agent's own (``agent:<node>``)."""
    sick = tmp_path / "sick"
    args = (
        "--health-command",
        f"test ! -e {sick}",
        "--health-interval",
        "0.1",
        "--drain-after",
        "2",
        "--down-after",
        "4",
    )
    async with cluster_of(nats_server, js, cluster, tmp_path, nodes=1, args=args) as c:
        sick.touch()
        await c.until(lambda: c.state.nodes["h0"].health == "down", "the host down")
        sick.unlink()
        await c.until(lambda: c.state.nodes["h0"].health == "healthy", "the host healthy")
        changes = [(e.state, e.actor) for e in c.inputs if isinstance(e, NodeHealthChanged)]
        assert changes == [
            ("draining", "agent:h0"),
            ("down", "agent:h0"),
            ("healthy", "agent:h0"),
        ]


async def test_cancel_stops_the_run_and_sigkills_after_the_notice(
    nats_server, js, cluster, tmp_path
) -> None:
    """A cancelled run gets SIGTERM; one that ignores it gets SIGKILL when its notice
    ends; neither is reported (the cancel ended them)."""
    stubborn = """
    import os, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(os.environ["APPORTION_CHECKPOINT_DIR"], "up"), "w").close()
    time.sleep(120)
    """
    from apportion.schemas.events import WorkloadCancelled

    async with cluster_of(nats_server, js, cluster, tmp_path, nodes=1) as c:
        await c.op.publish_inputs(
            [
                job("polite", py("import time; time.sleep(120)")),
                job("stubborn", py(stubborn), grace_ms=500),
            ]
        )
        await c.until(
            lambda: len(c.starts("polite")) == 1 and (c.checkpoint("stubborn") / "up").exists(),
            "both running",
        )
        await c.op.publish_inputs(
            [
                WorkloadCancelled(id=f"cancel-{w}", at_ms=0, workload=w, actor="ops")
                for w in ("polite", "stubborn")
            ]
        )
        dirs = {w: c.attempt_dirs("h0", w)[0] for w in ("polite", "stubborn")}
        await c.until(lambda: all((d / "reported").exists() for d in dirs.values()), "both stopped")
        await c.settle()
        codes = {w: json.loads((d / "exit").read_text())["exit_code"] for w, d in dirs.items()}
        assert codes == {"polite": -signal.SIGTERM, "stubborn": -signal.SIGKILL}
        assert c.finishes("polite") == c.finishes("stubborn") == []
        assert (dirs["stubborn"] / "preempt-notice").exists()
