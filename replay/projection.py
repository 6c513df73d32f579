"""The DuckDB projection tables, built incrementally from the canonical history.

The canonical history is input 1, the decisions based on 1, input 2, ... The
projection is an observer of the one fold (:mod:`apportion.core.history`): the
consumer folds each item into its state and shows it the item, the state and
whether the input was rejected (a rejected input changes no table but
``events``). It buffers rows in memory and writes them, with its position and
a snapshot of the consumer's state, in **one** DuckDB transaction per
:meth:`Projection.commit`. A restarted consumer reads the position and
snapshot back (:meth:`Projection.saved_state`) and resumes with no duplicate
and no gap. docs/formats.md documents every table.

Tables (the first columns of each are the interface scripts rely on; later
columns are additions):

- ``events(pos, at_ms, kind, workload, node, body, subject)``: every input and decision,
  ``pos`` counting from 1 in canonical order; ``body`` is the event's JSON;
  ``at_ms`` the time the fold gave it (inputs never go back in time);
  ``subject`` the subject an input was stored on, when known (NULL for
  decisions, simulations, and rows written before it was kept).
- ``workloads(workload, owner, gpus, min_runtime_ms, resumable, priority,
  submitted_ms, first_placed_ms, ended_ms, status, preemptions, gpu_type,
  duration_ms, legacy_priority, legacy_preemptible, team, held_ms, held_by)``;
  a rejected submission has status ``rejected`` (unless its id belongs to
  another workload); a held workload (``WorkloadHeld``) is ``pending`` with
  ``held_ms`` (when) and ``held_by`` (who) set until it is released or ends.
- ``runs(workload, node, gpus, start_ms, end_ms, allocated, end_reason,
  attempt)``: one row per placement per node; ``end_reason`` finished,
  preempted (fair share, unallocated, drain), cancelled, node_down, NULL while running.
  A run preempted with notice stays open (status ``running``) until its stop
  ends as the fold ends it: at its deadline (``end_ms`` the deadline), or at
  its executor's report (``failed``: the preemption's outcome, ``end_reason``
  preempted; ``succeeded``: finished), a cancel or the loss of its host.
- ``waits(workload, queued_ms, placed_ms)``: one row per queue episode;
  ``placed_ms`` NULL while waiting (and for an episode ended by a cancel).
- ``nodes(node, gpus, gpu_type)``; ``health(node, at_ms, state)`` with the
  accepted health changes plus a ``drained`` row at each ``NodeDrained``;
  ``budget(path, weight, owner, global_share)`` (the current tree, root ``""``).
- ``projection_position(input_seq, batches, pos)``: how far it is (one row);
  ``projection_state(input_seq, state)``: the folded state at that position
  (a msgpack snapshot, what a reopened projection resumes from), in a table of
  its own so that ``SELECT * FROM projection_position`` stays readable (files
  written before keep it in a ``state`` column, moved on the next open).
- ``projection_errors(pos, input_seq, batch, kind, workload, error)``: an event
  whose rows the projection could not derive (only when the writer asked to go
  on past such errors, :attr:`Projection.on_error`: the live projector); its
  ``events`` row is written all the same, the tables it would have changed may
  be wrong for that workload from then on.

Additions that make the history exactly recoverable from the file (the
``apportion replay|audit|whatif`` log sources, :mod:`apportion.replay.eventlog`):

- ``batches(batch, basis, pos, decisions, next_wakeup_ms, v, logic)``: one row per
  decision batch, empty ones included; its decisions are the ``events`` rows
  ``pos + 1 .. pos + decisions``; ``logic`` is the version of the logic that made
  it (NULL for batches recorded before versions were);
- ``malformed_inputs(seq, at_ms, ref, reason)``: inputs whose bytes did not
  decode (no ``events`` row; their ``InputRejected`` decision has one);
- ``log_meta(key, value)``: e.g. ``policy`` (``budget`` or ``priority``) when
  the simulator wrote the file.

Simulator addition (not part of the history; empty unless the simulator
sampled start-time estimates, :mod:`apportion.replay.simulator`):

- ``estimates(workload, at_ms, estimated_start_ms, note)``: one row per sampled
  estimate, made at ``at_ms`` "if nothing new arrives"; ``estimated_start_ms``
  NULL when there was none, ``note`` then says why (``no_known_end`` or
  ``beyond_horizon``), else NULL. :meth:`Projection.add_estimate` buffers them.

Analyst additions (docs/analyst.md documents each with an example query):

- a ``team`` column at the end of ``workloads`` and ``runs`` (the team rule of
  the KPIs, :func:`apportion.core.rules.classes.team_of`; the SQL macro ``team_of(path)``
  holds the same rule for queries);
- views ``attempts`` (one row per placement: a workload's run attempt, all its
  nodes), ``preemptions`` (one row per ``WorkloadPreempted`` decision, victim
  and beneficiary with their teams, the victim's contract state),
  ``team_usage_hourly`` and ``team_usage_daily`` (GPU-hours per team: allocated,
  unallocated, demand, share, owed and delivered as the KPIs count them).

A projection in a file written by a long-lived writer (no ``commit_every``: the
live projector) also keeps a read-only copy ``<file>.snapshot.duckdb``
(:meth:`Projection.write_snapshot`), because DuckDB lets no other process open
a file a writer holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import duckdb
import msgspec
from apportion.core.budget import ROOT
from apportion.core.rules.classes import allocated_sql, team_of, team_sql
from apportion.core.state import State, StateSnapshot
from apportion.schemas.events import (
    BudgetRemoved,
    BudgetSet,
    Event,
    Input,
    NodeDrained,
    NodeHealthChanged,
    NodeRegistered,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadHeld,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadReleased,
    WorkloadSubmitted,
    kind_of,
)
from apportion.schemas.history import BatchItem, HistoryItem, InputItem
from apportion.schemas.times import ISO_UTC_SQL

SCHEMA = """
CREATE TABLE IF NOT EXISTS events(pos BIGINT, at_ms BIGINT, kind VARCHAR, workload VARCHAR, node VARCHAR, body VARCHAR,
    subject VARCHAR);
CREATE TABLE IF NOT EXISTS workloads(workload VARCHAR, owner VARCHAR, gpus INTEGER, min_runtime_ms BIGINT,
    resumable BOOLEAN, priority INTEGER, submitted_ms BIGINT, first_placed_ms BIGINT, ended_ms BIGINT,
    status VARCHAR, preemptions INTEGER, gpu_type VARCHAR, duration_ms BIGINT, legacy_priority VARCHAR,
    legacy_preemptible BOOLEAN);
CREATE TABLE IF NOT EXISTS runs(workload VARCHAR, node VARCHAR, gpus INTEGER, start_ms BIGINT, end_ms BIGINT,
    allocated BOOLEAN, end_reason VARCHAR, attempt INTEGER);
CREATE TABLE IF NOT EXISTS waits(workload VARCHAR, queued_ms BIGINT, placed_ms BIGINT);
CREATE TABLE IF NOT EXISTS nodes(node VARCHAR, gpus INTEGER, gpu_type VARCHAR);
CREATE TABLE IF NOT EXISTS health(node VARCHAR, at_ms BIGINT, state VARCHAR);
CREATE TABLE IF NOT EXISTS budget(path VARCHAR, weight BIGINT, owner VARCHAR, global_share DOUBLE);
CREATE TABLE IF NOT EXISTS projection_position(input_seq BIGINT, batches BIGINT, pos BIGINT);
CREATE TABLE IF NOT EXISTS projection_state(input_seq BIGINT, state BLOB);
CREATE TABLE IF NOT EXISTS batches(batch BIGINT, basis BIGINT, pos BIGINT, decisions INTEGER, next_wakeup_ms BIGINT,
    v INTEGER, logic VARCHAR);
CREATE TABLE IF NOT EXISTS malformed_inputs(seq BIGINT, at_ms BIGINT, ref VARCHAR, reason VARCHAR);
CREATE TABLE IF NOT EXISTS log_meta(key VARCHAR, value VARCHAR);
CREATE TABLE IF NOT EXISTS estimates(workload VARCHAR, at_ms BIGINT, estimated_start_ms BIGINT, note VARCHAR);
CREATE TABLE IF NOT EXISTS projection_errors(pos BIGINT, input_seq BIGINT, batch BIGINT, kind VARCHAR,
    workload VARCHAR, error VARCHAR);
"""

# files written before the team column (and the batches' logic version): add them, fill the team (idempotent)
MIGRATE = f"""
ALTER TABLE workloads ADD COLUMN IF NOT EXISTS team VARCHAR;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS team VARCHAR;
ALTER TABLE batches ADD COLUMN IF NOT EXISTS logic VARCHAR;
ALTER TABLE events ADD COLUMN IF NOT EXISTS subject VARCHAR;
ALTER TABLE workloads ADD COLUMN IF NOT EXISTS held_ms BIGINT;
ALTER TABLE workloads ADD COLUMN IF NOT EXISTS held_by VARCHAR;
UPDATE workloads SET team = {team_sql("owner")} WHERE team IS NULL AND owner IS NOT NULL;
UPDATE runs SET team = (SELECT w.team FROM workloads w WHERE w.workload = runs.workload)
 WHERE team IS NULL;
"""

HOUR_MS = 3_600_000


def _move_saved_state(con: duckdb.DuckDBPyConnection) -> None:
    """A file written before ``projection_state``: its ``projection_position.state``
    column moves there (``SELECT * FROM projection_position`` printed the blob)."""
    columns = {
        r[0]
        for r in con.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = 'projection_position' AND table_schema = current_schema()"
        ).fetchall()
    }
    if "state" not in columns:
        return
    con.execute("BEGIN")
    try:
        con.execute("DELETE FROM projection_state")
        con.execute(
            "INSERT INTO projection_state SELECT input_seq, state FROM projection_position "
            "WHERE state IS NOT NULL"
        )
        con.execute("ALTER TABLE projection_position DROP COLUMN state")
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


VIEWS = f"""
CREATE OR REPLACE MACRO team_of(path) AS {team_sql("path")};
CREATE OR REPLACE MACRO iso_utc(ms) AS {ISO_UTC_SQL};

CREATE OR REPLACE VIEW attempts AS
SELECT workload, attempt, any_value(team) AS team, min(start_ms) AS start_ms, max(end_ms) AS end_ms,
       sum(gpus)::INTEGER AS gpus, count(*)::INTEGER AS nodes,
       string_agg(node, ',' ORDER BY node) AS node_list, bool_or(allocated) AS allocated,
       any_value(end_reason) AS end_reason,
       iso_utc(min(start_ms)) AS start_at, iso_utc(max(end_ms)) AS end_at
FROM runs GROUP BY workload, attempt;

CREATE OR REPLACE VIEW preemptions AS
WITH p AS (
    SELECT pos, at_ms, workload, json_extract_string(body, '$.id') AS decision,
           json_extract_string(body, '$.reason') AS reason,
           CAST(json_extract(body, '$.requeued') AS BOOLEAN) AS requeued,
           json_extract_string(body, '$.for_workload') AS for_workload
    FROM events WHERE kind = 'WorkloadPreempted'),
pl AS (
    SELECT pos, at_ms, workload, CAST(json_extract(body, '$.attempt') AS INTEGER) AS attempt,
           CAST(json_extract(body, '$.allocated') AS BOOLEAN) AS allocated,
           CAST(json_extract(body, '$.protected_until_ms') AS BIGINT) AS protected_until_ms
    FROM events WHERE kind = 'WorkloadPlaced')
SELECT p.pos, p.at_ms, p.decision, p.workload, v.team, v.owner, v.gpus AS gpus_freed,
       p.reason, p.requeued, p.for_workload, b.team AS for_team, b.owner AS for_owner,
       pl.attempt, pl.allocated, pl.at_ms AS placed_ms, pl.protected_until_ms,
       p.at_ms >= pl.protected_until_ms AS past_protection, p.at_ms - pl.at_ms AS ran_ms,
       iso_utc(p.at_ms) AS "at", iso_utc(pl.at_ms) AS placed_at,
       iso_utc(pl.protected_until_ms) AS protected_until_at
FROM p ASOF LEFT JOIN pl ON p.workload = pl.workload AND p.pos > pl.pos
LEFT JOIN workloads v ON v.workload = p.workload
LEFT JOIN workloads b ON b.workload = p.for_workload;

CREATE OR REPLACE VIEW team_usage_hourly AS
WITH bounds AS (SELECT min(at_ms) AS t0, max(at_ms) AS t1 FROM events),
hours AS (
    SELECT unnest(range(t0 // {HOUR_MS}, (t1 + {HOUR_MS - 1}) // {HOUR_MS})) AS hour
    FROM bounds WHERE t1 IS NOT NULL),
teams AS (
    SELECT team_of(b.path) AS team FROM budget b
    WHERE b.path <> '' AND NOT EXISTS (SELECT 1 FROM budget c WHERE c.path LIKE b.path || '/%')
    UNION SELECT team FROM workloads WHERE status <> 'rejected'),
seg AS (
    SELECT s.node, n.gpus, s.state, s.at_ms AS s,
           COALESCE(LEAD(s.at_ms) OVER (PARTITION BY s.node ORDER BY s.at_ms, s.ord),
                    (SELECT t1 FROM bounds)) AS e
    FROM (SELECT node, 'healthy' AS state, min(at_ms) AS at_ms, -1 AS ord FROM events
          WHERE kind = 'NodeRegistered' GROUP BY node
          UNION ALL SELECT node, state, at_ms, rowid FROM health) s
    JOIN nodes n USING (node)),
spans AS (
    SELECT 'healthy' AS what, NULL AS team, gpus, s, e FROM seg WHERE state = 'healthy'
    UNION ALL
    SELECT CASE WHEN allocated THEN 'allocated' ELSE 'unallocated' END, team, gpus, start_ms,
           COALESCE(end_ms, (SELECT t1 FROM bounds)) FROM runs
    UNION ALL
    SELECT 'demand', team, gpus, submitted_ms, COALESCE(ended_ms, (SELECT t1 FROM bounds))
    FROM workloads WHERE {allocated_sql()} AND status <> 'rejected'),
per_hour AS (
    SELECT what, team, h AS hour,
           SUM(GREATEST(0, LEAST(e, (h + 1) * {HOUR_MS}) - GREATEST(s, h * {HOUR_MS})) * gpus) AS gpu_ms
    FROM (SELECT *, unnest(range(s // {HOUR_MS}, (e + {HOUR_MS - 1}) // {HOUR_MS})) AS h
          FROM spans WHERE e > s)
    GROUP BY ALL),
grid AS (
    SELECT t.team, hours.hour, COALESCE(bu.global_share, 0) AS global_share,
           COALESCE(hl.gpu_ms, 0) / {HOUR_MS}.0 AS healthy,
           COALESCE(al.gpu_ms, 0) / {HOUR_MS}.0 AS allocated,
           COALESCE(un.gpu_ms, 0) / {HOUR_MS}.0 AS unallocated,
           COALESCE(de.gpu_ms, 0) / {HOUR_MS}.0 AS demand
    FROM teams t CROSS JOIN hours
    LEFT JOIN budget bu ON bu.path = t.team
    LEFT JOIN per_hour hl ON hl.what = 'healthy' AND hl.hour = hours.hour
    LEFT JOIN per_hour al ON al.what = 'allocated' AND al.team = t.team AND al.hour = hours.hour
    LEFT JOIN per_hour un ON un.what = 'unallocated' AND un.team = t.team AND un.hour = hours.hour
    LEFT JOIN per_hour de ON de.what = 'demand' AND de.team = t.team AND de.hour = hours.hour)
SELECT team, hour, hour * {HOUR_MS} AS hour_start_ms, allocated AS gpu_hours_allocated,
       unallocated AS gpu_hours_unallocated, demand AS gpu_hours_demand,
       global_share * healthy AS gpu_hours_share,
       LEAST(global_share * healthy, demand) AS gpu_hours_owed,
       LEAST(allocated, global_share * healthy, demand) AS gpu_hours_delivered,
       healthy AS cluster_gpu_hours_healthy, iso_utc(hour * {HOUR_MS}) AS hour_start_at
FROM grid;

CREATE OR REPLACE VIEW team_usage_daily AS
SELECT team, hour // 24 AS day,
       CAST(DATE '1970-01-01' + CAST(hour // 24 AS INTEGER) AS DATE) AS "date",
       (hour // 24) * {24 * HOUR_MS} AS day_start_ms, count(*) AS hours,
       sum(gpu_hours_allocated) AS gpu_hours_allocated,
       sum(gpu_hours_unallocated) AS gpu_hours_unallocated,
       sum(gpu_hours_demand) AS gpu_hours_demand, sum(gpu_hours_share) AS gpu_hours_share,
       sum(gpu_hours_owed) AS gpu_hours_owed, sum(gpu_hours_delivered) AS gpu_hours_delivered,
       sum(gpu_hours_delivered) / NULLIF(sum(gpu_hours_owed), 0) AS delivery_ratio,
       sum(cluster_gpu_hours_healthy) AS cluster_gpu_hours_healthy,
       iso_utc((hour // 24) * {24 * HOUR_MS}) AS day_start_at
FROM team_usage_hourly GROUP BY team, hour // 24;
"""

SNAPSHOT_SUFFIX = ".snapshot.duckdb"
SNAPSHOT_EVERY_S = 5.0
"""Least time between two snapshots (and at least 10 times the last one's copy time)."""

_log = logging.getLogger(__name__)


def snapshot_path(db: str | Path) -> Path:
    """The read-only copy a live projection keeps beside its file ``db``."""
    return Path(f"{db}{SNAPSHOT_SUFFIX}")


_TYPES = {
    "events": ("BIGINT", "BIGINT", "VARCHAR", "VARCHAR", "VARCHAR", "VARCHAR", "VARCHAR"),
    "workloads": (
        "VARCHAR",
        "VARCHAR",
        "INTEGER",
        "BIGINT",
        "BOOLEAN",
        "INTEGER",
        "BIGINT",
        "BIGINT",
        "BIGINT",
        "VARCHAR",
        "INTEGER",
        "VARCHAR",
        "BIGINT",
        "VARCHAR",
        "BOOLEAN",
        "VARCHAR",
        "BIGINT",
        "VARCHAR",
    ),
    "runs": (
        "VARCHAR",
        "VARCHAR",
        "INTEGER",
        "BIGINT",
        "BIGINT",
        "BOOLEAN",
        "VARCHAR",
        "INTEGER",
        "VARCHAR",
    ),
    "waits": ("VARCHAR", "BIGINT", "BIGINT"),
    "nodes": ("VARCHAR", "INTEGER", "VARCHAR"),
    "health": ("VARCHAR", "BIGINT", "VARCHAR"),
    "budget": ("VARCHAR", "BIGINT", "VARCHAR", "DOUBLE"),
    "batches": ("BIGINT", "BIGINT", "BIGINT", "INTEGER", "BIGINT", "INTEGER", "VARCHAR"),
    "malformed_inputs": ("BIGINT", "BIGINT", "VARCHAR", "VARCHAR"),
    "estimates": ("VARCHAR", "BIGINT", "BIGINT", "VARCHAR"),
    "projection_errors": ("BIGINT", "BIGINT", "BIGINT", "VARCHAR", "VARCHAR", "VARCHAR"),
}
# workloads row indexes
W_STATUS, W_FIRST, W_ENDED, W_PRE, W_TEAM, W_HELD_MS, W_HELD_BY = 9, 7, 8, 10, 15, 16, 17

_json = msgspec.json.Encoder()


def insert_rows(
    con: duckdb.DuckDBPyConnection,
    table: str,
    rows: list[list[Any]] | list[tuple[Any, ...]],
) -> None:
    """Insert many rows at once (one statement, columns passed as typed lists)."""
    if not rows:
        return
    types = _TYPES[table]
    cols = [list(c) for c in zip(*rows, strict=True)]
    select = ", ".join(f"unnest(${i + 1}::{t}[])" for i, t in enumerate(types))
    con.execute(f"INSERT INTO {table} SELECT {select}", cols)


def _workload_row(e: WorkloadSubmitted, now: int, status: str) -> list[Any]:
    """A new ``workloads`` row (not yet placed or ended) for a submission."""
    return [
        e.workload,
        e.owner,
        e.gpus,
        e.min_runtime_ms,
        e.resumable,
        e.priority,
        now,
        None,
        None,
        status,
        0,
        e.gpu_type,
        e.duration_ms,
        e.legacy_priority,
        e.legacy_preemptible,
        team_of(e.owner),
        None,
        None,
    ]


class ProjectionFault(NamedTuple):
    """An event whose rows the projection could not derive: a ``projection_errors`` row."""

    pos: int
    """Its ``events`` row."""
    input_seq: int
    """The last input folded: the input itself, or the basis of its batch."""
    batch: int | None
    """Its decision batch (``None`` for an input)."""
    kind: str
    workload: str | None
    error: str
    """``<exception type>: <message>``."""


class Projection:
    """The DuckDB tables, written by observing the canonical history.

    An observer (:class:`apportion.core.history.Observer`): call it with each
    item right after :func:`~apportion.core.history.fold_item` folded it into
    the caller's state. It owns no scheduler state: it buffers rows (and keeps
    the open rows of live workloads, runs and waits to update them), and
    :meth:`commit` writes them with the position and a snapshot of the state
    it is given. :meth:`saved_state` gives that snapshot back, so a consumer
    resumes from the committed position.

    ``commit_every`` (events rows): when set, the projection commits by itself
    after a decision batch once that many rows are buffered (the simulator's
    memory stays bounded).

    ``snapshot``: keep the read-only copy ``<file>.snapshot.duckdb`` (written at
    open when the file holds a position, and after a commit when the last copy
    is older than :data:`SNAPSHOT_EVERY_S`). By default on for a file
    written without ``commit_every`` (the live projector), off in memory.

    ``on_error``: what happens when the rows of an event cannot be derived (the
    projection's open rows disagree with the history, i.e. a bug). ``None``
    (the default: simulator, replay, audit, tests): the exception propagates.
    Otherwise (the live projector) the event's ``events`` row is kept, a
    ``projection_errors`` row is buffered, ``on_error`` is called with the
    :class:`ProjectionFault`, and the projection goes on with the next event.
    """

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        commit_every: int | None = None,
        snapshot: bool | None = None,
        on_error: Callable[[ProjectionFault], None] | None = None,
    ) -> None:
        self.con = con
        self.commit_every = commit_every
        self.on_error = on_error
        con.execute(SCHEMA)
        con.execute(MIGRATE)
        _move_saved_state(con)
        con.execute(VIEWS)
        row = con.execute(
            "SELECT path FROM duckdb_databases() WHERE database_name = current_database()"
        ).fetchone()
        self.path: Path | None = Path(row[0]) if row and row[0] else None
        if snapshot is None:
            snapshot = commit_every is None
        self.snapshot: Path | None = (
            snapshot_path(self.path) if snapshot and self.path is not None else None
        )
        self._snapshot_at: float | None = None
        self._snapshot_took = 0.0
        self.snapshot_error: str | None = None
        """Why the last snapshot failed (the projection goes on without it), else None."""
        self._reset_buffers()
        row = con.execute("SELECT input_seq, batches, pos FROM projection_position").fetchone()
        saved_row = con.execute("SELECT state FROM projection_state").fetchone()
        self.live: dict[str, list[Any]] = {}
        self.open_runs: dict[str, list[list[Any]]] = {}
        self.open_waits: dict[str, list[Any]] = {}
        self.rejected_ids: set[str] = set()
        self.stopping: dict[str, tuple[int, bool]] = {}
        """Runs preempted with notice whose stop has not ended: workload ->
        (deadline, requeued), as in the fold's state (:class:`~apportion.core.state.Stopping`)."""
        self._now = 0
        """The fold's clock after the last input observed."""
        if row is None:
            self._saved: bytes | None = None
            self._batches = 0
            self._pos = 0
            self._committed = (0, 0)
            return
        self._saved = saved_row[0] if saved_row is not None else None
        self._batches = row[1]
        self._pos = row[2]
        self._committed = (row[0], row[1])
        for r in con.execute(
            "SELECT * FROM workloads WHERE status IN ('pending', 'running')"
        ).fetchall():
            self.live[r[0]] = list(r)
        for r in con.execute(
            "SELECT * FROM runs WHERE end_ms IS NULL ORDER BY workload, node"
        ).fetchall():
            self.open_runs.setdefault(r[0], []).append(list(r))
        for r in con.execute(
            "SELECT w.* FROM waits w JOIN workloads USING (workload) WHERE placed_ms IS NULL AND status = 'pending'"
        ).fetchall():
            self.open_waits[r[0]] = list(r)
        for (wid,) in con.execute(
            "SELECT workload FROM workloads WHERE status = 'rejected'"
        ).fetchall():
            self.rejected_ids.add(wid)
        if self._saved is not None:
            # the stops in progress at the committed position are the saved state's
            saved = msgspec.msgpack.decode(self._saved, type=StateSnapshot)
            self._now = saved.now_ms
            for w in saved.workloads:
                if w.stopping is not None:
                    self.stopping[w.id] = (w.stopping.until_ms, w.stopping.requeue)
        self.write_snapshot()

    def _reset_buffers(self) -> None:
        self._events: list[tuple[Any, ...]] = []
        self._batch_rows: list[tuple[Any, ...]] = []
        self._malformed: list[tuple[Any, ...]] = []
        self._dirty_workloads: dict[str, list[Any]] = {}
        self._closed_runs: list[list[Any]] = []
        self._dirty_runs: dict[str, bool] = {}
        self._closed_waits: list[list[Any]] = []
        self._dirty_waits: dict[str, bool] = {}
        self._health: list[tuple[Any, ...]] = []
        self._estimates: list[tuple[Any, ...]] = []
        self._errors: list[tuple[Any, ...]] = []
        self._nodes_dirty = False
        self._budget_dirty = False

    # -- position --------------------------------------------------------
    @property
    def position(self) -> tuple[int, int]:
        """(last input seq, last decision batch seq) as committed."""
        return self._committed

    def saved_state(self) -> State:
        """The state committed with :attr:`position` (an empty state for an empty projection)."""
        return State() if self._saved is None else State.from_bytes(self._saved)

    # -- observing -----------------------------------------------------------
    def __call__(self, item: HistoryItem, state: State, rejected: str | None) -> None:
        if isinstance(item, InputItem):
            if item.event is None:
                self._malformed.append((item.seq, item.at_ms, item.ref, rejected))
            else:
                event, now = item.event, state.now_ms
                self._event_row(
                    event,
                    now,
                    getattr(event, "workload", None),
                    getattr(event, "node", None),
                    item.subject,
                )
                try:
                    if self.stopping and now > self._now:
                        self._end_due_stops(now)
                    self._input(event, state, rejected is not None)
                except Exception as exc:
                    if self.on_error is None:
                        raise
                    self._failed(exc, event, state, None)
            self._now = state.now_ms
        else:
            self._batch(item, state)
            if self.commit_every is not None and len(self._events) >= self.commit_every:
                self.commit(state)

    def _failed(self, exc: Exception, event: Event, state: State, batch: int | None) -> None:
        """The rows of ``event`` (its ``events`` row is the last one) could not be
        derived: record it (a ``projection_errors`` row) and tell :attr:`on_error`."""
        assert self.on_error is not None
        fault = ProjectionFault(
            pos=self._pos,
            input_seq=state.input_seq,
            batch=batch,
            kind=kind_of(event),
            workload=getattr(event, "workload", None),
            error=f"{type(exc).__name__}: {exc}",
        )
        self._errors.append(tuple(fault))
        self.on_error(fault)

    def _end_due_stops(self, now: int) -> None:
        """An input moved the clock to ``now``: as the fold does before it applies
        the input, end every stop due by then, each at its deadline, in deadline
        (then workload) order."""
        for until, wid in sorted((u, w) for w, (u, _) in self.stopping.items() if u <= now):
            self._stop_ended(wid, until, self.stopping[wid][1])

    def _stop_ended(
        self, wid: str, at_ms: int, requeued: bool, run_reason: str = "preempted"
    ) -> None:
        """The preemption of ``wid`` takes effect at ``at_ms`` (at once, or at the end of
        its stop): its runs end with ``run_reason``, and it is requeued or ends."""
        self.stopping.pop(wid, None)
        row = self.live[wid]
        self._close_runs(wid, at_ms, run_reason)
        if requeued:
            row[W_STATUS] = "pending"
            self.open_waits[wid] = [wid, at_ms, None]
            self._dirty_waits[wid] = True
        else:
            del self.live[wid]
            row[W_STATUS] = "preempted"
            row[W_ENDED] = at_ms
        self._dirty_workloads[wid] = row

    def _event_row(
        self,
        event: Event,
        at_ms: int,
        workload: str | None,
        node: str | None,
        subject: str | None = None,
    ) -> None:
        self._pos += 1
        self._events.append(
            (
                self._pos,
                at_ms,
                kind_of(event),
                workload,
                node,
                _json.encode(event).decode(),
                subject,
            )
        )

    def _input(self, event: Input, state: State, rejected: bool) -> None:
        now = state.now_ms
        if isinstance(event, WorkloadSubmitted):
            wid = event.workload
            if rejected:
                if (
                    wid not in self.live
                    and state.status_of(wid) is None
                    and wid not in self.rejected_ids
                ):
                    self.rejected_ids.add(wid)
                    self._dirty_workloads[wid] = _workload_row(event, now, "rejected")
                return
            row = _workload_row(event, now, "pending")
            self.live[wid] = row
            self._dirty_workloads[wid] = row
            self.open_waits[wid] = [wid, now, None]
            self._dirty_waits[wid] = True
            return
        if rejected:
            return
        if isinstance(event, WorkloadFinished):
            wid = event.workload
            status = state.status_of(wid)
            if status == "pending" or status == "preempted":
                # a failed report during a notice: the fold applied the preemption's outcome
                self._stop_ended(wid, now, status == "pending")
            else:
                self.stopping.pop(wid, None)
                self._end(wid, event.outcome, "finished", now)
        elif isinstance(event, WorkloadCancelled):
            self.stopping.pop(event.workload, None)
            self._end(event.workload, "cancelled", "cancelled", now)
        elif isinstance(event, WorkloadHeld | WorkloadReleased):
            row = self.live[event.workload]
            held = isinstance(event, WorkloadHeld)
            row[W_HELD_MS] = now if held else None
            row[W_HELD_BY] = event.actor if held else None
            self._dirty_workloads[event.workload] = row
        elif isinstance(event, NodeHealthChanged):
            self._health.append((event.node, now, event.state))
        elif isinstance(event, NodeRegistered):
            self._nodes_dirty = True
        elif isinstance(event, BudgetSet | BudgetRemoved):
            self._budget_dirty = True

    def add_estimate(
        self, workload: str, at_ms: int, estimated_start_ms: int | None, note: str | None
    ) -> None:
        """Buffer one ``estimates`` row (written by the next :meth:`commit`)."""
        self._estimates.append((workload, at_ms, estimated_start_ms, note))

    def set_meta(self, key: str, value: str) -> None:
        """Record ``key = value`` in ``log_meta`` (written at once, outside the position)."""
        self.con.execute("DELETE FROM log_meta WHERE key = ?", [key])
        self.con.execute("INSERT INTO log_meta VALUES (?, ?)", [key, value])

    def _close_runs(self, wid: str, now: int, reason: str) -> None:
        runs = self.open_runs.pop(wid, None)
        if runs:
            for r in runs:
                r[4] = now
                r[6] = reason
                self._closed_runs.append(r)
            self._dirty_runs[wid] = True

    def _end(self, wid: str, status: str, run_reason: str, now: int) -> None:
        row = self.live.pop(wid)
        if row[W_STATUS] == "running":
            self._close_runs(wid, now, run_reason)
        else:
            wait = self.open_waits.pop(wid, None)
            if wait is not None:
                self._closed_waits.append(wait)
                self._dirty_waits[wid] = True
        row[W_STATUS] = status
        row[W_ENDED] = now
        row[W_HELD_MS] = row[W_HELD_BY] = None  # a held workload cancelled is held no more
        self._dirty_workloads[wid] = row

    def _batch(self, item: BatchItem, state: State) -> None:
        batch = item.batch
        self._batches = item.seq
        self._batch_rows.append(
            (
                item.seq,
                batch.basis,
                self._pos,
                len(batch.decisions),
                batch.next_wakeup_ms,
                batch.v,
                None if batch.logic is msgspec.UNSET else batch.logic,
            )
        )
        now = state.now_ms  # decisions happen at the time of the input they are based on
        for d in batch.decisions:
            self._event_row(d, now, getattr(d, "workload", None), getattr(d, "node", None))
            try:
                self._decision(d, now)
            except Exception as exc:
                if self.on_error is None:
                    raise
                self._failed(exc, d, state, item.seq)

    def _decision(self, d: Event, now: int) -> None:
        if isinstance(d, WorkloadPlaced):
            wid = d.workload
            row = self.live[wid]
            row[W_STATUS] = "running"
            if row[W_FIRST] is None:
                row[W_FIRST] = now
            self._dirty_workloads[wid] = row
            wait = self.open_waits.pop(wid, None)
            if wait is not None:
                wait[2] = now
                self._closed_waits.append(wait)
                self._dirty_waits[wid] = True
            self.open_runs[wid] = [
                [wid, s.node, s.gpus, now, None, d.allocated, None, d.attempt, row[W_TEAM]]
                for s in d.placement
            ]
            self._dirty_runs[wid] = True
        elif isinstance(d, WorkloadPreempted):
            wid = d.workload
            row = self.live[wid]
            # as the fold: a stopping run ends early only by the loss of its host (not
            # counted again); otherwise a notice starts a stop and the run goes on
            stopping = self.stopping.pop(wid, None) is not None
            if not stopping:
                row[W_PRE] += 1
                self._dirty_workloads[wid] = row
                if d.grace_ms > 0:
                    self.stopping[wid] = (now + d.grace_ms, d.requeued)
                    return
            reason = "node_down" if d.reason == "node_down" else "preempted"
            self._stop_ended(wid, now, d.requeued, reason)
        elif isinstance(d, NodeDrained):
            self._health.append((d.node, now, "drained"))

    # -- writing -------------------------------------------------------------
    def commit(self, state: State) -> None:
        """Write buffered rows, the position and ``state`` (the state after the
        last item observed) in one transaction."""
        con = self.con
        con.execute("BEGIN TRANSACTION")
        try:
            insert_rows(con, "events", self._events)
            insert_rows(con, "batches", self._batch_rows)
            insert_rows(con, "malformed_inputs", self._malformed)
            if self._dirty_workloads:
                ids = list(self._dirty_workloads)
                con.execute(
                    "DELETE FROM workloads WHERE workload IN (SELECT unnest($1::VARCHAR[]))", [ids]
                )
                insert_rows(con, "workloads", list(self._dirty_workloads.values()))
            if self._dirty_runs:
                ids = list(self._dirty_runs)
                con.execute(
                    "DELETE FROM runs WHERE end_ms IS NULL AND workload IN (SELECT unnest($1::VARCHAR[]))",
                    [ids],
                )
                rows = list(self._closed_runs)
                for wid in ids:
                    rows.extend(self.open_runs.get(wid, ()))
                insert_rows(con, "runs", rows)
            if self._dirty_waits:
                ids = list(self._dirty_waits)
                con.execute(
                    "DELETE FROM waits WHERE placed_ms IS NULL AND workload IN (SELECT unnest($1::VARCHAR[]))",
                    [ids],
                )
                rows = list(self._closed_waits)
                for wid in ids:
                    w = self.open_waits.get(wid)
                    if w is not None:
                        rows.append(w)
                insert_rows(con, "waits", rows)
            insert_rows(con, "health", self._health)
            insert_rows(con, "estimates", self._estimates)
            insert_rows(con, "projection_errors", self._errors)
            if self._nodes_dirty:
                con.execute("DELETE FROM nodes")
                insert_rows(
                    con, "nodes", [(n.node, n.gpus, n.gpu_type) for n in state.nodes.values()]
                )
            if self._budget_dirty:
                con.execute("DELETE FROM budget")
                tree = state.budget
                insert_rows(
                    con,
                    "budget",
                    [
                        (
                            p,
                            tree.nodes[p].weight,
                            tree.nodes[p].owner,
                            float(tree.global_share(p)) if p != ROOT else 1.0,
                        )
                        for p in tree.depth_first()
                    ],
                )
            saved = state.to_bytes()
            con.execute("DELETE FROM projection_position")
            con.execute(
                "INSERT INTO projection_position VALUES (?, ?, ?)",
                [state.input_seq, self._batches, self._pos],
            )
            con.execute("DELETE FROM projection_state")
            con.execute("INSERT INTO projection_state VALUES (?, ?)", [state.input_seq, saved])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        self._committed = (state.input_seq, self._batches)
        self._saved = saved
        self._reset_buffers()
        if self.snapshot is not None and (
            self._snapshot_at is None
            or time.monotonic() - self._snapshot_at
            >= max(SNAPSHOT_EVERY_S, 10 * self._snapshot_took)
        ):
            self.write_snapshot()

    def write_snapshot(self) -> Path | None:
        """Copy the committed projection to :attr:`snapshot`: DuckDB copies it
        (``COPY FROM DATABASE``) into a temporary file, renamed over the old copy
        (a reader that has the old copy open keeps it). The file itself is never
        opened a second time: closing a second descriptor would drop the
        writer's lock on it. A failure is logged and kept in
        :attr:`snapshot_error`, never raised: the projection goes on. Returns
        the copy's path, or None."""
        if self.snapshot is None or self.path is None:
            return None
        started = time.monotonic()
        tmp = self.snapshot.with_name(self.snapshot.name + ".tmp")
        attached = False
        try:
            for stale in (tmp, tmp.with_name(tmp.name + ".wal")):
                stale.unlink(missing_ok=True)
            row = self.con.execute("SELECT current_database()").fetchone()
            source = str(row[0] if row else "main").replace('"', '""')
            target = str(tmp).replace("'", "''")
            self.con.execute(f"ATTACH '{target}' AS apportion_snapshot")
            attached = True
            self.con.execute(f'COPY FROM DATABASE "{source}" TO apportion_snapshot')
            self.con.execute("DETACH apportion_snapshot")
            attached = False
            os.replace(tmp, self.snapshot)
        except (OSError, duckdb.Error) as exc:
            if attached:
                with contextlib.suppress(duckdb.Error):
                    self.con.execute("DETACH apportion_snapshot")
            self.snapshot_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            _log.warning("projection snapshot failed: %s", self.snapshot_error)
            tmp.unlink(missing_ok=True)
            return None
        self.snapshot_error = None
        self._snapshot_at = time.monotonic()
        self._snapshot_took = self._snapshot_at - started
        return self.snapshot
