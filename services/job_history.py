"""Job history: every workload's life from submission to its end, for ``explain``
and ``apportion jobs`` (``GET /v1/jobs``, the dashboard's jobs page).

The fold keeps only live workloads (an ended one keeps its status); what came
before, and how it ended, is in the history. :class:`JobHistory` is an
observer of the one fold (:class:`~apportion.core.history.Observer`), built the
way the DuckDB projection is (``replay/projection.py``): shown each item right
after it was folded, with the state and whether an input was refused, it keeps
per workload

- its submission: owner, GPUs, contract, ``submitted_by``, command, image;
- every attempt (placement): nodes, start, end and how it ended, with the
  runs table's words (``finished``, ``preempted``, ``node_down``,
  ``cancelled``), the outcome and exit code its executor reported, the
  preemption that stopped it (reason, for which workload, notice, requeued),
  the hosts whose agent reported starting it, and where each host's agent
  writes its log;
- its end: status, time, who cancelled it; or why its submission was refused.

A refused input changes nothing. Where an input's effect depends on the state
(a ``failed`` report during a notice applies the preemption's outcome) the
fold's answer is read from the state; a run stopping with notice ends at its
deadline when the fold's clock reaches it, as the fold ends it. After each
item the workloads it touched are checked against the state, which has the
last word (:attr:`JobHistory.disagreements` counts any correction).

**Bounds.** Live workloads are all kept (the state holds them anyway); of the
ended ones the last :data:`MAX_ENDED_JOBS` (in the order they ended) are kept,
the oldest dropped first (:attr:`JobHistory.dropped`). The projection
(``apportion sql``, ``explain --log``) keeps them all.
"""

from __future__ import annotations

import datetime as _dt
import re
import shlex
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from apportion.core.state import State
from apportion.schemas.bounds import MAX_NAME_LEN, MAX_PATH_LEN
from apportion.schemas.events import (
    ANY_GPU_TYPE,
    DAY_MS,
    HOUR_MS,
    MINUTE_MS,
    Event,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadHeld,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadReleased,
    WorkloadStarted,
    WorkloadSubmitted,
)
from apportion.schemas.history import HistoryItem, InputItem

MAX_ENDED_JOBS = 100_000
"""Ended workloads a :class:`JobHistory` keeps (the most recently ended)."""

ENDED_STATES = ("succeeded", "failed", "cancelled", "preempted", "rejected")
LIVE_STATES = ("pending", "running")
STATES = LIVE_STATES + ENDED_STATES
STATE_GROUPS = {"ended": ENDED_STATES, "live": LIVE_STATES, "all": STATES}
"""Names for several states at once (``--state ended``, the default)."""
HELD = "held"
"""``--state held``: pending workloads that are held (``pending`` includes them)."""

DEFAULT_LIMIT = 50
MAX_LIMIT = 1000
MAX_SINCE_MS = 366 * DAY_MS
"""``since`` as a duration: at most a year back (an ISO time or epoch ms may be any time)."""

LOG_NAME = "output.log"
WORK_DIR_PLACEHOLDER = "<work-dir>"


class Attempt:
    """One placement of a workload (all its hosts)."""

    __slots__ = (
        "number",
        "placement",
        "allocated",
        "start_ms",
        "protected_until_ms",
        "end_ms",
        "end",
        "outcome",
        "exit_code",
        "preemption",
        "started",
    )

    def __init__(
        self,
        number: int,
        placement: tuple[tuple[str, int], ...],
        allocated: bool,
        start_ms: int,
        protected_until_ms: int,
    ) -> None:
        self.number = number
        self.placement = placement
        self.allocated = allocated
        self.start_ms = start_ms
        self.protected_until_ms = protected_until_ms
        self.end_ms: int | None = None
        self.end: str | None = None
        """``finished``, ``preempted``, ``node_down``, ``cancelled`` (the runs
        table's ``end_reason``); ``None`` while it runs."""
        self.outcome: str | None = None
        """What its executor reported (``succeeded``/``failed``), if it did."""
        self.exit_code: int | None = None
        self.preemption: dict[str, Any] | None = None
        """The preemption that stopped it: ``at_ms``, ``reason``, ``for_workload``,
        ``grace_ms``, ``requeued``."""
        self.started: dict[str, int] = {}
        """Host -> when its agent reported the process started (``WorkloadStarted``)."""


class Job:
    """One workload's submission, attempts and end."""

    __slots__ = (
        "workload",
        "owner",
        "gpus",
        "gpu_type",
        "min_runtime_ms",
        "resumable",
        "priority",
        "submitted_by",
        "submitted_ms",
        "command",
        "image",
        "duration_ms",
        "grace_ms",
        "status",
        "ended_ms",
        "cancelled_by",
        "rejected",
        "attempts",
        "held_ms",
        "held_by",
    )

    def __init__(self, e: WorkloadSubmitted, now: int) -> None:
        self.workload = e.workload
        self.owner = e.owner
        self.gpus = e.gpus
        self.gpu_type = e.gpu_type
        self.min_runtime_ms = e.min_runtime_ms
        self.resumable = e.resumable
        self.priority = e.priority
        self.submitted_by = e.submitted_by
        self.submitted_ms = now
        self.command = e.command
        self.image = e.image
        self.duration_ms = e.duration_ms
        self.grace_ms = e.grace_ms
        self.status = "pending"
        self.ended_ms: int | None = None
        self.cancelled_by: str | None = None
        self.rejected: str | None = None
        self.attempts: list[Attempt] = []
        self.held_ms: int | None = None
        """When it was held (``WorkloadHeld``), while it is: pending, not placed."""
        self.held_by: str | None = None

    @property
    def current(self) -> Attempt | None:
        """The attempt that runs now (also during a notice), if one does."""
        if self.attempts and self.attempts[-1].end is None:
            return self.attempts[-1]
        return None

    @property
    def exit_code(self) -> int | None:
        """The exit code its executor reported for the last attempt (``None``: none)."""
        return self.attempts[-1].exit_code if self.attempts else None


class JobHistory:
    """Every workload's submission, attempts and end, kept from the canonical
    history (see the module doc). Call it with each item right after folding it:
    ``history(item, state, rejected)``."""

    def __init__(self, max_ended: int = MAX_ENDED_JOBS) -> None:
        self.max_ended = max_ended
        self.live: dict[str, Job] = {}
        self.ended: dict[str, Job] = {}
        """Ended (and refused) workloads, in the order they ended."""
        self.stopping: dict[str, tuple[int, bool]] = {}
        """Runs preempted with notice, not ended yet: workload -> (deadline, requeue)."""
        self.dropped = 0
        """Ended workloads dropped to keep :attr:`max_ended`."""
        self.disagreements = 0
        """Workloads whose status the state corrected (0 unless a reading here is wrong)."""
        self.last_disagreement = ""
        self._now = 0

    def get(self, workload: str) -> Job | None:
        return self.live.get(workload) or self.ended.get(workload)

    def __len__(self) -> int:
        return len(self.live) + len(self.ended)

    # -- observing -------------------------------------------------------------
    def __call__(self, item: HistoryItem, state: State, rejected: str | None) -> None:
        if isinstance(item, InputItem):
            e = item.event
            if e is not None:
                now = state.now_ms
                due: list[str] = []
                if self.stopping and now > self._now:
                    due = self._end_due_stops(now)
                wid = self._input(e, state, rejected)
                for w in due if wid is None else [*due, wid]:
                    self._check(w, state)
            self._now = state.now_ms
            return
        now = state.now_ms  # decisions happen at the time of the input they are based on
        touched: dict[str, None] = {}
        for d in item.batch.decisions:
            wid = self._decision(d, now)
            if wid is not None:
                touched[wid] = None
        for wid in touched:
            self._check(wid, state)

    def _input(self, e: Event, state: State, rejected: str | None) -> str | None:
        now = state.now_ms
        if isinstance(e, WorkloadSubmitted):
            wid = e.workload
            if rejected is not None:
                if wid not in self.live and wid not in self.ended and state.status_of(wid) is None:
                    job = Job(e, now)
                    job.status, job.ended_ms, job.rejected = "rejected", now, rejected
                    self._ended(job)
                return None
            self.ended.pop(wid, None)  # an id refused before, now accepted
            self.live[wid] = Job(e, now)
            return wid
        return None if rejected is not None else self._accepted(e, now, state)

    def _accepted(self, e: Event, now: int, state: State) -> str | None:
        """An input the fold accepted (a submission aside); the workload it touched."""
        if isinstance(e, WorkloadFinished):
            job = self.live.get(e.workload)
            if job is None:
                return None
            run = job.current
            if run is not None:
                run.outcome, run.exit_code = e.outcome, e.exit_code
            status = state.status_of(e.workload)
            if e.workload in self.stopping and status in ("pending", "preempted"):
                # a failed report during a notice: the preemption's outcome applies now
                self._stop_ended(job, now, status == "pending", "preempted")
            else:
                self.stopping.pop(e.workload, None)
                self._close(job, now, "finished")
                self._end(job, e.outcome, now)
            return e.workload
        if isinstance(e, WorkloadCancelled):
            job = self.live.get(e.workload)
            if job is None:
                return None
            self.stopping.pop(e.workload, None)
            self._close(job, now, "cancelled")
            job.cancelled_by = e.actor
            self._end(job, "cancelled", now)
            return e.workload
        if isinstance(e, WorkloadHeld | WorkloadReleased):
            job = self.live.get(e.workload)
            if job is None:
                return None
            held = isinstance(e, WorkloadHeld)
            job.held_ms, job.held_by = (now, e.actor) if held else (None, None)
            return e.workload
        if isinstance(e, WorkloadStarted):
            job = self.live.get(e.workload)
            run = job.current if job is not None else None
            if run is not None and run.number == e.attempt:
                run.started.setdefault(e.node, now)
            return None
        return None

    def _decision(self, d: Event, now: int) -> str | None:
        if isinstance(d, WorkloadPlaced):
            job = self.live.get(d.workload)
            if job is None:
                return None
            placement = tuple((s.node, s.gpus) for s in d.placement)
            job.attempts.append(
                Attempt(d.attempt, placement, d.allocated, now, d.protected_until_ms)
            )
            job.status = "running"
            return d.workload
        if isinstance(d, WorkloadPreempted):
            job = self.live.get(d.workload)
            if job is None:
                return None
            run = job.current
            # as the fold: a stopping run ends early only by the loss of its host;
            # otherwise a notice starts a stop and the run goes on
            stopping = self.stopping.pop(d.workload, None) is not None
            if not stopping and run is not None:
                run.preemption = {
                    "at_ms": now,
                    "reason": d.reason,
                    "for_workload": d.for_workload,
                    "grace_ms": d.grace_ms,
                    "requeued": d.requeued,
                }
                if d.grace_ms > 0:
                    self.stopping[d.workload] = (now + d.grace_ms, d.requeued)
                    return d.workload
            end = "node_down" if d.reason == "node_down" else "preempted"
            self._stop_ended(job, now, d.requeued, end)
            return d.workload
        return None

    def _end_due_stops(self, now: int) -> list[str]:
        """The clock moved to ``now``: as the fold does before it applies the input,
        end every stop due by then at its deadline, in deadline (then workload) order."""
        due = sorted((u, w) for w, (u, _) in self.stopping.items() if u <= now)
        for until, wid in due:
            job = self.live.get(wid)
            requeue = self.stopping[wid][1]
            if job is None:
                self.stopping.pop(wid)
                continue
            self._stop_ended(job, until, requeue, "preempted")
        return [wid for _, wid in due]

    def _stop_ended(self, job: Job, at_ms: int, requeued: bool, end: str) -> None:
        self.stopping.pop(job.workload, None)
        self._close(job, at_ms, end)
        if requeued:
            job.status = "pending"
        else:
            self._end(job, "preempted", at_ms)

    @staticmethod
    def _close(job: Job, at_ms: int, end: str) -> None:
        run = job.current
        if run is not None:
            run.end_ms, run.end = at_ms, end

    def _end(self, job: Job, status: str, at_ms: int) -> None:
        self.live.pop(job.workload, None)
        job.status, job.ended_ms = status, at_ms
        job.held_ms = job.held_by = None
        self._ended(job)

    def _ended(self, job: Job) -> None:
        self.ended.pop(job.workload, None)
        self.ended[job.workload] = job
        while len(self.ended) > self.max_ended:
            del self.ended[next(iter(self.ended))]
            self.dropped += 1

    def _check(self, wid: str, state: State) -> None:
        """The state has the last word on ``wid``'s status."""
        folded = state.status_of(wid)
        job = self.get(wid)
        if folded is None or job is None or job.status == folded:
            return
        self.disagreements += 1
        self.last_disagreement = f"{wid}: job history {job.status}, fold {folded}"
        w = state.workloads.get(wid)
        if w is None:
            self.stopping.pop(wid, None)
            self._close(job, state.now_ms, "unknown")
            self._end(job, folded, state.now_ms)
            return
        if job.workload in self.ended:
            del self.ended[wid]
            job.ended_ms = None
            self.live[wid] = job
        job.status = w.status
        if w.status == "pending":
            self._close(job, state.now_ms, "unknown")

    # -- reading ---------------------------------------------------------------
    def newest_first(self) -> Iterator[Job]:
        """Live workloads (newest submission first), then ended ones (last ended first)."""
        yield from sorted(
            self.live.values(), key=lambda j: (j.submitted_ms, j.workload), reverse=True
        )
        yield from reversed(self.ended.values())


# -- JSON and words ------------------------------------------------------------------


def log_path(cluster: str, work_dir: str | None, node: str, workload: str, attempt: int) -> str:
    """Where the agent on ``node`` writes the output of ``attempt`` (docs/agent.md,
    "Folders and logs"): ``<work-dir>/<cluster>/<node>/<workload>/attempt-<n>/output.log``,
    ``<work-dir>`` left as it is when the agents' ``--work-dir`` is not known here."""
    root = (work_dir or WORK_DIR_PLACEHOLDER).rstrip("/") or "/"
    return f"{root}/{cluster}/{node}/{workload}/attempt-{attempt}/{LOG_NAME}"


def attempt_json(job: Job, a: Attempt, cluster: str, work_dir: str | None = None) -> dict[str, Any]:
    return {
        "attempt": a.number,
        "placement": [[n, g] for n, g in a.placement],
        "allocated": a.allocated,
        "start_ms": a.start_ms,
        "protected_until_ms": a.protected_until_ms,
        "end_ms": a.end_ms,
        "end": a.end,
        "outcome": a.outcome,
        "exit_code": a.exit_code,
        "preemption": None if a.preemption is None else dict(a.preemption),
        "logs": [
            {
                "node": n,
                "path": log_path(cluster, work_dir, n, job.workload, a.number),
                "started_ms": a.started.get(n),
            }
            for n, _ in a.placement
        ],
    }


def job_json(job: Job, cluster: str, work_dir: str | None = None) -> dict[str, Any]:
    """A workload's whole history as JSON (docs/formats.md, "Job history")."""
    return {
        "workload": job.workload,
        "owner": job.owner,
        "gpus": job.gpus,
        "gpu_type": job.gpu_type,
        "min_runtime_ms": job.min_runtime_ms,
        "resumable": job.resumable,
        "priority": job.priority,
        "submitted_by": job.submitted_by,
        "submitted_ms": job.submitted_ms,
        "command": list(job.command),
        "image": job.image,
        "duration_ms": job.duration_ms,
        "grace_ms": job.grace_ms,
        "status": job.status,
        "ended_ms": job.ended_ms,
        "cancelled_by": job.cancelled_by,
        "rejected": job.rejected,
        "exit_code": job.exit_code,
        "held_ms": job.held_ms,
        "held_by": job.held_by,
        "attempts": [attempt_json(job, a, cluster, work_dir) for a in job.attempts],
    }


def job_row(job: Job) -> dict[str, Any]:
    """One line of ``apportion jobs`` / ``GET /v1/jobs`` (``explain`` has the rest)."""
    last = job.attempts[-1] if job.attempts else None
    return {
        "workload": job.workload,
        "status": job.status,
        "owner": job.owner,
        "submitted_by": job.submitted_by,
        "gpus": job.gpus,
        "gpu_type": job.gpu_type,
        "submitted_ms": job.submitted_ms,
        "ended_ms": job.ended_ms,
        "attempts": len(job.attempts),
        "nodes": [n for n, _ in last.placement] if last is not None else [],
        "last_end": last.end if last is not None else None,
        "exit_code": job.exit_code,
        "cancelled_by": job.cancelled_by,
        "held_ms": job.held_ms,
        "held_by": job.held_by,
        "note": _note(job),
    }


def _note(job: Job) -> str:
    """Why it ended, in a few words."""
    if job.rejected is not None:
        return job.rejected
    if job.status == "cancelled":
        return f"cancelled by {job.cancelled_by or '(unknown)'}"
    if job.held_by is not None:
        return f"held by {job.held_by or '(unknown)'} (apportion release)"
    last = job.attempts[-1] if job.attempts else None
    if last is None:
        return ""
    pre = last.preemption
    if job.status == "preempted" and pre is not None:
        return _preempted_words(pre, last.end)
    return ""


def _preempted_words(pre: dict[str, Any], end: str | None) -> str:
    words = f"preempted ({pre['reason']}"
    if pre.get("for_workload"):
        words += f", for {pre['for_workload']}"
    if pre.get("grace_ms"):
        words += f", {_span(pre['grace_ms'])} notice"
    words += ")"
    if end == "node_down" and pre["reason"] != "node_down":
        words += ", then its host went down"
    return words


def _iso(ms: int) -> str:
    from .views import iso

    return iso(ms)


def _span(ms: int) -> str:
    from .views import span

    return span(ms)


def _relative(ms: int, now_ms: int) -> str:
    from .views import relative

    return relative(ms, now_ms)


def _when(ms: int, now_ms: int) -> str:
    from .views import when

    return when(ms, now_ms)


def attempt_words(j: dict[str, Any], a: dict[str, Any], now_ms: int) -> str:
    """``attempt 2 on h0:8, h1:8 from <time> to <time> (1 h 5 min): preempted (fairshare,
    for w-9, 30 s notice), requeued; exit code 143``."""
    nodes = ", ".join(f"{n}:{g}" for n, g in a["placement"])
    text = f"attempt {a['attempt']} on {nodes} from {_iso(a['start_ms'])}"
    if a["end_ms"] is None:
        text += f" ({_relative(a['start_ms'], now_ms)}): running"
        pre = a["preemption"]
        if pre is not None:
            text += f", stopping since {_iso(pre['at_ms'])}: " + _preempted_words(pre, None)
        return text
    text += f" to {_iso(a['end_ms'])} ({_span(a['end_ms'] - a['start_ms'])}): "
    end, pre = a["end"], a["preemption"]
    if end == "finished":
        text += f"finished, {a['outcome']}"
        if pre is not None:
            text += " (during its notice: " + _preempted_words(pre, None) + ")"
    elif end in ("preempted", "node_down") and pre is not None:
        text += _preempted_words(pre, end)
        text += ", requeued" if pre["requeued"] else ", not resumable: it ended"
    elif end == "node_down":
        text += "its host went down"
    elif end == "cancelled":
        text += f"cancelled by {j['cancelled_by'] or '(unknown)'}"
    else:
        text += str(end)
    if a["exit_code"] is not None:
        text += f"; exit code {a['exit_code']}"
    return text


def job_words(j: dict[str, Any], now_ms: int) -> list[str]:
    """The lines ``explain`` adds for a workload's history (``j``: :func:`job_json`)."""
    lines = []
    if j["status"] in ENDED_STATES and j["ended_ms"] is not None:
        end = f"ended {j['status']} at {_when(j['ended_ms'], now_ms)}"
        if j["status"] == "cancelled":
            end += f", cancelled by {j['cancelled_by'] or '(unknown)'}"
        elif j["status"] == "rejected":
            end = f"refused at {_when(j['ended_ms'], now_ms)}: {j['rejected']}"
        elif j["exit_code"] is not None:
            end += f", exit code {j['exit_code']}"
        lines.append(end)
    contract = f"min runtime {_span(j['min_runtime_ms'])}" if j["min_runtime_ms"] else "unallocated"
    typ = "" if j["gpu_type"] in ("", "any") else f" {j['gpu_type']}"
    lines.append(
        f"submitted by {j['submitted_by'] or '(unknown)'} at {_when(j['submitted_ms'], now_ms)} "
        f"to {j['owner']}: {j['gpus']}{typ} GPUs, {contract}, "
        + ("resumable" if j["resumable"] else "not resumable")
    )
    if j["command"]:
        lines.append("command: " + shlex.join(j["command"]))
    else:
        lines.append("command: none (the executor runs a placeholder for its duration)")
    if j["image"]:
        lines.append(f"image: {j['image']}")
    for a in j["attempts"]:
        lines.append(attempt_words(j, a, now_ms))
        for log in a["logs"]:
            if log["started_ms"] is not None:  # an agent started it there: its log is there
                lines.append(f"log of attempt {a['attempt']} on {log['node']}: {log['path']}")
    if not j["attempts"] and j["status"] != "rejected":
        lines.append("never placed")
    return lines


# -- the query of `apportion jobs` / GET /v1/jobs -------------------------------------


class QueryError(ValueError):
    """A query parameter out of its form or bound (one line naming it and the bound)."""


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|min|h|d|w)$")
_UNIT_MS = {"s": 1000, "m": MINUTE_MS, "min": MINUTE_MS, "h": HOUR_MS, "d": DAY_MS, "w": 7 * DAY_MS}


_SIM_TIME = re.compile(r"^day\s+(\d{1,6})(?:\s+(\d{1,2}):(\d{2}))?$", re.IGNORECASE)


def parse_since(text: str, now_ms: int) -> int:
    """``since`` of ``apportion jobs``: see :func:`parse_when`."""
    return parse_when(text, now_ms, "since")


def parse_when(text: str, now_ms: int, name: str) -> int:
    """A point in time given as a duration back from now (``90m``, ``12h``, ``2d``,
    ``1w``; at most a year), an ISO-8601 date or time (``2026-11-30``,
    ``2026-11-30T14:05:00Z``; no zone = UTC), epoch milliseconds, or simulated
    time (``day 3``, ``day 3 14:05``: day 0 starts at epoch 0); the epoch ms it
    names. :class:`QueryError` (naming the parameter ``name``) otherwise."""
    t = text.strip()
    m = _DURATION.match(t)
    if m:
        ms = int(float(m.group(1)) * _UNIT_MS[m.group(2)])
        if ms > MAX_SINCE_MS:
            raise QueryError(f"{name}: {text!r} is more than a year back (use an ISO time)")
        return now_ms - ms
    if t.isdigit() and len(t) <= 15:
        return int(t)
    sim = _SIM_TIME.match(t)
    if sim:
        hour, minute = int(sim[2] or 0), int(sim[3] or 0)
        if hour > 23 or minute > 59:
            raise QueryError(f"{name}: {text!r}: the time of day is HH:MM, 00:00 to 23:59")
        return (int(sim[1]) * 24 * 60 + hour * 60 + minute) * MINUTE_MS
    try:
        when = _dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise QueryError(
            f"{name}: {text[:64]!r} is neither a duration (2d, 12h, 90m), an ISO-8601 time "
            "(2026-11-30T14:05:00Z), a simulated time (day 3 14:05) nor epoch ms"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.UTC)
    return int(when.timestamp() * 1000)


class JobQuery:
    """Which jobs to list: every filter given must hold."""

    __slots__ = ("states", "user", "team", "id", "since_ms", "limit", "gpu_type")

    def __init__(
        self,
        states: tuple[str, ...] = ENDED_STATES,
        user: str | None = None,
        team: str | None = None,
        id: str | None = None,
        since_ms: int | None = None,
        limit: int = DEFAULT_LIMIT,
        gpu_type: str | None = None,
    ) -> None:
        self.states = states
        self.user = user
        self.team = team
        self.id = id
        self.since_ms = since_ms
        self.limit = limit
        self.gpu_type = gpu_type

    @classmethod
    def parse(
        cls, query: Mapping[str, str], now_ms: int, gpu_types: Iterable[str] = ()
    ) -> JobQuery:
        """From query parameters (``state``, ``user``, ``team``, ``id``, ``since``,
        ``limit``, ``gpu_type``: one of ``gpu_types``, the cluster's, or ``any``);
        :class:`QueryError` names the first one out of bounds."""
        names = ("state", "user", "team", "id", "since", "limit", "gpu_type")
        unknown = sorted(set(query) - set(names))
        if unknown:
            raise QueryError(f"unknown parameter {unknown[0][:64]!r} (known: {', '.join(names)})")
        states = parse_states(query.get("state", "ended"))
        user = _bounded(query, "user", MAX_NAME_LEN)
        team = _bounded(query, "team", MAX_PATH_LEN)
        if team is not None:
            team = team.strip("/")
        wid = _bounded(query, "id", MAX_NAME_LEN)
        since = parse_since(query["since"], now_ms) if query.get("since") else None
        limit = DEFAULT_LIMIT
        if "limit" in query:
            text = query["limit"].strip()
            if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
                raise QueryError(f"limit: a whole number from 1 to {MAX_LIMIT}")
            limit = int(text)
        gpu_type = parse_gpu_type(query.get("gpu_type"), gpu_types)
        return cls(states, user, team, wid, since, limit, gpu_type)

    def matches(self, job: Job) -> bool:
        if job.status not in self.states and not (HELD in self.states and job.held_ms is not None):
            return False
        if self.gpu_type is not None and (job.gpu_type or ANY_GPU_TYPE) != self.gpu_type:
            return False
        if self.user is not None and job.submitted_by != self.user:
            return False
        if self.team and not (job.owner == self.team or job.owner.startswith(self.team + "/")):
            return False
        if self.id and self.id not in job.workload:
            return False
        return not (
            self.since_ms is not None and job.ended_ms is not None and job.ended_ms < self.since_ms
        )


def parse_states(text: str) -> tuple[str, ...]:
    """``state``: statuses, ``held``, and groups (``ended``, ``live``, ``all``),
    comma-separated."""
    out: list[str] = []
    for part in text.split(","):
        name = part.strip().lower()
        if not name:
            continue
        group = STATE_GROUPS.get(name, (name,) if name in (*STATES, HELD) else None)
        if group is None:
            raise QueryError(
                f"state: {name[:32]!r} is not one of {', '.join(STATES)}, {HELD} "
                f"(or {', '.join(STATE_GROUPS)})"
            )
        out.extend(s for s in group if s not in out)
    if not out:
        raise QueryError(f"state: give one of {', '.join(STATES)} (or {', '.join(STATE_GROUPS)})")
    return tuple(out)


def parse_gpu_type(text: str | None, known: Iterable[str]) -> str | None:
    """The ``gpu_type`` filter of ``/v1/queue`` and ``/v1/jobs``: one of the cluster's
    types (``known``) or ``any`` (work that takes any type); ``None`` when not given.
    :class:`QueryError` lists the known ones."""
    if not text:
        return None
    types = list(known)
    if text not in types and text != ANY_GPU_TYPE:
        listed = ", ".join(types) or "none registered"
        raise QueryError(
            f"gpu_type: {text[:64]!r} is not a GPU type of this cluster "
            f"(known: {listed}; or {ANY_GPU_TYPE})"
        )
    return text


def _bounded(query: Mapping[str, str], name: str, most: int) -> str | None:
    value = query.get(name)
    if value is None or value == "":
        return None
    if len(value) > most:
        raise QueryError(f"{name}: at most {most} characters")
    return value


def list_jobs(history: JobHistory, query: JobQuery, now_ms: int) -> dict[str, Any]:
    """``GET /v1/jobs``: the jobs ``query`` matches, live ones first (newest
    submission first), then ended ones (last ended first), at most ``limit``."""
    rows: list[dict[str, Any]] = []
    matched = 0
    for job in history.newest_first():
        if query.matches(job):
            matched += 1
            if len(rows) < query.limit:
                rows.append(job_row(job))
    return {
        "now_ms": now_ms,
        "jobs": rows,
        "matched": matched,
        "truncated": matched > len(rows),
        "limit": query.limit,
        "states": list(query.states),
        "since_ms": query.since_ms,
        "kept": {
            "live": len(history.live),
            "ended": len(history.ended),
            "max_ended": history.max_ended,
            "dropped": history.dropped,
        },
    }
