"""Times in trace and health CSVs: a bare number is seconds, a number with a unit is
a duration by the cluster file's and the CLI's rule (``parse_duration_ms``)."""

from __future__ import annotations

import json
from fractions import Fraction

import duckdb
import pytest
from apportion.replay.trace import read_health, read_trace, seconds_to_ms, time_to_ms
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from apportion.cli import main


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("90", 90_000),
        ("12.5", 12_500),
        (" 0.0005 ", 0),  # bare seconds round to the nearest ms, half to even
        ("90s", 90_000),
        ("45m", 2_700_000),
        ("45min", 2_700_000),
        ("1h", 3_600_000),
        ("1.5h", 5_400_000),
        ("2d", 172_800_000),
        ("250ms", 250),
        (" 1 h ", 3_600_000),
    ],
)
def test_time_cells(text, ms):
    assert time_to_ms(text, "duration") == ms


@given(
    st.one_of(
        st.integers(0, 10**12).map(str),
        st.text(alphabet="0123456789", min_size=1, max_size=25),
        st.text(alphabet="0123456789.\u00b2\u0663 _", min_size=1, max_size=8),
    )
)
def test_whole_seconds_read_as_the_exact_decimal_does(text):
    # whole seconds take a shortcut past Fraction: the same milliseconds, the same errors
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        with pytest.raises(ValueError):
            seconds_to_ms(text)
        return
    assert seconds_to_ms(text) == round(value * 1000)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("1H", "not a number of seconds or a duration such as 90s, 45m, 1h or 2d: duration '1H'"),
        ("an hour", "not a number of seconds or a duration"),
        ("-1h", "negative time: duration '-1h'"),
        ("-5", "negative time: duration '-5'"),
        ("0.5ms", "not a whole number of milliseconds: duration '0.5ms'"),
        ("", "not a number of seconds"),
    ],
)
def test_bad_time_cells(text, reason):
    with pytest.raises(ValueError) as exc:
        time_to_ms(text, "duration")
    assert str(exc.value).startswith(reason)


def test_trace_and_health_with_units_read_like_seconds(tmp_path):
    units = tmp_path / "units.csv"
    units.write_text(
        "id,submit,owner,gpus,duration,min_runtime\n"
        "a,0,x,8,10h,4h\n"
        "b,10m,x,8,90s,0\n"
        "c,1d,x,8,2d,45m\n"
        "d,5,x,8,1 hour,0\n"
    )
    secs = tmp_path / "secs.csv"
    secs.write_text(
        "id,submit,owner,gpus,duration,min_runtime\n"
        "a,0,x,8,36000,14400\n"
        "b,600,x,8,90,0\n"
        "c,86400,x,8,172800,2700\n"
    )
    rows, errors = read_trace(units)
    back, none = read_trace(secs)
    assert none == []
    key = [(r.id, r.submit_ms, r.duration_ms, r.min_runtime_ms) for r in rows]
    assert key == [(r.id, r.submit_ms, r.duration_ms, r.min_runtime_ms) for r in back]
    assert key[0] == ("a", 0, 36_000_000, 14_400_000)
    assert [(e.where, e.reason) for e in errors] == [
        (5, "not a number of seconds or a duration such as 90s, 45m, 1h or 2d: duration '1 hour'")
    ]
    health = tmp_path / "h.csv"
    health.write_text("at,node,state\n30m,g000,draining\n2h,g000,healthy\n")
    hrows, herrors = read_health(health)
    assert herrors == []
    assert [h.at_ms for h in hrows] == [1_800_000, 7_200_000]


def test_simulate_takes_a_trace_with_units(tmp_path):
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        '[cluster]\nname = "t"\n[[cluster.pool]]\nprefix = "g"\ncount = 1\n'
        'gpus_per_node = 8\ngpu_type = "h100"\n[budget]\nowner = "ops"\n'
        '[budget.a]\nweight = 1\nowner = "al"\n'
    )
    trace = tmp_path / "trace.csv"
    trace.write_text("id,submit,owner,gpus,duration,min_runtime\nj,30m,a,8,2h,1h\nk,1h,a,8,9x,0\n")
    out = tmp_path / "run.duckdb"
    r = CliRunner().invoke(
        main,
        ["simulate", "--cluster", str(cluster), "--trace", str(trace), "--out", str(out), "--json"],
    )
    assert r.exit_code == 0, r.output
    assert f"{trace}:3: not a number of seconds or a duration" in r.stderr
    assert json.loads(r.stdout)["workloads"] == 1
    con = duckdb.connect(str(out), read_only=True)
    assert con.execute(
        "SELECT submitted_ms, duration_ms, min_runtime_ms, ended_ms FROM workloads"
    ).fetchall() == [(1_800_000, 7_200_000, 3_600_000, 1_800_000 + 7_200_000)]
