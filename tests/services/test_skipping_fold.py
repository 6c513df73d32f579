"""One loop folds the history and passes over a decision batch out of canonical
order: the follower, the projector and the scheduler all use it, with the same
log line (and the projector's metric)."""

from __future__ import annotations

import asyncio

import duckdb
import pytest
from apportion.core.state import State
from apportion.replay.projection import Projection
from apportion.schemas.events import DecisionBatch
from apportion.schemas.history import BatchItem, InputItem
from apportion.services.bus import MemoryLog
from apportion.services.canonical import Follower, SkippingFold
from apportion.services.projector import Projector
from apportion.services.scheduler import Scheduler
from services_helpers import eventually, small_cluster
from structlog.testing import capture_logs

SKIP_LINE = "skipped a decision batch out of canonical order"


class _Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw: object) -> None:
        self.lines.append((event, kw))


def test_the_fold_yields_each_item_after_folding_it_and_skips_a_batch_out_of_order() -> None:
    events = small_cluster(nodes=1)
    items = [InputItem(seq=i + 1, at_ms=0, ref=e.id, event=e) for i, e in enumerate(events)]
    n = len(items)
    rogue = BatchItem(seq=1, batch=DecisionBatch(basis=n, decisions=(), decisions_before=5))
    good = BatchItem(seq=2, batch=DecisionBatch(basis=n, decisions=()))
    lines, seen = _Lines(), []
    fold = SkippingFold(lines, lambda item, why: seen.append((item.seq, why)))
    state = State()
    out = []
    for item, why in fold.fold(state, [*items, rogue, good]):
        out.append(item)
        assert state.input_seq == min(item.seq, n) if isinstance(item, InputItem) else n
        assert why is None
    assert out == [*items, good]
    assert fold.skipped == 1 and [s for s, _ in seen] == [1]
    assert lines.lines[0][0] == SKIP_LINE and lines.lines[0][1]["seq"] == 1
    assert "belongs after decision 5" in lines.lines[0][1]["why"]
    # an input out of order is a broken reader: it raises
    with pytest.raises(Exception, match="gap or a repeat"):
        list(fold.fold(state, [items[0]]))


async def test_follower_projector_and_scheduler_skip_the_same_batch() -> None:
    log = MemoryLog()
    events = small_cluster(nodes=1)
    await log.publish_inputs(events)
    n = len(events)
    await log.publish_batch(DecisionBatch(basis=n, decisions=(), decisions_before=5), 0)
    await log.publish_batch(DecisionBatch(basis=n, decisions=()), 1)
    follower = Follower(log)
    projector = Projector(log, Projection(duckdb.connect()))
    scheduler = Scheduler(log)
    with capture_logs() as captured:
        while follower.reader.batches_done < 2:
            await follower.poll(0.05)
        stop = asyncio.Event()
        task = asyncio.create_task(projector.run(stop))
        await eventually(lambda: projector.position == (n, 2), what="projector at the end")
        stop.set()
        await task
        await scheduler.recover()
    assert follower.skipped == projector.skipped == scheduler.skipped == 1
    assert b"apportion_projector_batches_skipped_total 1.0" in projector.metrics.render()
    assert follower.state.digest() == projector.state.digest()
    assert scheduler.state is not None and scheduler.state.digest() == follower.state.digest()
    assert scheduler.batch_seq == 2
    skips = [c for c in captured if c["event"] == SKIP_LINE]
    assert [c["service"] for c in skips] == ["canonical", "projector", "scheduler"]
    assert all(c["seq"] == 1 for c in skips)
    await follower.close()
