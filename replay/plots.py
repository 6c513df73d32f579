"""Charts for ``apportion simulate --plot DIR`` (matplotlib, Agg backend, PNG).

matplotlib is an optional extra (``pip install 'apportion[plot]'``), imported
only when a chart is drawn; without it :func:`write_plots` raises
:class:`PlotExtraMissing`, one line saying how to install it.

1. ``usage_vs_budget.png``: one panel per team, all on one y-scale: its
   allocated GPU use over the trailing lookback window (7 days) as a percentage
   of its budget (its global share of the healthy GPU-hours; the budget line is
   100%), and its allocated demand (pending or running) on the same scale.
   With ``--compare`` every policy is drawn in each panel. The figures come
   from the projection's ``team_usage_hourly`` view (docs/analyst.md).
2. ``gpu_timeline.png`` (``gpu_timeline_POLICY.png`` for the other policies):
   one row per GPU, a bar per run coloured by team, hatched where the work was
   preemptible (unallocated under the budget policy, ``legacy_preemptible``
   under the baseline), a red edge where it was preempted; the first
   ``window_days`` days, the same axes for every policy.
3. ``wait_distribution.png``: the distribution of queue waits per class
   (debug, large >= 64 GPUs, other) for every policy run, one y-scale; a class
   no run has a wait of gets no panel.

Time axes are in hours up to 2 days, in days beyond.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from apportion.core.rules.classes import LARGE_MIN_GPUS, debug_sql, large_sql, team_sql

TEAM_SQL = team_sql("w.owner")
INSTALL_HINT = "matplotlib is not installed; install the plot extra: pip install 'apportion[plot]'"
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
POLICY_STYLE = {
    "budget": {"color": "tab:blue", "ls": "-"},
    "priority": {"color": "tab:orange", "ls": "--"},
}
POLICY_LABEL = {"budget": "budget policy", "priority": "baseline (priorities)"}
WAIT_TICKS = [
    (1, "1 s"),
    (10, "10 s"),
    (60, "1 min"),
    (600, "10 min"),
    (3600, "1 h"),
    (6 * 3600, "6 h"),
    (86400, "1 d"),
    (7 * 86400, "7 d"),
]


class PlotExtraMissing(OSError):
    """matplotlib is not installed (an ``OSError``, so callers that report an
    unwritable chart directory report this as one line too)."""

    def __init__(self) -> None:
        super().__init__(errno.ENOENT, INSTALL_HINT)


def require_matplotlib() -> None:
    """Raise :class:`PlotExtraMissing` unless matplotlib can be imported (a CLI
    can call this before a long simulation)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotExtraMissing() from None


def _plt():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def time_unit(span_ms: float) -> tuple[float, str]:
    """(ms per unit, axis label) for a time axis spanning ``span_ms``."""
    return (HOUR_MS, "hour") if span_ms <= 2 * DAY_MS else (DAY_MS, "day")


def _style(policy: str) -> dict[str, Any]:
    return POLICY_STYLE.get(policy, {"color": "tab:green", "ls": "-."})


def team_usage(sim: Any) -> tuple[list[str], dict[str, float], dict[str, dict[str, Any]]]:
    """Per team, hourly arrays of allocated, demand and share GPU-hours over the
    run's horizon (from ``team_usage_hourly``); the teams and their global shares."""
    import numpy as np

    con = sim.con
    h0 = sim.start_ms // HOUR_MS
    hours = max(1, -(-(sim.end_ms - sim.start_ms) // HOUR_MS))
    rows = con.execute(
        "SELECT team, hour, gpu_hours_allocated, gpu_hours_demand, gpu_hours_share "
        "FROM team_usage_hourly WHERE hour >= ? AND hour < ? ORDER BY team, hour",
        [h0, h0 + hours],
    ).fetchall()
    shares = {
        t: float(g) for t, g in con.execute("SELECT path, global_share FROM budget").fetchall()
    }
    data: dict[str, dict[str, Any]] = {}
    for team, hour, alloc, demand, share in rows:
        d = data.setdefault(team, {k: np.zeros(hours) for k in ("allocated", "demand", "share")})
        i = hour - h0
        d["allocated"][i], d["demand"][i], d["share"][i] = alloc, demand, share
    teams = sorted(t for t in data if shares.get(t, 0) > 0)
    return teams, shares, data


def _trailing(values: Any, window: int) -> Any:
    import numpy as np

    cum = np.cumsum(values)
    if len(cum) <= window:
        return cum
    return cum - np.concatenate([np.zeros(window), cum[:-window]])


def usage_vs_budget(sims: dict[str, Any] | Any, path: Path) -> None:
    import numpy as np

    if not isinstance(sims, dict):
        sims = {sims.policy: sims}
    plt = _plt()
    first = next(iter(sims.values()))
    window_h = max(1, first.state.policy.lookback_ms // HOUR_MS)
    per_policy = {policy: team_usage(sim) for policy, sim in sims.items()}
    teams = sorted({t for ts, _, _ in per_policy.values() for t in ts})
    shares = per_policy[next(iter(per_policy))][1]
    span = first.end_ms - first.start_ms
    unit, unit_label = time_unit(span)
    curves: dict[str, list[tuple[str, str, Any, Any]]] = {t: [] for t in teams}
    top = 120.0
    for policy, (_, _, data) in per_policy.items():
        for team in teams:
            d = data.get(team)
            if d is None:
                continue
            share = _trailing(d["share"], window_h)
            ok = share > 0
            x = (np.arange(len(share)) * HOUR_MS + first.start_ms % HOUR_MS) / unit
            used = np.where(
                ok, 100 * _trailing(d["allocated"], window_h) / np.where(ok, share, 1), np.nan
            )
            demand = np.where(
                ok, 100 * _trailing(d["demand"], window_h) / np.where(ok, share, 1), np.nan
            )
            curves[team].append((policy, "used", x, used))
            if policy == next(iter(per_policy)):
                curves[team].append((policy, "demand", x, demand))
            top = max(top, float(np.nanmax(used, initial=0)), float(np.nanmax(demand, initial=0)))
    top = min(top * 1.05, 400.0)
    n = len(teams)
    cols = 4 if n > 6 else max(1, n)
    nrows = max(1, -(-n // cols))
    fig, axes = plt.subplots(
        nrows, cols, figsize=(4 * cols, 2.6 * nrows + 0.8), squeeze=False, sharex=True, sharey=True
    )
    for i, team in enumerate(teams):
        ax = axes[i // cols][i % cols]
        for policy, what, x, y in curves[team]:
            if what == "used":
                ax.plot(
                    x,
                    y,
                    lw=1.3,
                    label=f"used, {POLICY_LABEL.get(policy, policy)}",
                    **_style(policy),
                )
            else:
                ax.plot(x, y, lw=1.0, color="grey", ls=":", label="allocated demand")
        ax.axhline(100, color="k", ls="--", lw=0.9, label="budget (its share)")
        ax.set_ylim(0, top)
        ax.set_title(f"{team} (share {100 * shares.get(team, 0):.1f}%)", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.25)
    for j in range(n, nrows * cols):
        axes[j // cols][j % cols].set_visible(False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    height = 2.6 * nrows + 0.8
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.supxlabel(unit_label, y=0.35 / height + 0.01)
    fig.supylabel(f"% of budget, trailing {window_h / 24:g} d", x=0.004)
    fig.suptitle("allocated usage and demand against budget per team")
    fig.tight_layout(rect=(0.012, 0.4 / height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gpu_timeline(sim: Any, path: Path, window_days: float = 3.0, max_nodes: int = 64) -> None:
    plt = _plt()
    from matplotlib.collections import LineCollection, PolyCollection

    con = sim.con
    t0 = sim.start_ms
    t1 = min(sim.end_ms, t0 + int(window_days * DAY_MS))
    unit, unit_label = time_unit(t1 - t0)
    nodes = con.execute(
        "SELECT node, gpus FROM nodes ORDER BY node LIMIT ?", [max_nodes]
    ).fetchall()
    preemptible = "NOT r.allocated" if sim.policy == "budget" else "w.legacy_preemptible"
    runs = con.execute(
        f"""SELECT r.node, r.gpus, r.start_ms, LEAST(COALESCE(r.end_ms, {sim.end_ms}), {t1}), {TEAM_SQL},
                   {preemptible}, r.end_reason IN ('preempted', 'node_down'), r.workload
            FROM runs r JOIN workloads w USING (workload)
            WHERE r.start_ms < {t1} AND COALESCE(r.end_ms, {sim.end_ms}) > {t0}
            ORDER BY r.node, r.start_ms, r.workload"""
    ).fetchall()
    teams = sorted({r[4] for r in runs})
    # tab20 and tab20b without reds, so the red preemption edges stand out
    palette = [plt.get_cmap("tab20")(i) for i in range(20) if i not in (6, 7)]
    palette += [plt.get_cmap("tab20b")(i) for i in range(20)]
    colour = {t: palette[i % len(palette)] for i, t in enumerate(teams)}
    base: dict[str, int] = {}
    gpu_free_at: dict[str, list[int]] = {}
    row = 0
    for node, gpus in nodes:
        base[node] = row
        gpu_free_at[node] = [t0] * gpus
        row += gpus
    polys, colours, hatched, red = [], [], [], []
    for node, gpus, s, e, team, pre, preempted, _wid in runs:
        if node not in base:
            continue
        frees = gpu_free_at[node]
        idx = sorted(range(len(frees)), key=lambda i: (frees[i] > s, i))[:gpus]
        for i in idx:
            frees[i] = e
            y = base[node] + i
            xs, xe = (max(s, t0) - t0) / unit, (e - t0) / unit
            poly = [(xs, y), (xe, y), (xe, y + 0.9), (xs, y + 0.9)]
            polys.append(poly)
            colours.append(colour[team])
            if pre:
                hatched.append(poly)
            if preempted and e < t1:
                red.append([(xe, y), (xe, y + 0.9)])
    height = max(4.0, min(24.0, row * 0.02 + 2))
    fig, ax = plt.subplots(figsize=(14, height))
    ax.add_collection(PolyCollection(polys, facecolors=colours, edgecolors="none"))
    if hatched:
        ax.add_collection(
            PolyCollection(
                hatched, facecolors="none", edgecolors=(1, 1, 1, 0.7), hatch="////", linewidths=0
            )
        )
    if red:
        ax.add_collection(LineCollection(red, colors="red", linewidths=1.2))
    ax.set_xlim(0, (t1 - t0) / unit)
    ax.set_ylim(row, 0)
    ax.set_xlabel(unit_label)
    ax.set_ylabel(f"GPU (first {len(nodes)} nodes)")
    from matplotlib.patches import Patch

    handles = [Patch(color=colour[t], label=t) for t in teams[:20]]
    handles.append(Patch(facecolor="grey", hatch="////", label="preemptible"))
    handles.append(Patch(color="red", label="preempted"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"GPU timeline ({POLICY_LABEL.get(sim.policy, sim.policy)})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def wait_distribution(sims: dict[str, Any], path: Path) -> None:
    import numpy as np

    plt = _plt()
    classes = {
        "debug": debug_sql("x.gpus", "x.min_runtime_ms"),
        f"large (>= {LARGE_MIN_GPUS} GPUs)": large_sql("x.gpus"),
        "other": f"NOT {debug_sql('x.gpus', 'x.min_runtime_ms')} AND NOT {large_sql('x.gpus')}",
    }
    found: dict[str, dict[str, Any]] = {}
    for label, cond in classes.items():
        for policy, sim in sims.items():
            waits = [
                r[0]
                for r in sim.con.execute(
                    f"""SELECT (w.placed_ms - w.queued_ms) / 1000.0 FROM waits w JOIN workloads x USING (workload)
                    WHERE w.placed_ms IS NOT NULL AND {cond} ORDER BY 1"""
                ).fetchall()
            ]
            if waits:
                found.setdefault(label, {})[policy] = np.maximum(np.array(waits), 1.0)
    panels = [label for label in classes if label in found] or ["all"]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5 * len(panels), 3.8), sharey=True, sharex=True, squeeze=False
    )
    longest = max((float(xs[-1]) for d in found.values() for xs in d.values()), default=60.0)
    for ax, label in zip(axes[0], panels, strict=True):
        for policy, xs in found.get(label, {}).items():
            ax.step(
                xs,
                np.arange(1, len(xs) + 1) / len(xs),
                where="post",
                lw=1.3,
                label=f"{POLICY_LABEL.get(policy, policy)} (n={len(xs):,})",
                **_style(policy),
            )
        ax.set_xscale("log")
        ticks = [(t, name) for t, name in WAIT_TICKS if t <= longest * 1.5]
        ax.set_xticks([t for t, _ in ticks], [name for _, name in ticks])
        ax.minorticks_off()
        ax.set_xlim(1, max(60.0, longest * 1.5))
        ax.set_ylim(0, 1.02)
        ax.set_title(label)
        ax.set_xlabel("queue wait (log; under 1 s shown at 1 s)")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8, loc="lower right")
    axes[0][0].set_ylabel("fraction of placements")
    fig.suptitle("queue wait distribution per class")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(sims: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Every chart of ``sims`` (policy -> simulation result with a projection)
    into ``out_dir``; raises :class:`PlotExtraMissing` (an ``OSError``) without matplotlib."""
    require_matplotlib()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = next(iter(sims.values()))
    paths = []
    p = out / "usage_vs_budget.png"
    usage_vs_budget(sims, p)
    paths.append(p)
    for policy, sim in sims.items():
        p = out / ("gpu_timeline.png" if sim is first else f"gpu_timeline_{policy}.png")
        gpu_timeline(sim, p)
        paths.append(p)
    p = out / "wait_distribution.png"
    wait_distribution(sims, p)
    paths.append(p)
    return paths


def write_diagnosis_plot(diag: Any, path: str | Path, team: str | None = None) -> Path:
    """Stacked bars: each day's owed-but-undelivered GPU-hours by cause."""
    from .diagnose import CAUSES

    plt = _plt()
    daily = diag.daily(team)
    days = sorted(daily)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(days)
    for cause in CAUSES:
        values = [daily[d][cause] for d in days]
        if any(values):
            ax.bar(days, values, bottom=bottom, label=cause)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("day of the run")
    ax.set_ylabel("owed GPU-hours not delivered")
    ax.set_title(f"shortfall by cause{f' ({team})' if team else ''}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
