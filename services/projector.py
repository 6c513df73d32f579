"""The projector: the canonical history into DuckDB, incrementally.

It reads both streams in canonical order (input ``k``, then the batch based on
``k``) from the position the projection committed last, feeds
:class:`apportion.replay.projection.Projection` and commits rows together with
that position in one transaction, so a restart resumes with no duplicate and no
gap. A batch's position is its DECISIONS sequence (the stream holds batches
only, so "batches folded" is also the last sequence read).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import duckdb
from apportion.core.history import fold_item
from apportion.replay.projection import Projection

from . import logs
from .bus import EventLog
from .canonical import CanonicalReader


def open_projection(path: str | Path | None) -> Projection:
    return Projection(duckdb.connect(str(path) if path else ":memory:"))


class Projector:
    """Folds the canonical history from the projection's committed position and
    shows each item to the projection, which writes the rows."""

    def __init__(self, log: EventLog, projection: Projection, commit_every_s: float = 0.2) -> None:
        self.log = log
        self.projection = projection
        self.commit_every_s = commit_every_s
        self.logger = logs.get("projector", cluster=log.subjects.cluster)
        self.position: tuple[int, int] = projection.position
        self.state = projection.saved_state()

    async def run(self, stop: asyncio.Event) -> None:
        inputs_done, batches_done = self.projection.position
        reader = CanonicalReader(self.log, inputs_done, batches_done)
        self.logger.info("resuming", input_seq=inputs_done, batches=batches_done)
        p, state = self.projection, self.state
        dirty = False
        last_commit = time.monotonic()
        try:
            while not stop.is_set():
                items = await reader.read(0.2, limit=5000)
                for item in items:
                    p(item, state, fold_item(state, item))
                dirty = dirty or bool(items)
                if dirty and (not items or time.monotonic() - last_commit >= self.commit_every_s):
                    p.commit(state)
                    dirty = False
                    last_commit = time.monotonic()
                    self.position = p.position
        finally:
            if dirty:
                p.commit(state)
                self.position = p.position
            await reader.close()
            self.logger.info("stopped", input_seq=self.position[0], batches=self.position[1])
