"""Charts for ``apportion simulate --plot DIR`` (matplotlib, Agg backend, PNG).

1. ``usage_vs_budget.png``: per team, its allocated GPU use over the trailing
   lookback window (7 days) as a share of the cluster, against its global
   share (dashed): the view Ai2 gave its researchers.
2. ``gpu_timeline.png``: one row per GPU, a bar per run coloured by team,
   hatched where the work was preemptible (unallocated under the budget
   policy, ``legacy_preemptible`` under the baseline), a red edge where it was
   preempted; the first ``window_days`` days.
3. ``wait_distribution.png``: the distribution of queue waits per class
   (debug, large >= 64 GPUs, other) for every policy run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEAM_SQL = "CASE WHEN strpos(w.owner, '/') > 0 THEN regexp_replace(w.owner, '/[^/]*$', '') ELSE w.owner END"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def usage_vs_budget(sim: Any, path: Path) -> None:
    import numpy as np

    plt = _plt()
    con = sim.con
    hours = max(1, (sim.end_ms - sim.start_ms) // 3_600_000)
    cap = con.execute("SELECT SUM(gpus) FROM nodes").fetchone()[0] or 1
    teams = [
        r[0]
        for r in con.execute(
            f"SELECT DISTINCT {TEAM_SQL.replace('w.owner', 'path')} FROM budget b WHERE path <> '' AND NOT EXISTS "
            "(SELECT 1 FROM budget c WHERE c.path LIKE b.path || '/%') ORDER BY 1"
        ).fetchall()
    ]
    shares = dict(con.execute("SELECT path, global_share FROM budget").fetchall())
    rows = con.execute(
        f"""SELECT team, h, SUM(GREATEST(0, LEAST(e, {sim.start_ms} + (h + 1) * 3600000) - GREATEST(s, {sim.start_ms} + h * 3600000)) * gpus)
        FROM (SELECT *, unnest(range(CAST(FLOOR((s - {sim.start_ms}) / 3600000) AS BIGINT),
                                     CAST(CEIL((e - {sim.start_ms}) / 3600000.0) AS BIGINT))) AS h
              FROM (SELECT {TEAM_SQL} AS team, r.gpus, r.start_ms AS s, LEAST(COALESCE(r.end_ms, {sim.end_ms}), {sim.end_ms}) AS e
                    FROM runs r JOIN workloads w USING (workload) WHERE r.allocated))
        WHERE h < {hours} GROUP BY ALL"""
    ).fetchall()
    use = {t: np.zeros(hours) for t in teams}
    for team, h, gms in rows:
        if team in use and 0 <= h < hours:
            use[team][h] = gms
    window = 7 * 24
    n = len(teams)
    cols = 4 if n > 6 else max(1, n)
    nrows = -(-n // cols)
    fig, axes = plt.subplots(
        nrows, cols, figsize=(4 * cols, 2.6 * nrows), squeeze=False, sharex=True
    )
    x = np.arange(hours) / 24
    for i, team in enumerate(teams):
        ax = axes[i // cols][i % cols]
        cum = np.cumsum(use[team])
        trailing = (
            cum - np.concatenate([np.zeros(window), cum[:-window]]) if hours > window else cum
        )
        span = np.minimum(np.arange(1, hours + 1), window) * 3_600_000 * cap
        ax.plot(x, 100 * trailing / span, lw=1.2, label="used (trailing 7 d)")
        ax.axhline(
            100 * float(shares.get(team, 0)),
            color="k",
            ls="--",
            lw=1,
            label="budget (global share)",
        )
        ax.set_title(team, fontsize=9)
        ax.tick_params(labelsize=7)
    for j in range(n, nrows * cols):
        axes[j // cols][j % cols].axis("off")
    axes[0][0].legend(fontsize=7)
    fig.supxlabel("day")
    fig.supylabel("% of cluster GPU time")
    fig.suptitle(f"allocated usage against budget per team ({sim.policy} policy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gpu_timeline(sim: Any, path: Path, window_days: float = 3.0, max_nodes: int = 64) -> None:
    plt = _plt()
    from matplotlib.collections import LineCollection, PolyCollection

    con = sim.con
    t0 = sim.start_ms
    t1 = min(sim.end_ms, t0 + int(window_days * 86_400_000))
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
            xs, xe = (max(s, t0) - t0) / 86_400_000, (e - t0) / 86_400_000
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
    ax.set_xlim(0, (t1 - t0) / 86_400_000)
    ax.set_ylim(row, 0)
    ax.set_xlabel("day")
    ax.set_ylabel(f"GPU (first {len(nodes)} nodes)")
    from matplotlib.patches import Patch

    handles = [Patch(color=colour[t], label=t) for t in teams[:20]]
    handles.append(Patch(facecolor="grey", hatch="////", label="preemptible"))
    handles.append(Patch(color="red", label="preempted"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"GPU timeline ({sim.policy} policy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def wait_distribution(sims: dict[str, Any], path: Path) -> None:
    import numpy as np

    plt = _plt()
    classes = {
        "debug": "x.gpus <= 8 AND x.min_runtime_ms <= 900000",
        "large (>= 64 GPUs)": "x.gpus >= 64",
        "other": "NOT (x.gpus <= 8 AND x.min_runtime_ms <= 900000) AND x.gpus < 64",
    }
    fig, axes = plt.subplots(1, len(classes), figsize=(5 * len(classes), 3.8), sharey=True)
    styles = {"budget": "-", "priority": "--"}
    for ax, (label, cond) in zip(axes, classes.items(), strict=True):
        for policy, sim in sims.items():
            waits = [
                r[0]
                for r in sim.con.execute(
                    f"""SELECT (w.placed_ms - w.queued_ms) / 1000.0 FROM waits w JOIN workloads x USING (workload)
                    WHERE w.placed_ms IS NOT NULL AND {cond} ORDER BY 1"""
                ).fetchall()
            ]
            if not waits:
                continue
            xs = np.maximum(np.array(waits), 1.0)
            ax.step(
                xs,
                np.arange(1, len(xs) + 1) / len(xs),
                where="post",
                ls=styles.get(policy, "-"),
                label=f"{policy} (n={len(xs):,})",
            )
        ax.set_xscale("log")
        ax.set_title(label)
        ax.set_xlabel("queue wait (s, log; 0 shown at 1 s)")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    axes[0].set_ylabel("fraction of placements")
    fig.suptitle("queue wait distribution per class")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(sims: dict[str, Any], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = next(iter(sims.values()))
    paths = []
    p = out / "usage_vs_budget.png"
    usage_vs_budget(first, p)
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
