"""A simulation's size has bounds: days of a scenario, GPUs of the family, the
workloads a generator makes and the days a trace spans. Past them the command
exits with one line (exit 2) before it fills the memory, never a traceback."""

from __future__ import annotations

import pytest
from apportion.replay import trace as trace_mod
from apportion.replay.scenarios import MAX_SCENARIO_DAYS, generate
from click.testing import CliRunner

from apportion.cli import main


def _refused(args: list[str]) -> str:
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("days", ["1e9", "0.5", str(MAX_SCENARIO_DAYS + 1), "0", "-3"])
def test_scenario_days_are_bounded(days):
    line = _refused(["simulate", "--scenario", "family", "--days", days, "-q"])
    assert f"from 1 to {MAX_SCENARIO_DAYS}" in line or "positive" in line


def test_trace_generate_days_are_bounded(tmp_path):
    line = _refused(
        ["trace", "generate", "--scenario", "ai2", "--days", "100000", "--out-dir", str(tmp_path)]
    )
    assert f"from 1 to {MAX_SCENARIO_DAYS}" in line
    assert not list(tmp_path.iterdir())


def test_family_gpus_are_bounded():
    line = _refused(
        ["simulate", "--scenario", "family", "--set", "gpus=1600000", "--days", "1", "-q"]
    )
    assert "gpus must be a multiple of 8 from 16 to 65,536" in line


def test_generation_stops_at_the_row_bound(monkeypatch):
    monkeypatch.setattr(trace_mod, "MAX_GENERATED_ROWS", 50)
    with pytest.raises(ValueError, match="more than 50 workloads"):
        generate("family", 3, 1, [])
    monkeypatch.setattr(trace_mod, "MAX_GENERATED_ROWS", 10**6)
    assert len(generate("family", 3, 1, []).trace) > 50


def test_generation_row_bound_reaches_the_cli(monkeypatch):
    monkeypatch.setattr(trace_mod, "MAX_GENERATED_ROWS", 50)
    line = _refused(["simulate", "--scenario", "family", "--days", "3", "-q"])
    assert "more than 50 workloads" in line


def _small_trace(tmp_path, last_submit_s: int):
    out = tmp_path / "d"
    r = CliRunner().invoke(
        main, ["trace", "generate", "--scenario", "debug", "--days", "1", "--out-dir", str(out)]
    )
    assert r.exit_code == 0, r.output
    trace = out / "trace.csv"
    with trace.open("a") as f:
        f.write(f"late-1,{last_submit_s},dev/ed,1,60,0,true,0,any,normal,false\n")
    return out / "cluster.toml", trace


def test_trace_horizon_is_bounded(tmp_path):
    cluster, trace = _small_trace(tmp_path, 9_000_000_000)
    line = _refused(["simulate", "--cluster", str(cluster), "--trace", str(trace), "-q"])
    assert "the trace's last row makes a simulation of 104167 days; at most 3,650" in line
    line = _refused(
        ["simulate", "--cluster", str(cluster), "--trace", str(trace), "--days", "1e9", "-q"]
    )
    assert "--days 1e+09" in line and "at most 3,650" in line


def test_a_long_trace_cut_by_days_runs(tmp_path):
    cluster, trace = _small_trace(tmp_path, 9_000_000_000)
    r = CliRunner().invoke(
        main,
        [
            "simulate",
            "--cluster",
            str(cluster),
            "--trace",
            str(trace),
            "--days",
            "1",
            "-q",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output


def _cluster_file(tmp_path, pools: str, name: str = "c.toml"):
    f = tmp_path / name
    f.write_text(
        f'[cluster]\nname = "x"\n{pools}\n[budget]\nowner = "ops"\n[budget.a]\nweight = 1\nowner = "a"\n'
    )
    return f


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        (
            '[[cluster.pool]]\nprefix = "n"\ncount = 100000000\ngpus_per_node = 8\ngpu_type = "h100"\n',
            "cluster.pool[0].count: a cluster has at most 65,536 nodes, got 100,000,000",
        ),
        (
            '[[cluster.pool]]\nprefix = "n"\ncount = 60000\ngpus_per_node = 8\ngpu_type = "h100"\n'
            '[[cluster.pool]]\nprefix = "m"\ncount = 6000\ngpus_per_node = 8\ngpu_type = "a100"\n',
            "cluster.pool[1].count: a cluster has at most 65,536 nodes (60,000 in the pools before), got 6,000",
        ),
        (
            '[[cluster.pool]]\nprefix = "n"\ncount = 2\ngpus_per_node = 100000\ngpu_type = "h100"\n',
            "cluster.pool[0].gpus_per_node: at most 65,536, got 100,000",
        ),
    ],
)
def test_cluster_file_sizes_are_bounded(tmp_path, pools, message):
    cluster = _cluster_file(tmp_path, pools)
    trace = tmp_path / "t.csv"
    trace.write_text("id,submit,owner,gpus,duration,min_runtime\nj1,0,a,1,60,0\n")
    line = _refused(["simulate", "--cluster", str(cluster), "--trace", str(trace), "-q"])
    assert message in line


def test_at_most_64_clusters_share_a_tree(tmp_path):
    members = "".join(
        f'[[clusters]]\nname = "c{i}"\n[[clusters.pool]]\nprefix = "c{i}-"\ncount = 1\ngpus_per_node = 8\n'
        'gpu_type = "h100"\n'
        for i in range(65)
    )
    f = tmp_path / "fed.toml"
    f.write_text(members + '[budget]\nowner = "ops"\n[budget.a]\nweight = 1\nowner = "a"\n')
    trace = tmp_path / "t.csv"
    trace.write_text("id,submit,owner,gpus,duration,min_runtime\nj1,0,a,1,60,0\n")
    line = _refused(["simulate", "--cluster", str(f), "--trace", str(trace), "-q"])
    assert "at most 64 clusters share a tree, got 65" in line
