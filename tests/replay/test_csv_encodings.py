"""Input files as people have them: a byte-order mark, another encoding, a file that
is not there. Each is read, or refused with one line naming the right file (and the
line and byte), through the real ``apportion`` command."""

from __future__ import annotations

import codecs
import json

import pytest
from apportion.replay.errors import InputFileError
from apportion.replay.trace import read_health, read_trace
from click.testing import CliRunner

from apportion.cli import main

CLUSTER = """\
[cluster]
name = "t"
[[cluster.pool]]
prefix = "g"
count = 2
gpus_per_node = 8
gpu_type = "h100"
[budget]
owner = "ops"
[budget.a]
weight = 1
owner = "al"
[budget.b]
weight = 1
owner = "bo"
"""
TRACE = "id,submit,owner,gpus,duration,min_runtime\r\nj1,0,a,8,3600,600\r\nj2,60,b,8,1800,0\r\n"


def _simulate(tmp_path, trace_bytes: bytes, cluster_bytes: bytes = CLUSTER.encode()):
    cluster = tmp_path / "cluster.toml"
    cluster.write_bytes(cluster_bytes)
    trace = tmp_path / "trace.csv"
    trace.write_bytes(trace_bytes)
    r = CliRunner().invoke(
        main,
        ["simulate", "--cluster", str(cluster), "--trace", str(trace), "--days", "1", "--json"],
    )
    return r, trace


def test_utf8_bom_trace_runs_like_the_plain_file(tmp_path):
    plain, _ = _simulate(tmp_path, TRACE.encode())
    bom, _ = _simulate(tmp_path, codecs.BOM_UTF8 + TRACE.encode())
    assert plain.exit_code == 0, plain.output
    assert bom.exit_code == 0, bom.stderr
    # no warning (the progress lines a run without a terminal prints are not warnings)
    assert [x for x in bom.stderr.splitlines() if not x.startswith("simulating ")] == []
    assert json.loads(bom.stdout)["workloads"] == 2
    assert json.loads(bom.stdout) | {"wall_s": 0} == json.loads(plain.stdout) | {"wall_s": 0}


def test_bom_cluster_toml_and_bom_health_csv_are_read(tmp_path):
    r, _ = _simulate(tmp_path, TRACE.encode(), codecs.BOM_UTF8 + CLUSTER.encode())
    assert r.exit_code == 0, r.stderr
    health = tmp_path / "health.csv"
    health.write_bytes(codecs.BOM_UTF8 + b"at,node,state\n60,g000,draining\n")
    rows, errors = read_health(health)
    assert errors == []
    assert [(h.at_ms, h.node, h.state) for h in rows] == [(60_000, "g000", "draining")]


def test_utf16_with_bom_is_read(tmp_path):
    p = tmp_path / "t.csv"
    p.write_bytes(TRACE.encode("utf-16"))  # Python writes the BOM
    rows, errors = read_trace(p)
    assert errors == []
    assert [r.id for r in rows] == ["j1", "j2"]


def test_latin1_trace_is_one_line_naming_file_line_and_byte(tmp_path):
    text = TRACE + "caf\u00e9,120,a,1,60,0\r\n"
    r, trace = _simulate(tmp_path, text.encode("latin-1"))
    assert r.exit_code == 2
    assert "Traceback" not in r.output
    assert r.stderr.splitlines() == [
        f"apportion: {trace}:4: not UTF-8 text: byte 0xe9 at byte 4 of the line "
        f"(byte {len(TRACE.encode()) + 3} of the file); "
        "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    ]


def test_latin1_in_the_header_and_in_a_cluster_file(tmp_path):
    p = tmp_path / "h.csv"
    p.write_bytes("at,n\u0153ud,state\n".encode("cp1252"))
    with pytest.raises(InputFileError) as exc:
        read_health(p)
    assert (exc.value.file, exc.value.where) == (str(p), 1)
    assert "byte 0x9c" in exc.value.reason
    cluster = CLUSTER.replace('owner = "bo"', 'owner = "b\u00f8"').encode("latin-1")
    r, _ = _simulate(tmp_path, TRACE.encode(), cluster)
    assert r.exit_code == 2
    assert r.stderr.startswith(
        f"apportion: {tmp_path / 'cluster.toml'}:15: not UTF-8 text: byte 0xf8"
    )
    assert len(r.stderr.splitlines()) == 1


def test_empty_trace_and_missing_health_name_their_file(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_bytes(codecs.BOM_UTF8)
    with pytest.raises(InputFileError, match="empty file") as exc:
        read_trace(empty)
    assert exc.value.file == str(empty)
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(CLUSTER)
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    missing = tmp_path / "nope" / "health.csv"
    r = CliRunner().invoke(
        main,
        ["simulate", "--cluster", str(cluster), "--trace", str(trace), "--health", str(missing)],
    )
    assert r.exit_code == 2
    assert r.stderr == f"apportion: {missing}: cannot read: No such file or directory\n"


def test_philly_import_names_the_missing_job_file_not_the_vc_file(tmp_path):
    nope = tmp_path / "nope.csv"
    r = CliRunner().invoke(
        main, ["trace", "import", "--format", "philly", str(nope), "--out-dir", str(tmp_path)]
    )
    assert r.exit_code == 2
    assert r.stderr == f"apportion: {nope}: cannot read: No such file or directory\n"


def test_philly_import_names_a_missing_vc_file(philly_dir, tmp_path):
    jobs = tmp_path / "jobs.csv"
    jobs.write_bytes((philly_dir / "philly_pollux_jobs.csv").read_bytes())
    r = CliRunner().invoke(
        main, ["trace", "import", "--format", "philly", str(jobs), "--out-dir", str(tmp_path)]
    )
    assert r.exit_code == 2
    vc = tmp_path / "philly_vc_nodes_helios.csv"
    assert r.stderr.startswith(f"apportion: {vc}: cannot read: No such file or directory")
    assert "--vc-file" in r.stderr and len(r.stderr.splitlines()) == 1


def test_philly_import_reads_bom_files_like_plain_ones(philly_dir, tmp_path):
    def run(out, bom: bytes):
        src = tmp_path / f"src-{out}"
        src.mkdir()
        for name in ("philly_pollux_jobs.csv", "philly_vc_nodes_helios.csv"):
            (src / name).write_bytes(bom + (philly_dir / name).read_bytes())
        r = CliRunner().invoke(
            main,
            [
                "trace",
                "import",
                "--format",
                "philly",
                str(src / "philly_pollux_jobs.csv"),
                "--out-dir",
                str(tmp_path / out),
            ],
        )
        assert r.exit_code == 0, r.output
        return (tmp_path / out / "trace.csv").read_text()

    plain = run("plain", b"")
    assert plain.count("\n") > 300
    assert run("bom", codecs.BOM_UTF8) == plain


def test_philly_import_latin1_row_is_one_line(philly_dir, tmp_path):
    jobs = tmp_path / "philly_pollux_jobs.csv"
    jobs.write_bytes((philly_dir / "philly_pollux_jobs.csv").read_bytes() + b"caf\xe9\n")
    (tmp_path / "philly_vc_nodes_helios.csv").write_bytes(
        (philly_dir / "philly_vc_nodes_helios.csv").read_bytes()
    )
    r = CliRunner().invoke(
        main, ["trace", "import", "--format", "philly", str(jobs), "--out-dir", str(tmp_path)]
    )
    assert r.exit_code == 2
    n = (philly_dir / "philly_pollux_jobs.csv").read_bytes().count(b"\n") + 1
    assert r.stderr.startswith(f"apportion: {jobs}:{n}: not UTF-8 text: byte 0xe9")
    assert len(r.stderr.splitlines()) == 1
