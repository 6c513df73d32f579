"""A plain ``simulate`` (no ``--out``) keeps only the tables the KPIs read and
counts the events: its KPIs equal, exactly, those of the same run written to a
file with the whole projection (issue 28: the history's rows were most of the
memory of a plain run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import pytest
from apportion.replay import run
from apportion.replay.run import load_inputs, run_policy

KPI_TABLES = ("workloads", "runs", "waits", "nodes", "health", "budget", "estimates")


def _without_wall(kpis: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kpis.items() if k != "wall_s"}


def _rows(con: duckdb.DuckDBPyConnection, table: str) -> list[tuple]:
    return sorted(con.execute(f"SELECT * FROM {table}").fetchall(), key=repr)


@pytest.mark.parametrize(
    ("scenario", "days", "policy"),
    [("debug", 2, "budget"), ("debug", 2, "priority"), ("family", 1, "budget")],
)
def test_the_kpis_without_the_history_are_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scenario: str, days: int, policy: str
) -> None:
    monkeypatch.setattr(run, "KPI_COMMIT_EVERY", 97)  # many commits: row order plays no part
    inp = load_inputs(None, None, None, seed=1, days=days, scenario=scenario)
    out = tmp_path / "run.duckdb"
    whole, whole_kpis = run_policy(inp, policy, out=out, estimate_every=3)
    plain, plain_kpis = run_policy(inp, policy, estimate_every=3)
    assert _without_wall(plain_kpis) == _without_wall(whole_kpis)
    assert plain_kpis["events"] == whole_kpis["events"] > 97
    assert plain.state.digest() == whole.state.digest()
    assert plain.con is not None and whole.con is not None
    for table in KPI_TABLES:
        assert _rows(plain.con, table) == _rows(whole.con, table), table
    for table in ("events", "batches", "projection_state"):
        assert plain.con.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,), table
    assert whole.con.execute("SELECT count(*) FROM projection_state").fetchone() == (1,)


def test_charts_keep_the_history(tmp_path: Path) -> None:
    """``--plot`` reads the history's views (``team_usage_hourly``): those runs keep it."""
    inp = load_inputs(None, None, None, seed=1, days=1, scenario="debug")
    result, kpis = run_policy(inp, "budget", history=True)
    assert result.con is not None
    assert result.con.execute("SELECT count(*) FROM events").fetchone() == (kpis["events"],)
    assert result.con.execute("SELECT count(*) FROM team_usage_hourly").fetchone() != (0,)
