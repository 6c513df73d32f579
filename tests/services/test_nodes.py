"""`apportion nodes`, `apportion node drain|undrain|down` and their routes, `GET
/v1/nodes` and `POST /v1/nodes/{node}/health`, against a real nats-server: who may
change a node's health is the fold's rule, so the history (and any replay of it)
refuses the same changes the gateway refuses."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import aiohttp
import pytest
from apportion.schemas.codec import decode_input, encode
from apportion.schemas.events import InputRejected, NodeHealthChanged
from apportion.services.bus import JetStreamLog
from conftest import Credentials
from services_helpers import APPORTION_CMD, Roles, eventually, gateway_on


def test_a_health_change_without_a_reason_encodes_as_before() -> None:
    """``reason`` was added at the end with no default value written: old logs re-encode
    byte for byte, and a reason survives a round trip."""
    old = b'{"kind":"NodeHealthChanged","id":"h","at_ms":1,"v":1,"node":"n1","state":"draining","actor":"ops"}'
    assert encode(decode_input(old)) == old
    with_reason = NodeHealthChanged(
        id="h", at_ms=1, node="n1", state="down", actor="ops", reason="ECC errors"
    )
    assert decode_input(encode(with_reason)) == with_reason
    assert b'"reason":"ECC errors"' in encode(with_reason)


async def _http(
    s: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str] | None = None, **kw
):
    async with s.request(method, url, headers=headers or {}, **kw) as r:
        return r.status, await r.json(content_type=None)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*APPORTION_CMD, *args], capture_output=True, text=True, timeout=60, env=env
    )


async def _rejected(log: JetStreamLog, ref: str) -> InputRejected | None:
    tail = log.tail_batches(1)
    try:
        while True:
            batches = await tail.take(1000, 0.2)
            if not batches:
                return None
            for b in batches:
                for d in b.batch.decisions:
                    if isinstance(d, InputRejected) and d.ref == ref:
                        return d
    finally:
        await tail.close()


@pytest.mark.nats
async def test_nodes_list_and_health_changes_over_http_and_the_cli(
    roles: Roles, creds: Credentials
) -> None:
    async with (
        gateway_on(roles, creds.authenticator) as gw,
        aiohttp.ClientSession() as s,
    ):
        url = gw.url
        ops, alice, mallory = creds.headers("ops"), creds.headers("alice"), creds.headers("mallory")
        spec = {"owner": "llm/a", "gpus": 8, "min_runtime_ms": 3_600_000, "id": "big"}
        status, body = await _http(s, "POST", f"{url}/v1/workloads", alice, json=spec)
        assert status == 202, body
        await eventually(lambda: "big" in gw.state.running, what="big placed")
        busy = gw.state.running["big"].placement[0].node
        idle = next(n for n in ("h000", "h001") if n != busy)

        # the list: every node by name, anyone with a token may read it
        status, body = await _http(s, "GET", f"{url}/v1/nodes", alice)
        assert status == 200, body
        assert [r["node"] for r in body["nodes"]] == ["h000", "h001"]
        row = {r["node"]: r for r in body["nodes"]}
        assert (row[busy]["gpus"], row[busy]["free"], row[busy]["workloads"]) == (8, 0, ["big"])
        assert row[busy]["protected_until_ms"] == gw.state.running["big"].protected_until_ms
        assert (row[idle]["free"], row[idle]["workloads"], row[idle]["state"]) == (8, [], "healthy")
        assert row[idle]["last_change"] is None and row[idle]["drained"] is False
        assert row[idle]["gpu_type"] == "h100" and row[idle]["protected_until_ms"] is None

        # who may: an operator (here the root's owner, ops); not a team's owner, not anyone
        health = f"{url}/v1/nodes/{idle}/health"
        for who in (mallory, alice):
            status, body = await _http(s, "POST", health, who, json={"state": "draining"})
            assert status == 403 and body["code"] == "not_authorised", body
            assert "may not change the health of node" in body["error"]
        assert gw.state.nodes[idle].health == "healthy"
        # bad requests: one JSON 4xx each, nothing published
        before = gw.state.input_seq
        for path, sent, code in (
            (health, {"state": "broken"}, "malformed"),
            (health, {"state": "draining", "colour": "red"}, "malformed"),
            (health, {"state": "draining", "reason": "two\nlines"}, "malformed"),
            (health, {"state": "draining", "reason": "r" * 1025}, "malformed"),
            (health, {}, "malformed"),
            (f"{url}/v1/nodes/ghost/health", {"state": "down"}, "unknown_node"),
            (f"{url}/v1/nodes/{'n' * 200}/health", {"state": "down"}, "malformed"),
            (health, {"state": "healthy"}, "no_change"),
        ):
            status, body = await _http(s, "POST", path, ops, json=sent)
            assert status in (400, 404, 409) and body["code"] == code, (sent, body)
        status, body = await _http(
            s, "POST", health, ops, json={"state": "draining", "reason": "r" * 1025}
        )
        assert "length <= 1024 - at `$.reason`" in body["error"], body
        for query, words in (("state=sick", "state: 'sick' is not one of"), ("x=1", "unknown")):
            status, body = await _http(s, "GET", f"{url}/v1/nodes?{query}", ops)
            assert status == 400 and body["code"] == "bad_query" and words in body["error"]
        status, body = await _http(s, "GET", f"{url}/v1/nodes")
        assert status == 401
        assert gw.state.input_seq == before

        # drain with a reason: published with the principal as actor; the list shows it
        status, body = await _http(
            s, "POST", health, ops, json={"state": "draining", "reason": "fan noise"}
        )
        assert status == 202 and body["node"] == idle and body["state"] == "draining", body
        await eventually(lambda: gw.state.nodes[idle].drained, what="drained")
        status, body = await _http(s, "GET", f"{url}/v1/nodes?state=draining", alice)
        (row,) = body["nodes"]
        assert row["node"] == idle and row["drained"] is True  # nothing ran there
        change = row["last_change"]
        assert (change["state"], change["actor"], change["reason"]) == (
            "draining",
            "ops",
            "fan noise",
        )
        status, body = await _http(s, "GET", f"{url}/v1/nodes?state=down", alice)
        assert body["nodes"] == [] and body["state"] == "down"

        # the fold has the last word: a change published by someone else around the
        # gateway is refused in the history, and a replay of it refuses it too
        evil = NodeHealthChanged(id="evil", at_ms=0, node=busy, state="down", actor="mallory")
        await roles.op.publish_input(evil)
        await eventually(lambda: _rejected(roles.sched, "evil"), what="the rejection")
        rejection = await _rejected(roles.sched, "evil")
        assert rejection is not None and rejection.code == "not_authorised"
        assert gw.state.nodes[busy].health == "healthy" and "big" in gw.state.running
        assert busy not in gw.history.node_changes

        # the command line, as the people on call run it
        env = {**os.environ, "APPORTION_URL": url}
        as_ops = {**env, "APPORTION_TOKEN_FILE": str(creds.token_files["ops"])}
        as_mallory = {**env, "APPORTION_TOKEN_FILE": str(creds.token_files["mallory"])}
        out = await asyncio.to_thread(_cli, "nodes", env=as_mallory)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split()[:5] == ["NODE", "TYPE", "GPUS", "FREE", "STATE"]
        by_node = {line.split()[0]: line for line in lines[1:-1]}
        assert by_node[idle].split()[:6] == [idle, "h100", "8", "8", "drained", "0"]
        assert "draining by ops " in by_node[idle] and by_node[idle].endswith(": fan noise")
        assert by_node[busy].split()[:6] == [busy, "h100", "8", "0", "healthy", "1"]
        assert by_node[busy].endswith("  big")
        assert lines[-1] == "2 nodes, 16 GPUs, 8 free"
        out = await asyncio.to_thread(_cli, "nodes", "--state", "draining", "--json", env=as_ops)
        assert [r["node"] for r in json.loads(out.stdout)["nodes"]] == [idle]
        out = await asyncio.to_thread(_cli, "nodes", "--state", "sick", env=as_ops)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr == "apportion: state: 'sick' is not one of healthy, draining, down\n"
        out = await asyncio.to_thread(_cli, "node", "down", busy, env=as_mallory)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith("apportion: mallory may not change the health of node")
        out = await asyncio.to_thread(_cli, "node", "drain", "ghost", env=as_ops)
        assert out.returncode == 2 and out.stderr == "apportion: unknown node 'ghost'\n"
        out = await asyncio.to_thread(_cli, "node", "undrain", idle, env=as_ops)
        assert out.returncode == 0 and out.stdout.startswith(f"node {idle}: healthy (input ")
        out = await asyncio.to_thread(
            _cli, "node", "down", busy, "--reason", "PSU failed", env=as_ops
        )
        assert out.returncode == 0, out.stderr
        # down preempts at once: big is requeued and placed on the healthy node
        await eventually(
            lambda: (
                gw.state.nodes[busy].health == "down"
                and "big" in gw.state.running
                and gw.state.running["big"].placement[0].node == idle
            ),
            what="big moved",
        )
        out = await asyncio.to_thread(_cli, "nodes", "--json", env=as_ops)
        rows = {r["node"]: r for r in json.loads(out.stdout)["nodes"]}
        assert rows[busy]["state"] == "down" and rows[busy]["workloads"] == []
        assert rows[busy]["last_change"]["reason"] == "PSU failed"
        assert rows[idle]["last_change"]["state"] == "healthy"
        assert rows[idle]["last_change"]["reason"] == ""

        status, doc = await _http(s, "GET", f"{url}/openapi.json")
        assert {"/v1/nodes", "/v1/nodes/{node}/health"} <= set(doc["paths"])
