"""``apportion simulate``, ``apportion trace generate|import`` and the event-log commands
``apportion replay|audit|whatif`` (docs/audit.md), registered on :data:`apportion.cli.main`.

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
WARMUP_DAYS = {"ai2": 2}
"""The ai2 scenario starts from an empty cluster and a backlog; its first two
days are simulated and left out of the KPIs, as simulation studies do with a
warm-up period (``simulated_days`` counts the measured days)."""
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
    for key, label, kind in _KPI_ROWS:
        row = [label, *(_fmt(data[n].get(key), kind) for n in names)]
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
            row = [f"  {t}", *(_fmt(v, "pct") for v in vals)]
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
        self.warmup_days = 0
        """Simulated first and left out of the KPIs (the cluster starts empty)."""
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
                raise UserError(
                    "--cluster and --health go with --trace (or leave all three out for a bundled scenario)"
                )
            from apportion.replay.scenarios import generate

            try:
                inp.warmup_days = WARMUP_DAYS.get(scenario, 0)
                sc = generate(scenario, days=int(days or DEFAULT_DAYS) + inp.warmup_days, seed=seed)
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
        "cluster": {
            "name": sc.name,
            "pool": [
                {"prefix": p, "count": c, "gpus_per_node": g, "gpu_type": t}
                for p, c, g, t in sc.pools
            ],
        },
        "policy": dict(sc.policy),
        "budget": {"owner": sc.budget[0][2]},
    }
    for path, weight, owner in sc.budget[1:]:
        table = doc["budget"]
        for seg in path.split("/"):
            table = table.setdefault(seg, {})
        table["weight"], table["owner"] = weight, owner
    return doc


def _policy_path(path: Path | None, policy: str, compare: bool, suffix: str) -> Path | None:
    """Where a run writes ``path``: with ``--compare`` the baseline's goes to ``NAME.priority.EXT``."""
    if path is None:
        return None
    if compare and policy == "priority":
        return path.with_name(f"{path.stem}.priority{path.suffix or suffix}")
    return path


def _fresh_database(out: Path):
    """A new DuckDB file at ``out`` (an existing one, and its WAL, is replaced)."""
    import duckdb

    for p in (out, Path(str(out) + ".wal")):
        if p.exists():
            p.unlink()
    try:
        return duckdb.connect(str(out))
    except duckdb.Error as exc:
        raise UserError(f"{out}: cannot create the database: {exc}") from None


def run_policy(inp: _Inputs, policy: str, out: Path | None, quiet: bool, log: Path | None = None):

    from apportion.replay.kpi import compute_kpis
    from apportion.replay.simulator import simulate

    con = _fresh_database(out) if out is not None else None
    days = inp.days
    if days is None:
        last = max([r.submit_ms for r in inp.trace] + [h.at_ms for h in inp.health] + [0])
        days = -(-(last + 1) // 86_400_000)
    total_h = max(1, int(days * 24))
    show = not quiet and sys.stderr.isatty()
    with (
        click.progressbar(
            length=total_h,
            label=f"simulating {policy:8s}",
            file=sys.stderr,
            show_pos=False,
            show_percent=True,
        )
        if show
        else _NoBar() as bar
    ):
        done = [0]

        def progress(ms: int) -> None:
            h = min(total_h, ms // 3_600_000)
            if h > done[0]:
                bar.update(h - done[0])
                done[0] = h

        writer = None
        if log is not None:
            from apportion.replay.eventlog import Header, LogWriter

            try:
                writer = LogWriter(log, Header(policy=policy, source="simulate"))
            except OSError as exc:
                raise UserError(f"{log}: cannot write the log: {exc.strerror}") from None
        result = simulate(
            inp.cluster_events,
            inp.trace,
            inp.health,
            policy=policy,
            days=days,
            con=con,
            progress=progress,
            sink=writer,
        )
        if writer is not None:
            writer.close(result.state.digest())
    kpis = compute_kpis(
        result.con, result.start_ms + inp.warmup_days * 86_400_000, result.end_ms, result.wall_s
    )
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
            msgs.append(
                f"{inp.trace_file}:{lines.get(wid, 0)}: {reason}"
                if lines.get(wid)
                else f"{inp.trace_file}: workload {wid}: {reason}"
            )
        elif ref.startswith("health/"):
            line = ref.split("/")[1]
            msgs.append(f"{inp.health_file}:{line}: {reason}")
        elif not ref.startswith(("fin/", "tick/")):
            msgs.append(f"{ref}: {reason}")
    _report_errors(msgs, "input")
    return len(msgs)


@main.command()
@click.option(
    "--cluster", type=click.Path(dir_okay=False, path_type=Path), help="cluster TOML (with --trace)"
)
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path), help="trace CSV")
@click.option("--health", type=click.Path(dir_okay=False, path_type=Path), help="health CSV")
@click.option(
    "--scenario",
    default=DEFAULT_SCENARIO,
    show_default=True,
    help="bundled scenario when no --trace",
)
@click.option(
    "--policy", type=click.Choice(["budget", "priority"]), default="budget", show_default=True
)
@click.option(
    "--compare", is_flag=True, help="run the budget scheduler and the baseline side by side"
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="write the projection to this DuckDB file (with --compare the baseline goes to NAME.priority.duckdb)",
)
@click.option(
    "--log",
    "log",
    type=click.Path(dir_okay=False, path_type=Path),
    help="write the canonical event log (JSON lines) here, for replay/audit/whatif "
    "(with --compare the baseline's goes to NAME.priority.jsonl)",
)
@click.option("--json", "as_json", is_flag=True, help="KPIs as one JSON object on stdout")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True, help="scenario seed")
@click.option(
    "--days",
    type=float,
    default=None,
    help="days to simulate [scenario: 30; trace: to its last row]",
)
@click.option(
    "--plot",
    type=click.Path(file_okay=False, path_type=Path),
    help="write PNG charts into this directory",
)
@click.option("--quiet", "-q", is_flag=True, help="no progress bar")
def simulate(
    cluster, trace, health, scenario, policy, compare, out, log, as_json, seed, days, plot, quiet
) -> None:
    """Simulate a trace (or the bundled ai2 scenario) with no server and print the KPIs."""
    if days is not None and days <= 0:
        raise UserError("--days must be positive")
    inp = _load_inputs(cluster, trace, health, seed, days, scenario)
    policies = ["budget", "priority"] if compare else [policy]
    results: dict[str, dict[str, Any]] = {}
    sims = {}
    rejected = 0
    for p in policies:
        result, kpis = run_policy(
            inp,
            p,
            _policy_path(out, p, compare, ".duckdb"),
            quiet or as_json and not sys.stderr.isatty(),
            _policy_path(log, p, compare, ".jsonl"),
        )
        if p == policies[0]:
            rejected = _report_rejections(inp, result)
        results[p] = kpis
        sims[p] = result
    if inp.bad_rows or rejected:
        _warn(
            f"{inp.bad_rows + rejected} input rows rejected ({inp.bad_rows} malformed, {rejected} refused by the scheduler); the valid rows ran"
        )
    if plot is not None:
        from apportion.replay.plots import write_plots

        try:
            paths = write_plots(sims, plot)
        except OSError as exc:
            raise UserError(f"{plot}: cannot write charts: {exc.strerror}") from None
        for p in paths:
            click.echo(f"wrote {p}", err=True)
    if as_json:
        click.echo(
            json.dumps(results[policies[0]] if len(policies) == 1 else results, sort_keys=False)
        )
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
    click.echo(
        f"scenario {sc.name}, seed {seed}, {days} days: {len(sc.trace):,} workloads, "
        f"{len(sc.health):,} health rows, {sum(c * g for _, c, g, _ in sc.pools):,} GPUs"
    )
    for k in ("cluster", "trace", "health"):
        click.echo(f"wrote {paths[k]}")


@trace.command("import")
@click.option("--format", "fmt", type=click.Choice(["philly"]), required=True)
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option(
    "--vc-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="virtual-cluster sizes (default: philly_vc_nodes_helios.csv beside FILE)",
)
@click.option(
    "--from", "date_from", default=None, help="first submit day kept, YYYY-MM-DD (inclusive)"
)
@click.option("--to", "date_to", default=None, help="last submit day, YYYY-MM-DD (exclusive)")
@click.option(
    "--capacity-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="scale every virtual cluster's nodes (at least one node each)",
)
@click.option(
    "--min-runtime",
    "min_runtime",
    default="cap:8h",
    show_default=True,
    help="rule for each job's min runtime: cap:DUR = min(duration, DUR) rounded up to a minute; "
    "fixed:DUR; zero",
)
def trace_import(
    fmt, file, out_dir, vc_file, date_from, date_to, capacity_scale, min_runtime
) -> None:
    """Import a public trace into trace.csv and cluster.toml."""
    from apportion.replay.errors import InputFileError
    from apportion.replay.importers import import_philly

    try:
        report = import_philly(
            file,
            out_dir,
            vc_file=vc_file,
            date_from=date_from,
            date_to=date_to,
            capacity_scale=capacity_scale,
            min_runtime_rule=min_runtime,
        )
    except InputFileError as exc:
        raise UserError(str(exc)) from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"{out_dir}: {exc.strerror}") from None
    _report_errors([str(e) for e in report.errors], "trace")
    for line in report.lines():
        click.echo(line)


# --------------------------------------------------------------------------
# The event log: replay, audit, whatif
# --------------------------------------------------------------------------


def _source_options(f):
    f = click.option(
        "--cluster",
        "cluster_name",
        default=None,
        help="read a live cluster's INPUTS and DECISIONS streams instead of LOG",
    )(f)
    f = click.option(
        "--nats",
        "nats_url",
        default=None,
        envvar="NATS_URL",
        help="NATS server(s) for --cluster [env NATS_URL]",
    )(f)
    return click.argument("log", required=False, type=click.Path(dir_okay=False, path_type=Path))(f)


def _open_source(log: Path | None, nats_url: str | None, cluster_name: str | None):
    """A log file, a DuckDB projection, or a live cluster's streams."""
    from apportion.replay.eventlog import LogError, open_log, read_nats

    try:
        if log is not None:
            if cluster_name is not None:
                raise UserError("give LOG or --cluster NAME (a live cluster), not both")
            return open_log(log)
        if cluster_name is None:
            raise UserError(
                "give LOG (a log file or a projection .duckdb) or --cluster NAME --nats URL"
            )
        if not nats_url:
            raise UserError("--cluster needs --nats URL (or NATS_URL)")
        return read_nats(nats_url, cluster_name)
    except LogError as exc:
        raise UserError(str(exc)) from None


def _guard_log_errors(fn, *args, **kw):
    from apportion.core.state import CorruptHistory
    from apportion.replay.eventlog import LogError
    from apportion.replay.projection import ProjectionOrderError

    try:
        return fn(*args, **kw)
    except (LogError, ProjectionOrderError) as exc:
        raise UserError(str(exc)) from None
    except CorruptHistory as exc:
        raise UserError(f"corrupt history: {exc}") from None


@main.command("replay")
@_source_options
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="write DESIGN's projection tables to this DuckDB file (replaced if it exists)",
)
@click.option(
    "--log",
    "log_out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="also write the history as a log file (JSON lines), e.g. to take a live cluster's offline",
)
@click.option(
    "--until", type=click.IntRange(min=0), default=None, help="stop after input SEQ (and its batch)"
)
def replay_cmd(log, nats_url, cluster_name, out, log_out, until) -> None:
    """Rebuild the projection tables (and/or a log file) from an event log."""
    import duckdb

    from apportion.replay.eventlog import DecisionBatch, Header, LogWriter, Malformed
    from apportion.replay.projection import Projection

    if out is None and log_out is None:
        raise UserError("nothing to write: give --out FILE.duckdb and/or --log FILE.jsonl")
    source = _open_source(log, nats_url, cluster_name)
    con = _fresh_database(out) if out is not None else None
    proj = Projection(
        con if con is not None else duckdb.connect()
    )  # in memory: only for the digest
    proj.set_meta("policy", source.header.policy)
    writer = None
    if log_out is not None:
        try:
            writer = LogWriter(
                log_out,
                Header(
                    policy=source.header.policy,
                    source=source.header.source or "replay",
                    cluster=source.header.cluster,
                ),
            )
        except OSError as exc:
            raise UserError(f"{log_out}: cannot write the log: {exc.strerror}") from None
    counts = {"inputs": 0, "batches": 0, "decisions": 0}

    def run() -> None:
        for item in source:
            if isinstance(item, DecisionBatch):
                counts["batches"] += 1
                counts["decisions"] += len(item.decisions)
                proj.add_batch(item)
            else:
                seq = item.seq if isinstance(item, Malformed) else item[0]
                if until is not None and seq > until:
                    break
                counts["inputs"] += 1
                if isinstance(item, Malformed):
                    proj.add_undecodable(item.seq, item.at_ms, item.ref, item.reason)
                else:
                    proj.add_input(*item)
            if writer is not None:
                writer.add(item)

    _guard_log_errors(run)
    if con is not None:
        proj.commit()
    if writer is not None:
        writer.close(proj.state.digest())
    click.echo(
        f"replay: {counts['inputs']:,} inputs, {counts['batches']:,} decision batches, "
        f"{counts['decisions']:,} decisions"
        + (f" (until input {until})" if until is not None else "")
    )
    if con is not None:
        tables = ("events", "workloads", "runs", "waits", "nodes", "health", "budget")
        sizes = ", ".join(
            f"{t} {con.execute(f'SELECT COUNT(*) FROM {t}').fetchone()[0]:,}" for t in tables
        )
        con.close()
        click.echo(f"wrote {out}: {sizes}")
    if writer is not None:
        click.echo(f"wrote {log_out}")


@main.command("audit")
@_source_options
@click.option(
    "--digest",
    "expected_digest",
    default=None,
    help="the final state digest expected (default: the one the log records)",
)
@click.option(
    "--policy",
    type=click.Choice(["budget", "priority"]),
    default=None,
    help="policy that made the decisions [default: the log's header]",
)
def audit_cmd(log, nats_url, cluster_name, expected_digest, policy) -> None:
    """Refold the inputs, recompute every decision batch and compare it bit for bit.

    Exit 0 when everything is reproduced, 1 at the first divergence, 2 when the
    log cannot be read."""
    from apportion.replay.audit import audit

    source = _open_source(log, nats_url, cluster_name)
    if policy is not None:
        source.header.policy = policy
    result = _guard_log_errors(audit, source, expected_digest=expected_digest)
    click.echo(result.verdict())
    if not result.ok:
        sys.exit(1)


@main.command("whatif")
@_source_options
@click.option(
    "--policy",
    type=click.Choice(["budget", "priority"]),
    default=None,
    help="policy to re-simulate with [default: the one that made the log]",
)
@click.option("--margin", type=str, default=None, help="preemption margin, e.g. 0.1")
@click.option("--lookback", type=str, default=None, help="fair-share window, e.g. 3d")
@click.option(
    "--max-min-runtime",
    "max_min_runtime",
    type=str,
    default=None,
    help="cap on min runtime, e.g. 4h",
)
@click.option("--no-reservations", is_flag=True, help="no fragmentation reservations")
@click.option(
    "--budget",
    "budget_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="replace the budget tree by FILE's [budget] tables (TOML)",
)
@click.option("--json", "as_json", is_flag=True, help="both KPI sets as one JSON object")
def whatif_cmd(
    log,
    nats_url,
    cluster_name,
    policy,
    margin,
    lookback,
    max_min_runtime,
    no_reservations,
    budget_file,
    as_json,
) -> None:
    """Re-simulate a log's submissions, health and budget changes under a changed policy; compare KPIs."""
    from apportion.replay.cluster_file import margin_ppm, parse_duration_ms
    from apportion.replay.errors import InputFileError
    from apportion.replay.whatif import PolicyChange, load_budget, whatif

    change = PolicyChange(policy=policy, reservations=False if no_reservations else None)
    for opt, value, parse, field in (
        ("--margin", margin, margin_ppm, "preemption_margin_ppm"),
        ("--lookback", lookback, parse_duration_ms, "lookback_ms"),
        ("--max-min-runtime", max_min_runtime, parse_duration_ms, "max_min_runtime_ms"),
    ):
        if value is not None:
            try:
                setattr(change, field, parse(value))
            except ValueError as exc:
                raise UserError(f"{opt} {value}: {exc}") from None
    if budget_file is not None:
        try:
            change.budget = load_budget(budget_file)
        except InputFileError as exc:
            raise UserError(str(exc)) from None
    source = _open_source(log, nats_url, cluster_name)
    try:
        res = _guard_log_errors(whatif, source, change)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if res.dropped_no_duration:
        _warn(
            f"{res.dropped_no_duration} submissions have no duration_ms and never finished in the log; left out"
        )
    rejected = res.whatif.get("rejected", 0) - res.original.get("rejected", 0)
    if rejected > 0:
        _warn(
            f"{rejected} more submissions rejected in the what-if (owners missing from the new budget?)"
        )
    if as_json:
        click.echo(json.dumps({"original": res.original, "whatif": res.whatif}))
        return
    desc = [f"policy {res.whatif_policy}"]
    if change.preemption_margin_ppm is not None:
        desc.append(f"margin {change.preemption_margin_ppm / 1e6:g}")
    if change.lookback_ms is not None:
        desc.append(f"lookback {lookback}")
    if change.max_min_runtime_ms is not None:
        desc.append(f"max min runtime {max_min_runtime}")
    if no_reservations:
        desc.append("no reservations")
    if budget_file is not None:
        desc.append(f"budget {budget_file}")
    click.echo(
        f"apportion whatif: {source.name} ({res.original_policy}, {res.submissions:,} submissions, "
        f"{(res.end_ms - res.start_ms) / 86_400_000:.2f} days) vs {', '.join(desc)}"
    )
    click.echo(kpi_table({"what-if": res.whatif, "original": res.original}))
