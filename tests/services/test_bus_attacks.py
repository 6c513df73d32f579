"""The attacks of issue 24 on the bus, against a real nats-server with the real
configuration (``infra/accounts.conf``, what ``apportion up`` generates for the
demo cluster), and against the one-account file it replaces
(``data/accounts-one-account.conf``), to show what they did there.

1. Writes through a reply subject: a direct get (every credential may ask one)
   with its reply set to an inputs subject, the decisions subject or the lease
   key made the server publish there. Now every credential but the scheduler's
   has an account of its own, the reply is delivered in that account, and only
   subjects the credential may publish itself lead into the streams.
2. Any role could send every kind: the gateway's credential stored a
   ``PolicySet`` on the ``WorkloadCancelled`` subject, an agent finished another
   host's run as ``admin``. Now the fold binds kind, host and actor to the subject.
6. Every role could read other clients' replies on ``_INBOX.>``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from apportion.core.history import fold_history
from apportion.schemas.codec import encode
from apportion.schemas.events import PolicySet, WorkloadFinished
from apportion.services.bus import JetStreamLog, connect
from apportion.services.direct import get_batch
from apportion.services.natsconf import ROLE_KINDS, agent_user
from apportion.services.scheduler import Scheduler
from services_helpers import small_cluster, submit

ONE_ACCOUNT = Path(__file__).resolve().parent / "data" / "accounts-one-account.conf"

H0, H1 = "h100-000", "h100-001"
"""Two hosts of the demo cluster, each with its agent's credential."""
IN = "apportion.demo.inputs"
KINDS = sorted(
    {
        *ROLE_KINDS["operator"],
        *ROLE_KINDS["scheduler"],
        "WorkloadStarted",
    }
)
TARGETS = [
    *(f"{IN}.{k}" for k in KINDS),
    *(f"{IN}.{k}.{h}" for k in ("NodeHealthChanged", "WorkloadFinished") for h in (H0, H1)),
    "apportion.demo.decisions",
    "$KV.apportion_demo_leases.scheduler",
]
"""Where an attacker would like the server to publish."""


@pytest.fixture
def one_account(tmp_path: Path) -> Iterator[int]:
    """nats-server with the one-account file of before issue 24; its port."""
    from conftest import start_configured_server

    proc, port = start_configured_server(ONE_ACCOUNT.read_text(), tmp_path)
    yield port
    proc.terminate()
    proc.wait(10)


class Bus:
    """Connections as each user (password ``<user>-secret``), the scheduler's set-up done."""

    def __init__(self, port: int, inbox: str | None = None) -> None:
        self.port = port
        self.inbox = inbox
        """``_INBOX`` for a file of before per-user inbox prefixes; ``None``: each user's."""
        self.conns: dict[str, Any] = {}

    async def as_user(self, user: str) -> Any:
        if user not in self.conns:
            url = f"nats://{user}:{user}-secret@127.0.0.1:{self.port}"
            if self.inbox is None:
                self.conns[user] = await connect(url, name=f"test-{user}", timeout_s=10)
            else:
                import nats

                self.conns[user] = await nats.connect(url, inbox_prefix=self.inbox)
        return self.conns[user]

    async def setup(self, operator: str = "operator") -> tuple[JetStreamLog, Any]:
        sched = JetStreamLog((await self.as_user("scheduler")).jetstream(), "demo")
        await sched.setup()
        op = JetStreamLog((await self.as_user(operator)).jetstream(timeout=2.0), "demo")
        await op.publish_inputs(small_cluster() + [submit("w1")])
        lease = await sched.lease("s1", ttl_s=60)
        assert await lease.acquire()
        return sched, lease

    async def stored(self, stream: str, after: int = 0) -> list[Any]:
        nc = await self.as_user("scheduler")
        got, _ = await get_batch(nc, stream, after + 1, 1000)
        return got

    async def close(self) -> None:
        for nc in self.conns.values():
            await nc.close()


@pytest.fixture
async def bus(secure_server: int) -> AsyncIterator[Bus]:
    b = Bus(secure_server)
    try:
        yield b
    finally:
        await b.close()


async def _reply_attack(nc: Any, allowed: list[str]) -> None:
    """Ask for stored messages (one, and a batch) with the reply set to every
    target; publish on each allowed subject with the reply set to every target."""
    for target in TARGETS:
        for stream in ("INPUTS_demo", "DECISIONS_demo"):
            for body in ({"seq": 1}, {"seq": 1, "batch": 3}):
                await nc.publish(
                    f"$JS.API.DIRECT.GET.{stream}", json.dumps(body).encode(), reply=target
                )
        for subject in allowed:
            await nc.publish(subject, b"junk", reply=target)
    await nc.flush()


ATTACKERS = {
    "gateway": [f"{IN}.{k}" for k in ROLE_KINDS["gateway"]],
    "operator": [f"{IN}.{k}" for k in ROLE_KINDS["operator"]],
    "projector": [],
    "auditor": [],
    "executor": [f"{IN}.{k}.{H1}" for k in ("WorkloadStarted", "WorkloadFinished")],
    agent_user(H0): [f"{IN}.{k}.{H0}" for k in ("NodeHealthChanged", "WorkloadFinished")],
}
"""Each user, and the subjects it may publish on itself (a sample of them)."""


@pytest.mark.parametrize("user", sorted(ATTACKERS))
async def test_a_reply_subject_writes_only_where_the_credential_may_publish(
    bus: Bus, user: str
) -> None:
    sched_log, lease = await bus.setup()
    s = Scheduler(sched_log, await sched_log.snapshots(), await sched_log.lease("s2"))
    await s.recover()
    assert await s.cycle() is not None  # DECISIONS holds a batch, which has no Nats-Msg-Id
    await s._tail.close()
    inputs_before = len(await bus.stored("INPUTS_demo"))
    decisions_before = len(await bus.stored("DECISIONS_demo"))
    revision = lease.revision
    nc = await bus.as_user(user)
    await _reply_attack(nc, ATTACKERS[user])
    await asyncio.sleep(0.5)
    # nothing on DECISIONS, the lease untouched
    assert len(await bus.stored("DECISIONS_demo")) == decisions_before
    entry = await lease.kv.get("scheduler")
    assert (entry.revision, entry.value) == (revision, b"s1")
    # INPUTS: what was stored is on the attacker's own subjects only (its junk, and
    # a reply the server sent there; a copy of a stored input keeps its Nats-Msg-Id
    # and is not stored again)
    new = await bus.stored("INPUTS_demo", inputs_before)
    ours = set(ATTACKERS[user])
    assert {m.subject for m in new} <= ours, sorted({m.subject for m in new} - ours)
    if not ours:
        assert new == []
    # and none of it changes the state: each is refused, as junk or by its subject
    sched = JetStreamLog((await bus.as_user("scheduler")).jetstream(), "demo")
    tail = sched.tail_inputs(1)
    items = []
    while not tail.caught_up or not items:
        items += await tail.take(1000, 2.0)
    await tail.close()
    state = fold_history(items[:inputs_before])
    rejected_before = len(state.rejections)
    fold_history(items[inputs_before:], state)
    assert len(state.rejections) - rejected_before == len(new)


async def test_in_one_shared_account_the_auditor_wrote_into_both_streams(one_account: int) -> None:
    """What the attack did with the file of before: the auditor's direct gets,
    answered on the BudgetSet subject and on DECISIONS, were stored there."""
    b = Bus(one_account, inbox="_INBOX")
    try:
        _, lease = await b.setup()
        inputs_before = len(await b.stored("INPUTS_demo"))
        nc = await b.as_user("auditor")
        await _reply_attack(nc, [])
        await asyncio.sleep(0.5)
        new = await b.stored("INPUTS_demo", inputs_before)
        assert f"{IN}.BudgetSet" in {m.subject for m in new}
        assert len(await b.stored("DECISIONS_demo")) > 0
        entry = await lease.kv.get("scheduler")
        assert entry.value != b"s1" or entry.revision != lease.revision
    finally:
        await b.close()


async def test_no_role_reads_another_roles_replies(bus: Bus) -> None:
    """Every user may subscribe to its own inbox prefix only: ``_INBOX.>`` and
    another user's prefix are refused, and a request's reply reaches its asker only."""
    await bus.setup()
    spy = await bus.as_user("auditor")
    heard: list[str] = []

    async def cb(msg: Any) -> None:
        heard.append(msg.subject)

    for pattern in ("_INBOX.>", "_INBOX_gateway.>", "_INBOX_scheduler.>", ">"):
        await spy.subscribe(pattern, cb=cb)
    await spy.flush()
    gateway = JetStreamLog((await bus.as_user("gateway")).jetstream(timeout=2.0), "demo")
    await gateway.publish_input(submit("w2"))
    tail = gateway.tail_batches(1)
    await tail.take(10, 0.5)
    await tail.close()
    assert await gateway.last_input_seq() > 0
    await asyncio.sleep(0.3)
    assert not [s for s in heard if s.startswith("_INBOX")], heard


async def test_a_kind_on_another_kinds_subject_is_stored_but_refused(bus: Bus) -> None:
    """The gateway may publish on the WorkloadCancelled subject; a PolicySet stored
    there (operators += mallory) is refused by the fold (``wrong_subject``)."""
    sched, _ = await bus.setup()
    nc = await bus.as_user("gateway")
    policy = PolicySet(id="evil", at_ms=0, actor="ops", operators=("mallory",))
    await nc.jetstream(timeout=2.0).publish(f"{IN}.WorkloadCancelled", encode(policy))
    s = Scheduler(sched, await sched.snapshots(), await sched.lease("s2"))
    await s.recover()
    assert "mallory" not in s.state.policy.operators
    assert [code for ref, _, code in s.state.rejections if ref == "evil"] == ["wrong_subject"]
    await s._tail.close()


async def test_an_agent_speaks_for_its_own_host_only(bus: Bus) -> None:
    """The agent of h100-001 may not publish on h100-000's subjects (the server
    drops it), and what it says on its own subject about a run on another host,
    even as ``ops`` (the root's owner), is refused (``wrong_host``)."""
    import nats.errors

    sched, _ = await bus.setup()
    s = Scheduler(sched, await sched.snapshots(), await sched.lease("s2"))
    await s.recover()
    assert await s.cycle() is not None
    await s._tail.close()
    assert "w1" in s.state.running  # on h000, a host of small_cluster()
    js = (await bus.as_user(agent_user(H1))).jetstream(timeout=1.0)
    finish = WorkloadFinished(id="evil-finish", at_ms=0, workload="w1", actor="ops")
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await js.publish(f"{IN}.WorkloadFinished.{H0}", encode(finish))
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await js.publish(f"{IN}.WorkloadFinished", encode(finish))
    await js.publish(f"{IN}.WorkloadFinished.{H1}", encode(finish))
    again = Scheduler(sched, await sched.snapshots(), await sched.lease("s3"))
    await again.recover()
    assert "w1" in again.state.running
    assert [c for ref, _, c in again.state.rejections if ref == "evil-finish"] == ["wrong_host"]
    await again._tail.close()


async def test_the_services_run_each_as_its_own_user(secure_server: int, tmp_path: Path) -> None:
    """Production's shape on infra/accounts.conf: `serve` scheduler, projector,
    executor and gateway, each connected as its own user (only the scheduler has
    the JetStream API; the others read by direct get), place and finish work
    that the operator's bootstrap and the gateway's submission asked for."""
    from apportion.services.runner import serve
    from services_helpers import eventually

    url = "nats://{0}:{0}-secret@127.0.0.1:" + str(secure_server)
    stop = asyncio.Event()
    port = __import__("apportion.services.stack", fromlist=["free_port"]).free_port()
    tasks = [
        asyncio.create_task(serve("scheduler", url.format("scheduler"), "demo", stop=stop)),
        asyncio.create_task(
            serve("projector", url.format("projector"), "demo", db=tmp_path / "p.duckdb", stop=stop)
        ),
        asyncio.create_task(serve("executor", url.format("executor"), "demo", stop=stop)),
        asyncio.create_task(
            serve("gateway", url.format("gateway"), "demo", port=port, insecure=True, stop=stop)
        ),
    ]
    b = Bus(secure_server)
    try:
        auditor = JetStreamLog((await b.as_user("auditor")).jetstream(timeout=5.0), "demo")

        async def streams_exist() -> bool:
            try:
                await auditor.last_batch_seq()
            except Exception:
                return False
            return True

        await eventually(streams_exist, what="the scheduler set the streams up")
        op = JetStreamLog((await b.as_user("operator")).jetstream(timeout=5.0), "demo")
        await op.publish_inputs(small_cluster())
        gateway = JetStreamLog((await b.as_user("gateway")).jetstream(timeout=5.0), "demo")
        await gateway.publish_input(submit("w1", duration_ms=500))

        async def finished() -> bool:
            tail = auditor.tail_inputs(1)
            items: list[Any] = []
            while True:
                got = await tail.take(1000, 0.5)
                if not got:
                    break
                items += got
            await tail.close()
            return any(
                getattr(i.event, "workload", None) == "w1"
                and type(i.event).__name__ == "WorkloadFinished"
                and i.subject == f"{IN}.WorkloadFinished.h000"
                for i in items
            )

        await eventually(finished, timeout=60, what="w1 placed, run and reported by its host")
        for t in tasks:
            assert not t.done(), t
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await b.close()
