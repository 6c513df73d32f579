"""A restarted gateway answers only from a caught-up view (issue 24, item 5).

Until its view has folded the decision batches stored when it started, every
``/v1/...`` request but the status is answered 503 ``catching_up`` with
``Retry-After``: never a final 4xx (``400 unknown owner``) that a later view
would not give."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from apportion.schemas.events import ClockTicked
from apportion.services.gateway import Gateway
from apportion.services.scheduler import Scheduler
from services_helpers import eventually, small_cluster

pytestmark = pytest.mark.nats


async def test_a_restarted_gateway_answers_503_then_202_never_400(
    jlog, oplog, gwlog, creds
) -> None:
    log = jlog  # the scheduler's: it ticks the clock
    await oplog.publish_inputs(small_cluster())
    stop = asyncio.Event()
    scheduler = Scheduler(log)
    sched = asyncio.create_task(scheduler.run(stop))
    try:
        for round_ in range(10):  # a history of many batches: catching up takes a while
            ticks = [
                ClockTicked(id=f"tick-{round_}-{i}", at_ms=1_000 * round_ + i) for i in range(500)
            ]
            await log.publish_inputs(ticks)
            last = await log.last_input_seq()
            await eventually(lambda last=last: scheduler.last_basis == last, what="a cycle")

        gateway = Gateway(gwlog, auth=creds.authenticator)
        serving = asyncio.create_task(gateway.serve(stop))
        await gateway.ready.wait()
        body = {"owner": "llm/a", "gpus": 4, "min_runtime_ms": 60_000, "id": "at-once"}
        statuses: list[int] = []
        async with aiohttp.ClientSession() as http:
            while not statuses or statuses[-1] != 202:
                async with http.post(
                    f"{gateway.url}/v1/workloads", json=body, headers=creds.headers("a")
                ) as r:
                    statuses.append(r.status)
                    answer = await r.json()
                    assert r.status in (202, 503), answer
                    if r.status == 503:
                        assert answer["code"] == "catching_up"
                        assert int(r.headers["Retry-After"]) >= 1
                assert len(statuses) < 2000, statuses
                await asyncio.sleep(0.01)
            async with http.get(f"{gateway.url}/v1/status") as r:
                assert (await r.json())["caught_up"] is True
        assert statuses[0] == 503 and statuses[-1] == 202 and 400 not in statuses
        await eventually(lambda: "at-once" in gateway.state.workloads, what="the submission")
    finally:
        stop.set()
        for task in [sched, *([serving] if "serving" in locals() else [])]:
            with contextlib.suppress(Exception):
                await task
