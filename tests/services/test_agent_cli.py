"""`apportion up --agents N` and `apportion submit ... -- COMMAND` / `--file`, as a user
runs them (subprocesses against the test nats-server)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_cli_live import APPORTION, run

pytestmark = pytest.mark.nats


def _wait(check, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def up_agents(tmp_path: Path, cluster: str):
    """`apportion up --agents 2` (demo cluster under a fresh name): (env, process, data dir)."""
    from apportion.services.stack import DEMO_CLUSTER_TOML

    cluster_file = tmp_path / "cluster.toml"
    cluster_file.write_text(DEMO_CLUSTER_TOML.replace('name = "demo"', f'name = "{cluster}"'))
    env = dict(os.environ)
    env.pop("NATS_URL", None)  # `up` starts nats-server with the users of production
    env.pop("APPORTION_URL", None)
    data = tmp_path / "data"
    err = open(tmp_path / "up.err", "w+")  # noqa: SIM115 - read while the process runs
    proc = subprocess.Popen(
        [
            *APPORTION,
            "up",
            "--cluster",
            str(cluster_file),
            "--data-dir",
            str(data),
            "--port",
            "0",
            "--agents",
            "2",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,
    )

    def printed() -> str | None:
        err.seek(0)
        text = err.read()
        assert proc.poll() is None, text
        return text if "Ctrl-C stops everything" in text else None

    text = _wait(printed, "apportion up to start")
    env["APPORTION_URL"] = re.search(r"gateway: (http://\S+)", text).group(1)  # type: ignore[union-attr]
    env["APPORTION_TOKEN_FILE"] = re.search(r"APPORTION_TOKEN_FILE=(\S+)", text).group(1)  # type: ignore[union-attr]
    assert "agents: h100-000, h100-001" in text or "agents: 2" in text, text
    try:
        yield env, proc, data / "agents" / cluster
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
        err.close()


def test_up_with_agents_runs_submitted_commands(up_agents, tmp_path: Path) -> None:
    env, proc, root = up_agents
    _wait(
        lambda: run(["status", "--json"], env).returncode == 0,
        "the gateway to answer",
    )
    job = tmp_path / "job.toml"
    job.write_text(
        'owner = "llm/pretrain"\ngpus = 2\nmin_runtime = 0\ngrace = "5s"\n'
        'command = "python3 -c \'import os; print(os.environ[\\"GREETING\\"], '
        'os.environ[\\"CUDA_VISIBLE_DEVICES\\"], os.environ[\\"APPORTION_GRACE_S\\"])\'"\n'
        '[env]\nGREETING = "from-file"\n'
    )
    out = run(["submit", "--file", str(job), "--id", "filejob"], env)
    assert out.returncode == 0, out.stderr
    out = run(
        [
            "submit",
            "--owner",
            "llm/finetune",
            "--gpus",
            "1",
            "--min-runtime",
            "0",
            "--env",
            "GREETING=from-cli",
            "--id",
            "clijob",
            "--",
            "python3",
            "-c",
            "import os, sys; print(os.environ['GREETING']); sys.exit(4)",
        ],
        env,
    )
    assert out.returncode == 0, out.stderr
    bad = [*args_of("badenv"), "--env", "1BAD=x", "--", "true"]
    out = run(bad, env)
    assert out.returncode == 2 and "an environment name" in out.stderr, out.stderr
    out = run([*args_of("toolong"), "--", "x" * 5000], env)
    assert out.returncode == 2 and "length <= 4096" in out.stderr, out.stderr

    def status(w: str) -> str:
        got = run(["explain", w, "--json"], env)
        return json.loads(got.stdout)["status"] if got.returncode == 0 else ""

    _wait(lambda: status("filejob") == "succeeded", "filejob to succeed")
    _wait(lambda: status("clijob") == "failed", "clijob to fail (exit 4)")
    logs = {p.parent.parent.name: p.read_text() for p in root.glob("*/*/attempt-1/output.log")}
    assert "from-file 0,1 5" in logs["filejob"], logs
    assert "from-cli" in logs["clijob"], logs
    # nodes without an agent are down, so nothing waits on them
    q = run(["status", "--json"], env)
    assert q.returncode == 0

    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(60) == 0


def args_of(workload: str) -> list[str]:
    return [
        "submit",
        "--owner",
        "llm/finetune",
        "--gpus",
        "1",
        "--min-runtime",
        "0",
        "--id",
        workload,
    ]


def test_submit_refuses_bad_jobs_with_one_line(tmp_path: Path) -> None:
    """Mistakes in a job file or --env end with one line, before any request."""
    env = {**os.environ, "APPORTION_URL": "http://127.0.0.1:9"}
    bad = tmp_path / "bad.toml"
    for text, words in (
        ("owner = 3\n", "owner: expected a string"),
        ('nope = "x"\n', "unknown field 'nope'"),
        ("command = [1, 2]\n", "command: a list of strings"),
        ("owner = [\n", "TOML syntax"),
    ):
        bad.write_text(text)
        out = run(["submit", "--file", str(bad)], env)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert words in out.stderr, out.stderr
    out = run(["submit", "--owner", "a/b", "--gpus", "1", "--min-runtime", "0", "--env", "X"], env)
    assert out.returncode == 2 and "--env 'X': give NAME=VALUE" in out.stderr
    out = run(["submit", "--gpus", "1"], env)
    assert out.returncode == 2 and "missing --owner, --min-runtime" in out.stderr
