"""What an executor should be doing, from the folded history: the one reconcile.

Every executor (the host agent's processes, the emulator's timers, a later Slurm
or Kubernetes launcher) runs the same three steps against its own runtime:

1. :class:`Ledger` (an :class:`~apportion.core.history.Observer`) notes what the
   folded :class:`~apportion.core.state.State` does not keep but an executor
   needs: each workload's submission (``command``, ``env``, ``image``, its
   notice), the preemptions of the runs it runs (reason, notice, when), the
   start and end reports already in the history, who changed each host's
   health last.
2. :func:`desired_runs`: the runs that should be running, per host, computed
   once from the state (the current run of every running workload, one entry
   per slot: its rank, its GPUs, its first host, its submission).
3. :func:`reconcile`: given what the runtime holds (its live and ended runs,
   and what it must never start again), the :class:`Plan`: which runs to
   start, which live runs to stop (a notice: still current but preempted; or
   ended), which of its runs are no longer current. :func:`end_report` and
   :func:`start_report_due` say whether a run's report goes out,
   :func:`health_change` which health a host's executor may publish.

Pure: no I/O, no clock (``now_ms`` is an argument), no randomness; ordered
output (by host, then workload id).
"""

from __future__ import annotations

from collections.abc import Container, Iterable

import msgspec
from apportion.schemas.events import (
    HealthState,
    NodeHealthChanged,
    Outcome,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadStarted,
    WorkloadSubmitted,
)
from apportion.schemas.history import HistoryItem, InputItem

from .state import SCHEDULER, State

RunKey = tuple[str, int]
"""``(workload, attempt)``: one run. An executor holds each run at most once: its
host's rank (a host agent), or the whole run as its first host (the emulator)."""


class DesiredRun(msgspec.Struct, frozen=True, kw_only=True):
    """A run that should be running on ``node``: everything needed to start it."""

    workload: str
    attempt: int
    node: str
    slot_gpus: int
    """The GPUs of its slot on ``node``."""
    rank: int
    """``node``'s index in the placement (0: the first slot)."""
    ranks: int
    master: str
    """The placement's first host (``MASTER_ADDR`` is its address)."""
    owner: str
    gpus: int
    """The workload's GPUs, all hosts."""
    started_ms: int
    duration_ms: int | None
    run_ms: int
    """Progress kept from earlier runs."""
    stopping: bool
    """Under notice (preempted with grace), as the state says."""
    grace_ms: int
    """Its notice if preempted: its own ``grace_ms``, else the policy's."""
    submission: WorkloadSubmitted | None = None

    @property
    def key(self) -> RunKey:
        return (self.workload, self.attempt)

    @property
    def remaining_ms(self) -> int | None:
        """What is left of its ``duration_ms`` (``None``: runs until stopped)."""
        return None if self.duration_ms is None else max(0, self.duration_ms - self.run_ms)


class Stop(msgspec.Struct, frozen=True, kw_only=True):
    """Stop a live run: a notice of ``grace_ms`` (SIGTERM now, SIGKILL then)."""

    key: RunKey
    reason: str
    grace_ms: int
    ended: bool
    """The run is no longer current (else it is preempted and still in its notice)."""


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    start: tuple[DesiredRun, ...] = ()
    stop: tuple[Stop, ...] = ()
    gone: tuple[RunKey, ...] = ()
    """Runs the runtime holds (live or ended) that are no longer current."""


class Ledger:
    """What an executor notes from the history besides the state (an observer).

    ``hosts``: the hosts whose runs' preemptions it keeps (``None``: every host)."""

    def __init__(self, hosts: Iterable[str] | None = None) -> None:
        self.hosts = None if hosts is None else frozenset(hosts)
        self.submissions: dict[str, WorkloadSubmitted] = {}
        self.placed: dict[str, tuple[int, bool]] = {}
        """workload -> (attempt of its last placement, whether it named one of ``hosts``)"""
        self.preempted: dict[RunKey, WorkloadPreempted] = {}
        """The preemption of each run on ``hosts`` (the shortest notice when there are two)."""
        self.seen: dict[str, str] = {}
        """Ids of the start and end reports in the history -> their workload."""
        self.health_by: dict[str, str] = {}
        """host -> who made its last accepted health change."""

    def __call__(self, item: HistoryItem, state: State, rejected: str | None, /) -> None:
        if isinstance(item, InputItem):
            e = item.event
            if e is None or rejected is not None:
                return
            if isinstance(e, WorkloadSubmitted):
                self.submissions.setdefault(e.workload, e)
            elif isinstance(e, WorkloadFinished | WorkloadStarted):
                self.seen[e.id] = e.workload
            elif isinstance(e, NodeHealthChanged):
                self.health_by[e.node] = e.actor
            return
        hosts = self.hosts
        for d in item.batch.decisions:
            if isinstance(d, WorkloadPlaced):
                here = hosts is None or any(s.node in hosts for s in d.placement)
                self.placed[d.workload] = (d.attempt, here)
            elif isinstance(d, WorkloadPreempted):
                attempt, here = self.placed.get(d.workload, (0, False))
                if here:
                    key = (d.workload, attempt)
                    known = self.preempted.get(key)
                    if known is None or d.grace_ms < known.grace_ms:
                        self.preempted[key] = d

    def grace_ms(self, state: State, workload: str) -> int:
        """The workload's notice: its own ``grace_ms``, else the policy's."""
        sub = self.submissions.get(workload)
        if sub is not None and sub.grace_ms is not None:
            return sub.grace_ms
        return state.policy.grace_ms

    def prune(self, state: State, keep: Iterable[str] = ()) -> None:
        """Forget what belongs to ended workloads (bounded memory); ``keep``: the
        workloads of runs the executor still holds."""
        live = state.workloads
        self.submissions = {w: s for w, s in self.submissions.items() if w in live}
        self.placed = {w: p for w, p in self.placed.items() if w in live}
        self.preempted = {k: p for k, p in self.preempted.items() if k[0] in live}
        held = set(keep) | set(live)
        self.seen = {i: w for i, w in self.seen.items() if w in held}


def is_current(state: State, key: RunKey) -> bool:
    """``key`` is the current run of its workload (also during a notice)."""
    w = state.running.get(key[0])
    return w is not None and w.attempt == key[1]


def desired_runs(state: State, ledger: Ledger, host: str | None = None) -> list[DesiredRun]:
    """The runs that should be running: on ``host`` its rank of each run placed
    there (by workload id); with ``None`` each run once, as its first host's
    (rank 0; by host, then workload id)."""
    out: list[DesiredRun] = []
    hosts = [host] if host is not None else sorted(state.nodes)
    for name in hosts:
        node = state.nodes.get(name)
        if node is None:
            continue
        for wid, slot_gpus in sorted(node.workloads.items()):
            w = state.running.get(wid)
            if w is None or not w.placement:
                continue
            nodes = [s.node for s in w.placement]
            if name not in nodes or (host is None and nodes[0] != name):
                continue
            out.append(
                DesiredRun(
                    workload=wid,
                    attempt=w.attempt,
                    node=name,
                    slot_gpus=slot_gpus,
                    rank=nodes.index(name),
                    ranks=len(nodes),
                    master=nodes[0],
                    owner=w.owner,
                    gpus=w.gpus,
                    started_ms=w.started_ms,
                    duration_ms=w.duration_ms,
                    run_ms=w.run_ms,
                    stopping=w.stopping is not None,
                    grace_ms=ledger.grace_ms(state, wid),
                    submission=ledger.submissions.get(wid),
                )
            )
    return out


def reconcile(
    state: State,
    ledger: Ledger,
    *,
    host: str | None,
    held: Iterable[tuple[RunKey, bool]],
    done: Container[RunKey],
    now_ms: int,
    adopts_under_notice: bool = False,
) -> Plan:
    """What the runtime of ``host`` (``None``: every host, each run as its first
    host) should do now.

    ``held``: ``(run, ended)`` for each run it holds; ``done``: runs it must never
    start again (reported, or claimed before). A live run that was preempted is
    stopped with what is left of its notice at ``now_ms``; one no longer current
    is stopped with its workload's notice. A run that should be running and
    that it neither holds nor is done with is started, unless it is under
    notice already: a runtime that cannot take over a run it never saw start
    (a process) leaves it; one whose runs are a function of the history (the
    emulator, ``adopts_under_notice``) takes it."""
    stops: list[Stop] = []
    gone: list[RunKey] = []
    holds: set[RunKey] = set()
    for key, ended in held:
        holds.add(key)
        current = is_current(state, key)
        if not current:
            gone.append(key)
        if ended:
            continue
        p = ledger.preempted.get(key)
        if p is not None:
            grace = p.grace_ms  # the notice the scheduler gave (and charges)
            # what is left of it (all of it, unless the executor restarted during it)
            left = max(0, min(grace, p.at_ms + grace - now_ms))
            stops.append(
                Stop(key=key, reason=f"preempted ({p.reason})", grace_ms=left, ended=not current)
            )
        elif not current:
            stops.append(
                Stop(key=key, reason="ended", grace_ms=ledger.grace_ms(state, key[0]), ended=True)
            )
    start: list[DesiredRun] = []
    for run in desired_runs(state, ledger, host):
        key = run.key
        if key in holds or key in done:
            continue
        if not adopts_under_notice and (key in ledger.preempted or run.stopping):
            continue  # stopping before it was ever seen running (a restart mid-notice)
        start.append(run)
    return Plan(start=tuple(start), stop=tuple(stops), gone=tuple(gone))


def start_report_due(state: State, ledger: Ledger, key: RunKey, host: str) -> bool:
    """``WorkloadStarted`` of ``key`` on ``host`` goes out: not in the history yet,
    and still the current run."""
    return started_id(key, host) not in ledger.seen and is_current(state, key)


def end_report(
    state: State, ledger: Ledger, key: RunKey, rank: int, exit_code: int | None, lost: bool
) -> str:
    """Why the end of run ``key`` (this host's ``rank``) is not reported, or ``""``:
    it is reported (exactly one report per attempt)."""
    if finished_id(key) in ledger.seen:
        return "already reported"
    if not is_current(state, key):
        return "no longer the current run"
    if rank > 0 and exit_code == 0 and not lost:
        return "rank 0 reports the gang"  # also during a notice: rank 0 says if it is done
    return ""


def outcome_of(exit_code: int | None, lost: bool) -> Outcome:
    return "succeeded" if exit_code == 0 and not lost else "failed"


def started_id(key: RunKey, host: str) -> str:
    return f"started-{key[0]}-{key[1]}-{host}"


def finished_id(key: RunKey) -> str:
    return f"finished-{key[0]}-{key[1]}"


def health_change(
    state: State, ledger: Ledger, host: str, actor: str, probed: HealthState
) -> HealthState | None:
    """The health ``host`` should have when its probes say ``probed``, as far as
    ``actor`` (its executor) may set it, or ``None`` (not registered, or not
    its to change). Always by way of ``draining`` (its history reads in order);
    back to ``healthy`` only over its own change or the scheduler's heartbeat
    timeout (an operator's drain or down stands). The host's health itself
    means: nothing to publish."""
    node = state.nodes.get(host)
    if node is None:
        return None
    want: HealthState = probed
    if want == "down" and node.health == "healthy":
        want = "draining"
    if node.health == want:
        return want
    if want == "healthy" and ledger.health_by.get(host, "") not in (SCHEDULER, actor):
        return None
    if want == "draining" and node.health == "down":
        return None
    return want
