"""Accounting (``apportion report``, ``GET /v1/report``): GPU-hours per team, user
and day, with owed against delivered, like Slurm's ``sreport``.

The figures are those of the usage history (:mod:`~apportion.services.usage_history`),
which are the KPIs' (docs/formats.md, "KPI keys"): per budget node and hour,
owed = min(global share x healthy GPU-hours, allocated demand) and delivered =
min(allocated GPU-hours run, owed) (:func:`~apportion.services.usage_history.owed_delivered`),
computed hour by hour and then summed, so a burst in one hour never repays a
shortfall in another. A **team** is the budget node one level above the leaves;
a **user** is a leaf (the budget path work is owned by). ``--by day`` sums the
hours of each UTC day (a simulation's day 0 starts at epoch 0).

The same function answers live (the gateway's usage history: the lookback
window, 7 days by default, is all it keeps) and offline (an event log or a
DuckDB projection folded from its start, every hour kept).
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import msgspec
from apportion.core.budget import ROOT, BudgetTree
from apportion.core.rules.classes import team_of
from apportion.schemas.bounds import MAX_PATH_LEN
from apportion.schemas.events import DAY_MS, HOUR_MS
from apportion.schemas.times import civil_date, iso_utc

from .job_history import QueryError, parse_when
from .usage_history import Hourly, UsageHistory, owed_delivered

REPORT_BY = ("team", "user", "day")
"""What ``by`` groups rows by (one or two, comma-separated; not team and user)."""
MAX_REPORT_MS = 366 * DAY_MS
"""The longest period one report covers."""
KEEP_ALL_MS = 100 * 366 * DAY_MS
"""``keep_ms`` of an offline report's usage history: every hour of the log."""
PARAMETERS = ("since", "until", "by", "team")

FIGURES = (
    "gpu_hours",
    "allocated_gpu_hours",
    "unallocated_gpu_hours",
    "demand_gpu_hours",
    "share_gpu_hours",
    "owed_gpu_hours",
    "delivered_gpu_hours",
)
"""The GPU-hour columns of a row (then ``delivery_ratio``), in order."""


class ReportQuery(msgspec.Struct, frozen=True):
    """What to report: the period (``None``: from the first hour held / to now),
    the grouping, and optionally one team (a budget path: it and its subtree)."""

    since_ms: int | None = None
    until_ms: int | None = None
    by: tuple[str, ...] = ("team",)
    team: str | None = None

    @classmethod
    def parse(cls, query: Mapping[str, str], now_ms: int) -> ReportQuery:
        """From query parameters (``since``, ``until``, ``by``, ``team``);
        :class:`QueryError` names the first one out of its form or bound."""
        unknown = sorted(set(query) - set(PARAMETERS))
        if unknown:
            raise QueryError(
                f"unknown parameter {unknown[0][:64]!r} (known: {', '.join(PARAMETERS)})"
            )
        since = parse_when(query["since"], now_ms, "since") if query.get("since") else None
        until = parse_when(query["until"], now_ms, "until") if query.get("until") else None
        if since is not None and until is not None:
            if until <= since:
                raise QueryError("until: must be later than since")
            if until - since > MAX_REPORT_MS:
                raise QueryError("since/until: at most 366 days at once")
        by = parse_by(query.get("by") or "team")
        team = query.get("team") or None
        if team is not None:
            if len(team) > MAX_PATH_LEN:
                raise QueryError(f"team: at most {MAX_PATH_LEN} characters")
            team = team.strip("/") or None
        return cls(since, until, by, team)


def parse_by(text: str) -> tuple[str, ...]:
    """``by``: ``team``, ``user``, ``day`` or two of them (``team,day``; not team and user)."""
    out: list[str] = []
    for part in text.split(","):
        name = part.strip().lower()
        if not name:
            continue
        if name not in REPORT_BY:
            raise QueryError(f"by: {name[:32]!r} is not one of {', '.join(REPORT_BY)}")
        if name not in out:
            out.append(name)
    if not out:
        raise QueryError(f"by: give one or two of {', '.join(REPORT_BY)}")
    if "team" in out and "user" in out:
        raise QueryError("by: team or user, not both (a user's rows name its team)")
    return tuple(sorted(out, key=REPORT_BY.index))


def _within(path: str, top: str | None) -> bool:
    """``path`` is ``top`` or below it (by whole segments); anything when ``top`` is None."""
    return top is None or path == top or path.startswith(top + "/")


def _share(tree: BudgetTree, path: str) -> Fraction:
    """``path``'s global share in the current tree; 0 for a path removed since."""
    return tree.global_share(path) if path in tree.nodes else Fraction(0)


def report(
    usage: UsageHistory, tree: BudgetTree, query: ReportQuery, now_ms: int
) -> dict[str, Any]:
    """The accounting answer (docs/formats.md, "Report"): rows of GPU-hours used,
    allocated, unallocated, demanded, the share, owed and delivered, grouped by
    ``query.by``, over the whole UTC hours from the one holding ``since`` to the
    one holding ``until`` (the last counted up to ``now_ms``), clipped to the
    hours ``usage`` holds (``note`` says so)."""
    now_ms = max(now_ms, usage.clock)
    kept_from = usage.kept_from_ms()
    until = min(query.until_ms if query.until_ms is not None else now_ms, now_ms)
    since = query.since_ms if query.since_ms is not None else kept_from
    note = None
    if kept_from is None:
        since = until
        note = "no history yet"
    elif since is not None and since < kept_from and query.since_ms is not None:
        note = (
            f"hours before {iso_utc(kept_from)} are not kept here (the usage history holds "
            "the lookback window): the report starts at the first hour held; for "
            "older hours, report from the projection: apportion report --log FILE"
        )
    since = until if since is None or kept_from is None else max(since, kept_from)
    first = since // HOUR_MS
    last = -(-until // HOUR_MS) - 1  # the hour holding until - 1 ms
    n = max(0, last - first + 1)
    rows: dict[tuple[str, ...], dict[str, Any]] = {}
    if n:
        hourly = usage.hourly(now_ms, n, last_hour=last)
        leaves = set(tree.leaves()) | set(hourly.demand) | set(hourly.used) | set(hourly.free)
        leaves.discard(ROOT)
        members: dict[str, list[str]] = {}
        for leaf in sorted(leaves):
            members.setdefault(team_of(leaf), []).append(leaf)
        per_user = "user" in query.by
        for team, team_leaves in members.items():
            units = [(leaf, [leaf]) for leaf in team_leaves] if per_user else [(team, team_leaves)]
            for path, of in units:
                if _within(team, query.team) or (per_user and _within(path, query.team)):
                    _add_unit(rows, hourly, query.by, team, path, _share(tree, path), of)
    ordered = [rows[k] for k in sorted(rows)]
    return {
        "since_ms": first * HOUR_MS,
        "until_ms": max(first * HOUR_MS, min((last + 1) * HOUR_MS, now_ms)),
        "now_ms": now_ms,
        "hours": n,
        "by": list(query.by),
        "team": query.team,
        "kept_from_ms": kept_from,
        "note": note,
        "rows": ordered,
        "total": _total(ordered),
    }


def _add_unit(
    rows: dict[tuple[str, ...], dict[str, Any]],
    hourly: Hourly,
    by: tuple[str, ...],
    team: str,
    path: str,
    share: Fraction,
    leaves: list[str],
) -> None:
    """Add budget node ``path`` (a team, or a user of ``team``) hour by hour into the
    rows of its groups: owed and delivered per hour first, then summed."""
    demand = hourly.summed_of(leaves, hourly.demand)
    used = hourly.summed_of(leaves, hourly.used)
    free = hourly.summed_of(leaves, hourly.free)
    first_hour = hourly.start_ms // HOUR_MS
    for i in range(hourly.n):
        if not (demand[i] or used[i] or free[i] or (share and hourly.healthy[i])):
            continue
        share_ms = share * hourly.healthy[i]
        owed, delivered = owed_delivered(share_ms, demand[i], used[i])
        day = (first_hour + i) // 24
        key: tuple[str, ...] = ()
        if "team" in by:
            key += (team,)
        if "user" in by:
            key += (team, path)
        if "day" in by:
            key = (f"{day:09d}", *key)
        row = rows.get(key)
        if row is None:
            row = rows[key] = _new_row(by, team, path, day)
        sums = row["_sums"]
        for name, value in (
            ("gpu_hours", used[i] + free[i]),
            ("allocated_gpu_hours", used[i]),
            ("unallocated_gpu_hours", free[i]),
            ("demand_gpu_hours", demand[i]),
            ("share_gpu_hours", share_ms),
            ("owed_gpu_hours", owed),
            ("delivered_gpu_hours", delivered),
        ):
            sums[name] += value


def _new_row(by: tuple[str, ...], team: str, path: str, day: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    if "day" in by:
        row["day_start_ms"] = day * DAY_MS
        row["date"] = _date(day)
    if "team" in by or "user" in by:
        row["team"] = team
    if "user" in by:
        row["user"] = path
    row["_sums"] = dict.fromkeys(FIGURES, Fraction(0))
    return row


def _date(day: int) -> str:
    """Epoch day ``day`` as ``YYYY-MM-DD`` (UTC)."""
    return "{:04d}-{:02d}-{:02d}".format(*civil_date(day))


def _figures(sums: dict[str, Fraction]) -> dict[str, Any]:
    out: dict[str, Any] = {name: round(float(sums[name]) / HOUR_MS, 6) for name in FIGURES}
    owed = sums["owed_gpu_hours"]
    out["delivery_ratio"] = (
        round(float(Fraction(sums["delivered_gpu_hours"]) / Fraction(owed)), 6) if owed else None
    )
    return out


def _total(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows summed (and each row's exact sums turned into GPU-hours)."""
    total = dict.fromkeys(FIGURES, Fraction(0))
    for row in rows:
        sums = row.pop("_sums")
        for name in FIGURES:
            total[name] += sums[name]
        row.update(_figures(sums))
    return _figures(total)


def report_offline_usage(items: Any) -> tuple[UsageHistory, BudgetTree, int]:
    """A whole history (an event log's items) folded: its usage history with every
    hour kept, the budget tree at its end and its last event's time."""
    from apportion.core.history import fold_item
    from apportion.core.state import State

    state = State()
    usage = UsageHistory(keep_ms=KEEP_ALL_MS)
    for item in items:
        fold_item(state, item)
        usage.record([item])
    return usage, state.budget, state.now_ms
