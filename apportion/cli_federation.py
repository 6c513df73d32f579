"""``apportion federation``: clusters joined through NATS (docs/federation.md).

``join``, ``leave`` and ``status`` act on one cluster's JetStream and connect as
its scheduler (the one user with its JetStream API); ``tree-setup`` and
``tree-set``/``tree-remove`` act on the hub and connect as its tree admin.
Every call is bounded (``$APPORTION_TIMEOUT``, 10 s by default) and ends with
one line on error. Registered on :data:`apportion.cli.main`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import click

from apportion.cli import UserError, echo_json, main


@main.group()
def federation() -> None:
    """Several clusters, one budget tree: join, leave, status, the tree (docs/federation.md)."""


def _cluster_options(f: Any) -> Any:
    f = click.option(
        "--nats",
        "nats_url",
        default=None,
        envvar="NATS_URL",
        help="the cluster's NATS server(s), as its scheduler [env NATS_URL]",
    )(f)
    return click.option("--cluster", "cluster_name", required=True, help="this cluster's name")(f)


def _hub_option(f: Any) -> Any:
    return click.option(
        "--hub",
        "hub_url",
        default=None,
        envvar="APPORTION_HUB_URL",
        help="the hub's NATS URL, as tree-admin [env APPORTION_HUB_URL]",
    )(f)


def _check_name(name: str, what: str) -> None:
    from apportion.services.bus import Subjects

    try:
        Subjects(name)
    except ValueError as exc:
        raise UserError(f"{what}: {exc}") from None


def _run(url: str | None, what: str, work: Any) -> Any:
    """``work(nc)`` on a connection to ``url``; every failure one line."""
    from apportion.services.bus import NatsUnreachable, client_timeout_s, connect

    if not url:
        raise UserError(f"give the {what}'s NATS URL (see --help)")
    limit = client_timeout_s()

    async def go() -> Any:
        nc = await connect(url, name="apportion-federation", reconnect=False, timeout_s=limit)
        try:
            async with asyncio.timeout(limit * 3):
                return await work(nc, limit)
        finally:
            await nc.close()

    from nats.js.errors import APIError, NotFoundError

    try:
        return asyncio.run(go())
    except NatsUnreachable as exc:
        raise UserError(str(exc)) from None
    except NotFoundError as exc:
        raise UserError(f"{what}: {exc.description or 'not found'} (is it set up?)") from None
    except APIError as exc:
        raise UserError(f"{what}: JetStream refused: {exc.description or exc}") from None
    except TimeoutError:
        raise UserError(
            f"{what}: no answer from JetStream within {limit:g} s (connected as the "
            "user it takes? a cluster: its scheduler; the hub: tree-admin)"
        ) from None


@federation.command("join")
@_cluster_options
@click.option("--peer", "peers", multiple=True, help="a cluster whose usage to take (repeat)")
@click.option("--no-tree", is_flag=True, help="do not take budget edits from the hub's TREE")
@click.option("--hub-domain", default="hub", show_default=True, help="the hub's JetStream domain")
@click.option("--replicas", type=click.IntRange(1, 5), default=1, show_default=True)
def join_cmd(
    nats_url: str | None,
    cluster_name: str,
    peers: tuple[str, ...],
    no_tree: bool,
    hub_domain: str,
    replicas: int,
) -> None:
    """Join this cluster to its peers: create its USAGE_<cluster> (what the peers
    take) and make its INPUTS source each peer's usage and the hub's budget tree.
    The running cluster is not restarted; run it on each cluster."""
    from apportion.services import federation as fed

    _check_name(cluster_name, "--cluster")
    for p in peers:
        _check_name(p, "--peer")

    async def work(nc: Any, limit: float) -> list[str]:
        js = nc.jetstream(timeout=limit)
        return await fed.join(
            js,
            cluster_name,
            peers,
            tree=not no_tree,
            hub_domain=hub_domain,
            replicas=replicas,
            timeout_s=limit,
        )

    if hub_domain in (cluster_name, *peers):
        raise UserError(f"{hub_domain!r} is the hub's JetStream domain, not a cluster's")
    names = _run(nats_url, f"cluster {cluster_name!r}", work)
    click.echo(
        f"cluster {cluster_name}: INPUTS_{cluster_name} sources {', '.join(names) or 'nothing'}"
    )


@federation.command("leave")
@_cluster_options
@click.option("--peer", "peers", multiple=True, help="stop taking this peer's usage (repeat)")
@click.option("--all-peers", is_flag=True, help="stop taking every peer's usage")
@click.option("--tree", is_flag=True, help="stop taking budget edits from the hub too")
def leave_cmd(
    nats_url: str | None, cluster_name: str, peers: tuple[str, ...], all_peers: bool, tree: bool
) -> None:
    """Stop sourcing peers' usage (and the tree): what was taken stays in the history."""
    from apportion.services import federation as fed

    _check_name(cluster_name, "--cluster")
    if not peers and not all_peers and not tree:
        raise UserError("give --peer NAME, --all-peers or --tree")

    async def work(nc: Any, limit: float) -> list[str]:
        js = nc.jetstream(timeout=limit)
        return await fed.leave(
            js, cluster_name, None if all_peers else peers, tree=tree, timeout_s=limit
        )

    names = _run(nats_url, f"cluster {cluster_name!r}", work)
    click.echo(
        f"cluster {cluster_name}: INPUTS_{cluster_name} sources {', '.join(names) or 'nothing'}"
    )


@federation.command("status")
@_cluster_options
@click.option("--json", "as_json", is_flag=True)
def status_cmd(nats_url: str | None, cluster_name: str, as_json: bool) -> None:
    """Each source of this cluster's INPUTS: how far behind it is, when it last
    heard from its stream, the server's error if any. Exit 1 when one has an error."""
    import dataclasses
    import sys

    from apportion.services import federation as fed

    _check_name(cluster_name, "--cluster")

    async def work(nc: Any, limit: float) -> list[fed.SourceState]:
        return await fed.status(nc.jetstream(timeout=limit), cluster_name, timeout_s=limit)

    states = _run(nats_url, f"cluster {cluster_name!r}", work)
    if as_json:
        echo_json([dataclasses.asdict(s) for s in states], indent=None, sort_keys=False)
    elif not states:
        click.echo(f"cluster {cluster_name}: not joined (no federation source)")
    for s in [] if as_json else states:
        heard = "never" if s.active_ms is None else f"{s.active_ms / 1000:.1f} s ago"
        line = f"{s.name:<16} lag {s.lag:>6}  heard {heard}"
        click.echo(line + (f"  error: {s.error}" if s.error else ""))
    if any(s.error for s in states):
        sys.exit(1)


@federation.command("tree-setup")
@_hub_option
@click.option("--replicas", type=click.IntRange(1, 5), default=1, show_default=True)
def tree_setup_cmd(hub_url: str | None, replicas: int) -> None:
    """Create the hub's TREE stream (once; again changes nothing)."""
    from apportion.services import federation as fed

    async def work(nc: Any, limit: float) -> None:
        await fed.ensure_tree_stream(nc.jetstream(timeout=limit), replicas, timeout_s=limit)

    _run(hub_url, "the hub", work)
    click.echo(f"the hub's {fed.TREE_STREAM} stream is there")


def _edit(kind: Any, event_id: str | None, **fields: Any) -> Any:
    """A tree edit of type ``kind``, sent now, within the bounds every reader checks."""
    from apportion.schemas.codec import EventDecodeError, decode_input, encode

    try:
        event = kind(
            id=event_id or f"budget-{uuid.uuid4().hex}",
            at_ms=time.time_ns() // 1_000_000,
            **fields,
        )
        decode_input(encode(event))
    except (EventDecodeError, TypeError) as exc:
        raise UserError(f"invalid budget edit: {exc}") from None
    return event


def _publish_tree(hub_url: str | None, event: Any) -> None:
    from apportion.services import federation as fed

    async def work(nc: Any, limit: float) -> Any:
        return await fed.publish_tree_input(nc.jetstream(timeout=limit), event)

    ack = _run(hub_url, "the hub", work)
    note = " (already stored)" if ack.duplicate else ""
    click.echo(f"published {event.id} on the tree: TREE sequence {ack.seq}{note}")


@federation.command("tree-set")
@_hub_option
@click.argument("path")
@click.option("--weight", type=click.IntRange(min=0), required=True)
@click.option("--owner", required=True)
@click.option("--actor", required=True, help="who makes the edit (must own the parent node)")
@click.option("--id", "event_id", default=None, help="the edit's id (a retry: the same id)")
def tree_set_cmd(
    hub_url: str | None, path: str, weight: int, owner: str, actor: str, event_id: str | None
) -> None:
    """Set budget node PATH once for every cluster (a BudgetSet on the tree)."""
    from apportion.schemas.events import BudgetSet

    _publish_tree(
        hub_url, _edit(BudgetSet, event_id, path=path, weight=weight, owner=owner, actor=actor)
    )


@federation.command("tree-remove")
@_hub_option
@click.argument("path")
@click.option("--actor", required=True, help="who makes the edit (must own the parent node)")
@click.option("--id", "event_id", default=None, help="the edit's id (a retry: the same id)")
def tree_remove_cmd(hub_url: str | None, path: str, actor: str, event_id: str | None) -> None:
    """Remove budget node PATH once for every cluster (a BudgetRemoved on the tree)."""
    from apportion.schemas.events import BudgetRemoved

    _publish_tree(hub_url, _edit(BudgetRemoved, event_id, path=path, actor=actor))
