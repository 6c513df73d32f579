"""`queue` (START, WAIT to now, --watch), `status` and `--json` against `apportion up`."""

from __future__ import annotations

import json
import signal
import subprocess
import time

from test_cli_live import APPORTION, run, stack  # noqa: F401 - the `stack` fixture


def test_queue_start_column_watch_status_and_json(stack) -> None:  # noqa: F811
    env, _proc = stack
    deadline = time.monotonic() + 60
    while (
        run(["status", "--json"], env).returncode != 0
        or not json.loads(run(["status", "--json"], env).stdout)["nodes"]
    ):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # fill the four H100 nodes with protected work of unknown end, then one more waits
    for i in range(4):
        args = ["submit", "--owner", "llm/pretrain", "--gpus", "8", "--gpu-type", "h100"]
        assert run([*args, "--min-runtime", "1h", "--id", f"big{i}"], env).returncode == 0
    args = ["submit", "--owner", "vision/detection", "--gpus", "8", "--gpu-type", "h100"]
    assert run([*args, "--min-runtime", "15m", "--id", "waits"], env).returncode == 0
    deadline = time.monotonic() + 60
    while True:
        q = json.loads(run(["queue", "--json"], env).stdout)
        if [r["workload"] for r in q["pending"]] == ["waits"] and len(q["running"]) == 4:
            break
        assert time.monotonic() < deadline, q
        time.sleep(0.1)
    first_end = min(r["protected_until_ms"] for r in q["running"])
    assert q["pending"][0]["estimated_start_ms"] == first_end
    text = run(["queue"], env).stdout
    assert "START (UTC, estimated)" in text, text
    assert "(in 59 min)" in text or "(in 1 h)" in text, text
    assert "START: estimated if nothing new arrives" in text
    assert "vision 0% > vision/detection 0%" in text, text  # used of share, not raw ratios
    status = json.loads(run(["status", "--json"], env).stdout)
    assert status["pending"] == 1 and status["running"] == 4
    assert "1 pending, 4 running" in run(["status"], env).stdout
    ex = run(["explain", "waits"], env).stdout
    assert "estimated start: " in ex and "big" in ex and "e+" not in ex
    # --watch: the queue again and again until Ctrl-C
    watch = subprocess.Popen(
        [*APPORTION, "queue", "--watch", "0.3"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2.0)
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=30)
    assert out.count("apportion queue at ") >= 2, (out, err)
    assert "Traceback" not in err
