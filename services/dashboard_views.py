"""What the dashboard's pages show, as data, and the templates that lay it out.

Every page is a Jinja2 template in ``dashboard_templates/`` (autoescaping on: text
from the event log is escaped where a template prints it, never by hand); the
functions here compute the numbers, labels and rows a template shows. A page
template extends ``base.html`` (the header, the navigation, the flash message) and
includes its live part (``*_live.html``), which ``/ui/live`` renders alone; the
charts are macros of ``charts.html`` over the geometry of :mod:`.dashboard_charts`.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from apportion.core.budget import ROOT
from apportion.core.refusals import hold_refusal
from apportion.core.rules.authority import cancel_authority_error, may_manage_node
from apportion.core.state import State
from apportion.schemas.bounds import MAX_REASON_LEN
from apportion.schemas.events import (
    HOUR_MS,
    NodeHealthChanged,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
)
from apportion.schemas.history import HistoryItem, InputItem

from . import dashboard_charts as charts
from . import views
from .job_history import STATE_GROUPS, STATES, JobQuery, QueryError, list_jobs
from .usage_history import UsageHistory, hours_in, usage_over_time
from .views import (
    QUEUE_STATES,
    History,
    QueueFilter,
    budget_tree,
    explain,
    iso,
    nodes_view,
    queue_view,
    span,
)

if TYPE_CHECKING:
    from .gateway import Gateway

MAX_TIMELINE_HOURS = 7 * 24
KEEP_RUNS_MS = MAX_TIMELINE_HOURS * HOUR_MS
TEMPLATES = Path(__file__).with_name("dashboard_templates")
NAV = [
    ("cluster", "/ui/", "Cluster"),
    ("queue", "/ui/queue", "Queue"),
    ("usage", "/ui/usage", "Usage"),
    ("jobs", "/ui/jobs", "Jobs"),
    ("budget", "/ui/budget", "Budget"),
]
JOBS_PAGE_LIMIT = 200
"""Rows the jobs page shows (newest first; ``?limit=`` up to the API's bound)."""
JOBS_SEARCH = ("id", "user", "team", "state", "since", "limit")
"""The jobs page's search fields: the query parameters of ``GET /v1/jobs``."""
QUEUE_SEARCH = ("user", "team", "state")
"""The queue page's filters: the query parameters of ``GET /v1/queue``."""


# -- what the timeline needs beyond the state ----------------------------------------


class Run:
    __slots__ = ("workload", "attempt", "gpus", "allocated", "start_ms", "end_ms", "preempted")

    def __init__(self, workload: str, attempt: int, gpus: int, allocated: bool, start_ms: int):
        self.workload = workload
        self.attempt = attempt
        self.gpus = gpus
        self.allocated = allocated
        self.start_ms = start_ms
        self.end_ms: int | None = None
        self.preempted: str | None = None


class TimelineHistory(History):
    """:class:`~apportion.services.views.History` that also remembers runs (placement
    to end), preemptions and health changes for the GPU timeline."""

    def __init__(
        self,
        state: Callable[[], State],
        cluster: str = "<cluster>",
        agent_work_dir: str | None = None,
    ) -> None:
        super().__init__(cluster, agent_work_dir)
        self._state = state
        self.runs: list[Run] = []
        self.open: dict[str, Run] = {}
        self.preemptions: list[tuple[int, str, str, int]] = []
        """``(at_ms, workload, reason, gpus)``."""
        self.health: list[tuple[int, str, str]] = []
        self.clock = 0
        self.usage = UsageHistory()
        """Hourly healthy, demanded and used GPU-time for owed vs delivered (the usage page)."""

    def record(self, items: Iterable[HistoryItem]) -> None:
        items = list(items)
        super().record(items)
        if not items:
            return
        self.usage.record(items)
        ended_by_input: list[Run] = []
        for item in items:
            if isinstance(item, InputItem):
                self.clock = max(self.clock, item.at_ms)
                e = item.event
                if isinstance(e, WorkloadFinished | WorkloadCancelled):
                    run = self.open.get(e.workload)
                    if run is not None and (
                        not isinstance(e, WorkloadFinished)
                        or e.attempt is None
                        or e.attempt == run.attempt
                    ):
                        run.end_ms = self.clock  # checked against the state below
                        del self.open[e.workload]
                        ended_by_input.append(run)
                elif isinstance(e, NodeHealthChanged):
                    self.health.append((self.clock, e.node, e.state))
                continue
            for d in item.batch.decisions:
                if isinstance(d, WorkloadPlaced):
                    run = Run(
                        d.workload,
                        d.attempt,
                        sum(s.gpus for s in d.placement),
                        d.allocated,
                        d.at_ms,
                    )
                    self.runs.append(run)
                    self.open[d.workload] = run
                elif isinstance(d, WorkloadPreempted):
                    run = self.open.pop(d.workload, None)
                    if run is not None:
                        run.end_ms = d.at_ms
                        run.preempted = d.reason
                    self.preemptions.append((d.at_ms, d.workload, d.reason, run.gpus if run else 0))
        self._reconcile(ended_by_input)

    def _reconcile(self, ended_by_input: list[Run]) -> None:
        """The state has the last word: a run it still has is open (an end report the
        fold refused), one it no longer has is closed."""
        state = self._state()
        running = state.running
        for run in ended_by_input:
            w = running.get(run.workload)
            if w is not None and w.attempt == run.attempt and run.workload not in self.open:
                run.end_ms = None
                self.open[run.workload] = run
        for wid, run in list(self.open.items()):
            w = running.get(wid)
            if w is None or w.attempt != run.attempt:
                run.end_ms = state.now_ms
                del self.open[wid]
        horizon = state.now_ms - KEEP_RUNS_MS
        if self.runs and self.runs[0].end_ms is not None and self.runs[0].end_ms < horizon:
            self.runs = [r for r in self.runs if r.end_ms is None or r.end_ms >= horizon]
            self.preemptions = [p for p in self.preemptions if p[0] >= horizon]
            self.health = [h for h in self.health if h[0] >= horizon]


# -- formatting (the templates' filters) ----------------------------------------------


def gpu_h(value: float) -> str:
    return f"{value:,.1f} GPU-h" if value < 1000 else f"{value:,.0f} GPU-h"


def fine(value: float) -> str:
    """GPU-hours with two decimals below 100 (a fresh cluster's first minutes show)."""
    return f"{value:,.2f} GPU-h" if value < 100 else gpu_h(value)


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def wall_ms() -> int:
    return int(time.time() * 1000)


def moment(ms: int | None, now_ms: int) -> dict[str, str] | None:
    """A time as the ``when`` macro shows it: ISO-8601 UTC and ``3 min ago``."""
    return None if ms is None else {"iso": iso(ms), "relative": views.relative(ms, now_ms)}


def leaves(state: State) -> list[str]:
    return sorted(p for p, n in state.budget.nodes.items() if p != ROOT and not n.children)


# -- the templates -------------------------------------------------------------------


class CompactLoader(jinja2.FileSystemLoader):
    """The templates with their source's layout taken out (:func:`compact`), so a
    template is written indented, one element a line, and the page is sent compact."""

    def get_source(
        self, environment: jinja2.Environment, template: str
    ) -> tuple[str, str, Callable[[], bool]]:
        source, filename, uptodate = super().get_source(environment, template)
        return compact(source), filename, uptodate


def compact(source: str) -> str:
    """``source`` with each line stripped of its indentation and empty lines dropped; a
    line break is dropped after a tag or a template tag (a line ending in ``>``, ``%}``
    or ``#}``) and before a closing tag or a template tag (a line starting with ``</``,
    ``{%`` or ``{#``), and is one space elsewhere: inside running text, and before an
    opening tag that follows text (``is`` / ``<b>owed</b>``)."""
    out = ""
    for line in source.splitlines():
        line = line.strip()
        if not line:
            continue
        glued = out.endswith((">", "%}", "#}")) or line.startswith(("</", "{%", "{#"))
        out += line if glued or not out else " " + line
    return out


ENV = jinja2.Environment(
    loader=CompactLoader(TEMPLATES),
    autoescape=True,
    undefined=jinja2.StrictUndefined,  # a name a template misspells fails, not shows ""
    auto_reload=False,  # the templates are part of the package: read once
)
ENV.filters.update(
    gpu_h=gpu_h,
    fine=fine,
    pct=pct,
    span=span,
    f1=lambda v: f"{v:.1f}",
    f2=lambda v: f"{v:.2f}",
)
ENV.globals["nav"] = NAV


def render(template: str, **data: Any) -> str:
    return ENV.get_template(template).render(**data)


def macro(name: str, *args: Any) -> str:
    """A macro of ``charts.html`` on its own (a chart outside a page)."""
    return str(getattr(ENV.get_template("charts.html").module, name)(*args))


def page(
    title: str,
    active: str,
    body: str,
    *,
    principal: str | None,
    live: str | None = None,
    flash: str = "",
    error: bool = False,
) -> str:
    """The layout every page template extends, around ``body`` (text, escaped; or
    markup a template rendered)."""
    return render(
        "page.html",
        title=title,
        active=active,
        body=body,
        principal=principal,
        live=live,
        flash=flash,
        error=error,
    )


# -- charts --------------------------------------------------------------------------


def timeline_svg(
    history: TimelineHistory, state: State, end_ms: int, hours: int, width: int = 900
) -> str:
    return macro("timeline", charts.timeline(history, state, end_ms, hours, width))


def usage_history_data(
    gw: Gateway, hours: int | None = None, team: str | None = None
) -> dict[str, Any] | None:
    """Per team: owed vs delivered hour by hour over the last ``hours`` (default:
    the lookback window; a chart each, one y-scale), with ``team`` also a chart per
    user of that team (one y-scale among them), and a table of every team's and
    user's totals. ``None`` without a :class:`TimelineHistory`."""
    hist = gw.history
    if not isinstance(hist, TimelineHistory):
        return None
    state = gw.state
    now = max(state.now_ms, wall_ms())
    most = hours_in(hist.usage.window_ms)
    asked = most if hours is None else min(max(hours, 1), most)
    # a new cluster: the axis spans the hours that hold data, not an empty window
    have = hist.usage.hours_of_data(now)
    n = min(asked, have)
    data = usage_over_time(hist.usage, state.budget, now, hours=n)
    teams = data["teams"]
    shown = next((t for t in teams if t["path"] == team and t["users"]), None)

    def href(h: int, path: str | None) -> str:
        return "/ui/usage?" + urllib.parse.urlencode(
            {"hours": str(h), **({"team": path} if path else {})}
        )

    def chart_top(rows: list[dict[str, Any]]) -> float:
        return max(
            [1.0]
            + [max(h["owed_gpu_ms"], h["used_gpu_ms"]) / HOUR_MS for r in rows for h in r["hours"]]
        )

    here = shown["path"] if shown else None
    top, start, count = chart_top(teams), data["start_ms"], data["hours"]
    users = shown["users"] if shown else []
    utop = chart_top(users)
    return {
        "window": span(n * HOUR_MS),
        "short": (
            None
            if n == asked
            else f"the data covers only the last {span(n * HOUR_MS)}: the charts span "
            f"it, not the {span(asked * HOUR_MS)} window"
        ),
        "choices": [
            {"href": href(h, here), "label": span(h * HOUR_MS), "active": h == asked}
            for h in sorted({h for h in (24, 72) if h < most} | {most})
        ],
        "teams": teams,
        "team_charts": [charts.usage_history(t, start, count, top) for t in teams],
        "pick": [
            {
                "href": href(asked, None if t is shown else t["path"]),
                "label": t["path"],
                "active": t is shown,
            }
            for t in teams
            if t["users"]
        ],
        "shown": here,
        "user_charts": [charts.usage_history(u, start, count, utop, kind="user") for u in users],
        "rows": [(0 if r is t else 1, r) for t in teams for r in [t, *t["users"]]],
    }


def usage_history_html(gw: Gateway, hours: int | None = None, team: str | None = None) -> str:
    data = usage_history_data(gw, hours, team)
    return "" if data is None else render("usage_history.html", history=data)


# -- the pages' data -----------------------------------------------------------------


NODE_ACTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "healthy": (("draining", "Drain"), ("down", "Down")),
    "draining": (("healthy", "Undrain"), ("down", "Down")),
    "down": (("healthy", "Undrain"),),
}
"""The node table's buttons by a node's health: the state each asks for
(``POST /v1/nodes/{node}/health``) and its label, as ``apportion node drain|undrain|down``."""


def cluster_data(gw: Gateway, hours: int, principal: str | None = None) -> dict[str, Any]:
    """The cluster page: tiles, the GPU timeline and the nodes by health (the rows of
    ``GET /v1/nodes``), each with the actions ``principal`` may take on it by the
    fold's rule (:func:`~apportion.core.rules.authority.may_manage_node`: operators
    and the root's owner); the gateway and the fold still check every request."""
    state = gw.state
    hist = gw.history
    now = max(state.now_ms, wall_ms())
    by_health: dict[str, int] = {"healthy": 0, "draining": 0, "down": 0}
    for n in state.nodes.values():
        by_health[n.health] = by_health.get(n.health, 0) + 1
    capacity = sum(n.gpus for n in state.nodes.values() if n.health != "down")
    alloc = sum(w.gpus for w in state.running.values() if w.allocated)
    unalloc = sum(w.gpus for w in state.running.values() if not w.allocated)
    rows_by_health: dict[str, list[dict[str, Any]]] = {}
    for row in nodes_view(state, hist, now_ms=now)["nodes"]:
        n = state.nodes[row["node"]]
        used = row["gpus"] - row["free"]
        al = sum(
            g
            for wid, g in n.workloads.items()
            if (w := state.running.get(wid)) is not None and w.allocated
        )
        change = row["last_change"]
        may = principal is not None and may_manage_node(state, principal, row["node"])
        rows_by_health.setdefault(row["state"], []).append(
            {
                **row,
                "used": used,
                "bar": charts.bar(used, al, row["gpus"]),
                "workloads": sorted(n.workloads.items()),
                "protected": moment(row["protected_until_ms"], now),
                "change": (
                    None if change is None else {**change, "when": moment(change["at_ms"], now)}
                ),
                "actions": NODE_ACTIONS.get(row["state"], ()) if may else (),
                "form": "node-" + row["node"],
            }
        )
    groups: list[dict[str, Any]] = [
        {"health": h, "nodes": rows_by_health[h]}
        for h in ("healthy", "draining", "down")
        if h in rows_by_health
    ]
    return {
        "tiles": [
            ("nodes healthy", by_health["healthy"]),
            ("draining", by_health["draining"]),
            ("down", by_health["down"]),
            ("GPUs in use", f"{alloc + unalloc} / {capacity}"),
            ("allocated", alloc),
            ("preemptible", unalloc),
            ("pending", len(state.pending)),
        ],
        "hours": hours,
        "choices": [
            {"href": f"/ui/?hours={h}", "label": f"{h} h", "active": h == hours}
            for h in (1, 6, 24, 168)
        ],
        "timeline": (
            charts.timeline(hist, state, now, hours) if isinstance(hist, TimelineHistory) else None
        ),
        "groups": groups,
        "operator": any(n["actions"] for g in groups for n in g["nodes"]),
        "reason_len": MAX_REASON_LEN,
        "as_of": moment(state.now_ms, now),
    }


def _estimate(row: dict[str, Any], now: int) -> dict[str, Any] | None:
    """The estimated start of a queue row, if the API gives one."""
    if "estimated_start_ms" not in row:
        return None
    value = row["estimated_start_ms"]
    if isinstance(value, int) and not isinstance(value, bool):
        return {"at": moment(value, now)}
    return {"at": None, "note": row.get("estimate_note") or "no estimate"}


def _share(k: dict[str, Any]) -> str:
    """A level of the sort key: usage as a percentage of share where the view gives it,
    else the ratio usage / weight."""
    if isinstance(k.get("share_pct"), int | float):
        return f"{k['share_pct']:.1f}% of share"
    return f"ratio {k['ratio']['value']:.3g}"


def may_act(state: State, principal: str | None, workload: str) -> dict[str, bool]:
    """Whether ``principal`` may hold, release and cancel ``workload`` now, by the
    fold's own rules (:func:`~apportion.core.refusals.hold_refusal`: pending and not
    held / held; :func:`~apportion.core.rules.authority.cancel_authority_error`: its
    submitter or an owner of its leaf or above, while it lives): a button shows only
    then; the gateway and the fold still check the request."""
    w = state.workloads.get(workload)
    if principal is None or w is None:
        return {"hold": False, "release": False, "cancel": False}
    return {
        "hold": hold_refusal(state, workload, principal, release=False) is None,
        "release": hold_refusal(state, workload, principal, release=True) is None,
        "cancel": cancel_authority_error(state, principal, w) is None,
    }


def search_form(query: Any, fields: Iterable[str]) -> tuple[dict[str, str], str]:
    """A search form's values (``fields`` of ``query``, stripped) and the query string
    of those given (the live part's and the ``next`` of its forms)."""
    query = query or {}
    form = {k: str(query.get(k, "")).strip() for k in fields}
    return form, urllib.parse.urlencode({k: v for k, v in form.items() if v})


def queue_data(
    gw: Gateway, estimates: Any = None, principal: str | None = None, query: Any = None
) -> dict[str, Any]:
    """The queue page: pending work in queue order, each with its reason code
    (:data:`~apportion.services.views.WAIT_REASONS`) and the Hold / Release the
    viewer may use, then running work; ``query``: ``GET /v1/queue``'s filters
    (``user``, ``team``, ``state``), or the reason one is out of its bound."""
    state = gw.state
    now = max(state.now_ms, wall_ms())
    form, live_query = search_form(query, QUEUE_SEARCH)
    out: dict[str, Any] = {
        "form": form,
        "live_query": live_query,
        "back": "/ui/queue" + (f"?{live_query}" if live_query else ""),
        "state_choices": QUEUE_STATES,
        "problem": None,
    }
    try:
        only = QueueFilter.parse({k: v for k, v in form.items() if v})
    except QueryError as exc:
        return {**out, "problem": str(exc)}
    q = queue_view(state, gw.history, now_ms=now, estimates=estimates, only=only)
    pending = [
        {
            **r,
            "typ": "" if r["gpu_type"] in ("", "any") else r["gpu_type"],
            "waiting": span(max(0, now - r["queued_ms"])),
            "levels": [
                {
                    "exact": k["ratio"]["exact"] if k["ratio"] else "",
                    "path": k["path"],
                    "share": _share(k),
                    "usage": k["usage_gpu_ms"] / HOUR_MS,
                    "weight": k["weight"],
                }
                for k in r["ratios"]
            ],
            "estimate": _estimate(r, now),
            "may": may_act(state, principal, r["workload"]),
        }
        for r in q["pending"]
    ]
    has_est = any(r["estimate"] is not None for r in pending)
    running = [
        {
            **r,
            "started": moment(r["started_ms"], now),
            "protected": moment(r["protected_until_ms"], now) if r["allocated"] else None,
            "kind": "allocated" if r["allocated"] else "preemptible",
        }
        for r in q["running"]
    ]
    return {
        **out,
        "pending": pending,
        "has_estimates": has_est,
        "assumption": q.get("estimate_assumption") if has_est else None,
        "actions": any(r["may"]["hold"] or r["may"]["release"] for r in pending),
        "running": running,
        "totals": q["totals"],
        "filtered": only != QueueFilter(),
    }


def submit_data(state: State) -> dict[str, Any]:
    return {
        "owners": leaves(state),
        "gpu_types": sorted({n.gpu_type for n in state.nodes.values()}),
    }


def usage_data(gw: Gateway, hours: int | None = None, team: str | None = None) -> dict[str, Any]:
    state = gw.state
    rows: list[dict[str, Any]] = []

    def walk(n: dict[str, Any]) -> None:
        if n["path"] != ROOT:
            rows.append({"committed_gpu_h": 0.0, **n, "depth": n["path"].count("/")})
        for c in n["children"]:
            walk(c)

    tree = budget_tree(state, detail=True)
    walk(tree)
    fed = tree.get("federation")
    return {
        "federation": fed,
        "peers": []
        if fed is None
        else views.peers_words(fed["peers"], max(state.now_ms, wall_ms())),
        "window": span(state.policy.lookback_ms),
        "chart": charts.usage_bars(rows),
        "rows": rows,
        "history": usage_history_data(gw, hours, team),
    }


DETAIL_LABELS = {
    "workload": "workload",
    "owner": "owner (budget leaf)",
    "gpus": "GPUs",
    "gpu_type": "GPU type",
    "min_runtime_ms": "minimum runtime",
    "resumable": "resumable",
    "priority": "priority",
    "allocated": "allocated (protected work)",
    "submitted_ms": "submitted",
    "queued_ms": "queued since",
    "status": "status",
    "attempt": "attempt",
    "preemptions": "preemptions",
    "duration_ms": "duration hint",
    "submitted_by": "submitted by",
    "held_by": "held by",
    "held_ms": "held since",
}
"""The workload page's Details: the API's field names (``GET /v1/workloads/{id}``)
as people say them."""


def detail_row(key: str, value: Any, now: int) -> dict[str, Any]:
    """One row of the Details: a human label, durations as ``2 h``, times as moments,
    booleans as yes / no, nothing as ``-``."""
    label = DETAIL_LABELS.get(key) or key.removesuffix("_ms").replace("_", " ")
    row: dict[str, Any] = {"key": label, "field": key, "at": None, "text": "-"}
    if value is None:
        row["text"] = "none given" if key == "duration_ms" else "-"
    elif isinstance(value, bool):
        row["text"] = "yes" if value else "no"
    elif key in ("min_runtime_ms", "duration_ms") and isinstance(value, int):
        unallocated = key == "min_runtime_ms" and value == 0
        row["text"] = "none (unallocated)" if unallocated else span(value)
    elif key.endswith("_ms") and isinstance(value, int):
        row["at"] = moment(value, now)
    elif key == "gpu_type" and value in ("", "any"):
        row["text"] = "any"
    else:
        row["text"] = value
    return row


def workload_data(
    gw: Gateway, workload: str, estimates: Any = None, principal: str | None = None
) -> dict[str, Any] | None:
    """The workload page: the explain view, its attempts and details, and what
    ``principal`` may do to it (:func:`may_act`)."""
    state = gw.state
    now = max(state.now_ms, wall_ms())
    out = explain(state, gw.history, workload, now_ms=now, estimates=estimates)
    if out is None:
        return None
    details = [detail_row(k, v, now) for k, v in (out.get("detail") or {}).items()]
    w = state.running.get(workload)
    live = state.workloads.get(workload)
    job = out.get("job")
    attempts = [
        {
            **a,
            "start": moment(a["start_ms"], now),
            "stop": moment(a["end_ms"], now),
            "how": _how_it_ended(a),
            "started_logs": [g for g in a["logs"] if g["started_ms"] is not None],
        }
        for a in (job["attempts"] if job else [])
    ]
    return {
        "status": out["status"],
        "held_by": live.held_by if live is not None and live.held else None,
        "may": may_act(state, principal, workload),
        "reason": out.get("reason"),
        "reason_text": out.get("reason_text"),
        "reasons": out.get("reasons", []),
        "attempts": attempts,
        "details": details,
        "placement": [(s.node, s.gpus) for s in w.placement] if w is not None else None,
        "since": moment(w.started_ms, now) if w is not None else None,
    }


def jobs_data(gw: Gateway, query: Any) -> dict[str, Any]:
    """The jobs page: the search form's values and the jobs they match (the rows of
    ``GET /v1/jobs``), or the reason a field is out of its bound."""
    state = gw.state
    now = max(state.now_ms, wall_ms())
    form, live_query = search_form(query, JOBS_SEARCH)
    given = {k: v for k, v in form.items() if v}
    given.setdefault("limit", str(JOBS_PAGE_LIMIT))
    out: dict[str, Any] = {
        "form": form,
        "choices": [*STATE_GROUPS, *STATES],
        "live_query": live_query,
        "rows": [],
        "matched": 0,
        "truncated": False,
        "kept": None,
        "problem": None,
    }
    try:
        parsed = JobQuery.parse(given, now)
    except QueryError as exc:
        out["problem"] = str(exc)
        return out
    found = list_jobs(gw.history.jobs, parsed, now)
    out["rows"] = [
        {
            **r,
            "typ": "" if r["gpu_type"] in ("", "any") else r["gpu_type"],
            "submitted": moment(r["submitted_ms"], now),
            "ended": moment(r["ended_ms"], now),
        }
        for r in found["jobs"]
    ]
    out.update(matched=found["matched"], truncated=found["truncated"], kept=found["kept"])
    return out


def _how_it_ended(a: dict[str, Any]) -> str:
    """An attempt's end in a few words: ``finished (failed)``, ``preempted (fairshare,
    for w-2)``, ``node down``, ``cancelled``, ``running``."""
    end, pre = a["end"], a["preemption"]
    if end is None:
        return "stopping (notice)" if pre is not None else "running"
    if end == "finished":
        return f"finished ({a['outcome']})"
    if end in ("preempted", "node_down") and pre is not None:
        words = f"preempted ({pre['reason']}"
        words += f", for {pre['for_workload']})" if pre.get("for_workload") else ")"
        if end == "node_down" and pre["reason"] != "node_down":
            words += ", then node down"
        return words + (", requeued" if pre["requeued"] else "")
    return str(end).replace("_", " ")


def budget_data(gw: Gateway, principal: str | None) -> dict[str, Any]:
    """The budget tree, depth first; a row's form where the fold's own rule
    (:meth:`~apportion.core.budget.BudgetTree.may_edit`) lets ``principal`` edit it."""
    state = gw.state
    tree = state.budget
    rows: list[dict[str, Any]] = []

    def row(n: dict[str, Any]) -> None:
        path = n["path"]
        editable = principal is not None and tree.may_edit(principal, path)
        rows.append(
            {
                **n,
                "depth": 0 if path == ROOT else path.count("/") + 1,
                "name": path or "(root)",
                "form": ("edit-" + (path.replace("/", "--") or "root")) if editable else None,
                "removable": path != ROOT and not n["children"],
            }
        )
        for c in n["children"]:
            row(c)

    row(budget_tree(state))
    mine = [p for p, n in sorted(tree.nodes.items()) if principal and n.owner == principal]
    return {"rows": rows, "mine": mine}


# -- the live parts of the pages, as HTML ----------------------------------------------


def cluster_html(gw: Gateway, hours: int, principal: str | None = None) -> str:
    return render("cluster_live.html", **cluster_data(gw, hours, principal))


def queue_html(
    gw: Gateway, estimates: Any = None, principal: str | None = None, query: Any = None
) -> str:
    return render("queue_live.html", **queue_data(gw, estimates, principal, query))


def usage_html(gw: Gateway, hours: int | None = None, team: str | None = None) -> str:
    return render("usage_live.html", **usage_data(gw, hours, team))


def workload_html(
    gw: Gateway, workload: str, estimates: Any = None, principal: str | None = None
) -> str | None:
    data = workload_data(gw, workload, estimates, principal)
    return (
        None if data is None else render("workload_live.html", wid=workload, found=data, log=None)
    )


def jobs_html(gw: Gateway, query: Any) -> str:
    return render("jobs_live.html", **jobs_data(gw, query))


def budget_html(gw: Gateway, principal: str | None) -> str:
    return render("budget_live.html", principal=principal, **budget_data(gw, principal))
