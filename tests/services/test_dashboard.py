"""The web dashboard (services/dashboard.py): the GPU timeline it keeps, the pages it
renders, and its login cookie against a real gateway on a real nats-server (the
browser test is test_dashboard_browser.py)."""

from __future__ import annotations

import re
import urllib.parse
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from apportion.core.history import decide_batch, fold_item
from apportion.core.state import State
from apportion.schemas.history import BatchItem, input_item
from apportion.services.auth import revoke_tokens
from apportion.services.bus import JetStreamLog
from apportion.services.dashboard import (
    COOKIE,
    TimelineHistory,
    budget_html,
    cluster_html,
    queue_html,
    timeline_svg,
    usage_html,
    workload_html,
)
from services_helpers import eventually, gateway_on, small_cluster, submit

if TYPE_CHECKING:
    from conftest import Credentials

HOUR = 3_600_000
T0 = 1_800_000_000_000  # a fixed wall-clock-like epoch, so the timeline window holds it


class Folded:
    """A state and a timeline history fed one input and one cycle at a time."""

    def __init__(self) -> None:
        self.state = State()
        self.history = TimelineHistory(lambda: self.state)
        self.seq = 0
        self.batches = 0

    def feed(self, event: Any) -> None:
        self.seq += 1
        item = input_item(self.seq, event)
        fold_item(self.state, item)
        self.history.record([item])
        batch, _ = decide_batch(self.state)
        self.batches += 1
        b = BatchItem(seq=self.batches, batch=batch)
        fold_item(self.state, b)
        self.history.record([b])


def at(event: Any, ms: int) -> Any:
    import msgspec

    return msgspec.structs.replace(event, at_ms=ms)


def cluster_with_a_preemption() -> Folded:
    f = Folded()
    for e in small_cluster():
        f.feed(at(e, T0))
    f.feed(at(submit("free", gpus=16, min_runtime_ms=0), T0 + 1000))  # both nodes, preemptible
    f.feed(at(submit("paid", gpus=8, min_runtime_ms=HOUR), T0 + HOUR))  # preempts it
    return f


def test_the_timeline_keeps_runs_and_preemptions() -> None:
    f = cluster_with_a_preemption()
    h = f.history
    assert [(r.workload, r.allocated, r.gpus) for r in h.runs] == [
        ("free", False, 16),
        ("paid", True, 8),
    ]
    free, paid = h.runs
    assert free.start_ms == T0 + 1000 and free.end_ms == T0 + HOUR and free.preempted
    assert paid.end_ms is None and set(h.open) == {"paid"}
    assert [(p[1], p[3]) for p in h.preemptions] == [("free", 16)]
    svg = timeline_svg(h, f.state, T0 + 2 * HOUR, 6)
    assert svg.startswith('<svg id="gpu-timeline"') and svg.endswith("</svg>")
    assert 'fill="url(#hatch)"' in svg  # preemptible work is hatched
    assert svg.count('class="preemption"') == 2  # a mark and a line
    assert "free preempted" in svg


def test_an_end_report_the_fold_refuses_leaves_the_run_open() -> None:
    from apportion.schemas.events import WorkloadFinished

    f = Folded()
    for e in small_cluster():
        f.feed(at(e, T0))
    f.feed(at(submit("job", gpus=8), T0 + 1))
    # a stale report (an attempt that never ran): the fold refuses it
    f.feed(WorkloadFinished(id="fin-1", at_ms=T0 + 2, workload="job", attempt=7, actor="ops"))
    assert f.history.open["job"].end_ms is None
    # nobody may report it but an operator or the host's agent: refused as well
    f.feed(WorkloadFinished(id="fin-2", at_ms=T0 + 3, workload="job", actor="mallory"))
    assert "job" in f.state.running and f.history.open["job"].end_ms is None
    f.feed(
        WorkloadFinished(
            id="fin-3",
            at_ms=T0 + 4,
            workload="job",
            actor=f"agent:{f.state.running['job'].placement[0].node}",
        )
    )
    assert "job" not in f.history.open and f.history.runs[0].end_ms == T0 + 4


def test_the_pages_render_from_the_state() -> None:
    f = cluster_with_a_preemption()
    f.feed(at(submit("waiting", owner="vision", gpus=16, min_runtime_ms=HOUR), T0 + HOUR + 5))
    gw = SimpleNamespace(state=f.state, history=f.history, auth=None, url=None)
    cluster = cluster_html(gw, 6)  # type: ignore[arg-type]
    assert '<svg id="gpu-timeline"' in cluster and "h000" in cluster and "h001" in cluster
    assert "GPUs in use" in cluster
    queue = queue_html(gw)  # type: ignore[arg-type]
    assert '<a href="/ui/workload/waiting">waiting</a>' in queue
    assert "vision" in queue and "paid" in queue
    usage = usage_html(gw)  # type: ignore[arg-type]
    assert '<svg id="usage-chart"' in usage and "llm/a" in usage
    why = workload_html(gw, "waiting")  # type: ignore[arg-type]
    assert why is not None and "pending" in why and "position" in why
    assert workload_html(gw, "nope") is None  # type: ignore[arg-type]
    # alice owns llm: she may edit llm/a and llm/b, not llm itself nor vision
    tree = budget_html(gw, "alice")  # type: ignore[arg-type]
    editable = set(
        re.findall(r'<form method="post" action="/ui/budget" class="inline" id="([^"]+)"', tree)
    )
    assert editable == {"edit-llm--a", "edit-llm--b"}
    assert "edit-" not in budget_html(gw, "mallory")  # type: ignore[arg-type]


def test_text_from_the_log_is_escaped() -> None:
    from apportion.services.dashboard import esc, page

    out = page("<x>", "queue", esc("<script>alert(1)</script>"), principal="a&b")
    assert "<script>alert" not in out and "&lt;script&gt;" in out and "a&amp;b" in out


# -- against a real gateway ----------------------------------------------------------


def session() -> aiohttp.ClientSession:
    # unsafe: keep cookies for an IP address host (127.0.0.1)
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


async def login(s: aiohttp.ClientSession, url: str, token: str) -> aiohttp.ClientResponse:
    async with s.post(
        f"{url}/ui/login", data={"token": token, "next": "/ui/queue"}, allow_redirects=False
    ) as resp:
        return resp


@pytest.mark.nats
async def test_login_cookie_pages_and_forms(jlog: JetStreamLog, creds: Credentials) -> None:
    async with gateway_on(jlog, creds.authenticator) as gw, session() as s:
        url = gw.url
        # no cookie: pages send to the login form, the live endpoint says 401
        async with s.get(f"{url}/ui/queue", allow_redirects=False) as r:
            assert r.status == 303 and r.headers["Location"].startswith("/ui/login?next=")
        async with s.get(f"{url}/ui/live?page=queue") as r:
            assert r.status == 401
        async with s.get(f"{url}/", allow_redirects=False) as r:
            assert r.status == 302 and r.headers["Location"] == "/ui/"
        async with s.get(f"{url}/ui/login") as r:
            assert r.status == 200 and 'name="token"' in await r.text()
        # a wrong token is refused; the cookie is never set
        r = await login(s, url, "apt_nope")
        assert r.status == 303 and "error=" in r.headers["Location"]
        assert COOKIE not in {c.key for c in s.cookie_jar}
        # the JSON API still wants its header: a cookie alone does not open /v1
        r = await login(s, url, creds.tokens["alice"])
        assert r.status == 303 and r.headers["Location"] == "/ui/queue"
        set_cookie = r.headers["Set-Cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
        assert "Path=/ui" in set_cookie
        async with s.get(f"{url}/v1/queue") as r2:
            assert r2.status == 401
        for path in ("/ui/", "/ui/queue", "/ui/usage", "/ui/budget", "/ui/?hours=24"):
            async with s.get(url + path) as r2:
                text = await r2.text()
                assert r2.status == 200, path
                assert "signed in as <b>alice</b>" in text
                assert "Content-Security-Policy" in r2.headers
        async with s.get(f"{url}/ui/static/dashboard.js") as r2:
            assert r2.status == 200 and "fetch(" in await r2.text()
        async with s.get(f"{url}/ui/static/../gateway.py") as r2:
            assert r2.status == 404
        # submit through the form: forwarded to /v1/workloads with alice's token
        form = {"owner": "llm/a", "gpus": "8", "min_runtime": "15m", "id": "ui1", "resumable": "on"}
        async with s.post(f"{url}/ui/submit", data=form, allow_redirects=False) as r2:
            assert r2.status == 303 and r2.headers["Location"].startswith("/ui/workload/ui1")
        await eventually(lambda: "ui1" in gw.state.running, what="ui1 placed")
        assert gw.state.running["ui1"].submitted_by == "alice"
        async with s.get(f"{url}/ui/live?page=workload&id=ui1") as r2:
            assert r2.status == 200 and "running on" in (await r2.json())["html"]
        # a refused submission comes back as a message
        form = {"owner": "vision", "gpus": "8", "min_runtime": "15m"}
        async with s.post(f"{url}/ui/submit", data=form, allow_redirects=False) as r2:
            assert r2.status == 303 and "error=" in r2.headers["Location"]
        # budget: alice may edit below llm, not vision (the fold's rule, through the API)
        async with s.post(
            f"{url}/ui/budget",
            data={"path": "llm/a", "weight": "3", "owner": "a", "action": "set"},
            allow_redirects=False,
        ) as r2:
            assert r2.status == 303 and "ok=" in r2.headers["Location"]
        await eventually(lambda: gw.state.budget.nodes["llm/a"].weight == 3, what="weight set")
        async with s.post(
            f"{url}/ui/budget",
            data={"path": "vision", "weight": "9", "owner": "vic", "action": "set"},
            allow_redirects=False,
        ) as r2:
            where = urllib.parse.unquote_plus(r2.headers["Location"])
            assert r2.status == 303 and "refused (403)" in where and "does not own" in where
        # a form posted from another site is refused
        async with s.post(
            f"{url}/ui/submit", data=form, headers={"Origin": "http://evil.example"}
        ) as r2:
            assert r2.status == 403
        # a revoked token stops working at the next request
        assert revoke_tokens(creds.file, "alice") == 1
        async with s.get(f"{url}/ui/queue", allow_redirects=False) as r2:
            assert r2.status == 303
        async with s.get(f"{url}/ui/live?page=cluster") as r2:
            assert r2.status == 401


@pytest.mark.nats
async def test_without_auth_the_login_names_the_actor(jlog: JetStreamLog) -> None:
    async with gateway_on(jlog, None) as gw, session() as s:
        url = gw.url
        async with s.get(f"{url}/ui/login") as r:
            assert "name to act as" in await r.text()
        r = await login(s, url, "not a name!")
        assert r.status == 303 and "error=" in r.headers["Location"]
        r = await login(s, url, "alice")
        assert r.status == 303
        form = {"owner": "llm/b", "gpus": "4", "min_runtime": "0", "id": "free1"}
        async with s.post(f"{url}/ui/submit", data=form, allow_redirects=False) as r2:
            assert r2.status == 303 and r2.headers["Location"].startswith("/ui/workload/free1")
        await eventually(lambda: "free1" in gw.state.running, what="free1 placed")
        w = gw.state.running["free1"]
        assert w.submitted_by == "alice" and not w.allocated
        async with s.post(f"{url}/ui/workload/free1/cancel", allow_redirects=False) as r2:
            assert r2.status == 303 and "ok=" in r2.headers["Location"]
        await eventually(lambda: gw.state.ended.get("free1") == "cancelled", what="cancelled")


def test_the_usage_page_charts_owed_and_delivered_per_team() -> None:
    from apportion.services.dashboard import usage_history_html

    f = cluster_with_a_preemption()
    gw = SimpleNamespace(state=f.state, history=f.history, auth=None, url=None)
    out = usage_history_html(gw, 6)  # type: ignore[arg-type]
    charts = re.findall(r'<svg id="usage-history-([^"]+)".*?</svg>', out)
    assert charts == ["llm", "vision"]
    # one y-scale for every team: the same axis labels on each chart
    labels = [
        re.findall(r'class="ylabel">([^<]+)<', c)
        for c in re.findall(r'<svg id="usage-history-.*?</svg>', out)
    ]
    assert labels[0] == labels[1] and len(labels[0]) == 3
    assert out.count('class="h-delivered"') == 2 and out.count('class="h-owed"') == 2
    assert out.count('class="hour"') == 12  # six hours, two teams
    assert '<tr data-path="llm/a">' in out and "last 6 h" in out
    assert 'class="chart usage-history user"' not in out
    # the users of a team on request, one scale among them
    users = usage_history_html(gw, 6, "llm")  # type: ignore[arg-type]
    assert re.findall(
        r'<svg id="usage-history-([^"]+)" class="chart usage-history user"', users
    ) == [
        "llm-a",
        "llm-b",
    ]
    assert 'href="/ui/usage?hours=6"' in users  # back to the teams only
    assert usage_history_html(gw, 6, "nope").count("usage-history user") == 0  # type: ignore[arg-type]
    # the page has it under the usage chart
    assert '<svg id="usage-history-llm"' in usage_html(gw, 6)  # type: ignore[arg-type]
