"""A 3-node JetStream cluster on loopback: replicas=3 streams survive a SIGKILLed leader.

Three nats-server processes, each with its own generated config (free loopback
client and route ports, the accounts and users of production) and store dir.
Each part connects as its production user: the scheduler runs as ``apportion
serve scheduler --replicas 3`` with a multi-server ``NATS_URL`` of the
``scheduler`` user, the cluster's nodes, budget and work are published by the
operator, and the audit runs as the auditor. Inputs are published
before and after the INPUTS stream leader is killed (retrying while a new leader
is elected; ``Nats-Msg-Id`` makes a retried publish land once); the scheduler
must place every submitted workload and an audit of the history must pass.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from apportion.schemas.events import Input, WorkloadPlaced
from apportion.services.bus import JetStreamLog, connect
from apportion.services.natsconf import accounts_conf, user_url, users_of
from apportion.services.stack import free_port, nats_server_binary
from conftest import TEST_HOSTS, password
from services_helpers import (
    APPORTION_CMD,
    audit_live,
    eventually,
    kill_and_reap,
    small_cluster,
    submit,
    wait_port,
)
from test_failover import PlacedWatcher
from test_services import full_fold, read_all

pytestmark = pytest.mark.slow

NODE_CONF = """\
server_name: {name}
listen: 127.0.0.1:{port}
jetstream {{
  store_dir: "{store}"
  max_memory_store: 64MB
  max_file_store: 1GB
}}
cluster {{
  name: apportion_test
  listen: 127.0.0.1:{route}
  no_advertise: true
  routes: [
{routes}
  ]
}}
"""


class NatsCluster:
    def __init__(self, root: Path, binary: str, cluster: str) -> None:
        self.names = [f"n{i}" for i in range(1, 4)]
        self.ports = {n: free_port() for n in self.names}
        route_ports = {n: free_port() for n in self.names}
        routes = "\n".join(f"    nats-route://127.0.0.1:{p}" for p in route_ports.values())
        self.binary = binary
        self.confs: dict[str, Path] = {}
        self.logs: dict[str, Path] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        for n in self.names:
            store = root / n / "store"
            store.mkdir(parents=True)
            conf = root / n / "server.conf"
            server = NODE_CONF.format(
                name=n, port=self.ports[n], store=store, route=route_ports[n], routes=routes
            )
            users = {u: password(u) for u in users_of(TEST_HOSTS)}
            conf.write_text(accounts_conf(cluster, TEST_HOSTS, users, server=server))
            self.confs[n] = conf
            self.logs[n] = root / n / "server.log"
        self.url = ",".join(f"nats://127.0.0.1:{self.ports[n]}" for n in self.names)

    def url_as(self, user: str, url: str | None = None) -> str:
        """``url`` (every member by default) as ``user`` of the production accounts."""
        return user_url(url or self.url, user, password(user))

    def start(self) -> None:
        for n in self.names:
            self.procs[n] = subprocess.Popen(
                [self.binary, "-c", str(self.confs[n]), "-l", str(self.logs[n])],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        for n in self.names:
            wait_port(self.ports[n], self.procs[n])

    def kill(self, name: str) -> None:
        kill_and_reap(self.procs[name], signal.SIGKILL)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                kill_and_reap(proc)


@pytest.fixture
def nats_cluster(tmp_path: Path, cluster: str) -> Iterator[NatsCluster]:
    try:
        binary = nats_server_binary()
    except FileNotFoundError:
        pytest.skip("no nats-server binary")
    c = NatsCluster(tmp_path / "nats", binary, cluster)
    try:
        c.start()
        yield c
    finally:
        c.stop()
    assert all(p.poll() is not None for p in c.procs.values())


async def publish_retrying(log: JetStreamLog, event: Input, attempts: int = 120) -> None:
    """Publish one input, retrying while the cluster has no stream leader (dedup by id)."""
    for attempt in range(attempts):
        try:
            await log.publish_input(event)
            return
        except Exception:  # timeouts, no responders, 'no leader' API errors
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.25)


async def test_replicated_streams_survive_a_sigkilled_leader(
    nats_cluster: NatsCluster, cluster: str, tmp_path: Path
) -> None:
    nc = await connect(nats_cluster.url_as("scheduler"), name="test-scheduler")
    log = JetStreamLog(nc.jetstream(), cluster, replicas=3)
    await log.setup(attempts=120)
    op = await connect(nats_cluster.url_as("operator"), name="test-operator")
    oplog = JetStreamLog(op.jetstream(), cluster, replicas=3)
    for event in small_cluster(nodes=4):
        await publish_retrying(oplog, event)
    env = {**os.environ, "NATS_URL": nats_cluster.url_as("scheduler")}
    err_path = tmp_path / "scheduler.err"
    with open(err_path, "w") as err:
        sched = subprocess.Popen(
            [*APPORTION_CMD, "serve", "scheduler", "--cluster-name", cluster]
            + ["--replicas", "3", "--log-level", "warning"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    watcher: PlacedWatcher | None = None
    names = [f"w{i}" for i in range(30)]
    try:
        watcher = PlacedWatcher(log)

        async def placed(*want: str) -> bool:
            assert sched.poll() is None, err_path.read_text()
            return set(want) <= await watcher.poll()

        for name in names[:10]:
            await publish_retrying(oplog, submit(name, gpus=1))
        await eventually(lambda: placed(*names[:10]), timeout=90, what="first ten placed")

        info = await log.js.stream_info(log.subjects.inputs_stream)
        leader = info.cluster.leader
        assert leader in nats_cluster.names and info.config.num_replicas == 3
        nats_cluster.kill(leader)
        for name in names[10:]:
            await publish_retrying(oplog, submit(name, gpus=1))
        await eventually(lambda: placed(*names), timeout=120, what="every workload placed")
        info = await log.js.stream_info(log.subjects.inputs_stream)
        assert info.cluster.leader not in (None, leader)
        assert info.state.messages == len(small_cluster(nodes=4)) + len(names)
    finally:
        kill_and_reap(sched, signal.SIGTERM)
        if watcher is not None:
            await watcher.tail.close()

    inputs, batches = await read_all(log)
    await nc.drain()
    await op.close()
    assert [i.seq for i in inputs] == list(range(1, len(inputs) + 1))
    submitted = [i.event.workload for i in inputs if i.ref.startswith("submit-")]
    assert sorted(submitted) == sorted(names)  # nothing lost, nothing stored twice
    bases = [sb.batch.basis for sb in batches]
    assert all(a < b for a, b in zip(bases, bases[1:], strict=False)), bases
    placed_all = [
        d.workload for sb in batches for d in sb.batch.decisions if isinstance(d, WorkloadPlaced)
    ]
    assert sorted(placed_all) == sorted(names)
    full_fold(inputs, batches)
    out = audit_live(nats_cluster.url_as("auditor"), cluster)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all reproduced" in out.stdout, out.stdout
    print(out.stdout)


async def test_replicated_inputs_survive_a_member_with_a_damaged_store(
    nats_cluster: NatsCluster, cluster: str
) -> None:
    """docs/services.md, "Lost inputs": with three replicas, a member whose INPUTS
    block file is damaged while it is stopped does not lose acknowledged inputs:
    the history read through every member (the damaged one included) is whole
    and audits."""
    from test_lost_inputs import damage_first_block, publish_filler

    nc = await connect(nats_cluster.url_as("scheduler"), name="test-scheduler")
    log = JetStreamLog(nc.jetstream(), cluster, replicas=3)
    await log.setup(attempts=120)
    op = await connect(nats_cluster.url_as("operator"), name="test-operator")
    oplog = JetStreamLog(op.jetstream(), cluster, replicas=3)
    for event in small_cluster(nodes=2):
        await publish_retrying(oplog, event)
    await publish_filler(oplog)
    await publish_retrying(oplog, submit("after-filler", gpus=4))
    last = await log.last_input_seq()
    info = await log.js.stream_info(log.subjects.inputs_stream)
    damaged = info.cluster.leader  # the worst member to damage: it was serving reads
    await nc.close()
    await op.close()

    kill_and_reap(nats_cluster.procs[damaged], signal.SIGTERM)
    store = nats_cluster.confs[damaged].parent / "store"
    damage_first_block(store, log.subjects.inputs_stream)
    nats_cluster.procs[damaged] = subprocess.Popen(
        [nats_cluster.binary, "-c", str(nats_cluster.confs[damaged]), "-l", str(nats_cluster.logs[damaged])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_port(nats_cluster.ports[damaged], nats_cluster.procs[damaged])

    nc = await connect(nats_cluster.url_as("scheduler"), name="test-reader")
    log = JetStreamLog(nc.jetstream(), cluster, replicas=3)

    async def replicas_current() -> bool:
        try:
            i = await log.js.stream_info(log.subjects.inputs_stream)
        except Exception:
            return False
        peers = i.cluster.replicas or []
        return len(peers) == 2 and all(p.current for p in peers)

    await eventually(replicas_current, timeout=60, what="every replica current")
    # read through each member, the damaged one included (direct gets may be answered
    # by any replica): INPUTS is whole everywhere
    for name in nats_cluster.names:
        one = f"nats://127.0.0.1:{nats_cluster.ports[name]}"
        member = await connect(nats_cluster.url_as("scheduler", one), name="member")
        try:
            member_log = JetStreamLog(member.jetstream(), cluster, replicas=3)
            for _ in range(3):
                assert await member_log.input_gaps() == [], name
                inputs, _batches = await read_all(member_log)
                assert [i.seq for i in inputs] == list(range(1, last + 1)), name
        finally:
            await member.close()
    await nc.close()
    done = audit_live(nats_cluster.url_as("auditor"), cluster)
    assert done.returncode == 0, done.stdout + done.stderr
