"""Which hosts the scheduler marks down for silence, and when (services/scheduler.py, step
9; core/rules/fence.py): the default timeout (a policy's 0) watches only the hosts that
heartbeat, so hosts without an agent (the emulator's) are never marked; a policy's own
timeout watches every host; a silence that is the scheduler's own (its connection down,
or just back) marks nothing.

The heard times are set by hand (no waiting): each test says how long ago a host was
heard and asks for one check."""

from __future__ import annotations

import time

from apportion.core.rules.fence import DEFAULT_HEARTBEAT_TIMEOUT_MS
from apportion.schemas.events import BudgetSet, NodeHealthChanged, NodeRegistered, PolicySet
from apportion.services.bus import MemoryLog
from apportion.services.scheduler import Scheduler


async def scheduler(heartbeat_timeout_ms: int) -> tuple[Scheduler, MemoryLog]:
    log = MemoryLog()
    await log.publish_inputs(
        [
            BudgetSet(id="root", at_ms=0, path="", weight=1, owner="ops", actor="ops"),
            BudgetSet(id="a", at_ms=0, path="a", weight=1, owner="ops", actor="ops"),
            PolicySet(id="p", at_ms=0, actor="ops", heartbeat_timeout_ms=heartbeat_timeout_ms),
            *(
                NodeRegistered(id=n, at_ms=0, node=n, gpus=8, gpu_type="h100", actor="ops")
                for n in ("agent-host", "quiet-host", "emulated")
            ),
        ]
    )
    s = Scheduler(log)
    await s.recover()
    return s, log


def downs(log: MemoryLog) -> list[str]:
    out = []
    for item in log.inputs:
        event = item.event
        if isinstance(event, NodeHealthChanged) and event.state == "down":
            out.append(event.node)
    return out


def heard(s: Scheduler, node: str, seconds_ago: float) -> None:
    s.heard[node] = (time.monotonic() - seconds_ago, 1)


async def test_the_default_watches_only_the_hosts_that_heartbeat() -> None:
    s, log = await scheduler(0)
    default_s = DEFAULT_HEARTBEAT_TIMEOUT_MS / 1000
    heard(s, "agent-host", default_s + 1)
    heard(s, "quiet-host", default_s - 60)
    await s._check_heartbeats()
    assert downs(log) == ["agent-host"]
    assert "emulated" not in s.heard  # never heard: never watched, never marked
    await s._check_heartbeats()
    assert downs(log) == ["agent-host"]  # once per silence


async def test_a_policy_timeout_watches_every_host() -> None:
    s, log = await scheduler(60_000)
    await s._check_heartbeats()
    assert downs(log) == [] and set(s.heard) == {"agent-host", "quiet-host", "emulated"}
    heard(s, "emulated", 61)
    await s._check_heartbeats()
    assert downs(log) == ["emulated"]


async def test_an_old_history_timeout_under_5_s_is_read_as_5_s() -> None:
    s, log = await scheduler(1_500)
    await s._check_heartbeats()
    heard(s, "agent-host", 3)
    await s._check_heartbeats()
    assert downs(log) == []
    heard(s, "agent-host", 5.5)
    await s._check_heartbeats()
    assert downs(log) == ["agent-host"]


class FakeNats:
    """The parts of a nats-py connection the check reads."""

    def __init__(self) -> None:
        self.is_connected = True
        self.stats = {"reconnects": 0}
        self.flush_fails = False

    async def flush(self, timeout: float) -> None:
        if self.flush_fails:
            raise TimeoutError


async def test_the_schedulers_own_silence_marks_nothing() -> None:
    s, log = await scheduler(0)
    nc = FakeNats()
    log.nc = nc  # type: ignore[attr-defined]
    late = DEFAULT_HEARTBEAT_TIMEOUT_MS / 1000 + 1

    nc.is_connected = False  # cut off itself: it cannot tell who is silent
    heard(s, "agent-host", late)
    await s._check_heartbeats()
    assert downs(log) == []

    nc.is_connected, nc.stats["reconnects"] = True, 1  # back: every host heard again
    await s._check_heartbeats()
    assert downs(log) == [] and time.monotonic() - s.heard["agent-host"][0] < late

    heard(s, "agent-host", late)
    nc.flush_fails = True  # no round trip to the server: maybe its own link is gone
    await s._check_heartbeats()
    assert downs(log) == []

    nc.flush_fails = False
    await s._check_heartbeats()
    assert downs(log) == ["agent-host"]
