"""The KPIs (docs/formats.md, "KPI keys") as SQL over the projection tables.

Every figure is one query over ``runs``, ``waits``, ``workloads``, ``nodes``,
``health`` and ``budget`` for the horizon ``[start, end)`` of a run (a run or a
wait still open at ``end`` is cut at ``end``); :data:`KPI_SQL` holds the text so
an analyst can rerun it (``$start``/``$end`` are the horizon in ms).

Definitions (choices of our own are marked *):

- **team**: the budget node one level above the leaves; a leaf directly under
  the root is its own team (SQL: the owner path without its last segment).
- **healthy GPU-time**: GPUs x time a node is ``healthy`` (draining, drained
  and down time is not available). Every node is healthy from ``start`` until
  its first health row.
- **occupancy** = GPU-time of runs on healthy nodes / healthy GPU-time.
- per team and hour: **owed** = min(global share x healthy GPU-hours of the
  hour, demand), demand = GPU-hours of its allocated (``min_runtime > 0``)
  workloads between submission and end (pending or running); **delivered** =
  min(allocated GPU-hours it ran in the hour, owed). ``delivery_ratio`` =
  sum delivered / sum owed over all teams and hours; ``team_delivery`` per team
  (``null`` for a team never owed anything).
- **weeks** (``windows_7d``): the horizon cut into consecutive 7-day windows
  from ``start``, each hour in one; *a last partial week counts if it has at
  least a day (the first always). Per team and week, owed_w = sum of its hourly
  owed, delivered_w = min(sum of its allocated GPU-hours run, owed_w) (a surplus
  hour repays a short one of the same week): ``team_delivery_weeks``,
  ``team_delivery_week_min`` (the worst week), ``delivery_ratio_weeks``.
  *``team_delivery_7d_sliding_min`` / ``worst_sliding_7d``: the same ratio over
  7-day windows starting at every whole hour. ``delivery_ratio_7d`` and
  ``team_delivery_7d`` keep their older meaning: overlapping windows starting
  every day (a middle day counted in up to 7 of them).
- **starved_teams**: teams with a week under 95% of what they were owed (the
  hourly owed is already capped at the share, so demand above the share excuses
  nothing); ``starved_teams_by_demand`` keeps the older rule (a daily-start
  window with average demand at or below the share).
- **largest_team**: the largest global share and its delivery figures.
- **never placed**: large (``gpus >= 64``) and small allocated (``gpus < 64``,
  ``min_runtime > 0``) workloads submitted in ``[start, end)``, not rejected nor
  cancelled unplaced before ``end``, with no placement before ``end``: counts,
  shares by count and by GPUs, and ``never_placed_gpu_ratio`` (large GPU share /
  small allocated GPU share).
- **unallocated_fraction** = GPU-hours of unallocated runs / all GPU-hours run.
- **waits**: each queue episode that ended in a placement before ``end``
  (submit or requeue -> placement); p50/p90 over all, over debug workloads
  (``gpus <= 8 and min_runtime <= 15 min``, as docs/semantics.md defines it, so small
  zero-min-runtime work counts), and over large ones (``gpus >= 64``).
  *Episodes still waiting at ``end`` are not in the percentiles; they are
  counted in ``open_waits`` (and ``open_large_waits``).
- **preemptions_per_1000_gpu_h**: *scheduler preemptions (fair share,
  unallocated, drain; not node_down losses) per 1000 GPU-hours run.
- **drain_time_p90_s**: from a node's ``draining`` row to its ``drained`` row
  (the ``NodeDrained`` decision), p90 over the drains that completed.

Extra keys beyond the core set: ``debug_allocated_wait_p90_s`` (debug with
``min_runtime > 0``) and the same per request size
(``debug_allocated_wait_p90_by_gpus_s``: a whole-node debug job waits for a
whole node, which a full cluster frees far less often than a GPU), ``open_waits``, ``open_large_waits``, ``demand_ratio``
(mean allocated demand in GPUs, pending or running, / healthy GPUs),
``rejected``.

Start-time estimate accuracy (the ``estimates`` table, empty unless the
simulator sampled estimates): ``estimate_samples`` counts the samples made in
``[start, end)``; a sample is *compared* when it has an estimate and the
workload's first placement at or after the sample (``waits.placed_ms``) falls
before ``end``. Over the compared samples: ``estimate_abs_error_p50_s`` and
``estimate_abs_error_p90_s`` (|actual - estimated|, seconds) and
``estimate_late_fraction`` (actual start later than estimated). Each estimate
assumes nothing new arrives, so errors measure what arrivals changed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import duckdb
from apportion.core.rules.classes import (
    allocated_debug_sql,
    allocated_sql,
    debug_sql,
    large_sql,
    team_sql,
)

HOUR_MS = 3_600_000

KPI_KEYS = (
    "occupancy",
    "delivery_ratio",
    "team_delivery",
    "unallocated_fraction",
    "wait_p50_s",
    "wait_p90_s",
    "debug_wait_p90_s",
    "large_wait_p90_s",
    "preemptions_per_1000_gpu_h",
    "drain_time_p90_s",
    "simulated_days",
    "workloads",
    "events",
    "wall_s",
)

_VIEWS = f"""
CREATE OR REPLACE TEMP VIEW kpi_node_seg AS
SELECT s.node, n.gpus, s.state, s.start_ms,
       COALESCE(LEAD(s.start_ms) OVER (PARTITION BY s.node ORDER BY s.start_ms, s.ord), $end) AS end_ms
FROM (SELECT node, 'healthy' AS state, $start AS start_ms, -1 AS ord FROM nodes
      UNION ALL
      SELECT node, state, at_ms, rowid FROM health WHERE at_ms >= $start AND at_ms < $end) s
JOIN nodes n USING (node);

CREATE OR REPLACE TEMP VIEW kpi_healthy AS
SELECT node, gpus, start_ms, end_ms FROM kpi_node_seg WHERE state = 'healthy' AND end_ms > start_ms;

CREATE OR REPLACE TEMP VIEW kpi_runs AS
SELECT r.workload, r.node, r.gpus, GREATEST(r.start_ms, $start) AS start_ms,
       LEAST(COALESCE(r.end_ms, $end), $end) AS end_ms, r.allocated, r.end_reason, r.attempt,
       w.owner,
       {team_sql("w.owner")} AS team
FROM runs r JOIN workloads w USING (workload)
WHERE r.start_ms < $end AND COALESCE(r.end_ms, $end) > $start;

CREATE OR REPLACE TEMP VIEW kpi_teams AS
SELECT DISTINCT {team_sql("b.path")} AS team
FROM budget b WHERE b.path <> '' AND NOT EXISTS (
    SELECT 1 FROM budget c WHERE c.path LIKE b.path || '/%');
"""

KPI_SQL: dict[str, str] = {
    "occupancy": """
SELECT (SELECT SUM(GREATEST(0, LEAST(r.end_ms, h.end_ms) - GREATEST(r.start_ms, h.start_ms)) * r.gpus)
          FROM kpi_runs r JOIN kpi_healthy h ON r.node = h.node AND r.start_ms < h.end_ms AND r.end_ms > h.start_ms)
     / NULLIF((SELECT SUM((end_ms - start_ms) * gpus) FROM kpi_healthy), 0)
""",
    "delivery": f"""
WITH hours AS (SELECT unnest(range(0, CAST(CEIL(($end - $start) / 3600000.0) AS BIGINT))) AS h),
avail AS (
    SELECT h, SUM(GREATEST(0, LEAST(k.end_ms, $start + (h + 1) * 3600000) - GREATEST(k.start_ms, $start + h * 3600000)) * k.gpus) AS gpu_ms
    FROM (SELECT *, unnest(range(CAST(FLOOR((start_ms - $start) / 3600000) AS BIGINT),
                                 CAST(CEIL((end_ms - $start) / 3600000.0) AS BIGINT))) AS h FROM kpi_healthy) k
    GROUP BY h),
dem AS (
    SELECT team, h, SUM(GREATEST(0, LEAST(e, $start + (h + 1) * 3600000) - GREATEST(s, $start + h * 3600000)) * gpus) AS gpu_ms
    FROM (SELECT *, unnest(range(CAST(FLOOR((s - $start) / 3600000) AS BIGINT), CAST(CEIL((e - $start) / 3600000.0) AS BIGINT))) AS h
          FROM (SELECT {team_sql("owner")} AS team,
                       gpus, GREATEST(submitted_ms, $start) AS s, LEAST(COALESCE(ended_ms, $end), $end) AS e
                FROM workloads WHERE {allocated_sql()} AND status <> 'rejected'
                  AND submitted_ms < $end AND COALESCE(ended_ms, $end) > $start))
    GROUP BY team, h),
ran AS (
    SELECT team, h, SUM(GREATEST(0, LEAST(end_ms, $start + (h + 1) * 3600000) - GREATEST(start_ms, $start + h * 3600000)) * gpus) AS gpu_ms
    FROM (SELECT *, unnest(range(CAST(FLOOR((start_ms - $start) / 3600000) AS BIGINT), CAST(CEIL((end_ms - $start) / 3600000.0) AS BIGINT))) AS h
          FROM kpi_runs WHERE allocated AND end_ms > start_ms)
    GROUP BY team, h),
owed AS (
    SELECT t.team, hours.h,
           b.global_share * COALESCE(a.gpu_ms, 0) AS share_ms,
           COALESCE(d.gpu_ms, 0) AS demand_ms,
           COALESCE(r.gpu_ms, 0) AS ran_ms
    FROM kpi_teams t CROSS JOIN hours
    JOIN budget b ON b.path = t.team
    LEFT JOIN avail a ON a.h = hours.h
    LEFT JOIN dem d ON d.team = t.team AND d.h = hours.h
    LEFT JOIN ran r ON r.team = t.team AND r.h = hours.h)
SELECT team, h, share_ms, demand_ms, ran_ms FROM owed ORDER BY team, h
""",
    "unallocated_fraction": """
SELECT SUM(CASE WHEN NOT allocated THEN (end_ms - start_ms) * gpus ELSE 0 END) / NULLIF(SUM((end_ms - start_ms) * gpus), 0)
FROM kpi_runs
""",
    "waits": f"""
SELECT quantile_cont((w.placed_ms - w.queued_ms) / 1000.0, 0.5),
       quantile_cont((w.placed_ms - w.queued_ms) / 1000.0, 0.9),
       quantile_cont((w.placed_ms - w.queued_ms) / 1000.0, 0.9) FILTER (WHERE {debug_sql("x.gpus", "x.min_runtime_ms")}),
       quantile_cont((w.placed_ms - w.queued_ms) / 1000.0, 0.9) FILTER (WHERE {large_sql("x.gpus")}),
       quantile_cont((w.placed_ms - w.queued_ms) / 1000.0, 0.9) FILTER (WHERE {allocated_debug_sql("x.gpus", "x.min_runtime_ms")})
FROM waits w JOIN workloads x USING (workload)
WHERE w.placed_ms IS NOT NULL AND w.placed_ms >= $start AND w.placed_ms < $end
""",
    "debug_allocated_by_gpus": f"""
SELECT x.gpus, quantile_cont((w.placed_ms - w.queued_ms) / 1000.0, 0.9), COUNT(*)
FROM waits w JOIN workloads x USING (workload)
WHERE w.placed_ms IS NOT NULL AND w.placed_ms >= $start AND w.placed_ms < $end
  AND {allocated_debug_sql("x.gpus", "x.min_runtime_ms")}
GROUP BY x.gpus ORDER BY x.gpus
""",
    "large_waits_censored": f"""
SELECT quantile_cont((LEAST(COALESCE(w.placed_ms, $end), $end) - w.queued_ms) / 1000.0, 0.9)
FROM waits w JOIN workloads x USING (workload)
WHERE {large_sql("x.gpus")} AND w.queued_ms < $end
  AND (w.placed_ms IS NULL OR w.placed_ms >= $start)
  AND NOT (w.placed_ms IS NULL AND x.status = 'cancelled' AND x.ended_ms < $end)
""",
    "open_waits": f"""
SELECT COUNT(*), COUNT(*) FILTER (WHERE {large_sql("x.gpus")})
FROM waits w JOIN workloads x USING (workload)
WHERE w.queued_ms < $end AND (w.placed_ms IS NULL OR w.placed_ms >= $end)
  AND NOT (w.placed_ms IS NULL AND x.status = 'cancelled' AND x.ended_ms < $end)
""",
    "preemptions": """
SELECT (SELECT COUNT(*) FROM (SELECT DISTINCT workload, attempt FROM kpi_runs WHERE end_reason = 'preempted' AND end_ms < $end))
       * 1000.0 / NULLIF((SELECT SUM((end_ms - start_ms) * gpus) FROM kpi_runs) / 3600000.0, 0)
""",
    "drain": """
SELECT quantile_cont((nxt_ms - at_ms) / 1000.0, 0.9)
FROM (SELECT node, at_ms, state, LEAD(state) OVER w AS nxt, LEAD(at_ms) OVER w AS nxt_ms
      FROM health WINDOW w AS (PARTITION BY node ORDER BY at_ms, rowid))
WHERE state = 'draining' AND nxt = 'drained' AND at_ms >= $start AND at_ms < $end
""",
    "estimates": """
WITH s AS (
    SELECT e.workload, e.at_ms, e.estimated_start_ms,
           (SELECT MIN(w.placed_ms) FROM waits w
             WHERE w.workload = e.workload AND w.placed_ms >= e.at_ms) AS actual_ms
    FROM estimates e WHERE e.at_ms >= $start AND e.at_ms < $end),
c AS (SELECT * FROM s WHERE estimated_start_ms IS NOT NULL AND actual_ms IS NOT NULL AND actual_ms < $end)
SELECT (SELECT COUNT(*) FROM s),
       quantile_cont(ABS(actual_ms - estimated_start_ms) / 1000.0, 0.5),
       quantile_cont(ABS(actual_ms - estimated_start_ms) / 1000.0, 0.9),
       AVG(CASE WHEN actual_ms > estimated_start_ms THEN 1.0 ELSE 0.0 END)
FROM c
""",
    "never_placed": f"""
WITH sub AS (
    SELECT x.gpus, {large_sql("x.gpus")} AS large, {allocated_sql("x.min_runtime_ms")} AS alloc,
           (x.first_placed_ms IS NULL OR x.first_placed_ms >= $end) AS never
    FROM workloads x
    WHERE x.submitted_ms >= $start AND x.submitted_ms < $end AND x.status <> 'rejected'
      AND NOT (x.status = 'cancelled' AND x.ended_ms < $end
               AND (x.first_placed_ms IS NULL OR x.first_placed_ms >= $end))),
kept AS (
    SELECT * FROM sub WHERE large OR alloc)
SELECT COUNT(*) FILTER (WHERE large), COUNT(*) FILTER (WHERE large AND never),
       SUM(gpus) FILTER (WHERE large), SUM(gpus) FILTER (WHERE large AND never),
       COUNT(*) FILTER (WHERE NOT large), COUNT(*) FILTER (WHERE NOT large AND never),
       SUM(gpus) FILTER (WHERE NOT large), SUM(gpus) FILTER (WHERE NOT large AND never)
FROM kept
""",
    "team_shares": """
SELECT t.team, b.global_share FROM kpi_teams t JOIN budget b ON b.path = t.team
""",
    "demand_ratio": f"""
SELECT (SELECT SUM((LEAST(COALESCE(ended_ms, $end), $end) - GREATEST(submitted_ms, $start)) * gpus)
          FROM workloads WHERE {allocated_sql()} AND status <> 'rejected'
           AND submitted_ms < $end AND COALESCE(ended_ms, $end) > $start)
       / NULLIF((SELECT SUM((end_ms - start_ms) * gpus) FROM kpi_healthy), 0)
""",
}


class TeamHour(NamedTuple):
    """One team in one hour of the horizon: GPU-ms of its global share of the
    healthy GPUs, of its allocated demand (pending or running), of its allocated runs."""

    team: str
    hour: int
    share_ms: float
    demand_ms: float
    ran_ms: float

    @property
    def owed_ms(self) -> float:
        return min(self.share_ms, self.demand_ms)


WINDOW_7D_H = 7 * 24
WINDOW_5D_H = 5 * 24
STARVED_BELOW = 0.95
MIN_PARTIAL_WEEK_H = 24
"""A last, partial week of the horizon counts if it has at least this many hours."""


def _ratio(delivered: float, owed: float) -> float | None:
    return _r(delivered / owed) if owed > 0 else None


def delivery_kpis(
    hourly: list[TeamHour], hours: int, shares: dict[str, float] | None = None
) -> dict[str, Any]:
    """The delivery KPIs from per-team, per-hour figures (see the module docstring);
    ``shares`` (team: global share) picks the largest team (without it: the
    largest sum of ``share_ms``)."""
    by_team: dict[str, list[TeamHour]] = {}
    for row in hourly:
        by_team.setdefault(row.team, []).append(row)
    out: dict[str, Any] = {}
    # hourly (strict): a burst in one hour does not repay a shortfall in another
    team_delivered = {t: sum(min(r.ran_ms, r.owed_ms) for r in rows) for t, rows in by_team.items()}
    team_owed = {t: sum(r.owed_ms for r in rows) for t, rows in by_team.items()}
    out["delivery_ratio"] = _ratio(sum(team_delivered.values()), sum(team_owed.values()))
    out["team_delivery"] = {t: _ratio(team_delivered[t], team_owed[t]) for t in sorted(by_team)}
    # 7-day windows, one starting at each day (one window when the horizon is shorter)
    span = min(WINDOW_7D_H, hours)
    starts = range(0, max(1, hours - span + 1), 24)
    w_delivered: dict[str, float] = {}
    w_owed: dict[str, float] = {}
    starved: dict[str, None] = {}
    for t in sorted(by_team):
        rows = by_team[t]
        for s0 in starts:
            window = rows[s0 : s0 + span]
            owed = sum(r.owed_ms for r in window)
            ran = sum(r.ran_ms for r in window)
            share = sum(r.share_ms for r in window)
            demand = sum(r.demand_ms for r in window)
            w_owed[t] = w_owed.get(t, 0.0) + owed
            w_delivered[t] = w_delivered.get(t, 0.0) + min(ran, owed)
            if owed > 0 and demand <= share and ran < STARVED_BELOW * owed:
                starved[t] = None  # the rule before owed-based starvation (by demand)
    out["delivery_ratio_7d"] = _ratio(sum(w_delivered.values()), sum(w_owed.values()))
    out["team_delivery_7d"] = {t: _ratio(w_delivered[t], w_owed[t]) for t in sorted(by_team)}
    out["starved_teams_by_demand"] = list(starved)
    # drift: delivery and the worst team in each 5-day window (hourly, as above)
    windows = []
    for s0 in range(0, hours, WINDOW_5D_H):
        per_team = {}
        for t in sorted(by_team):
            part = [r for r in by_team[t] if s0 <= r.hour < s0 + WINDOW_5D_H]
            per_team[t] = (
                sum(min(r.ran_ms, r.owed_ms) for r in part),
                sum(r.owed_ms for r in part),
            )
        ratios = {t: d / o for t, (d, o) in per_team.items() if o > 0}
        worst = min(ratios, key=lambda t: (ratios[t], t)) if ratios else None
        windows.append(
            {
                "start_day": s0 // 24,
                "delivery_ratio": _ratio(
                    sum(d for d, _ in per_team.values()), sum(o for _, o in per_team.values())
                ),
                "worst_team": worst,
                "worst_team_ratio": _r(ratios[worst]) if worst is not None else None,
            }
        )
    out["windows_5d"] = windows
    out.update(_week_kpis(by_team, hours))
    out.update(_sliding_kpis(by_team, hours))
    out["largest_team"] = _largest_team(by_team, out, shares)
    return out


def _week_bounds(hours: int) -> list[tuple[int, int]]:
    """The weeks of a horizon of ``hours``: consecutive 7-day windows from its
    start; a last partial one is kept if it has at least a day (the first one
    always, so a horizon under a day has one)."""
    bounds = []
    for s0 in range(0, max(1, hours), WINDOW_7D_H):
        e0 = min(s0 + WINDOW_7D_H, hours)
        if s0 == 0 or e0 - s0 >= MIN_PARTIAL_WEEK_H:
            bounds.append((s0, e0))
    return bounds


def _week_kpis(by_team: dict[str, list[TeamHour]], hours: int) -> dict[str, Any]:
    """Delivery over the weeks (non-overlapping 7-day windows): each hour in one
    window, a surplus hour repays a short one of the same window."""
    teams = sorted(by_team)
    windows = []
    delivered = dict.fromkeys(teams, 0.0)
    owed = dict.fromkeys(teams, 0.0)
    week_min: dict[str, float | None] = dict.fromkeys(teams)
    starved: list[str] = []
    for s0, e0 in _week_bounds(hours):
        per_team: dict[str, tuple[float, float]] = {}
        for t in teams:
            part = by_team[t][s0:e0]
            o = sum(r.owed_ms for r in part)
            d = min(sum(r.ran_ms for r in part), o)
            per_team[t] = (d, o)
            delivered[t] += d
            owed[t] += o
            if o > 0:
                ratio = _r(d / o)
                prev = week_min[t]
                week_min[t] = ratio if prev is None else min(prev, ratio)
                if d < STARVED_BELOW * o and t not in starved:
                    starved.append(t)
        ratios = {t: d / o for t, (d, o) in per_team.items() if o > 0}
        worst = min(ratios, key=lambda t: (ratios[t], t)) if ratios else None
        windows.append(
            {
                "start_day": s0 // 24,
                "days": _r((e0 - s0) / 24, 3),
                "delivery_ratio": _ratio(
                    sum(d for d, _ in per_team.values()), sum(o for _, o in per_team.values())
                ),
                "team_delivery": {t: _ratio(*per_team[t]) for t in teams},
                "worst_team": worst,
                "worst_team_ratio": _r(ratios[worst]) if worst is not None else None,
            }
        )
    return {
        "windows_7d": windows,
        "delivery_ratio_weeks": _ratio(sum(delivered.values()), sum(owed.values())),
        "team_delivery_weeks": {t: _ratio(delivered[t], owed[t]) for t in teams},
        "team_delivery_week_min": week_min,
        "starved_teams": sorted(starved),
    }


def _sliding_kpis(by_team: dict[str, list[TeamHour]], hours: int) -> dict[str, Any]:
    """The worst 7-day window starting at any whole hour (one window of the whole
    horizon when it is shorter than 7 days), per team and over all teams."""
    span = min(WINDOW_7D_H, hours)
    team_min: dict[str, float | None] = {}
    worst: dict[str, Any] | None = None
    for t in sorted(by_team):
        rows = by_team[t][:hours]
        owed_sum = [0.0]
        ran_sum = [0.0]
        for r in rows:
            owed_sum.append(owed_sum[-1] + r.owed_ms)
            ran_sum.append(ran_sum[-1] + r.ran_ms)
        best: tuple[float, int] | None = None
        for s0 in range(0, max(1, len(rows) - span + 1)):
            e0 = min(s0 + span, len(rows))
            o = owed_sum[e0] - owed_sum[s0]
            if o <= 0:
                continue
            ratio = min(ran_sum[e0] - ran_sum[s0], o) / o
            if best is None or ratio < best[0]:
                best = (ratio, s0)
        team_min[t] = None if best is None else _r(best[0])
        if best is not None and (worst is None or best[0] < worst["_ratio"]):
            worst = {"team": t, "start_hour": best[1], "ratio": _r(best[0]), "_ratio": best[0]}
    if worst is not None:
        del worst["_ratio"]
    return {"team_delivery_7d_sliding_min": team_min, "worst_sliding_7d": worst}


def _largest_team(
    by_team: dict[str, list[TeamHour]], out: dict[str, Any], shares: dict[str, float] | None
) -> dict[str, Any] | None:
    """The team with the largest global share (ties: the first path) and its delivery."""
    if not by_team:
        return None

    def size(t: str) -> float:
        if shares is not None and t in shares:
            return shares[t]
        return sum(r.share_ms for r in by_team[t])

    team = min(by_team, key=lambda t: (-size(t), t))
    return {
        "team": team,
        "global_share": _r(shares.get(team)) if shares is not None else None,
        "delivery": out["team_delivery"][team],
        "delivery_weeks": out["team_delivery_weeks"][team],
        "week_min": out["team_delivery_week_min"][team],
        "sliding_7d_min": out["team_delivery_7d_sliding_min"][team],
    }


def _q(con: duckdb.DuckDBPyConnection, sql: str, start: int, end: int) -> list[tuple]:
    return con.execute(
        sql.replace("$start", str(int(start))).replace("$end", str(int(end)))
    ).fetchall()


def _count(con: duckdb.DuckDBPyConnection, sql: str) -> int:
    """The one value of a ``SELECT COUNT(*) ...`` (an aggregate always returns one row)."""
    row = con.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


def _r(x: Any, nd: int = 4) -> Any:
    return None if x is None else round(float(x), nd)


def compute_kpis(
    con: duckdb.DuckDBPyConnection,
    start_ms: int,
    end_ms: int,
    wall_s: float = 0.0,
    events: int | None = None,
) -> dict[str, Any]:
    """All KPIs for the horizon ``[start_ms, end_ms)``, keyed as the KPI JSON of docs/formats.md.

    ``events``: the number of events, when the projection counted them instead of
    keeping the ``events`` table (``Projection(history=False)``)."""
    con.execute(_VIEWS.replace("$start", str(int(start_ms))).replace("$end", str(int(end_ms))))
    occ = _q(con, KPI_SQL["occupancy"], start_ms, end_ms)[0][0]
    hourly = [
        TeamHour(team, int(h), float(share), float(demand), float(ran))
        for team, h, share, demand, ran in _q(con, KPI_SQL["delivery"], start_ms, end_ms)
    ]
    shares = {t: float(g) for t, g in _q(con, KPI_SQL["team_shares"], start_ms, end_ms)}
    delivery = delivery_kpis(hourly, round((end_ms - start_ms) / HOUR_MS), shares)
    never = _never_placed(_q(con, KPI_SQL["never_placed"], start_ms, end_ms)[0])
    unalloc = _q(con, KPI_SQL["unallocated_fraction"], start_ms, end_ms)[0][0]
    p50, p90, dbg, large, dbg_alloc = _q(con, KPI_SQL["waits"], start_ms, end_ms)[0]
    dbg_by_gpus = _q(con, KPI_SQL["debug_allocated_by_gpus"], start_ms, end_ms)
    large_censored = _q(con, KPI_SQL["large_waits_censored"], start_ms, end_ms)[0][0]
    open_all, open_large = _q(con, KPI_SQL["open_waits"], start_ms, end_ms)[0]
    pre = _q(con, KPI_SQL["preemptions"], start_ms, end_ms)[0][0]
    drain = _q(con, KPI_SQL["drain"], start_ms, end_ms)[0][0]
    demand = _q(con, KPI_SQL["demand_ratio"], start_ms, end_ms)[0][0]
    has_estimates = _count(
        con, "SELECT COUNT(*) FROM duckdb_tables() WHERE table_name = 'estimates' AND NOT temporary"
    )
    est_n, est_p50, est_p90, est_late = (
        _q(con, KPI_SQL["estimates"], start_ms, end_ms)[0]
        if has_estimates
        else (0, None, None, None)
    )
    n_workloads = _count(con, "SELECT COUNT(*) FROM workloads")
    n_rejected = _count(con, "SELECT COUNT(*) FROM workloads WHERE status = 'rejected'")
    n_events = _count(con, "SELECT COUNT(*) FROM events") if events is None else events
    return {
        "occupancy": _r(occ),
        "delivery_ratio": delivery["delivery_ratio"],
        "team_delivery": delivery["team_delivery"],
        "unallocated_fraction": _r(unalloc),
        "wait_p50_s": _r(p50, 1),
        "wait_p90_s": _r(p90, 1),
        "debug_wait_p90_s": _r(dbg, 1),
        "large_wait_p90_s": _r(large, 1),
        "preemptions_per_1000_gpu_h": _r(pre, 3),
        "drain_time_p90_s": _r(drain, 1),
        "simulated_days": _r((end_ms - start_ms) / 86_400_000, 3),
        "workloads": n_workloads,
        "events": n_events,
        "wall_s": round(wall_s, 2),
        "debug_allocated_wait_p90_s": _r(dbg_alloc, 1),
        "debug_allocated_wait_p90_by_gpus_s": {
            str(gpus): {"p90_s": _r(q, 1), "placed": n} for gpus, q, n in dbg_by_gpus
        },
        "open_waits": open_all,
        "open_large_waits": open_large,
        "demand_ratio": _r(demand, 3),
        "rejected": n_rejected,
        "delivery_ratio_7d": delivery["delivery_ratio_7d"],
        "team_delivery_7d": delivery["team_delivery_7d"],
        "starved_teams": delivery["starved_teams"],
        "windows_5d": delivery["windows_5d"],
        "large_wait_p90_censored_s": _r(large_censored, 1),
        "estimate_samples": int(est_n),
        "estimate_abs_error_p50_s": _r(est_p50, 1),
        "estimate_abs_error_p90_s": _r(est_p90, 1),
        "estimate_late_fraction": _r(est_late),
        "starved_teams_by_demand": delivery["starved_teams_by_demand"],
        "windows_7d": delivery["windows_7d"],
        "delivery_ratio_weeks": delivery["delivery_ratio_weeks"],
        "team_delivery_weeks": delivery["team_delivery_weeks"],
        "team_delivery_week_min": delivery["team_delivery_week_min"],
        "team_delivery_7d_sliding_min": delivery["team_delivery_7d_sliding_min"],
        "worst_sliding_7d": delivery["worst_sliding_7d"],
        "largest_team": delivery["largest_team"],
        **never,
    }


OVER_SERVED_ABOVE = 1.05
"""A team ran more than this times its global share of the capacity in a week."""


def served_kpis(con: duckdb.DuckDBPyConnection, start_ms: int, end_ms: int) -> dict[str, Any]:
    """Who ran above its share while another team was short, per week (after
    :func:`compute_kpis` on ``con``, whose views it reads): :func:`served_from_hours`."""
    hourly = [
        TeamHour(team, int(h), float(share), float(demand), float(ran))
        for team, h, share, demand, ran in _q(con, KPI_SQL["delivery"], start_ms, end_ms)
    ]
    return served_from_hours(hourly, round((end_ms - start_ms) / HOUR_MS))


def served_from_hours(hourly: list[TeamHour], hours: int) -> dict[str, Any]:
    """``team_served_week_max``: per team, the most it ran in a week as a multiple of
    its global share of that week's healthy GPU-time; ``double_served_teams``: teams
    that ran above :data:`OVER_SERVED_ABOVE` times their share in a week in which
    another team got under 95% of what it was owed (across several clusters: served
    twice, once by each cluster's view of its share, at another team's expense).
    ``hourly`` sorted by team and hour, as :func:`delivery_kpis` takes it."""
    by_team: dict[str, list[TeamHour]] = {}
    for row in hourly:
        by_team.setdefault(row.team, []).append(row)
    teams = sorted(by_team)
    served: dict[str, float | None] = dict.fromkeys(teams)
    double: list[str] = []
    for s0, e0 in _week_bounds(hours):
        week = {t: by_team[t][s0:e0] for t in teams}
        ran = {t: sum(r.ran_ms for r in week[t]) for t in teams}
        share = {t: sum(r.share_ms for r in week[t]) for t in teams}
        owed = {t: sum(r.owed_ms for r in week[t]) for t in teams}
        short = [t for t in teams if owed[t] > 0 and min(ran[t], owed[t]) < STARVED_BELOW * owed[t]]
        for t in teams:
            if share[t] <= 0:
                continue
            x = ran[t] / share[t]
            prev = served[t]
            served[t] = _r(x) if prev is None else max(prev, _r(x))
            if x > OVER_SERVED_ABOVE and [u for u in short if u != t] and t not in double:
                double.append(t)
    return {"team_served_week_max": served, "double_served_teams": sorted(double)}


def _never_placed(row: tuple) -> dict[str, Any]:
    """The never-placed keys from the ``never_placed`` query's one row."""
    (
        n_large,
        never_large,
        gpus_large,
        never_gpus_large,
        n_small,
        never_small,
        gpus_small,
        never_gpus_small,
    ) = (0 if v is None else int(v) for v in row)
    large_w = _r(never_gpus_large / gpus_large) if gpus_large else None
    small_w = _r(never_gpus_small / gpus_small) if gpus_small else None
    return {
        "large_submitted": n_large,
        "large_never_placed": never_large,
        "large_never_placed_fraction": _r(never_large / n_large) if n_large else None,
        "large_never_placed_gpu_fraction": large_w,
        "small_allocated_submitted": n_small,
        "small_allocated_never_placed": never_small,
        "small_allocated_never_placed_fraction": _r(never_small / n_small) if n_small else None,
        "small_allocated_never_placed_gpu_fraction": small_w,
        "never_placed_gpu_ratio": (
            _r(never_gpus_large * gpus_small / (gpus_large * never_gpus_small), 3)
            if gpus_large and never_gpus_small
            else None
        ),
    }
