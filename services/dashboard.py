"""The web dashboard the gateway serves under ``/ui/`` (server-rendered HTML, inline SVG).

Pages (see docs/dashboard.md):

| path | shows |
|---|---|
| ``/ui/`` | the cluster now: nodes by health (state, GPUs used / free, protected-until, the last change's reason; Drain / Undrain / Down for operators), GPUs in use, a GPU timeline of the last hours (preemptible work hatched, preemptions marked) |
| ``/ui/queue`` | pending work in queue order with its reason code and sentence, the sort-key ratios per level (and the estimated start where the API gives one), Hold / Release where the viewer may; running work; ``GET /v1/queue``'s filters; a submit form |
| ``/ui/usage`` | each budget node's usage against its allocation over the lookback window; per team, owed vs delivered hour by hour (:mod:`~apportion.services.usage_history`) |
| ``/ui/workload/{id}`` | why a workload is pending, preempted or placed where it is (the explain view), its attempts and their logs' locations, and the output of its last attempt (``?attempt=N``: another's) as the agents shipped it (the last :data:`LOG_LINES` lines) |
| ``/ui/jobs`` | ended (or any) workloads, newest first, searched by id, submitter, team, state, end time (``GET /v1/jobs``'s query) |
| ``/ui/budget`` | the budget tree, with forms to edit it (the fold decides who may) |
| ``/ui/live`` | JSON ``{"html": ...}``: the live part of a page, polled by the page's script |
| ``/v1/usage/history`` | JSON: the usage page's owed / delivered / used per hour (``?team=``, ``?hours=``), with the API's bearer token |

**Identity.** A browser cannot attach ``Authorization: Bearer`` to a page load,
so ``/ui/login`` takes the token once in a form, checks it with the gateway's
own :class:`~apportion.services.auth.Authenticator` and keeps it in a cookie
(:data:`COOKIE`: ``HttpOnly``, ``SameSite=Strict``, ``Path=/ui``). Every page
checks the cookie's token with the same authenticator on every request (a
revoked token stops working at once); without a valid one a page redirects to
the login form and ``/ui/live`` answers 401. The forms (submit, cancel, hold, release,
budget edits, node health) are forwarded to the JSON API (``/v1/...``) with the cookie's token as
the bearer credential, so the API's validation and the fold's authority rules
apply unchanged. A POST whose ``Origin`` is another site is refused (403).

With a gateway that authenticates nobody (``--no-auth``) the login form asks
for a name instead, which the forms send as the actor.

**How a page is built.** A handler here asks :mod:`.dashboard_views` for the
page's data (plain dicts and lists: rows, labels, the charts' geometry from
:mod:`.dashboard_charts`) and renders the page's Jinja2 template from
``dashboard_templates/`` with it; autoescaping is on, so nothing is escaped by
hand. ``/ui/live`` renders a page's live part (its ``*_live.html``) alone, from
the same data.
"""

from __future__ import annotations

import json
import urllib.parse
from importlib import resources
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from apportion.core.estimate import Estimates

from .auth import AuthError, check_principal
from .dashboard_views import (
    MAX_TIMELINE_HOURS,
    TimelineHistory,
    budget_data,
    budget_html,
    cluster_data,
    cluster_html,
    jobs_data,
    jobs_html,
    queue_data,
    queue_html,
    render,
    submit_data,
    usage_data,
    usage_html,
    workload_data,
)
from .usage_history import hours_in, usage_over_time

if TYPE_CHECKING:
    from .gateway import Gateway

COOKIE = "apportion_token"
"""The login cookie: the bearer token (or, without auth, the name acted as)."""
COOKIE_MAX_AGE_S = 12 * 3600
TIMELINE_HOURS = 6
"""How far back the cluster page's GPU timeline reaches by default (``?hours=`` changes it)."""
LOG_LINES = 200
"""The workload page shows the last this many lines of an attempt's output."""
STATIC = "dashboard_static"


# -- the routes ---------------------------------------------------------------------


class Dashboard:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def estimates(self) -> Estimates | None:
        """The gateway's start-time estimates of its folded state (computed once per
        state, off the event loop); ``None`` if they failed (a page without them)."""
        try:
            return await self.gw.estimates()
        except Exception:  # a page without estimates beats no page
            self.gw.logger.exception("dashboard: estimates failed")
            return None

    # identity
    def principal(self, request: web.Request) -> str | None:
        """Who the login cookie stands for, checked now; ``None`` if nobody."""
        return self._check_token(request.cookies.get(COOKIE, ""))

    def _require(self, request: web.Request) -> str:
        who = self.principal(request)
        if who is None:
            target = request.path_qs if request.method == "GET" else "/ui/"
            raise web.HTTPSeeOther("/ui/login?" + urllib.parse.urlencode({"next": target}))
        return who

    @staticmethod
    def _same_origin(request: web.Request) -> None:
        origin = request.headers.get("Origin")
        if origin and origin != "null":
            host = urllib.parse.urlsplit(origin).netloc
            if host != request.host:
                raise web.HTTPForbidden(text="cross-site form post refused")

    def _html(self, text: str, status: int = 200) -> web.Response:
        resp = web.Response(text=text, content_type="text/html", status=status)
        resp.headers.update(SECURITY_HEADERS)
        return resp

    def _page(
        self,
        request: web.Request,
        template: str,
        title: str,
        active: str = "",
        *,
        principal: str | None,
        live: str | None = None,
        status: int = 200,
        flash: tuple[str, bool] | None = None,
        **data: Any,
    ) -> web.Response:
        """``template`` (it extends ``base.html``) with the layout's data and ``flash``,
        the message and whether it is an error (default: ``?ok=`` / ``?error=``)."""
        message, error = self._flash(request) if flash is None else flash
        text = render(
            template,
            title=title,
            active=active,
            principal=principal,
            live=live,
            flash=message,
            error=error,
            **data,
        )
        return self._html(text, status=status)

    @staticmethod
    def _flash(request: web.Request) -> tuple[str, bool]:
        return request.query.get("ok") or request.query.get("error", ""), "error" in request.query

    # pages
    async def root(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/ui/")

    async def login_form(self, request: web.Request) -> web.Response:
        nxt = request.query.get("next", "/ui/")
        error = request.query.get("error", "")
        label = (
            "token"
            if self.gw.auth is not None
            else "name to act as (this gateway does not authenticate)"
        )
        return self._page(
            request,
            "login.html",
            "Sign in",
            principal=None,
            status=401 if error else 200,
            flash=(error, bool(error)),
            next=nxt,
            label=label,
        )

    async def login(self, request: web.Request) -> web.StreamResponse:
        self._same_origin(request)
        form = await request.post()
        token = str(form.get("token", "")).strip()
        nxt = _local(str(form.get("next", "")), "/ui/")
        who = self._check_token(token)
        if who is None:
            q = urllib.parse.urlencode({"next": nxt, "error": "unknown or revoked token"})
            raise web.HTTPSeeOther("/ui/login?" + q)
        resp = web.HTTPSeeOther(nxt)
        resp.set_cookie(
            COOKIE,
            token,
            httponly=True,
            samesite="Strict",
            path="/ui",
            max_age=COOKIE_MAX_AGE_S,
            secure=request.secure,
        )
        self.gw.logger.info("dashboard sign-in", principal=who)
        raise resp

    def _check_token(self, token: str) -> str | None:
        """Who ``token`` stands for (without auth: the name it is), or ``None``."""
        if not token:
            return None
        if self.gw.auth is None:
            try:
                return check_principal(token)
            except ValueError:
                return None
        try:
            return self.gw.auth.authenticate({"Authorization": f"Bearer {token}"})
        except AuthError:
            return None

    async def logout(self, request: web.Request) -> web.StreamResponse:
        self._same_origin(request)
        resp = web.HTTPSeeOther("/ui/login")
        resp.del_cookie(COOKIE, path="/ui")
        raise resp

    def _hours(self, request: web.Request) -> int:
        try:
            return min(max(int(request.query.get("hours", TIMELINE_HOURS)), 1), MAX_TIMELINE_HOURS)
        except ValueError:
            return TIMELINE_HOURS

    async def cluster(self, request: web.Request) -> web.Response:
        who = self._require(request)
        hours = self._hours(request)
        return self._page(
            request,
            "cluster.html",
            "Cluster now",
            "cluster",
            principal=who,
            live=f"cluster?hours={hours}",
            **cluster_data(self.gw, hours, who),
        )

    async def queue(self, request: web.Request) -> web.Response:
        who = self._require(request)
        data = queue_data(self.gw, await self.estimates(), who, request.query)
        return self._page(
            request,
            "queue.html",
            "Queue",
            "queue",
            principal=who,
            live="queue" + (f"?{data['live_query']}" if data["live_query"] else ""),
            status=400 if data["problem"] else 200,
            **data,
            **submit_data(self.gw.state),
        )

    @staticmethod
    def _usage_query(request: web.Request) -> tuple[int | None, str | None]:
        """``?hours=`` (``None``: the lookback window) and ``?team=`` of the usage page."""
        try:
            hours: int | None = int(request.query["hours"])
        except (KeyError, ValueError):
            hours = None
        return hours, request.query.get("team") or None

    async def usage(self, request: web.Request) -> web.Response:
        who = self._require(request)
        hours, team = self._usage_query(request)
        query = {
            **({"hours": str(hours)} if hours is not None else {}),
            **({"team": team} if team else {}),
        }
        return self._page(
            request,
            "usage.html",
            "Usage against budget",
            "usage",
            principal=who,
            live="usage" + ("?" + urllib.parse.urlencode(query) if query else ""),
            flash=("", False),
            **usage_data(self.gw, hours, team),
        )

    async def usage_history_api(self, request: web.Request) -> web.Response:
        """``GET /v1/usage/history[?team=T][&hours=N]``: owed, delivered and used GPU-ms
        per hour for every team (or team ``T``) and its users. Under ``/v1/``, so the
        gateway asks for the bearer token like every other API call."""
        hist = self.gw.history
        if not isinstance(hist, TimelineHistory):
            return web.json_response({"error": "this gateway keeps no usage history"}, status=404)
        team = request.query.get("team")
        hours = None
        if "hours" in request.query:
            most = hours_in(hist.usage.window_ms)
            try:
                hours = int(request.query["hours"])
            except ValueError:
                hours = 0
            if not 1 <= hours <= most:
                return web.json_response(
                    {"error": f"hours: a whole number from 1 to {most} (the lookback window)"},
                    status=400,
                )
        state = self.gw.state
        try:
            out = usage_over_time(
                hist.usage, state.budget, self.gw.now_ms(), team=team or None, hours=hours
            )
        except KeyError:
            return web.json_response({"error": f"no team {team!r}"}, status=404)
        return web.json_response(out, headers={"Cache-Control": "no-store"})

    async def workload_lookup(self, request: web.Request) -> web.StreamResponse:
        self._require(request)
        wid = request.query.get("id", "").strip()
        if not wid:
            raise web.HTTPSeeOther("/ui/queue")
        raise web.HTTPSeeOther("/ui/workload/" + urllib.parse.quote(wid, safe=""))

    async def _log(self, wid: str, attempt: str | None) -> dict[str, Any] | None:
        """The output of ``wid``'s attempt (the last if ``attempt`` is ``None``) as the
        API answers it (the gateway's own read: explain's authority), cut to its last
        :data:`LOG_LINES` lines; ``{"error": ...}`` for one it cannot give; ``None``
        for a workload not known or never placed."""
        from .gateway import _HttpError

        job = self.gw.history.job(wid)
        if job is None or not job["attempts"]:
            return None
        number = int(attempt) if attempt and attempt.isdigit() and len(attempt) < 10 else None
        try:
            body = await self.gw.read_log(wid, number, None, 0)
        except _HttpError as exc:
            return {"error": exc.reason}
        lines = body["text"].splitlines(keepends=True)
        body["cut"] = len(lines) > LOG_LINES
        body["lines"] = LOG_LINES
        body["text"] = "".join(lines[-LOG_LINES:])
        return body

    async def workload(self, request: web.Request) -> web.Response:
        who = self._require(request)
        wid = request.match_info["id"]
        attempt = request.query.get("attempt")
        live = {"id": wid, **({"attempt": attempt} if attempt else {})}
        return self._page(
            request,
            "workload.html",
            f"Workload {wid}",
            principal=who,
            live="workload?" + urllib.parse.urlencode(live),
            wid=wid,
            found=workload_data(self.gw, wid, await self.estimates(), who),
            log=await self._log(wid, attempt),
        )

    async def jobs(self, request: web.Request) -> web.Response:
        who = self._require(request)
        data = jobs_data(self.gw, request.query)
        return self._page(
            request,
            "jobs.html",
            "Jobs",
            "jobs",
            principal=who,
            live="jobs" + (f"?{data['live_query']}" if data["live_query"] else ""),
            status=400 if data["problem"] else 200,
            flash=("", False),
            **data,
        )

    async def budget(self, request: web.Request) -> web.Response:
        who = self._require(request)
        return self._page(
            request,
            "budget.html",
            "Budget tree",
            "budget",
            principal=who,
            live="budget",
            **budget_data(self.gw, who),
        )

    async def live(self, request: web.Request) -> web.Response:
        """The live part of a page as JSON ``{"html", "input_seq"}`` (polled by the script)."""
        who = self.principal(request)
        if who is None:
            return web.json_response({"error": "not signed in"}, status=401)
        which = request.query.get("page", "")
        if which == "cluster":
            text = cluster_html(self.gw, self._hours(request), who)
        elif which == "queue":
            text = queue_html(self.gw, await self.estimates(), who, request.query)
        elif which == "usage":
            text = usage_html(self.gw, *self._usage_query(request))
        elif which == "budget":
            text = budget_html(self.gw, who)
        elif which == "jobs":
            text = jobs_html(self.gw, request.query)
        elif which == "workload":
            wid = request.query.get("id", "")
            found = workload_data(self.gw, wid, await self.estimates(), who)
            log = await self._log(wid, request.query.get("attempt"))
            text = render("workload_live.html", wid=wid, found=found, log=log)
        else:
            return web.json_response({"error": f"no live page {which!r}"}, status=404)
        return web.json_response(
            {"html": text, "input_seq": self.gw.state.input_seq},
            headers={"Cache-Control": "no-store"},
        )

    # forms: forwarded to the JSON API with the cookie's token
    async def _api(self, request: web.Request, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        token = request.cookies.get(COOKIE, "")
        headers = {"Content-Type": "application/json"}
        if self.gw.auth is not None:
            headers["Authorization"] = f"Bearer {token}"
        base = self.gw.url or f"http://{request.host}"
        base = base.replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")
        timeout = aiohttp.ClientTimeout(total=30)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(base + path, data=json.dumps(body), headers=headers) as resp,
        ):
            try:
                answer = await resp.json(content_type=None)
            except ValueError:
                answer = {"error": await resp.text()}
            return resp.status, answer

    async def submit(self, request: web.Request) -> web.StreamResponse:
        self._same_origin(request)
        who = self._require(request)
        form = await request.post()
        try:
            body: dict[str, Any] = {
                "owner": str(form.get("owner", "")),
                "gpus": int(str(form.get("gpus", "0"))),
                "min_runtime_ms": _duration(str(form.get("min_runtime", ""))),
                "priority": int(str(form.get("priority", "0") or "0")),
                "resumable": form.get("resumable") is not None,
                "gpu_type": str(form.get("gpu_type", "any") or "any"),
            }
            if str(form.get("duration", "")).strip():
                body["duration_ms"] = _duration(str(form["duration"]))
        except ValueError as exc:
            raise web.HTTPSeeOther(_with("/ui/queue", error=str(exc))) from None
        if str(form.get("id", "")).strip():
            body["id"] = str(form["id"]).strip()
        if self.gw.auth is None:
            body["submitted_by"] = who
        status, answer = await self._api(request, "/v1/workloads", body)
        if status != 202:
            raise web.HTTPSeeOther(_with("/ui/queue", error=_reason(status, answer)))
        wid = answer["workload"]
        raise web.HTTPSeeOther(
            _with("/ui/workload/" + urllib.parse.quote(wid, safe=""), ok=f"submitted {wid}")
        )

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        return await self._workload_action(request, "cancel")

    async def hold(self, request: web.Request) -> web.StreamResponse:
        return await self._workload_action(request, "hold")

    async def release(self, request: web.Request) -> web.StreamResponse:
        return await self._workload_action(request, "release")

    async def _workload_action(self, request: web.Request, what: str) -> web.StreamResponse:
        """Cancel, hold or release: ``POST /v1/workloads/{id}/{what}`` as the signed-in
        principal; back to the form's ``next`` page (the queue) or the workload's page,
        with the API's refusal as the message."""
        self._same_origin(request)
        who = self._require(request)
        wid = request.match_info["id"]
        form = await request.post()
        body = {"actor": who} if self.gw.auth is None else {}
        quoted = urllib.parse.quote(wid, safe="")
        status, answer = await self._api(request, f"/v1/workloads/{quoted}/{what}", body)
        target = _local(str(form.get("next", "")), "/ui/workload/" + quoted)
        if status != 202:
            raise web.HTTPSeeOther(_with(target, error=_reason(status, answer)))
        raise web.HTTPSeeOther(_with(target, ok=f"{what} of {wid} sent"))

    async def node_health(self, request: web.Request) -> web.StreamResponse:
        """The node table's Drain / Undrain / Down: ``POST /v1/nodes/{node}/health``
        with the form's state and reason, as the signed-in principal (the gateway and
        the fold refuse anyone but an operator: the refusal comes back as a message)."""
        self._same_origin(request)
        who = self._require(request)
        node = request.match_info["node"]
        form = await request.post()
        body: dict[str, Any] = {
            "state": str(form.get("state", "")),
            "reason": str(form.get("reason", "")).strip(),
        }
        if self.gw.auth is None:
            body["actor"] = who
        status, answer = await self._api(
            request, f"/v1/nodes/{urllib.parse.quote(node, safe='')}/health", body
        )
        if status != 202:
            raise web.HTTPSeeOther(_with("/ui/", error=_reason(status, answer)))
        raise web.HTTPSeeOther(_with("/ui/", ok=f"{node}: {body['state']} sent"))

    async def budget_post(self, request: web.Request) -> web.StreamResponse:
        self._same_origin(request)
        who = self._require(request)
        form = await request.post()
        action = str(form.get("action", "set"))
        if "parent" in form:
            parent = str(form["parent"])
            name = str(form.get("name", "")).strip()
            path = f"{parent}/{name}" if parent else name
        else:
            path = str(form.get("path", ""))
        body: dict[str, Any] = {"actor": who} if self.gw.auth is None else {}
        if action == "remove":
            body["remove"] = [path]
        else:
            try:
                weight = int(str(form.get("weight", "")))
            except ValueError:
                raise web.HTTPSeeOther(
                    _with("/ui/budget", error="weight: a whole number")
                ) from None
            body["set"] = [{"path": path, "weight": weight, "owner": str(form.get("owner", ""))}]
        status, answer = await self._api(request, "/v1/budget", body)
        if status != 202:
            raise web.HTTPSeeOther(_with("/ui/budget", error=_reason(status, answer)))
        done = "removed" if action == "remove" else "saved"
        raise web.HTTPSeeOther(_with("/ui/budget", ok=f"{path or '(root)'} {done}"))

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC_TYPES:
            raise web.HTTPNotFound()
        data = resources.files("apportion.services").joinpath(STATIC, name).read_bytes()
        return web.Response(
            body=data,
            content_type=STATIC_TYPES[name],
            headers={"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"},
        )


STATIC_TYPES = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _duration(text: str) -> int:
    from apportion.replay.cluster_file import parse_duration_ms

    text = text.strip()
    if text in ("0", ""):
        return 0
    return parse_duration_ms(text)


def _local(target: str, default: str) -> str:
    """``target`` if it is a dashboard page (a path under ``/ui``), else ``default``:
    a form's ``next`` never leads off the dashboard."""
    return target if target.startswith("/ui") and not target.startswith("//") else default


def _with(path: str, **query: str) -> str:
    """``path`` with ``query`` added (a message: ``ok`` or ``error``), replacing one
    it had."""
    base, _, had = path.partition("?")
    kept = [(k, v) for k, v in urllib.parse.parse_qsl(had) if k not in ("ok", "error")]
    return base + "?" + urllib.parse.urlencode([*kept, *query.items()])


def _reason(status: int, answer: Any) -> str:
    reason = answer.get("error") if isinstance(answer, dict) else None
    return f"refused ({status}): {reason or answer}"


def add_dashboard(app: web.Application, gateway: Gateway) -> Dashboard:
    """Mount the dashboard's routes on ``app`` and give ``gateway`` a history that
    keeps the GPU timeline (call before the gateway follows the log)."""
    if not isinstance(gateway.history, TimelineHistory):
        was = gateway.history
        gateway.history = TimelineHistory(lambda: gateway.state, was.cluster, was.agent_work_dir)
    d = Dashboard(gateway)
    r = app.router
    r.add_get("/", d.root)
    r.add_get("/ui", d.root)
    r.add_get("/ui/", d.cluster)
    r.add_get("/ui/login", d.login_form)
    r.add_post("/ui/login", d.login)
    r.add_post("/ui/logout", d.logout)
    r.add_get("/ui/queue", d.queue)
    r.add_get("/ui/usage", d.usage)
    r.add_get("/ui/budget", d.budget)
    r.add_get("/ui/jobs", d.jobs)
    r.add_post("/ui/budget", d.budget_post)
    r.add_get("/ui/workload", d.workload_lookup)
    r.add_get("/ui/workload/{id}", d.workload)
    r.add_post("/ui/workload/{id}/cancel", d.cancel)
    r.add_post("/ui/workload/{id}/hold", d.hold)
    r.add_post("/ui/workload/{id}/release", d.release)
    r.add_post("/ui/submit", d.submit)
    r.add_post("/ui/node/{node}/health", d.node_health)
    r.add_get("/ui/live", d.live)
    r.add_get("/ui/static/{name}", d.static)
    r.add_get("/v1/usage/history", d.usage_history_api)
    return d
