"""A message on the decisions stream that is not the scheduler's: every reader skips
it and goes on, a new leader recovers past it, and the audit names it.

(With the accounts of infra/accounts.conf no role but the scheduler can write there:
tests/services/test_infra.py. A server without auth, like a local test server, can.)
"""

from __future__ import annotations

import asyncio

import duckdb
from apportion.replay.projection import Projection
from apportion.schemas.codec import encode
from apportion.schemas.events import DecisionBatch
from apportion.services.bus import JetStreamLog
from apportion.services.canonical import Follower, read_history
from apportion.services.projector import Projector
from apportion.services.scheduler import Scheduler
from click.testing import CliRunner
from services_helpers import eventually, small_cluster, submit

from apportion.cli import main


async def test_a_rogue_decisions_message_is_skipped_by_every_reader_and_named_by_the_audit(
    nats_server,
    jlog: JetStreamLog,
    cluster: str,
    oplog: JetStreamLog,
    projlog: JetStreamLog,
) -> None:
    await oplog.publish_inputs([*small_cluster(), submit("w1", gpus=1)])
    scheduler = Scheduler(jlog)
    follower = Follower(jlog)
    projector = Projector(projlog, Projection(duckdb.connect()))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(s.run(stop)) for s in (scheduler, projector)]
    try:

        def placed(*ids: str) -> bool:
            return scheduler.state is not None and all(i in scheduler.state.running for i in ids)

        await eventually(lambda: placed("w1"), what="w1 placed")
        # garbage bytes, then a decodable batch based on an input far ahead
        js = jlog.js
        await js.publish(jlog.subjects.decisions, b"\x00garbage")
        await js.publish(jlog.subjects.decisions, encode(DecisionBatch(basis=10_000, decisions=())))
        # everyone goes on: new work is placed, the readers follow the scheduler
        await oplog.publish_input(submit("w2", gpus=1))
        await eventually(lambda: placed("w1", "w2"), what="w2 placed after the rogue messages")

        async def same_digest() -> bool:
            await follower.poll(0.2)
            s, f = scheduler.state, follower.state
            return (
                s is not None
                and f is not None
                and f.input_seq == s.input_seq
                and f.decisions_folded == s.decisions_folded
                and f.digest() == s.digest()
            )

        await eventually(same_digest, what="the follower at the scheduler's state")
        await eventually(
            lambda: "w2" in projector.state.running, what="the projector past the rogue messages"
        )
        assert all(not t.done() for t in tasks)
        assert follower.reader.skipped == 1  # the garbage never decodes: the tail drops it
        assert scheduler.state is not None
        digest = scheduler.state.digest()
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await follower.close()
    # a new leader recovers past them (no loop) to the same state
    again = Scheduler(jlog)
    await asyncio.wait_for(again.recover(), 30)
    assert again.state is not None and again.state.digest() == digest
    # the history leaves them out, and says so
    foreign: list[str] = []
    await read_history(jlog, 10.0, foreign)
    assert len(foreign) == 2 and "not a decision batch" in foreign[0]
    assert "based on input 10000, not in INPUTS" in foreign[1]
    result = await asyncio.to_thread(
        CliRunner().invoke,
        main,
        ["audit", "--cluster", cluster, "--nats", nats_server.url_as("auditor")],
    )
    assert result.exit_code != 0
    assert "2 messages on the decisions stream are not part of the history" in result.output
    assert "not a decision batch" in result.output
