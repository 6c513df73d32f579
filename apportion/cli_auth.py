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
