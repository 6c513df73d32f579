"""The ``apportion`` command line (also ``python -m apportion``).

Errors a user can fix exit non-zero with one line on stderr (``apportion: ...``),
never a traceback. Sub-command groups live beside this file:
``cli_sim`` (simulate, trace, replay, audit, whatif) and ``cli_live`` (up,
submit, cancel, queue, share, explain, budget); they register themselves here.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from apportion import __version__


class UserError(click.ClickException):
    """A one-line error for the user; exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:  # noqa: ANN001
        click.echo(f"apportion: {self.format_message()}", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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


for _module in ("apportion.cli_sim", "apportion.cli_live"):
    _register(_module)


def run() -> None:  # pragma: no cover - console entry alias
    sys.exit(main())
