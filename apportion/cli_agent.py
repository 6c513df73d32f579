"""``apportion agent``: the host agent (docs/agent.md)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import click

from apportion.cli import UserError, main

_NAME = re.compile(r"^[A-Za-z0-9_.:@+\-]{1,128}$")

CLUSTER_NAME = click.option(
    "--cluster-name", default="demo", show_default=True, help="which cluster's streams"
)
NATS_URL = click.option(
    "--nats",
    "nats_url",
    default=None,
    help="NATS URL (default: $NATS_URL, else nats://127.0.0.1:4222)",
)
"""Options of the commands that follow one cluster's history on the bus (``agent``, ``slurm``)."""


@main.command()
@click.option(
    "--node",
    default=None,
    help="this host's node name (default: the host name, up to the first dot)",
)
@CLUSTER_NAME
@NATS_URL
@click.option(
    "--gpus",
    type=click.IntRange(1, 65536),
    default=None,
    help="declare N GPUs instead of discovering them with nvidia-smi (fake GPUs: tests, demos)",
)
@click.option("--gpu-type", default=None, help="GPU type (with --gpus; default: from nvidia-smi)")
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".apportion/agent"),
    show_default=True,
    help="attempts, logs and checkpoints: WORK_DIR/<cluster>/<node>/<workload>/attempt-<n>",
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="root of the per-workload checkpoint folders (default: WORK_DIR/<cluster>/checkpoints; "
    "use a shared file system when a requeued job may land on another host)",
)
@click.option(
    "--advertise-addr",
    default="127.0.0.1",
    show_default=True,
    help="the address other hosts of a gang reach this one at (MASTER_ADDR when it has rank 0)",
)
@click.option(
    "--heartbeat-interval",
    type=click.FloatRange(0.05, 3600),
    default=2.0,
    show_default=True,
    help="seconds between heartbeats",
)
@click.option(
    "--health-command",
    default=None,
    help="a shell command that exits 0 when the host is healthy (besides nvidia-smi)",
)
@click.option(
    "--health-interval", type=click.FloatRange(0.05, 3600), default=10.0, show_default=True
)
@click.option(
    "--drain-after",
    type=click.IntRange(1, 1000),
    default=3,
    show_default=True,
    help="failed probes in a row before the host is set draining",
)
@click.option(
    "--down-after",
    type=click.IntRange(1, 1000),
    default=10,
    show_default=True,
    help="failed probes in a row before the host is set down",
)
@click.option(
    "--container-runtime",
    type=click.Choice(["auto", "docker", "podman", "none"]),
    default="auto",
    show_default=True,
    help="runs workloads that name an image",
)
@click.option(
    "--stop-on-exit",
    is_flag=True,
    help="stop (and report) every run when the agent stops; by default they keep running "
    "and the next agent re-adopts them",
)
@click.option("--log-level", default="info", show_default=True)
def agent(
    node: str | None,
    cluster_name: str,
    nats_url: str | None,
    gpus: int | None,
    gpu_type: str | None,
    work_dir: Path,
    checkpoint_dir: Path | None,
    advertise_addr: str,
    heartbeat_interval: float,
    health_command: str | None,
    health_interval: float,
    drain_after: int,
    down_after: int,
    container_runtime: str,
    stop_on_exit: bool,
    log_level: str,
) -> None:
    """Run this host's agent: register it, run the workloads placed on it, report
    their start and end, obey preemptions, heartbeat and probe its health."""
    from apportion.services import logs
    from apportion.services.agent import container_runtime as find_runtime
    from apportion.services.agent import discover_gpus

    node = node or socket.gethostname().split(".", 1)[0]
    if not _NAME.match(node):
        raise UserError(f"--node {node!r}: use letters, digits and '_.:@+-' (at most 128)")
    if gpu_type is not None and (not _NAME.match(gpu_type) or gpu_type == "any"):
        raise UserError(f"--gpu-type {gpu_type!r}: name a GPU type (letters, digits, '_.:@+-')")
    if down_after < drain_after:
        raise UserError("--down-after must be at least --drain-after")
    real = gpus is None
    if gpus is None:
        found = discover_gpus()
        if found is None:
            raise UserError(
                "no GPUs found (nvidia-smi is absent or failed); declare them with "
                "--gpus N --gpu-type TYPE"
            )
        gpus, gpu_type = found[0], gpu_type or found[1]
    elif gpu_type is None:
        raise UserError("--gpus needs --gpu-type TYPE")
    assert gpu_type is not None
    url = nats_url or os.environ.get("NATS_URL") or "nats://127.0.0.1:4222"
    logs.configure(log_level)
    try:
        asyncio.run(
            _agent(
                url,
                cluster_name,
                node=node,
                gpus=gpus,
                gpu_type=gpu_type,
                work_dir=work_dir,
                checkpoint_root=checkpoint_dir,
                advertise_addr=advertise_addr,
                heartbeat_s=heartbeat_interval,
                health_command=health_command,
                health_interval_s=health_interval,
                drain_after=drain_after,
                down_after=down_after,
                probe_nvidia=real,
                real_gpus=real,
                runtime=find_runtime(container_runtime),
                stop_on_exit=stop_on_exit,
            )
        )
    except (OSError, ValueError) as exc:
        raise UserError(f"agent: {exc}") from None


async def _agent(url: str, cluster: str, **options: Any) -> None:
    from apportion.services.agent import Agent
    from apportion.services.bus import JetStreamLog, connect

    nc = await connect(url, name=f"apportion-agent-{options['node']}")
    agent = Agent(JetStreamLog(nc.jetstream(), cluster), **options)
    await run_until_signalled(nc, agent)


async def run_until_signalled(nc: Any, service: Any) -> None:
    """``service.run(stop)`` until SIGINT or SIGTERM sets ``stop`` (a stop that hangs
    ends the process after three stop graces), then close ``nc``. For the
    one-service commands (``agent``, ``slurm``)."""
    from apportion.services.runner import STOP_GRACE_S, exit_watchdog

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    watchdog: list[threading.Timer] = []

    def on_signal() -> None:
        stop.set()
        if not watchdog:
            watchdog.append(exit_watchdog(3 * STOP_GRACE_S, service.logger))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await service.run(stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 5)
        for timer in watchdog:
            timer.cancel()
            timer.join()
