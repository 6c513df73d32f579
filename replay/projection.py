"""DESIGN's DuckDB projection tables, built incrementally from the canonical history.

The canonical history is input 1, the decisions based on 1, input 2, ... The
projection folds a :class:`~apportion.core.state.State` alongside (the oracle
for what each input changed: an input the fold rejected changes no table but
``events``), buffers rows in memory and writes them, with its position and a
snapshot of that state, in **one** DuckDB transaction per :meth:`commit`. A
restarted projection reads its position and snapshot back and resumes with no
duplicate and no gap; inputs and batches it has already committed are
ignored, and anything out of order raises :class:`ProjectionOrderError`.

Tables (DESIGN "Interfaces"; columns after the DESIGN ones are additions):

- ``events(pos, at_ms, kind, workload, node, body)``: every input and decision,
  ``pos`` counting from 1 in canonical order; ``body`` is the event's JSON;
  ``at_ms`` the time the fold gave it (inputs never go back in time).
- ``workloads(workload, owner, gpus, min_runtime_ms, resumable, priority,
  submitted_ms, first_placed_ms, ended_ms, status, preemptions, gpu_type,
  duration_ms, legacy_priority, legacy_preemptible)``; a rejected submission
  has status ``rejected`` (unless its id belongs to another workload).
- ``runs(workload, node, gpus, start_ms, end_ms, allocated, end_reason,
  attempt)``: one row per placement per node; ``end_reason`` finished,
  preempted (fair share, unallocated, drain), cancelled, node_down, NULL while running.
- ``waits(workload, queued_ms, placed_ms)``: one row per queue episode;
  ``placed_ms`` NULL while waiting (and for an episode ended by a cancel).
- ``nodes(node, gpus, gpu_type)``; ``health(node, at_ms, state)`` with the
  accepted health changes plus a ``drained`` row at each ``NodeDrained``;
  ``budget(path, weight, owner, global_share)`` (the current tree, root ``""``).
- ``projection_position(input_seq, batches, pos, state)``.

Additions that make the history exactly recoverable from the file (the
``apportion replay|audit|whatif`` log sources, :mod:`apportion.replay.eventlog`):

- ``batches(batch, basis, pos, decisions, next_wakeup_ms, v)``: one row per
  decision batch, empty ones included; its decisions are the ``events`` rows
  ``pos + 1 .. pos + decisions``;
- ``malformed_inputs(seq, at_ms, ref, reason)``: inputs whose bytes did not
  decode (no ``events`` row; their ``InputRejected`` decision has one);
- ``log_meta(key, value)``: e.g. ``policy`` (``budget`` or ``priority``) when
  the simulator wrote the file.
"""

from __future__ import annotations

from typing import Any

import duckdb
import msgspec
from apportion.core.budget import ROOT
from apportion.core.state import State, apply
from apportion.schemas.events import (
    BudgetRemoved,
    BudgetSet,
    DecisionBatch,
    Event,
    Input,
    NodeDrained,
    NodeHealthChanged,
    NodeRegistered,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadSubmitted,
    kind_of,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS events(pos BIGINT, at_ms BIGINT, kind VARCHAR, workload VARCHAR, node VARCHAR, body VARCHAR);
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
CREATE TABLE IF NOT EXISTS projection_position(input_seq BIGINT, batches BIGINT, pos BIGINT, state BLOB);
CREATE TABLE IF NOT EXISTS batches(batch BIGINT, basis BIGINT, pos BIGINT, decisions INTEGER, next_wakeup_ms BIGINT,
    v INTEGER);
CREATE TABLE IF NOT EXISTS malformed_inputs(seq BIGINT, at_ms BIGINT, ref VARCHAR, reason VARCHAR);
CREATE TABLE IF NOT EXISTS log_meta(key VARCHAR, value VARCHAR);
"""

_TYPES = {
    "events": ("BIGINT", "BIGINT", "VARCHAR", "VARCHAR", "VARCHAR", "VARCHAR"),
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
    ),
    "runs": ("VARCHAR", "VARCHAR", "INTEGER", "BIGINT", "BIGINT", "BOOLEAN", "VARCHAR", "INTEGER"),
    "waits": ("VARCHAR", "BIGINT", "BIGINT"),
    "nodes": ("VARCHAR", "INTEGER", "VARCHAR"),
    "health": ("VARCHAR", "BIGINT", "VARCHAR"),
    "budget": ("VARCHAR", "BIGINT", "VARCHAR", "DOUBLE"),
    "batches": ("BIGINT", "BIGINT", "BIGINT", "INTEGER", "BIGINT", "INTEGER"),
    "malformed_inputs": ("BIGINT", "BIGINT", "VARCHAR", "VARCHAR"),
}
# workloads row indexes
W_STATUS, W_FIRST, W_ENDED, W_PRE = 9, 7, 8, 10

_json = msgspec.json.Encoder()


class ProjectionOrderError(ValueError):
    """An input or batch that is not the next one in canonical order (a gap)."""


def insert_rows(
    con: duckdb.DuckDBPyConnection, table: str, rows: list[list[Any]] | list[tuple]
) -> None:
    """Insert many rows at once (one statement, columns passed as typed lists)."""
    if not rows:
        return
    types = _TYPES[table]
    cols = [list(c) for c in zip(*rows, strict=True)]
    select = ", ".join(f"unnest(${i + 1}::{t}[])" for i, t in enumerate(types))
    con.execute(f"INSERT INTO {table} SELECT {select}", cols)


def _workload_row(e: WorkloadSubmitted, now: int, status: str) -> list:
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
    ]


class Projection:
    """DESIGN's DuckDB tables built incrementally from the canonical history
    (input 1, decisions based on 1, input 2, ...)."""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self.con = con
        con.execute(SCHEMA)
        self._reset_buffers()
        row = con.execute(
            "SELECT input_seq, batches, pos, state FROM projection_position"
        ).fetchone()
        self.live: dict[str, list[Any]] = {}
        self.open_runs: dict[str, list[list[Any]]] = {}
        self.open_waits: dict[str, list[Any]] = {}
        self.rejected_ids: set[str] = set()
        if row is None:
            self.state = State()
            self._batches = 0
            self._pos = 0
            self._committed = (0, 0)
            return
        self.state = State.from_bytes(row[3])
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

    def _reset_buffers(self) -> None:
        self._events: list[tuple] = []
        self._batch_rows: list[tuple] = []
        self._malformed: list[tuple] = []
        self._dirty_workloads: dict[str, list[Any]] = {}
        self._closed_runs: list[list[Any]] = []
        self._dirty_runs: dict[str, bool] = {}
        self._closed_waits: list[list[Any]] = []
        self._dirty_waits: dict[str, bool] = {}
        self._health: list[tuple] = []
        self._nodes_dirty = False
        self._budget_dirty = False

    # -- position --------------------------------------------------------
    @property
    def position(self) -> tuple[int, int]:
        """(last input seq folded, last decision batch count folded) as committed."""
        return self._committed

    @property
    def pending_position(self) -> tuple[int, int]:
        """The position including what is buffered but not yet committed."""
        return (self.state.input_seq, self._batches)

    # -- folding -----------------------------------------------------------
    def _event_row(self, event: Event, workload: str | None, node: str | None) -> None:
        self._pos += 1
        self._events.append(
            (
                self._pos,
                self.state.now_ms,
                kind_of(event),
                workload,
                node,
                _json.encode(event).decode(),
            )
        )

    def add_input(self, seq: int, event: Input) -> None:
        state = self.state
        if seq <= state.input_seq:
            return  # already folded (a redelivery)
        if seq != state.input_seq + 1:
            raise ProjectionOrderError(
                f"input {seq} arrived after input {state.input_seq}: a gap in the history"
            )
        before = len(state.rejections)
        apply(state, event)
        rejected = len(state.rejections) > before
        now = state.now_ms
        t = type(event)
        self._event_row(event, getattr(event, "workload", None), getattr(event, "node", None))
        if t is WorkloadSubmitted:
            wid = event.workload  # type: ignore[union-attr]
            e: WorkloadSubmitted = event  # type: ignore[assignment]
            if rejected:
                if (
                    wid not in self.live
                    and state.status_of(wid) is None
                    and wid not in self.rejected_ids
                ):
                    self.rejected_ids.add(wid)
                    self._dirty_workloads[wid] = _workload_row(e, now, "rejected")
                return
            row = _workload_row(e, now, "pending")
            self.live[wid] = row
            self._dirty_workloads[wid] = row
            self.open_waits[wid] = [wid, now, None]
            self._dirty_waits[wid] = True
            return
        if rejected:
            return
        if t is WorkloadFinished:
            self._end(event.workload, event.outcome, "finished", now)  # type: ignore[union-attr]
        elif t is WorkloadCancelled:
            self._end(event.workload, "cancelled", "cancelled", now)  # type: ignore[union-attr]
        elif t is NodeHealthChanged:
            self._health.append((event.node, now, event.state))  # type: ignore[union-attr]
        elif t is NodeRegistered:
            self._nodes_dirty = True
        elif t is BudgetSet or t is BudgetRemoved:
            self._budget_dirty = True

    def add_undecodable(self, seq: int, at_ms: int, ref: str, reason: str) -> None:
        """Input ``seq`` whose bytes did not decode: folded as the scheduler folds it
        (the clock and the sequence advance, a rejection is queued for the next
        cycle's ``InputRejected``); recorded in ``malformed_inputs``."""
        state = self.state
        if seq <= state.input_seq:
            return
        if seq != state.input_seq + 1:
            raise ProjectionOrderError(
                f"input {seq} arrived after input {state.input_seq}: a gap in the history"
            )
        state.input_seq += 1
        if at_ms > state.now_ms:
            state.now_ms = at_ms
        state.rejections.append((ref, reason))
        self._malformed.append((seq, at_ms, ref, reason))

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
        self._dirty_workloads[wid] = row

    def add_batch(self, batch: DecisionBatch) -> None:
        state = self.state
        if batch.basis < state.input_seq:
            raise ProjectionOrderError(
                f"decisions based on input {batch.basis} arrived after input {state.input_seq} was folded"
            )
        if batch.basis > state.input_seq:
            raise ProjectionOrderError(
                f"decisions based on input {batch.basis} arrived before inputs {state.input_seq + 1}..{batch.basis}"
            )
        self._batches += 1
        self._batch_rows.append(
            (
                self._batches,
                batch.basis,
                self._pos,
                len(batch.decisions),
                batch.next_wakeup_ms,
                batch.v,
            )
        )
        for d in batch.decisions:
            apply(state, d)
            now = state.now_ms
            t = type(d)
            if t is WorkloadPlaced:
                wid = d.workload  # type: ignore[union-attr]
                self._event_row(d, wid, None)
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
                attempt = d.attempt  # type: ignore[union-attr]
                self.open_runs[wid] = [
                    [wid, s.node, s.gpus, now, None, d.allocated, None, attempt]  # type: ignore[union-attr]
                    for s in d.placement  # type: ignore[union-attr]
                ]
                self._dirty_runs[wid] = True
            elif t is WorkloadPreempted:
                wid = d.workload  # type: ignore[union-attr]
                self._event_row(d, wid, None)
                row = self.live[wid]
                self._close_runs(wid, now, "node_down" if d.reason == "node_down" else "preempted")  # type: ignore[union-attr]
                row[W_PRE] += 1
                if d.requeued:  # type: ignore[union-attr]
                    row[W_STATUS] = "pending"
                    self.open_waits[wid] = [wid, now, None]
                    self._dirty_waits[wid] = True
                else:
                    del self.live[wid]
                    row[W_STATUS] = "preempted"
                    row[W_ENDED] = now
                self._dirty_workloads[wid] = row
            elif t is NodeDrained:
                self._event_row(d, None, d.node)  # type: ignore[union-attr]
                self._health.append((d.node, now, "drained"))  # type: ignore[union-attr]
            else:
                self._event_row(d, None, None)

    # -- writing -------------------------------------------------------------
    def commit(self) -> None:
        """Write buffered rows, the position and the state snapshot in one transaction."""
        con = self.con
        state = self.state
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
            con.execute("DELETE FROM projection_position")
            con.execute(
                "INSERT INTO projection_position VALUES (?, ?, ?, ?)",
                [state.input_seq, self._batches, self._pos, state.to_bytes()],
            )
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        self._committed = (state.input_seq, self._batches)
        self._reset_buffers()
