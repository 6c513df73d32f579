"""``apportion sql QUERY --db FILE``: SQL over a projection, read-only.

The database is opened with DuckDB's ``read_only``, so the projection cannot be
changed (an INSERT, UPDATE, DROP, ... fails with DuckDB's reason as one line).
A file the live projector holds is locked by it: DuckDB lets no other process
open it. The projector keeps a read-only copy beside it,
``FILE.snapshot.duckdb`` (docs/analyst.md), which the error names.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import click

from apportion.cli import UserError, main


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def is_lock_error(exc: BaseException) -> bool:
    """DuckDB refusing a file another process holds open for writing."""
    text = str(exc).lower()
    return "could not set lock" in text or "conflicting lock" in text


def open_read_only(db: Path) -> Any:
    """A read-only DuckDB connection to ``db``, or a one-line :class:`UserError`."""
    import duckdb

    from apportion.replay.projection import snapshot_path

    if not db.exists():
        raise UserError(f"{db}: no such file")
    try:
        return duckdb.connect(str(db), read_only=True)
    except duckdb.Error as exc:
        if is_lock_error(exc):
            snap = snapshot_path(db)
            hint = (
                f"query its read-only copy instead: --db {snap}"
                if snap.exists()
                else f"its read-only copy {snap} is not written yet (the projector writes it "
                "at its next commit)"
            )
            raise UserError(
                f"{db}: locked by another process (the running projector?); {hint}"
            ) from None
        raise UserError(f"{db}: cannot open the database: {_first_line(exc)}") from None


def _cell(value: Any) -> str:
    return "NULL" if value is None else str(value)


def format_table(columns: list[str], rows: list[tuple]) -> str:
    """Aligned columns with a header line; numbers right-aligned."""
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [
        bool(rows) and all(isinstance(r[i], int | float) or r[i] is None for r in rows)
        for i in range(len(columns))
    ]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(widths[i]) if numeric[i] else v.ljust(widths[i]) for i, v in enumerate(values)
        ).rstrip()

    out = [line(columns), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


@main.command("sql")
@click.argument("query")
@click.option(
    "--db",
    "db",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="the projection (simulate --out, replay --out, or the live projector's "
    "FILE.snapshot.duckdb)",
)
@click.option("--csv", "as_csv", is_flag=True, help="CSV with a header line")
@click.option("--json", "as_json", is_flag=True, help="one JSON array of row objects")
def sql_cmd(query: str, db: Path, as_csv: bool, as_json: bool) -> None:
    """Run QUERY on a projection, read-only, and print the result.

    Tables and views are in docs/formats.md and docs/analyst.md, e.g.
    apportion sql "SELECT team, count(*) FROM preemptions GROUP BY team" --db run.duckdb
    """
    import duckdb

    if as_csv and as_json:
        raise UserError("--csv and --json exclude each other")
    con = open_read_only(db)
    try:
        try:
            cur = con.execute(query)
            columns = [d[0] for d in cur.description] if cur.description else []
            rows = cur.fetchall() if columns else []
        except duckdb.Error as exc:
            raise UserError(f"{db}: {_first_line(exc)}") from None
    finally:
        con.close()
    if not columns:
        return
    if as_json:
        click.echo(json.dumps([dict(zip(columns, r, strict=True)) for r in rows], default=str))
    elif as_csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
    else:
        click.echo(format_table(columns, rows))
