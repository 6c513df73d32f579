"""infra/: the configs are valid, and the accounts file enforces who may publish what."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from apportion.schemas.events import DecisionBatch
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


@pytest.fixture
def secure_server(tmp_path: Path):
    from conftest import free_port, nats_server_binary

    binary = nats_server_binary()
    if binary is None:
        pytest.skip("no nats-server binary")
    port = free_port()
    text = (INFRA / "accounts.conf").read_text()
    conf = tmp_path / "accounts.conf"
    conf.write_text(text.replace('"./.apportion/nats-secure"', f'"{tmp_path / "js"}"'))
    proc = subprocess.Popen(
        [binary, "-c", str(conf), "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    from conftest import _wait_port

    _wait_port(port, proc)
    yield port
    proc.terminate()
    proc.wait(10)


async def _connect(port: int, user: str):
    import nats

    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    nc = await nats.connect(f"nats://{user}:{user}-secret@127.0.0.1:{port}", error_cb=on_error)
    return nc, errors


async def test_accounts_enforce_roles(secure_server: int) -> None:
    import nats.errors

    sched_nc, _ = await _connect(secure_server, "scheduler")
    gw_nc, _ = await _connect(secure_server, "gateway")
    aud_nc, _ = await _connect(secure_server, "auditor")
    try:
        sched = JetStreamLog(sched_nc.jetstream(), "demo")
        await sched.setup()
        gw = JetStreamLog(gw_nc.jetstream(timeout=1.0), "demo")
        aud = JetStreamLog(aud_nc.jetstream(timeout=1.0), "demo")
        # gateway and services publish inputs; the scheduler decides, snapshots and holds its lease
        await gw.publish_inputs(small_cluster() + [submit("w1")])
        s = Scheduler(sched, await sched.snapshots(), await sched.lease("s1"))
        await s.recover()
        assert await s.cycle() is not None
        await s.save_snapshot()
        await s._tail.close()  # noqa: SLF001
        # nobody else publishes decisions, the auditor publishes nothing, and all can read
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await gw.publish_batch(DecisionBatch(basis=99, decisions=()), 1)
        with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
            await aud.publish_input(submit("w2"))
        tail = aud.tail_batches(1)
        assert [b.batch.basis for b in await tail.take(10, 10.0)] == [len(small_cluster()) + 1]
        await tail.close()
        assert await sched.last_batch_seq() == 1
    finally:
        for nc in (sched_nc, gw_nc, aud_nc):
            await nc.close()
