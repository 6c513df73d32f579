"""The web dashboard the gateway serves under ``/ui/`` (server-rendered HTML, inline SVG).

Pages (see docs/dashboard.md):

| path | shows |
|---|---|
| ``/ui/`` | the cluster now: nodes by health, GPUs in use, a GPU timeline of the last hours (preemptible work hatched, preemptions marked) |
| ``/ui/queue`` | pending work in queue order with the sort-key ratios per level (and the estimated start where the API gives one), running work, a submit form |
| ``/ui/usage`` | each budget node's usage against its allocation over the lookback window; per team, owed vs delivered hour by hour (:mod:`~apportion.services.usage_history`) |
| ``/ui/workload/{id}`` | why a workload is pending, preempted or placed where it is (the explain view) |
| ``/ui/budget`` | the budget tree, with forms to edit it (the fold decides who may) |
| ``/ui/live`` | JSON ``{"html": ...}``: the live part of a page, polled by the page's script |
| ``/v1/usage/history`` | JSON: the usage page's owed / delivered / used per hour (``?team=``, ``?hours=``), with the API's bearer token |

**Identity.** A browser cannot attach ``Authorization: Bearer`` to a page load,
so ``/ui/login`` takes the token once in a form, checks it with the gateway's
own :class:`~apportion.services.auth.Authenticator` and keeps it in a cookie
(:data:`COOKIE`: ``HttpOnly``, ``SameSite=Strict``, ``Path=/ui``). Every page
checks the cookie's token with the same authenticator on every request (a
revoked token stops working at once); without a valid one a page redirects to
the login form and ``/ui/live`` answers 401. The forms (submit, cancel, budget
edits) are forwarded to the JSON API (``/v1/...``) with the cookie's token as
the bearer credential, so the API's validation and the fold's authority rules
apply unchanged. A POST whose ``Origin`` is another site is refused (403).

With a gateway that authenticates nobody (``--no-auth``) the login form asks
for a name instead, which the forms send as the actor.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import time
import urllib.parse
from collections.abc import Callable, Iterable
from importlib import resources
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from apportion.core.budget import ROOT
from apportion.core.estimate import Estimates
from apportion.core.state import State
from apportion.schemas.events import (
    HOUR_MS,
    NodeHealthChanged,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
)
from apportion.schemas.history import HistoryItem, InputItem

from . import views
from .auth import AuthError, check_principal
from .usage_history import UsageHistory, hours_in, usage_over_time
from .views import History, budget_tree, explain, iso, queue_view, span

if TYPE_CHECKING:
    from .gateway import Gateway

COOKIE = "apportion_token"
"""The login cookie: the bearer token (or, without auth, the name acted as)."""
COOKIE_MAX_AGE_S = 12 * 3600
TIMELINE_HOURS = 6
"""How far back the cluster page's GPU timeline reaches by default (``?hours=`` changes it)."""
MAX_TIMELINE_HOURS = 7 * 24
KEEP_RUNS_MS = MAX_TIMELINE_HOURS * HOUR_MS
STATIC = "dashboard_static"


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

    def __init__(self, state: Callable[[], State]) -> None:
        super().__init__()
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


# -- formatting ---------------------------------------------------------------------


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def relative(ms: int | None, now_ms: int) -> str:
    """The views' ``in 2 h 14 min`` / ``3 min ago``, or ``-`` for no time."""
    return "-" if ms is None else views.relative(ms, now_ms)


def when(ms: int | None, now_ms: int) -> str:
    if ms is None:
        return "-"
    stamp = esc(iso(ms))
    return f'<time datetime="{stamp}" title="{stamp}">{esc(relative(ms, now_ms))}</time>'


def gpu_h(value: float) -> str:
    return f"{value:,.1f} GPU-h" if value < 1000 else f"{value:,.0f} GPU-h"


def fine(value: float) -> str:
    """GPU-hours with two decimals below 100 (a fresh cluster's first minutes show)."""
    return f"{value:,.2f} GPU-h" if value < 100 else gpu_h(value)


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def wall_ms() -> int:
    return int(time.time() * 1000)


def leaves(state: State) -> list[str]:
    return sorted(p for p, n in state.budget.nodes.items() if p != ROOT and not n.children)


# -- charts (inline SVG) ------------------------------------------------------------


def timeline_svg(
    history: TimelineHistory, state: State, end_ms: int, hours: int, width: int = 900
) -> str:
    """GPUs in use over ``[end - hours, end]``: allocated work solid, unallocated
    (preemptible) work hatched above it, capacity as a line, preemptions as red marks."""
    height, left, right, top, bottom = 220, 48, 12, 12, 28
    start_ms = end_ms - hours * HOUR_MS
    capacity = sum(n.gpus for n in state.nodes.values() if n.health != "down")
    total = max(capacity, sum(n.gpus for n in state.nodes.values()), 1)
    # step function from run starts and ends
    deltas: dict[int, list[int]] = {}
    for r in history.runs:
        end = r.end_ms if r.end_ms is not None else end_ms
        if end < start_ms:
            continue
        s = max(r.start_ms, start_ms)
        k = 0 if r.allocated else 1
        deltas.setdefault(s, [0, 0])[k] += r.gpus
        if end < end_ms:
            deltas.setdefault(end, [0, 0])[k] -= r.gpus
    t_list = sorted(deltas)
    alloc = free = 0
    points: list[tuple[int, int, int]] = [(start_ms, 0, 0)]
    for t in t_list:
        alloc += deltas[t][0]
        free += deltas[t][1]
        points.append((max(t, start_ms), alloc, free))
    points.append((end_ms, alloc, free))
    pw, ph = width - left - right, height - top - bottom

    def x(t: int) -> float:
        return left + pw * (t - start_ms) / max(end_ms - start_ms, 1)

    def y(g: float) -> float:
        return top + ph * (1 - g / total)

    def area(lower: Callable[[tuple[int, int, int]], int], upper: Callable[..., int]) -> str:
        up: list[str] = []
        low: list[str] = []
        for i, p in enumerate(points):
            nxt = points[i + 1][0] if i + 1 < len(points) else p[0]
            up += [f"{x(p[0]):.1f},{y(upper(p)):.1f}", f"{x(nxt):.1f},{y(upper(p)):.1f}"]
            low += [f"{x(p[0]):.1f},{y(lower(p)):.1f}", f"{x(nxt):.1f},{y(lower(p)):.1f}"]
        return " ".join(up + low[::-1])

    alloc_poly = area(lambda p: 0, lambda p: p[1])
    free_poly = area(lambda p: p[1], lambda p: p[1] + p[2])
    out = [
        f'<svg id="gpu-timeline" class="chart" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="GPUs in use over the last {hours} hours">',
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fde9c4"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#e0a030" stroke-width="3"/></pattern></defs>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plot"/>',
    ]
    for g in sorted({0, total // 2, total}):
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y(g):.1f}" y2="{y(g):.1f}" class="grid"/>'
            f'<text x="{left - 6}" y="{y(g) + 4:.1f}" class="ylabel">{g}</text>'
        )
    step = max(1, hours // 6) * HOUR_MS
    tick = start_ms - start_ms % step + step
    while tick <= end_ms:
        label = dt.datetime.fromtimestamp(tick / 1000, dt.UTC).strftime(
            "%H:%M" if hours <= 24 else "%d %H:%M"
        )
        out.append(
            f'<line x1="{x(tick):.1f}" x2="{x(tick):.1f}" y1="{top}" y2="{top + ph}" class="grid"/>'
            f'<text x="{x(tick):.1f}" y="{height - 8}" class="xlabel">{label}</text>'
        )
        tick += step
    out.append(
        f'<polygon class="allocated" points="{alloc_poly}"><title>allocated</title></polygon>'
    )
    out.append(
        f'<polygon class="unallocated" fill="url(#hatch)" points="{free_poly}">'
        "<title>unallocated (preemptible)</title></polygon>"
    )
    out.append(
        f'<line class="capacity" x1="{left}" x2="{left + pw}" y1="{y(capacity):.1f}" '
        f'y2="{y(capacity):.1f}"><title>healthy capacity: {capacity} GPUs</title></line>'
    )
    for at, wid, reason, gpus in history.preemptions:
        if start_ms <= at <= end_ms:
            px = x(at)
            out.append(
                f'<path class="preemption" d="M{px:.1f},{top} l-5,-9 h10 z"/>'
                f'<line class="preemption" x1="{px:.1f}" x2="{px:.1f}" y1="{top}" y2="{top + ph}">'
                f"<title>{esc(iso(at))}: {esc(wid)} preempted ({esc(reason)}, {gpus} GPUs)</title></line>"
            )
    out.append("</svg>")
    return "".join(out)


def bar_svg(used: int, allocated: int, total: int, width: int = 160) -> str:
    """A node's GPUs: allocated work solid, unallocated hatched, the rest free."""
    total = max(total, 1)
    a = width * used / total
    u = width * allocated / total
    return (
        f'<svg class="bar" viewBox="0 0 {width} 14" width="{width}" height="14">'
        f'<rect width="{width}" height="14" class="free"/>'
        f'<rect width="{u:.1f}" height="14" class="allocated"/>'
        f'<rect x="{u:.1f}" width="{max(a - u, 0):.1f}" height="14" fill="url(#hatch-small)" class="unallocated"/>'
        "</svg>"
    )


HATCH_DEFS = (
    '<svg width="0" height="0" class="defs" aria-hidden="true"><defs>'
    '<pattern id="hatch-small" width="5" height="5" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)"><rect width="5" height="5" fill="#fde9c4"/>'
    '<line x1="0" y1="0" x2="0" y2="5" stroke="#e0a030" stroke-width="2.5"/></pattern>'
    "</defs></svg>"
)


def usage_svg(rows: list[dict[str, Any]], width: int = 900) -> str:
    """One bar per budget node: usage over the window (solid), the rest of its running
    work's protection (committed, light) against its allocation (the tick)."""
    row_h, left, right = 24, 220, 120
    height = row_h * len(rows) + 30
    top_val = max(
        [1e-9]
        + [
            max(r["usage_gpu_h"] + r.get("committed_gpu_h", 0.0), r["allocation_gpu_h"])
            for r in rows
        ]
    )
    pw = width - left - right
    out = [
        f'<svg id="usage-chart" class="chart" viewBox="0 0 {width} {height}" role="img" '
        'aria-label="usage against allocation over the lookback window">'
    ]
    for i, r in enumerate(rows):
        y = 10 + i * row_h
        depth = r["path"].count("/")
        used, committed, allocation = (
            r["usage_gpu_h"],
            r.get("committed_gpu_h", 0.0),
            r["allocation_gpu_h"],
        )
        uw = pw * used / top_val
        cw = pw * committed / top_val
        ax = left + pw * allocation / top_val
        over = used > allocation
        out.append(
            f'<text x="{8 + 14 * depth}" y="{y + 15}" class="label">{esc(r["path"])}</text>'
            f'<rect x="{left}" y="{y + 3}" width="{pw}" height="16" class="track"/>'
            f'<rect x="{left}" y="{y + 3}" width="{uw:.1f}" height="16" '
            f'class="{"over" if over else "used"}"><title>{esc(r["path"])}: '
            f"{esc(gpu_h(used))} used of {esc(gpu_h(allocation))}</title></rect>"
            f'<rect x="{left + uw:.1f}" y="{y + 3}" width="{cw:.1f}" height="16" class="committed">'
            f"<title>{esc(r['path'])}: {esc(gpu_h(committed))} committed by running work's "
            "protection</title></rect>"
            f'<line x1="{ax:.1f}" x2="{ax:.1f}" y1="{y}" y2="{y + 22}" class="allocation"/>'
            f'<text x="{left + pw + 8}" y="{y + 15}" class="value">'
            f"{esc(pct(used / allocation) if allocation else '-')}</text>"
        )
    out.append("</svg>")
    return "".join(out)


OWED_COLOR = "#1d2330"
DELIVERED_COLOR = "#3b6fd8"
USED_COLOR = "#e0a030"


def _hour_ticks(start_ms: int, n: int) -> list[tuple[int, str]]:
    """Hour indices to label on a time axis of ``n`` hours from ``start_ms``: every
    few hours for a day or two (``14:00``), else each midnight (``Mon 30``)."""
    out: list[tuple[int, str]] = []
    every = 3 if n <= 24 else 6 if n <= 48 else 24
    for i in range(n + 1):
        t = start_ms + i * HOUR_MS
        stamp = dt.datetime.fromtimestamp(t / 1000, dt.UTC)
        if stamp.hour % every:
            continue
        label = (
            stamp.strftime("%a %d") if every == 24 or stamp.hour == 0 else stamp.strftime("%H:%M")
        )
        out.append((i, label))
    return out


def usage_history_svg(
    team: dict[str, Any], start_ms: int, n: int, top: float, width: int = 900, kind: str = "team"
) -> str:
    """One team's (or user's) hours: delivered GPU-hours as a filled area, owed as a
    line, its allocated use (uncapped) as a dashed line; ``top`` (GPU-h per hour) is
    the y-scale shared by every chart shown beside it."""
    height, left, right, top_pad, bottom = (190 if kind == "team" else 150), 48, 12, 26, 28
    pw, ph = width - left - right, height - top_pad - bottom
    top = max(top, 1e-9)
    hours = team["hours"]

    def x(i: float) -> float:
        return left + pw * i / max(n, 1)

    def y(gpu_ms: float) -> float:
        return top_pad + ph * (1 - min(gpu_ms / HOUR_MS / top, 1.0))

    def steps(key: str) -> list[tuple[float, float]]:
        pts: list[tuple[float, float]] = []
        for i, h in enumerate(hours):
            v = y(h[key])
            pts += [(x(i), v), (x(i + 1), v)]
        return pts

    def line(pts: list[tuple[float, float]]) -> str:
        return "M" + " L".join(f"{a:.1f},{b:.1f}" for a, b in pts) if pts else ""

    path = team["path"]
    ratio = team["delivery_ratio"]
    summary = (
        f"{path}: delivered {gpu_h(team['delivered_gpu_h'])} of {gpu_h(team['owed_gpu_h'])} owed"
        + (f" ({pct(ratio)})" if ratio is not None else "")
        + f", used {gpu_h(team['used_gpu_h'])}"
    )
    slug = "".join(c if c.isalnum() else "-" for c in path)
    out = [
        f'<svg id="usage-history-{esc(slug)}" class="chart usage-history {kind}" data-path="{esc(path)}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{esc(summary)}">',
        f"<title>{esc(summary)}</title>",
        f'<rect x="{left}" y="{top_pad}" width="{pw}" height="{ph}" class="plot"/>',
    ]
    for g in sorted({0.0, top / 2, top}):
        gy = top_pad + ph * (1 - g / top)
        label = f"{g:.0f}" if top >= 4 else f"{g:.1f}"
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{gy:.1f}" y2="{gy:.1f}" class="grid"/>'
            f'<text x="{left - 6}" y="{gy + 4:.1f}" class="ylabel">{label}</text>'
        )
    for i, label in _hour_ticks(start_ms, n):
        out.append(
            f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{top_pad}" y2="{top_pad + ph}" class="grid"/>'
            f'<text x="{x(i):.1f}" y="{height - 8}" class="xlabel">{esc(label)}</text>'
        )
    delivered = steps("delivered_gpu_ms")
    if delivered:
        base = y(0)
        poly = [(delivered[0][0], base), *delivered, (delivered[-1][0], base)]
        out.append(
            f'<polygon class="h-delivered" fill="{DELIVERED_COLOR}" fill-opacity="0.45" '
            f'points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in poly)}">'
            "<title>delivered: allocated GPU-hours run, up to what was owed</title></polygon>"
        )
        out.append(
            f'<path class="h-used" d="{line(steps("used_gpu_ms"))}" fill="none" stroke="{USED_COLOR}" '
            'stroke-width="1.5" stroke-dasharray="4 3"><title>used: allocated GPU-hours run '
            "(not capped)</title></path>"
        )
        out.append(
            f'<path class="h-owed" d="{line(steps("owed_gpu_ms"))}" fill="none" stroke="{OWED_COLOR}" '
            'stroke-width="1.6"><title>owed: global share of the healthy GPU-hours, capped at '
            "demand</title></path>"
        )
    # hover targets: one per hour with its numbers
    for i, h in enumerate(hours):
        when_ = dt.datetime.fromtimestamp(h["start_ms"] / 1000, dt.UTC).strftime("%a %d %H:00Z")
        out.append(
            f'<rect class="hour" x="{x(i):.1f}" y="{top_pad}" width="{max(x(i + 1) - x(i), 0.1):.2f}" '
            f'height="{ph}" fill="transparent"><title>{esc(when_)}: owed '
            f"{h['owed_gpu_ms'] / HOUR_MS:.2f}, delivered {h['delivered_gpu_ms'] / HOUR_MS:.2f}, "
            f"used {h['used_gpu_ms'] / HOUR_MS:.2f}, demand {h['demand_gpu_ms'] / HOUR_MS:.2f} "
            "GPU-h</title></rect>"
        )
    # the legend, inside the chart (the page's style sheet needs nothing more)
    lx = left + 4
    out.append(
        f'<text x="{lx}" y="16" class="label" font-weight="600">{esc(path)}</text>'
        f'<g class="legend" transform="translate({left + pw - 430},6)">'
        f'<rect width="14" height="10" fill="{DELIVERED_COLOR}" fill-opacity="0.45"/>'
        '<text x="18" y="10" class="value">delivered</text>'
        f'<line x1="90" x2="110" y1="5" y2="5" stroke="{OWED_COLOR}" stroke-width="1.6"/>'
        '<text x="114" y="10" class="value">owed (share, capped at demand)</text>'
        f'<line x1="320" x2="340" y1="5" y2="5" stroke="{USED_COLOR}" stroke-width="1.5" '
        'stroke-dasharray="4 3"/><text x="344" y="10" class="value">used</text></g>'
    )
    out.append("</svg>")
    return "".join(out)


def usage_history_html(gw: Gateway, hours: int | None = None, team: str | None = None) -> str:
    """Per team: owed vs delivered hour by hour over the last ``hours`` (default:
    the lookback window; a chart each, one y-scale), with ``team`` also a chart per
    user of that team (one y-scale among them), and a table of every team's and
    user's totals."""
    hist = gw.history
    if not isinstance(hist, TimelineHistory):
        return ""
    state = gw.state
    now = max(state.now_ms, wall_ms())
    most = hours_in(hist.usage.window_ms)
    n = most if hours is None else min(max(hours, 1), most)
    data = usage_over_time(hist.usage, state.budget, now, hours=n)
    teams = data["teams"]
    choices = sorted({h for h in (24, 72) if h < most} | {most})
    shown = next((t for t in teams if t["path"] == team and t["users"]), None)

    def href(h: int, path: str | None) -> str:
        query = {"hours": str(h), **({"team": path} if path else {})}
        return esc("/ui/usage?" + urllib.parse.urlencode(query))

    here = shown["path"] if shown else None
    links = " ".join(
        f'<a href="{href(h, here)}"{" class=active" if h == n else ""}>{esc(span(h * HOUR_MS))}</a>'
        for h in choices
    )
    out = [
        f"<h2>Allocation usage over time, last {esc(span(n * HOUR_MS))} <small>{links}</small></h2>",
        "<p>Hour by hour (UTC), as the simulator's KPIs count it: a team or user is "
        "<b>owed</b> its global share of the hour's healthy GPU-hours, but no more than it "
        "asked for (the GPU-hours of its allocated work pending or running); "
        "<b>delivered</b> is the allocated GPU-hours it ran, up to what it was owed; "
        "<b>used</b> is what it ran, not capped. Every chart has the same scale "
        "(GPU-hours per hour: average GPUs). JSON: <code>/v1/usage/history?team=...</code>.</p>",
    ]
    if not teams:
        out.append('<p class="empty">no teams in the budget tree</p>')
        return "".join(out)
    top = max(
        [1.0]
        + [max(h["owed_gpu_ms"], h["used_gpu_ms"]) / HOUR_MS for t in teams for h in t["hours"]]
    )
    for t in teams:
        out.append(usage_history_svg(t, data["start_ms"], data["hours"], top))
    pick = " · ".join(
        f'<a href="{href(n, None if t is shown else t["path"])}"'
        f"{' class=active' if t is shown else ''}>{esc(t['path'])}</a>"
        for t in teams
        if t["users"]
    )
    if pick:
        out.append(f'<p class="muted">Each user of a team, hour by hour: {pick}</p>')
    if shown is not None:
        users = shown["users"]
        utop = max(
            [1.0]
            + [max(h["owed_gpu_ms"], h["used_gpu_ms"]) / HOUR_MS for u in users for h in u["hours"]]
        )
        out.append(f"<h3>Users of {esc(shown['path'])}</h3>")
        for u in users:
            out.append(usage_history_svg(u, data["start_ms"], data["hours"], utop, kind="user"))
    out.append(
        '<table class="usage-history"><tr><th>team / user</th><th>global share</th>'
        "<th>owed</th><th>delivered</th><th>delivered / owed</th><th>used</th>"
        "<th>demand</th></tr>"
    )
    for t in teams:
        for r in [t, *t["users"]]:
            depth = 0 if r is t else 1
            ratio = r["delivery_ratio"]
            out.append(
                f'<tr data-path="{esc(r["path"])}"><td class="d{depth}">{esc(r["path"])}</td>'
                f"<td>{pct(r['global_share'])}</td><td>{fine(r['owed_gpu_h'])}</td>"
                f"<td>{fine(r['delivered_gpu_h'])}</td>"
                f"<td>{pct(ratio) if ratio is not None else '-'}</td>"
                f"<td>{fine(r['used_gpu_h'])}</td><td>{fine(r['demand_gpu_h'])}</td></tr>"
            )
    out.append("</table>")
    return "".join(out)


# -- pages --------------------------------------------------------------------------

NAV = [
    ("cluster", "/ui/", "Cluster"),
    ("queue", "/ui/queue", "Queue"),
    ("usage", "/ui/usage", "Usage"),
    ("budget", "/ui/budget", "Budget"),
]


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
    nav = "".join(
        f'<a href="{href}"{" class=active" if key == active else ""}>{label}</a>'
        for key, href, label in NAV
    )
    who = ""
    if principal is not None:
        who = (
            f'<span class="who">signed in as <b>{esc(principal)}</b></span>'
            '<form method="post" action="/ui/logout" class="inline">'
            '<button type="submit">Sign out</button></form>'
        )
    msg = ""
    if flash:
        msg = f'<p class="flash{" error" if error else ""}" role="status">{esc(flash)}</p>'
    live_attr = f' data-live="{esc(live)}"' if live else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · apportion</title>"
        '<link rel="icon" href="data:,">'
        '<link rel="stylesheet" href="/ui/static/dashboard.css">'
        '<script src="/ui/static/dashboard.js" defer></script></head>'
        f'<body><header><span class="brand">apportion</span><nav>{nav}</nav>{who}</header>'
        f"<main{live_attr}><h1>{esc(title)}</h1>{msg}{HATCH_DEFS}{body}</main></body></html>"
    )


def cluster_html(gw: Gateway, hours: int) -> str:
    state = gw.state
    hist = gw.history
    now = max(state.now_ms, wall_ms())
    by_health: dict[str, int] = {"healthy": 0, "draining": 0, "down": 0}
    for n in state.nodes.values():
        by_health[n.health] = by_health.get(n.health, 0) + 1
    capacity = sum(n.gpus for n in state.nodes.values() if n.health != "down")
    alloc = sum(w.gpus for w in state.running.values() if w.allocated)
    unalloc = sum(w.gpus for w in state.running.values() if not w.allocated)
    tiles = [
        ("nodes healthy", by_health["healthy"]),
        ("draining", by_health["draining"]),
        ("down", by_health["down"]),
        ("GPUs in use", f"{alloc + unalloc} / {capacity}"),
        ("allocated", alloc),
        ("preemptible", unalloc),
        ("pending", len(state.pending)),
    ]
    out = ['<section class="tiles">']
    out += [
        f'<div class="tile"><span class="n">{esc(v)}</span><span>{esc(k)}</span></div>'
        for k, v in tiles
    ]
    out.append("</section>")
    links = " ".join(
        f'<a href="/ui/?hours={h}"{" class=active" if h == hours else ""}>{h} h</a>'
        for h in (1, 6, 24, 168)
    )
    out.append(f"<h2>GPUs in use, last {hours} h <small>{links}</small></h2>")
    if isinstance(hist, TimelineHistory):
        out.append(timeline_svg(hist, state, now, hours))
    out.append(
        '<p class="legend"><span class="sw allocated"></span> allocated '
        '<span class="sw unallocated"></span> unallocated (preemptible) '
        '<span class="sw capacity"></span> healthy capacity '
        '<span class="sw preemption"></span> preemption</p>'
    )
    out.append("<h2>Nodes</h2>")
    for health in ("healthy", "draining", "down"):
        nodes = sorted(
            (n for n in state.nodes.values() if n.health == health), key=lambda n: n.node
        )
        if not nodes:
            continue
        out.append(
            f'<h3 class="health {health}">{health} ({len(nodes)})</h3>'
            '<table class="nodes"><tr><th>node</th><th>type</th><th>GPUs</th><th>in use</th>'
            "<th>workloads</th></tr>"
        )
        for n in nodes:
            used = n.gpus - n.free
            al = sum(
                g
                for wid, g in n.workloads.items()
                if (w := state.running.get(wid)) is not None and w.allocated
            )
            wl = ", ".join(
                f'<a href="/ui/workload/{esc(wid)}">{esc(wid)}</a>:{g}'
                for wid, g in sorted(n.workloads.items())
            )
            drained = " (drained)" if n.drained else ""
            out.append(
                f"<tr><td>{esc(n.node)}{drained}</td><td>{esc(n.gpu_type)}</td><td>{used} / {n.gpus}</td>"
                f"<td>{bar_svg(used, al, n.gpus)}</td><td>{wl}</td></tr>"
            )
        out.append("</table>")
    out.append(f'<p class="asof">as of the event at {when(state.now_ms, now)}</p>')
    return "".join(out)


def _estimate(row: dict[str, Any], now: int) -> str | None:
    """The estimated start of a queue row, if the API gives one."""
    if "estimated_start_ms" not in row:
        return None
    value = row["estimated_start_ms"]
    if isinstance(value, int) and not isinstance(value, bool):
        return when(value, now)
    note = row.get("estimate_note") or "no estimate"
    return f'<span class="muted" title="{esc(note)}">unknown</span>'


def _share(k: dict[str, Any]) -> str:
    """A level of the sort key: usage as a percentage of share where the view gives it,
    else the ratio usage / weight."""
    if isinstance(k.get("share_pct"), int | float):
        return f"{k['share_pct']:.1f}% of share"
    return f"ratio {k['ratio']['value']:.3g}"


def queue_html(gw: Gateway, estimates: Any = None) -> str:
    state = gw.state
    now = max(state.now_ms, wall_ms())
    q = queue_view(state, gw.history, now_ms=now, estimates=estimates)
    pending = q["pending"]
    estimates = [_estimate(r, now) for r in pending]
    has_est = any(e is not None for e in estimates)
    out = [f"<h2>Pending ({len(pending)})</h2>"]
    if pending:
        out.append(
            '<table class="queue"><tr><th>#</th><th>workload</th><th>owner</th><th>GPUs</th>'
            "<th>min runtime</th><th>waiting</th><th>sort key, per level (lower ranks first)</th>"
            + ("<th>estimated start</th>" if has_est else "")
            + "</tr>"
        )
        for r, est in zip(pending, estimates, strict=True):
            ratios = (
                " › ".join(
                    f'<span class="ratio" title="{esc(x["exact"] if (x := k["ratio"]) else "")}">'
                    f"{esc(k['path'])}: {_share(k)} "
                    f"<small>({esc(gpu_h(k['usage_gpu_ms'] / HOUR_MS))} / weight {k['weight']})</small></span>"
                    for k in r["ratios"]
                )
                or "unallocated: after all allocated work"
            )
            typ = "" if r["gpu_type"] in ("", "any") else f" {esc(r['gpu_type'])}"
            out.append(
                f"<tr><td>{r['position']}</td>"
                f'<td><a href="/ui/workload/{esc(r["workload"])}">{esc(r["workload"])}</a></td>'
                f"<td>{esc(r['owner'])}</td><td>{r['gpus']}{typ}</td>"
                f"<td>{esc(span(r['min_runtime_ms']))}</td><td>{esc(span(max(0, now - r['queued_ms'])))}</td>"
                f"<td>{ratios}</td>" + (f"<td>{est or '-'}</td>" if has_est else "") + "</tr>"
            )
        out.append("</table>")
        if has_est and q.get("estimate_assumption"):
            out.append(f'<p class="muted">estimated start: {esc(q["estimate_assumption"])}</p>')
    else:
        out.append('<p class="empty">nothing is waiting</p>')
    running = q["running"]
    out.append(f"<h2>Running ({len(running)})</h2>")
    if running:
        out.append(
            '<table class="running"><tr><th>workload</th><th>owner</th><th>GPUs</th><th>on</th>'
            "<th>started</th><th>protected until</th><th>kind</th></tr>"
        )
        for r in running:
            on = ", ".join(f"{esc(n)}:{g}" for n, g in r["placement"])
            kind = "allocated" if r["allocated"] else "preemptible"
            out.append(
                f'<tr><td><a href="/ui/workload/{esc(r["workload"])}">{esc(r["workload"])}</a></td>'
                f"<td>{esc(r['owner'])}</td><td>{r['gpus']}</td><td>{on}</td>"
                f"<td>{when(r['started_ms'], now)}</td>"
                f"<td>{when(r['protected_until_ms'], now) if r['allocated'] else '-'}</td>"
                f'<td><span class="kind {kind}">{kind}</span></td></tr>'
            )
        out.append("</table>")
    else:
        out.append('<p class="empty">nothing is running</p>')
    return "".join(out)


def submit_form(state: State) -> str:
    opts = "".join(f'<option value="{esc(p)}">{esc(p)}</option>' for p in leaves(state))
    types = sorted({n.gpu_type for n in state.nodes.values()})
    topts = '<option value="any">any</option>' + "".join(
        f'<option value="{esc(t)}">{esc(t)}</option>' for t in types
    )
    return (
        '<h2>Submit a workload</h2><form method="post" action="/ui/submit" class="grid" id="submit-form">'
        f'<label>owner (leaf)<select name="owner" required>{opts}</select></label>'
        '<label>GPUs<input name="gpus" type="number" min="1" value="8" required></label>'
        f'<label>GPU type<select name="gpu_type">{topts}</select></label>'
        '<label>minimum runtime<input name="min_runtime" value="15m" required '
        'title="0 for free, preemptible work; at most the policy cap, e.g. 15m, 2h"></label>'
        '<label>duration (emulated)<input name="duration" value="" placeholder="e.g. 30m"></label>'
        '<label>priority<input name="priority" type="number" value="0"></label>'
        '<label>id (optional)<input name="id" value="" placeholder="generated"></label>'
        '<label class="check"><input name="resumable" type="checkbox" checked> resumable</label>'
        '<button type="submit">Submit</button></form>'
    )


def usage_html(gw: Gateway, hours: int | None = None, team: str | None = None) -> str:
    state = gw.state
    tree = budget_tree(state, detail=True)
    rows: list[dict[str, Any]] = []

    def walk(n: dict[str, Any]) -> None:
        if n["path"] != ROOT:
            rows.append(n)
        for c in n["children"]:
            walk(c)

    walk(tree)
    window = span(state.policy.lookback_ms)
    out = [
        f"<p>Usage is the GPU time charged to a node's subtree over the last {esc(window)} "
        "(allocated work only); committed is what running work's protection (its minimum "
        "runtime) still adds, which the queue already counts. Its allocation is its global "
        "share of the healthy capacity over the same window: the tick.</p>",
        usage_svg(rows),
        '<table class="usage"><tr><th>path</th><th>owner</th><th>global share</th>'
        "<th>allocation</th><th>usage</th><th>committed</th><th>of allocation</th><th>usage vs share</th>"
        "<th>running GPUs</th><th>pending GPUs</th></tr>",
    ]
    for r in rows:
        depth = r["path"].count("/")
        of = pct(r["usage_gpu_h"] / r["allocation_gpu_h"]) if r["allocation_gpu_h"] else "-"
        out.append(
            f'<tr><td class="d{depth}">{esc(r["path"])}</td><td>{esc(r["owner"])}</td>'
            f"<td>{pct(r['global_share'])}</td><td>{gpu_h(r['allocation_gpu_h'])}</td>"
            f"<td>{gpu_h(r['usage_gpu_h'])}</td><td>{gpu_h(r.get('committed_gpu_h', 0.0))}</td><td>{of}</td><td>{pct(r['usage_vs_share'])}</td>"
            f"<td>{r['running_gpus']}</td><td>{r['pending_gpus']}</td></tr>"
        )
    out.append("</table>")
    out.append(usage_history_html(gw, hours, team))
    return "".join(out)


def workload_html(gw: Gateway, workload: str, estimates: Any = None) -> str | None:
    state = gw.state
    now = max(state.now_ms, wall_ms())
    out = explain(state, gw.history, workload, now_ms=now, estimates=estimates)
    if out is None:
        return None
    status = out["status"]
    parts = [
        f'<p class="status {esc(status)}">status: <b id="wl-status">{esc(status)}</b></p>',
        "<h2>Why</h2><ul class=reasons>",
    ]
    parts += [f"<li>{esc(r)}</li>" for r in out.get("reasons", [])]
    parts.append("</ul>")
    detail = out.get("detail")
    if detail:
        parts.append('<h2>Details</h2><table class="detail">')
        for k, v in detail.items():
            shown = (
                when(v, now)
                if k.endswith("_ms")
                and k not in ("min_runtime_ms", "duration_ms")
                and isinstance(v, int)
                else esc("-" if v is None else v)
            )
            if k in ("min_runtime_ms", "duration_ms") and isinstance(v, int):
                shown = esc(span(v))
            parts.append(f"<tr><th>{esc(k)}</th><td>{shown}</td></tr>")
        parts.append("</table>")
    w = state.running.get(workload)
    if w is not None:
        parts.append(
            "<p>placed on "
            + ", ".join(f"{esc(s.node)} ({s.gpus} GPUs)" for s in w.placement)
            + f" since {when(w.started_ms, now)}</p>"
        )
    return "".join(parts)


def cancel_form(workload: str) -> str:
    return (
        f'<form method="post" action="/ui/workload/{esc(workload)}/cancel" class="inline">'
        '<button type="submit" class="danger">Cancel this workload</button></form>'
    )


def budget_html(gw: Gateway, principal: str | None) -> str:
    state = gw.state
    tree = budget_tree(state)
    nodes = state.budget.nodes

    def may_edit(path: str) -> bool:
        """The owner of the parent or of any ancestor may edit ``path`` (the fold checks)."""
        if principal is None:
            return False
        if path == ROOT:
            return nodes[ROOT].owner in (principal, "")
        p = path
        while p != ROOT:
            p = p.rsplit("/", 1)[0] if "/" in p else ROOT
            if nodes[p].owner == principal:
                return True
        return False

    out = [
        "<p>Each node's share of its parent is its weight over the sum of its siblings' weights. "
        "The owner of a node may edit the nodes below it; the scheduler's fold checks every "
        "edit, so a form you may not use is refused with the reason.</p>",
        '<table class="budget"><tr><th>path</th><th>weight</th><th>owner</th><th>global share</th>'
        "<th>edit</th></tr>",
    ]

    def row(n: dict[str, Any]) -> None:
        path = n["path"]
        depth = 0 if path == ROOT else path.count("/") + 1
        name = path or "(root)"
        editable = may_edit(path)
        form = ""
        if editable:
            fid = "edit-" + (path.replace("/", "--") or "root")
            form = (
                f'<form method="post" action="/ui/budget" class="inline" id="{esc(fid)}">'
                f'<input type="hidden" name="path" value="{esc(path)}">'
                f'<input name="weight" type="number" min="1" value="{n["weight"]}" aria-label="weight">'
                f'<input name="owner" value="{esc(n["owner"])}" aria-label="owner">'
                '<button type="submit" name="action" value="set">Save</button>'
                + (
                    '<button type="submit" name="action" value="remove" class="danger">Remove</button>'
                    if path != ROOT and not n["children"]
                    else ""
                )
                + "</form>"
            )
        out.append(
            f'<tr data-path="{esc(path)}"><td class="d{depth}">{esc(name)}</td>'
            f'<td class="weight">{n["weight"]}</td><td>{esc(n["owner"])}</td>'
            f"<td>{pct(n['global_share'])}</td><td>{form or '<span class=muted>-</span>'}</td></tr>"
        )
        for c in n["children"]:
            row(c)

    row(tree)
    out.append("</table>")
    mine = [p for p, n in sorted(nodes.items()) if principal and n.owner == principal]
    if mine:
        opts = "".join(f'<option value="{esc(p)}">{esc(p or "(root)")}</option>' for p in mine)
        out.append(
            '<h2>Add a node</h2><form method="post" action="/ui/budget" class="grid" id="add-node">'
            f'<label>under<select name="parent">{opts}</select></label>'
            '<label>name<input name="name" required pattern="[A-Za-z0-9_.:@+-]+"></label>'
            '<label>weight<input name="weight" type="number" min="1" value="1" required></label>'
            f'<label>owner<input name="owner" value="{esc(principal)}" required></label>'
            '<button type="submit" name="action" value="set">Add</button></form>'
        )
    return "".join(out)


# -- the routes ---------------------------------------------------------------------


class Dashboard:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def estimates(self) -> Estimates | None:
        """The gateway's start-time estimates of its folded state (computed once per
        state, off the event loop); ``None`` if they failed (a page without them)."""
        try:
            return await self.gw.estimates()
        except Exception:  # noqa: BLE001 - a page without estimates beats no page
            self.gw.logger.exception("dashboard: estimates failed")
            return None

    # identity
    def principal(self, request: web.Request) -> str | None:
        """Who the login cookie stands for, checked now; ``None`` if nobody."""
        value = request.cookies.get(COOKIE)
        if not value:
            return None
        auth = self.gw.auth
        if auth is None:
            try:
                return check_principal(value)
            except ValueError:
                return None
        try:
            return auth.authenticate({"Authorization": f"Bearer {value}"})
        except AuthError:
            return None

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
        body = (
            '<form method="post" action="/ui/login" class="login" id="login-form">'
            f'<input type="hidden" name="next" value="{esc(nxt)}">'
            f'<label>{esc(label)}<input name="token" type="password" autocomplete="off" required autofocus></label>'
            '<button type="submit">Sign in</button></form>'
            "<p>Use the bearer token of <code>apportion up</code> (it prints where the token "
            "files are, e.g. <code>.apportion/credentials/admin.token</code>). The token is kept "
            "in an HttpOnly, SameSite=Strict cookie for this site only.</p>"
        )
        return self._html(
            page("Sign in", "", body, principal=None, flash=error, error=bool(error)),
            status=401 if error else 200,
        )

    async def login(self, request: web.Request) -> web.StreamResponse:
        self._same_origin(request)
        form = await request.post()
        token = str(form.get("token", "")).strip()
        nxt = str(form.get("next", "/ui/"))
        if not nxt.startswith("/ui") or nxt.startswith("//"):
            nxt = "/ui/"
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
        flash, err = self._flash(request)
        return self._html(
            page(
                "Cluster now",
                "cluster",
                f'<div id="live">{cluster_html(self.gw, hours)}</div>',
                principal=who,
                live=f"cluster?hours={hours}",
                flash=flash,
                error=err,
            )
        )

    async def queue(self, request: web.Request) -> web.Response:
        who = self._require(request)
        flash, err = self._flash(request)
        est = await self.estimates()
        body = f'<div id="live">{queue_html(self.gw, est)}</div>{submit_form(self.gw.state)}'
        return self._html(
            page("Queue", "queue", body, principal=who, live="queue", flash=flash, error=err)
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
        return self._html(
            page(
                "Usage against budget",
                "usage",
                f'<div id="live">{usage_html(self.gw, hours, team)}</div>',
                principal=who,
                live="usage" + ("?" + urllib.parse.urlencode(query) if query else ""),
            )
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

    async def workload(self, request: web.Request) -> web.Response:
        who = self._require(request)
        wid = request.match_info["id"]
        flash, err = self._flash(request)
        body = workload_html(self.gw, wid, await self.estimates())
        status = 200
        if body is None:  # not folded yet (just submitted), or never seen: the page keeps polling
            body = f'<p class="empty" id="wl-unknown">no workload {esc(wid)} known (yet)</p>'
        live = "workload?" + urllib.parse.urlencode({"id": wid})
        content = f'<div id="live">{body}</div>'
        if wid in self.gw.state.workloads:
            content += cancel_form(wid)
        return self._html(
            page(f"Workload {wid}", "", content, principal=who, live=live, flash=flash, error=err),
            status=status,
        )

    async def budget(self, request: web.Request) -> web.Response:
        who = self._require(request)
        flash, err = self._flash(request)
        return self._html(
            page(
                "Budget tree",
                "budget",
                f'<div id="live">{budget_html(self.gw, who)}</div>',
                principal=who,
                live="budget",
                flash=flash,
                error=err,
            )
        )

    async def live(self, request: web.Request) -> web.Response:
        """The live part of a page as JSON ``{"html", "input_seq"}`` (polled by the script)."""
        who = self.principal(request)
        if who is None:
            return web.json_response({"error": "not signed in"}, status=401)
        which = request.query.get("page", "")
        if which == "cluster":
            text = cluster_html(self.gw, self._hours(request))
        elif which == "queue":
            text = queue_html(self.gw, await self.estimates())
        elif which == "usage":
            text = usage_html(self.gw, *self._usage_query(request))
        elif which == "budget":
            text = budget_html(self.gw, who)
        elif which == "workload":
            wid = request.query.get("id", "")
            text = (
                workload_html(self.gw, wid, await self.estimates())
                or f'<p class="empty" id="wl-unknown">no workload {esc(wid)} known (yet)</p>'
            )
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
        self._same_origin(request)
        who = self._require(request)
        wid = request.match_info["id"]
        body = {"actor": who} if self.gw.auth is None else {}
        status, answer = await self._api(
            request, f"/v1/workloads/{urllib.parse.quote(wid, safe='')}/cancel", body
        )
        target = "/ui/workload/" + urllib.parse.quote(wid, safe="")
        if status != 202:
            raise web.HTTPSeeOther(_with(target, error=_reason(status, answer)))
        raise web.HTTPSeeOther(_with(target, ok=f"cancel of {wid} sent"))

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


def _with(path: str, **query: str) -> str:
    return path + "?" + urllib.parse.urlencode(query)


def _reason(status: int, answer: Any) -> str:
    reason = answer.get("error") if isinstance(answer, dict) else None
    return f"refused ({status}): {reason or answer}"


def add_dashboard(app: web.Application, gateway: Gateway) -> Dashboard:
    """Mount the dashboard's routes on ``app`` and give ``gateway`` a history that
    keeps the GPU timeline (call before the gateway follows the log)."""
    if not isinstance(gateway.history, TimelineHistory):
        gateway.history = TimelineHistory(lambda: gateway.state)
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
    r.add_post("/ui/budget", d.budget_post)
    r.add_get("/ui/workload", d.workload_lookup)
    r.add_get("/ui/workload/{id}", d.workload)
    r.add_post("/ui/workload/{id}/cancel", d.cancel)
    r.add_post("/ui/submit", d.submit)
    r.add_get("/ui/live", d.live)
    r.add_get("/ui/static/{name}", d.static)
    r.add_get("/v1/usage/history", d.usage_history_api)
    return d
