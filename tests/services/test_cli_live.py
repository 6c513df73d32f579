"""`apportion up` and the client commands, as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

APPORTION = [sys.executable, "-m", "apportion"]


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(APPORTION + args, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def stack(tmp_path: Path, cluster: str):
    """`apportion up` with a nats-server of its own (the users of production: no
    NATS_URL), the demo cluster, gateway on a free port; yields the env for clients."""
    from apportion.services.stack import DEMO_CLUSTER_TOML

    cluster_file = tmp_path / "cluster.toml"
    cluster_file.write_text(DEMO_CLUSTER_TOML.replace('name = "demo"', f'name = "{cluster}"'))
    env = dict(os.environ)
    env.pop("NATS_URL", None)  # `up` starts nats-server with the users of production
    env.pop("APPORTION_URL", None)
    err = open(tmp_path / "up.err", "w+")  # noqa: SIM115 - read while the process runs
    proc = subprocess.Popen(
        APPORTION
        + ["up", "--data-dir", str(tmp_path / "data"), "--port", "0", "--log-level", "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,
    )
    url = token_file = None
    deadline = time.monotonic() + 60
    while token_file is None and time.monotonic() < deadline and proc.poll() is None:
        err.seek(0)
        printed = err.read()
        m = re.search(r"gateway: (http://\S+)", printed)
        url = m.group(1) if m else None
        m = re.search(r"export APPORTION_TOKEN_FILE=(\S+)", printed)
        token_file = m.group(1) if m else None
        time.sleep(0.05)
    assert url, f"apportion up did not print its gateway URL: {(tmp_path / 'up.err').read_text()}"
    assert token_file == str((tmp_path / "data" / "credentials" / "admin.token").resolve())
    env["APPORTION_URL"] = url
    env["APPORTION_TOKEN_FILE"] = token_file
    try:
        yield env, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
        err.close()


def test_up_submit_queue_explain_budget_and_ctrl_c(stack) -> None:
    env, proc = stack
    deadline = time.monotonic() + 60
    while True:  # the gateway has folded the demo cluster once budget show lists it
        out = run(["budget", "show", "--json"], env)
        if out.returncode == 0 and json.loads(out.stdout)["children"]:
            break
        assert time.monotonic() < deadline, out.stderr
        time.sleep(0.1)
    tree = json.loads(out.stdout)
    assert set(tree) == {"path", "weight", "owner", "global_share", "usage_gpu_h", "children"}
    assert {c["path"] for c in tree["children"]} == {"llm", "vision"}

    ok = run(
        [
            "submit",
            "--owner",
            "llm/pretrain",
            "--gpus",
            "8",
            "--min-runtime",
            "15m",
            "--id",
            "job1",
        ],
        env,
    )
    assert ok.returncode == 0, ok.stderr
    bad = run(["submit", "--owner", "llm", "--gpus", "8", "--min-runtime", "15m"], env)
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "not a leaf" in bad.stderr
    bad = run(["submit", "--owner", "llm/pretrain", "--gpus", "8", "--min-runtime", "soon"], env)
    assert bad.returncode != 0 and "min-runtime" in bad.stderr
    deadline = time.monotonic() + 60
    while True:
        q = json.loads(run(["queue", "--json"], env).stdout)
        if [r["workload"] for r in q["running"]] == ["job1"]:
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ex = run(["explain", "job1"], env)
    assert ex.returncode == 0 and "running" in ex.stdout
    assert run(["share"], env).returncode == 0
    assert run(["explain", "nope"], env).returncode != 0
    # hold / release through the gateway: a running job cannot be held, nor released
    held = run(["hold", "job1"], env)
    assert held.returncode != 0 and held.stderr.count("\n") == 1 and "not pending" in held.stderr
    rel = run(["release", "job1"], env)
    assert rel.returncode != 0 and "not held" in rel.stderr
    assert "unknown workload" in run(["hold", "ghost"], env).stderr
    assert run(["cancel", "job1"], env).returncode == 0

    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(60) == 0


def test_client_commands_without_a_gateway_fail_with_one_line() -> None:
    env = {**os.environ, "APPORTION_URL": "http://127.0.0.1:9"}
    out = run(["queue"], env)
    assert out.returncode != 0
    assert (
        out.stderr.startswith("apportion: cannot reach the gateway") and out.stderr.count("\n") == 1
    )
