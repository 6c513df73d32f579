"""``apportion auth``: issue, list and revoke the gateway's bearer tokens.

The credentials file is ``--file``, else ``$APPORTION_CREDENTIALS``, else
``.apportion/credentials/tokens.toml`` (the one ``apportion up`` keeps with its
default data dir). See docs/security.md.
"""

from __future__ import annotations

from pathlib import Path

import click

from apportion.cli import UserError, main
from apportion.services.auth import CREDENTIALS_ENV


def _default_file() -> Path:
    from apportion.services.auth import DEFAULT_DATA_DIR, credentials_file

    return credentials_file(DEFAULT_DATA_DIR)


_file_option = click.option(
    "--file",
    "file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=CREDENTIALS_ENV,
    default=None,
    help="the gateway's credentials file (default: $APPORTION_CREDENTIALS, "
    "else .apportion/credentials/tokens.toml)",
)


@main.group()
def auth() -> None:
    """Bearer tokens for the gateway: issue, list, revoke."""


@auth.command("issue")
@click.argument("principal")
@_file_option
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="write the token to this file (mode 0600) instead of printing it",
)
def auth_issue(principal: str, file: Path | None, out: Path | None) -> None:
    """Make a token for PRINCIPAL (a budget owner's name) and add its hash to the file.

    The token is shown once (or written to --out); only its SHA-256 is kept."""
    from apportion.services.auth import hash_token, issue_token, write_token_file

    path = file or _default_file()
    try:
        token = issue_token(path, principal)
        if out is not None:
            write_token_file(out, token)
    except OSError as exc:
        raise UserError(f"cannot write {exc.filename or path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    digest = hash_token(token)
    if out is None:
        click.echo(token)
        click.echo(
            f"apportion: token for {principal!r} added to {path} as {digest[:19]}...; "
            "it is not shown again",
            err=True,
        )
    else:
        click.echo(
            f"token for {principal!r} written to {out} (added to {path} as {digest[:19]}...)"
        )


@auth.command("list")
@_file_option
def auth_list(file: Path | None) -> None:
    """The principals of the credentials file and the start of each token's hash."""
    from apportion.services.auth import load_credentials

    path = file or _default_file()
    try:
        known = load_credentials(path)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    for digest, principal in sorted(known.items(), key=lambda kv: (kv[1], kv[0])):
        click.echo(f"{principal:<24} {digest[:19]}...")


@auth.command("revoke")
@click.argument("principal")
@_file_option
@click.option(
    "--hash",
    "hash_prefix",
    default="",
    help="only the token whose hash starts with this (as `auth list` shows it)",
)
def auth_revoke(principal: str, file: Path | None, hash_prefix: str) -> None:
    """Delete PRINCIPAL's tokens (or one of them, --hash) from the credentials file.

    A running gateway stops accepting them at its next request."""
    from apportion.services.auth import revoke_tokens

    path = file or _default_file()
    try:
        gone = revoke_tokens(path, principal, hash_prefix.removesuffix("..."))
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if not gone:
        raise UserError(f"no token of {principal!r} in {path} matches")
    click.echo(f"revoked {gone} token{'s' if gone != 1 else ''} of {principal!r} in {path}")


@main.command("nats-config")
@click.option(
    "--cluster",
    "cluster_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="cluster file (TOML); default: the bundled demo cluster",
)
@click.option(
    "--passwords",
    "passwords_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help='a nats-users.toml ([users] name = "password"); users it lacks get a new random password',
)
@click.option(
    "--no-executor",
    is_flag=True,
    help="leave out the executor emulator's user (it may report runs on every host)",
)
@click.option(
    "--slurm",
    is_flag=True,
    help="add the Slurm bridge's user, slurm (apportion slurm; docs/slurm.md)",
)
@click.option(
    "--example", is_flag=True, help="infra/accounts.conf: the demo cluster, '<user>-secret'"
)
@click.option(
    "--hub-url",
    default=None,
    help="federation: the whole configuration of this cluster's server, a leaf of the hub "
    "at this URL (nats://leaf-<cluster>:PASSWORD@HOST:7422), its JetStream domain "
    "the cluster's name (docs/federation.md)",
)
@click.option(
    "--hub",
    "hub_for",
    default=None,
    metavar="CLUSTER,CLUSTER,...",
    help="federation: the hub's whole configuration for these clusters",
)
@click.option("--listen", default="127.0.0.1:4222", show_default=True, help="with --hub(-url)")
@click.option(
    "--leaf-listen", default="127.0.0.1:7422", show_default=True, help="with --hub: leaf links"
)
@click.option(
    "--store-dir", default="./.apportion/nats", show_default=True, help="with --hub(-url)"
)
@click.option(
    "--server-name", default="", help="with --hub-url: this server's name (default apportion-<c>)"
)
@click.option(
    "--route-listen",
    default="",
    metavar="HOST:PORT",
    help="with --hub-url, a cluster of servers: where this one listens for routes",
)
@click.option(
    "--route",
    "routes",
    multiple=True,
    metavar="URL",
    help="with --route-listen: every server's route URL, nats://HOST:PORT (repeat)",
)
def nats_config(
    cluster_file: Path | None,
    passwords_file: Path | None,
    no_executor: bool,
    slurm: bool,
    example: bool,
    hub_url: str | None,
    hub_for: str | None,
    listen: str,
    leaf_listen: str,
    store_dir: str,
    server_name: str,
    route_listen: str,
    routes: tuple[str, ...],
) -> None:
    """Print the NATS accounts and users of a cluster (docs/security.md, "The bus"):
    the streams in an account of their own with the scheduler, every other role
    and every host's agent in an account of its own. Include it from your
    nats-server configuration; keep it readable by the server's user only.

    With --hub-url, the whole configuration of a federated cluster's server (its
    JetStream domain, its leaf link to the hub); with --hub, the hub's."""
    import secrets

    from apportion.replay.errors import InputFileError
    from apportion.schemas.events import NodeRegistered
    from apportion.services.natsconf import accounts_conf, example_conf, users_of
    from apportion.services.stack import load_cluster_spec

    if example:
        click.echo(example_conf(), nl=False)
        return
    known = _known_passwords(passwords_file)
    if hub_for is not None:
        from apportion.services.bus import Subjects
        from apportion.services.federation import HUB_DOMAIN
        from apportion.services.natsconf import hub_conf, hub_users

        names = [c.strip() for c in hub_for.split(",") if c.strip()]
        try:
            for c in names:
                Subjects(c)
        except ValueError as exc:
            raise UserError(f"--hub: {exc}") from None
        if HUB_DOMAIN in names:
            raise UserError(f"--hub: {HUB_DOMAIN!r} is the hub's JetStream domain, not a cluster's")
        if not names:
            raise UserError("--hub: name the clusters (a,b,...)")
        hub_passwords = {u: known.get(u) or secrets.token_urlsafe(24) for u in hub_users(names)}
        click.echo(
            hub_conf(
                names, hub_passwords, store_dir=store_dir, listen=listen, leaf_listen=leaf_listen
            ),
            nl=False,
        )
        return
    try:
        spec = load_cluster_spec(cluster_file)
    except InputFileError as exc:
        raise UserError(str(exc)) from None
    hosts = [e.node for e in spec.events if isinstance(e, NodeRegistered)]
    passwords = {u: known.get(u) or secrets.token_urlsafe(24) for u in users_of(hosts, slurm=slurm)}
    server = ""
    if hub_url is not None:
        from apportion.services.natsconf import federated_server

        server = federated_server(
            spec.name,
            hub_url,
            store_dir=store_dir,
            listen=listen,
            server_name=server_name,
            route_listen=route_listen,
            routes=routes,
        )
    click.echo(
        accounts_conf(
            spec.name, hosts, passwords, server=server, executor=not no_executor, slurm=slurm
        ),
        nl=False,
    )


def _known_passwords(passwords_file: Path | None) -> dict[str, str]:
    """``[users]`` of a nats-users.toml (``{}`` without one)."""
    import tomllib

    if passwords_file is None:
        return {}
    try:
        users = tomllib.loads(passwords_file.read_text()).get("users", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"{passwords_file}: {exc}") from None
    return {str(k): str(v) for k, v in users.items()}
