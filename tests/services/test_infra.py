"""infra/: the configs are valid, and the accounts file enforces who may publish what."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from apportion.services.bus import JetStreamLog
from apportion.services.scheduler import Scheduler
from services_helpers import small_cluster, submit

INFRA = Path(__file__).resolve().parents[2] / "infra"
CONFIGS = ["single.conf", "cluster/n1.conf", "cluster/n2.conf", "cluster/n3.conf", "accounts.conf"]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_is_valid(name: str) -> None:
    from conftest import nats_server_binary

    binary = nats_server_binary()
    if binary is None:
        pytest.skip("no nats-server binary")
    out = subprocess.run(
        [binary, "-t", "-c", str(INFRA / name)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr + out.stdout


async def _connect(port: int, user: str):
    import nats
    from apportion.services.natsconf import inbox_prefix

    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    nc = await nats.connect(
        f"nats://{user}:{user}-secret@127.0.0.1:{port}",
        error_cb=on_error,
        inbox_prefix=inbox_prefix(user),
    )
    return nc, errors


AGENT = "agent-h100-000"
"""The agent of host h100-000 (infra/accounts.conf has one per host of the demo cluster)."""
ROLES = ("scheduler", "gateway", "operator", AGENT, "projector", "auditor", "executor")
INPUT_KINDS = {
    "scheduler": {"ClockTicked", "NodeHealthChanged"},
    "gateway": {
        "WorkloadSubmitted",
        "WorkloadCancelled",
        "BudgetSet",
        "BudgetRemoved",
        "NodeHealthChanged",
    },
    "operator": {
        "WorkloadSubmitted",
        "WorkloadCancelled",
        "BudgetSet",
        "BudgetRemoved",
        "PolicySet",
        "NodeRegistered",
        "NodeHealthChanged",
        "WorkloadFinished",
    },
    AGENT: set(),
    "projector": set(),
    "auditor": set(),
    "executor": set(),
}
HOST_KINDS = {
    AGENT: {"NodeRegistered", "NodeHealthChanged", "WorkloadStarted", "WorkloadFinished"},
    "executor": {"WorkloadStarted", "WorkloadFinished"},
}
"""What a role may publish on ``apportion.demo.inputs.<Kind>.h100-000`` (a host's subjects)."""
ALL_KINDS = sorted(set().union(*INPUT_KINDS.values(), *HOST_KINDS.values()))


async def _refused(nc, subject: str, payload: bytes = b"{}") -> bool:
    """A JetStream API request or a stream publish that gets no answer (the server
    drops what a user may not publish) is refused."""
    import nats.errors

    try:
        await nc.request(subject, payload, timeout=0.4)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return True
    return False


async def _subscribe_refused(nc, subject: str) -> bool:
    """A subscription the server refuses: a heartbeat published after it never arrives."""
    import asyncio

    got: list[bytes] = []

    async def cb(msg) -> None:
        got.append(msg.data)

    sub = await nc.subscribe(subject, cb=cb)
    agent, _ = await _connect_port(nc)
    try:
        await agent.publish("apportion.demo.heartbeat.h100-000", b"x")
        await agent.flush()
        await nc.flush()
        await asyncio.sleep(0.3)
    finally:
        await agent.close()
        await sub.unsubscribe()
    return not got


async def _connect_port(nc):
    port = int(nc.connected_url.port)
    return await _connect(port, AGENT)


async def _stored(nc, stream: str) -> int:
    info = await nc.jetstream().stream_info(stream)
    return info.state.messages


async def test_accounts_enforce_roles(secure_server: int) -> None:
    """Every role reads; each publishes only its input kinds; only the scheduler
    writes decisions; nobody creates a consumer on the streams (whose deliver
    subject could be DECISIONS), deletes or purges."""
    import asyncio
    import json

    conns = {role: (await _connect(secure_server, role))[0] for role in ROLES}
    try:
        sched = JetStreamLog(conns["scheduler"].jetstream(), "demo")
        await sched.setup()
        op = JetStreamLog(conns["operator"].jetstream(timeout=1.0), "demo")
        await op.publish_inputs(small_cluster() + [submit("w1")])
        s = Scheduler(sched, await sched.snapshots(), await sched.lease("s1"))
        await s.recover()
        assert await s.cycle() is not None
        await s.save_snapshot()
        await s._tail.close()
        inputs, decisions = await _stored(conns["scheduler"], "INPUTS_demo"), 1
        for role, nc in conns.items():
            # reads: every role, by direct get
            tail = JetStreamLog(nc.jetstream(timeout=1.0), "demo").tail_batches(1)
            assert [b.seq for b in await tail.take(10, 5.0)] == [1], role
            await tail.close()
            # inputs: only its kinds (the refusals are asked all at once)
            kinds = await asyncio.gather(
                *(_refused(nc, f"apportion.demo.inputs.{k}", b"not json") for k in ALL_KINDS)
            )
            assert dict(zip(ALL_KINDS, kinds, strict=True)) == {
                k: k not in INPUT_KINDS[role] for k in ALL_KINDS
            }, role
            inputs += kinds.count(False)
            # a host's subjects: only its agent (and the executor emulator)
            on_host = await asyncio.gather(
                *(
                    _refused(nc, f"apportion.demo.inputs.{k}.h100-000", b"not json")
                    for k in ALL_KINDS
                )
            )
            assert dict(zip(ALL_KINDS, on_host, strict=True)) == {
                k: k not in HOST_KINDS.get(role, set()) for k in ALL_KINDS
            }, role
            inputs += on_host.count(False)
            # no consumer on the streams, not even for the scheduler: a push consumer's
            # deliver subject is where the server writes; no deletes, no purges
            body = json.dumps({"config": {"deliver_subject": "apportion.demo.decisions"}}).encode()
            routes = [
                (f"$JS.API.{api}.{stream}{suffix}", payload)
                for stream in ("INPUTS_demo", "DECISIONS_demo")
                for api, suffix, payload in (
                    ("CONSUMER.CREATE", "", body),
                    ("CONSUMER.CREATE", ".x.>", body),
                    ("CONSUMER.DURABLE.CREATE", ".x", body),
                    ("STREAM.DELETE", "", b""),
                    ("STREAM.PURGE", "", b""),
                    ("STREAM.MSG.DELETE", "", b'{"seq": 1}'),
                )
            ]
            if role != "scheduler":
                routes.append(("apportion.demo.decisions", b"garbage"))
            refused = await asyncio.gather(*(_refused(nc, r, p) for r, p in routes))
            assert all(refused), (
                role,
                [r for (r, _), ok in zip(routes, refused, strict=True) if not ok],
            )
        # what was refused left no trace; what was allowed was stored
        assert await _stored(conns["scheduler"], "DECISIONS_demo") == decisions
        assert await _stored(conns["scheduler"], "INPUTS_demo") == inputs
        # heartbeats: only agents publish them; the scheduler and the agents hear them
        heard: dict[str, list[str]] = {"scheduler": [], AGENT: []}
        for role, got in heard.items():

            async def cb(msg, got=got) -> None:
                got.append(msg.data.decode())

            await conns[role].subscribe("apportion.demo.heartbeat.>", cb=cb)
        for role, nc in conns.items():
            await nc.publish("apportion.demo.heartbeat.h100-000", role.encode())
            await nc.flush()
        for role, got in heard.items():
            for _ in range(200):
                if got:
                    break
                await asyncio.sleep(0.01)
            await conns[role].flush()
            assert got == [AGENT], role
        for role in ("gateway", "operator", "projector", "auditor", "executor"):
            assert await _subscribe_refused(conns[role], "apportion.demo.heartbeat.>"), role
    finally:
        for nc in conns.values():
            await nc.close()


def test_accounts_conf_is_the_generated_one() -> None:
    """infra/accounts.conf is what apportion.services.natsconf generates for the demo
    cluster (regenerate it with ``apportion nats-config --example > infra/accounts.conf``)."""
    from apportion.services.natsconf import example_conf

    assert (INFRA / "accounts.conf").read_text() == example_conf()


def test_nats_config_writes_a_valid_file_for_a_cluster(tmp_path: Path) -> None:
    """`apportion nats-config --cluster FILE` for another cluster: valid for
    nats-server, one agent user per host, the passwords given kept."""
    import sys

    from apportion.services.stack import DEMO_CLUSTER_TOML
    from conftest import nats_server_binary

    cluster = tmp_path / "c.toml"
    cluster.write_text(DEMO_CLUSTER_TOML.replace('name = "demo"', 'name = "ai2"'))
    passwords = tmp_path / "users.toml"
    passwords.write_text('[users]\ngateway = "kept-password"\n')
    out = subprocess.run(
        [sys.executable, "-m", "apportion", "nats-config", "--cluster", str(cluster)]
        + ["--passwords", str(passwords), "--no-executor"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert 'user: "gateway", password: "kept-password"' in text
    assert "AGENT_a100-001" in text and "$JS.API.DIRECT.GET.INPUTS_ai2" in text
    assert "EXECUTOR" not in text
    binary = nats_server_binary()
    if binary is not None:
        conf = tmp_path / "accounts.conf"
        conf.write_text(text)
        check = subprocess.run([binary, "-t", "-c", str(conf)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr + check.stdout


async def test_the_jetstream_api_does_not_cross_accounts(tmp_path: Path) -> None:
    """Readers and a damaged replica (docs/security.md): ``STREAM.MSG.GET`` (an input
    as the INPUTS leader holds it, when a replica that answered a direct get lost it)
    is the scheduler's alone. Importing it into a reader's account from APPORTION
    does not help: the JetStream API answers a request as if for the account it
    came from ("JetStream not enabled for account", 10039), where a direct get is
    answered by the stream itself. So no reader account imports it."""
    from apportion.services.bus import connect
    from apportion.services.natsconf import JS_ACCOUNT
    from conftest import production_conf, production_server
    from services_helpers import small_cluster

    get = "$JS.API.STREAM.MSG.GET.INPUTS_c1"
    conf = production_conf("c1", ["h000"], tmp_path / "js")
    assert get not in conf.split('"AUDITOR"')[1]  # the scheduler's only
    # the same accounts with the leader's get exported to, and imported by, the auditor
    conf = conf.replace(
        "    exports = [\n",
        f'    exports = [\n      {{ service: "{get}" }}\n',
        1,
    ).replace(
        '"AUDITOR" {\n    users = [\n      {\n        user: "auditor", password: "auditor-secret"\n'
        "        permissions {\n          publish { allow: [\n",
        '"AUDITOR" {\n    users = [\n      {\n        user: "auditor", password: "auditor-secret"\n'
        f'        permissions {{\n          publish {{ allow: [\n            "{get}"\n',
        1,
    )
    conf = conf.replace(
        "    imports = [\n",
        f'    imports = [\n      {{ service: {{ account: {JS_ACCOUNT}, subject: "{get}" }} }}\n',
    )
    server = production_server(tmp_path, "c1", ["h000"])
    server.conf = conf
    server.start()
    conns = []
    try:
        for user in ("scheduler", "operator", "auditor"):
            conns.append(await connect(server.url_as(user), name=f"t-{user}", timeout_s=10))
        sched, op, auditor = (JetStreamLog(nc.jetstream(timeout=2.0), "c1") for nc in conns)
        await sched.setup()
        await op.publish_inputs(small_cluster())
        held = await sched._leader_input(2)  # the scheduler asks the leader
        assert held is not None and held.seq == 2
        answer = await conns[2].request(get, b'{"seq": 2}', timeout=2.0)
        assert b"JetStream not enabled for account" in answer.data, answer.data
        assert await auditor._leader_input(2) is None
    finally:
        for nc in conns:
            await nc.close()
        server.stop()
