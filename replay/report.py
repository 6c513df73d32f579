"""The KPI table a person reads: one column per run, rows in a fixed order.

``kpi_table({"budget": kpis, "priority": kpis})`` puts two runs side by side
with the change between them; the teams' delivery ratios follow the KPIs.
"""

from __future__ import annotations

from typing import Any

from apportion.core.rules.classes import LARGE_MIN_GPUS

KPI_ROWS = (
    ("occupancy", "occupancy", "pct"),
    ("delivery_ratio", "delivered / owed", "pct"),
    ("worst_team", "worst team delivered / owed", "pct"),
    ("teams_ge_95", "teams >= 95% delivered", "int"),
    ("unallocated_fraction", "unallocated GPU time", "pct"),
    ("wait_p50_s", "wait p50", "dur"),
    ("wait_p90_s", "wait p90", "dur"),
    ("debug_wait_p90_s", "debug wait p90", "dur"),
    ("debug_allocated_wait_p90_s", "debug (min runtime > 0) wait p90", "dur"),
    ("large_wait_p90_s", f"large (>= {LARGE_MIN_GPUS} GPUs) wait p90", "dur"),
    ("open_waits", "still waiting at the end", "int"),
    ("preemptions_per_1000_gpu_h", "preemptions / 1000 GPU-h", "num"),
    ("drain_time_p90_s", "drain time p90", "dur"),
    ("demand_ratio", "allocated demand / capacity", "num"),
    ("simulated_days", "simulated days", "num"),
    ("workloads", "workloads", "int"),
    ("events", "events", "int"),
    ("wall_s", "wall time (s)", "num"),
)


def format_value(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "int":
        return f"{int(value):,}"
    if kind == "dur":
        v = float(value)
        if v < 120:
            return f"{v:.0f} s"
        if v < 7200:
            return f"{v / 60:.1f} min"
        return f"{v / 3600:.1f} h"
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def _derived(k: dict[str, Any]) -> dict[str, Any]:
    td = [v for v in k["team_delivery"].values() if v is not None]
    return {
        **k,
        "worst_team": min(td) if td else None,
        "teams_ge_95": sum(1 for v in td if v >= 0.95),
    }


def kpi_table(results: dict[str, dict[str, Any]], teams: bool = True) -> str:
    """The KPI table; with two policies, side by side with the change."""
    names = list(results)
    rows: list[list[str]] = [["KPI", *names]]
    if len(names) == 2:
        rows[0].append("change")
    data = {n: _derived(results[n]) for n in names}
    for key, label, kind in KPI_ROWS:
        row = [label, *(format_value(data[n].get(key), kind) for n in names)]
        if len(names) == 2:
            a, b = data[names[0]].get(key), data[names[1]].get(key)
            if (
                isinstance(a, int | float)
                and isinstance(b, int | float)
                and key not in ("simulated_days",)
            ):
                if kind == "pct":
                    row.append(f"{100 * (a - b):+.1f} pt")
                elif b:
                    row.append(f"{a / b:.2f}x")
                else:
                    row.append("")
            else:
                row.append("")
        rows.append(row)
    if teams:
        all_teams = sorted({t for n in names for t in results[n]["team_delivery"]})
        for t in all_teams:
            vals = [results[n]["team_delivery"].get(t) for n in names]
            row = [f"  {t}", *(format_value(v, "pct") for v in vals)]
            if len(names) == 2:
                row.append(f"{100 * (vals[0] - vals[1]):+.1f} pt" if None not in vals else "")
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, r in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(widths[0]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(r))
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
