"""``apportion slurm`` against a real Slurm 22.05 (slurmctld + 3 slurmd with fake GPUs on
this machine: tests/services/slurm_cluster.py), a real nats-server and a real scheduler.

Skips with the reason where Slurm cannot run (not root, not installed: ``make test``
installs it when root). No timed assertions: every wait is for a condition, with a
bounded deadline that fails the test with what it waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from apportion.schemas.events import (
    BudgetSet,
    NodeHealthChanged,
    PolicySet,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadStarted,
    WorkloadSubmitted,
)
from apportion.schemas.history import BatchItem, InputItem
from apportion.services.bus import JetStreamLog
from apportion.services.canonical import Follower
from apportion.services.natsconf import SLURM
from apportion.services.runner import supervise_scheduler
from apportion.services.scheduler import Scheduler
from apportion.services.slurm import SlurmBridge
from apportion.services.slurm_jobs import SlurmCli, exit_code_of, parse_jobcomp
from services_helpers import APPORTION_CMD
from slurm_cluster import SlurmCluster, skip_reason

pytestmark = pytest.mark.nats


@pytest.fixture(scope="session")
def slurm_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3, gpus=4)
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm(slurm_session: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's Slurm, with no job left from another test."""
    slurm_session.clean()
    yield slurm_session
    slurm_session.clean()


def tree(grace_ms: int = 0) -> list[Any]:
    """root (ops) -> lab (owned by root, the Slurm user here) -> lab/a, lab/b."""
    return [
        BudgetSet(id="b-root", at_ms=0, path="", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b-lab", at_ms=0, path="lab", weight=1, owner="root", actor="ops"),
        BudgetSet(id="b-lab-a", at_ms=0, path="lab/a", weight=1, owner="root", actor="root"),
        BudgetSet(id="b-lab-b", at_ms=0, path="lab/b", weight=1, owner="root", actor="root"),
        PolicySet(id="policy", at_ms=0, actor="ops", preemption_margin_ppm=0, grace_ms=grace_ms),
    ]


class Harness:
    """A scheduler (in this process), the bridge (in this process or as ``apportion
    slurm``), and a follower of the history."""

    def __init__(self, log: JetStreamLog, slurm: SlurmCluster, url: str, work: Path) -> None:
        self.log = log
        self.slurm = slurm
        self.url = url
        self.work = work
        self.follower = Follower(log)
        self.inputs: list[Any] = []
        self.decisions: list[Any] = []
        self.bridge: SlurmBridge | None = None
        self.bridge_task: asyncio.Task[None] | None = None
        self.bridge_stop = asyncio.Event()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def state(self) -> Any:
        return self.follower.state

    def wid(self, job: int) -> str:
        return f"slurm-{self.slurm.name}-{job}"

    # -- the bridge --------------------------------------------------------
    async def start_bridge(self) -> None:
        self.bridge_stop = asyncio.Event()
        self.bridge = SlurmBridge(
            self.log, partitions=["gpu"], cli=SlurmCli(self.slurm.env), interval_s=0.1
        )
        self.bridge_task = asyncio.create_task(self.bridge.run(self.bridge_stop))
        await asyncio.wait_for(self.bridge.ready.wait(), 30)

    async def stop_bridge(self) -> None:
        self.bridge_stop.set()
        if self.bridge_task is not None:
            await self.bridge_task
            self.bridge_task = None

    def start_process(self) -> None:
        """``apportion slurm`` as a process (``kill_process`` kills it)."""
        err = open(self.work / "slurm-bridge.log", "ab")  # noqa: SIM115 - kept by the process
        self.proc = subprocess.Popen(
            [
                *APPORTION_CMD,
                "slurm",
                "--cluster-name",
                self.log.subjects.cluster,
                "--nats",
                self.url,
                "--partition",
                "gpu",
                "--interval",
                "0.1",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=self.slurm.env,
        )
        err.close()

    def kill_process(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(30)
        self.proc = None

    # -- the history ---------------------------------------------------------
    async def sync(self) -> None:
        for item in await self.follower.poll(0.05):
            if isinstance(item, InputItem) and item.event is not None:
                self.inputs.append(item.event)
            elif isinstance(item, BatchItem):
                self.decisions.extend(item.batch.decisions)

    async def until(self, check: Callable[[], bool], what: str, timeout: float = 45.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await self.sync()
            if check():
                return
            if self.bridge_task is not None and self.bridge_task.done():
                self.bridge_task.result()  # raises what stopped it
                raise AssertionError("the bridge stopped")
            if self.proc is not None and self.proc.poll() is not None:
                log = (self.work / "slurm-bridge.log").read_text()[-3000:]
                raise AssertionError(f"apportion slurm exited ({self.proc.returncode}):\n{log}")
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.slurm.run('squeue')}")
            await asyncio.sleep(0.05)

    async def until_job(
        self, job: int, check: Callable[[dict[str, Any]], bool], what: str, timeout: float = 45.0
    ) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        def ok() -> bool:
            seen.update(self.slurm.job(job))
            return check(seen)

        await self.until(ok, f"job {job}: {what}", timeout)
        return seen

    def finishes(self, wid: str) -> list[WorkloadFinished]:
        return [e for e in self.inputs if isinstance(e, WorkloadFinished) and e.workload == wid]

    def placements(self, wid: str) -> list[WorkloadPlaced]:
        return [d for d in self.decisions if isinstance(d, WorkloadPlaced) and d.workload == wid]

    def submissions(self, wid: str) -> list[WorkloadSubmitted]:
        return [e for e in self.inputs if isinstance(e, WorkloadSubmitted) and e.workload == wid]


@contextlib.asynccontextmanager
async def harness(
    nats_server: Any,
    jlog: JetStreamLog,
    log_as: Any,
    slurm: SlurmCluster,
    work: Path,
    grace_ms: int = 0,
    bridge: bool = True,
) -> AsyncIterator[Harness]:
    """Each part as its production user: the scheduler (``jlog``, in this process),
    the operator who publishes the tree, and the bridge as the ``slurm`` user (in
    this process, its nodes registered; ``bridge=False``: no bridge yet)."""
    await asyncio.wait_for((await log_as("operator")).publish_inputs(tree(grace_ms)), 30)
    stop = asyncio.Event()
    task = asyncio.create_task(supervise_scheduler(Scheduler(jlog), stop))
    h = Harness(await log_as(SLURM), slurm, nats_server.url_as(SLURM), work)
    try:
        if bridge:
            await h.start_bridge()
            await nodes_registered(h)
        yield h
    finally:
        if h.proc is not None:
            h.kill_process(signal.SIGTERM)
        await h.stop_bridge()
        stop.set()
        await task
        await h.follower.close()


async def nodes_registered(h: Harness) -> None:
    await h.until(
        lambda: (
            sorted(h.state.nodes) == h.slurm.nodes
            and all(n.gpus == 4 and n.gpu_type == "fake" for n in h.state.nodes.values())
        ),
        "Slurm's nodes registered with their 4 fake GPUs",
    )


ENV_SCRIPT = (
    'echo "node=$SLURMD_NODENAME cuda=$CUDA_VISIBLE_DEVICES list=$SLURM_JOB_NODELIST '
    'restart=${SLURM_RESTART_COUNT:-0}"\n'
)


async def test_held_job_runs_on_the_decided_node_and_reports_its_exit(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    async with harness(nats_server, jlog, log_as, slurm, tmp_path) as h:
        # a 1-GPU job first: the scheduler's best fit then sends a 4-GPU job elsewhere
        small = slurm.sbatch(
            "--gres=gpu:1", "--account=lab.b", "--time=30", script=ENV_SCRIPT + "sleep 20\n"
        )
        await h.until(lambda: h.state.status_of(h.wid(small)) == "running", "small placed")
        big = slurm.sbatch(
            "--gres=gpu:fake:4",
            "--account=lab.a",
            "--time=30",
            "--time-min=5",
            "--nice=0",
            script=ENV_SCRIPT + "sleep 1\nexit 3\n",
        )
        wid = h.wid(big)
        await h.until(lambda: bool(h.finishes(wid)), f"{wid} finished")
        [sub] = h.submissions(wid)
        assert (sub.owner, sub.gpus, sub.gpu_type, sub.min_runtime_ms, sub.submitted_by) == (
            "lab/a",
            4,
            "fake",
            5 * 60_000,
            "root",
        )
        [placed] = h.placements(wid)
        [node] = [s.node for s in placed.placement]
        assert node != h.placements(h.wid(small))[0].placement[0].node
        job = slurm.job(big)
        assert job["nodes"] == node
        assert job["time_limit"] == 30  # --time-min did not cut it (backfill's trap)
        assert f"node={node} cuda=0,1,2,3 list={node}" in slurm.output(big)
        [fin] = h.finishes(wid)
        assert (fin.outcome, fin.exit_code, fin.attempt) == ("failed", 3, 1)
        started = [e for e in h.inputs if isinstance(e, WorkloadStarted) and e.workload == wid]
        assert [(e.node, e.attempt, e.actor) for e in started] == [(node, 1, f"agent:{node}")]
        assert h.state.status_of(wid) == "failed"
        assert job["comment"].startswith(f"apportion: {wid} attempt 1 run 0 on {node}")
        # Slurm's own completion log tells the same end (read once squeue forgets a job)
        with (slurm.root / "jobcomp.log").open() as lines:
            ended = parse_jobcomp(lines, big)
        assert ended is not None and (ended.job_state, exit_code_of(ended.exit_code)) == (
            "FAILED",
            3,
        )


async def test_two_node_gang_runs_on_both_decided_nodes(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    async with harness(nats_server, jlog, log_as, slurm, tmp_path) as h:
        job = slurm.sbatch(
            "--nodes=2",
            "--gres=gpu:4",
            "--account=lab.a",
            "--time-min=1",
            script=ENV_SCRIPT + "srun hostname >/dev/null\nsleep 1\n",
        )
        wid = h.wid(job)
        await h.until(lambda: bool(h.finishes(wid)), f"{wid} finished")
        [placed] = h.placements(wid)
        nodes = [s.node for s in placed.placement]
        assert [s.gpus for s in placed.placement] == [4, 4]
        info = slurm.job(job)
        assert info["job_state"] == "COMPLETED"
        assert sorted(slurm.run("scontrol", "show", "hostnames", info["nodes"]).split()) == sorted(
            nodes
        )
        assert "cuda=0,1,2,3" in slurm.output(job)
        [fin] = h.finishes(wid)
        assert (fin.outcome, fin.exit_code) == ("succeeded", 0)
        assert fin.actor == f"agent:{nodes[0]}"


async def test_unmappable_jobs_stay_held_with_a_reason_then_enter_once_mapped(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    async with harness(nats_server, jlog, log_as, slurm, tmp_path) as h:
        unknown = slurm.sbatch("--gres=gpu:1", "--account=vision")
        gang = slurm.sbatch("--nodes=2", "--gres=gpu:1", "--account=lab.a")
        nogpu = slurm.sbatch("--account=lab.a")
        over = slurm.sbatch("--gres=gpu:1", "--account=lab.a", "--time-min=600")
        expect = {
            unknown: "unknown owner 'vision'",
            gang: "not a valid gang: 2 nodes x 1 GPUs",
            nogpu: "no GPUs asked",
            over: "min_runtime must be between 0 and 8 h",
        }
        for job, text in expect.items():
            got = await h.until_job(job, lambda j, t=text: t in j["comment"], f"comment {text!r}")
            assert got["job_state"] == "PENDING" and got["priority"] == 0  # still held
            assert got["comment"].startswith("apportion: held: ")
        await h.sync()
        assert not any(h.submissions(h.wid(j)) for j in expect)
        # nothing lost: once the budget has the leaf, the held job enters
        await (await log_as("operator")).publish_input(
            BudgetSet(id="b-vision", at_ms=0, path="vision", weight=1, owner="root", actor="ops")
        )
        wid = h.wid(unknown)
        await h.until(lambda: bool(h.finishes(wid)), f"{wid} entered, ran and finished")
        assert [s.owner for s in h.submissions(wid)] == ["vision"]


async def test_scancel_of_a_running_and_of_a_pending_job(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    async with harness(nats_server, jlog, log_as, slurm, tmp_path) as h:
        full = slurm.sbatch("--nodes=3", "--gres=gpu:4", "--account=lab.a", "--time-min=10",
                            script="sleep 300\n")  # fmt: skip
        await h.until_job(full, lambda j: j["job_state"] == "RUNNING", "running")
        waiting = slurm.sbatch("--gres=gpu:1", "--account=lab.b", "--time-min=1")
        wait_id = h.wid(waiting)
        await h.until(lambda: h.state.status_of(wait_id) == "pending", f"{wait_id} pending")
        slurm.run("scancel", str(waiting))
        await h.until(lambda: h.state.status_of(wait_id) == "cancelled", f"{wait_id} cancelled")
        [cancel] = [e for e in h.inputs if isinstance(e, WorkloadCancelled)]
        assert (cancel.workload, cancel.actor) == (wait_id, "root")
        slurm.run("scancel", str(full))
        wid = h.wid(full)
        await h.until(lambda: bool(h.finishes(wid)), f"{wid} finished")
        # the report is not repeated however many rounds see the CANCELLED job,
        # by this bridge or by a new one
        await h.stop_bridge()
        await h.start_bridge()
        bridge = h.bridge
        assert bridge is not None
        await h.until(lambda: bridge._rounds >= 10, "10 rounds of a new bridge")
        last = await h.log.last_input_seq()
        await h.until(lambda: h.state.input_seq >= last, "all inputs folded")
        [fin] = h.finishes(wid)
        assert (fin.outcome, fin.exit_code) == ("failed", -15)
        assert h.state.status_of(wid) == "failed"


async def test_cancel_through_apportion_cancels_the_slurm_job(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    async with harness(nats_server, jlog, log_as, slurm, tmp_path) as h:
        job = slurm.sbatch("--gres=gpu:2", "--account=lab.a", script="sleep 300\n")
        wid = h.wid(job)
        await h.until_job(job, lambda j: j["job_state"] == "RUNNING", "running")
        gateway = await log_as("gateway")  # a cancel through apportion's API
        await gateway.publish_input(WorkloadCancelled(id="c1", at_ms=0, workload=wid, actor="root"))
        await h.until_job(job, lambda j: j["job_state"] == "CANCELLED", "cancelled in Slurm")
        await h.sync()
        assert h.state.status_of(wid) == "cancelled"
        assert not h.finishes(wid)  # the run ended by the cancel: nothing to report


async def test_a_workload_whose_job_is_gone_from_slurm_is_cancelled(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    """A job purged from ``squeue`` (``MinJobAge``) while the bridge was away: its
    workload does not wait (nor hold GPUs) for it forever: cancelled while pending,
    its run reported lost once placed (whichever the bridge sees first)."""
    async with harness(nats_server, jlog, log_as, slurm, tmp_path) as h:
        wid = h.wid(999_999)
        await (await log_as("gateway")).publish_input(
            WorkloadSubmitted(
                id="gone", at_ms=0, workload=wid, owner="lab/a", gpus=1, min_runtime_ms=0,
                submitted_by="root",
            )
        )  # fmt: skip
        await h.until(lambda: h.state.status_of(wid) in ("cancelled", "failed"), f"{wid} ended")
        cancels = [e for e in h.inputs if isinstance(e, WorkloadCancelled)]
        if h.state.status_of(wid) == "cancelled":
            assert [(c.workload, c.actor) for c in cancels] == [(wid, "root")]
        else:
            [fin] = h.finishes(wid)
            assert (fin.outcome, fin.exit_code, cancels) == ("failed", None, [])


async def test_drain_in_slurm_and_drain_by_apportion(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    async with harness(nats_server, jlog, log_as, slurm, tmp_path) as h:
        health = lambda n: h.state.nodes[n].health  # noqa: E731
        # an admin drains a node in Slurm: apportion places nothing there
        slurm.run("scontrol", "update", "NodeName=sn2", "State=DRAIN", "Reason=bad fan")
        await h.until(lambda: health("sn2") == "draining", "sn2 draining in apportion")
        changes = [e for e in h.inputs if isinstance(e, NodeHealthChanged)]
        assert [(c.node, c.state, c.actor) for c in changes] == [("sn2", "draining", "agent:sn2")]
        slurm.run("scontrol", "update", "NodeName=sn2", "State=RESUME")
        await h.until(lambda: health("sn2") == "healthy", "sn2 healthy again")
        # an operator drains a node in apportion: Slurm shows it, with the reason
        operator = await log_as("operator")
        await operator.publish_input(
            NodeHealthChanged(id="d1", at_ms=0, node="sn1", state="draining", actor="ops")
        )

        def slurm_node(name: str) -> str:
            return slurm.run("scontrol", "show", "node", "-o", name)

        await h.until(
            lambda: (
                "DRAIN" in slurm_node("sn1")
                and "Reason=apportion: draining (set by ops)" in slurm_node("sn1")
            ),
            "sn1 drained in Slurm by apportion",
        )
        await operator.publish_input(
            NodeHealthChanged(id="d2", at_ms=0, node="sn1", state="healthy", actor="ops")
        )
        await h.until(lambda: "DRAIN" not in slurm_node("sn1"), "sn1 resumed in Slurm")
        await h.sync()
        assert health("sn1") == "healthy"


@pytest.mark.slow
async def test_a_node_down_in_slurm_is_down_in_apportion_and_its_run_lost(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    """A node Slurm sets DOWN under a running job: the node goes ``down`` in
    apportion, the run is reported lost, the resumable workload runs again
    elsewhere; the node back in Slurm is healthy again."""
    async with harness(nats_server, jlog, log_as, slurm, tmp_path) as h:
        job = slurm.sbatch("--gres=gpu:4", "--account=lab.a", script="sleep 30\n")
        wid = h.wid(job)
        await h.until_job(job, lambda j: j["job_state"] == "RUNNING", "running")
        [first] = h.placements(wid)
        node = first.placement[0].node
        slurm.stop_node(node)  # a host whose daemon is gone: Slurm cannot bring it back
        slurm.run("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=psu")
        await h.until(lambda: h.state.nodes[node].health == "down", f"{node} down in apportion")
        await h.until(lambda: len(h.placements(wid)) == 2, f"{wid} placed again")
        await h.until(lambda: len(h.placements(wid)) == 2, f"{wid} placed again")
        assert not h.finishes(wid)  # not a failure of the job: requeued
        [preempted] = [d for d in h.decisions if isinstance(d, WorkloadPreempted)]
        # the node goes draining, then down: a free run is preempted at the first
        assert (preempted.workload, preempted.reason, preempted.requeued) == (wid, "drain", True)
        second = h.placements(wid)[1].placement[0].node
        assert second != node
        await h.until_job(
            job, lambda j: j["job_state"] == "RUNNING" and j["nodes"] == second, "running again"
        )
        slurm.start_node(node)  # ReturnToService=2: back in service once it registers
        await h.until(lambda: h.state.nodes[node].health == "healthy", f"{node} healthy again")


async def test_a_job_released_by_hand_is_requeued_held_then_placed(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    async with harness(nats_server, jlog, log_as, slurm, tmp_path) as h:
        job = slurm.sbatch("--gres=gpu:1", "--account=lab.a", "--open-mode=append",
                           script=ENV_SCRIPT + "sleep 2\n")  # fmt: skip
        wid = h.wid(job)
        held = await h.until_job(job, lambda j: j["state_reason"] == "JobHeldAdmin", "admin hold")
        assert held["job_state"] == "PENDING"
        await h.stop_bridge()
        # the bridge is away: its job is released by hand (an admin) and starts
        slurm.run("scontrol", "release", str(job))
        await h.until_job(job, lambda j: j["job_state"] == "RUNNING", "running outside")
        await h.start_bridge()
        await h.until(lambda: bool(h.finishes(wid)), f"{wid} placed by apportion and finished")
        info = slurm.job(job)
        assert info["restart_cnt"] == 1  # requeued held once, then released by the bridge
        [placed] = h.placements(wid)
        assert info["nodes"] == placed.placement[0].node
        assert [f.outcome for f in h.finishes(wid)] == ["succeeded"]


@pytest.mark.slow
async def test_a_job_aged_out_of_squeue_while_the_bridge_was_away_keeps_its_exit_code(
    nats_server, jlog, log_as, tmp_path
) -> None:
    """A job that ended and left ``squeue`` (``MinJobAge``, here 2 s) while the
    bridge was stopped: its end is read from Slurm's completion log, exit code
    and all, not reported lost."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    (tmp_path / "aged").mkdir()
    aged = SlurmCluster(tmp_path / "aged", nodes=1, prefix="sa", name="aged", min_job_age_s=2)
    try:
        aged.start()
        async with harness(nats_server, jlog, log_as, aged, tmp_path) as h:
            job = aged.sbatch("--gres=gpu:1", "--account=lab.a", script="sleep 2\nexit 3\n")
            wid = h.wid(job)
            await h.until(lambda: h.state.status_of(wid) == "running", f"{wid} running")
            await h.stop_bridge()
            for _ in range(1200):  # slurmctld purges old jobs about once a minute
                if str(job) not in aged.run("squeue", "-h", "-o", "%i", check=False).split():
                    break
                await asyncio.sleep(0.25)
            else:
                raise AssertionError(f"job {job} still in squeue after 300 s")
            await h.sync()
            assert h.state.status_of(wid) == "running"  # nobody has reported it
            await h.start_bridge()
            await h.until(lambda: bool(h.finishes(wid)), f"{wid} finished")
            [fin] = h.finishes(wid)
            assert (fin.outcome, fin.exit_code) == ("failed", 3)
    finally:
        aged.stop()


@pytest.mark.slow
async def test_bridge_killed_mid_flight_starts_nothing_twice(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    async with harness(nats_server, jlog, log_as, slurm, tmp_path, bridge=False) as h:
        h.start_process()
        await nodes_registered(h)
        first = slurm.sbatch(
            "--gres=gpu:4", "--account=lab.a", script='echo "start $SLURM_JOB_ID"\nsleep 6\n'
        )
        await h.until_job(first, lambda j: j["job_state"] == "RUNNING", "running")
        h.kill_process()
        # while the bridge is away: a second job arrives, the first one ends
        second = slurm.sbatch(
            "--gres=gpu:4", "--account=lab.b", script='echo "start $SLURM_JOB_ID"\nsleep 1\n'
        )
        await h.until_job(first, lambda j: j["job_state"] == "COMPLETED", "completed")
        await h.sync()
        assert h.state.status_of(h.wid(first)) == "running"  # nobody reported it yet
        h.start_process()
        for job in (first, second):
            await h.until(lambda j=job: bool(h.finishes(h.wid(j))), f"{job} finished")
        # and a second restart changes nothing
        h.kill_process()
        h.start_process()
        third = slurm.sbatch("--gres=gpu:1", "--account=lab.a", script="sleep 1\n")
        await h.until(lambda: bool(h.finishes(h.wid(third))), "the third job finished")
        for job in (first, second):
            wid = h.wid(job)
            assert len(h.finishes(wid)) == 1
            assert len(h.placements(wid)) == 1
            assert slurm.job(job)["restart_cnt"] == 0
            assert slurm.output(job).count("start") == 1


async def test_bridge_under_the_accounts_of_production(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    """The bridge's own NATS user (``apportion nats-config --slurm``): it submits,
    registers, reports ends on the nodes' subjects (every test here runs it so); it
    cannot set the policy, edit the budget or write decisions."""
    import nats.errors

    if not nats_server.secured:
        pytest.skip("an outside server (NATS_URL) has no users")
    async with harness(nats_server, jlog, log_as, slurm, tmp_path) as h:
        job = slurm.sbatch("--gres=gpu:2", "--account=lab.a", script="sleep 1\n")
        wid = h.wid(job)
        await h.until(lambda: bool(h.finishes(wid)), f"{wid} finished")
        [fin] = h.finishes(wid)
        assert fin.outcome == "succeeded"
        for bad in (
            PolicySet(id="p-bad", at_ms=0, actor="ops", grace_ms=1),
            BudgetSet(id="b-bad", at_ms=0, path="x", weight=1, owner="root", actor="ops"),
        ):
            with pytest.raises((TimeoutError, nats.errors.Error)):  # no ack: dropped
                await asyncio.wait_for(h.log.publish_input(bad), 3)
        nc = h.log.nc
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await nc.request(f"apportion.{h.log.subjects.cluster}.decisions", b"{}", timeout=0.5)


CHECKPOINTING = """\
ck={out}/ckpt-$SLURM_JOB_ID
step=$(cat $ck 2>/dev/null || echo 0)
echo "start restart=${{SLURM_RESTART_COUNT:-0}} step=$step"
trap 'echo $step > $ck; echo "term at $step"; exit 143' TERM
while [ $step -lt {steps} ]; do sleep 0.5 & wait $!; step=$((step+1)); echo "step $step"; done
echo "done $step"
"""


@pytest.mark.slow
async def test_free_job_preempted_with_notice_requeued_held_and_resumed(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    async with harness(nats_server, jlog, log_as, slurm, tmp_path, grace_ms=5000) as h:
        script = CHECKPOINTING.format(out=slurm.out, steps=16)
        free = slurm.sbatch(
            "--nodes=3", "--gres=gpu:4", "--account=lab.b", "--open-mode=append", script=script
        )
        await h.until(lambda: "step 3" in slurm.output(free), "the free job made progress")
        urgent = slurm.sbatch("--gres=gpu:4", "--account=lab.a", "--time-min=1", script="sleep 2\n")
        free_id, urgent_id = h.wid(free), h.wid(urgent)
        await h.until(lambda: bool(h.finishes(urgent_id)), "the urgent job ran")
        await h.until(lambda: h.state.status_of(free_id) == "succeeded", "the free job resumed")
        out = slurm.output(free)
        starts = [x for x in out.splitlines() if x.startswith("start ")]
        assert len(starts) == 2 and "term at" in out and "done 16" in out
        assert "restart=1" in starts[1] and "step=0" not in starts[1]  # resumed from its checkpoint
        preempted = [
            d for d in h.decisions if isinstance(d, WorkloadPreempted) and d.workload == free_id
        ]
        assert [(p.requeued, p.for_workload, p.grace_ms) for p in preempted] == [
            (True, urgent_id, 5000)
        ]
        assert [(f.attempt, f.outcome, f.exit_code) for f in h.finishes(free_id)] == [
            (1, "failed", 143),
            (2, "succeeded", 0),
        ]
        assert len(h.placements(free_id)) == 2


@pytest.mark.slow
async def test_non_resumable_job_preempted_is_cancelled(
    nats_server, jlog, log_as, slurm, tmp_path
) -> None:
    async with harness(nats_server, jlog, log_as, slurm, tmp_path, grace_ms=0) as h:
        free = slurm.sbatch(
            "--nodes=3", "--gres=gpu:4", "--account=lab.b", "--no-requeue", script="sleep 300\n"
        )
        await h.until_job(free, lambda j: j["job_state"] == "RUNNING", "running")
        urgent = slurm.sbatch("--gres=gpu:4", "--account=lab.a", "--time-min=1")
        await h.until(lambda: bool(h.finishes(h.wid(urgent))), "the urgent job ran")
        assert h.state.status_of(h.wid(free)) == "preempted"
        assert slurm.job(free)["job_state"] == "CANCELLED"


UP_CLUSTER = """\
[cluster]
name = "uplab"

[[cluster.pool]]
prefix = "x"
count = 2
gpus_per_node = 4
gpu_type = "fake"

[budget]
owner = "ops"
[budget.lab]
weight = 1
owner = "root"
[budget.lab.a]
weight = 1
owner = "root"
"""


@pytest.mark.slow
async def test_up_with_slurm(slurm, tmp_path) -> None:
    """``apportion up --slurm gpu``: nats-server with the bridge's own user, the
    bridge instead of the emulator; the cluster file's nodes that Slurm does not
    have are marked down, Slurm's are registered, a held job runs."""
    import json
    import re
    import time

    (tmp_path / "c.toml").write_text(UP_CLUSTER)
    env = {k: v for k, v in slurm.env.items() if not k.startswith(("NATS_", "APPORTION_"))}
    err_path = tmp_path / "up.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [*APPORTION_CMD, "up", "--cluster", "c.toml", "--slurm", "gpu", "--port", "0"],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"gateway: (http://\S+)", err_path.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
            await asyncio.sleep(0.1)
        env = {**env, "APPORTION_URL": m.group(1)}
        env["APPORTION_TOKEN_FILE"] = str(tmp_path / ".apportion/credentials/ops.token")
        users = (tmp_path / ".apportion/credentials/nats-users.toml").read_text()
        assert '"slurm" = ' in users

        def nodes() -> dict[str, str]:
            out = subprocess.run(
                [*APPORTION_CMD, "nodes", "--json"], env=env, capture_output=True, text=True
            ).stdout
            try:
                return {n["node"]: n["state"] for n in json.loads(out)["nodes"]}
            except (ValueError, KeyError):
                return {}

        deadline = time.monotonic() + 60
        want = {"x000": "down", "x001": "down", **dict.fromkeys(slurm.nodes, "healthy")}
        while nodes() != want:
            assert time.monotonic() < deadline, (nodes(), err_path.read_text()[-2000:])
            await asyncio.sleep(0.3)
        job = slurm.sbatch("--gres=gpu:2", "--account=lab.a", script="sleep 1\n")
        deadline = time.monotonic() + 60
        while slurm.job(job)["job_state"] != "COMPLETED":
            assert time.monotonic() < deadline, slurm.job(job)
            await asyncio.sleep(0.2)
        assert slurm.job(job)["comment"].startswith(f"apportion: slurm-lab-{job} attempt 1")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
