"""``apportion simulate``, ``apportion trace generate|import`` and the event-log commands
``apportion replay|audit|whatif`` (docs/audit.md), registered on :data:`apportion.cli.main`.

Bad input files give one line ``apportion: file:line: reason`` per problem on
stderr; rows that are valid still run and the summary counts the rejected ones.
A file that cannot be used at all exits non-zero with one such line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from apportion.cli import UserError, echo_json, main
from apportion.replay.run import DEFAULT_DAYS, DEFAULT_SCENARIO

DEFAULT_SEED = 1
SCENARIO_NAMES = ["ai2", "debug", "family"]
"""The bundled scenarios (``replay.scenarios.SCENARIOS``, not imported here: the CLI starts fast)."""
MAX_REPORTED = 20


def _warn(message: str) -> None:
    click.echo(f"apportion: {message}", err=True)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _report_errors(errors: list[str], what: str) -> None:
    for err in errors[:MAX_REPORTED]:
        _warn(err)
    if len(errors) > MAX_REPORTED:
        _warn(f"... and {len(errors) - MAX_REPORTED} more {what} problems")


@contextmanager
def _user_errors() -> Iterator[None]:
    """Errors a user can fix (bad files, bad values, a log that does not read) as one line."""
    from apportion.core.state import CorruptHistory
    from apportion.replay.errors import InputFileError
    from apportion.replay.eventlog import LogError

    try:
        yield
    except (InputFileError, LogError, ValueError) as exc:
        raise UserError(str(exc)) from None
    except CorruptHistory as exc:
        raise UserError(f"corrupt history: {exc}") from None


_knob_option = click.option(
    "--set",
    "knobs",
    multiple=True,
    metavar="KEY=VALUE",
    help="a knob of the family scenario (repeatable; docs/simulator.md lists them)",
)


def _policy_path(path: Path | None, policy: str, compare: bool, suffix: str) -> Path | None:
    """Where a run writes ``path``: with ``--compare`` the baseline's goes to ``NAME.priority.EXT``."""
    if path is None:
        return None
    if compare and policy == "priority":
        return path.with_name(f"{path.stem}.priority{path.suffix or suffix}")
    return path


PLAIN_PROGRESS_LINES = 40
"""Without a terminal: one progress line per simulated day, or every few days so a
run prints at most about this many."""


def _plain_progress(
    policy: str, horizon_days: float
) -> tuple[Callable[[int], None], Callable[[], None]]:
    """A ``progress(ms)`` callback printing plain lines on stderr (no terminal: CI logs,
    ``make run > file``): one per simulated day (every few days on long runs), then a
    last line with the total."""
    import math
    import time

    total_days = max(1, math.ceil(horizon_days))
    step = max(1, math.ceil(total_days / PLAIN_PROGRESS_LINES))
    t0 = time.monotonic()
    shown = [0]

    def progress(ms: int) -> None:
        day = min(total_days, ms // 86_400_000)
        if day >= total_days or day < shown[0] + step:
            return
        shown[0] = day
        click.echo(
            f"simulating {policy}: day {day}/{total_days} "
            f"({100 * day // total_days}%), {time.monotonic() - t0:.0f} s",
            err=True,
        )

    def done() -> None:
        click.echo(
            f"simulating {policy}: done, {_plural(total_days, 'day')} in {time.monotonic() - t0:.0f} s",
            err=True,
        )

    return progress, done


def _run_with_progress(inp: Any, policy: str, quiet: bool, **kw: Any) -> tuple[Any, dict[str, Any]]:
    from apportion.replay.run import run_policy

    total_h = max(1, int(inp.horizon_days() * 24))
    if quiet:
        return run_policy(inp, policy, **kw)
    if not sys.stderr.isatty():  # the bar only draws on a terminal: plain lines instead
        plain, finished = _plain_progress(policy, inp.horizon_days())
        result = run_policy(inp, policy, progress=plain, **kw)
        finished()
        return result
    with click.progressbar(
        length=total_h,
        label=f"simulating {policy:8s}",
        file=sys.stderr,
        show_pos=False,
        show_percent=True,
    ) as bar:
        done = [0]

        def progress(ms: int) -> None:
            h = min(total_h, ms // 3_600_000)
            if h > done[0]:
                bar.update(h - done[0])
                done[0] = h

        return run_policy(inp, policy, progress=progress, **kw)


@main.command()
@click.option(
    "--cluster", type=click.Path(dir_okay=False, path_type=Path), help="cluster TOML (with --trace)"
)
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path), help="trace CSV")
@click.option("--health", type=click.Path(dir_okay=False, path_type=Path), help="health CSV")
@click.option(
    "--scenario",
    type=click.Choice(SCENARIO_NAMES),
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
    help="write PNG charts into this directory (needs the plot extra: pip install 'apportion[plot]')",
)
@click.option(
    "--estimates",
    "estimate_every",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="N",
    help="sample the start-time estimate of every N-th submission (1: all; 0: none) "
    "into the estimates table and the estimate_* KPIs; costly (about 0.2 s each on ai2)",
)
@_knob_option
@click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="no progress (a bar on a terminal, else one line per simulated day on stderr)",
)
def simulate(
    cluster,
    trace,
    health,
    scenario,
    policy,
    compare,
    out,
    log,
    as_json,
    seed,
    days,
    plot,
    estimate_every,
    knobs,
    quiet,
) -> None:
    """Simulate a trace (or the bundled ai2 scenario) with no server and print the KPIs."""
    from apportion.replay.report import kpi_table
    from apportion.replay.run import load_inputs, rejection_messages

    if days is not None and days <= 0:
        raise UserError("--days must be positive")
    if plot is not None:  # before a long simulation, not after it
        from apportion.replay.plots import PlotExtraMissing, require_matplotlib

        try:
            require_matplotlib()
        except PlotExtraMissing as exc:
            raise UserError(exc.strerror or str(exc)) from None
    with _user_errors():
        inp = load_inputs(cluster, trace, health, seed, days, scenario, list(knobs))
    _report_errors(inp.problems, "input file")
    policies = ["budget", "priority"] if compare else [policy]
    results: dict[str, dict[str, Any]] = {}
    sims = {}
    rejected = 0
    for p in policies:
        with _user_errors():
            result, kpis = _run_with_progress(
                inp,
                p,
                quiet,
                out=_policy_path(out, p, compare, ".duckdb"),
                log=_policy_path(log, p, compare, ".jsonl"),
                estimate_every=estimate_every,
                history=plot is not None,  # the charts read the history's views
            )
        if p == policies[0]:
            refused = rejection_messages(inp, result)
            _report_errors(refused, "input")
            rejected = len(refused)
        results[p] = kpis
        sims[p] = result
    bad_rows = len(inp.problems)
    if bad_rows or rejected:
        _warn(
            f"{bad_rows + rejected} input rows rejected ({bad_rows} malformed, {rejected} refused by the scheduler); the valid rows ran"
        )
    if log is not None and inp.federation is not None:
        from apportion.replay.run import cluster_log_path

        for p in policies:
            path = _policy_path(log, p, compare, ".jsonl")
            assert path is not None
            for c in inp.federation.clusters:
                click.echo(f"wrote {cluster_log_path(path, c.name)}", err=True)
    if plot is not None:
        from apportion.replay.plots import write_plots

        try:
            paths = write_plots(sims, plot)
        except OSError as exc:
            raise UserError(f"{plot}: cannot write charts: {exc.strerror}") from None
        for p in paths:
            click.echo(f"wrote {p}", err=True)
    if as_json:
        echo_json(
            results[policies[0]] if len(policies) == 1 else results, indent=None, sort_keys=False
        )
        return
    click.echo(f"apportion simulate: {inp.label}")
    click.echo(kpi_table(results))


@main.group()
def trace() -> None:
    """Generate scenario traces and import public ones."""


@trace.command("generate")
@click.option(
    "--scenario",
    type=click.Choice(SCENARIO_NAMES),
    default=DEFAULT_SCENARIO,
    show_default=True,
)
@click.option("--days", type=int, default=None, help="[ai2: 30, family: 10, debug: 3]")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True)
@_knob_option
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
def trace_generate(scenario, days, seed, knobs, out_dir) -> None:
    """Write trace.csv, health.csv and cluster.toml for a synthetic scenario."""
    from apportion.replay.run import DEFAULT_DAYS_OF
    from apportion.replay.scenarios import check_scenario_days, generate, write_scenario

    if days is None:
        days = DEFAULT_DAYS_OF.get(scenario, DEFAULT_DAYS)
    with _user_errors():
        check_scenario_days(days)
        sc = generate(scenario, days, seed, list(knobs))
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
    "--from",
    "date_from",
    type=click.DateTime(["%Y-%m-%d"]),
    default=None,
    help="first submit day kept (inclusive)",
)
@click.option(
    "--to",
    "date_to",
    type=click.DateTime(["%Y-%m-%d"]),
    default=None,
    help="last submit day (exclusive)",
)
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
            date_from=None if date_from is None else f"{date_from:%Y-%m-%d}",
            date_to=None if date_to is None else f"{date_to:%Y-%m-%d}",
            capacity_scale=capacity_scale,
            min_runtime_rule=min_runtime,
        )
    except InputFileError as exc:
        raise UserError(str(exc)) from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:  # writing: the file it names, else the folder
        raise UserError(f"{exc.filename or out_dir}: {exc.strerror}") from None
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


def _open_source(log: Path | None, nats_url: str | None, cluster_name: str | None) -> Any:
    """A log file, a DuckDB projection, or a live cluster's streams."""
    from apportion.replay.eventlog import open_log

    if log is not None and cluster_name is not None:
        raise UserError("give LOG or --cluster NAME (a live cluster), not both")
    if log is None and cluster_name is None:
        raise UserError(
            "give LOG (a log file or a projection .duckdb) or --cluster NAME --nats URL"
        )
    if log is None and not nats_url:
        raise UserError("--cluster needs --nats URL (or NATS_URL)")
    with _user_errors():
        if log is not None:
            return open_log(log)
        from apportion.services.canonical import read_nats

        assert nats_url is not None and cluster_name is not None  # checked above
        return read_nats(nats_url, cluster_name)


@main.command("replay")
@_source_options
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="write the projection tables to this DuckDB file (replaced if it exists)",
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
    from apportion.replay.run import rebuild

    if out is None and log_out is None:
        raise UserError("nothing to write: give --out FILE.duckdb and/or --log FILE.jsonl")
    source = _open_source(log, nats_url, cluster_name)
    with _user_errors():
        done = rebuild(source, out, log_out, until)
    click.echo(
        f"replay: {done.inputs:,} inputs, {done.batches:,} decision batches, "
        f"{done.decisions:,} decisions" + (f" (until input {until})" if until is not None else "")
    )
    for note in source.gaps:
        click.echo(f"replay: {note}")
    if out is not None:
        sizes = ", ".join(f"{t} {n:,}" for t, n in done.table_sizes.items())
        click.echo(f"wrote {out}: {sizes}")
    if log_out is not None:
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
    with _user_errors():
        result = audit(source, expected_digest=expected_digest)
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
@click.option(
    "--margin-wait",
    "margin_wait",
    type=str,
    default=None,
    help="how long a waiting workload is held to the margin, e.g. 2h (0: always)",
)
@click.option("--lookback", type=str, default=None, help="fair-share window, e.g. 3d")
@click.option(
    "--max-min-runtime",
    "max_min_runtime",
    type=str,
    default=None,
    help="the policy's cap on min runtime, e.g. 1h; submissions that declared more are "
    "replayed with the cap as their contract",
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
    margin_wait,
    lookback,
    max_min_runtime,
    no_reservations,
    budget_file,
    as_json,
) -> None:
    """Re-simulate a log's submissions, health and budget changes under a changed policy; compare KPIs."""
    from apportion.replay.cluster_file import margin_ppm, parse_duration_ms
    from apportion.replay.report import kpi_table
    from apportion.replay.whatif import PolicyChange, load_budget, whatif

    change = PolicyChange(policy=policy, reservations=False if no_reservations else None)
    for opt, value, parse, field in (
        ("--margin", margin, margin_ppm, "preemption_margin_ppm"),
        ("--margin-wait", margin_wait, parse_duration_ms, "preemption_margin_wait_ms"),
        ("--lookback", lookback, parse_duration_ms, "lookback_ms"),
        ("--max-min-runtime", max_min_runtime, parse_duration_ms, "max_min_runtime_ms"),
    ):
        if value is not None:
            try:
                setattr(change, field, parse(value))
            except ValueError as exc:
                raise UserError(f"{opt} {value}: {exc}") from None
    if budget_file is not None:
        with _user_errors():
            change.budget = load_budget(budget_file)
    source = _open_source(log, nats_url, cluster_name)
    with _user_errors():
        res = whatif(source, change)
    if res.dropped_no_duration:
        _warn(
            f"{res.dropped_no_duration} submissions have no duration_ms and never finished in the log; left out"
        )
    if res.capped:
        _warn(
            f"{_plural(res.capped, 'submission')} declared a min runtime above {max_min_runtime}; "
            f"replayed with {max_min_runtime} (the new cap)"
        )
    if res.new_rejections:
        _warn(
            f"{_plural(len(res.new_rejections), 'input')} the original accepted "
            "refused in the what-if:"
        )
        _report_errors(
            [f"{ref}: {reason}" for ref, reason in res.new_rejections], "what-if rejection"
        )
    if as_json:
        echo_json({"original": res.original, "whatif": res.whatif}, indent=None, sort_keys=False)
        return
    desc = [f"policy {res.whatif_policy}"]
    if change.preemption_margin_ppm is not None:
        desc.append(f"margin {change.preemption_margin_ppm / 1e6:g}")
    if change.preemption_margin_wait_ms is not None:
        desc.append(f"margin wait {margin_wait}")
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


@main.command("diagnose")
@click.argument("logs", nargs=-1, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--cluster",
    "cluster_name",
    default=None,
    help="read a live cluster's INPUTS and DECISIONS streams instead of LOG",
)
@click.option(
    "--nats",
    "nats_url",
    default=None,
    envvar="NATS_URL",
    help="NATS server(s) for --cluster [env NATS_URL]",
)
@click.option(
    "--team", default=None, help="only this team (a budget path one level above the leaves)"
)
@click.option(
    "--from", "from_day", type=float, default=None, help="from this day of the run (0 = its start)"
)
@click.option(
    "--to", "to_day", type=float, default=None, help="up to this day of the run (exclusive)"
)
@click.option("--json", "as_json", is_flag=True, help="the rows as JSON (with the hourly figures)")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="write a PNG chart of the shortfall by cause per day (needs the plot extra: pip install 'apportion[plot]')",
)
def diagnose_cmd(logs, nats_url, cluster_name, team, from_day, to_day, as_json, plot) -> None:
    """Why teams did not get their owed GPU time: the shortfall by cause, and who held it.

    LOG is one cluster's history (a log file or a projection). Several LOGs are
    the clusters of one federated run (``simulate --log run.jsonl`` of several
    clusters writes ``run.<cluster>.jsonl``): the whole tree, then each cluster."""
    from apportion.replay.diagnose import (
        Diagnosis,
        diagnose,
        diagnose_federation,
    )

    if len(logs) > 1:
        if cluster_name is not None:
            raise UserError("give LOGs or --cluster NAME (a live cluster), not both")
        sources = [_open_source(path, None, None) for path in logs]
        with _user_errors():
            fed = diagnose_federation([(s.name, s) for s in sources])
        _diagnosis_out(
            fed.tree,
            fed.clusters,
            ", ".join(s.name for s in sources),
            team,
            from_day,
            to_day,
            as_json,
            plot,
        )
        return
    source = _open_source(logs[0] if logs else None, nats_url, cluster_name)
    with _user_errors():
        diag = diagnose(source)
    clusters: dict[str, Diagnosis] = {}
    _diagnosis_out(diag, clusters, source.name, team, from_day, to_day, as_json, plot)


def _diagnosis_out(
    diag: Any,
    clusters: dict[str, Any],
    name: str,
    team: str | None,
    from_day: float | None,
    to_day: float | None,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Print ``diag`` (one cluster's, or the whole tree's with each of ``clusters``)."""
    from apportion.replay.diagnose import controlled_share, table

    day = 86_400_000
    start = None if from_day is None else diag.start_ms + int(from_day * day)
    end = None if to_day is None else diag.start_ms + int(to_day * day)
    rows = diag.rows(team, start, end)
    if team is not None and not rows:
        raise UserError(f"no team {team!r} in {name} (teams: {', '.join(diag.teams())})")
    if plot is not None:
        from apportion.replay.plots import write_diagnosis_plot

        try:
            write_diagnosis_plot(diag, plot, team)
        except OSError as exc:
            raise UserError(f"{plot}: cannot write the chart: {exc.strerror}") from None
        click.echo(f"wrote {plot}", err=True)
    share = controlled_share(rows)
    per = {c: d.rows(team, start, end) for c, d in clusters.items()}
    if as_json:
        if not diag.clusters:
            echo_json(
                {"teams": rows, "scheduler_controlled_share": share}, indent=None, sort_keys=False
            )
            return
        echo_json(
            {
                "tree": {"teams": rows, "scheduler_controlled_share": share},
                "clusters": {
                    c: {"teams": r, "scheduler_controlled_share": controlled_share(r)}
                    for c, r in per.items()
                },
            },
            indent=None,
            sort_keys=False,
        )
        return
    click.echo(f"apportion diagnose: {name}")
    if diag.clusters:
        click.echo(
            f"the whole tree ({', '.join(diag.clusters)}): owed = global share x every "
            "cluster's healthy GPUs, ran = on every cluster"
        )
    click.echo(table(rows))
    if share is not None:
        click.echo(f"lost to causes the scheduler controls: {100 * share:.2f}% of owed GPU-hours")
    if diag.clusters:
        click.echo("")
        click.echo("where the tree's shortfall waited (GPU-h):")
        click.echo(_where_table(rows, diag.clusters))
    for c, r in per.items():
        click.echo("")
        click.echo(f"cluster {c} on its own (owed = global share x its healthy GPUs, ran = on it):")
        click.echo(table(r))
        s = controlled_share(r)
        if s is not None:
            click.echo(f"lost to causes the scheduler controls: {100 * s:.2f}% of owed GPU-hours")


def _where_table(rows: list[dict[str, Any]], clusters: tuple[str, ...]) -> str:
    """Per team, the tree's shortfall GPU-hours by the cluster its workloads waited on."""
    lines = [["team", "short", *clusters]]
    for r in rows:
        lines.append(
            [
                r["team"],
                f"{r['shortfall_gpu_h']:,.0f}",
                *(f"{r['clusters'][c]:,.0f}" for c in clusters),
            ]
        )
    widths = [max(len(x[i]) for x in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(c.ljust(widths[j]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(x))
        for x in lines
    )


@main.command("outcomes")
@click.option("--quick", is_flag=True, help="two 2-day cells (a smoke run)")
@click.option(
    "--big", is_flag=True, help="only the big-team cells (big_team=0.3, load 3.5; --quick: one)"
)
@click.option(
    "--days", type=click.IntRange(1, 365), default=None, help="every cell for DAYS days instead"
)
@click.option(
    "--federated",
    is_flag=True,
    help="only the cells of several clusters (clusters=2|3; --quick: one, 2 days)",
)
@click.option("--workers", type=click.IntRange(1, 64), default=None, help="processes [cores]")
@click.option("--json", "as_json", is_flag=True, help="every cell's KPIs and causes as JSON")
@_knob_option
def outcomes_cmd(quick, big, federated, days, workers, as_json, knobs) -> None:
    """The family scenario over a grid of loads and seeds, budget vs baseline, one row a cell."""
    import dataclasses
    import time

    from apportion.replay.outcomes import (
        BIG_CELLS,
        DEFAULT_GRID,
        FEDERATED_CELLS,
        QUICK_GRID,
        run_grid,
        table,
    )

    t0 = time.perf_counter()
    with _user_errors():
        from apportion.replay.family import parse_knobs

        parse_knobs(list(knobs))  # one clear line for a bad knob, before any cell runs
    if big:  # --quick: its first cell (seed 1, margin 0) for 2 days
        cells = (dataclasses.replace(BIG_CELLS[0], days=2),) if quick else BIG_CELLS
    elif federated:
        cells = (dataclasses.replace(FEDERATED_CELLS[0], days=2),) if quick else FEDERATED_CELLS
    else:
        cells = QUICK_GRID if quick else DEFAULT_GRID
    if days is not None:
        cells = tuple(dataclasses.replace(c, days=days) for c in cells)
    results = run_grid(cells, workers, tuple(knobs))
    if as_json:
        echo_json(results, indent=None, sort_keys=False)
        return
    click.echo(table(results))
    click.echo(
        f"{len(results)} cells, {time.perf_counter() - t0:.0f} s wall; * large-job waits with "
        "jobs still waiting at the end counted as waiting until the end"
    )
