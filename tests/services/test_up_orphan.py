"""`apportion up` killed with SIGKILL leaves its nats-server running; the next `up` on the
same data dir stops that orphan (found through `<data-dir>/nats/nats-server.pid`)
before starting its own, and resumes from the same store."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from services_helpers import APPORTION_CMD, processes_with_arg


def start_up(data_dir: Path, err_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`apportion up` with its own nats-server; returns the process and its gateway URL."""
    err = open(err_path, "w+")  # noqa: SIM115 - read while the process runs
    proc = subprocess.Popen(
        [*APPORTION_CMD, "up", "--data-dir", str(data_dir), "--port", "0"]
        + ["--log-level", "warning", "--no-executor"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    url = None
    while url is None and proc.poll() is None and time.monotonic() < deadline:
        err.seek(0)
        m = re.search(r"gateway: (http://\S+)", err.read())
        url = m.group(1) if m else None
        time.sleep(0.05)
    err.close()
    assert url, f"apportion up did not start: {err_path.read_text()}"
    while True:  # the gateway has folded the demo cluster once the budget lists it
        out = cli(["budget", "show", "--json"], env, url)
        if out.returncode == 0 and json.loads(out.stdout)["children"]:
            return proc, url
        assert time.monotonic() < deadline, out.stderr
        time.sleep(0.1)


def cli(args: list[str], env: dict[str, str], url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*APPORTION_CMD, *args],
        env={**env, "APPORTION_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )


def wait_running(env: dict[str, str], url: str, workload: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        out = cli(["queue", "--json"], env, url)
        if out.returncode == 0 and workload in [
            r["workload"] for r in json.loads(out.stdout)["running"]
        ]:
            return
        assert time.monotonic() < deadline, f"{workload} never ran: {out.stdout} {out.stderr}"
        time.sleep(0.1)


def test_up_after_a_sigkilled_up_stops_the_orphaned_nats_server(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = str(data.resolve() / "nats" / "jetstream")
    pid_file = data / "nats" / "nats-server.pid"
    env = {**os.environ}
    env.pop("NATS_URL", None)  # `up` starts its own server
    env.pop("APPORTION_URL", None)
    env["APPORTION_TOKEN_FILE"] = str(data / "credentials" / "admin.token")  # made by `up`
    procs: list[subprocess.Popen] = []
    try:
        first, url = start_up(data, tmp_path / "up1.err", env)
        procs.append(first)
        orphan = int(pid_file.read_text())
        assert processes_with_arg(store) == [orphan]
        submitted = cli(
            ["submit", "--owner", "llm/pretrain", "--gpus", "8", "--min-runtime", "15m"]
            + ["--id", "job1"],
            env,
            url,
        )
        assert submitted.returncode == 0, submitted.stderr
        wait_running(env, url, "job1")

        first.send_signal(signal.SIGKILL)  # no cleanup: its nats-server lives on
        assert first.wait(30) == -signal.SIGKILL
        assert processes_with_arg(store) == [orphan]

        second, url = start_up(data, tmp_path / "up2.err", env)
        procs.append(second)
        server = int(pid_file.read_text())
        assert server != orphan
        assert processes_with_arg(store) == [server]  # the orphan is gone, exactly one server
        wait_running(env, url, "job1")  # same store: the history resumed

        os.killpg(second.pid, signal.SIGINT)
        assert second.wait(60) == 0
        assert processes_with_arg(store) == []
        assert not pid_file.exists()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for pid in processes_with_arg(store):  # only servers this test's `up`s started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
