"""The projector: the canonical history into DuckDB, incrementally.

It reads both streams in canonical order (input ``k``, then the batch based on
``k``) from the position the projection committed last, feeds
:class:`apportion.replay.projection.Projection` and commits rows together with
that position in one transaction, so a restart resumes with no duplicate and no
gap. A batch's position is its DECISIONS sequence (the stream holds batches
only, so "batches folded" is also the last sequence read).

The file heals: :func:`open_projection` reads every table of it through (DuckDB
checks each block's checksum) and decodes the saved state; a file that is
truncated, bit-flipped or otherwise unreadable is moved aside
(``<file>.corrupt-<UTC time>``, with its WAL), logged, and replaced by an empty
one, which the projector rebuilds from the streams; so is a file ahead of the
streams (:func:`open_projection_for`). A decision batch out of canonical order
is logged and skipped.

An event whose rows the projection cannot derive (its open rows disagree with
the history: a bug) never stops the projector, which would only be restarted
into the same item: the event keeps its ``events`` row, the fault is logged
(``could not project an event``, with its position and the error), counted
(``apportion_projector_errors_total``) and recorded in the file's
``projection_errors`` table, and the projector goes on.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
from apportion.replay.projection import Projection, ProjectionFault

from . import logs
from .bus import EventLog
from .canonical import CanonicalReader, SkippingFold, judged_by
from .metrics import ProjectorMetrics, stored_inputs


class ProjectionCorrupt(Exception):
    """A projection file that cannot be used as it is."""


def check_projection(projection: Projection) -> None:
    """Read every table of ``projection`` through and decode its saved state;
    raise :class:`ProjectionCorrupt` (or a ``duckdb.Error``) if anything is damaged."""
    con = projection.con
    tables = [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'"
        ).fetchall()
    ]
    for table in tables:
        # hashing every value makes DuckDB read (and checksum) every block of the table
        con.execute(f'SELECT sum(hash(COLUMNS(*))) FROM "{table}"').fetchall()
    try:
        state = projection.saved_state()
    except Exception as exc:  # a saved state that does not decode, however it fails
        raise ProjectionCorrupt(
            f"its saved state does not decode ({type(exc).__name__}: {exc})"
        ) from None
    if state.input_seq != projection.position[0]:
        raise ProjectionCorrupt(
            f"its saved state is at input {state.input_seq}, its position at {projection.position[0]}"
        )


def _is_lock_error(exc: BaseException) -> bool:
    """DuckDB refusing a file another process has open: not damage, never moved aside."""
    text = str(exc).lower()
    return "could not set lock" in text or "conflicting lock" in text


def move_aside(path: Path) -> Path:
    """Rename ``path`` (and its ``.wal``) to ``<path>.corrupt-<UTC time>``; returns the new name."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    path.rename(aside)
    wal = path.with_name(path.name + ".wal")
    if wal.exists():
        wal.rename(aside.with_name(aside.name + ".wal"))
    return aside


def open_projection(
    path: str | Path | None, logger: Any = None, metrics: ProjectorMetrics | None = None
) -> Projection:
    """The projection in the DuckDB file ``path`` (in memory for ``None``); a
    damaged file is moved aside (logged, counted in ``metrics``' rebuilds) and
    an empty one takes its place."""
    if path is None:
        return Projection(duckdb.connect(":memory:"))
    path = Path(path)
    con: duckdb.DuckDBPyConnection | None = None
    try:
        con = duckdb.connect(str(path))
        projection = Projection(con)
        check_projection(projection)
        return projection
    except (duckdb.Error, ProjectionCorrupt) as exc:
        if con is not None:
            con.close()
        if isinstance(exc, duckdb.Error) and _is_lock_error(exc):
            raise
        reason = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    aside = move_aside(path)
    if metrics is not None:
        metrics.rebuilds.inc()
    (logger or logs.get("projector")).warning(
        "projection file unreadable; moved aside, rebuilding it from the streams",
        path=str(path),
        moved_to=str(aside),
        reason=reason,
    )
    return Projection(duckdb.connect(str(path)))


async def open_projection_for(
    path: str | Path | None,
    log: EventLog,
    logger: Any = None,
    metrics: ProjectorMetrics | None = None,
) -> Projection:
    """:func:`open_projection`, then also moved aside when the file is ahead of the
    streams (they lost their tail in an OS crash: its rows would not be theirs)."""
    projection = await asyncio.to_thread(open_projection, path, logger, metrics)
    inputs, batches = projection.position
    last_input, last_batch = await log.last_input_seq(), await log.last_batch_seq()
    if path is None or (inputs <= last_input and batches <= last_batch):
        return projection
    projection.con.close()
    aside = move_aside(Path(path))
    if metrics is not None:
        metrics.rebuilds.inc()
    (logger or logs.get("projector")).warning(
        "projection file ahead of the streams; moved aside, rebuilding it from the streams",
        path=str(path),
        moved_to=str(aside),
        position=[inputs, batches],
        streams=[last_input, last_batch],
    )
    return Projection(duckdb.connect(str(path)))


class Projector:
    """Folds the canonical history from the projection's committed position and
    shows each item to the projection, which writes the rows."""

    def __init__(
        self,
        log: EventLog,
        projection: Projection,
        commit_every_s: float = 0.2,
        metrics: ProjectorMetrics | None = None,
    ) -> None:
        self.log = log
        self.metrics = metrics or ProjectorMetrics()
        """Prometheus metrics (docs/services.md, "Metrics"); :meth:`metrics_text` renders them."""
        self.projection = projection
        projection.on_error = self._unprojected
        self.commit_every_s = commit_every_s
        self.logger = logs.get("projector", cluster=log.subjects.cluster)
        self.position: tuple[int, int] = projection.position
        self.state = projection.saved_state()
        self._fold = SkippingFold(self.logger, lambda _item, _why: self.metrics.skipped.inc())
        self._reader: CanonicalReader | None = None
        self.metrics.update(self.position, None)

    @property
    def skipped(self) -> int:
        """Decision batches skipped as out of canonical order."""
        return self._fold.skipped

    def _unprojected(self, fault: ProjectionFault) -> None:
        """The projection could not derive the rows of an event: log it, count it, go on."""
        self.metrics.errors.inc()
        self.logger.error(
            "could not project an event; recorded in projection_errors, going on",
            **fault._asdict(),
        )

    async def metrics_text(self) -> bytes:
        """The metrics in Prometheus' text format; the lag asks NATS for INPUTS' last sequence."""
        self.metrics.update(self.position, await stored_inputs(self.log))
        gap = self.gap
        self.metrics.inputs_missing.set(0 if gap is None else gap[1] - gap[0] + 1)
        return self.metrics.render()

    @property
    def gap(self) -> tuple[int, int] | None:
        """Inputs missing where the projector stopped (no loss accepted), or ``None``."""
        reader = self._reader
        return None if reader is None else reader.gap

    def _commit(self, state: Any) -> None:
        before = self.position
        self.projection.commit(state)
        self.position = self.projection.position
        self.metrics.committed(before, self.position)

    async def run(self, stop: asyncio.Event) -> None:
        inputs_done, batches_done = self.projection.position
        reader = self._reader = CanonicalReader(
            self.log, inputs_done, batches_done, may_accept=judged_by(lambda: self.state)
        )
        self.logger.info("resuming", input_seq=inputs_done, batches=batches_done)
        p, state = self.projection, self.state
        dirty = False
        last_commit = time.monotonic()
        try:
            while not stop.is_set():
                items = await reader.read(0.2, limit=5000)
                for item, why in self._fold.fold(state, items):
                    p(item, state, why)
                dirty = dirty or bool(items)
                if dirty and (not items or time.monotonic() - last_commit >= self.commit_every_s):
                    self._commit(state)
                    dirty = False
                    last_commit = time.monotonic()
        except Exception:
            # a database that failed may be damaged: let go of it, so that the next
            # open (a restart by the supervisor) checks the file afresh
            dirty = False
            p.con.close()
            raise
        finally:
            await reader.close()
            if dirty:
                self._commit(state)
            self.logger.info("stopped", input_seq=self.position[0], batches=self.position[1])
