"""ISO-8601 UTC beside the integer ms: one rule (`schemas/times.py`) in Python for
JSON and in SQL for the analyst views, and the views carry the columns."""

from __future__ import annotations

import duckdb
from apportion.replay.projection import Projection
from apportion.schemas.times import DURATIONS, TIME_POINTS, iso_key, iso_utc, with_iso
from hypothesis import given
from hypothesis import strategies as st


def test_iso_utc_is_to_the_second_with_ms_only_when_there_are_some() -> None:
    assert iso_utc(1_796_301_735_000) == "2026-12-03T12:42:15Z"
    assert iso_utc(1_796_301_735_250) == "2026-12-03T12:42:15.250Z"
    assert iso_utc(0) == "1970-01-01T00:00:00Z"  # a simulation's start: still a value
    assert iso_utc(-1) == "1969-12-31T23:59:59.999Z"
    assert iso_utc(None) is None
    assert iso_utc(10**18) is None  # past the calendar


def test_with_iso_adds_at_beside_points_in_time_only() -> None:
    data = {
        "now_ms": 0,
        "jobs": [{"submitted_ms": 1_500, "ended_ms": None, "min_runtime_ms": 3_600_000}],
        "at_ms": 60_000,
        "owed_gpu_ms": 5,
        "flag": True,
    }
    out = with_iso(data)
    assert list(out) == ["now_ms", "now_at", "jobs", "at_ms", "at", "owed_gpu_ms", "flag"]
    assert out["jobs"][0] == {
        "submitted_ms": 1_500,
        "submitted_at": "1970-01-01T00:00:01.500Z",
        "ended_ms": None,
        "ended_at": None,
        "min_runtime_ms": 3_600_000,  # a duration: no time of day
    }
    assert with_iso(out) == out  # idempotent
    assert not TIME_POINTS & DURATIONS
    assert iso_key("protected_until_ms") == "protected_until_at" and iso_key("at_ms") == "at"


@given(st.integers(min_value=-(10**12), max_value=4 * 10**12))
def test_the_sql_macro_is_the_python_rule(ms: int) -> None:
    con = duckdb.connect()
    Projection(con)
    (got,) = con.execute("SELECT iso_utc(?::BIGINT)", [ms]).fetchone()
    assert got == iso_utc(ms)


def test_every_analyst_view_has_an_at_beside_each_point_in_time() -> None:
    con = duckdb.connect()
    Projection(con)
    for view in ("attempts", "preemptions", "team_usage_hourly", "team_usage_daily"):
        cols = [
            r[0]
            for r in con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
                "ORDER BY ordinal_position",
                [view],
            ).fetchall()
        ]
        for c in cols:
            if c.endswith("_ms"):
                assert c in TIME_POINTS or c in DURATIONS, (view, c)
                if c in TIME_POINTS:
                    assert iso_key(c) in cols, (view, c)
