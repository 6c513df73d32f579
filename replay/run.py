"""The work behind ``apportion simulate`` and ``apportion replay``, as small functions.

- :func:`load_inputs`: a bundled scenario, or a cluster file with a trace (and
  health) CSV, as the events and rows a simulation needs;
- :func:`run_policy`: one simulation under one policy, observed by a
  projection (and an event-log writer if asked), with its KPIs;
- :func:`rejection_messages`: the inputs the scheduler refused, named by the
  file and line they came from;
- :func:`rebuild`: a history folded again, written to a projection and/or a log file.

Errors a user can fix raise :class:`~apportion.replay.errors.InputFileError`
(or ``ValueError``) with one line of text; the CLI prints it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
from apportion.core.history import Observer, fold_item, observe_all
from apportion.core.state import State
from apportion.schemas.events import DAY_MS, Input
from apportion.schemas.history import BatchItem

from .cluster_file import FederationSpec, federation_from_dict, load_federation
from .errors import InputFileError
from .eventlog import CanonicalLog, Header, LogWriter
from .federation import simulate_federation, tree_kpis
from .kpi import compute_kpis
from .projection import Projection
from .simulator import SimResult, input_origin, simulate
from .trace import HealthRow, TraceRow, read_health, read_trace

DEFAULT_SCENARIO = "ai2"
DEFAULT_DAYS = 30
DEFAULT_DAYS_OF = {"family": 10, "debug": 3}
WARMUP_DAYS = {"ai2": 2, "family": 2}
MAX_TRACE_DAYS = 3_650
"""The longest simulation of a trace (ten years): its hourly KPIs are tables of
that many hours."""
"""The ai2 and family scenarios start from an empty cluster and a backlog; their
first two days are simulated and left out of the KPIs, as simulation studies do
with a warm-up period (``simulated_days`` counts the measured days)."""


@dataclass
class SimInputs:
    """What one simulation runs on."""

    cluster_events: list[Input] = field(default_factory=list)
    trace: list[TraceRow] = field(default_factory=list)
    health: list[HealthRow] = field(default_factory=list)
    days: float | None = None
    warmup_days: int = 0
    """Simulated first and left out of the KPIs (the cluster starts empty)."""
    label: str = ""
    trace_file: str = "<generated>"
    health_file: str = "<generated>"
    problems: list[str] = field(default_factory=list)
    """One line per trace or health row that could not be read (those rows are left out)."""
    federation: FederationSpec | None = None
    """Several clusters sharing the tree (``cluster_events`` is then the first's)."""

    def set_clusters(self, spec: FederationSpec) -> None:
        self.cluster_events = list(spec.clusters[0].events)
        self.federation = spec if len(spec.clusters) > 1 else None

    def horizon_days(self) -> float:
        """``days``, or whole days up to the last submission or health change."""
        if self.days is not None:
            return self.days
        last = max([r.submit_ms for r in self.trace] + [h.at_ms for h in self.health] + [0])
        return -(-(last + 1) // DAY_MS)


def load_inputs(
    cluster: Path | None,
    trace: Path | None,
    health: Path | None,
    seed: int,
    days: float | None,
    scenario: str,
    knobs: list[str] | None = None,
) -> SimInputs:
    """A bundled scenario (no files given; ``knobs`` ``KEY=VALUE`` for ``family``)
    or a cluster file with a trace (and health) CSV."""
    inp = SimInputs()
    if trace is None:
        if cluster is not None or health is not None:
            raise ValueError(
                "--cluster and --health go with --trace (or leave all three out for a bundled scenario)"
            )
        from .scenarios import check_scenario_days, generate

        if days is not None:
            check_scenario_days(days)
        inp.warmup_days = WARMUP_DAYS.get(scenario, 0)
        default = DEFAULT_DAYS_OF.get(scenario, DEFAULT_DAYS)
        sc = generate(scenario, int(days or default) + inp.warmup_days, seed, knobs)
        doc = scenario_cluster_doc(sc)
        inp.set_clusters(federation_from_dict(doc, f"<scenario {sc.name}>"))
        inp.trace, inp.health, inp.days = sc.trace, sc.health, sc.days
        measured = sc.days - inp.warmup_days  # the days the KPI table counts
        warmup = f" (+{inp.warmup_days} warm-up)" if inp.warmup_days else ""
        inp.label = (
            f"scenario {sc.name}, seed {seed}, {measured:g} day{'' if measured == 1 else 's'}{warmup}"
            + (f" ({', '.join(knobs)})" if knobs else "")
        )
        return inp
    if knobs:
        raise ValueError("--set KEY=VALUE goes with a generated scenario, not with --trace")
    if cluster is None:
        raise ValueError("--trace needs --cluster FILE (nodes, budget tree and policy)")
    spec = load_federation(cluster)
    inp.set_clusters(spec)
    rows, errors = read_trace(trace)
    inp.problems.extend(str(e) for e in errors)
    rows = _on_known_clusters(rows, spec.names, str(trace), inp.problems)
    inp.trace, inp.trace_file = rows, str(trace)
    if health is not None:
        hrows, herrors = read_health(health)
        inp.problems.extend(str(e) for e in herrors)
        inp.health, inp.health_file = hrows, str(health)
    if not rows:
        raise InputFileError(str(trace), None, "no valid rows to simulate")
    inp.days = days
    if inp.horizon_days() > MAX_TRACE_DAYS:
        why = f"--days {days:g}" if days is not None else "the trace's last row"
        raise InputFileError(
            str(trace),
            None,
            f"{why} makes a simulation of {inp.horizon_days():g} days; at most {MAX_TRACE_DAYS:,} "
            "(give --days to cut it)",
        )
    inp.label = f"{trace}"
    return inp


def _on_known_clusters(
    rows: list[TraceRow], names: list[str], path: str, problems: list[str]
) -> list[TraceRow]:
    """``rows`` without those whose ``cluster`` the cluster file does not have (each
    a problem of its line, like any row that cannot run; the others run)."""
    known = set(names)
    kept = []
    for r in rows:
        if r.cluster and r.cluster not in known:
            problems.append(
                str(
                    InputFileError(
                        path,
                        r.line,
                        f"row {r.id!r} names cluster {r.cluster!r}; the cluster file has "
                        + ", ".join(repr(n) for n in names),
                    )
                )
            )
        else:
            kept.append(r)
    return kept


def scenario_cluster_doc(sc: Any) -> dict[str, Any]:
    """A generated scenario's cluster (or clusters) as the TOML document a cluster file holds."""
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
    if getattr(sc, "clusters", None):
        del doc["cluster"]
        doc["clusters"] = [
            {
                "name": name,
                "pool": [
                    {"prefix": p, "count": c, "gpus_per_node": g, "gpu_type": t, "start": s0}
                    for p, c, g, t, s0 in pools
                ],
            }
            for name, pools in sc.clusters
        ]
    for path, weight, owner in sc.budget[1:]:
        table = doc["budget"]
        for seg in path.split("/"):
            table = table.setdefault(seg, {})
        table["weight"], table["owner"] = weight, owner
    return doc


KPI_COMMIT_EVERY = 20_000
"""Events between two commits of a projection without the history: its rows are
buffered in Python until then (Philly Oct-Nov, 205,589 events: a peak of
330 MiB at the simulator's 200,000, 216 MiB at 20,000, and less CPU)."""


def fresh_database(out: Path) -> duckdb.DuckDBPyConnection:
    """A new DuckDB file at ``out`` (an existing one, and its WAL, is replaced)."""
    for p in (out, Path(str(out) + ".wal")):
        if p.exists():
            p.unlink()
    try:
        return duckdb.connect(str(out))
    except duckdb.Error as exc:
        raise InputFileError(str(out), None, f"cannot create the database: {exc}") from None


def open_log_writer(path: Path, header: Header) -> LogWriter:
    try:
        return LogWriter(path, header)
    except OSError as exc:
        raise InputFileError(str(path), None, f"cannot write the log: {exc.strerror}") from None


def run_policy(
    inp: SimInputs,
    policy: str,
    out: Path | None = None,
    log: Path | None = None,
    progress: Callable[[int], None] | None = None,
    estimate_every: int = 0,
    history: bool = False,
) -> tuple[SimResult, dict[str, Any]]:
    """Simulate ``inp`` under ``policy``; the projection goes to ``out``, the event
    log to ``log``; KPIs leave out the warm-up days.

    Without ``out`` the projection is in memory and, unless ``history`` (the
    charts read the history's views), holds only the tables the KPIs read: the
    events are counted, not kept (the same KPIs, a fraction of the memory).
    ``estimate_every``: sample the start-time estimate of every N-th submission (0: none)."""
    if inp.federation is not None:
        if out is not None or history:
            raise ValueError(
                "--out and --plot take one cluster; this file has several "
                "(--log FILE writes one log per cluster: FILE.<cluster>.jsonl)"
            )
        return run_federation_policy(inp, inp.federation, policy, progress, log=log)
    con = fresh_database(out) if out is not None else None
    history = history or out is not None
    writer = open_log_writer(log, Header(policy=policy, source="simulate")) if log else None
    result = simulate(
        inp.cluster_events,
        inp.trace,
        inp.health,
        policy=policy,
        days=inp.horizon_days(),
        con=con,
        progress=progress,
        sink=writer,
        estimate_every=estimate_every,
        history=history,
        **({} if history else {"commit_every": KPI_COMMIT_EVERY}),
    )
    if writer is not None:
        writer.close(result.state.digest())
    assert result.con is not None
    start = result.start_ms + inp.warmup_days * DAY_MS
    events = None if history else result.events
    return result, compute_kpis(result.con, start, result.end_ms, result.wall_s, events)


def cluster_log_path(path: Path, cluster: str) -> Path:
    """Where a federated run writes ``cluster``'s log when asked for ``path``:
    ``run.jsonl`` -> ``run.<cluster>.jsonl``."""
    return path.with_name(f"{path.stem}.{cluster}{path.suffix or '.jsonl'}")


def run_federation_policy(
    inp: SimInputs,
    spec: FederationSpec,
    policy: str,
    progress: Callable[[int], None] | None = None,
    log: Path | None = None,
    sinks: dict[str, Observer] | None = None,
) -> tuple[SimResult, dict[str, Any]]:
    """Simulate the clusters of ``spec`` under ``policy``: the KPIs of the whole tree
    (every cluster's runs against the whole tree's capacity), with each cluster's
    own under ``clusters`` and the routing under ``rows_routed``. The result
    returned is the first cluster's, with the tree's projection as its ``con``.
    ``log``: write each cluster's event log to :func:`cluster_log_path`;
    ``sinks``: an observer of each cluster's history, by name."""
    writers: dict[str, LogWriter] = {}
    if log is not None:
        for c in spec.clusters:
            header = Header(policy=policy, source="simulate", cluster=c.name)
            writers[c.name] = open_log_writer(cluster_log_path(log, c.name), header)
    observers = dict(sinks or {})
    for name, writer in writers.items():
        both = observe_all(writer, observers.get(name))
        assert both is not None
        observers[name] = both
    fed, tree = simulate_federation(
        spec, inp.trace, inp.health, policy, inp.horizon_days(), progress=progress, sinks=observers
    )
    for name, writer in writers.items():
        writer.close(fed.results[name].state.digest())
    start = fed.start_ms + inp.warmup_days * DAY_MS
    kpis = tree_kpis(fed, tree, start)
    first = fed.results[spec.clusters[0].name]
    merged = SimResult(
        policy=policy,
        start_ms=fed.start_ms,
        end_ms=fed.end_ms,
        wall_s=fed.wall_s,
        inputs=sum(r.inputs for r in fed.results.values()),
        decisions=sum(r.decisions for r in fed.results.values()),
        cycles=sum(r.cycles for r in fed.results.values()),
        rejected=[x for r in fed.results.values() for x in r.rejected],
        state=first.state,
        con=tree,
        events=kpis["events"],
    )
    return merged, kpis


def rejection_messages(inp: SimInputs, result: SimResult) -> list[str]:
    """One line per input the scheduler refused, naming the trace or health row it came from."""
    lines = {r.id: r.line for r in inp.trace}
    out = []
    for ref, reason in result.rejected:
        origin = input_origin(ref)
        if origin is None:
            continue
        kind, key = origin
        if kind == "trace":
            line = lines.get(key)
            out.append(
                f"{inp.trace_file}:{line}: {reason}"
                if line
                else f"{inp.trace_file}: workload {key}: {reason}"
            )
        elif kind == "health":
            out.append(f"{inp.health_file}:{key}: {reason}")
        else:
            out.append(f"{key}: {reason}")
    return out


@dataclass
class Rebuilt:
    inputs: int = 0
    batches: int = 0
    decisions: int = 0
    state: State = field(default_factory=State)
    table_sizes: dict[str, int] = field(default_factory=dict)


PROJECTION_TABLES = ("events", "workloads", "runs", "waits", "nodes", "health", "budget")


def rebuild(
    source: CanonicalLog,
    out: Path | None = None,
    log_out: Path | None = None,
    until: int | None = None,
) -> Rebuilt:
    """Fold ``source`` again (up to input ``until`` and its batch), writing the
    projection tables to ``out`` and/or the history to the log file ``log_out``."""
    con = fresh_database(out) if out is not None else None
    proj = None
    if con is not None:
        proj = Projection(con)
        proj.set_meta("policy", source.header.policy)
    writer = None
    if log_out is not None:
        header = Header(
            policy=source.header.policy,
            source=source.header.source or "replay",
            cluster=source.header.cluster,
        )
        writer = open_log_writer(log_out, header)
    done = Rebuilt()
    state = done.state
    items = iter(source)
    try:
        for item in items:
            if isinstance(item, BatchItem):
                done.batches += 1
                done.decisions += len(item.batch.decisions)
            elif until is not None and item.seq > until:
                break
            else:
                done.inputs += 1
            rejected = fold_item(state, item)
            if proj is not None:
                proj(item, state, rejected)
            if writer is not None:
                writer.add(item)
    finally:
        items.close()
    if proj is not None and con is not None:
        proj.commit(state)
        for t in PROJECTION_TABLES:
            row = con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()
            done.table_sizes[t] = row[0] if row else 0
        con.close()
    if writer is not None:
        writer.close(state.digest())
    return done
