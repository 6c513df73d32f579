"""The geometry of the dashboard's charts: coordinates, labels and titles as plain data,
which ``dashboard_templates/charts.html`` draws as inline SVG (no markup here)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from apportion.core.state import State
from apportion.schemas.events import HOUR_MS

from .views import iso

if TYPE_CHECKING:
    from .dashboard_views import TimelineHistory

OWED_COLOR = "#1d2330"
DELIVERED_COLOR = "#3b6fd8"
USED_COLOR = "#e0a030"


def _points(pts: list[tuple[float, float]]) -> str:
    """An SVG ``points`` list: ``x,y x,y ...`` to one decimal."""
    return " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)


def timeline(
    history: TimelineHistory, state: State, end_ms: int, hours: int, width: int = 900
) -> dict[str, Any]:
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
    alloc = free = 0
    points: list[tuple[int, int, int]] = [(start_ms, 0, 0)]
    for t in sorted(deltas):
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
        up: list[tuple[float, float]] = []
        low: list[tuple[float, float]] = []
        for i, p in enumerate(points):
            nxt = points[i + 1][0] if i + 1 < len(points) else p[0]
            up += [(x(p[0]), y(upper(p))), (x(nxt), y(upper(p)))]
            low += [(x(p[0]), y(lower(p))), (x(nxt), y(lower(p)))]
        return _points(up + low[::-1])

    step = max(1, hours // 6) * HOUR_MS
    ticks = []
    tick = start_ms - start_ms % step + step
    while tick <= end_ms:
        stamp = dt.datetime.fromtimestamp(tick / 1000, dt.UTC)
        ticks.append(
            {"x": x(tick), "label": stamp.strftime("%H:%M" if hours <= 24 else "%d %H:%M")}
        )
        tick += step
    return {
        "width": width,
        "height": height,
        "hours": hours,
        "left": left,
        "top": top,
        "pw": pw,
        "ph": ph,
        "ylines": [{"y": y(g), "label": g} for g in sorted({0, total // 2, total})],
        "xticks": ticks,
        "allocated": area(lambda p: 0, lambda p: p[1]),
        "unallocated": area(lambda p: p[1], lambda p: p[1] + p[2]),
        "capacity": capacity,
        "capacity_y": y(capacity),
        "preemptions": [
            {"x": x(at), "at": iso(at), "workload": wid, "reason": reason, "gpus": gpus}
            for at, wid, reason, gpus in history.preemptions
            if start_ms <= at <= end_ms
        ],
    }


def bar(used: int, allocated: int, total: int, width: int = 160) -> dict[str, Any]:
    """A node's GPUs: allocated work solid, unallocated hatched, the rest free."""
    total = max(total, 1)
    a = width * used / total
    u = width * allocated / total
    return {"width": width, "allocated": u, "unallocated": max(a - u, 0)}


def usage_bars(rows: list[dict[str, Any]], width: int = 900) -> dict[str, Any]:
    """One bar per budget node: usage over the window (solid), the rest of its running
    work's protection (committed, light) against its allocation (the tick)."""
    row_h, left, right = 24, 220, 120
    top_val = max(
        [1e-9]
        + [
            max(r["usage_gpu_h"] + r.get("committed_gpu_h", 0.0), r["allocation_gpu_h"])
            for r in rows
        ]
    )
    pw = width - left - right
    bars = []
    for i, r in enumerate(rows):
        used = r["usage_gpu_h"]
        committed = r.get("committed_gpu_h", 0.0)
        allocation = r["allocation_gpu_h"]
        bars.append(
            {
                "path": r["path"],
                "y": 10 + i * row_h,
                "indent": 8 + 14 * r["path"].count("/"),
                "used": used,
                "committed": committed,
                "allocation": allocation,
                "used_w": pw * used / top_val,
                "committed_w": pw * committed / top_val,
                "allocation_x": left + pw * allocation / top_val,
                "over": used > allocation,
                "of_allocation": used / allocation if allocation else None,
            }
        )
    return {"width": width, "height": row_h * len(rows) + 30, "left": left, "pw": pw, "bars": bars}


def hour_ticks(start_ms: int, n: int) -> list[tuple[int, str]]:
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


def usage_history(
    team: dict[str, Any], start_ms: int, n: int, top: float, width: int = 900, kind: str = "team"
) -> dict[str, Any]:
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
    delivered = steps("delivered_gpu_ms")
    area = ""
    if delivered:
        base = y(0)
        area = _points([(delivered[0][0], base), *delivered, (delivered[-1][0], base)])
    grid = []
    for g in sorted({0.0, top / 2, top}):
        grid.append(
            {"y": top_pad + ph * (1 - g / top), "label": f"{g:.0f}" if top >= 4 else f"{g:.1f}"}
        )
    return {
        "id": "usage-history-" + "".join(c if c.isalnum() else "-" for c in path),
        "kind": kind,
        "team": team,
        "width": width,
        "height": height,
        "left": left,
        "top": top_pad,
        "pw": pw,
        "ph": ph,
        "ylines": grid,
        "xticks": [{"x": x(i), "label": label} for i, label in hour_ticks(start_ms, n)],
        "delivered": area,
        "used": line(steps("used_gpu_ms")),
        "owed": line(steps("owed_gpu_ms")),
        "hours": [
            {
                "x": x(i),
                "width": max(x(i + 1) - x(i), 0.1),
                "when": dt.datetime.fromtimestamp(h["start_ms"] / 1000, dt.UTC).strftime(
                    "%a %d %H:00Z"
                ),
                **{k: h[k + "_gpu_ms"] / HOUR_MS for k in ("owed", "delivered", "used", "demand")},
            }
            for i, h in enumerate(hours)
        ],
        "colors": {"owed": OWED_COLOR, "delivered": DELIVERED_COLOR, "used": USED_COLOR},
    }
