"""``apportion simulate`` and ``apportion trace generate|import`` (registered on :data:`apportion.cli.main`).

Bad input files give one line ``apportion: file:line: reason`` per problem on
stderr; rows that are valid still run and the summary counts the rejected ones.
A file that cannot be used at all exits non-zero with one such line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from apportion.cli import UserError, main

DEFAULT_SCENARIO = "ai2"
DEFAULT_DAYS = 30
DEFAULT_SEED = 1
MAX_REPORTED = 20

_KPI_ROWS = (
    ("occupancy", "occupancy", "pct"),
    ("delivery_ratio", "delivered / owed", "pct"),
    ("worst_team", "worst team delivered / owed", "pct"),
    ("teams_ge_95", "teams >= 95% delivered", "int"),
    ("unallocated_fraction", "unallocated GPU time", "pct"),
    ("wait_p50_s", "wait p50", "dur"),
    ("wait_p90_s", "wait p90", "dur"),
    ("debug_wait_p90_s", "debug wait p90", "dur"),
    ("debug_allocated_wait_p90_s", "debug (min runtime > 0) wait p90", "dur"),
    ("large_wait_p90_s", "large (>= 64 GPUs) wait p90", "dur"),
    ("open_waits", "still waiting at the end", "int"),
    ("preemptions_per_1000_gpu_h", "preemptions / 1000 GPU-h", "num"),
    ("drain_time_p90_s", "drain time p90", "dur"),
    ("demand_ratio", "allocated demand / capacity", "num"),
    ("simulated_days", "simulated days", "num"),
    ("workloads", "workloads", "int"),
    ("events", "events", "int"),
    ("wall_s", "wall time (s)", "num"),
)


def _warn(message: str) -> None:
    click.echo(f"apportion: {message}", err=True)


def _fmt(value: Any, kind: str) -> str:
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
    return {**k, "worst_team": min(td) if td else None, "teams_ge_95": sum(1 for v in td if v >= 0.95)}


def kpi_table(results: dict[str, dict[str, Any]], teams: bool = True) -> str:
    """The KPI table; with two policies, side by side with the change."""
    names = list(results)
    rows: list[list[str]] = [["KPI", *names]]
    if len(names) == 2:
        rows[0].append("change")
    data = {n: _derived(results[n]) for n in names}
    for key, label, kind in _KPI_ROWS:
        row = [label, *(_fmt(data[n].get(key), kind) for n in names)]
        if len(names) == 2:
            a, b = data[names[0]].get(key), data[names[1]].get(key)
            if isinstance(a, int | float) and isinstance(b, int | float) and key not in ("simulated_days",):
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
            row = [f"  {t}", *(_fmt(v, "pct") for v in vals)]
            if len(names) == 2:
                row.append(f"{100 * (vals[0] - vals[1]):+.1f} pt" if None not in vals else "")
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[0]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(r)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _report_errors(errors: list, what: str) -> None:
    for err in errors[:MAX_REPORTED]:
        _warn(str(err))
    if len(errors) > MAX_REPORTED:
        _warn(f"... and {len(errors) - MAX_REPORTED} more {what} problems")


class _Inputs:
    def __init__(self) -> None:
        self.cluster_events: list = []
        self.trace: list = []
        self.health: list = []
        self.days: float | None = None
        self.label = ""
        self.trace_file = "<generated>"
        self.health_file = "<generated>"
        self.bad_rows = 0


def _load_inputs(cluster, trace, health, seed, days, scenario) -> _Inputs:
    from apportion.replay.cluster_file import cluster_from_dict, load_cluster
    from apportion.replay.errors import InputFileError
    from apportion.replay.trace import read_health, read_trace

    inp = _Inputs()
    try:
        if trace is None:
            if cluster is not None or health is not None:
                raise UserError("--cluster and --health go with --trace (or leave all three out for a bundled scenario)")
            from apportion.replay.scenarios import generate

            try:
                sc = generate(scenario, days=int(days or DEFAULT_DAYS), seed=seed)
            except ValueError as exc:
                raise UserError(str(exc)) from None
            doc = _scenario_cluster_doc(sc)
            inp.cluster_events = cluster_from_dict(doc, f"<scenario {sc.name}>").events
            inp.trace, inp.health, inp.days = sc.trace, sc.health, sc.days
            inp.label = f"scenario {sc.name}, seed {seed}, {sc.days} days"
            return inp
        if cluster is None:
            raise UserError("--trace needs --cluster FILE (nodes, budget tree and policy)")
        inp.cluster_events = load_cluster(cluster).events
        rows, errors = read_trace(trace)
        _report_errors(errors, "trace")
        inp.bad_rows += len(errors)
        inp.trace, inp.trace_file = rows, str(trace)
        if health is not None:
            hrows, herrors = read_health(health)
            _report_errors(herrors, "health")
            inp.bad_rows += len(herrors)
            inp.health, inp.health_file = hrows, str(health)
        if not rows:
            raise UserError(f"{trace}: no valid rows to simulate")
        inp.days = days
        inp.label = f"{trace}"
        return inp
    except InputFileError as exc:
        raise UserError(str(exc)) from None


def _scenario_cluster_doc(sc) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "cluster": {"name": sc.name, "pool": [
            {"prefix": p, "count": c, "gpus_per_node": g, "gpu_type": t} for p, c, g, t in sc.pools]},
        "policy": dict(sc.policy),
        "budget": {"owner": sc.budget[0][2]},
    }
    for path, weight, owner in sc.budget[1:]:
        table = doc["budget"]
        for seg in path.split("/"):
            table = table.setdefault(seg, {})
        table["weight"], table["owner"] = weight, owner
    return doc


def _out_path(out: Path | None, policy: str, compare: bool) -> Path | None:
    if out is None:
        return None
    if compare and policy == "priority":
        return out.with_name(f"{out.stem}.priority{out.suffix or '.duckdb'}")
    return out


def run_policy(inp: _Inputs, policy: str, out: Path | None, quiet: bool):
    import duckdb

    from apportion.replay.kpi import compute_kpis
    from apportion.replay.simulator import simulate

    con = None
    if out is not None:
        for p in (out, Path(str(out) + ".wal")):
            if p.exists():
                p.unlink()
        try:
            con = duckdb.connect(str(out))
        except duckdb.Error as exc:
            raise UserError(f"{out}: cannot create the database: {exc}") from None
    days = inp.days
    if days is None:
        last = max([r.submit_ms for r in inp.trace] + [h.at_ms for h in inp.health] + [0])
        days = -(-(last + 1) // 86_400_000)
    total_h = max(1, int(days * 24))
    show = not quiet and sys.stderr.isatty()
    with click.progressbar(length=total_h, label=f"simulating {policy:8s}", file=sys.stderr,
                           show_pos=False, show_percent=True) if show else _NoBar() as bar:
        done = [0]

        def progress(ms: int) -> None:
            h = min(total_h, ms // 3_600_000)
            if h > done[0]:
                bar.update(h - done[0])
                done[0] = h

        result = simulate(inp.cluster_events, inp.trace, inp.health, policy=policy, days=days, con=con,
                          progress=progress)
    kpis = compute_kpis(result.con, result.start_ms, result.end_ms, result.wall_s)
    return result, kpis


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *a) -> None:
        return None

    def update(self, n: int) -> None:
        return None


def _report_rejections(inp: _Inputs, result) -> int:
    lines = {r.id: r.line for r in inp.trace}
    msgs = []
    for ref, reason in result.rejected:
        if ref.startswith("sub/"):
            wid = ref[4:]
            msgs.append(f"{inp.trace_file}:{lines.get(wid, 0)}: {reason}" if lines.get(wid) else f"{inp.trace_file}: workload {wid}: {reason}")
        elif ref.startswith("health/"):
            line = ref.split("/")[1]
            msgs.append(f"{inp.health_file}:{line}: {reason}")
        elif not ref.startswith(("fin/", "tick/")):
            msgs.append(f"{ref}: {reason}")
    _report_errors(msgs, "input")
    return len(msgs)


@main.command()
@click.option("--cluster", type=click.Path(dir_okay=False, path_type=Path), help="cluster TOML (with --trace)")
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path), help="trace CSV")
@click.option("--health", type=click.Path(dir_okay=False, path_type=Path), help="health CSV")
@click.option("--scenario", default=DEFAULT_SCENARIO, show_default=True, help="bundled scenario when no --trace")
@click.option("--policy", type=click.Choice(["budget", "priority"]), default="budget", show_default=True)
@click.option("--compare", is_flag=True, help="run the budget scheduler and the baseline side by side")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="write the projection to this DuckDB file (with --compare the baseline goes to NAME.priority.duckdb)")
@click.option("--json", "as_json", is_flag=True, help="KPIs as one JSON object on stdout")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True, help="scenario seed")
@click.option("--days", type=float, default=None, help="days to simulate [scenario: 30; trace: to its last row]")
@click.option("--plot", type=click.Path(file_okay=False, path_type=Path), help="write PNG charts into this directory")
@click.option("--quiet", "-q", is_flag=True, help="no progress bar")
def simulate(cluster, trace, health, scenario, policy, compare, out, as_json, seed, days, plot, quiet) -> None:
    """Simulate a trace (or the bundled ai2 scenario) with no server and print the KPIs."""
    if days is not None and days <= 0:
        raise UserError("--days must be positive")
    inp = _load_inputs(cluster, trace, health, seed, days, scenario)
    policies = ["budget", "priority"] if compare else [policy]
    results: dict[str, dict[str, Any]] = {}
    sims = {}
    rejected = 0
    for p in policies:
        result, kpis = run_policy(inp, p, _out_path(out, p, compare), quiet or as_json and not sys.stderr.isatty())
        if p == policies[0]:
            rejected = _report_rejections(inp, result)
        results[p] = kpis
        sims[p] = result
    if inp.bad_rows or rejected:
        _warn(f"{inp.bad_rows + rejected} input rows rejected ({inp.bad_rows} malformed, {rejected} refused by the scheduler); the valid rows ran")
    if plot is not None:
        from apportion.replay.plots import write_plots

        try:
            paths = write_plots(sims, plot)
        except OSError as exc:
            raise UserError(f"{plot}: cannot write charts: {exc.strerror}") from None
        for p in paths:
            click.echo(f"wrote {p}", err=True)
    if as_json:
        click.echo(json.dumps(results[policies[0]] if len(policies) == 1 else results, sort_keys=False))
        return
    click.echo(f"apportion simulate: {inp.label}")
    click.echo(kpi_table(results))


@main.group()
def trace() -> None:
    """Generate scenario traces and import public ones."""


@trace.command("generate")
@click.option("--scenario", default=DEFAULT_SCENARIO, show_default=True, help="ai2 or debug")
@click.option("--days", type=int, default=None, help="[ai2: 30, debug: 3]")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True)
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
def trace_generate(scenario, days, seed, out_dir) -> None:
    """Write trace.csv, health.csv and cluster.toml for a synthetic scenario."""
    from apportion.replay.scenarios import generate, write_scenario

    if days is None:
        days = DEFAULT_DAYS if scenario == "ai2" else 3
    if days <= 0:
        raise UserError("--days must be positive")
    try:
        sc = generate(scenario, days=days, seed=seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        paths = write_scenario(sc, out_dir)
    except OSError as exc:
        raise UserError(f"{out_dir}: {exc.strerror}") from None
    click.echo(f"scenario {sc.name}, seed {seed}, {days} days: {len(sc.trace):,} workloads, "
               f"{len(sc.health):,} health rows, {sum(c * g for _, c, g, _ in sc.pools):,} GPUs")
    for k in ("cluster", "trace", "health"):
        click.echo(f"wrote {paths[k]}")


@trace.command("import")
@click.option("--format", "fmt", type=click.Choice(["philly"]), required=True)
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--vc-file", type=click.Path(dir_okay=False, path_type=Path),
              help="virtual-cluster sizes (default: philly_vc_nodes_helios.csv beside FILE)")
@click.option("--from", "date_from", default=None, help="first submit day kept, YYYY-MM-DD (inclusive)")
@click.option("--to", "date_to", default=None, help="last submit day, YYYY-MM-DD (exclusive)")
@click.option("--capacity-scale", type=float, default=1.0, show_default=True,
              help="scale every virtual cluster's nodes (at least one node each)")
@click.option("--min-runtime", "min_runtime", default="cap:8h", show_default=True,
              help="rule for each job's min runtime: cap:DUR = min(duration, DUR) rounded up to a minute; "
                   "fixed:DUR; zero")
def trace_import(fmt, file, out_dir, vc_file, date_from, date_to, capacity_scale, min_runtime) -> None:
    """Import a public trace into trace.csv and cluster.toml."""
    from apportion.replay.errors import InputFileError
    from apportion.replay.importers import import_philly

    try:
        report = import_philly(file, out_dir, vc_file=vc_file, date_from=date_from, date_to=date_to,
                               capacity_scale=capacity_scale, min_runtime_rule=min_runtime)
    except InputFileError as exc:
        raise UserError(str(exc)) from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"{out_dir}: {exc.strerror}") from None
    _report_errors([str(e) for e in report.errors], "trace")
    for line in report.lines():
        click.echo(line)
