"""`GET /v1/report` and `apportion report` against a real gateway on a real
nats-server, and the ISO-8601 `*_at` beside every point-in-time `*_ms` of every
API answer and `--json` output."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import subprocess
from typing import Any

import aiohttp
import pytest
from apportion.schemas.times import DURATIONS, TIME_POINTS, iso_key, iso_utc
from apportion.services.bus import JetStreamLog
from conftest import Credentials
from services_helpers import APPORTION_CMD, cli_env, eventually, gateway_on

HOUR_MS = 3_600_000


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*APPORTION_CMD, *args], capture_output=True, text=True, timeout=60, env=env
    )


async def _get(s: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> tuple[int, Any]:
    async with s.get(url, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def times_without_iso(data: Any, where: str = "") -> list[str]:
    """Every ``*_ms`` key in ``data`` that is neither a known duration nor a point in
    time with its ISO string beside it (with the same instant)."""
    out: list[str] = []
    if isinstance(data, dict):
        for key, value in data.items():
            here = f"{where}.{key}"
            out += times_without_iso(value, here)
            if not isinstance(key, str) or not key.endswith("_ms") or key.endswith("_gpu_ms"):
                continue
            if key in DURATIONS:
                continue
            if key not in TIME_POINTS:
                out.append(f"{here}: not classified (a point in time or a duration?)")
            elif isinstance(value, int | type(None)) and data.get(iso_key(key), "?") != iso_utc(
                value
            ):
                out.append(f"{here}: {iso_key(key)} is {data.get(iso_key(key), 'missing')!r}")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out += times_without_iso(value, f"{where}[{i}]")
    return out


@pytest.mark.nats
async def test_report_over_http_and_the_cli(jlog: JetStreamLog, creds: Credentials) -> None:
    async with gateway_on(jlog, creds.authenticator) as gw, aiohttp.ClientSession() as s:
        url, ops = gw.url, creds.headers("ops")
        for wid, owner, minimum in (("a1", "llm/a", HOUR_MS), ("v1", "vision", 0)):
            spec = {"id": wid, "owner": owner, "gpus": 8, "min_runtime_ms": minimum}
            async with s.post(f"{url}/v1/workloads", json=spec, headers=ops) as r:
                assert r.status == 202, await r.text()
        await eventually(lambda: {"a1", "v1"} <= set(gw.state.running), what="both placed")

        async def used(query: str = "") -> dict[str, Any]:
            status, body = await _get(s, f"{url}/v1/report{query}", ops)
            assert status == 200, body
            return body

        async def ran() -> bool:
            body = await used()
            rows = {r["team"]: r for r in body["rows"]}
            return rows.get("llm", {}).get("allocated_gpu_hours", 0) > 0 and (
                rows.get("vision", {}).get("unallocated_gpu_hours", 0) > 0
            )

        await eventually(ran, what="usage accrued")
        body = await used()
        assert body["by"] == ["team"] and body["hours"] >= 1
        rows = {r["team"]: r for r in body["rows"]}
        assert set(rows) == {"llm", "vision"}
        llm, vision = rows["llm"], rows["vision"]
        assert llm["unallocated_gpu_hours"] == 0 and vision["allocated_gpu_hours"] == 0
        assert llm["gpu_hours"] == llm["allocated_gpu_hours"]
        assert llm["delivered_gpu_hours"] <= llm["owed_gpu_hours"] <= llm["demand_gpu_hours"]
        assert body["since_at"] == iso_utc(body["since_ms"]) and body["since_at"].endswith("Z")
        assert body["total"]["gpu_hours"] == pytest.approx(
            llm["gpu_hours"] + vision["gpu_hours"], rel=0.5
        )  # the two answers were made at slightly different times

        body = await used("?by=user,day&team=llm")
        assert [(r["team"], r["user"]) for r in body["rows"]] == [
            ("llm", "llm/a"),
            ("llm", "llm/b"),
        ]
        assert all(r["date"] == r["day_start_at"][:10] for r in body["rows"])
        body = await used(f"?since=1h&until={iso_utc(gw.now_ms() + 24 * HOUR_MS)}")
        assert body["until_ms"] <= gw.now_ms()  # the future holds no hours
        body = await used("?since=2000-01-01")  # before the history: clipped
        assert body["since_ms"] >= gw.history.usage.kept_from_ms()
        for query, words in (
            ("since=yesterday", "since: 'yesterday' is neither a duration"),
            ("by=week", "by: 'week' is not one of team, user, day"),
            ("by=team,user", "by: team or user, not both"),
            ("since=2026-01-02&until=2026-01-01", "until: must be later than since"),
            ("since=2020-01-01&until=2026-01-01", "since/until: at most 366 days at once"),
            ("team=" + "t" * 300, "team: at most 256 characters"),
            ("colour=red", "unknown parameter 'colour' (known: since, until, by, team)"),
        ):
            status, err = await _get(s, f"{url}/v1/report?{query}", ops)
            assert status == 400 and err["code"] == "bad_query", (query, err)
            assert err["error"].startswith(words), err
        status, _ = await _get(s, f"{url}/v1/report", {})
        assert status == 401
        status, doc = await _get(s, f"{url}/openapi.json", {})
        params = [p["name"] for p in doc["paths"]["/v1/report"]["get"]["parameters"]]
        assert params == ["since", "until", "by", "team"]

        # every answer: an ISO string beside each point in time, none beside a duration
        answers = [
            await _get(s, f"{url}/v1/{path}", ops)
            for path in (
                "queue",
                "jobs?state=all",
                "explain/a1",
                "workloads/a1",
                "nodes",
                "status",
                "share",
                "budget",
                "usage/history",
                "report?by=user,day",
            )
        ]
        for status, answer in answers:
            assert status == 200
            assert times_without_iso(answer) == [], answer
        queue = answers[0][1]
        assert queue["running"][0]["started_at"] == iso_utc(queue["running"][0]["started_ms"])
        assert "min_runtime_at" not in queue["running"][0]

        # the command line
        env = cli_env(url, creds.token_files["ops"])
        out = await asyncio.to_thread(_cli, "report", env=env)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("GPU-hours from ") and lines[0].endswith("by team")
        assert lines[1].split()[:3] == ["TEAM", "GPU-H", "USED"]
        assert [ln.split()[0] for ln in lines[2:4]] == ["llm", "vision"]
        assert lines[-1].startswith("total")
        out = await asyncio.to_thread(_cli, "report", "--by", "day", "--csv", env=env)
        rows = list(csv.DictReader(io.StringIO(out.stdout)))
        assert len(rows) >= 1 and rows[0]["date"] == rows[0]["day_start_at"][:10]
        out = await asyncio.to_thread(_cli, "report", "--by", "user", "--json", env=env)
        data = json.loads(out.stdout)
        assert {r["user"] for r in data["rows"]} == {"llm/a", "llm/b", "vision"}
        assert times_without_iso(data) == []
        for args in (("queue", "--json"), ("jobs", "--all", "--json"), ("nodes", "--json")):
            out = await asyncio.to_thread(_cli, *args, env=env)
            assert out.returncode == 0 and times_without_iso(json.loads(out.stdout)) == []
        for args, words in (
            (("--since", "soon"), "since: 'soon' is neither a duration"),
            (("--by", "week"), "by: 'week' is not one of team, user, day"),
            (("--csv", "--json"), "give --json or --csv, not both"),
        ):
            out = await asyncio.to_thread(_cli, "report", *args, env=env)
            assert out.returncode == 2 and out.stdout == "", out
            assert out.stderr.startswith(f"apportion: {words}") and out.stderr.count("\n") == 1
