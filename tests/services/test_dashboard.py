"""The web dashboard (services/dashboard.py): the GPU timeline it keeps, the pages it
renders, and its login cookie against a real gateway on a real nats-server (the
browser test is test_dashboard_browser.py)."""

from __future__ import annotations

import json
import re
import urllib.parse
from html.parser import HTMLParser
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from apportion.core.history import decide_batch, fold_item
from apportion.core.state import State
from apportion.schemas.history import BatchItem, input_item
from apportion.services.auth import revoke_tokens
from apportion.services.bus import JetStreamLog
from apportion.services.dashboard import COOKIE
from apportion.services.dashboard_views import (
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
        self.history.observe(item, self.state, fold_item(self.state, item))
        self.history.record([item])
        batch, _ = decide_batch(self.state)
        self.batches += 1
        b = BatchItem(seq=self.batches, batch=batch)
        self.history.observe(b, self.state, fold_item(self.state, b))
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
    # Details: human labels (the API's field name in the tooltip), durations, yes / no
    assert why is not None
    cells = {
        f: (label, text)
        for f, label, text in re.findall(r'<tr><th title="(\w+)">([^<]+)</th><td>([^<]*)<', why)
    }
    assert cells["min_runtime_ms"] == ("minimum runtime", "1 h")
    assert cells["resumable"][1] in ("yes", "no") and cells["allocated"] == (
        "allocated (protected work)",
        "yes",
    )
    assert cells["gpus"] == ("GPUs", "16")
    assert not re.search(r">(True|False|min_runtime_ms|duration_ms)<", why)
    free = workload_html(gw, "free")  # type: ignore[arg-type]
    assert free is not None and "none (unallocated)" in free
    # alice owns llm: she may edit llm/a and llm/b, not llm itself nor vision
    tree = budget_html(gw, "alice")  # type: ignore[arg-type]
    editable = set(
        re.findall(r'<form method="post" action="/ui/budget" class="inline" id="([^"]+)"', tree)
    )
    assert editable == {"edit-llm--a", "edit-llm--b"}
    assert "edit-" not in budget_html(gw, "mallory")  # type: ignore[arg-type]


def test_node_actions_reason_codes_and_hold_buttons_follow_the_folds_rules() -> None:
    from apportion.schemas.events import NodeHealthChanged, WorkloadHeld

    f = Folded()
    for e in small_cluster():
        f.feed(at(e, T0))
    f.feed(at(submit("big", gpus=16, min_runtime_ms=HOUR, submitted_by="a"), T0 + 1))
    f.feed(at(submit("next", gpus=8, min_runtime_ms=HOUR, submitted_by="a"), T0 + 2))
    f.feed(at(submit("kept", "llm/b", 8, HOUR, submitted_by="b"), T0 + 3))
    f.feed(WorkloadHeld(id="hold-1", at_ms=T0 + 4, workload="kept", actor="b"))
    f.feed(
        NodeHealthChanged(
            id="h-1", at_ms=T0 + 5, node="h001", state="draining", actor="ops", reason="bad DIMM"
        )
    )
    gw = SimpleNamespace(state=f.state, history=f.history, auth=None, url=None)

    # the node table: state, GPUs used / free, protection, the last change and its reason
    ops = cluster_html(gw, 6, "ops")  # type: ignore[arg-type]
    row = re.search(r'<tr data-node="h001">.*?</tr>', ops)
    assert row is not None
    assert 'class="node-state draining">draining<' in row[0]
    assert "8 / 0" in row[0]  # used / free
    assert "by ops" in row[0] and '<q class="reason">bad DIMM</q>' in row[0]
    # operators (the root's owner) get a form per node with what its state allows
    forms = dict(
        re.findall(r'<form method="post" action="/ui/node/(\w+)/health"[^>]*>(.*?)</form>', ops)
    )
    assert set(forms) == {"h000", "h001"}
    buttons = {
        n: re.findall(r'name="state" value="(\w+)"[^>]*>(\w+)<', b) for n, b in forms.items()
    }
    assert buttons["h000"] == [("draining", "Drain"), ("down", "Down")]
    assert buttons["h001"] == [("healthy", "Undrain"), ("down", "Down")]
    assert 'name="reason"' in forms["h000"]
    # anyone else sees the table without a form or an actions column
    for viewer in ("alice", "mallory", None):
        other = cluster_html(gw, 6, viewer)  # type: ignore[arg-type]
        assert "/health" not in other and "<th>actions</th>" not in other, viewer
        assert "bad DIMM" in other

    # the queue: each pending workload's reason code beside its sentence; held work marked
    def rows(viewer: str | None) -> dict[str, str]:
        page = queue_html(gw, None, viewer)  # type: ignore[arg-type]
        return dict(re.findall(r'<tr data-workload="([\w-]+)"[^>]*>(.*?)</tr>', page))

    for_a = rows("a")
    assert set(for_a) == {"next", "kept"}
    # big holds both nodes under its protection; h001 drains after it
    assert '<code class="reason-code">waiting_for_protection</code>' in for_a["next"]
    assert "protected by their minimum runtime" in for_a["next"]  # and the sentence
    assert '<code class="reason-code">held</code>' in for_a["kept"]
    assert 'class="badge held"' in for_a["kept"] and "held by b" in for_a["kept"]
    # Hold for its submitter (a), Release for b who held it and for the owners above
    assert "/ui/workload/next/hold" in for_a["next"] and "/release" not in for_a["kept"]
    for viewer in ("b", "alice", "ops"):
        assert "/ui/workload/kept/release" in rows(viewer)["kept"], viewer
    assert "/ui/workload/next/hold" not in rows("b")["next"]
    mallory = queue_html(gw, None, "mallory")  # type: ignore[arg-type]
    assert "/hold" not in mallory and "/release" not in mallory
    # the workload page: the same buttons by the same rule, and the reason code
    held = workload_html(gw, "kept", None, "b")  # type: ignore[arg-type]
    assert held is not None and 'id="wl-held"' in held and "/ui/workload/kept/release" in held
    assert '<code class="reason-code" id="wl-reason">held</code>' in held
    assert "/cancel" in held and "/hold" not in held
    seen = workload_html(gw, "kept", None, "mallory")  # type: ignore[arg-type]
    assert seen is not None and "/release" not in seen and "/cancel" not in seen
    # filters: by submitter, team and state; a bad one answered with the API's reason
    assert set(rows_of(queue_html(gw, None, "a", {"user": "b"}))) == {"kept"}  # type: ignore[arg-type]
    only_running = queue_html(gw, None, "a", {"state": "running"})  # type: ignore[arg-type]
    assert "nothing is waiting" in only_running and "big" in only_running
    assert rows_of(queue_html(gw, None, "a", {"team": "vision"})) == []  # type: ignore[arg-type]
    bad = queue_html(gw, None, "a", {"state": "gone"})  # type: ignore[arg-type]
    assert 'id="queue-error"' in bad and "is not one of pending, running" in bad


def rows_of(page: str) -> list[str]:
    """The workloads of a queue page's pending rows, in order."""
    return re.findall(r'<tr data-workload="([\w-]+)"', page)


def test_text_from_the_log_is_escaped() -> None:
    from apportion.services.dashboard_views import page

    # the templates escape: a body given as text is shown as text
    out = page("<x>", "queue", "<script>alert(1)</script>", principal="a&b")
    assert "<script>alert" not in out and "&lt;script&gt;" in out and "a&amp;b" in out


BAD = '<script>alert("x")</script>\'&'
"""A name that would run a script, end an attribute or start an entity if it were not escaped."""
BAD_SEGMENT = '<script>alert("x")\'&'
"""The same as a budget path segment (no ``/``)."""


class Parsed(HTMLParser):
    """A page as a browser's parser reads it: its elements, text and attribute values."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.scripts: list[dict[str, str | None]] = []
        self.shown: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "script":
            self.scripts.append(dict(attrs))
        self.shown += [v for _, v in attrs if v]

    def handle_data(self, data: str) -> None:
        self.shown.append(data)


def hostile_names() -> Folded:
    """A budget leaf, its owner, a node and workloads named :data:`BAD`. The API's
    schemas refuse such names; the pages must not trust that: they are put in the state
    past those checks (the fold itself takes them)."""
    from apportion.schemas.events import NodeRegistered
    from apportion.schemas.history import InputItem

    f = Folded()
    for e in small_cluster():
        f.feed(at(e, T0))
    f.state.budget.set_node("llm/" + BAD_SEGMENT, 2, "o" + BAD)
    unchecked = [
        NodeRegistered(id="n", at_ms=T0, node="n" + BAD, gpus=4, gpu_type="h100", actor="ops"),
        submit("w" + BAD, owner="llm/" + BAD_SEGMENT, gpus=4, min_runtime_ms=HOUR),
        submit("q" + BAD, owner="llm/" + BAD_SEGMENT, gpus=16, min_runtime_ms=HOUR),
    ]
    for i, e in enumerate(unchecked, 1):
        f.seq += 1
        item = InputItem(seq=f.seq, at_ms=T0 + i, ref=e.id, event=e)
        f.history.observe(item, f.state, fold_item(f.state, item))
        f.history.record([item])
        batch, _ = decide_batch(f.state)
        f.batches += 1
        b = BatchItem(seq=f.batches, batch=batch)
        f.history.observe(b, f.state, fold_item(f.state, b))
        f.history.record([b])
    assert {"w" + BAD, "q" + BAD} <= set(f.state.workloads) and "n" + BAD in f.state.nodes
    return f


async def test_names_with_markup_are_escaped_on_every_page() -> None:
    """Every page and every live part that shows a hostile budget path, owner, node or
    workload id shows it as text: the parser finds it whole in the text or an
    attribute value, and no script but the dashboard's own."""
    from aiohttp.test_utils import make_mocked_request
    from apportion.services.dashboard import Dashboard

    f = hostile_names()
    path, owner, running, pending = "llm/" + BAD_SEGMENT, "o" + BAD, "w" + BAD, "q" + BAD

    async def no_estimates() -> None:
        return None

    output = "out" + BAD  # a job's output is as hostile as anything else

    async def read_log(wid: str, attempt: int | None, node: str | None, offset: int) -> Any:
        return {
            "attempt": 1,
            "node": "n" + BAD,
            "text": output + "\n",
            "note": BAD,
            "shipped": True,
        }

    gw = SimpleNamespace(
        state=f.state,
        history=f.history,
        auth=None,
        url=None,
        logger=SimpleNamespace(info=print, exception=print),
        estimates=no_estimates,
        read_log=read_log,
    )
    d = Dashboard(gw)  # type: ignore[arg-type]
    pages = {
        # path -> (handler, match_info, the names it shows)
        "/ui/": (d.cluster, {}, ["n" + BAD, running]),
        "/ui/queue": (d.queue, {}, [running, pending, path]),
        "/ui/usage": (d.usage, {}, [path, owner]),
        "/ui/usage?team=llm": (d.usage, {}, [path, owner]),
        "/ui/budget": (d.budget, {}, [path, owner]),
        "/ui/workload/w": (d.workload, {"id": running}, [running, path, output]),
        "/ui/workload/q": (d.workload, {"id": pending}, [pending, path]),
        "/ui/workload/x": (d.workload, {"id": "x" + BAD}, ["x" + BAD]),
        "/ui/jobs?state=all": (d.jobs, {}, [running, pending, path]),
        "/ui/jobs?id=" + urllib.parse.quote(BAD): (d.jobs, {}, [BAD]),
        "/ui/login?next=" + urllib.parse.quote(BAD): (d.login_form, {}, [BAD]),
        "/ui/queue?error=" + urllib.parse.quote(BAD): (d.queue, {}, [BAD]),
    }
    live = {
        "cluster": ["n" + BAD, running],
        "queue": [running, pending, path],
        "usage&team=llm": [path, owner],
        "budget": [path, owner],
        "jobs&state=all": [running, pending, path],
        "workload&id=" + urllib.parse.quote(running): [running, path, output],
        "workload&id=" + urllib.parse.quote("x" + BAD): ["x" + BAD],
    }
    for which, names in live.items():
        pages["/ui/live?page=" + which] = (d.live, {}, names)
    for url, (handler, match, names) in pages.items():
        headers = {"Cookie": "apportion_token=ops"}
        resp = await handler(make_mocked_request("GET", url, headers=headers, match_info=match))
        assert resp.text is not None
        text = resp.text if "/live" not in url else json.loads(resp.text)["html"]
        page = Parsed(text)
        own = [{"src": "/ui/static/dashboard.js", "defer": None}] if "/live" not in url else []
        assert page.scripts == own, url
        for name in names:
            assert any(name in s for s in page.shown), (url, name)
        assert 'alert("x")' not in text and "alert(&#34;x&#34;)" in text, url
    # the budget page's forms carry the names as their values (the ops own the root)
    page = Parsed(
        (await d.budget(make_mocked_request("GET", "/ui/budget", headers=headers))).text or ""
    )
    assert path in page.shown and owner in page.shown


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
        # the Cancel button: for its submitter and the owners above its leaf only
        async with s.get(f"{url}/ui/workload/free1") as r2:
            assert "Cancel this workload" in await r2.text()
        # (llm/b is owned by b, under llm owned by alice, under the root owned by ops)
        for viewer, shown in (("mallory", False), ("vic", False), ("b", True), ("ops", True)):
            async with session() as other:
                assert (await login(other, url, viewer)).status == 303
                async with other.get(f"{url}/ui/workload/free1") as r2:
                    assert r2.status == 200
                    assert ("Cancel this workload" in await r2.text()) == shown, viewer
                if viewer == "mallory":  # no button, and the server refuses the request
                    async with other.post(
                        f"{url}/ui/workload/free1/cancel", allow_redirects=False
                    ) as r2:
                        assert r2.status == 303 and "error=" in r2.headers["Location"]
        async with s.post(f"{url}/ui/workload/free1/cancel", allow_redirects=False) as r2:
            assert r2.status == 303 and "ok=" in r2.headers["Location"]
        await eventually(lambda: gw.state.ended.get("free1") == "cancelled", what="cancelled")


@pytest.mark.nats
async def test_node_actions_and_hold_release_through_the_forms(
    jlog: JetStreamLog, creds: Credentials
) -> None:
    async with gateway_on(jlog, creds.authenticator) as gw, session() as ops, session() as a:
        url = gw.url
        assert (await login(ops, url, creds.tokens["ops"])).status == 303
        assert (await login(a, url, creds.tokens["a"])).status == 303
        # the root's owner drains a node with a reason: forwarded as his health change
        form = {"state": "draining", "reason": "fan noise"}
        async with ops.post(f"{url}/ui/node/h001/health", data=form, allow_redirects=False) as r:
            assert r.status == 303 and r.headers["Location"].startswith("/ui/?ok=")
        await eventually(lambda: gw.state.nodes["h001"].health == "draining", what="draining")
        change = gw.history.node_changes["h001"]
        assert change["actor"] == "ops" and change["reason"] == "fan noise"
        async with ops.get(f"{url}/ui/live?page=cluster") as r:
            html = (await r.json())["html"]
            assert "fan noise" in html and 'value="healthy">Undrain<' in html
        # a, no operator: no form, and the gateway refuses her post (the fold's 403)
        async with a.get(f"{url}/ui/") as r:
            text = await r.text()
            assert "fan noise" in text and "/health" not in text
        form = {"state": "down", "reason": "mine now"}
        async with a.post(f"{url}/ui/node/h000/health", data=form, allow_redirects=False) as r:
            where = urllib.parse.unquote_plus(r.headers["Location"])
            assert r.status == 303 and "refused (403)" in where
        assert gw.state.nodes["h000"].health == "healthy"
        # an unknown state is the API's 400
        form = {"state": "asleep"}
        async with ops.post(f"{url}/ui/node/h000/health", data=form, allow_redirects=False) as r:
            assert "refused (400)" in urllib.parse.unquote_plus(r.headers["Location"])
        # hold and release her own pending work from the queue page, back to it filtered
        form = {"owner": "llm/a", "gpus": "16", "min_runtime": "1h", "id": "gang"}
        async with a.post(f"{url}/ui/submit", data=form, allow_redirects=False) as r:
            assert r.status == 303
        await eventually(lambda: "gang" in gw.state.pending, what="gang pending")
        back = {"next": "/ui/queue?user=a"}
        async with a.post(f"{url}/ui/workload/gang/hold", data=back, allow_redirects=False) as r:
            assert r.headers["Location"] == "/ui/queue?user=a&ok=hold+of+gang+sent"
        await eventually(lambda: gw.state.pending["gang"].held, what="held")
        async with a.get(f"{url}/ui/live?page=queue&user=a") as r:
            html = (await r.json())["html"]
            assert '<code class="reason-code">held</code>' in html
            assert "/ui/workload/gang/release" in html
        # mallory may not release it: the page offers nothing, the gateway refuses
        async with session() as m:
            assert (await login(m, url, creds.tokens["mallory"])).status == 303
            async with m.get(f"{url}/ui/workload/gang") as r:
                assert "/release" not in await r.text()
            async with m.post(f"{url}/ui/workload/gang/release", allow_redirects=False) as r:
                where = urllib.parse.unquote_plus(r.headers["Location"])
                assert where.startswith("/ui/workload/gang?error=refused (403)")
        # a form's next leads nowhere but the dashboard
        evil = {"next": "//evil.example/x"}
        async with a.post(f"{url}/ui/workload/gang/release", data=evil, allow_redirects=False) as r:
            assert r.headers["Location"].startswith("/ui/workload/gang?ok=")
        await eventually(lambda: not gw.state.pending["gang"].held, what="released")
        # a filter out of its bound is a 400 with the API's reason
        async with a.get(f"{url}/ui/queue?state=ended") as r:
            assert r.status == 400 and "is not one of pending, running" in await r.text()


def test_the_usage_page_charts_owed_and_delivered_per_team() -> None:
    from apportion.services.dashboard_views import usage_history_html

    f = cluster_with_a_preemption()
    f.feed(at(submit("later", owner="vision", gpus=1, min_runtime_ms=HOUR), T0 + 6 * HOUR))
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


def test_a_new_clusters_usage_charts_span_its_data_and_say_what_each_pct_is() -> None:
    from apportion.services.dashboard_views import usage_history_html

    f = Folded()
    for e in small_cluster():
        f.feed(at(e, T0))
    f.feed(at(submit("paid", gpus=8, min_runtime_ms=HOUR), T0 + 60_000))
    f.feed(at(submit("more", owner="vision", gpus=4, min_runtime_ms=HOUR), T0 + 9 * 60_000))
    gw = SimpleNamespace(state=f.state, history=f.history, auth=None, url=None)
    # minutes of data, a 7-day window: the axis is the hour that holds the data
    out = usage_history_html(gw)  # type: ignore[arg-type]
    assert "last 1 h" in out and out.count('class="hour"') == 2  # one hour, two teams
    assert "the data covers only the last 1 h" in out and "not the 7 d window" in out
    whole = usage_history_html(gw, 24)  # type: ignore[arg-type]
    assert whole.count('class="hour"') == 2  # asking for a day: still only the data
    # the two percentages are told apart: a legend line and a tooltip on each header
    page = usage_html(gw)  # type: ignore[arg-type]
    assert "Two different percentages" in page
    assert re.search(r'<th title="usage ÷ allocation[^"]*">of allocation</th>', page)
    assert re.search(r'<th title="[^"]*÷ its global share[^"]*">usage vs share</th>', page)


def test_the_templates_layout_is_taken_out() -> None:
    """The loader drops the templates' indentation; a line break next to a tag goes,
    one inside running text (or before a tag that follows text) is a space."""
    from apportion.services.dashboard_views import compact

    source = """
    <p>
      a team is
      <b>owed</b> its share,
      {% if x %}
        <i>{{ x }}</i>
      {% endif %}
    </p>
    """
    assert (
        compact(source)
        == "<p>a team is <b>owed</b> its share,{% if x %}<i>{{ x }}</i>{% endif %}</p>"
    )
