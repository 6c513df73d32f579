"""``apportion history gaps|accept-loss``: inputs the INPUTS stream lost, found and accepted.

A store that loses acknowledged inputs (a damaged block file of a single
nats-server) leaves a gap in INPUTS' sequences. Every reader stops before it
and reports it (docs/services.md, "Lost inputs"); ``history gaps`` lists the
gaps, and ``history accept-loss`` records an operator's acceptance as an
``InputsLost`` input, after which the history (and scheduling) goes on without
the lost inputs. Registered on :data:`apportion.cli.main`.
"""

from __future__ import annotations

import asyncio
import getpass
import time
from typing import Any

import click

from apportion.cli import UserError, echo_json, main


@main.group()
def history() -> None:
    """A live cluster's history: inputs lost by the store (docs/services.md, "Lost inputs")."""


def _nats_options(f: Any) -> Any:
    f = click.option(
        "--nats",
        "nats_url",
        default=None,
        envvar="NATS_URL",
        help="NATS server(s) [env NATS_URL]",
    )(f)
    return click.option("--cluster", "cluster_name", required=True, help="the cluster's name")(f)


async def _with_log(nats_url: str, cluster: str, work: Any) -> Any:
    from apportion.services.bus import JetStreamLog, connect

    nc = await connect(nats_url, name="apportion-history", reconnect=False)
    try:
        js = nc.jetstream()
        try:
            await js.stream_info(f"INPUTS_{cluster}")
        except Exception as exc:
            raise UserError(
                f"cluster {cluster!r}: no INPUTS stream at {nats_url} ({type(exc).__name__})"
            ) from None
        return await work(JetStreamLog(js, cluster))
    finally:
        await nc.close()


def _run(nats_url: str | None, cluster: str, work: Any) -> Any:
    from apportion.services.bus import NatsUnreachable, Subjects

    if not nats_url:
        raise UserError("give --nats URL (or NATS_URL)")
    try:
        Subjects(cluster)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        return asyncio.run(_with_log(nats_url, cluster, work))
    except NatsUnreachable as exc:
        raise UserError(str(exc)) from None


def _describe(gap: Any) -> str:
    head = f"inputs {gap.first:,}..{gap.through:,} missing ({gap.count:,} inputs)"
    if gap.acceptance is None:
        return f"{head}: no loss accepted (apportion history accept-loss --through {gap.through})"
    return f"{head}: loss accepted by {gap.accepted_by or '(no actor)'} ({gap.acceptance})"


async def _drop_snapshot(log: Any) -> bool:
    from apportion.services.scheduler import SNAPSHOT_NAME

    try:
        store = await log.snapshots()
        return bool(await store.delete(SNAPSHOT_NAME))
    except Exception as exc:  # no bucket, no permission: say so, go on
        click.echo(f"note: the scheduler's snapshot was not deleted ({type(exc).__name__})")
        return False


@history.command("gaps")
@_nats_options
@click.option("--json", "as_json", is_flag=True)
def gaps_cmd(nats_url: str | None, cluster_name: str, as_json: bool) -> None:
    """List the sequences missing from INPUTS and whether each loss was accepted.
    Exit 1 when a gap has no accepted loss (the history is not whole)."""
    import sys

    import msgspec

    found = _run(nats_url, cluster_name, lambda log: log.input_gaps())
    if as_json:
        echo_json(
            [{**msgspec.to_builtins(g), "count": g.count} for g in found],
            indent=None,
            sort_keys=False,
        )
    elif not found:
        click.echo(f"cluster {cluster_name}: INPUTS is whole (no sequence missing)")
    for gap in [] if as_json else found:
        click.echo(_describe(gap))
    if any(g.acceptance is None for g in found):
        sys.exit(1)


@history.command("accept-loss")
@_nats_options
@click.option(
    "--through",
    type=click.IntRange(min=1),
    required=True,
    help="the last missing sequence of the first gap not accepted (as `history gaps` shows "
    "it): a confirmation of what is given up",
)
@click.option(
    "--actor",
    default=None,
    help="who accepts the loss, recorded in the history; must be an operator (the budget "
    "root's owner or one the policy names) [default: your user name]",
)
@click.option("--note", default="", help="why, in a few words (kept in the history)")
def accept_loss_cmd(
    nats_url: str | None, cluster_name: str, through: int, actor: str | None, note: str
) -> None:
    """Record that the first gap of INPUTS is lost for good: an `InputsLost` input
    that every reader places at the gap, so that the history, and scheduling,
    goes on without the lost inputs. Decisions based on lost inputs are left out
    of the history. The record is an audited input (replay and audit reproduce it)."""
    from apportion.schemas.codec import bounds_error
    from apportion.schemas.events import InputsLost

    who = actor if actor is not None else getpass.getuser()

    async def work(log: Any) -> str:
        open_gaps = [g for g in await log.input_gaps() if g.acceptance is None]
        if not open_gaps:
            raise UserError(f"cluster {cluster_name}: no missing inputs to accept")
        gap = open_gaps[0]
        if through != gap.through:
            raise UserError(
                f"--through {through}: the first gap not accepted is inputs "
                f"{gap.first}..{gap.through} ({gap.count:,} inputs); give --through {gap.through}"
            )
        event = InputsLost(
            id=f"inputs-lost-{gap.first}-{gap.through}",
            at_ms=time.time_ns() // 1_000_000,
            first=gap.first,
            through=gap.through,
            actor=who,
            note=note,
        )
        problem = bounds_error(event)
        if problem is not None:
            raise UserError(f"cannot record the loss: {problem}")
        # a scheduler snapshot taken before the loss holds the lost inputs: schedulers
        # must fold the log again (one that still holds them in memory does so when it
        # folds this record)
        dropped = await _drop_snapshot(log)
        ack = await log.publish_input(event)
        more = f"; {len(open_gaps) - 1} more gap(s) after it" if len(open_gaps) > 1 else ""
        return (
            f"recorded: inputs {gap.first:,}..{gap.through:,} lost ({gap.count:,} inputs), "
            f"accepted by {who} as input {ack.seq:,} ({event.id}); the history goes on "
            f"after them{more}" + ("; the scheduler's snapshot was deleted" if dropped else "")
        )

    click.echo(_run(nats_url, cluster_name, work))
