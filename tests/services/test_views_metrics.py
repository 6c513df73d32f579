"""Start-time estimates through the API, and the gateway's Prometheus metrics (real nats-server)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from apportion.core import State
from apportion.replay.eventlog import Header, write_log
from apportion.replay.run import load_inputs, run_policy
from apportion.services.canonical import read_history
from apportion.services.metrics import GatewayMetrics, rejection_class
from services_helpers import APPORTION_CMD, Roles, eventually, gateway_on, submit

if TYPE_CHECKING:
    from conftest import Credentials

HOUR = 3_600_000


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in Prometheus text format (labels in any order)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


async def test_estimates_through_the_api(roles: Roles, creds: Credentials, tmp_path: Path) -> None:
    async with gateway_on(roles, creds.authenticator) as gw:
        await roles.op.publish_input(submit("p", owner="llm/a", gpus=16, min_runtime_ms=HOUR))
        await eventually(lambda: gw.history.placed.get("p") is not None, what="p placed")
        await roles.op.publish_input(submit("q", owner="vision", gpus=8, min_runtime_ms=60_000))
        await roles.op.publish_input(submit("u", owner="llm/b", gpus=1, min_runtime_ms=0))
        await eventually(
            lambda: set(gw.state.pending) == {"q", "u"} and gw.history.basis == gw.state.input_seq,
            what="q and u pending after a cycle",
        )
        protected_until = gw.state.running["p"].protected_until_ms
        auth = creds.headers("ops")
        status, body, _ = await asyncio.to_thread(get, gw.url + "/v1/queue", auth)
        q = json.loads(body)
        assert status == 200
        rows = {r["workload"]: r for r in q["pending"]}
        # q (vision, under-served) may preempt p once p's protection ends
        assert rows["q"]["estimated_start_ms"] == protected_until
        # unallocated u takes what q leaves of p's 16 GPUs then
        assert rows["u"]["estimated_start_ms"] == protected_until
        assert "if nothing new arrives" in q["estimate_assumption"]
        assert (
            q["now_ms"] >= q["at_ms"] and rows["q"]["wait_ms"] <= q["now_ms"] - q["at_ms"] + 60_000
        )
        assert rows["q"]["ratios"][0]["share_pct"] is not None
        status, body, _ = await asyncio.to_thread(get, gw.url + "/v1/workloads/q", auth)
        assert json.loads(body)["estimated_start_ms"] == protected_until
        status, body, _ = await asyncio.to_thread(get, gw.url + "/v1/explain/q", auth)
        ex = json.loads(body)
        assert ex["estimated_start_ms"] == protected_until
        line = next(r for r in ex["reasons"] if r.startswith("estimated start: "))
        assert "(in 59 min)" in line or "(in 1 h)" in line, line
        assert not any("e+" in r for r in ex["reasons"])
        # offline: the same answer from the history as a log file (explain --log FILE --at NOW)
        log_file = tmp_path / "history.jsonl"
        write_log(log_file, Header(source="test"), await read_history(roles.sched, 10.0))
        args = ["explain", "q", "--log", str(log_file), "--at", str(ex["now_ms"]), "--json"]
        out = await asyncio.to_thread(
            subprocess.run, [*APPORTION_CMD, *args], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == ex


async def test_metrics_endpoint(roles: Roles, creds: Credentials) -> None:
    async with gateway_on(roles, creds.authenticator) as gw:
        await roles.op.publish_input(submit("p", owner="llm/a", gpus=16, min_runtime_ms=HOUR))
        await roles.op.publish_input(submit("q", owner="vision", gpus=8, min_runtime_ms=60_000))
        await roles.op.publish_input(submit("x", owner="no/such", gpus=1))  # rejected: invalid
        await roles.op.publish_raw_input(b"not an event", "junk-1", kind="WorkloadSubmitted")
        last = await roles.sched.last_input_seq()
        await eventually(
            lambda: gw.state.input_seq >= last and gw.history.basis == last, what="caught up"
        )
        await asyncio.to_thread(get, gw.url + "/v1/queue", creds.headers("ops"))
        status, body, headers = await asyncio.to_thread(get, gw.url + "/metrics")  # no token
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        text = body.decode()
        assert sample(text, "apportion_queue_pending_workloads", contract="allocated") == 1
        assert sample(text, "apportion_queue_pending_workloads", contract="unallocated") == 0
        assert sample(text, "apportion_running_workloads", contract="allocated") == 1
        assert sample(text, "apportion_gpus_in_use", contract="allocated") == 16
        assert sample(text, "apportion_gpus", health="healthy") == 16
        assert sample(text, "apportion_decisions_total", kind="WorkloadPlaced") == 1
        rejected = "apportion_rejections_total"
        assert sample(text, rejected, source="scheduler", reason_class="invalid") == 1
        assert sample(text, rejected, source="scheduler", reason_class="malformed") == 1
        assert sample(text, rejected, source="gateway", reason_class="invalid") == 0
        assert sample(text, "apportion_input_lag") == 0
        assert sample(text, "apportion_inputs_stored") == last
        assert sample(text, "apportion_team_usage_of_share_ratio", team="llm") is not None
        assert (
            sample(
                text,
                "apportion_gateway_request_seconds_count",
                route="/v1/queue",
                method="GET",
                status="200",
            )
            == 1
        )
        # an unknown workload id does not become a label value
        await asyncio.to_thread(get, gw.url + "/v1/explain/nope-1", creds.headers("ops"))
        _, body, _ = await asyncio.to_thread(get, gw.url + "/metrics")
        assert "nope-1" not in body.decode()
        assert 'route="/v1/explain/{id}"' in body.decode()
        assert (
            "/metrics"
            in json.loads((await asyncio.to_thread(get, gw.url + "/openapi.json"))[1])["paths"]
        )


def test_rejection_classes() -> None:
    assert rejection_class("malformed input: bad JSON") == "malformed"
    assert (
        rejection_class("cancel: workload 'w' already ended as succeeded (stale report)") == "stale"
    )
    assert rejection_class("node 'n' is already healthy (no change)") == "stale"
    assert rejection_class("mallory may not submit to 'llm/a': only its owner") == "authority"
    assert rejection_class("budget 'x': 'b' does not own 'llm' or an ancestor") == "authority"
    assert rejection_class("workload 'w' already exists; ids are never reused") == "duplicate"
    assert rejection_class("unknown owner 'x': submit to a leaf of the budget tree") == "invalid"


def test_rejection_classes_from_codes_agree_with_the_words() -> None:
    """A decision with a code is classed by its code; on every rejection of the
    handmade golden log that gives the class its words gave."""
    golden = Path(__file__).resolve().parents[1] / "golden" / "handmade.jsonl"
    seen = set()
    for line in golden.read_text().splitlines():
        for d in json.loads(line).get("batch", {}).get("decisions", []):
            if d["kind"] == "InputRejected":
                cls = rejection_class(d["reason"], d["code"])
                assert cls == rejection_class(d["reason"]), d
                seen.add(cls)
    assert {"malformed", "authority", "invalid", "stale"} <= seen
    assert rejection_class("x", "duplicate_id") == "duplicate"
    assert rejection_class("x", "wrong_node") == "invalid"


def _simulated_gateway_metrics() -> tuple[GatewayMetrics, State]:
    """The gateway's metrics set from the state a one-day ``debug`` simulation ends in."""
    inp = load_inputs(None, None, None, seed=1, days=1, scenario="debug")
    result, _ = run_policy(inp, "budget")
    metrics = GatewayMetrics()
    metrics.update(result.state, result.state.input_seq, now_ms=result.state.now_ms)
    return metrics, result.state


def test_team_usage_is_in_gpu_seconds() -> None:
    """``apportion_team_usage_gpu_seconds`` (base unit seconds; was ``_gpu_hours``):
    the state's GPU-ms charged in the window, / 1000."""
    metrics, state = _simulated_gateway_metrics()
    text = metrics.render().decode()
    assert "apportion_team_usage_gpu_hours" not in text
    teams = {"dev": state.usage("dev"), "train": state.usage("train")}
    assert all(ms > 0 for ms in teams.values()), teams
    for team, gpu_ms in teams.items():
        assert sample(text, "apportion_team_usage_gpu_seconds", team=team) == gpu_ms / 1000


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (Debian: prometheus)")
def test_gateway_metrics_pass_promtool() -> None:
    metrics, _ = _simulated_gateway_metrics()
    p = subprocess.run(
        ["promtool", "check", "metrics"],
        input=metrics.render(),
        capture_output=True,
        timeout=60,
    )
    assert p.returncode == 0 and not p.stdout and not p.stderr, (p.stdout + p.stderr).decode()
