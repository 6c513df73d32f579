"""`apportion report --log`: accounting from an event log agrees with the projection's
`team_usage_hourly` (the KPIs' owed and delivered), and its inputs are checked."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import duckdb
import pytest
from apportion.replay.eventlog import open_log
from apportion.replay.run import rebuild
from click.testing import CliRunner

from apportion.cli import main
from apportion.cli_report import report_offline

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "debug-budget-1d.jsonl"


@pytest.fixture(scope="module")
def projection(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report") / "run.duckdb"
    rebuild(open_log(GOLDEN), out=out)
    return out


def _sql(db: Path, query: str) -> list[tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(query).fetchall()
    finally:
        con.close()


def test_report_by_team_is_the_projections_owed_and_delivered(projection: Path) -> None:
    data = report_offline(GOLDEN, {})
    expected = {
        team: (owed, delivered, allocated, unallocated)
        for team, owed, delivered, allocated, unallocated in _sql(
            projection,
            "SELECT team, sum(gpu_hours_owed), sum(gpu_hours_delivered), "
            "sum(gpu_hours_allocated), sum(gpu_hours_unallocated) FROM team_usage_hourly "
            "GROUP BY team",
        )
    }
    got = {r["team"]: r for r in data["rows"]}
    assert set(got) == set(expected)
    for team, (owed, delivered, allocated, unallocated) in expected.items():
        row = got[team]
        assert row["owed_gpu_hours"] == pytest.approx(owed, abs=1e-5), team
        assert row["delivered_gpu_hours"] == pytest.approx(delivered, abs=1e-5), team
        assert row["allocated_gpu_hours"] == pytest.approx(allocated, abs=1e-5), team
        assert row["unallocated_gpu_hours"] == pytest.approx(unallocated, abs=1e-5), team
    # the projection answers the same as the log it was built from
    assert report_offline(projection, {"by": "user,day"}) == report_offline(
        GOLDEN, {"by": "user,day"}
    )
    # by day: the same totals, a row per day, dated
    days = report_offline(GOLDEN, {"by": "day"})
    assert [r["date"] for r in days["rows"]] == ["1970-01-01"]
    assert days["total"]["owed_gpu_hours"] == pytest.approx(data["total"]["owed_gpu_hours"])


def test_since_and_until_cut_whole_hours(projection: Path) -> None:
    whole = report_offline(GOLDEN, {"by": "team"})
    first = report_offline(GOLDEN, {"until": "day 0 12:00"})
    second = report_offline(GOLDEN, {"since": "43200000"})  # day 0 12:00 as epoch ms
    assert first["hours"] == 12 and second["since_ms"] == 12 * 3_600_000
    for key in ("owed_gpu_hours", "delivered_gpu_hours", "gpu_hours"):
        assert first["total"][key] + second["total"][key] == pytest.approx(whole["total"][key])
    late = report_offline(GOLDEN, {"since": "6h"})  # 6 h before the log's last event
    assert late["since_ms"] == whole["until_ms"] - 6 * 3_600_000


def test_the_command_prints_a_table_csv_and_json() -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["report", "--log", str(GOLDEN)])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].startswith("GPU-hours from day 0 00:00 to day 1 00:00 UTC (24 h), by team")
    assert lines[1].split()[:3] == ["TEAM", "GPU-H", "USED"] and "DELIV/OWED" in lines[1]
    assert lines[-1].startswith("total")
    out = runner.invoke(main, ["report", "--log", str(GOLDEN), "--by", "user,day", "--csv"])
    rows = list(csv.DictReader(io.StringIO(out.output)))
    assert rows and {r["date"] for r in rows} == {"1970-01-01"}
    assert {"team", "user", "owed_gpu_hours", "delivered_gpu_hours", "day_start_at"} <= set(rows[0])
    assert rows[0]["day_start_at"] == "1970-01-01T00:00:00Z"
    out = runner.invoke(main, ["report", "--log", str(GOLDEN), "--json"])
    data = json.loads(out.output)
    assert data["since_at"] == "1970-01-01T00:00:00Z" and data["until_at"] == "1970-01-02T00:00:00Z"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--since", "yesterday"], "since: 'yesterday' is neither a duration"),
        (["--by", "colour"], "by: 'colour' is not one of team, user, day"),
        (["--by", "team,user"], "by: team or user, not both"),
        (["--since", "2h", "--until", "3h"], "until: must be later than since"),
        (["--until", "day 0 25:00"], "until: 'day 0 25:00': the time of day is HH:MM"),
        (["--json", "--csv"], "give --json or --csv, not both"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], words: str) -> None:
    out = CliRunner().invoke(main, ["report", "--log", str(GOLDEN), *args])
    assert out.exit_code == 2, out.output
    assert out.output.startswith(f"apportion: {words}"), out.output
    assert out.output.count("\n") == 1 and "Traceback" not in out.output


def test_a_missing_log_is_one_line(tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["report", "--log", str(tmp_path / "nope.jsonl")])
    assert out.exit_code == 2 and out.output.startswith("apportion: ")
    assert out.output.count("\n") == 1
