"""``apportion report``: accounting like ``sreport``/``sacct``: GPU-hours per team,
user or day, owed against delivered (docs/formats.md, "Report"). Live from the
gateway (``GET /v1/report``) or offline from an event log or projection
(``--log``). Registered on :data:`apportion.cli.main`."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import click

from apportion.cli import UserError, echo_json, main
from apportion.cli_live import (
    URL_HELP,
    _offline_log_option,
    _timeout_option,
    _token_option,
    offline_or_live,
)

_WHEN_HELP = (
    "a duration back from now (7d, 12h, 90m), an ISO-8601 date or time (2026-11-30, "
    "2026-11-30T14:05:00Z; UTC if no zone), epoch ms, or simulated time (day 3 14:05)"
)
_LABELS = {
    "gpu_hours": "GPU-H USED",
    "allocated_gpu_hours": "ALLOCATED",
    "unallocated_gpu_hours": "FREE",
    "owed_gpu_hours": "OWED",
    "delivered_gpu_hours": "DELIVERED",
}
"""The table's GPU-hour columns (the CSV and JSON have every figure)."""


def report_offline(log_path: Path, query: dict[str, str]) -> dict[str, Any]:
    """``report`` from an event log (or a DuckDB projection), as the gateway answers
    it, with every hour of the log kept; ``now`` is the log's last event."""
    from apportion.replay.eventlog import LogError, open_log
    from apportion.services.job_history import QueryError
    from apportion.services.report import ReportQuery, report, report_offline_usage

    try:
        usage, tree, now = report_offline_usage(open_log(log_path))
    except LogError as exc:
        raise UserError(str(exc)) from None
    try:
        parsed = ReportQuery.parse(query, now)
    except QueryError as exc:
        raise UserError(str(exc)) from None
    return report(usage, tree, parsed, now)


def _keys(by: list[str]) -> list[str]:
    return [k for k in ("team", "user") if k in by or (k == "team" and "user" in by)]


def report_csv(data: dict[str, Any]) -> str:
    """The rows as CSV with a header: the grouping columns, then every figure."""
    from apportion.schemas.times import with_iso
    from apportion.services.report import FIGURES

    by = data["by"]
    columns = ["date", "day_start_ms", "day_start_at"] if "day" in by else []
    columns += _keys(by) + [*FIGURES, "delivery_ratio"]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in with_iso(data["rows"]):
        writer.writerow(["" if row.get(c) is None else row[c] for c in columns])
    return out.getvalue()


def _print_table(data: dict[str, Any], simulated: bool) -> None:
    from apportion.services.views import iso, simulated_clock

    by = data["by"]
    keys = (["date"] if "day" in by else []) + _keys(by)
    with simulated_clock(simulated):
        since, until = iso(data["since_ms"]), iso(data["until_ms"])

    def day_of(row: dict[str, Any]) -> str:
        return f"day {row['day_start_ms'] // 86_400_000}" if simulated else row["date"]

    cells = [[k.upper() for k in keys] + [*_LABELS.values(), "DELIV/OWED"]]
    for row in [*data["rows"], {**data["total"], "_total": True}]:
        head = [
            ("total" if i == 0 else "")
            if row.get("_total")
            else (day_of(row) if k == "date" else row[k])
            for i, k in enumerate(keys)
        ]
        ratio = row["delivery_ratio"]
        cells.append(
            head
            + [f"{row[f]:,.1f}" for f in _LABELS]
            + ["-" if ratio is None else f"{100 * ratio:.1f}%"]
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    click.echo(
        f"GPU-hours from {since} to {until} UTC ({data['hours']} h), by {', '.join(by)}"
        + (f", team {data['team']}" if data.get("team") else "")
    )
    for n, r in enumerate(cells):
        if n == len(cells) - 1:
            click.echo("  ".join("-" * w for w in widths))
        click.echo(
            "  ".join(
                c.ljust(widths[i]) if i < len(keys) else c.rjust(widths[i]) for i, c in enumerate(r)
            ).rstrip()
        )


@main.command()
@click.option("--since", default=None, metavar="WHEN", help=f"from WHEN: {_WHEN_HELP}")
@click.option("--until", default=None, metavar="WHEN", help="to WHEN (default: now), as --since")
@click.option(
    "--by",
    default="team",
    show_default=True,
    metavar="team|user|day",
    help="group rows by team, user (a budget leaf) or day, or two of them: team,day or user,day",
)
@click.option("--team", default=None, help="only teams (and users) at or below this budget path")
@click.option("--json", "as_json", is_flag=True, help="the API's answer")
@click.option("--csv", "as_csv", is_flag=True, help="the rows as CSV with a header")
@_offline_log_option
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
def report(
    since: str | None,
    until: str | None,
    by: str,
    team: str | None,
    as_json: bool,
    as_csv: bool,
    log_path: Path | None,
    url: str | None,
    timeout: float | None,
    token_file: Path | None,
) -> None:
    """Accounting, like sreport: GPU-hours each team (or user, or day) used, of which
    allocated (charged) and free (unallocated), and what it was owed against what
    it got: owed = min(its share of the healthy GPU-hours, its allocated demand)
    and delivered = min(allocated GPU-hours run, owed), hour by hour as the KPIs
    count them. Whole UTC hours from the one holding --since to the one holding
    --until. Live, the gateway keeps the lookback window (7 days by default);
    --log FILE reports from a whole event log or projection."""
    if as_json and as_csv:
        raise UserError("give --json or --csv, not both")
    query = {
        k: v
        for k, v in (("since", since), ("until", until), ("by", by), ("team", team))
        if v is not None
    }
    data = offline_or_live(log_path, report_offline, "report", query, url, timeout, token_file)
    if as_json:
        echo_json(data)
        return
    if data.get("note"):
        click.echo(f"apportion: note: {data['note']}", err=True)
    if as_csv:
        click.echo(report_csv(data), nl=False)
        return
    from apportion.services.views import is_simulated

    _print_table(data, log_path is not None and is_simulated(data["now_ms"]))
