"""Prometheus metrics of the scheduler and the projector, on a real nats-server:
scraped over HTTP (the server ``apportion serve --metrics-port`` starts, and the
gateway's ``/metrics`` that ``apportion up`` extends)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import duckdb
import pytest
from apportion.replay.projection import Projection
from apportion.services.bus import JetStreamLog
from apportion.services.gateway import Gateway
from apportion.services.metrics import ProjectorMetrics, start_metrics_server
from apportion.services.projector import Projector, open_projection_for
from apportion.services.runner import serve
from apportion.services.scheduler import Scheduler
from apportion.services.stack import free_port
from prometheus_client.parser import text_string_to_metric_families
from services_helpers import eventually, small_cluster, submit

if TYPE_CHECKING:
    from conftest import NatsServer


@contextlib.asynccontextmanager
async def running(*services: Any) -> AsyncIterator[asyncio.Event]:
    """Run each service's ``run(stop)`` until the block ends; re-raise their errors."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(s.run(stop)) for s in services]
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples at ``url``: (name, sorted labels) -> value."""
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return parse(text)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_scheduler_and_projector_metrics_move(
    jlog: JetStreamLog, tmp_path: Path, oplog: JetStreamLog, projlog: JetStreamLog
) -> None:
    await oplog.publish_inputs(small_cluster(nodes=2))
    scheduler = Scheduler(jlog)
    projector = Projector(projlog, Projection(duckdb.connect(str(tmp_path / "p.duckdb"))))
    s_runner, s_url = await start_metrics_server(scheduler.metrics_text, "127.0.0.1", 0)
    p_runner, p_url = await start_metrics_server(projector.metrics_text, "127.0.0.1", 0)
    try:
        async with running(scheduler, projector):
            await oplog.publish_inputs(
                [
                    submit("a1", owner="llm/a", gpus=8),
                    submit("b1", owner="llm/b", gpus=4),
                    submit("bad", owner="nope", gpus=4),  # rejected: no such owner
                ]
            )
            last = await jlog.last_input_seq()
            await eventually(
                lambda: scheduler.last_basis >= last and projector.position[0] >= last,
                what="scheduler and projector caught up",
            )
            s = await scrape(s_url)
            p = await scrape(p_url)
    finally:
        await s_runner.cleanup()
        await p_runner.cleanup()
    # the scheduler
    assert value(s, "apportion_scheduler_cycle_seconds_count") == scheduler.cycles > 0
    assert value(s, "apportion_scheduler_batches_total") == scheduler.cycles
    assert value(s, "apportion_scheduler_batch_parts_total") >= scheduler.cycles
    assert value(s, "apportion_scheduler_decisions_total", kind="WorkloadPlaced") == 2
    assert value(s, "apportion_scheduler_decisions_total", kind="InputRejected") == 1
    assert value(s, "apportion_scheduler_decisions_total", kind="WorkloadPreempted") == 0
    assert value(s, "apportion_scheduler_leader") == 1
    assert value(s, "apportion_scheduler_inputs_folded") == last
    assert value(s, "apportion_scheduler_inputs_stored") == last
    assert value(s, "apportion_scheduler_input_lag") == 0
    assert value(s, "apportion_scheduler_leases_lost_total") == 0
    assert value(s, "apportion_scheduler_snapshots_rejected_total") == 0
    # the projector: every input and batch committed, no lag
    assert value(p, "apportion_projector_commits_total") >= 1
    assert value(p, "apportion_projector_items_committed_total", kind="input") == last
    batches = await jlog.last_batch_seq()
    assert value(p, "apportion_projector_items_committed_total", kind="batch") == batches
    assert value(p, "apportion_projector_input_seq") == last
    assert value(p, "apportion_projector_batch_seq") == batches
    assert value(p, "apportion_projector_input_lag") == 0
    assert value(p, "apportion_projector_rebuilds_total") == 0
    # stopping saved a snapshot; a stopped scheduler is no leader
    after = parse((await scheduler.metrics_text()).decode())
    assert value(after, "apportion_scheduler_snapshots_saved_total") == 1
    assert value(after, "apportion_scheduler_leader") == 0
    # each service object has a registry of its own
    fresh = parse((await Scheduler(jlog).metrics_text()).decode())
    assert value(fresh, "apportion_scheduler_cycle_seconds_count") == 0
    assert value(fresh, "apportion_scheduler_input_lag") == last  # folded nothing yet


async def test_lag_counts_what_is_stored_but_not_folded(
    jlog: JetStreamLog, oplog: JetStreamLog
) -> None:
    await oplog.publish_inputs(small_cluster(nodes=1))
    scheduler = Scheduler(jlog)
    async with running(scheduler):
        await eventually(lambda: scheduler.leading.is_set(), what="leading")
    folded = scheduler.last_basis
    await oplog.publish_inputs([submit("x1"), submit("x2")])  # nobody folds them
    s = parse((await scheduler.metrics_text()).decode())
    assert value(s, "apportion_scheduler_input_lag") == 2
    assert value(s, "apportion_scheduler_inputs_folded") == folded


async def test_a_rebuilt_projection_is_counted(
    jlog: JetStreamLog, tmp_path: Path, projlog: JetStreamLog
) -> None:
    db = tmp_path / "broken.duckdb"
    db.write_bytes(b"not a duckdb file" * 100)
    metrics = ProjectorMetrics()
    projection = await open_projection_for(db, jlog, metrics=metrics)
    projector = Projector(projlog, projection, metrics=metrics)
    p = parse((await projector.metrics_text()).decode())
    assert value(p, "apportion_projector_rebuilds_total") == 1
    projection.con.close()


async def test_gateway_metrics_include_the_other_services(
    jlog: JetStreamLog, oplog: JetStreamLog, gwlog: JetStreamLog
) -> None:
    """``apportion up``: one process, one endpoint (the gateway's)."""
    await oplog.publish_inputs(small_cluster(nodes=1))
    scheduler = Scheduler(jlog)
    gateway = Gateway(gwlog, auth=None, extra_metrics=scheduler.metrics_text)
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(scheduler.run(stop)),
        asyncio.create_task(gateway.serve(stop, port=0)),
    ]
    try:
        await gateway.ready.wait()
        last = await jlog.last_input_seq()
        await eventually(lambda: scheduler.last_basis >= last, what="a cycle")
        samples = await scrape(f"{gateway.url}/metrics")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert value(samples, "apportion_scheduler_cycle_seconds_count") >= 1
    assert value(samples, "apportion_scheduler_leader") == 1
    assert ("apportion_inputs_folded", ()) in samples  # the gateway's own


async def test_serve_exposes_the_scheduler_metrics(
    nats_server: NatsServer,
    jlog: JetStreamLog,
    cluster: str,
    oplog: JetStreamLog,
) -> None:
    """``apportion serve scheduler --metrics-port N``."""
    await oplog.publish_inputs(small_cluster(nodes=1))
    port = free_port()
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        serve(
            "scheduler",
            nats_server.url_as("scheduler"),
            cluster,
            metrics_port=port,
            stop=stop,
            ready=ready,
        )
    )
    url = f"http://127.0.0.1:{port}/metrics"

    async def cycled() -> bool:
        if not ready.is_set():
            return False
        samples = await scrape(url)
        return value(samples, "apportion_scheduler_cycle_seconds_count") >= 1

    try:
        await eventually(cycled, what="a cycle seen through the metrics port")
    finally:
        stop.set()
        await task


async def test_serve_exposes_the_executor_metrics(
    nats_server: NatsServer,
    jlog: JetStreamLog,
    cluster: str,
    oplog: JetStreamLog,
) -> None:
    """``apportion serve executor --metrics-port N`` (docs/services.md, Metrics): the
    emulator's own metrics, and nothing of the gateway's."""
    await oplog.publish_inputs(small_cluster(nodes=1))
    port = free_port()
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        serve(
            "executor",
            nats_server.url_as("executor"),
            cluster,
            metrics_port=port,
            stop=stop,
            ready=ready,
        )
    )
    try:
        await eventually(ready.is_set, what="the executor started")
        samples = await scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        stop.set()
        await task
    assert value(samples, "apportion_executor_runs_running") == 0
    assert ("apportion_executor_inputs_folded", ()) in samples
    assert not any(name.startswith("apportion_scheduler_") for name, _ in samples)
    assert ("apportion_inputs_folded", ()) not in samples  # the gateway's


async def test_metrics_port_is_refused_for_the_gateway(nats_server: NatsServer) -> None:
    with pytest.raises(ValueError, match="metrics-port"):
        await serve("gateway", nats_server.url_as("gateway"), "x", metrics_port=0, insecure=True)


def test_cli_refuses_metrics_port_for_the_gateway_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """One line before anything connects; the other services accept the option."""
    from click.testing import CliRunner

    from apportion.cli import main

    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")  # never reached
    r = CliRunner().invoke(main, ["serve", "gateway", "--metrics-port", "9100", "--no-auth"])
    assert r.exit_code != 0
    assert "--metrics-port is not for the gateway: it serves /metrics on --port" in r.stderr
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "scheduler, projector, executor: serve Prometheus metrics" in " ".join(help_text.split())


async def test_executor_metrics_count_runs_by_outcome(
    jlog: JetStreamLog, tmp_path: Path, oplog: JetStreamLog, exelog: JetStreamLog
) -> None:
    """The executor emulator: runs started, finished by outcome (its own report, a
    preemption, a cancel), runs and timers now, timer lag, follower lag."""
    from apportion.schemas.events import WorkloadCancelled
    from apportion.services.executor import Executor
    from apportion.services.stack import Stack, load_cluster_spec

    await oplog.publish_inputs(small_cluster(nodes=1))
    scheduler, executor = Scheduler(jlog), Executor(exelog)
    async with running(scheduler, executor):
        # free work on the only node, then allocated work that preempts it (requeued)
        # and ends on its own after 200 ms; the free work runs again and is cancelled
        await oplog.publish_input(submit("u1", owner="vision", gpus=8, min_runtime_ms=0))
        await eventually(lambda: "u1" in executor.runs, what="u1 running")
        await oplog.publish_input(submit("a1", owner="llm/a", gpus=8, duration_ms=200))
        await eventually(lambda: executor.finished == 1, what="a1 reported")
        await eventually(lambda: executor.runs.get("u1") == 2, what="u1 running again")
        await oplog.publish_input(
            WorkloadCancelled(id="cancel-u1", at_ms=0, workload="u1", actor="ops")
        )
        await eventually(lambda: not executor.runs, what="u1 cancelled")
        last = await jlog.last_input_seq()
        await eventually(
            lambda: executor.follower.state.input_seq >= last, what="executor caught up"
        )
        e = parse((await executor.metrics_text()).decode())
        # under `apportion up`, the gateway's /metrics carries them after its own
        stack = Stack("nats://unused", load_cluster_spec(None), data_dir=tmp_path, projector=False)
        idle = parse((await stack._service_metrics()).decode())
        stack.executor = executor
        combined = parse((await stack._service_metrics()).decode())
    assert value(e, "apportion_executor_runs_started_total") == 3  # u1, a1, u1 again
    for outcome, n in (("succeeded", 1), ("preempted", 1), ("cancelled", 1)):
        assert value(e, "apportion_executor_runs_finished_total", outcome=outcome) == n
    assert value(e, "apportion_executor_runs_finished_total", outcome="ended") == 0
    assert value(e, "apportion_executor_runs_finished_total", outcome="report_failed") == 0
    assert value(e, "apportion_executor_runs_running") == 0
    assert value(e, "apportion_executor_timers") == 0
    assert value(e, "apportion_executor_timer_lag_seconds_count") == 1  # a1's timer
    assert value(e, "apportion_executor_timer_lag_seconds_sum") >= 0
    assert value(e, "apportion_executor_inputs_folded") == last
    assert value(e, "apportion_executor_input_lag") == 0
    assert value(idle, "apportion_executor_runs_started_total") == 0  # not started yet
    assert value(combined, "apportion_executor_runs_started_total") == 3
    # each emulator has a registry of its own
    fresh = parse((await Executor(exelog).metrics_text()).decode())
    assert value(fresh, "apportion_executor_runs_started_total") == 0
