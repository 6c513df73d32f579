"""Job history (services/job_history.py): every workload's submission, attempts and
end, for ``explain`` of an ended workload, ``apportion jobs``, ``GET /v1/jobs`` and
the dashboard's jobs page.

The job history is an observer of the one fold, like the projection: the same
histories (each way a notice can end, issue 25's checkpoint/resume flow, and the
random histories of the core's fold machine) are folded and shown to a
:class:`~apportion.services.job_history.JobHistory` and to a DuckDB
:class:`~apportion.replay.projection.Projection`, and compared field by field:
every workload's status against the fold's, every attempt (host, GPUs, start,
end, how it ended) against the projection's ``runs`` rows. Then the words of
``explain``, the query's bounds, and the HTTP endpoint, the CLI and the
dashboard page against a real gateway on a real nats-server.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import duckdb
import pytest
from apportion.core.history import fold_item
from apportion.core.state import State
from apportion.replay.projection import Projection
from apportion.schemas.events import (
    ClockTicked,
    NodeHealthChanged,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadHeld,
    WorkloadReleased,
    WorkloadStarted,
)
from apportion.schemas.history import HistoryItem
from apportion.services.job_history import (
    ENDED_STATES,
    MAX_LIMIT,
    STATES,
    JobHistory,
    JobQuery,
    QueryError,
    list_jobs,
    log_path,
    parse_since,
)
from apportion.services.views import explain, replay_history
from hypothesis import HealthCheck, settings
from services_helpers import APPORTION_CMD, eventually, gateway_on
from test_agent_cli import up_agents  # noqa: F401 - the `apportion up --agents 2` fixture
from test_cli_live import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "replay"))

from test_projection_agrees import (
    ENDS,
    GRACE,
    HOUR,
    MIN,
    Live,
    ProjectionMachine,
    noticed,
)

if TYPE_CHECKING:
    from apportion.services.bus import JetStreamLog
    from conftest import Credentials


# -- the same meaning as the fold and the projection -----------------------------------


def disagreements(jobs: JobHistory, state: State, con: duckdb.DuckDBPyConnection) -> list[str]:
    """Where the job history differs from the folded ``state`` and the projection in ``con``."""
    out: list[str] = []
    if jobs.disagreements:
        out.append(f"corrected by the state: {jobs.last_disagreement}")
    for wid in sorted(set(state.workloads) | set(state.ended)):
        job = jobs.get(wid)
        folded = state.status_of(wid)
        if job is None or job.status != folded:
            out.append(f"{wid}: {job.status if job else 'missing'}, fold {folded}")
            continue
        w = state.workloads.get(wid)
        if w is not None and len(job.attempts) != w.attempt:
            out.append(f"{wid}: {len(job.attempts)} attempts, fold {w.attempt}")
        if w is not None and w.status == "running":
            run = job.current
            mine = None if run is None else (run.placement, run.start_ms)
            fold = (tuple((s.node, s.gpus) for s in w.placement), w.started_ms)
            if mine != fold:
                out.append(f"{wid}: running {mine}, fold {fold}")
        if (job.ended_ms is None) != (w is not None):
            out.append(f"{wid}: ended_ms {job.ended_ms} for a {folded} workload")
        fold_held = (None, None) if w is None or not w.held else (w.held_ms, w.held_by)
        if (job.held_ms, job.held_by) != fold_held:
            out.append(f"{wid}: held {(job.held_ms, job.held_by)}, fold {fold_held}")
    runs = sorted(
        con.execute(
            "SELECT workload, attempt, node, gpus, start_ms, end_ms, end_reason FROM runs"
        ).fetchall()
    )
    mine_runs = sorted(
        (j.workload, a.number, node, gpus, a.start_ms, a.end_ms, a.end)
        for j in [*jobs.live.values(), *jobs.ended.values()]
        for a in j.attempts
        for node, gpus in a.placement
    )
    if mine_runs != runs:
        out.append(f"attempts {mine_runs}, projection runs {runs}")
    ended = dict(
        con.execute(
            "SELECT workload, ended_ms FROM workloads WHERE ended_ms IS NOT NULL "
            "AND status <> 'rejected'"
        ).fetchall()
    )
    mine_ended = {j.workload: j.ended_ms for j in jobs.ended.values() if j.status != "rejected"}
    if mine_ended != ended:
        out.append(f"ended {mine_ended}, projection {ended}")
    rejected = {
        r[0]
        for r in con.execute("SELECT workload FROM workloads WHERE status = 'rejected'").fetchall()
    }
    mine_rejected = {j.workload for j in jobs.ended.values() if j.status == "rejected"}
    if mine_rejected != rejected:
        out.append(f"rejected {mine_rejected}, projection {rejected}")
    return out


def check_each_item(items: list[HistoryItem]) -> JobHistory:
    """Fold ``items`` one at a time into a state, a job history and a projection,
    comparing them after every item; the job history."""
    con = duckdb.connect()
    projection, jobs, state = Projection(con), JobHistory(), State()
    for i, item in enumerate(items):
        rejected = fold_item(state, item)
        projection(item, state, rejected)
        jobs(item, state, rejected)
        projection.commit(state)
        assert disagreements(jobs, state, con) == [], f"after item {i + 1}: {item}"
    return jobs


def checkpoint_flow() -> Live:
    """Issue 25: ``a1`` preempted with notice for ``b1`` exits 143 while it
    checkpoints, is requeued, placed again and succeeds."""
    live = noticed()
    live.input(
        WorkloadStarted(
            id="st1", at_ms=HOUR + 1000, workload="a1", attempt=1, node="n1", actor="agent:n1"
        )
    )
    live.finished("a1", "failed", HOUR + 30_000, 1, exit_code=143)
    live.finished("b1", "succeeded", 2 * HOUR, 1, exit_code=0)
    live.finished("a1", "succeeded", 3 * HOUR, 2, exit_code=0)
    return live


def test_the_checkpoint_flow_is_kept_as_folded_and_projected() -> None:
    jobs = check_each_item(checkpoint_flow().items)
    a1 = jobs.get("a1")
    assert a1 is not None and a1.status == "succeeded" and a1.ended_ms == 3 * HOUR
    first, second = a1.attempts
    assert (first.end, first.end_ms, first.outcome, first.exit_code) == (
        "preempted",
        HOUR + 30_000,
        "failed",
        143,
    )
    assert first.preemption == {
        "at_ms": HOUR,
        "reason": "fairshare",
        "for_workload": "b1",
        "grace_ms": GRACE,
        "requeued": True,
    }
    assert first.started == {"n1": HOUR + 1000}
    assert (second.start_ms, second.end, second.outcome) == (2 * HOUR, "finished", "succeeded")


@pytest.mark.parametrize("resumable", [True, False])
@pytest.mark.parametrize("end", list(ENDS))
def test_every_way_a_notice_ends_is_kept_as_folded(end: str, resumable: bool) -> None:
    live = noticed(resumable=resumable)
    ENDS[end](live)
    live.input(ClockTicked(id="later", at_ms=4 * HOUR))
    jobs = check_each_item(live.items)
    (run,) = jobs.get("a1").attempts  # type: ignore[union-attr]
    assert run.preemption is not None and run.preemption["for_workload"] == "b1"
    expected = {
        "deadline": ("preempted", HOUR + GRACE),
        "failed report after the deadline": ("preempted", HOUR + GRACE),
        "succeeded during the notice": ("finished", HOUR + 30_000),
        "cancelled during the notice": ("cancelled", HOUR + 30_000),
        "host down during the notice": ("node_down", HOUR + 30_000),
    }[end]
    assert (run.end, run.end_ms) == expected


def test_a_refused_submission_and_a_refused_report_change_nothing() -> None:
    live = Live()
    live.submit("a1", "a", 0)
    # a submission to a node that is not a leaf's owner... refused: an unknown owner
    from apportion.schemas.events import WorkloadSubmitted

    live.input(
        WorkloadSubmitted(
            id="s-bad",
            at_ms=1,
            workload="bad",
            owner="nope",
            gpus=8,
            min_runtime_ms=MIN,
            submitted_by="root",
        ),
        refused=True,
    )
    # the same id again: refused as a duplicate, the first one's history stays
    live.input(
        WorkloadSubmitted(
            id="s-a1-again",
            at_ms=2,
            workload="a1",
            owner="b",
            gpus=8,
            min_runtime_ms=MIN,
            submitted_by="root",
        ),
        refused=True,
    )
    live.finished("a1", "failed", 3, 7, refused=True)  # a stale attempt
    live.input(WorkloadCancelled(id="c", at_ms=4, workload="a1", actor="nobody"), refused=True)
    jobs = check_each_item(live.items)
    a1, bad = jobs.get("a1"), jobs.get("bad")
    assert a1 is not None and a1.status == "running" and a1.owner == "a"
    assert bad is not None and bad.status == "rejected" and "nope" in (bad.rejected or "")


def test_a_hold_and_release_are_kept_as_folded_and_projected() -> None:
    """``w2`` waits behind ``w1`` on the one node; held at 1 min, it is not placed when
    ``w1`` ends at 2 min; released at 3 min, it is placed at once. The projection's
    ``held_ms``/``held_by`` and the job history follow the fold at every item; a
    refused hold (of running work) and release (of unheld work) change nothing."""
    live = Live()
    live.submit("w1", "a", 0)
    live.submit("w2", "a", 1)
    live.input(WorkloadHeld(id="h", at_ms=MIN, workload="w2", actor="root"))
    live.input(WorkloadHeld(id="h-run", at_ms=MIN, workload="w1", actor="root"), refused=True)
    live.finished("w1", "succeeded", 2 * MIN, 1)
    assert live.state.workloads["w2"].status == "pending"  # held: the free node waits
    con = duckdb.connect()
    projection, state = Projection(con), State()
    jobs = check_each_item(live.items)
    for item in live.items:
        projection(item, state, fold_item(state, item))
    projection.commit(state)
    assert con.execute(
        "SELECT status, held_ms, held_by FROM workloads WHERE workload = 'w2'"
    ).fetchall() == [("pending", MIN, "root")]
    w2 = jobs.get("w2")
    assert w2 is not None and (w2.held_ms, w2.held_by) == (MIN, "root")
    query = JobQuery.parse({"state": "held"}, 2 * MIN)
    assert [r["workload"] for r in list_jobs(jobs, query, 2 * MIN)["jobs"]] == ["w2"]
    row = list_jobs(jobs, query, 2 * MIN)["jobs"][0]
    assert row["held_ms"] == MIN and row["note"] == "held by root (apportion release)"
    live.input(WorkloadReleased(id="r-bad", at_ms=3 * MIN, workload="w1", actor="root"), True)
    placed = live.input(WorkloadReleased(id="r", at_ms=3 * MIN, workload="w2", actor="root"))
    assert [type(d).__name__ for d in placed] == ["WorkloadPlaced"]
    jobs = check_each_item(live.items)
    w2 = jobs.get("w2")
    assert w2 is not None and w2.status == "running" and w2.held_ms is None
    assert list_jobs(jobs, query, 3 * MIN)["jobs"] == []


class JobHistoryMachine(ProjectionMachine):
    """The core's fold machine: at the end of each random history the same items are
    folded, projected and kept as job history, compared after every item."""

    def teardown(self) -> None:
        check_each_item(self.history())


JobHistoryMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestJobHistoryMachine = JobHistoryMachine.TestCase


# -- explain's words -------------------------------------------------------------------


def test_explain_of_an_ended_workload_gives_its_whole_history() -> None:
    live = checkpoint_flow()
    live.submit("c1", "a", 4 * HOUR)
    live.input(WorkloadCancelled(id="cc", at_ms=4 * HOUR + MIN, workload="c1", actor="root"))
    state, history = replay_history(live.items, cluster="demo")
    out = explain(state, history, "a1")
    assert out is not None and out["status"] == "succeeded"
    text = "\n".join(out["reasons"])
    assert text.startswith("ended succeeded at 1970-01-01T03:00:00Z"), text
    assert "exit code 0" in out["reasons"][0]
    assert "submitted by root at 1970-01-01T00:00:00Z" in text
    assert (
        "attempt 1 on n1:8 from 1970-01-01T00:00:00Z to 1970-01-01T01:00:30Z (1 h): "
        "preempted (fairshare, for b1, 2 min notice), requeued; exit code 143"
    ) in text
    assert "attempt 2 on n1:8 from 1970-01-01T02:00:00Z to 1970-01-01T03:00:00Z (1 h): " in text
    # the log where the host's agent wrote it (an agent reported starting attempt 1)
    assert "log of attempt 1 on n1: <work-dir>/demo/n1/a1/attempt-1/output.log" in text
    job = out["job"]
    assert [a["end"] for a in job["attempts"]] == ["preempted", "finished"]
    assert job["attempts"][0]["logs"] == [
        {
            "node": "n1",
            "path": "<work-dir>/demo/n1/a1/attempt-1/output.log",
            "started_ms": HOUR + 1000,
        }
    ]
    assert job["exit_code"] == 0 and job["submitted_by"] == "root" and job["command"] == []
    # who cancelled: the actor of the accepted cancel
    out = explain(state, history, "c1")
    assert out is not None and out["status"] == "cancelled"
    assert out["reasons"][0].startswith("ended cancelled at 1970-01-01T04:01:00Z")
    assert "cancelled by root" in out["reasons"][0] and out["job"]["cancelled_by"] == "root"
    # a live one shows its attempts so far too
    live2 = noticed()
    state, history = replay_history(live2.items)
    out = explain(state, history, "a1")
    assert out is not None and out["status"] == "running"
    assert any("stopping since" in r and "for b1" in r for r in out["reasons"]), out["reasons"]


def test_explain_of_a_host_lost_and_a_workload_no_longer_kept() -> None:
    live = noticed(resumable=False)
    live.input(
        NodeHealthChanged(id="down", at_ms=HOUR + 30_000, node="n1", state="down", actor="root")
    )
    state, history = replay_history(live.items)
    out = explain(state, history, "a1")
    assert out is not None and out["status"] == "preempted"
    assert "then its host went down, not resumable: it ended" in "\n".join(out["reasons"])
    # the bound: only the last ended workloads are kept; explain still answers
    jobs = history.jobs
    jobs.max_ended = 0
    jobs._ended(jobs.ended.pop("a1"))
    assert jobs.dropped == 1 and jobs.get("a1") is None
    out = explain(state, history, "a1")
    assert out is not None and out["status"] == "preempted" and "job" not in out
    assert "not kept here any more" in out["reasons"][-1]


def test_log_locations() -> None:
    assert log_path("demo", None, "h0", "w1", 2) == "<work-dir>/demo/h0/w1/attempt-2/output.log"
    assert (
        log_path("demo", "/srv/agents/", "h0", "w1", 1)
        == "/srv/agents/demo/h0/w1/attempt-1/output.log"
    )


# -- the query -------------------------------------------------------------------------


def test_the_query_filters_and_its_bounds() -> None:
    live = checkpoint_flow()
    live.submit("c1", "a", 4 * HOUR)
    live.input(WorkloadCancelled(id="cc", at_ms=4 * HOUR + MIN, workload="c1", actor="root"))
    live.submit("p1", "b", 5 * HOUR)  # runs
    _, history = replay_history(live.items)
    jobs, now = history.jobs, 6 * HOUR

    def ids(**q: str) -> list[str]:
        return [r["workload"] for r in list_jobs(jobs, JobQuery.parse(q, now), now)["jobs"]]

    assert ids() == ["c1", "a1", "b1"]  # ended, last ended first
    assert ids(state="all") == ["p1", "c1", "a1", "b1"]
    assert ids(state="live") == ids(state="running") == ["p1"]
    assert ids(state="succeeded,cancelled") == ["c1", "a1", "b1"]
    assert ids(state="cancelled") == ["c1"]
    assert ids(team="a") == ["c1", "a1"] and ids(team="b", state="all") == ["p1", "b1"]
    assert ids(team="a/") == ids(team="a") and ids(team="") == ids()
    assert ids(user="root") == ids() and ids(user="nobody") == []
    assert ids(id="1") == ["c1", "a1", "b1"] and ids(id="b") == ["b1"]
    assert ids(since="3h") == ["c1", "a1"]  # ended at or after 6 h - 3 h
    assert ids(since="1970-01-01T03:00:00Z") == ["c1", "a1"] and ids(since="10800000") == ids(
        since="3h"
    )
    assert ids(since="1h", state="all") == ["p1"]  # live ones always match since
    answer = list_jobs(jobs, JobQuery.parse({"limit": "1"}, now), now)
    assert answer["matched"] == 3 and answer["truncated"] and len(answer["jobs"]) == 1
    row = answer["jobs"][0]
    assert row == {
        "workload": "c1",
        "status": "cancelled",
        "owner": "a",
        "submitted_by": "root",
        "gpus": 8,
        "gpu_type": "any",
        "submitted_ms": 4 * HOUR,
        "ended_ms": 4 * HOUR + MIN,
        "attempts": 1,
        "nodes": ["n1"],
        "last_end": "cancelled",
        "exit_code": None,
        "cancelled_by": "root",
        "held_ms": None,
        "held_by": None,
        "note": "cancelled by root",
    }
    bad = {
        "state": ({"state": "done"}, "state: 'done' is not one of"),
        "empty state": ({"state": ","}, "state: give one of"),
        "limit 0": ({"limit": "0"}, f"limit: a whole number from 1 to {MAX_LIMIT}"),
        "limit over": ({"limit": str(MAX_LIMIT + 1)}, "limit: a whole number"),
        "limit text": ({"limit": "ten"}, "limit: a whole number"),
        "since": ({"since": "yesterday"}, "since: 'yesterday' is neither a duration"),
        "since too far": ({"since": "400d"}, "more than a year back"),
        "user": ({"user": "u" * 129}, "user: at most 128 characters"),
        "team": ({"team": "t" * 257}, "team: at most 256 characters"),
        "unknown": ({"owner": "a"}, "unknown parameter 'owner'"),
    }
    for name, (query, message) in bad.items():
        with pytest.raises(QueryError) as exc:
            JobQuery.parse(query, now)
        assert message in str(exc.value) and "\n" not in str(exc.value), name
    assert set(ENDED_STATES) < set(STATES)
    assert parse_since("2d", 3 * 86_400_000) == 86_400_000


# -- against a real gateway ------------------------------------------------------------


async def _http(
    s: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with s.get(url, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*APPORTION_CMD, *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.nats
async def test_jobs_endpoint_cli_and_page(jlog: JetStreamLog, creds: Credentials) -> None:
    import os

    async with (
        gateway_on(jlog, creds.authenticator) as gw,
        aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s,
    ):
        url, ops, alice = gw.url, creds.headers("ops"), creds.headers("alice")
        spec = {"owner": "llm/a", "gpus": 8, "min_runtime_ms": 60_000}
        for wid in ("done", "gone", "waits"):
            async with s.post(f"{url}/v1/workloads", json={**spec, "id": wid}, headers=alice) as r:
                assert r.status == 202, await r.text()
        await eventually(
            lambda: {"done", "gone"} <= set(gw.state.running) and "waits" in gw.state.pending,
            what="two placed, one waiting",
        )
        host = gw.state.running["done"].placement[0].node
        await jlog.publish_input(
            WorkloadFinished(
                id="fin-done",
                at_ms=0,
                workload="done",
                outcome="failed",
                attempt=1,
                exit_code=3,
                actor=f"agent:{host}",
            )
        )
        async with s.post(f"{url}/v1/workloads/gone/cancel", json={}, headers=ops) as r:
            assert r.status == 202
        await eventually(
            lambda: (
                gw.state.ended.get("done") == "failed" and gw.state.ended.get("gone") == "cancelled"
            ),
            what="one failed, one cancelled",
        )
        # the endpoint: ended by default, filters, the same authority as explain (a token)
        status, body = await _http(s, f"{url}/v1/jobs", alice)
        assert status == 200 and [r["workload"] for r in body["jobs"]] == ["gone", "done"]
        done = body["jobs"][1]
        assert (done["status"], done["exit_code"], done["submitted_by"]) == ("failed", 3, "alice")
        assert body["jobs"][0]["cancelled_by"] == "ops"
        status, body = await _http(s, f"{url}/v1/jobs?state=all&team=llm&limit=2", alice)
        assert status == 200 and body["matched"] == 3 and body["truncated"]
        assert [r["workload"] for r in body["jobs"]] == ["waits", "gone"]
        status, body = await _http(s, f"{url}/v1/jobs?state=failed&user=alice&since=1h", ops)
        assert [r["workload"] for r in body["jobs"]] == ["done"]
        status, body = await _http(s, f"{url}/v1/jobs?team=vision", ops)
        assert status == 200 and body["jobs"] == [] and body["matched"] == 0
        for query, words in (
            ("state=done", "state: 'done'"),
            ("limit=0", "limit: a whole number from 1 to 1000"),
            ("since=soon", "since: 'soon'"),
            ("colour=red", "unknown parameter 'colour'"),
            ("user=" + "u" * 200, "user: at most 128 characters"),
        ):
            status, body = await _http(s, f"{url}/v1/jobs?{query}", ops)
            assert status == 400 and body["code"] == "bad_query", (query, body)
            assert words in body["error"], (query, body)
        status, body = await _http(s, f"{url}/v1/jobs")
        assert status == 401 and body["code"] == "not_authenticated"
        # explain over HTTP: the attempt, its end, the exit code
        status, body = await _http(s, f"{url}/v1/explain/done", alice)
        assert status == 200 and body["status"] == "failed"
        (attempt,) = body["job"]["attempts"]
        assert (attempt["end"], attempt["outcome"], attempt["exit_code"]) == (
            "finished",
            "failed",
            3,
        )
        assert attempt["logs"][0]["path"].endswith(
            f"/{gw.log.subjects.cluster}/{host}/done/attempt-1/output.log"
        )
        status, doc = await _http(s, f"{url}/openapi.json")
        assert "/v1/jobs" in doc["paths"]

        # the command line, as a user runs it
        env = {
            **os.environ,
            "APPORTION_URL": url,
            "APPORTION_TOKEN_FILE": str(creds.token_files["alice"]),
        }
        out = await asyncio.to_thread(_cli, "jobs", env=env)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split()[:3] == ["WORKLOAD", "STATE", "OWNER"]
        assert lines[1].split()[:2] == ["gone", "cancelled"] and "cancelled by ops" in lines[1]
        assert lines[2].split()[:2] == ["done", "failed"] and " 3  " in lines[2]
        assert lines[-1] == "2 matched"
        out = await asyncio.to_thread(_cli, "jobs", "--all", "--team", "llm/a", "--json", env=env)
        assert out.returncode == 0 and json.loads(out.stdout)["matched"] == 3
        out = await asyncio.to_thread(_cli, "jobs", "--state", "finished", env=env)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.startswith("apportion: state: 'finished' is not one of")
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
        out = await asyncio.to_thread(_cli, "jobs", "--since", "2x", env=env)
        assert out.returncode == 2 and out.stderr.startswith("apportion: since: '2x'")
        out = await asyncio.to_thread(_cli, "explain", "done", env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("done: failed\n  - ended failed at ")
        assert "exit code 3" in out.stdout and "attempt 1 on " in out.stdout

        # the dashboard: the jobs page in the navigation, its search, its live part
        async with s.post(
            f"{url}/ui/login", data={"token": creds.tokens["alice"]}, allow_redirects=False
        ) as r:
            assert r.status == 303
        async with s.get(f"{url}/ui/jobs") as r:
            text = await r.text()
            assert r.status == 200 and '<a href="/ui/jobs" class=active>Jobs</a>' in text
            assert 'id="job-search"' in text and "2 matched" in text
            assert '<a href="/ui/workload/done">done</a>' in text
        async with s.get(f"{url}/ui/jobs?state=cancelled&user=&team=llm") as r:
            text = await r.text()
            assert r.status == 200 and "1 matched" in text and "/ui/workload/gone" in text
            assert "/ui/workload/done" not in text
            assert 'data-live="jobs?team=llm&amp;state=cancelled"' in text
        async with s.get(f"{url}/ui/jobs?since=tomorrow") as r:
            assert r.status == 400 and "since: &#39;tomorrow&#39;" in await r.text()
        async with s.get(f"{url}/ui/live?page=jobs&id=don") as r:
            html = (await r.json())["html"]
            assert "1 matched" in html and "/ui/workload/done" in html
        async with s.get(f"{url}/ui/workload/done") as r:
            text = await r.text()
            assert 'id="wl-attempts"' in text and "finished (failed)" in text


# -- with real host agents: the log explain names is the one the agent wrote -----------


@pytest.mark.nats
def test_explain_names_the_log_the_agent_wrote(up_agents) -> None:  # noqa: F811
    import time

    env, _proc, _root = up_agents

    def answer(*args: str) -> Any:
        got = run([*args, "--json"], env)
        return json.loads(got.stdout) if got.returncode == 0 else None

    def wait(check: Any, what: str) -> Any:
        deadline = time.monotonic() + 60
        while not (got := check()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)
        return got

    wait(lambda: answer("status"), "the gateway to answer")
    code = "import sys; print('hello from the job'); sys.exit(5)"
    sub = ["submit", "--owner", "llm/pretrain", "--gpus", "1", "--min-runtime", "0"]
    assert run([*sub, "--id", "exits5", "--", "python3", "-c", code], env).returncode == 0
    assert run([*sub, "--id", "sleeps", "--", "sleep", "120"], env).returncode == 0
    started = wait(
        lambda: (
            (ex := answer("explain", "sleeps"))
            and ex["status"] == "running"
            and ex["job"]["attempts"][0]["logs"][0]["started_ms"] is not None
        ),
        "the agent to report starting sleeps",
    )
    assert started
    done = wait(
        lambda: (ex := answer("explain", "exits5")) and ex["status"] == "failed" and ex,
        "exits5 to fail",
    )
    assert run(["cancel", "sleeps"], env).returncode == 0
    (attempt,) = done["job"]["attempts"]
    assert (attempt["end"], attempt["exit_code"], done["job"]["exit_code"]) == ("finished", 5, 5)
    (log,) = attempt["logs"]
    path = Path(log["path"])
    assert path.is_absolute() and "hello from the job" in path.read_text(), log
    gone = wait(
        lambda: (ex := answer("explain", "sleeps")) and ex["status"] == "cancelled" and ex,
        "sleeps to be cancelled",
    )
    assert gone["job"]["cancelled_by"] == "admin"
    assert gone["job"]["attempts"][0]["end"] == "cancelled"
    text = run(["explain", "exits5"], env).stdout
    assert "ended failed at " in text and "exit code 5" in text, text
    assert f"log of attempt 1 on {log['node']}: {path}" in text, text
    listed = answer("jobs")
    assert [r["workload"] for r in listed["jobs"]] == ["sleeps", "exits5"], listed
