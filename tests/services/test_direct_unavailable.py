"""A reader whose stream has no leader (``503`` no responders, as while a cluster
elects one) waits and asks again instead of failing (services/direct.py)."""

from __future__ import annotations

import pytest
from apportion.services.direct import DirectTail, StoredMessage
from nats.js.api import StreamConfig

pytestmark = pytest.mark.nats


async def test_a_reader_waits_through_no_responders_then_reads(nc, js, cluster) -> None:
    stream, subject = f"S_{cluster}", f"direct.{cluster}"
    tail: DirectTail[bytes] = DirectTail(
        nc, stream, subject, 1, lambda m: m.data if isinstance(m, StoredMessage) else None
    )
    try:
        # no such stream yet: nobody answers the direct get (503), the reader waits
        assert await tail.take(10, timeout=0.5) == []
        await js.add_stream(StreamConfig(name=stream, subjects=[subject], allow_direct=True))
        await js.publish(subject, b"first")
        got: list[bytes] = []
        for _ in range(40):
            got += await tail.take(10, timeout=0.5)
            if got:
                break
        assert got == [b"first"]
    finally:
        await tail.close()
        await js.delete_stream(stream)
