"""``apportion slurm``: the executor of a Slurm cluster (docs/slurm.md)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import click

from apportion.cli import UserError, main
from apportion.cli_agent import CLUSTER_NAME, NATS_URL

if TYPE_CHECKING:
    from apportion.services.slurm_jobs import AccountMap


@main.command()
@CLUSTER_NAME
@NATS_URL
@click.option(
    "--partition",
    "partitions",
    multiple=True,
    default=("gpu",),
    show_default=True,
    help="a Slurm partition apportion governs (repeat for several)",
)
@click.option(
    "--accounts",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="TOML file with an [accounts] table: Slurm account -> budget leaf "
    "(default rule: the account with each '.' read as '/')",
)
@click.option(
    "--interval",
    type=click.FloatRange(0.05, 60),
    default=0.5,
    show_default=True,
    help="seconds between two reads of squeue",
)
@click.option(
    "--no-register",
    is_flag=True,
    help="do not register Slurm's nodes nor report their health (the cluster file does)",
)
@click.option("--log-level", default="info", show_default=True)
def slurm(
    cluster_name: str,
    nats_url: str | None,
    partitions: tuple[str, ...],
    accounts: Path | None,
    interval: float,
    no_register: bool,
    log_level: str,
) -> None:
    """Put apportion in front of Slurm: held jobs of the governed partitions become
    workloads; placements are pinned and released; ends are reported."""
    from apportion.services import logs
    from apportion.services.slurm_jobs import AccountMap

    for tool in ("squeue", "scontrol", "scancel"):
        if shutil.which(tool) is None:
            raise UserError(f"slurm: {tool} not found: install Slurm's client commands")
    try:
        table = AccountMap.load(accounts)
    except (OSError, ValueError) as exc:
        raise UserError(f"slurm: {exc}") from None
    url = nats_url or os.environ.get("NATS_URL") or "nats://127.0.0.1:4222"
    logs.configure(log_level)
    asyncio.run(_slurm(url, cluster_name, partitions, table, interval, not no_register))


async def _slurm(
    url: str,
    cluster: str,
    partitions: tuple[str, ...],
    accounts: AccountMap,
    interval: float,
    register: bool,
) -> None:
    from apportion.cli_agent import run_until_signalled
    from apportion.services.bus import JetStreamLog, connect
    from apportion.services.slurm import SlurmBridge

    nc = await connect(url, name="apportion-slurm")
    bridge = SlurmBridge(
        JetStreamLog(nc.jetstream(), cluster),
        partitions=partitions,
        accounts=accounts,
        interval_s=interval,
        register=register,
    )
    await run_until_signalled(nc, bridge)
