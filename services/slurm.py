"""``apportion slurm``: the executor of a Slurm cluster (docs/slurm.md).

Slurm launches, confines and accounts; apportion decides who runs where and when.
The bridge follows the canonical history like the agent (a
:class:`~apportion.core.reconcile.Ledger` beside the folded state) and, once
caught up, runs a round every ``interval`` seconds:

1. **read Slurm**: ``squeue --json`` (the governed partitions' jobs) and, every
   few rounds, ``scontrol show node -o``;
2. **nodes**: register each governed node (``NodeRegistered`` as its agent,
   ``agent:<node>``: GPUs and type from its ``Gres``) and bring its health in
   line with Slurm's state (DRAIN -> ``draining``, DOWN/NOT_RESPONDING ->
   ``down``, back to ``healthy`` by the rule every executor follows);
3. **intake**: a pending job that is not held is held at once (the backstop of
   the submit rule); a held job apportion does not know becomes
   ``WorkloadSubmitted`` (:func:`~apportion.services.slurm_jobs.submission`; the
   same checks as the fold, asked first), or gets the reason in its ``Comment``
   and stays held; a job that ended in Slurm before it was placed becomes
   ``WorkloadCancelled`` (by its Slurm user); a held job whose workload ended in
   apportion (cancelled there) is cancelled in Slurm; a job whose run ended while
   its workload was requeued is requeued held;
4. **the reconcile** (:func:`~apportion.services.executor_port.reconcile_once`) on
   :class:`SlurmRuntime`: each placed run is pinned to exactly its nodes and
   released; a preempted run gets SIGTERM (script and steps), then ``scontrol
   requeuehold`` (resumable) or ``scancel`` once its notice ends; a run that is no
   longer current (cancelled in apportion) is cancelled;
5. **reports**: the end of a released run (COMPLETED, FAILED, CANCELLED, TIMEOUT,
   NODE_FAIL, ...) becomes ``WorkloadFinished`` with its exit code, once per
   attempt (``finished-<workload>-<attempt>``, as the agent of its first node).

Which attempt a Slurm job runs is written in its ``Comment`` when it is released
(:class:`~apportion.services.slurm_jobs.Claim`, with Slurm's restart count), so a
restarted bridge knows from Slurm itself what it released: it never releases an
attempt twice, and reports each end once (the history says which are reported).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Container, Iterable
from typing import Any

import msgspec
from apportion.core.reconcile import (
    DesiredRun,
    Ledger,
    RunKey,
    Stop,
    end_report,
    health_change,
    start_report_due,
    started_id,
)
from apportion.core.refusals import submission_refusal
from apportion.core.rules.authority import agent_of
from apportion.core.state import State
from apportion.schemas.events import (
    Input,
    NodeHealthChanged,
    NodeRegistered,
    Slot,
    WorkloadCancelled,
    WorkloadStarted,
)

from . import logs
from .bus import EventLog
from .canonical import Follower
from .executor_port import finished, reconcile_once
from .runner import is_transient
from .slurm_jobs import (
    COMMENT_PREFIX,
    LOST_STATES,
    REQUEUE_SETTLE_S,
    AccountMap,
    Claim,
    SlurmCli,
    SlurmError,
    SlurmJob,
    SlurmNode,
    claim_text,
    exit_code_of,
    parse_claim,
    partition_types,
    submission,
    workload_id,
)

PUBLISH_TIMEOUT_S = 10.0
APPORTION_REASON = "apportion: "
"""How a Slurm node drained by apportion's own decision reads (its ``Reason``)."""
NODES_EVERY = 10
"""Rounds between two reads of Slurm's nodes (after the first)."""


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class SlurmRuntime:
    """The executor port on Slurm jobs: every run once, as a whole job (``host = None``).

    ``jobs`` (workload -> its Slurm job) is refreshed by the bridge before each
    round. A run is *held* once the job's ``Comment`` claims its attempt and
    Slurm ran it: live while it runs, ended once it ended or was requeued."""

    host: str | None = None
    adopts_under_notice = False

    def __init__(
        self, cli: SlurmCli, state: State, ledger: Ledger, logger: Any, clock: Any
    ) -> None:
        self.cli = cli
        self.state = state
        self.ledger = ledger
        self.logger = logger
        self.clock = clock
        self.jobs: dict[str, SlurmJob] = {}
        self.released: set[RunKey] = set()
        """Runs released by this process (until Slurm shows them)."""
        self.deadlines: dict[RunKey, int] = {}
        """Runs being stopped -> when their notice ends (epoch ms)."""
        self.finals: set[RunKey] = set()
        """Runs whose stop was carried out (requeued held, or cancelled)."""

    def run_of(self, job: SlurmJob) -> tuple[RunKey, bool] | None:
        """``(run, ended)`` of a job that ran a claimed attempt, or ``None``."""
        claim = parse_claim(job.comment)
        if claim is None or claim.workload != workload_id(job):
            return None
        key = (claim.workload, claim.attempt)
        if job.live:
            return key, False
        if job.ended or (job.job_state == "PENDING" and job.restart_cnt > claim.run):
            return key, True  # it ended, or it was requeued: that attempt is over
        return None  # pinned, not running yet

    # -- the port --------------------------------------------------------
    def held(self) -> Iterable[tuple[RunKey, bool]]:
        out = []
        for job in self.jobs.values():
            run = self.run_of(job)
            if run is not None:
                out.append(run)
        return out

    def done(self) -> Container[RunKey]:
        return self.released

    def probe(self) -> None:
        """Nothing: the bridge read ``squeue`` before the round."""

    async def launch(self, run: DesiredRun) -> bool:
        job = self.jobs.get(run.workload)
        if job is None or job.job_state != "PENDING":
            return False  # not in Slurm (yet), or an earlier run still ends
        if job.restart_cnt > 0 and self.clock() < (job.submit_time + REQUEUE_SETTLE_S) * 1000:
            return False  # requeued just now: slurmd would refuse the launch (REQUEUE_SETTLE_S)
        w = self.state.running.get(run.workload)
        if w is None:
            return False
        nodes = [s.node for s in w.placement]
        claim = Claim(run.workload, run.attempt, job.restart_cnt)
        try:
            await self.cli.pin_and_release(job.job_id, nodes, claim_text(claim, nodes))
        except SlurmError as exc:  # asked again next round
            self.logger.warning("release failed; retrying", job=job.job_id, error=str(exc))
            return False
        self.released.add(run.key)
        self.logger.info(
            "released", workload=run.workload, attempt=run.attempt, job=job.job_id, nodes=nodes
        )
        return True

    async def stop(self, stop: Stop) -> None:
        """The notice (SIGTERM to the script and steps), then, when it ends, requeue
        held (a preemption that requeues) or cancel. A command that fails is tried
        again next round."""
        key = stop.key
        job = self.jobs.get(key[0])
        if job is None or not job.live or key in self.finals:
            return
        now = self.clock()
        try:
            deadline = self.deadlines.get(key)
            if deadline is None:
                if stop.grace_ms > 0:
                    await self.cli.signal(job.job_id, "TERM")
                    self.logger.info(
                        "notice", workload=key[0], attempt=key[1], job=job.job_id, why=stop.reason
                    )
                deadline = now + stop.grace_ms
            deadline = self.deadlines[key] = min(deadline, now + stop.grace_ms)
            if now < deadline:
                return
            p = self.ledger.preempted.get(key)
            if p is not None and p.requeued:
                await self.cli.requeue_held(job.job_id)
                what = "requeued held"
            else:
                await self.cli.cancel(job.job_id)
                what = "cancelled"
        except SlurmError as exc:
            self.logger.warning("stop failed; retrying", job=job.job_id, error=str(exc))
            return
        self.finals.add(key)
        self.logger.info(what, workload=key[0], attempt=key[1], job=job.job_id)

    def gone(self, key: RunKey) -> None:
        """Forget ``key`` (no longer current: never desired again)."""
        self.deadlines.pop(key, None)
        self.finals.discard(key)
        self.released.discard(key)


class SlurmOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How ``apportion up --slurm`` runs the bridge."""

    partitions: tuple[str, ...]
    accounts: dict[str, str] = {}
    interval_s: float = 0.5

    def bridge(self) -> dict[str, Any]:
        return {
            "partitions": self.partitions,
            "accounts": AccountMap(self.accounts),
            "interval_s": self.interval_s,
        }


async def mark_absent_down(log: EventLog, spec: Any, options: SlurmOptions, actor: str) -> None:
    """Mark ``down`` every node of the cluster file that the governed partitions do
    not hold (nothing runs there; the bridge registers Slurm's own nodes)."""
    slurm_nodes = {n.name for n in await SlurmCli().nodes(frozenset(options.partitions))}
    absent = [
        e.node for e in spec.events if isinstance(e, NodeRegistered) and e.node not in slurm_nodes
    ]
    if absent:
        now = wall_ms()
        await log.publish_inputs(
            [
                NodeHealthChanged(
                    id=f"slurm-absent-{n}-{now}", at_ms=now, node=n, state="down", actor=actor
                )
                for n in absent
            ]
        )


class SlurmBridge:
    """``apportion slurm`` (see the module doc)."""

    def __init__(
        self,
        log: EventLog,
        *,
        partitions: Iterable[str] = ("gpu",),
        accounts: AccountMap | None = None,
        cli: SlurmCli | None = None,
        interval_s: float = 0.5,
        register: bool = True,
        clock: Any = wall_ms,
    ) -> None:
        self.log = log
        self.partitions = frozenset(partitions)
        self.accounts = accounts or AccountMap()
        self.cli = cli or SlurmCli()
        self.interval_s = interval_s
        self.register = register
        self.clock = clock
        self.logger = logs.get("slurm", cluster=log.subjects.cluster)
        self.follower = Follower(log)
        self.state = self.follower.state
        self.ledger = Ledger()
        self.runtime = SlurmRuntime(self.cli, self.state, self.ledger, self.logger, clock)
        self.nodes: list[SlurmNode] = []
        self.nodes_dirty = False
        """Read the nodes again next round (the bridge changed one)."""
        self.ready = asyncio.Event()
        self._rounds = 0
        self._sent: dict[str, str] = {}
        """Input ids published and not folded yet -> their workload or node."""
        self._comments: dict[int, str] = {}
        """Job id -> the comment written last (written again only when it changes)."""
        self.reported = 0
        self.submitted = 0
        self._nodes_fresh = False
        """This round read the nodes (at its start)."""
        self.slurm_cluster: str | None = None
        """Slurm's ``ClusterName`` (the middle of every workload id it makes)."""

    # -- the service ---------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        try:
            target = await asyncio.wait_for(self.log.last_batch_seq(), PUBLISH_TIMEOUT_S)
            while self.follower.reader.batches_done < target and not stop.is_set():
                await self._poll(1.0)
            self.ready.set()
            self.logger.info("ready", partitions=sorted(self.partitions))
            while not stop.is_set():
                try:
                    await self._poll(self.interval_s)
                    await self.round()
                except Exception as exc:
                    if not (is_transient(exc) or isinstance(exc, SlurmError)):
                        raise
                    self.logger.warning("round interrupted; retrying", error=str(exc))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
        finally:
            await self.follower.close()
            self.logger.info("stopped")

    async def _poll(self, timeout: float) -> None:
        for item, rejected in await self.follower.poll_folded(timeout):
            self.ledger(item, self.state, rejected)
            event = getattr(item, "event", None)
            if event is not None:
                self._sent.pop(event.id, None)

    async def round(self) -> None:
        """One round: read Slurm, nodes, intake, the reconcile, reports (module doc)."""
        # 1. read Slurm
        jobs = await self.cli.jobs(self.partitions)
        self._nodes_fresh = self._rounds % NODES_EVERY == 0 or self.nodes_dirty
        if self._nodes_fresh:
            self.nodes = await self.cli.nodes(self.partitions)
            self.nodes_dirty = False
        self._rounds += 1
        by_workload = {workload_id(j): j for j in jobs}
        self.runtime.jobs = by_workload
        # 2. nodes
        if self.register:
            await self._nodes()
        # 3. intake
        for job in jobs:
            try:
                await self._intake(job)
            except SlurmError as exc:  # one job's trouble does not hold up the others
                self.logger.warning("intake failed; retrying", job=job.job_id, error=str(exc))
        # 4. the reconcile
        await reconcile_once(self.runtime, self.state, self.ledger, self.clock())
        # 5. reports
        for job in jobs:
            run = self.runtime.run_of(job)
            if run is None:
                continue
            if run[1]:
                await self._report_end(job, run[0])
            elif job.job_state == "RUNNING":
                await self._report_start(run[0])
        await self._vanished(by_workload)
        if self._rounds % 500 == 0:
            self.ledger.prune(self.state, keep=list(by_workload))

    async def _publish(self, event: Input, what: str) -> bool:
        if event.id in self._sent:
            return False  # published, not folded yet
        try:
            await asyncio.wait_for(self.log.publish_input(event), PUBLISH_TIMEOUT_S)
        except Exception as exc:  # retried on the next round
            self.logger.warning(f"{what} publish failed; retrying", error=str(exc))
            return False
        self._sent[event.id] = what
        return True

    async def _comment(self, job: SlurmJob, text: str) -> None:
        text = (COMMENT_PREFIX + text)[:250]
        if job.comment == text or self._comments.get(job.job_id) == text:
            return
        await self.cli.comment(job.job_id, text)
        self._comments[job.job_id] = text
        self.logger.info("comment", job=job.job_id, comment=text)

    # -- nodes -------------------------------------------------------------
    async def _nodes(self) -> None:
        state, now = self.state, self.clock()
        for n in self.nodes:
            known = state.nodes.get(n.name)
            actor = agent_of(n.name)
            if n.gpus <= 0:
                continue
            if known is None or known.gpus != n.gpus or known.gpu_type != n.gpu_type:
                await self._publish(
                    NodeRegistered(
                        id=f"slurm-register-{n.name}-{n.gpus}x{n.gpu_type}",
                        at_ms=now,
                        node=n.name,
                        gpus=n.gpus,
                        gpu_type=n.gpu_type,
                        actor=actor,
                    ),
                    "register",
                )
                continue
            by = self.ledger.health_by.get(n.name, "")
            if known.health != "healthy" and by not in ("", actor) and n.health == "healthy":
                # apportion's own drain (an operator, the scheduler): shown in Slurm
                await self.cli.drain(n.name, f"{APPORTION_REASON}{known.health} (set by {by})")
                self.nodes_dirty = True
                continue
            if known.health == "healthy" and n.reason.startswith(APPORTION_REASON):
                await self.cli.resume(n.name)  # apportion undid its drain
                self.nodes_dirty = True
                continue
            want = health_change(state, self.ledger, n.name, actor, n.health)
            if want is None or want == known.health:
                continue
            await self._publish(
                NodeHealthChanged(
                    id=f"slurm-health-{n.name}-{want}-{state.input_seq}",
                    at_ms=now,
                    node=n.name,
                    state=want,
                    actor=actor,
                    reason=f"Slurm state {n.state}",
                ),
                "health",
            )

    # -- intake ------------------------------------------------------------
    async def _intake(self, job: SlurmJob) -> None:
        state, cli = self.state, self.cli
        wid = workload_id(job)
        w = state.workloads.get(wid)
        ended = state.ended.get(wid)
        claim = parse_claim(job.comment)
        released = claim is not None and claim.run == job.restart_cnt
        user_held = job.held and job.state_reason == "JobHeldUser"
        if job.job_state == "PENDING" and not released and (user_held or not job.held):
            # held by the submit rule or --hold (a user hold: its user could release
            # it), or not held at all (the backstop): an admin hold, which only
            # apportion (the bridge) releases
            await cli.hold(job.job_id)
            self.logger.info("held", job=job.job_id, was=job.state_reason)
            return
        if job.job_state in ("RUNNING", "CONFIGURING") and not released:
            # started past apportion (released by hand before the bridge saw it)
            await cli.requeue_held(job.job_id)
            await self._comment(job, "started outside apportion: requeued held")
            self.logger.warning("requeued a job started outside apportion", job=job.job_id)
            return
        if w is None and ended is None:
            if job.held and wid not in self.ledger.submissions:
                await self._submit(job)
            return
        if ended is not None:
            if job.job_state == "PENDING":
                await cli.cancel(job.job_id)  # ended in apportion before it ran
                self.logger.info("cancelled", job=job.job_id, status=ended)
            return
        assert w is not None
        if w.status == "pending":
            if job.ended:
                p = self.ledger.preempted.get((wid, claim.attempt)) if claim else None
                if claim is not None and p is not None and p.requeued:
                    await cli.requeue_held(job.job_id)  # it stopped during its notice
                    self.logger.info("requeued held", job=job.job_id, workload=wid)
                else:
                    await self._publish(
                        WorkloadCancelled(
                            id=f"slurm-cancel-{wid}",
                            at_ms=self.clock(),
                            workload=wid,
                            actor=job.user_name,
                        ),
                        "cancel",
                    )
            elif job.held and claim is None:
                await self._comment(job, f"{wid} pending in apportion (apportion explain {wid})")

    async def _submit(self, job: SlurmJob) -> None:
        gpn = {t: g for (t, g) in self.state.pools}
        typed = partition_types(self.nodes).get(job.partition)
        event = submission(job, self.accounts, gpn, self.clock(), typed)
        wid = workload_id(job)
        if isinstance(event, str):
            await self._comment(job, f"held: {event}")
            return
        refusal = submission_refusal(self.state, event)
        if refusal is not None:
            await self._comment(job, f"held: {refusal.message}")
            return
        if await self._publish(event, "submit"):
            self.submitted += 1
            self.logger.info("submitted", job=job.job_id, workload=wid, owner=event.owner)
            await self._comment(job, f"{wid} pending in apportion (apportion explain {wid})")

    # -- reports -----------------------------------------------------------
    async def _report_start(self, key: RunKey) -> None:
        """``WorkloadStarted`` from each node of the run (informational), once."""
        w = self.state.running.get(key[0])
        if w is None:
            return
        for slot in w.placement:
            if start_report_due(self.state, self.ledger, key, slot.node):
                await self._publish(
                    WorkloadStarted(
                        id=started_id(key, slot.node),
                        at_ms=self.clock(),
                        workload=key[0],
                        attempt=key[1],
                        node=slot.node,
                        actor=agent_of(slot.node),
                    ),
                    "start",
                )

    def _hosts_up(self, placement: Iterable[Slot]) -> bool:
        """Whether no node of ``placement`` is down in Slurm, as read at the start of
        this round (else: read again next round, and ``False`` until then). A run
        Slurm lost because its node failed is not reported as a failure: the
        node's ``down`` goes in (:meth:`_nodes`) and the scheduler requeues the
        run as ``node_down`` (a resumable workload runs again)."""
        if not self._nodes_fresh:
            self.nodes_dirty = True
            return False
        down = {n.name for n in self.nodes if n.health == "down"}
        return not any(slot.node in down for slot in placement)

    async def _vanished(self, by_workload: dict[str, SlurmJob]) -> None:
        """Workloads of Slurm jobs that ``squeue`` no longer shows (purged after
        ``MinJobAge`` while the bridge was away, or moved out of the governed
        partitions): a pending one is cancelled (by its submitter), the run of a
        running one is reported lost. Nothing is left waiting for a job that is gone."""
        if self.slurm_cluster is None:
            self.slurm_cluster = await self.cli.cluster_name()
        prefix = f"slurm-{self.slurm_cluster}-"
        now = self.clock()
        for wid, w in list(self.state.workloads.items()):
            if not wid.startswith(prefix) or wid in by_workload:
                continue
            if w.status == "pending":
                await self._publish(
                    WorkloadCancelled(
                        id=f"slurm-cancel-{wid}", at_ms=now, workload=wid, actor=w.submitted_by
                    ),
                    "cancel",
                )
                self.logger.warning("job gone from squeue; cancelled", workload=wid)
            elif w.placement:
                key = (wid, w.attempt)
                job_id = wid[len(prefix) :]
                ended = await self.cli.ended_job(int(job_id)) if job_id.isdigit() else None
                if ended is not None:  # sacct or the completion log knows its end
                    await self._report_end(ended, key)
                elif not end_report(self.state, self.ledger, key, 0, None, True):
                    event = finished(key, w.placement[0].node, now, None, lost=True)
                    if await self._publish(event, "finish"):
                        self.logger.warning("job gone from squeue; run lost", workload=wid)

    async def _report_end(self, job: SlurmJob, key: RunKey) -> None:
        """The end of run ``key`` of ``job``: its exit code once it ended; lost if
        Slurm requeued it (a node failure; after a preemption the history has
        moved on already and nothing is reported)."""
        lost = job.job_state in LOST_STATES or not job.ended
        code = exit_code_of(job.exit_code) if job.ended else None
        why = end_report(self.state, self.ledger, key, 0, code, lost)
        if why:
            return
        w = self.state.running.get(key[0])
        assert w is not None  # end_report: still the current run
        if lost and not self._hosts_up(w.placement):
            return  # the host's down reaches apportion first: its runs are requeued
        event = finished(key, w.placement[0].node, self.clock(), code, lost)
        if await self._publish(event, "finish"):
            self.reported += 1
            self.logger.info(
                "finished",
                workload=key[0],
                attempt=key[1],
                job=job.job_id,
                state=job.job_state,
                exit_code=code,
            )
