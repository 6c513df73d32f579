"""The ``apportion`` command line (also ``python -m apportion``).

Errors a user can fix exit non-zero with one line on stderr (``apportion: ...``),
never a traceback; so does a NATS server that is away or refuses (exit status 2).
Sub-command groups live beside this file:
``cli_sim`` (simulate, trace, replay, audit, whatif), ``cli_live`` (up,
submit, cancel, queue, share, explain, budget), ``cli_auth`` (auth issue,
list, revoke), ``cli_history`` (history gaps, accept-loss) and ``cli_report``
(report); they register themselves here.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import click

from apportion import __version__


class UserError(click.ClickException):
    """A one-line error for the user; exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"apportion: {self.format_message()}", err=True)


def echo_json(data: Any, indent: int | None = 2, sort_keys: bool = True) -> None:
    """Every ``--json`` output: ``data`` with an ISO-8601 UTC ``*_at`` beside each
    point-in-time ``*_ms`` (:func:`apportion.schemas.times.with_iso`)."""
    import json

    from apportion.schemas.times import with_iso

    click.echo(json.dumps(with_iso(data), indent=indent, sort_keys=sort_keys))


class _Main(click.Group):
    """The top group: an error from NATS that no command turned into a
    :class:`UserError` (a server that went away, JetStream not enabled, ...)
    still ends as one line and exit status 2."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            nats_errors = sys.modules.get("nats.errors")  # loaded if NATS was used at all
            if nats_errors is not None and isinstance(exc, nats_errors.Error):
                first = (str(exc).splitlines() or [""])[0]
                raise UserError(f"NATS: {type(exc).__name__}: {first}".rstrip(": ")) from None
            raise


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="apportion")
def main() -> None:
    """apportion: GPU-time budgets instead of priorities."""


@main.command()
def demo() -> None:
    """Fold a small budget tree and some submissions; print queue order and usage."""
    from apportion.demo import run_demo

    run_demo()


@main.group()
def schema() -> None:
    """Event schemas for publishers in other languages."""


@schema.command("export")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def schema_export(directory: Path) -> None:
    """Write one JSON Schema file per event kind into DIRECTORY."""
    import json

    from apportion.schemas.jsonschema import json_schemas

    try:
        directory.mkdir(parents=True, exist_ok=True)
        schemas = json_schemas()
        for name, doc in schemas.items():
            (directory / f"{name}.schema.json").write_text(
                json.dumps(doc, indent=2, sort_keys=True) + "\n"
            )
    except OSError as exc:
        raise UserError(f"cannot write schemas to {directory}: {exc.strerror}") from None
    click.echo(f"wrote {len(schemas)} schemas to {directory}")


def _register(module: str) -> None:
    """Sub-command modules add their commands to :data:`main` when imported."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise


LOG_LEVEL = click.Choice(["debug", "info", "warning", "error", "critical"], case_sensitive=False)
"""The values of ``--log-level`` (Python's logging levels): click refuses any other
with its usage error (exit 2, one line) before a service starts."""

_CHOICES = {"log_level": LOG_LEVEL}
"""Options that are really a choice, by parameter name, wherever a command declares them."""


def _validate_choices(group: click.Group) -> None:
    """Give every option named in :data:`_CHOICES` that a command declared as free
    text its :class:`click.Choice`, so one list holds for every command (``up``,
    ``serve``, ...) and a bad value is a usage error, not a traceback."""
    for cmd in group.commands.values():
        if isinstance(cmd, click.Group):
            _validate_choices(cmd)
        for param in cmd.params:
            choice = _CHOICES.get(param.name or "")
            if (
                choice is not None
                and isinstance(param, click.Option)
                and param.type is click.STRING
            ):
                param.type = choice


for _module in (
    "apportion.cli_sim",
    "apportion.cli_live",
    "apportion.cli_auth",
    "apportion.cli_agent",
    "apportion.cli_slurm",
    "apportion.cli_history",
    "apportion.cli_report",
    "apportion.cli_federation",
):
    _register(_module)
_register("apportion.cli_sql")
_validate_choices(main)


def run() -> None:  # pragma: no cover - console entry alias
    sys.exit(main())
