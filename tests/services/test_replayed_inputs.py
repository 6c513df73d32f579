"""Re-appended bytes (issue 24): a writer makes the server append the bytes of an
older stored input again on its own input subject (a direct get whose reply
subject is that subject: the reply lands in its own account, where that subject
leads into INPUTS). Within JetStream's duplicate window the ``Nats-Msg-Id``
stores it once; after it, only the fold can tell the copy from a new input, and
it does: ``duplicate_input`` (core/rules/identity.py). Against a real
nats-server with the accounts of production; the streams are made with a
duplicate window of one second so that the test need not wait two minutes."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from apportion.schemas.events import BudgetSet
from apportion.services.bus import JetStreamLog
from apportion.services.direct import get_batch
from apportion.services.scheduler import Scheduler
from services_helpers import eventually, small_cluster

pytestmark = pytest.mark.nats

WINDOW_S = 1.0


async def test_an_old_input_appended_again_by_a_writer_is_refused(
    nc, js, cluster: str, log_as, connect_as
) -> None:
    sched = JetStreamLog(js, cluster, duplicate_window_s=WINDOW_S)
    await sched.setup()
    op = await log_as("operator")
    team = next(e for e in small_cluster() if isinstance(e, BudgetSet) and e.path == "llm")
    await op.publish_inputs(small_cluster())
    edit = msgspec.structs.replace(team, id="b-llm-edit", weight=9)
    await op.publish_input(edit)  # the admin's later edit
    scheduler = Scheduler(sched)
    stop = asyncio.Event()
    task = asyncio.create_task(scheduler.run(stop))
    try:
        last = await sched.last_input_seq()
        await eventually(lambda: scheduler.last_basis == last, what="the cluster decided")
        assert scheduler.state is not None
        assert scheduler.state.budget.nodes["llm"].weight == 9
        stored, _ = await get_batch(nc, sched.subjects.inputs_stream, 1, 100)
        old = next(m for m in stored if m.headers.get("Nats-Msg-Id") == team.id)

        await asyncio.sleep(WINDOW_S + 0.5)  # past the stream's duplicate window
        gateway = await connect_as("gateway")
        await gateway.publish(
            f"$JS.API.DIRECT.GET.{sched.subjects.inputs_stream}",
            json.dumps({"seq": old.seq}).encode(),
            reply=sched.subjects.input_subject("BudgetSet"),  # its own subject
        )
        await gateway.flush()
        # the server appends it: the bytes of the first version, with its id
        await eventually(lambda: _stored_again(nc, sched, team.id, old.seq), what="the copy stored")
        last = await sched.last_input_seq()
        await eventually(lambda: scheduler.last_basis >= last, what="the copy decided")
        assert scheduler.state.budget.nodes["llm"].weight == 9  # the later edit stands
        folded = [ref for ref, _, _ in scheduler.state.rejections]
        assert folded == [], "announced: InputRejected decisions clear them"
    finally:
        stop.set()
        await task
    history = await _rejections(sched)
    assert history.get(team.id) == "duplicate_input", history


async def _stored_again(nc, log: JetStreamLog, msg_id: str, first: int) -> bool:
    got, _ = await get_batch(nc, log.subjects.inputs_stream, first + 1, 1000)
    return any(m.headers.get("Nats-Msg-Id") == msg_id for m in got)


async def _rejections(log: JetStreamLog) -> dict[str, str]:
    from apportion.schemas.events import InputRejected
    from apportion.schemas.history import BatchItem
    from apportion.services.canonical import read_history

    return {
        d.ref: d.code
        for item in await read_history(log, 10.0)
        if isinstance(item, BatchItem)
        for d in item.batch.decisions
        if isinstance(d, InputRejected)
    }
