"""The analyst views (docs/analyst.md), ``apportion sql`` and the charts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from apportion.core.rules.classes import team_of
from apportion.replay.cluster_file import cluster_from_dict
from apportion.replay.kpi import compute_kpis
from apportion.replay.projection import Projection, snapshot_path
from apportion.replay.run import load_inputs
from apportion.replay.simulator import simulate
from apportion.replay.trace import HealthRow, TraceRow
from click.testing import CliRunner

from apportion.cli import main

H = 3_600_000
M = 60_000


def nested_cluster():
    """Leaves at three depths: teams ``llm/pretrain`` (alice, bob), ``llm``
    (finetune, a leaf under ``llm``) and ``vision`` (a leaf under the root)."""
    return cluster_from_dict(
        {
            "cluster": {
                "name": "t",
                "pool": [{"prefix": "g", "count": 4, "gpus_per_node": 8, "gpu_type": "h100"}],
            },
            "budget": {
                "owner": "ops",
                "llm": {
                    "weight": 3,
                    "owner": "a",
                    "pretrain": {
                        "weight": 2,
                        "owner": "b",
                        "alice": {"weight": 1, "owner": "alice"},
                        "bob": {"weight": 1, "owner": "bob"},
                    },
                    "finetune": {"weight": 1, "owner": "c"},
                },
                "vision": {"weight": 1, "owner": "d"},
            },
        }
    ).events


def nested_trace() -> list[TraceRow]:
    def row(i, at, owner, gpus, dur, mr, resumable=True):
        return TraceRow(
            id=i,
            submit_ms=at,
            owner=owner,
            gpus=gpus,
            duration_ms=dur,
            min_runtime_ms=mr,
            resumable=resumable,
        )

    return [
        row("free-v", 0, "vision", 16, 6 * H, 0),
        row("free-f", 0, "llm/finetune", 16, 6 * H, 0, resumable=False),
        row("pt-a", 5 * M, "llm/pretrain/alice", 16, 3 * H, 30 * M),
        row("pt-b", 10 * M, "llm/pretrain/bob", 8, 2 * H, 15 * M),
        row("vis-1", 20 * M, "vision", 8, 2 * H, 30 * M),
        row("ft-1", 40 * M, "llm/finetune", 8, H, 15 * M),
        row("pt-a2", 2 * H, "llm/pretrain/alice", 16, 2 * H, H),
        row("vis-2", 2 * H, "vision", 16, 2 * H, 30 * M),
    ]


@pytest.fixture(scope="module")
def nested():
    health = [
        HealthRow(at_ms=90 * M, node="g003", state="draining"),
        HealthRow(at_ms=150 * M, node="g002", state="down"),
        HealthRow(at_ms=4 * H, node="g002", state="healthy"),
        HealthRow(at_ms=4 * H, node="g003", state="healthy"),
    ]
    result = simulate(nested_cluster(), nested_trace(), health, days=0.5)
    return result.con


@pytest.fixture(scope="module")
def small():
    """The bundled debug scenario, one day, budget policy (start 0, no warm-up)."""
    inp = load_inputs(None, None, None, seed=1, days=1, scenario="debug")
    return simulate(inp.cluster_events, inp.trace, inp.health, days=1)


def one(con, sql):
    row = con.execute(sql).fetchone()
    assert row is not None
    return row[0]


def test_team_on_workloads_and_runs(nested):
    rows = nested.execute("SELECT workload, owner, team FROM workloads").fetchall()
    assert rows
    for _, owner, team in rows:
        assert team == team_of(owner)
    teams = {w: t for w, _, t in rows}
    assert teams["pt-a"] == teams["pt-b"] == "llm/pretrain"
    assert teams["ft-1"] == teams["free-f"] == "llm"
    assert teams["vis-1"] == teams["free-v"] == "vision"
    assert one(nested, "SELECT team_of('llm/pretrain/alice')") == "llm/pretrain"
    assert one(nested, "SELECT team_of('vision')") == "vision"
    assert (
        one(
            nested,
            "SELECT count(*) FROM runs r JOIN workloads w USING (workload) "
            "WHERE r.team IS DISTINCT FROM w.team",
        )
        == 0
    )
    assert one(nested, "SELECT count(*) FROM runs") > 0


@pytest.mark.parametrize("which", ["nested", "small"])
def test_preemptions_and_attempts_agree_with_the_events(which, request):
    con = request.getfixturevalue(which)
    con = con if isinstance(con, duckdb.DuckDBPyConnection) else con.con
    events = one(con, "SELECT count(*) FROM events WHERE kind = 'WorkloadPreempted'")
    scheduler = one(
        con,
        "SELECT count(*) FROM events WHERE kind = 'WorkloadPreempted' "
        "AND json_extract_string(body, '$.reason') <> 'node_down'",
    )
    assert events > 0
    # one row per WorkloadPreempted decision, node-down losses included
    assert one(con, "SELECT count(*) FROM preemptions") == events
    assert one(con, "SELECT count(*) FROM preemptions WHERE reason <> 'node_down'") == scheduler
    # attempts: one row per placement; preempted attempts = scheduler preemptions
    assert one(con, "SELECT count(*) FROM attempts") == one(
        con, "SELECT count(*) FROM events WHERE kind = 'WorkloadPlaced'"
    )
    assert one(con, "SELECT count(*) FROM attempts WHERE end_reason = 'preempted'") == scheduler
    assert (
        one(con, "SELECT count(*) FROM attempts WHERE end_reason IN ('preempted', 'node_down')")
        == events
    )
    assert one(con, "SELECT sum(nodes) FROM attempts") == one(con, "SELECT count(*) FROM runs")
    # the runs table has one row per node: counting it over-counts multi-node gangs
    assert one(con, "SELECT count(*) FROM runs WHERE end_reason = 'preempted'") >= scheduler
    # every preemption has its victim's placement, team and GPUs; the scheduler's
    # own preemptions (not drains, not losses) name their beneficiary
    assert one(con, "SELECT count(*) FROM preemptions WHERE attempt IS NULL OR team IS NULL") == 0
    assert (
        one(
            con,
            "SELECT count(*) FROM preemptions p JOIN workloads w USING (workload) "
            "WHERE p.gpus_freed <> w.gpus",
        )
        == 0
    )
    assert (
        one(
            con,
            "SELECT count(*) FROM preemptions WHERE reason IN ('fairshare', 'unallocated') "
            "AND (for_workload IS NULL OR for_team IS NULL)",
        )
        == 0
    )
    # the contract: a fair-share victim is always past its protection
    assert (
        one(
            con,
            "SELECT count(*) FROM preemptions WHERE reason = 'fairshare' AND NOT past_protection",
        )
        == 0
    )


def test_nested_run_has_every_preemption_reason(nested):
    reasons = {r for (r,) in nested.execute("SELECT DISTINCT reason FROM preemptions").fetchall()}
    assert {"unallocated", "node_down"} <= reasons
    row = nested.execute(
        "SELECT team, for_team FROM preemptions WHERE reason = 'unallocated' ORDER BY pos LIMIT 1"
    ).fetchone()
    assert row is not None and row[0] in ("vision", "llm") and row[1] is not None


def test_team_usage_matches_the_kpis(small):
    con = small.con
    kpis = compute_kpis(con, small.start_ms, small.end_ms)
    ratios = dict(
        con.execute(
            "SELECT team, round(sum(gpu_hours_delivered) / sum(gpu_hours_owed), 4) "
            "FROM team_usage_hourly GROUP BY team HAVING sum(gpu_hours_owed) > 0"
        ).fetchall()
    )
    expected = {t: v for t, v in kpis["team_delivery"].items() if v is not None}
    assert ratios == expected
    overall = one(
        con,
        "SELECT round(sum(gpu_hours_delivered) / sum(gpu_hours_owed), 4) FROM team_usage_hourly",
    )
    assert overall == kpis["delivery_ratio"]
    # every run's GPU-hours are in the hourly view, allocated or not
    ran = one(
        con,
        "SELECT sum((COALESCE(end_ms, (SELECT max(at_ms) FROM events)) - start_ms) * gpus) FROM runs",
    )
    in_view = one(
        con, "SELECT sum(gpu_hours_allocated + gpu_hours_unallocated) FROM team_usage_hourly"
    )
    assert in_view == pytest.approx(ran / H)
    # daily = the sum of its hours
    hourly = con.execute(
        "SELECT team, hour // 24, sum(gpu_hours_owed), sum(gpu_hours_delivered) "
        "FROM team_usage_hourly GROUP BY ALL ORDER BY 1, 2"
    ).fetchall()
    daily = con.execute(
        "SELECT team, day, gpu_hours_owed, gpu_hours_delivered FROM team_usage_daily ORDER BY 1, 2"
    ).fetchall()
    assert [(t, d) for t, d, _, _ in hourly] == [(t, d) for t, d, _, _ in daily]
    for a, b in zip(hourly, daily, strict=True):
        assert a[2:] == pytest.approx(b[2:])
    # the epoch day has its calendar date beside it, a DATE (day 0: 1970-01-01)
    import datetime as dt

    types = dict(
        con.execute("SELECT column_name, column_type FROM (DESCRIBE team_usage_daily)").fetchall()
    )
    assert types["date"] == "DATE" and types["day"] == "BIGINT"
    for day, date in con.execute('SELECT day, "date" FROM team_usage_daily').fetchall():
        assert date == dt.date(1970, 1, 1) + dt.timedelta(days=day)


def test_views_on_an_empty_projection_and_the_projectors_check(tmp_path):
    from apportion.services.projector import check_projection

    con = duckdb.connect()
    proj = Projection(con)
    for view in ("attempts", "preemptions", "team_usage_hourly", "team_usage_daily"):
        assert one(con, f"SELECT count(*) FROM {view}") == 0
    check_projection(proj)


def test_a_file_without_the_team_column_gets_it(tmp_path, small):
    db = tmp_path / "old.duckdb"
    _file_projection(db, small)
    con = duckdb.connect(str(db))
    con.execute("DROP VIEW attempts; DROP VIEW preemptions; DROP VIEW team_usage_daily")
    con.execute("DROP VIEW team_usage_hourly")
    con.execute("ALTER TABLE runs DROP COLUMN team; ALTER TABLE workloads DROP COLUMN team")
    Projection(con, snapshot=False)
    assert one(con, "SELECT count(*) FROM workloads WHERE team IS NULL") == 0
    assert one(con, "SELECT count(*) FROM runs WHERE team IS NULL") == 0
    assert one(con, "SELECT count(*) FROM preemptions") > 0
    con.close()


def _file_projection(path: Path, small) -> None:
    """Copy the small run's projection into a file, then open it as the live projector does."""
    small.con.execute(f"ATTACH '{path}' AS f")
    small.con.execute("COPY FROM DATABASE memory TO f")
    small.con.execute("DETACH f")


def test_live_projection_keeps_a_read_only_snapshot(tmp_path, small):
    db = tmp_path / "live.duckdb"
    _file_projection(db, small)
    snap = snapshot_path(db)
    proj = Projection(duckdb.connect(str(db)))  # the live projector's way: no commit_every
    assert proj.snapshot == snap and snap.exists() and proj.snapshot_error is None
    proj.con.close()
    ro = duckdb.connect(str(snap), read_only=True)
    assert one(ro, "SELECT count(*) FROM events") == one(small.con, "SELECT count(*) FROM events")
    assert one(ro, "SELECT count(*) FROM preemptions") == one(
        small.con, "SELECT count(*) FROM preemptions"
    )
    ro.close()
    # in memory, or with commit_every (the simulator), no snapshot
    assert Projection(duckdb.connect()).snapshot is None
    other = tmp_path / "sim.duckdb"
    assert Projection(duckdb.connect(str(other)), commit_every=1000).snapshot is None


def test_commits_refresh_the_snapshot(tmp_path):
    from apportion.core.history import fold_item
    from apportion.core.state import State
    from apportion.schemas.history import InputItem

    db = tmp_path / "p.duckdb"
    con = duckdb.connect(str(db))
    proj = Projection(con)
    state = State()
    for seq, event in enumerate(nested_cluster(), start=1):
        item = InputItem(seq=seq, at_ms=0, ref=event.id, event=event)
        proj(item, state, fold_item(state, item))
    proj.commit(state)
    snap = snapshot_path(db)
    assert snap.exists()
    ro = duckdb.connect(str(snap), read_only=True)
    assert one(ro, "SELECT count(*) FROM budget") == one(con, "SELECT count(*) FROM budget") > 0
    assert ro.execute("SELECT input_seq FROM projection_position").fetchone() == (state.input_seq,)
    ro.close()
    con.close()


# -- apportion sql ------------------------------------------------------------


@pytest.fixture
def db_file(tmp_path, small) -> Path:
    db = tmp_path / "run.duckdb"
    _file_projection(db, small)
    con = duckdb.connect(str(db))
    Projection(con, snapshot=False)
    con.close()
    return db


def test_sql_reads(db_file):
    runner = CliRunner()
    r = runner.invoke(
        main,
        [
            "sql",
            "SELECT team, count(*) AS n FROM preemptions GROUP BY team ORDER BY team",
            "--db",
            str(db_file),
        ],
    )
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == ["team", "n"] and set(lines[1]) <= {"-", " "}
    r = runner.invoke(
        main, ["sql", "SELECT count(*) AS n FROM attempts", "--db", str(db_file), "--json"]
    )
    assert r.exit_code == 0 and json.loads(r.output)[0]["n"] > 0
    r = runner.invoke(main, ["sql", "SELECT 1 AS a, 'x' AS b", "--db", str(db_file), "--csv"])
    assert r.exit_code == 0 and r.output == "a,b\n1,x\n"


@pytest.mark.parametrize(
    "query",
    [
        "DELETE FROM workloads",
        "DROP TABLE events",
        "CREATE TABLE t(a INT)",
        "UPDATE runs SET gpus = 0",
    ],
)
def test_sql_refuses_writes(db_file, query):
    before = db_file.read_bytes()
    r = CliRunner().invoke(main, ["sql", query, "--db", str(db_file)])
    assert r.exit_code == 2
    assert len(r.output.strip().splitlines()) == 1 and "read-only" in r.output
    assert db_file.read_bytes() == before


def test_sql_errors_are_one_line(tmp_path, db_file):
    r = CliRunner().invoke(main, ["sql", "SELECT 1", "--db", str(tmp_path / "nope.duckdb")])
    assert r.exit_code == 2 and "no such file" in r.output
    r = CliRunner().invoke(main, ["sql", "SELECT * FROM nope", "--db", str(db_file)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1


def test_sql_on_a_locked_file_names_the_snapshot(tmp_path, small):
    db = tmp_path / "live.duckdb"
    _file_projection(db, small)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, duckdb\n"
            "from apportion.replay.projection import Projection\n"
            f"p = Projection(duckdb.connect({str(db)!r}))\n"
            "print('ready', p.snapshot_error, flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().split() == ["ready", "None"]
        runner = CliRunner()
        r = runner.invoke(main, ["sql", "SELECT count(*) FROM events", "--db", str(db)])
        assert r.exit_code == 2
        assert len(r.output.strip().splitlines()) == 1
        assert "locked" in r.output and str(snapshot_path(db)) in r.output
        r = runner.invoke(
            main,
            ["sql", "SELECT count(*) FROM preemptions", "--db", str(snapshot_path(db)), "--csv"],
        )
        assert r.exit_code == 0, r.output
        assert int(r.output.splitlines()[1]) == one(small.con, "SELECT count(*) FROM preemptions")
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)


# -- charts -------------------------------------------------------------------


def test_charts_for_both_policies(tmp_path):
    pytest.importorskip("matplotlib")
    from apportion.replay.plots import write_plots

    inp = load_inputs(None, None, None, seed=1, days=1, scenario="debug")
    sims = {
        p: simulate(inp.cluster_events, inp.trace, inp.health, policy=p, days=1)
        for p in ("budget", "priority")
    }
    paths = write_plots(sims, tmp_path / "charts")
    names = sorted(p.name for p in paths)
    assert names == [
        "gpu_timeline.png",
        "gpu_timeline_priority.png",
        "usage_vs_budget.png",
        "wait_distribution.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_charts_without_matplotlib_say_how_to_install(tmp_path, monkeypatch):
    from apportion.replay import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plots.PlotExtraMissing) as info:
        plots.write_plots({}, tmp_path / "x")
    assert "apportion[plot]" in str(info.value.strerror)
    r = CliRunner().invoke(
        main,
        ["simulate", "--scenario", "debug", "--days", "1", "-q", "--plot", str(tmp_path / "c")],
    )
    assert r.exit_code == 2
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("apportion: ") and "pip install 'apportion[plot]'" in last
