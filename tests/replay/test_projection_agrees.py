"""The DuckDB projection means what the fold means, input by input.

The same history is folded (:mod:`apportion.core.fold`) and shown to a
:class:`~apportion.replay.projection.Projection`; :func:`disagreements` then
compares them field by field: every workload's status, its preemptions, submit
and first placement, which runs are open (node, GPUs, attempt, start), how many
attempts it had and how long its closed runs lasted (the fold's progress), and
which queue episodes are open (since when).

The hand-built histories run the real scheduler cycle after each input
(:func:`~apportion.core.history.decide_batch`) and follow a run preempted with
notice to each way its notice can end (docs/semantics.md, "Preemption notice");
the first is issue 25's checkpoint/resume flow: the process exits non-zero
during its notice, its executor reports ``WorkloadFinished(failed)``, the
workload is requeued and placed again. The random histories are those of the
core's fold state machine (``tests/core/test_fold_machine.py``), compared at the
end of each, with the projection restarted from its committed position midway.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

import test_fold_machine as fold_machine
from apportion.core.history import decide_batch, fold_history, fold_item
from apportion.core.state import State
from apportion.replay.projection import Projection
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    DecisionBatch,
    Event,
    Input,
    InputRejected,
    NodeDrained,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadSubmitted,
)
from apportion.schemas.history import BatchItem, HistoryItem, InputItem
from hypothesis import HealthCheck, settings

MIN = 60_000
HOUR = 60 * MIN
GRACE = 2 * MIN
DECISION_TYPES = (WorkloadPlaced, WorkloadPreempted, NodeDrained, InputRejected)


def disagreements(state: State, con: duckdb.DuckDBPyConnection) -> list[str]:
    """Where the committed projection in ``con`` and the folded ``state`` differ."""
    out: list[str] = []
    rows = {
        r[0]: r
        for r in con.execute(
            "SELECT workload, status, preemptions, submitted_ms, first_placed_ms, held_ms, "
            "held_by FROM workloads"
        ).fetchall()
    }
    for wid in sorted(set(state.workloads) | set(state.ended)):
        if wid not in rows:
            out.append(f"{wid}: no workloads row (fold: {state.status_of(wid)})")
    attempts = dict(
        con.execute("SELECT workload, max(attempt) FROM runs GROUP BY workload").fetchall()
    )
    ran = dict(
        con.execute(
            "SELECT workload, sum(end_ms - start_ms) FROM attempts WHERE end_ms IS NOT NULL "
            "GROUP BY workload"
        ).fetchall()
    )
    for wid, (_, status, preemptions, submitted, first, held_ms, held_by) in sorted(rows.items()):
        folded = state.status_of(wid)
        if status == "rejected":
            if folded is not None:
                out.append(f"{wid}: projection rejected, fold {folded}")
            continue
        if status != folded:
            out.append(f"{wid}: status {status}, fold {folded}")
        w = state.workloads.get(wid)
        fold_held = (None, None) if w is None or not w.held else (w.held_ms, w.held_by)
        if (held_ms, held_by) != fold_held:
            out.append(f"{wid}: held {(held_ms, held_by)}, fold {fold_held}")
        if w is None:
            continue
        mine = (preemptions, submitted, first, attempts.get(wid, 0), ran.get(wid, 0))
        fold = (w.preemptions, w.submitted_ms, w.first_placed_ms, w.attempt, w.run_ms)
        if mine != fold:
            out.append(
                f"{wid}: (preemptions, submitted, first placed, attempts, run ms) {mine}, fold {fold}"
            )
    open_runs = sorted(
        con.execute(
            "SELECT workload, node, gpus, attempt, start_ms FROM runs WHERE end_ms IS NULL"
        ).fetchall()
    )
    folded_runs = sorted(
        (w.id, s.node, s.gpus, w.attempt, w.started_ms)
        for w in state.running.values()
        for s in w.placement
    )
    if open_runs != folded_runs:
        out.append(f"open runs {open_runs}, fold {folded_runs}")
    open_waits = sorted(
        con.execute(
            "SELECT workload, queued_ms FROM waits JOIN workloads USING (workload) "
            "WHERE placed_ms IS NULL AND status <> 'cancelled'"
        ).fetchall()
    )
    folded_waits = sorted((w.id, w.queued_ms) for w in state.pending.values())
    if open_waits != folded_waits:
        out.append(f"open waits {open_waits}, fold {folded_waits}")
    return out


class Live:
    """A one-node cluster run the way the scheduler runs it: each input is
    folded, then the real cycle decides and its batch (if any) is folded."""

    def __init__(self) -> None:
        self.state = State()
        self.items: list[HistoryItem] = []
        self.n = 0
        for e in (
            BudgetSet(id="b0", at_ms=0, path="", weight=1, owner="root", actor="root"),
            BudgetSet(id="b1", at_ms=0, path="a", weight=1, owner="root", actor="root"),
            BudgetSet(id="b2", at_ms=0, path="b", weight=1, owner="root", actor="root"),
            NodeRegistered(id="n1", at_ms=0, node="n1", gpus=8, gpu_type="h100", actor="root"),
            PolicySet(id="p", at_ms=0, actor="root", preemption_margin_ppm=0, grace_ms=GRACE),
        ):
            self.input(e)

    def input(self, event: Input, refused: bool = False) -> list[Event]:
        """Fold ``event`` (refused by the fold or not, as said) and the cycle after
        it; the cycle's decisions."""
        item = InputItem(seq=self.state.input_seq + 1, at_ms=event.at_ms, ref=event.id, event=event)
        assert (fold_item(self.state, item) is not None) == refused, event
        self.items.append(item)
        batch, _ = decide_batch(self.state)
        if not batch.decisions:
            return []
        self.n += 1
        self.items.append(BatchItem(seq=self.n, batch=batch))
        fold_item(self.state, self.items[-1])
        return list(batch.decisions)

    def submit(self, wid: str, owner: str, at_ms: int, **kw: object) -> list[Event]:
        return self.input(
            WorkloadSubmitted(
                id=f"s-{wid}",
                at_ms=at_ms,
                workload=wid,
                owner=owner,
                gpus=8,
                min_runtime_ms=10 * MIN,
                submitted_by="root",
                **kw,  # type: ignore[arg-type]
            )
        )

    def finished(
        self, wid: str, outcome: str, at_ms: int, attempt: int, refused: bool = False, **kw: object
    ) -> list[Event]:
        return self.input(
            WorkloadFinished(
                id=f"f-{wid}-{attempt}",
                at_ms=at_ms,
                workload=wid,
                outcome=outcome,  # type: ignore[arg-type]
                attempt=attempt,
                actor="agent:n1",
                **kw,  # type: ignore[arg-type]
            ),
            refused,
        )


def what(decisions: list[Event]) -> list[tuple[str, str, int]]:
    return [
        (type(d).__name__, getattr(d, "workload", ""), getattr(d, "grace_ms", 0)) for d in decisions
    ]


def noticed(**a1: object) -> Live:
    """``a1`` (team a) runs on n1 from 0; at 1 h ``b1`` (team b) preempts it for
    fair share with 2 minutes' notice."""
    live = Live()
    assert what(live.submit("a1", "a", 0, **a1)) == [("WorkloadPlaced", "a1", 0)]
    assert what(live.submit("b1", "b", HOUR)) == [("WorkloadPreempted", "a1", GRACE)]
    assert live.state.running["a1"].stopping is not None
    return live


def project_checking_each_item(items: list[HistoryItem]) -> duckdb.DuckDBPyConnection:
    """Project ``items`` into a new in-memory file, committing and comparing with
    the fold after every item; the connection."""
    con = duckdb.connect()
    projection = Projection(con)
    state = State()
    for i, item in enumerate(items):
        projection(item, state, fold_item(state, item))
        projection.commit(state)
        assert disagreements(state, con) == [], f"after item {i + 1}: {item}"
    return con


def test_a_failed_report_during_the_notice_requeues_and_the_second_run_is_projected() -> None:
    """Issue 25: exit 143 while checkpointing under notice, placed again, finished."""
    live = noticed()
    # the process exits during its notice (SIGTERM while checkpointing): 143, failed
    assert what(live.finished("a1", "failed", HOUR + 30_000, 1, exit_code=143)) == [
        ("WorkloadPlaced", "b1", 0)
    ]
    assert live.state.status_of("a1") == "pending"
    assert what(live.finished("b1", "succeeded", 2 * HOUR, 1)) == [("WorkloadPlaced", "a1", 0)]
    assert live.state.running["a1"].attempt == 2
    live.finished("a1", "succeeded", 3 * HOUR, 2)

    con = project_checking_each_item(live.items)
    assert con.execute(
        "SELECT status, preemptions, first_placed_ms, ended_ms FROM workloads WHERE workload = 'a1'"
    ).fetchall() == [("succeeded", 1, 0, 3 * HOUR)]
    assert con.execute(
        "SELECT attempt, start_ms, end_ms, end_reason FROM runs WHERE workload = 'a1' ORDER BY attempt"
    ).fetchall() == [(1, 0, HOUR + 30_000, "preempted"), (2, 2 * HOUR, 3 * HOUR, "finished")]
    assert con.execute(
        "SELECT queued_ms, placed_ms FROM waits WHERE workload = 'a1' ORDER BY queued_ms"
    ).fetchall() == [(0, 0), (HOUR + 30_000, 2 * HOUR)]


def _deadline(live: Live) -> None:
    live.input(ClockTicked(id="tick", at_ms=HOUR + GRACE + MIN))


def _late_failed_report(live: Live) -> None:
    # past the deadline: the stop ended there, and the report is stale
    decisions = live.finished("a1", "failed", HOUR + GRACE + MIN, 1, refused=True)
    assert ("InputRejected", "", 0) in what(decisions)


def _succeeded(live: Live) -> None:
    live.finished("a1", "succeeded", HOUR + 30_000, 1)
    assert live.state.status_of("a1") == "succeeded"


def _cancelled(live: Live) -> None:
    live.input(WorkloadCancelled(id="c", at_ms=HOUR + 30_000, workload="a1", actor="root"))
    assert live.state.status_of("a1") == "cancelled"


def _host_down(live: Live) -> None:
    decisions = live.input(
        NodeHealthChanged(id="down", at_ms=HOUR + 30_000, node="n1", state="down", actor="root")
    )
    assert ("WorkloadPreempted", "a1", 0) in what(decisions)


ENDS: dict[str, Callable[[Live], None]] = {
    "deadline": _deadline,
    "failed report after the deadline": _late_failed_report,
    "succeeded during the notice": _succeeded,
    "cancelled during the notice": _cancelled,
    "host down during the notice": _host_down,
}


@pytest.mark.parametrize("resumable", [True, False])
@pytest.mark.parametrize("end", list(ENDS))
def test_every_way_a_notice_ends_is_projected_as_folded(end: str, resumable: bool) -> None:
    live = noticed(resumable=resumable)
    ENDS[end](live)
    live.input(ClockTicked(id="later", at_ms=4 * HOUR))
    project_checking_each_item(live.items)


def test_the_deadline_ends_the_run_at_the_deadline() -> None:
    live = noticed(resumable=False)
    _deadline(live)
    con = project_checking_each_item(live.items)
    assert con.execute("SELECT end_ms, end_reason FROM runs WHERE workload = 'a1'").fetchall() == [
        (HOUR + GRACE, "preempted")
    ]
    assert con.execute(
        "SELECT status, ended_ms, preemptions FROM workloads WHERE workload = 'a1'"
    ).fetchall() == [("preempted", HOUR + GRACE, 1)]


@pytest.mark.parametrize("end", ["failed", "deadline"])
def test_a_projection_restarted_during_the_notice_ends_it_as_the_fold_does(end: str) -> None:
    """Committed while the run is stopping, reopened from its file, then the notice ends."""
    live = noticed()
    during = len(live.items)
    if end == "failed":
        live.finished("a1", "failed", HOUR + 30_000, 1, exit_code=143)
    else:
        _deadline(live)
    live.input(ClockTicked(id="later", at_ms=4 * HOUR))
    con = duckdb.connect()
    first = Projection(con)
    state = fold_history(live.items[:during], observer=first)
    first.commit(state)
    again = Projection(con)
    state = fold_history(live.items[during:], again.saved_state(), again)
    again.commit(state)
    assert state.digest() == live.state.digest()
    assert disagreements(state, con) == []


def test_the_saved_state_is_not_in_projection_position(tmp_path: Path) -> None:
    """``SELECT * FROM projection_position`` is the position alone (the state, a large
    blob, is in ``projection_state``); a file written with the state in a
    ``projection_position.state`` column is moved over when opened and resumes the
    same; ``replay``'s reader takes both."""
    from apportion.replay.eventlog import read_duckdb

    live = noticed()
    during = len(live.items)
    _deadline(live)
    live.input(ClockTicked(id="later", at_ms=4 * HOUR))
    path = tmp_path / "p.duckdb"
    con = duckdb.connect(str(path))
    first = Projection(con, snapshot=False)
    state = fold_history(live.items[:during], observer=first)
    first.commit(state)
    assert [d[0] for d in con.execute("SELECT * FROM projection_position").description] == [
        "input_seq",
        "batches",
        "pos",
    ]
    # the file as it was written before projection_state
    con.execute("ALTER TABLE projection_position ADD COLUMN state BLOB")
    con.execute("UPDATE projection_position SET state = (SELECT state FROM projection_state)")
    con.execute("DROP TABLE projection_state")
    con.close()
    old = read_duckdb(path)  # read-only: not migrated, read all the same
    assert len(list(old)) == during and old.end is not None
    assert old.end.digest == state.digest()
    con = duckdb.connect(str(path))
    again = Projection(con, snapshot=False)
    assert len(con.execute("SELECT * FROM projection_position").description) == 3
    assert again.saved_state().digest() == state.digest()
    state = fold_history(live.items[during:], again.saved_state(), again)
    again.commit(state)
    assert state.digest() == live.state.digest()
    assert disagreements(state, con) == []
    con.close()
    new = read_duckdb(path)
    assert len(list(new)) == len(live.items) and new.end is not None
    assert new.end.digest == state.digest()


class ProjectionMachine(fold_machine.FoldMachine):
    """The core's fold machine; at the end of each random history the same events,
    cut into canonical items, are projected (restarted from its committed position
    halfway) and compared with the fold."""

    def history(self) -> list[HistoryItem]:
        items: list[HistoryItem] = []
        seq = batches = 0
        run: list[Event] = []

        def close() -> None:
            nonlocal batches
            if run:
                batches += 1
                items.append(
                    BatchItem(seq=batches, batch=DecisionBatch(basis=seq, decisions=tuple(run)))  # type: ignore[arg-type]
                )
                run.clear()

        for e in self.events:
            if isinstance(e, DECISION_TYPES):
                run.append(e)
                continue
            close()
            seq += 1
            items.append(InputItem(seq=seq, at_ms=e.at_ms, ref=e.id, event=e))  # type: ignore[arg-type]
        close()
        return items

    def teardown(self) -> None:
        items = self.history()
        con = duckdb.connect()
        half = len(items) // 2
        first = Projection(con)
        state = fold_history(items[:half], observer=first)
        first.commit(state)
        again = Projection(con)
        state = fold_history(items[half:], again.saved_state(), again)
        again.commit(state)
        assert state.digest() == self.state.digest()
        assert disagreements(self.state, con) == []
        con.close()


ProjectionMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestProjectionMachine = ProjectionMachine.TestCase
