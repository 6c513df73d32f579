"""A real Philly slice end to end, and the command line's handling of bad files."""

from __future__ import annotations

import hashlib
import json

from apportion.replay.cluster_file import load_cluster
from apportion.replay.importers import import_philly
from apportion.replay.kpi import compute_kpis
from apportion.replay.simulator import simulate
from apportion.replay.trace import read_trace
from click.testing import CliRunner

from apportion.cli import main


def test_philly_files_are_untouched(shared_traces, philly_dir):
    sums = dict(
        reversed(line.split())
        for line in (shared_traces / "SHA256SUMS").read_text().splitlines()
        if line
    )
    for name in ("philly_pollux_jobs.csv", "philly_vc_nodes_helios.csv"):
        assert hashlib.sha256((shared_traces / name).read_bytes()).hexdigest() == sums[name]
    # the committed slice is the file's first 400 lines, byte for byte
    full = (shared_traces / "philly_pollux_jobs.csv").read_bytes()
    cut = (philly_dir / "philly_pollux_jobs.csv").read_bytes()
    assert full.startswith(cut) and cut.count(b"\n") == 400


def test_philly_slice_imports_and_runs(philly_dir, tmp_path):
    lines = (philly_dir / "philly_pollux_jobs.csv").read_text().splitlines()
    src = tmp_path / "philly_pollux_jobs.csv"
    # a real slice, one duplicated row and one job of a capacity-less VC
    slice_ = lines[:400] + [lines[5], "2017-10-09 07:01:55,66.0,1,66.0,925e2b"]
    src.write_text("\n".join(slice_) + "\n")
    (tmp_path / "philly_vc_nodes_helios.csv").write_bytes(
        (philly_dir / "philly_vc_nodes_helios.csv").read_bytes()
    )
    report = import_philly(
        src, tmp_path / "out", capacity_scale=0.25, date_from="2017-10-01", date_to="2017-12-01"
    )
    assert report.duplicates == 1 and report.dropped_vcs == {"925e2b": 1}
    assert report.vcs == 11 and report.nodes == sum(
        max(1, round(n / 4)) for n in (64, 32, 16, 64, 64, 16, 32, 16, 8, 8, 32)
    )
    rows, errors = read_trace(tmp_path / "out" / "trace.csv")
    assert errors == [] and len(rows) == report.written > 100
    assert all(
        r.min_runtime_ms == min(8 * 3_600_000, -(-r.duration_ms // 60_000) * 60_000) for r in rows
    )
    spec = load_cluster(tmp_path / "out" / "cluster.toml")
    days = rows[-1].submit_ms // 86_400_000 + 1
    for policy in ("priority", "budget"):
        sim = simulate(spec.events, rows, policy=policy, days=days)
        k = compute_kpis(sim.con, sim.start_ms, sim.end_ms)
        assert k["workloads"] == len(rows)
        assert set(k["team_delivery"]) <= {
            vc for vc, _, _ in [(p, 0, 0) for p, _, _ in spec.budget[1:]]
        }


def test_cli_generate_and_simulate_with_bad_rows(tmp_path):
    runner = CliRunner()
    r = runner.invoke(
        main,
        ["trace", "generate", "--scenario", "debug", "--days", "1", "--out-dir", str(tmp_path)],
    )
    assert r.exit_code == 0, r.output
    trace = tmp_path / "trace.csv"
    with open(trace, "a") as fh:
        fh.write("bad,abc,dev/cy,1,60,0,true,0,any,high,false\n")
        fh.write("ghost,10,nobody/here,1,60,0,true,0,any,high,false\n")
    n = trace.read_text().count("\n")
    r = runner.invoke(
        main,
        [
            "simulate",
            "--cluster",
            str(tmp_path / "cluster.toml"),
            "--trace",
            str(trace),
            "--policy",
            "priority",
            "--json",
            "-q",
        ],
    )
    assert r.exit_code == 0, r.output
    assert f"{trace}:{n - 1}: not a number of seconds" in r.stderr
    assert f"{trace}:{n}: unknown owner 'nobody/here'" in r.stderr
    assert "2 input rows rejected" in r.stderr
    k = json.loads(r.stdout)
    assert k["rejected"] == 1 and k["workloads"] == n - 2


def test_cli_bad_cluster_is_one_line(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text("[cluster]\nname='x'\n")
    t = tmp_path / "t.csv"
    t.write_text("id,submit,owner,gpus,duration,min_runtime\na,0,x,1,1,0\n")
    r = CliRunner().invoke(main, ["simulate", "--cluster", str(bad), "--trace", str(t)])
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == [
        f"apportion: {bad}: cluster.pool: need at least one [[cluster.pool]] "
        "with prefix, count, gpus_per_node, gpu_type"
    ]
    r = CliRunner().invoke(main, ["simulate", "--trace", str(t)])
    assert r.exit_code == 2 and "Traceback" not in r.output
