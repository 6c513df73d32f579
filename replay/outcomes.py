"""``make outcomes``: the family scenario over a grid of loads and seeds, both policies.

Each cell simulates the family scenario (:mod:`apportion.replay.family`) with
one ``load`` and one seed under the budget scheduler and under the priority
baseline, computes the KPIs of both, and diagnoses the budget run
(:mod:`apportion.replay.diagnose`; a cell of several clusters: the whole
tree's diagnosis, :func:`~apportion.replay.diagnose.diagnose_federation`). :func:`table` prints one row per cell,
the worst cell (lowest 7-day delivery of the worst team) last.

The default grid: loads 1.5, 2.5 and 4 with seeds 1-3 for 10 days, plus one
30-day cell at load 4, plus the big-team cells (:data:`BIG_CELLS`): the
``big_team`` knob (one team with 30% of the tree whose work is gangs of a third
to half of the cluster) at load 3.5, seeds 1-3, with margin 0 and with margin
0.05, for 10 days; and the federated cells (:data:`FEDERATED_CELLS`): the
same family as 2 or 3 clusters sharing the tree. Cells run in parallel
processes (one per core).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from apportion.core.history import Observer
from apportion.core.state import State
from apportion.schemas.events import DAY_MS
from apportion.schemas.history import HistoryItem

from .diagnose import SCHEDULER_CAUSES, diagnose, diagnose_federation
from .kpi import compute_kpis
from .run import KPI_COMMIT_EVERY, load_inputs, run_federation_policy, run_policy
from .simulator import simulate


@dataclass(frozen=True)
class Cell:
    load: float
    seed: int
    days: int
    knobs: tuple[str, ...] = ()
    """Family knobs (``KEY=VALUE``) of this cell beside its load."""

    def label(self) -> str:
        """The cell's own knobs, short: ``big 0.3 m 0.05``; ``-`` for none."""
        short = {"big_team": "big", "margin": "m", "clusters": "clusters"}
        parts = []
        for pair in self.knobs:
            key, _, value = pair.partition("=")
            parts.append(f"{short.get(key, key)} {value}")
        return " ".join(parts) or "-"


BIG_TEAM_SHARE = 0.3
BIG_CELLS = tuple(
    Cell(3.5, seed, 10, (f"big_team={BIG_TEAM_SHARE}", f"margin={margin}"))
    for margin in (0, 0.05)
    for seed in (1, 2, 3)
)
"""The big-team cells: one team with 30% of the tree and gangs of a third to half
of the cluster, at load 3.5, with margin 0 and with margin 0.05."""
FEDERATED_CELLS = tuple(
    Cell(load, seed, 7, (f"clusters={n}",))
    for n in (2, 3)
    for load in (2.5, 3.0)
    for seed in (1, 2)
)
"""Several clusters sharing the tree (family knob ``clusters``: ``big`` h100,
``small`` a100 and, with 3, ``mid`` h100; 512 GPUs in all), at loads 2.5 and 3,
seeds 1-2, for 7 days (one week) after the warm-up: the KPIs and the diagnosis
count the whole tree (owed: each team's share of every cluster's GPU-time)."""
DEFAULT_GRID = (
    tuple(Cell(load, seed, 10) for load in (1.5, 2.5, 4.0) for seed in (1, 2, 3))
    + (Cell(4.0, 1, 30),)
    + BIG_CELLS
    + FEDERATED_CELLS
)
QUICK_GRID = (Cell(1.5, 1, 2), Cell(4.0, 1, 2))


def _collector(items: list[HistoryItem]) -> Observer:
    """An observer that keeps every history item (for ``diagnose`` afterwards)."""

    def keep(item: HistoryItem, _state: State, _rejected: str | None) -> None:
        items.append(item)

    return keep


def run_cell(cell: Cell, knobs: tuple[str, ...] = ()) -> dict[str, Any]:
    """Both policies on one cell: KPIs, and the budget run's diagnosis. ``knobs``
    (``KEY=VALUE``) apply to every cell on top of its load and its own knobs."""
    t0 = time.process_time()
    inp = load_inputs(
        None,
        None,
        None,
        cell.seed,
        cell.days,
        "family",
        [f"load={cell.load}", *cell.knobs, *knobs],
    )
    out: dict[str, Any] = {
        "load": cell.load,
        "seed": cell.seed,
        "days": cell.days,
        "knobs": list(cell.knobs),
        "label": cell.label(),
    }
    start = inp.warmup_days * DAY_MS  # the warm-up days are not measured
    if inp.federation is not None:  # several clusters: the tree's KPIs and its diagnosis
        histories: dict[str, list[HistoryItem]] = {c.name: [] for c in inp.federation.clusters}
        sinks = {name: _collector(items) for name, items in histories.items()}
        res, out["budget"] = run_federation_policy(inp, inp.federation, "budget", sinks=sinks)
        out["priority"] = run_policy(inp, "priority")[1]
        diag = diagnose_federation(histories.items(), res.start_ms, per_cluster=False)
        del histories, sinks
        out.update(_loss(diag.tree.rows(from_ms=res.start_ms + start)))
        out["cpu_s"] = round(time.process_time() - t0, 1)
        return out
    for policy in ("budget", "priority"):
        items: list[HistoryItem] = []
        sink = _collector(items) if policy == "budget" else None
        sim = simulate(
            inp.cluster_events,
            inp.trace,
            inp.health,
            policy=policy,
            days=inp.days,
            sink=sink,
            history=False,  # only the KPIs' tables (the diagnosis reads ``items``)
            commit_every=KPI_COMMIT_EVERY,
        )
        assert sim.con is not None
        out[policy] = compute_kpis(
            sim.con, sim.start_ms + start, sim.end_ms, sim.wall_s, sim.events
        )
        sim.con.close()
        if items:
            out.update(_loss(diagnose(items).rows(from_ms=sim.start_ms + start)))
    out["cpu_s"] = round(time.process_time() - t0, 1)
    return out


def _loss(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``causes`` (each cause's share of the owed GPU-hours), ``controlled_loss``
    (the scheduler's causes together) and ``worst_team`` (the team with the lowest
    delivery, its shortfall's causes in GPU-hours) of a diagnosis's rows."""
    owed = sum(r["owed_gpu_h"] for r in rows)
    causes: dict[str, float] = {}
    for r in rows:
        for c, v in r["causes"].items():
            causes[c] = causes.get(c, 0.0) + v
    out: dict[str, Any] = {"causes": {c: (v / owed if owed else 0.0) for c, v in causes.items()}}
    out["controlled_loss"] = sum(out["causes"].get(c, 0.0) for c in SCHEDULER_CAUSES)
    served = [r for r in rows if r["delivery"] is not None]
    if served:
        worst = min(served, key=lambda r: (r["delivery"], r["team"]))
        out["worst_team"] = {
            k: worst[k]
            for k in ("team", "delivery", "owed_gpu_h", "shortfall_gpu_h", "causes", "clusters")
            if k in worst
        }
    return out


def run_grid(
    cells: tuple[Cell, ...] = DEFAULT_GRID,
    workers: int | None = None,
    knobs: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Every cell, in parallel processes; results in the grid's order."""
    workers = workers or max(1, min(len(cells), os.cpu_count() or 1))
    if workers == 1:
        return [run_cell(c, knobs) for c in cells]
    # the longest cells first, so the pool does not end on one long cell
    order = sorted(range(len(cells)), key=lambda i: -cells[i].days * cells[i].load)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {i: pool.submit(run_cell, cells[i], knobs) for i in order}
        return [futures[i].result() for i in range(len(cells))]


def _worst_team(k: dict[str, Any], key: str = "team_delivery_7d") -> float | None:
    values = [v for v in k[key].values() if v is not None]
    return min(values) if values else None


def _worst_week(k: dict[str, Any]) -> float | None:
    """The worst team's worst week (non-overlapping 7-day window)."""
    return _worst_team(k, "team_delivery_week_min")


def _worst_sliding(k: dict[str, Any]) -> float | None:
    w = k["worst_sliding_7d"]
    return None if w is None else w["ratio"]


def _largest(k: dict[str, Any], key: str) -> float | None:
    t = k["largest_team"]
    return None if t is None else t[key]


def _never(k: dict[str, Any], cls: str) -> str:
    """``"35.0% (12/40)"``: the GPU-weighted never-placed share, count of all."""
    frac = k[f"{cls}_never_placed_gpu_fraction"]
    if frac is None:
        return "-"
    return f"{100 * frac:.1f}% ({k[f'{cls}_never_placed']}/{k[f'{cls}_submitted']})"


def _ratio_x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _worst_window(k: dict[str, Any]) -> float | None:
    values = [w["worst_team_ratio"] for w in k["windows_5d"] if w["worst_team_ratio"] is not None]
    return min(values) if values else None


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _hours(s: float | None) -> str:
    return "-" if s is None else f"{s / 3600:.1f} h"


def table(results: list[dict[str, Any]]) -> str:
    """One row per cell, the worst cell (its worst team's worst week) last."""
    head = [
        "load",
        "seed",
        "days",
        "knobs",
        "occupancy",
        "deliv 1h",
        "deliv 7d",
        "worst 7d",
        "starved",
        "ctrl loss",
        "worst 5d win",
        "dbg-alloc p90",
        "large p90*",
        "worst wk",
        "worst slide",
        "big team",
        "big wk",
        "large unplaced",
        "small unplaced",
        "lg/sm",
        "dbl served",
        "| base deliv",
        "base worst 5d",
        "base large p90*",
    ]
    rows = []

    def worst_key(r: dict[str, Any]) -> float:
        v = _worst_week(r["budget"])
        return 2.0 if v is None else v

    for r in sorted(results, key=lambda r: -worst_key(r)):
        b, p = r["budget"], r["priority"]
        rows.append(
            [
                f"{r['load']:g}x",
                str(r["seed"]),
                str(r["days"]),
                r.get("label", "-"),
                _pct(b["occupancy"]),
                _pct(b["delivery_ratio"]),
                _pct(b["delivery_ratio_7d"]),
                _pct(_worst_team(b)),
                str(len(b["starved_teams"])),
                _pct(r.get("controlled_loss")),
                _pct(_worst_window(b)),
                "-"
                if b["debug_allocated_wait_p90_s"] is None
                else f"{b['debug_allocated_wait_p90_s']:.0f} s",
                _hours(b["large_wait_p90_censored_s"]),
                _pct(_worst_week(b)),
                _pct(_worst_sliding(b)),
                _pct(_largest(b, "delivery_weeks")),
                _pct(_largest(b, "week_min")),
                _never(b, "large"),
                _never(b, "small_allocated"),
                _ratio_x(b["never_placed_gpu_ratio"]),
                "-" if "double_served_teams" not in b else str(len(b["double_served_teams"])),
                "| " + _pct(p["delivery_ratio"]),
                _pct(_worst_window(p)),
                _hours(p["large_wait_p90_censored_s"]),
            ]
        )
    lines = [head, *rows]
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    text = []
    for i, line in enumerate(lines):
        text.append("  ".join(c.rjust(widths[j]) for j, c in enumerate(line)))
        if i == 0:
            text.append("  ".join("-" * w for w in widths))
    return "\n".join(text)
