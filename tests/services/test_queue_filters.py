"""`apportion queue --user/--team/--state` and `GET /v1/queue?user=&team=&state=`
(like squeue -u/-A/-t), the running section's header, and each pending workload's
reason code, against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import subprocess

import aiohttp
import pytest
from apportion.services.bus import JetStreamLog
from conftest import Credentials
from services_helpers import APPORTION_CMD, cli_env, eventually, gateway_on

HOUR_MS = 3_600_000


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*APPORTION_CMD, *args], capture_output=True, text=True, timeout=60, env=env
    )


async def _get(s: aiohttp.ClientSession, url: str, headers: dict[str, str]):
    async with s.get(url, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def _ids(rows: list[dict]) -> list[str]:
    return [r["workload"] for r in rows]


@pytest.mark.nats
async def test_queue_filters_over_http_and_the_cli(jlog: JetStreamLog, creds: Credentials) -> None:
    async with gateway_on(jlog, creds.authenticator) as gw, aiohttp.ClientSession() as s:
        url = gw.url
        # two 8-GPU nodes: a1 (alice, llm/a) and v1 (vic, vision) run; three wait
        for wid, owner, who in (
            ("a1", "llm/a", "alice"),
            ("v1", "vision", "vic"),
            ("a2", "llm/a", "alice"),
            ("b1", "llm/b", "b"),
            ("v2", "vision", "vic"),
        ):
            spec = {"id": wid, "owner": owner, "gpus": 8, "min_runtime_ms": HOUR_MS}
            async with s.post(f"{url}/v1/workloads", json=spec, headers=creds.headers(who)) as r:
                assert r.status == 202, await r.text()
            if wid == "v1":
                await eventually(
                    lambda: {"a1", "v1"} <= set(gw.state.running), what="a1 and v1 placed"
                )
        await eventually(lambda: len(gw.state.pending) == 3, what="three waiting")
        ops = creds.headers("ops")

        status, whole = await _get(s, f"{url}/v1/queue", ops)
        assert status == 200 and whole["filter"] == {
            "user": None,
            "team": None,
            "state": None,
            "gpu_type": None,
        }
        assert whole["totals"] == {"pending": 3, "running": 2}
        position = {r["workload"]: r["position"] for r in whole["pending"]}
        assert sorted(position.values()) == [1, 2, 3]
        # reason codes for scripts: the first holds the reservation, the others are behind it
        assert [r["reason"] for r in whole["pending"]] == [
            "holds_reservation",
            "outranked",
            "outranked",
        ], whole["pending"]
        assert all(r["reason_text"] for r in whole["pending"])
        first = whole["pending"][0]["workload"]
        status, body = await _get(s, f"{url}/v1/explain/{first}", ops)
        assert status == 200 and body["reason"] == "holds_reservation", body

        status, body = await _get(s, f"{url}/v1/queue?user=alice", ops)
        assert status == 200 and _ids(body["pending"]) == ["a2"] and _ids(body["running"]) == ["a1"]
        assert body["pending"][0]["position"] == position["a2"]  # its place in the whole queue
        assert body["totals"] == {"pending": 3, "running": 2}
        status, body = await _get(s, f"{url}/v1/queue?team=llm", ops)
        assert sorted(_ids(body["pending"])) == ["a2", "b1"] and _ids(body["running"]) == ["a1"]
        status, body = await _get(s, f"{url}/v1/queue?team=/llm/b/", ops)
        assert _ids(body["pending"]) == ["b1"] and body["filter"]["team"] == "llm/b"
        status, body = await _get(s, f"{url}/v1/queue?team=ll", ops)  # whole segments only
        assert body["pending"] == [] and body["running"] == []
        status, body = await _get(s, f"{url}/v1/queue?state=running", ops)
        assert body["pending"] == [] and sorted(_ids(body["running"])) == ["a1", "v1"]
        status, body = await _get(s, f"{url}/v1/queue?state=pending&user=vic", ops)
        assert _ids(body["pending"]) == ["v2"] and body["running"] == []
        status, body = await _get(s, f"{url}/v1/queue?user=mallory", ops)
        assert status == 200 and body["pending"] == [] and body["running"] == []
        for query, words in (
            ("state=done", "state: 'done' is not one of pending, running"),
            ("user=" + "u" * 200, "user: at most 128 characters"),
            ("team=" + "t" * 300, "team: at most 256 characters"),
            ("colour=red", "unknown parameter 'colour' (known: user, team, state, gpu_type)"),
        ):
            status, body = await _get(s, f"{url}/v1/queue?{query}", ops)
            assert status == 400 and body["code"] == "bad_query", (query, body)
            assert body["error"] == words, body
        status, doc = await _get(s, f"{url}/openapi.json", {})
        names = [p["name"] for p in doc["paths"]["/v1/queue"]["get"]["parameters"]]
        assert names == ["user", "team", "state", "gpu_type"]

        # the command line
        env = cli_env(url, creds.token_files["alice"])
        out = await asyncio.to_thread(_cli, "queue", env=env)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == "pending: 3" and lines[1].split()[:3] == ["POS", "WORKLOAD", "OWNER"]
        assert "REASON" in lines[1] and " holds_reservation " in lines[2], lines[2]
        run_at = lines.index("running: 2")
        assert lines[run_at + 1].split() == [
            "WORKLOAD",
            "OWNER",
            "GPUS",
            "RAN",
            "ENDS",
            "(UTC,",
            "estimated)",
            "NODES",
        ]
        # the running rows line up under the header, as the pending ones do
        header = lines[run_at + 1]
        for row in lines[run_at + 2 :]:
            assert row.index(row.split()[0]) == header.index("WORKLOAD"), (header, row)
            assert row.split()[-1].startswith("h00") and ":8" in row.split()[-1]
        out = await asyncio.to_thread(_cli, "queue", "--user", "alice", env=env)
        lines = out.stdout.splitlines()
        assert lines[0] == "pending: 1 of 3" and lines[2].split()[1] == "a2"
        assert "running: 1 of 2" in lines and lines[-1].split()[0] == "a1"
        out = await asyncio.to_thread(_cli, "queue", "--state", "running", env=env)
        lines = out.stdout.splitlines()
        assert lines[0] == "running: 2"
        assert not any(line.startswith("pending") for line in lines)
        out = await asyncio.to_thread(
            _cli, "queue", "--team", "llm", "--state", "pending", "--json", env=env
        )
        data = json.loads(out.stdout)
        assert sorted(_ids(data["pending"])) == ["a2", "b1"] and data["running"] == []
        out = await asyncio.to_thread(_cli, "queue", "--state", "done", env=env)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr == "apportion: state: 'done' is not one of pending, running\n"


@pytest.mark.nats
async def test_gpu_type_filter_on_queue_and_jobs(jlog: JetStreamLog, creds: Credentials) -> None:
    """`--gpu-type` / `?gpu_type=` keeps the work that asked for that type (`any`: the
    work that takes any type); a type the cluster does not have is a 400 listing the
    ones it has, and one line with exit status 2 on the command line."""
    async with gateway_on(jlog, creds.authenticator) as gw, aiohttp.ClientSession() as s:
        url, ops = gw.url, creds.headers("ops")
        for wid, kind in (("typed", "h100"), ("anyone", "any")):
            spec = {"id": wid, "owner": "llm/a", "gpus": 8, "min_runtime_ms": HOUR_MS}
            async with s.post(
                f"{url}/v1/workloads", json={**spec, "gpu_type": kind}, headers=ops
            ) as r:
                assert r.status == 202, await r.text()
        await eventually(lambda: {"typed", "anyone"} <= set(gw.state.workloads), what="folded")
        status, body = await _get(s, f"{url}/v1/queue?gpu_type=h100", ops)
        assert status == 200 and body["filter"]["gpu_type"] == "h100"
        assert _ids(body["pending"] + body["running"]) == ["typed"]
        status, body = await _get(s, f"{url}/v1/queue?gpu_type=any", ops)
        assert _ids(body["pending"] + body["running"]) == ["anyone"]
        status, body = await _get(s, f"{url}/v1/jobs?state=all&gpu_type=h100", ops)
        assert status == 200 and _ids(body["jobs"]) == ["typed"], body
        for route in ("queue", "jobs"):
            status, body = await _get(s, f"{url}/v1/{route}?gpu_type=a100", ops)
            assert status == 400 and body["code"] == "bad_query", body
            assert body["error"] == (
                "gpu_type: 'a100' is not a GPU type of this cluster (known: h100; or any)"
            )
        status, doc = await _get(s, f"{url}/openapi.json", {})
        jobs_params = [p["name"] for p in doc["paths"]["/v1/jobs"]["get"]["parameters"]]
        assert "gpu_type" in jobs_params

        env = cli_env(url, creds.token_files["ops"])
        out = await asyncio.to_thread(_cli, "queue", "--gpu-type", "h100", "--json", env=env)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert _ids(data["pending"] + data["running"]) == ["typed"]
        out = await asyncio.to_thread(_cli, "jobs", "--all", "--gpu-type", "any", "--json", env=env)
        assert out.returncode == 0 and _ids(json.loads(out.stdout)["jobs"]) == ["anyone"]
        for command in ("queue", "jobs"):
            out = await asyncio.to_thread(_cli, command, "--gpu-type", "tpu", env=env)
            assert out.returncode == 2 and out.stdout == "", out
            assert out.stderr == (
                "apportion: gpu_type: 'tpu' is not a GPU type of this cluster (known: h100; or any)\n"
            )
