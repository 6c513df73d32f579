"""A reader whose stream has no leader (``503`` no responders, as while a cluster
elects one) waits and asks again instead of failing (services/direct.py)."""

from __future__ import annotations

import pytest
from apportion.services.bus import JetStreamLog
from apportion.services.direct import DirectTail, StoredMessage

pytestmark = pytest.mark.nats


async def test_a_reader_waits_through_no_responders_then_reads(nc, js, cluster, log_as) -> None:
    log = JetStreamLog(js, cluster)  # the scheduler's: it creates the streams
    s = log.subjects
    tail: DirectTail[bytes] = DirectTail(
        nc,
        s.inputs_stream,
        s.inputs_all,
        1,
        lambda m: m.data if isinstance(m, StoredMessage) else None,
    )
    try:
        # no such stream yet: nobody answers the direct get (503), the reader waits
        assert await tail.take(10, timeout=0.5) == []
        await log.setup()
        await (await log_as("operator")).publish_raw_input(b"first", kind="WorkloadSubmitted")
        got: list[bytes] = []
        for _ in range(40):
            got += await tail.take(10, timeout=0.5)
            if got:
                break
        assert got == [b"first"]
    finally:
        await tail.close()
