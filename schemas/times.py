"""Points in time for people beside the integer milliseconds: ISO-8601 UTC.

Every JSON answer (the gateway's API, the command line's ``--json``) and every
analyst view keeps its integer epoch milliseconds (``*_ms``) and carries, beside
each one that is a *point in time*, the same instant as an ISO-8601 UTC string
(``*_at``): ``submitted_ms`` -> ``submitted_at``, ``at_ms`` -> ``at``. Durations
(``min_runtime_ms``, ``grace_ms``, ``wait_ms``, ...) and GPU-time quantities
(``*_gpu_ms``) get none. The string is to the second, with milliseconds only
when there are some: ``2026-12-03T12:42:15Z``, ``2026-12-03T12:42:15.250Z``. A
simulation's clock starts at epoch 0, so its times read ``1970-01-...``: the
same value, consistent with the milliseconds.

One rule in two spellings, kept equal by a test: :func:`iso_utc` (Python, used
through :func:`with_iso` for JSON) and :data:`ISO_UTC_SQL` (the DuckDB macro
``iso_utc(ms)`` every projection defines, used by the analyst views).
"""

from __future__ import annotations

from typing import Any

TIME_POINTS = frozenset(
    {
        "at_ms",
        "now_ms",
        "start_ms",
        "end_ms",
        "submitted_ms",
        "queued_ms",
        "placed_ms",
        "first_placed_ms",
        "ended_ms",
        "started_ms",
        "estimated_start_ms",
        "expected_end_ms",
        "protected_until_ms",
        "held_ms",
        "since_ms",
        "until_ms",
        "kept_from_ms",
        "next_wakeup_ms",
        "deadline_ms",
        "renewed_ms",
        "hour_start_ms",
        "day_start_ms",
    }
)
"""``*_ms`` keys that name a point in time (epoch ms): each gets an ``*_at`` beside it."""

DURATIONS = frozenset(
    {
        "min_runtime_ms",
        "max_min_runtime_ms",
        "duration_ms",
        "grace_ms",
        "max_grace_ms",
        "wait_ms",
        "ran_ms",
        "lookback_ms",
        "preemption_margin_wait_ms",
        "heartbeat_timeout_ms",
        "notice_ms",
        "fence_after_ms",
        "hour_ms",
    }
)
"""``*_ms`` keys that are lengths of time: no ``*_at``. (``*_gpu_ms`` are GPU-time.)"""

ISO_UTC_SQL = (
    "CASE WHEN ms % 1000 = 0 THEN strftime(make_timestamp(ms * 1000), '%Y-%m-%dT%H:%M:%SZ') "
    "ELSE strftime(make_timestamp(ms * 1000), '%Y-%m-%dT%H:%M:%S.%gZ') END"
)
"""The body of the DuckDB macro ``iso_utc(ms)``: :func:`iso_utc` in SQL (NULL stays NULL)."""


def civil_date(day: int) -> tuple[int, int, int]:
    """Epoch day ``day`` (days since 1970-01-01) as ``(year, month, day)`` of the
    proleptic Gregorian calendar: integer arithmetic only (H. Hinnant's
    ``civil_from_days``), so this layer needs no clock library."""
    z = day + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1_460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, doy - (153 * mp + 2) // 5 + 1


def iso_utc(ms: int | None) -> str | None:
    """Epoch milliseconds as ISO-8601 UTC (``2026-12-03T12:42:15Z``; ``.250`` added
    only when the milliseconds are not zero); ``None`` for ``None`` or a time
    outside the years 1 to 9999."""
    if ms is None:
        return None
    day, rest = divmod(int(ms), 86_400_000)
    year, month, mday = civil_date(day)
    if not 1 <= year <= 9999:
        return None
    seconds, frac = divmod(rest, 1000)
    minutes, sec = divmod(seconds, 60)
    hour, minute = divmod(minutes, 60)
    text = f"{year:04d}-{month:02d}-{mday:02d}T{hour:02d}:{minute:02d}:{sec:02d}"
    return f"{text}.{frac:03d}Z" if frac else f"{text}Z"


def iso_key(key: str) -> str:
    """The ISO field beside ``key``: ``submitted_ms`` -> ``submitted_at``, ``at_ms`` -> ``at``."""
    stem = key[: -len("_ms")]
    return "at" if stem == "at" else f"{stem}_at"


def with_iso(data: Any) -> Any:
    """``data`` (JSON-like: dicts, lists, scalars) with an ``*_at`` string placed right
    after every point-in-time ``*_ms`` key (:data:`TIME_POINTS`), at any depth; a
    ``None`` time gives ``None``. Returns new containers; idempotent."""
    if isinstance(data, dict):
        out: dict[Any, Any] = {}
        for key, value in data.items():
            out[key] = with_iso(value)
            if key in TIME_POINTS and (
                value is None or (isinstance(value, int | float) and not isinstance(value, bool))
            ):
                out[iso_key(key)] = iso_utc(None if value is None else int(value))
        return out
    if isinstance(data, list | tuple):
        return [with_iso(v) for v in data]
    return data
