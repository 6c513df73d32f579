"""The gateway's errors on a real nats-server: every error is JSON ``{"error": ...,
"code": ...}`` with the status of its reason code, each kind of refusal has its
code, bad requests never get a 5xx, a bug is a logged 500 that does not stop the
gateway, and a NATS outage is a 504 after which a retry with the same id is
stored once."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from apportion.schemas.bounds import MAX_DURATION_MS, MAX_GPUS
from apportion.schemas.events import DAY_MS, WorkloadSubmitted
from apportion.schemas.history import InputItem
from apportion.schemas.reasons import CODES
from apportion.services import gateway as gateway_module
from apportion.services.bus import JetStreamLog, connect
from apportion.services.canonical import read_history
from apportion.services.client import GatewayClient, GatewayError
from apportion.services.gateway import HTTP_STATUS, MAX_BODY_BYTES
from conftest import production_server
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from services_helpers import Roles, eventually, gateway_on, small_cluster

if TYPE_CHECKING:
    from conftest import Credentials

APPORTION = [sys.executable, "-m", "apportion"]


def http(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """``(status, JSON body)``; a body that is not JSON fails the test."""
    req = urllib.request.Request(
        url,
        data=body,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        raise AssertionError(
            f"{method} {url} -> {status} with a body that is not JSON: {raw!r}"
        ) from None


# -- fuzz ------------------------------------------------------------------------------

EXTREME_INTS = [0, 1, -1, 8, 2**31, -(2**31) - 1, 2**63, 2**64, 10**12, MAX_GPUS + 1, 10**30]
EXTREME_STRINGS = ["", "llm/a", "vision", "a" * 129, "a/b", "a//b", "a\x00b", "a\n", "é", "ops"]
values = st.one_of(
    st.sampled_from(EXTREME_INTS),
    st.integers(-(2**70), 2**70),
    st.sampled_from(EXTREME_STRINGS),
    st.text(max_size=10),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
SUBMIT_FIELDS = [
    "owner",
    "gpus",
    "min_runtime_ms",
    "id",
    "duration_ms",
    "priority",
    "resumable",
    "gpu_type",
    "submitted_by",
]
good_submit = {"owner": "llm/a", "gpus": 1, "min_runtime_ms": 0}
BIG = b"<a body over the limit>"
GET_ONLY = ("/v1/queue", "/v1/share", "/v1/status", "/openapi.json", "/v1/explain/")


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, bytes | None]:
    """A method, a path and a body: mostly well-typed bodies with extreme values."""
    wid = draw(st.sampled_from(["ghost", "a" * 300, "%00", "a%2Fb", "..", "%C3%A9", "%0A"]))
    path = draw(
        st.sampled_from(
            [
                "/v1/workloads",
                "/v1/budget",
                f"/v1/workloads/{wid}/cancel",
                f"/v1/workloads/{wid}",
                f"/v1/explain/{wid}",
                "/v1/queue",
                "/v1/share",
                "/v1/status",
                "/openapi.json",
                "/nope",
                "/v1/workloads/x/y/z",
            ]
        )
    )
    if draw(st.integers(0, 3)):  # mostly a method the path takes
        read = path.startswith(GET_ONLY) or (
            path.startswith("/v1/workloads/") and not path.endswith("/cancel")
        )
        method = "GET" if read else "POST"
    else:
        method = draw(st.sampled_from(["POST", "GET", "PUT", "DELETE"]))
    shape = draw(st.integers(0, 9))
    if shape == 0:
        return method, path, draw(st.binary(max_size=64))
    if shape == 1:
        return method, path, json.dumps(draw(values)).encode()
    if shape == 2:
        return method, path, BIG
    if shape <= 6:
        body = dict(good_submit)
        for name in draw(st.lists(st.sampled_from(SUBMIT_FIELDS), max_size=4)):
            body[name] = draw(values)
        return method, path, json.dumps(body).encode()
    budget: dict[str, Any] = {
        "actor": draw(st.one_of(st.just("ops"), values)),
        "set": [
            {"path": draw(values), "weight": draw(values), "owner": draw(values)}
            for _ in range(draw(st.integers(0, 2)))
        ],
        "remove": draw(st.lists(values, max_size=2)),
    }
    return method, path, json.dumps(budget).encode()


async def test_bad_requests_get_a_json_error_and_never_a_5xx(
    roles: Roles, creds: Credentials
) -> None:
    async with gateway_on(roles, creds.authenticator) as gateway:
        url = gateway.url
        assert url is not None
        seen: dict[int, int] = {}

        @settings(
            max_examples=200,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )
        @given(requests())
        @example(("POST", "/v1/workloads", BIG))
        @example(("PUT", "/v1/queue", None))
        @example(("GET", "/v1/nope", None))
        @example(("POST", "/v1/workloads", b"{not json"))
        def fuzz(request: tuple[str, str, bytes | None]) -> None:
            method, path, body = request
            if body == BIG:
                body = b'{"owner": "' + b"x" * MAX_BODY_BYTES + b'"}'
            status, answer = http(method, url + path, body, creds.headers())
            seen[status] = seen.get(status, 0) + 1
            assert status < 500, (method, path, body[:200] if body else body, answer)
            if status >= 400:
                assert isinstance(answer, dict) and isinstance(answer.get("error"), str)
                code = answer.get("code")
                assert code in CODES, answer
                assert status == HTTP_STATUS[code] or code == "http_error", (status, answer)

        await asyncio.to_thread(fuzz)
        assert {400, 404, 405, 413} <= set(seen), seen  # the fuzz reached each kind of error
        status, answer = await asyncio.to_thread(http, "GET", url + "/v1/status")
        assert status == 200 and answer["input_seq"] >= len(small_cluster())


async def test_bounds_and_sizes_are_named_in_4xx(roles: Roles, creds: Credentials) -> None:
    async with (
        gateway_on(roles, creds.authenticator) as gateway,
        aiohttp.ClientSession(headers=creds.headers()) as session,
    ):
        url = gateway.url

        async def post(path: str, **kw: Any) -> tuple[int, dict[str, Any]]:
            async with session.post(f"{url}{path}", **kw) as r:
                assert r.content_type == "application/json"
                return r.status, await r.json()

        cases = [
            ({"duration_ms": 99999999999999999999 * DAY_MS}, "$.duration_ms", str(MAX_DURATION_MS)),
            ({"duration_ms": 2**63}, "$.duration_ms", str(MAX_DURATION_MS)),
            ({"priority": 2**31}, "$.priority", "2147483647"),
            ({"gpus": 10**12}, "$.gpus", str(MAX_GPUS)),
            ({"gpus": 2**64}, "$.gpus", str(MAX_GPUS)),
            ({"id": "a" * 200}, "$.id", "length <= 128"),
            ({"id": "a/b"}, "$.id", "no '/'"),
        ]
        for over, field, bound in cases:
            status, body = await post("/v1/workloads", json={**good_submit, **over})
            assert status == 400 and field in body["error"] and bound in body["error"], body
        status, body = await post(
            "/v1/budget",
            json={"actor": "ops", "set": [{"path": "llm/c", "weight": 2**31, "owner": "o"}]},
        )
        assert status == 400 and "$.set[0].weight" in body["error"], body
        # a 450 KB id: refused before it is read, let alone published
        status, body = await post("/v1/workloads", json={**good_submit, "id": "i" * 450_000})
        assert status == 413 and str(MAX_BODY_BYTES) in body["error"]

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: read up to the limit
            yield b'{"owner": "'
            for _ in range(20):
                yield b"x" * 8192
            yield b'"}'

        status, body = await post("/v1/workloads", data=chunks())
        assert status == 413, body
        async with session.get(f"{url}/v1/status") as r:
            assert r.status == 200
        inputs = [i for i in await read_history(roles.sched, 10.0) if isinstance(i, InputItem)]
        assert len(inputs) == len(small_cluster())  # nothing out of bounds was published


async def test_a_bug_in_a_handler_is_a_logged_500_and_the_gateway_keeps_serving(
    roles: Roles, monkeypatch: pytest.MonkeyPatch, creds: Credentials
) -> None:
    def broken(state: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(gateway_module, "queue_view", broken)
    async with gateway_on(roles, creds.authenticator) as gateway:
        url = gateway.url
        auth = creds.headers()
        status, body = await asyncio.to_thread(http, "GET", f"{url}/v1/queue", None, auth)
        assert status == 500 and "RuntimeError" in body["error"]
        assert body["code"] == "internal_error"
        status, body = await asyncio.to_thread(http, "GET", f"{url}/v1/status")
        assert status == 200
        status, body = await asyncio.to_thread(
            http,
            "POST",
            f"{url}/v1/workloads",
            json.dumps({**good_submit, "id": "after"}).encode(),
            auth,
        )
        assert status == 202 and body["workload"] == "after"


# -- reason codes --------------------------------------------------------------------


def test_every_code_has_one_status_and_the_doc_gives_it() -> None:
    assert set(HTTP_STATUS) == set(CODES)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "reasons.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (\d{3}) \|", docs, flags=re.MULTILINE)
    assert len(rows) == len(CODES) and dict(rows) == {c: str(s) for c, s in HTTP_STATUS.items()}


async def test_each_kind_of_refusal_has_its_status_and_code(
    roles: Roles, creds: Credentials
) -> None:
    async with (
        gateway_on(roles, creds.authenticator) as gateway,
        aiohttp.ClientSession() as session,
    ):
        url = gateway.url

        async def call(
            method: str, path: str, as_: str | None = "ops", **kw: Any
        ) -> tuple[int, dict[str, Any]]:
            headers = creds.headers(as_) if as_ else {}
            async with session.request(method, f"{url}{path}", headers=headers, **kw) as r:
                assert r.content_type == "application/json"
                return r.status, await r.json()

        def submit(**over: Any) -> dict[str, Any]:
            return {"json": {**good_submit, **over}}

        def budget(**body: Any) -> dict[str, Any]:
            return {"json": body}

        async def check(case: tuple[str, str, str | None, dict[str, Any], str, str]) -> None:
            method, path, as_, kw, code, words = case
            status, body = await call(method, path, as_, **kw)
            assert (status, body.get("code")) == (HTTP_STATUS[code], code), (case, status, body)
            assert words in body["error"], (case, body)

        status, body = await call("POST", "/v1/workloads", **submit(id="dup"))
        assert status == 202, body
        status, body = await call("POST", "/v1/workloads", **submit(id="busy", owner="llm/b"))
        assert status == 202, body
        await eventually(
            lambda: {"dup", "busy"} <= set(gateway.state.workloads), what="both folded"
        )
        P, W, B = "POST", "/v1/workloads", "/v1/budget"
        cases: list[tuple[str, str, str | None, dict[str, Any], str, str]] = [
            (P, W, "ops", {"data": b"{not json"}, "malformed", "not JSON"),
            (P, W, "ops", submit(gpus="x"), "malformed", "invalid request"),
            (P, W, "ops", submit(colour="red"), "malformed", "invalid request"),
            (P, W, "ops", submit(gpus=MAX_GPUS + 1), "malformed", "$.gpus"),
            (P, W, "ops", submit(id=".."), "invalid_name", "is not allowed"),
            (P, W, "ops", submit(owner="nope"), "unknown_owner", "unknown owner 'nope'"),
            (P, W, "ops", submit(owner="llm"), "not_a_leaf", "not a leaf"),
            (P, W, "mallory", submit(), "not_authorised", "mallory may not submit"),
            (P, W, "ops", submit(gpus=0), "not_positive", "gpus must be positive"),
            (P, W, "ops", submit(min_runtime_ms=10 * 3_600_000), "over_cap", "min_runtime"),
            (P, W, "ops", submit(grace_ms=3_600_000), "over_cap", "grace must be between"),
            (P, W, "ops", submit(gpu_type="a100"), "unknown_gpu_type", "no nodes of gpu_type"),
            (P, W, "ops", submit(gpus=12), "invalid_gang", "not a valid gang"),
            (P, W, "ops", submit(id="dup"), "duplicate_id", "already exists"),
            (P, f"{W}/ghost/cancel", "ops", {"json": {}}, "unknown_workload", "unknown workload"),
            (P, f"{W}/dup/cancel", "mallory", {"json": {}}, "not_authorised", "may not cancel"),
            ("GET", f"{W}/ghost", "ops", {}, "unknown_workload", "unknown workload 'ghost'"),
            ("GET", "/v1/explain/ghost", "ops", {}, "unknown_workload", "unknown workload"),
            (P, B, "ops", budget(), "empty_request", "nothing to change"),
            (
                P,
                B,
                "mallory",
                budget(set=[{"path": "llm/c", "weight": 1, "owner": "m"}]),
                "not_authorised",
                "'mallory' does not own",
            ),
            (
                P,
                B,
                "ops",
                budget(set=[{"path": "llm/_x", "weight": 1, "owner": "m"}]),
                "bad_path",
                "bad budget path",
            ),
            (
                P,
                B,
                "ops",
                budget(set=[{"path": "llm/c", "weight": 0, "owner": "m"}]),
                "not_positive",
                "weight must be a positive",
            ),
            (
                P,
                B,
                "ops",
                budget(set=[{"path": "llm/c", "weight": 1, "owner": ""}]),
                "invalid_name",
                "owner is empty",
            ),
            (
                P,
                B,
                "ops",
                budget(set=[{"path": "x/y", "weight": 1, "owner": "m"}]),
                "unknown_parent",
                "does not exist",
            ),
            (
                P,
                B,
                "ops",
                budget(set=[{"path": "llm/b/sub", "weight": 1, "owner": "m"}]),
                "has_work",
                "has pending or running work",
            ),
            (P, B, "ops", budget(remove=["zzz"]), "unknown_budget_node", "unknown budget node"),
            (P, B, "ops", budget(remove=["llm"]), "has_children", "has children"),
            (P, B, "ops", budget(remove=["llm/b"]), "has_work", "pending or running workloads"),
            (P, B, "ops", budget(remove=[""]), "root_not_removable", "cannot be removed"),
            # the second edit relies on the first, and is refused for itself
            (
                P,
                B,
                "ops",
                budget(set=[{"path": "ml", "weight": 1, "owner": "m"}], remove=["ml", "ml"]),
                "unknown_budget_node",
                "unknown budget node 'ml'",
            ),
            ("GET", "/v1/queue", None, {}, "not_authenticated", "not authenticated"),
            ("GET", "/v1/nope", "ops", {}, "no_such_path", "no such path"),
            ("PUT", "/v1/queue", "ops", {}, "method_not_allowed", "not allowed"),
            (P, W, "ops", {"data": b"x" * (MAX_BODY_BYTES + 1)}, "too_large", "request body over"),
        ]
        for case in cases:
            await check(case)
        status, body = await call("POST", f"{W}/dup/cancel", "ops", json={})
        assert status == 202, body
        await eventually(lambda: "dup" in gateway.state.ended, what="cancel folded")
        await check((P, f"{W}/dup/cancel", "ops", {"json": {}}, "already_ended", "already ended"))
        await check((P, W, "ops", submit(id="dup"), "duplicate_id", "already exists"))
        # nothing refused was published: the cluster, two submissions and one cancel
        inputs = [i for i in await read_history(roles.sched, 10.0) if isinstance(i, InputItem)]
        assert len(inputs) == len(small_cluster()) + 3


# -- a NATS outage ------------------------------------------------------------------


def stored(inputs: list[InputItem], workload: str) -> int:
    return sum(
        1 for i in inputs if isinstance(i.event, WorkloadSubmitted) and i.event.workload == workload
    )


async def test_refused_requests_count_in_rejections_by_source(
    roles: Roles, creds: Credentials
) -> None:
    """A request the gateway answers 4xx never becomes an input (so no ``InputRejected``):
    it counts in ``apportion_rejections_total{source="gateway"}`` by the class of its
    code; reads answered 4xx do not count; the scheduler's rejections stay apart."""
    from prometheus_client.parser import text_string_to_metric_families
    from services_helpers import submit as submit_event

    async with (
        gateway_on(roles, creds.authenticator) as gateway,
        aiohttp.ClientSession() as session,
    ):
        url = gateway.url

        async def call(method: str, path: str, as_: str | None = "ops", **kw: Any) -> int:
            headers = creds.headers(as_) if as_ else {}
            async with session.request(method, f"{url}{path}", headers=headers, **kw) as r:
                return r.status

        async def rejections() -> dict[tuple[str, str], float]:
            async with session.get(f"{url}/metrics") as r:
                text = await r.text()
            return {
                (s.labels["source"], s.labels["reason_class"]): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "apportion_rejections_total"
            }

        before = await rejections()
        assert before == {
            (source, c): 0.0
            for source in ("scheduler", "gateway")
            for c in ("malformed", "stale", "authority", "duplicate", "invalid")
        }
        W = "/v1/workloads"
        assert await call("POST", W, json={**good_submit, "id": "dup"}) == 202
        await eventually(lambda: "dup" in gateway.state.workloads, what="dup folded")
        refused = [
            (await call("POST", W, data=b"{not json"), "malformed"),
            (await call("POST", W, json={**good_submit, "owner": "nope"}), "invalid"),
            (await call("POST", "/v1/nope", json={}), "invalid"),  # no_such_path
            (await call("POST", W, "mallory", json=good_submit), "authority"),
            (await call("POST", W, None, json=good_submit), "authority"),  # no token: 401
            (await call("POST", f"{W}/dup/cancel", "mallory", json={}), "authority"),
            (await call("POST", W, json={**good_submit, "id": "dup"}), "duplicate"),
            (await call("POST", f"{W}/ghost/cancel", json={}), "invalid"),  # 404
        ]
        assert [status for status, _ in refused] == [400, 400, 404, 403, 401, 403, 409, 404]
        # reads answered 4xx are not refused inputs
        assert await call("GET", f"{W}/ghost") == 404
        assert await call("GET", "/v1/explain/ghost") == 404
        assert await call("GET", "/v1/queue", None) == 401
        # an input the scheduler refuses (published past the gateway): the other source
        await roles.op.publish_input(submit_event("x", owner="no/such"))
        last = await roles.sched.last_input_seq()
        await eventually(lambda: gateway.history.basis == last, what="the rejection folded")
        after = await rejections()
    expected = dict(before)
    for _, c in refused:
        expected["gateway", c] += 1
    expected["scheduler", "invalid"] += 1
    assert after == expected


async def test_an_outage_is_a_504_and_a_retry_with_the_same_id_is_stored_once(
    tmp_path: Path, cluster: str, creds: Credentials
) -> None:
    # a nats-server of this test's own (it is stopped and started again)
    server = production_server(tmp_path / "store", cluster)
    server.start()
    conns = {
        user: await connect(server.url_as(user), name=f"test-outage-{user}")
        for user in ("scheduler", "operator", "gateway")
    }
    log, op, gw = (JetStreamLog(nc.jetstream(timeout=1.0), cluster) for nc in conns.values())
    await log.setup()
    try:
        async with gateway_on(Roles(log, op, gw), creds.authenticator) as gateway:
            url = gateway.url
            auth = creds.headers()
            server.stop()
            body = json.dumps({**good_submit, "id": "during"}).encode()
            status, answer = await asyncio.to_thread(
                http, "POST", f"{url}/v1/workloads", body, auth
            )
            assert status == 504 and "may still be stored" in answer["error"], answer
            assert answer["workload"] == "during" and "same" in answer["error"]
            assert answer["code"] == "unacknowledged"
            status, answer = await asyncio.to_thread(http, "GET", f"{url}/v1/nope", None, auth)
            assert status == 404 and "error" in answer

            # a client that retries on its own: the server comes back while it does
            result: dict[str, Any] = {}

            def client_submit() -> None:
                try:
                    client = GatewayClient(url, timeout=90, token=creds.tokens["ops"])
                    result["ok"] = client.submit(**good_submit)
                except GatewayError as exc:
                    result["error"] = exc.reason

            thread = threading.Thread(target=client_submit)
            thread.start()
            await asyncio.sleep(1.5)  # not a timing assertion: either order must end well
            server.start()
            await asyncio.to_thread(thread.join, 120)
            assert "ok" in result, result
            made = result["ok"]["workload"]
            assert made.startswith("w-")

            while True:  # the same request again, until the gateway answers it
                status, answer = await asyncio.to_thread(
                    http, "POST", f"{url}/v1/workloads", body, auth
                )
                if status != 504:
                    break
            assert status in (202, 409), answer
            if status == 409:
                assert "already exists" in answer["error"] and answer["code"] == "duplicate_id"
            await eventually(
                lambda: {"during", made} <= set(gateway.state.workloads), what="both folded"
            )
        inputs = [i for i in await read_history(log, 10.0) if isinstance(i, InputItem)]
        assert stored(inputs, "during") == 1 and stored(inputs, made) == 1
    finally:
        for nc in conns.values():
            await nc.close()
        server.stop()


async def test_the_cli_names_the_bound_in_one_line(roles: Roles, creds: Credentials) -> None:
    async with gateway_on(roles, creds.authenticator) as gateway:
        env = {
            "APPORTION_URL": gateway.url or "",
            "PATH": "/usr/bin:/bin",
            "APPORTION_TOKEN": creds.tokens["a"],
        }

        async def cli(*args: str) -> tuple[int, str, str]:
            proc = await asyncio.create_subprocess_exec(
                *APPORTION,
                *args,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode is not None
            return proc.returncode, out.decode(), err.decode()

        base = ["submit", "--owner", "llm/a", "--gpus", "1", "--min-runtime", "0"]
        for extra, words in [
            (["--duration", "99999999999999999999d"], ["duration_ms", str(MAX_DURATION_MS)]),
            (["--priority", str(2**31)], ["priority", "2147483647"]),
            (["--gpus", str(10**12)], ["gpus", str(MAX_GPUS)]),
            (["--id", "x" * 200], ["id", "length <= 128"]),
        ]:
            code, out, err = await cli(*base, *extra)
            assert code == 2 and out == "" and err.count("\n") == 1, (extra, err)
            assert err.startswith("apportion: ") and all(w in err for w in words), err
        code, out, err = await cli(*base, "--json")
        assert code == 0, err
        made = json.loads(out)["workload"]
        assert made.startswith("w-")  # the CLI made the id
        await eventually(lambda: made in gateway.state.workloads, what="submitted")
        code, out, err = await cli("cancel", made)
        assert code == 0 and urllib.parse.quote(made) in out, err
