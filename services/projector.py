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
from typing import Any

from . import logs
from .bus import EventLog, StoredInput
from .canonical import CanonicalReader, fold_input


def open_projection(path: str | Path | None) -> Any:
    import duckdb
    from apportion.replay.projection import Projection

    con = duckdb.connect(str(path) if path else ":memory:")
    return Projection(con)


class Projector:
    def __init__(self, log: EventLog, projection: Any, commit_every_s: float = 0.2) -> None:
        self.log = log
        self.projection = projection
        self.commit_every_s = commit_every_s
        self.logger = logs.get("projector", cluster=log.subjects.cluster)
        self.position: tuple[int, int] = tuple(projection.position)  # type: ignore[assignment]

    async def run(self, stop: asyncio.Event) -> None:
        inputs_done, batches_done = self.projection.position
        reader = CanonicalReader(self.log, inputs_done, batches_done)
        self.logger.info("resuming", input_seq=inputs_done, batches=batches_done)
        p = self.projection
        dirty = False
        last_commit = time.monotonic()
        try:
            while not stop.is_set():
                items = await reader.read(0.2, limit=5000)
                for item in items:
                    if isinstance(item, StoredInput):
                        add_stored_input(p, item)
                    else:
                        p.add_batch(item.batch)
                dirty = dirty or bool(items)
                if dirty and (not items or time.monotonic() - last_commit >= self.commit_every_s):
                    p.commit()
                    dirty = False
                    last_commit = time.monotonic()
                    self.position = tuple(p.position)  # type: ignore[assignment]
        finally:
            if dirty:
                p.commit()
                self.position = tuple(p.position)  # type: ignore[assignment]
            await reader.close()
            self.logger.info("stopped", input_seq=self.position[0], batches=self.position[1])


def add_stored_input(projection: Any, item: StoredInput) -> None:
    """Feed one stored input. Bytes that did not decode have no event to record: they
    are folded into the projection's state as the scheduler folds them (a queued
    rejection), so the ``InputRejected`` decision that follows applies and is the
    row ``events`` keeps for them."""
    if item.event is not None:
        projection.add_input(item.seq, item.event)
        return
    hook = getattr(projection, "add_undecodable", None)
    if hook is not None:
        hook(item.seq, item.at_ms, item.ref, f"malformed input: {item.error}")
        return
    state = projection.state
    if item.seq <= state.input_seq:
        return
    fold_input(state, item)
