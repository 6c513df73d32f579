"""Simulating several clusters that share one budget tree (docs/simulator.md,
"Several clusters").

Each cluster runs its own core (:class:`~apportion.replay.simulator.ClusterRun`:
its own state, history and cycles), and all of them advance in lockstep on
event time: at each millisecond where anything happens, first the trace rows
due then are routed, then every cluster with something due runs it and one
cycle, in name order. A cluster's ``UsageReported`` decisions reach every
other cluster as ``UsageSummary`` inputs (id ``usage/<source>/<start_ms>``,
actor ``federation:<source>``) after ``delay_ms``; while a partition cuts the
link of either end, a summary waits and arrives when the link heals (the
receiver counts it at its own interval's time all the same). Inputs given
ready-made (``timed_inputs``: budget edits, a policy) reach every cluster's
history. A gang never spans clusters: each trace row runs on one.

**Routing** (one rule, :func:`route`): a row naming a cluster goes there. Any
other row goes to one of the clusters that would accept it (a pool of its GPU
type that can hold its gang: the fold's own check), the one where the least
work stands before it for its capacity: the GPUs of the live workloads routed
there (pending or running, free work included) of the teams that rank with or
before the row's team (their usage over their global share, on every cluster,
at most the team's), plus the row's own GPUs, divided by the GPUs of that
cluster's nodes of a type the row can use. Counting the row itself sends a
gang that is large for a small cluster to a larger one; counting only the
work that outranks it sends an under-served team's work where it is first in
line, and an over-served team's where the cluster is least loaded. Compared exactly (cross-multiplied
integers); ties go to the cluster with the larger capacity, then to the name.
A row no cluster accepts goes to the first cluster by name, whose fold refuses
it with its reason. The rule reads only the states at that moment, so a run
is deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import islice
from typing import Any

import duckdb
from apportion.core.history import Observer, observe_all
from apportion.core.refusals import submission_refusal
from apportion.core.rules.classes import team_of
from apportion.core.rules.federation import summary_of
from apportion.core.rules.gpu_types import takes
from apportion.schemas.events import DAY_MS, Input, UsageReported

from .cluster_file import FederationSpec, Partition
from .kpi import compute_kpis, served_kpis
from .projection import Projection
from .simulator import ClusterRun, EstimateSink, SimResult, submission
from .trace import HealthRow, TraceRow


def arrival_ms(sent_ms: int, delay_ms: int, cuts: Sequence[Partition]) -> int:
    """When a summary sent at ``sent_ms`` arrives, with ``cuts`` the partitions of
    either end of its link: ``delay_ms`` later, or when the link heals if it is
    cut in between (at sending or on arrival)."""
    at = sent_ms + delay_ms
    moved = True
    while moved:
        moved = False
        for cut in cuts:
            if cut.from_ms <= at and sent_ms < cut.until_ms and at < cut.until_ms:
                at, moved = cut.until_ms, True
    return at


@dataclass
class _Member:
    """One cluster of the run, with what routing keeps of it."""

    name: str
    run: ClusterRun
    gpus_by_type: dict[str, int]
    live_gpus: int = 0
    team_live: dict[str, int] = field(default_factory=dict)
    """Of :attr:`live_gpus`, each team's."""
    routed: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Team and GPUs of each workload routed here, until it ends."""
    ended_seen: int = 0
    rows: int = 0
    _view: tuple[tuple[int, int], Callable[[str], Fraction]] | None = None

    def capacity(self, gpu_type: str) -> int:
        return sum(g for t, g in self.gpus_by_type.items() if takes(gpu_type, t))

    def note_ends(self) -> None:
        """Forget the workloads that ended since the last look (``ended`` only grows)."""
        ended = self.run.state.ended
        new = len(ended) - self.ended_seen
        if new <= 0:
            return
        for wid in islice(reversed(ended), new):
            routed = self.routed.pop(wid, None)
            if routed is not None:
                team, gpus = routed
                self.live_gpus -= gpus
                self.team_live[team] -= gpus
        self.ended_seen = len(ended)

    def note_routed(self, row: TraceRow) -> None:
        """Count ``row``'s GPUs here until it ends (a repeated id is refused by the fold)."""
        if row.id not in self.routed and row.id not in self.run.state.workloads:
            team = team_of(row.owner)
            self.routed[row.id] = (team, row.gpus)
            self.live_gpus += row.gpus
            self.team_live[team] = self.team_live.get(team, 0) + row.gpus

    def ahead_of(self, team: str) -> int:
        """Live GPUs here of the teams that rank with or before ``team``: whose usage
        (charged in the window, on every cluster, as this cluster sees it) over
        their global share is at most ``team``'s, compared exactly."""
        served = self._served()
        mine = served(team)
        return sum(g for u, g in self.team_live.items() if g and served(u) <= mine)

    def _served(self) -> Callable[[str], Fraction]:
        """``usage / global share`` of a team at this cluster's state (computed once
        per state: rows routed at one moment share it)."""
        state = self.run.state
        version = (state.input_seq, state.decisions_folded)
        if self._view is None or self._view[0] != version:
            tree, now, lookback = state.budget, state.now_ms, state.policy.lookback_ms
            memo: dict[str, Fraction] = {}

            def served(u: str) -> Fraction:
                out = memo.get(u)
                if out is None:
                    node = tree.nodes.get(u)
                    share = tree.global_share(u) if node is not None else Fraction(0)
                    used = node.charged(now, lookback) if node is not None else 0
                    out = Fraction(used) / share if share else Fraction(2**62)
                    memo[u] = out
                return out

            self._view = (version, served)
        return self._view[1]


def route(row: TraceRow, at_ms: int, members: Sequence[_Member]) -> _Member:
    """The cluster ``row`` runs on (module docstring, "Routing")."""
    if row.cluster:
        for m in members:
            if m.name == row.cluster:
                return m
        raise ValueError(f"trace row {row.id!r} names cluster {row.cluster!r}, not in the file")
    best: _Member | None = None
    best_key: tuple[int, int] = (0, 1)
    for m in members:  # by name
        state = m.run.state
        if submission_refusal(state, submission(row, at_ms, state)) is not None:
            continue
        cap = m.capacity(row.gpu_type)
        # lower (ahead + gpus) / cap first (cross-multiplied), then larger capacity, then name
        load = m.ahead_of(team_of(row.owner)) + row.gpus
        lhs, rhs = load * best_key[1], best_key[0] * cap
        if best is None or lhs < rhs or (lhs == rhs and cap > best_key[1]):
            best, best_key = m, (load, cap)
    return best if best is not None else members[0]


@dataclass
class FederationResult:
    """Each cluster's :class:`SimResult` by name, with how the run went."""

    results: dict[str, SimResult]
    rows_routed: dict[str, int]
    summaries_sent: int = 0
    wall_s: float = 0.0
    start_ms: int = 0
    end_ms: int = 0


def run_federation(
    spec: FederationSpec,
    trace_rows: Iterable[TraceRow],
    health_rows: Iterable[HealthRow] = (),
    policy: str = "budget",
    days: float | None = None,
    *,
    observers: dict[str, Observer] | None = None,
    timed_inputs: Iterable[Input] = (),
    start_ms: int = 0,
    progress: Callable[[int], None] | None = None,
    estimate_every: int = 0,
    on_estimate: dict[str, EstimateSink] | None = None,
) -> FederationResult:
    """Simulate the clusters of ``spec`` in lockstep (module docstring)."""
    wall0 = time.perf_counter()
    observers = observers or {}
    node_home = {node: c.name for c in spec.clusters for node, _, _ in c.nodes}
    members: list[_Member] = []
    timed = list(timed_inputs)
    health = list(health_rows)
    rows = sorted(trace_rows, key=lambda r: (r.submit_ms, r.line))
    last_ms = start_ms + max([r.submit_ms for r in rows] + [h.at_ms for h in health] + [0])
    for c in spec.clusters:
        gpus_by_type: dict[str, int] = {}
        for _, gpus, gpu_type in c.nodes:
            gpus_by_type[gpu_type] = gpus_by_type.get(gpu_type, 0) + gpus
        run = ClusterRun(
            policy,
            observer=observers.get(c.name),
            estimate_every=estimate_every,
            on_estimate=(on_estimate or {}).get(c.name),
        )
        mine = [h for h in health if node_home.get(h.node, spec.clusters[0].name) == c.name]
        last_ms = max(last_ms, run.add((), mine, timed, start_ms))
        members.append(_Member(c.name, run, gpus_by_type))
    if days is None:
        days = -(-(last_ms - start_ms + 1) // DAY_MS)
    end_ms = start_ms + int(days * DAY_MS)
    for c, m in zip(spec.clusters, members, strict=True):
        m.run.start(c.events)
    cuts = {
        (a.name, b.name): [p for p in spec.partitions if p.cluster in (a.name, b.name)]
        for a in members
        for b in members
    }
    sent = 0
    i = 0
    next_progress = start_ms
    while True:
        times = [nxt for m in members if (nxt := m.run.next_ms()) is not None]
        if i < len(rows):
            times.append(start_ms + rows[i].submit_ms)
        if not times:
            break
        t = min(times)
        if t >= end_ms:
            break
        if progress is not None and t >= next_progress:
            progress(t - start_ms)
            next_progress = t + 3_600_000
        while i < len(rows) and start_ms + rows[i].submit_ms == t:
            row = rows[i]
            i += 1
            m = route(row, t, members)
            m.run.push_submission(row, t)
            m.rows += 1
            m.note_routed(row)
        for m in members:
            if m.run.next_ms() != t or not m.run.advance(t):
                continue
            m.note_ends()
            for d in m.run.last_decisions:
                if not isinstance(d, UsageReported):
                    continue
                for peer in members:
                    if peer is not m:
                        at = arrival_ms(t, spec.delay_ms, cuts[(m.name, peer.name)])
                        peer.run.push_input(summary_of(d, at))
                        sent += 1
    wall = time.perf_counter() - wall0
    results = {}
    for m in members:
        m.run.close(end_ms)
        results[m.name] = m.run.result(start_ms, end_ms, wall)
    if progress is not None:
        progress(end_ms - start_ms)
    return FederationResult(
        results=results,
        rows_routed={m.name: m.rows for m in members},
        summaries_sent=sent,
        wall_s=wall,
        start_ms=start_ms,
        end_ms=end_ms,
    )


KPI_TABLES = ("workloads", "runs", "waits", "nodes", "health", "estimates")
"""The projection tables the KPIs read that differ per cluster (``budget`` is one tree)."""


def simulate_federation(
    spec: FederationSpec,
    trace_rows: Iterable[TraceRow],
    health_rows: Iterable[HealthRow] = (),
    policy: str = "budget",
    days: float | None = None,
    *,
    history: bool = False,
    sinks: dict[str, Observer] | None = None,
    **kw: object,
) -> tuple[FederationResult, duckdb.DuckDBPyConnection]:
    """:func:`run_federation` observed by one DuckDB projection per cluster, each in
    its own database ``c_<name>`` of one connection (every result's ``con`` is a
    cursor on its own); the connection returned holds the union of their tables
    (one budget tree): the whole tree's projection, for KPIs across clusters."""
    base = duckdb.connect()
    projections: dict[str, Projection] = {}
    observers: dict[str, Observer] = {}
    cursors: dict[str, duckdb.DuckDBPyConnection] = {}
    for c in spec.clusters:
        base.execute(f"ATTACH ':memory:' AS \"c_{c.name}\"")
        cur = base.cursor()
        cur.execute(f'USE "c_{c.name}"')
        proj = Projection(cur, history=history)
        proj.set_meta("policy", policy)
        proj.set_meta("cluster", c.name)
        projections[c.name], cursors[c.name] = proj, cur
        observer = observe_all(proj, (sinks or {}).get(c.name))
        assert observer is not None
        observers[c.name] = observer
    result = run_federation(
        spec,
        trace_rows,
        health_rows,
        policy,
        days,
        observers=observers,
        **kw,  # type: ignore[arg-type]
    )
    for name, proj in projections.items():
        r = result.results[name]
        proj.commit(r.state)
        r.con = cursors[name]
        r.events = proj.events
    first = spec.clusters[0].name
    base.execute(f'CREATE TABLE budget AS SELECT * FROM "c_{first}".budget')
    for table in KPI_TABLES:
        union = " UNION ALL ".join(f'SELECT * FROM "c_{c.name}".{table}' for c in spec.clusters)
        base.execute(f"CREATE TABLE {table} AS {union}")
    return result, base


def tree_kpis(
    result: FederationResult, tree: duckdb.DuckDBPyConnection, start_ms: int
) -> dict[str, Any]:
    """The KPIs of the whole tree from :func:`simulate_federation`'s union (owed: each
    team's global share of every cluster's healthy GPU-time, capped at its demand
    on all of them; delivered: what it ran on all of them), with who ran above its
    share while another team was short (:func:`~apportion.replay.kpi.served_kpis`),
    each cluster's own KPIs under ``clusters``, the rows routed to each and the
    usage summaries sent."""
    per: dict[str, Any] = {}
    for name, r in result.results.items():
        assert r.con is not None
        per[name] = compute_kpis(r.con, start_ms, result.end_ms, result.wall_s, r.events)
    events = sum(r.events or 0 for r in result.results.values())
    out = compute_kpis(tree, start_ms, result.end_ms, result.wall_s, events)
    out.update(served_kpis(tree, start_ms, result.end_ms))
    out["clusters"] = per
    out["rows_routed"] = result.rows_routed
    out["usage_summaries"] = result.summaries_sent
    return out
