"""What-if: a log's demand and cluster history, re-simulated under another policy.

From the log take what the world did, not what the scheduler did:

- the **cluster**: the node registrations, budget and policy inputs at the head
  of the log (before its first other input) are folded first, as the simulator
  folds a cluster file;
- later ``WorkloadSubmitted`` (durations from ``duration_ms``; a submission
  without one gets the run time it had in the log if it finished there, and is
  left out otherwise), ``NodeHealthChanged``, ``NodeRegistered``, ``BudgetSet``,
  ``BudgetRemoved`` and ``PolicySet`` inputs, each at its own time and in log
  order (within one millisecond: after the simulator's finishes, before its
  ticks);
- **not** the decisions, ``WorkloadFinished`` (the simulator's executor model
  finishes work when its duration has run), ``WorkloadCancelled`` (a cancel
  reacts to the recorded schedule), ``ClockTicked`` or undecodable inputs.

Changes: every ``PolicySet`` gets the new margin / lookback / cap /
reservations (one is added after the cluster if the log has none); with a new
cap (``max_min_runtime``), every submission that declared a longer minimum
runtime is replayed with the cap as its contract, as users under that policy
would have declared it (not rejected: the what-if asks what the cap does to the
schedule, not how many submissions it would refuse); ``budget``
replaces every budget input by the given tree, set at the start; ``policy``
picks the budget scheduler or the baseline. The horizon is the log's: from its
first input's time to its last. The same policy with no change re-makes the
same history, so the same KPIs.
"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import duckdb
import msgspec
from apportion.core.budget import ROOT
from apportion.core.fold import fold
from apportion.core.history import fold_history
from apportion.core.state import State
from apportion.schemas.events import (
    BudgetRemoved,
    BudgetSet,
    Input,
    InputRejected,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    WorkloadSubmitted,
)
from apportion.schemas.history import BatchItem, HistoryItem, InputItem

from .cluster_file import format_duration
from .eventlog import CONFIG_TYPES, CanonicalLog
from .kpi import compute_kpis
from .projection import Projection
from .run import KPI_COMMIT_EVERY
from .simulator import COMMIT_EVERY, SimResult, simulate


class PolicyChange(msgspec.Struct, kw_only=True):
    """What to change; ``None`` keeps the log's value."""

    preemption_margin_ppm: int | None = None
    preemption_margin_wait_ms: int | None = None
    lookback_ms: int | None = None
    max_min_runtime_ms: int | None = None
    reservations: bool | None = None
    policy: str | None = None
    """``budget`` or ``priority``; ``None``: the policy that made the log."""
    budget: list[tuple[str, int, str]] | None = None
    """``(path, weight, owner)`` parents first, root ``""`` first."""

    def policy_fields(self) -> dict[str, Any]:
        return {
            k: v
            for k in (
                "preemption_margin_ppm",
                "preemption_margin_wait_ms",
                "lookback_ms",
                "max_min_runtime_ms",
                "reservations",
            )
            if (v := getattr(self, k)) is not None
        }


class WhatIf(msgspec.Struct, kw_only=True):
    original: dict[str, Any]
    whatif: dict[str, Any]
    original_policy: str
    whatif_policy: str
    start_ms: int
    end_ms: int
    submissions: int
    dropped_no_duration: int
    capped: int = 0
    """Submissions whose minimum runtime was lowered to the new ``max_min_runtime``."""
    new_rejections: list[tuple[str, str]] = msgspec.field(default_factory=list)
    """``(input id, reason)`` of inputs the what-if refused that the original accepted."""
    sim: Any = None
    """The :class:`SimResult` of the what-if run (its projection in ``sim.con``)."""


def replay_into(items: Iterable[HistoryItem], con: duckdb.DuckDBPyConnection) -> State:
    """Fold ``items`` with a projection on ``con`` observing; return the final state."""
    proj = Projection(con)
    state = fold_history(items, proj.saved_state(), proj)
    proj.commit(state)
    return state


def _observed_durations(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Run time of every workload that finished in the recorded history."""
    rows = con.execute(
        """SELECT workload, SUM(end_ms - start_ms) FROM (
               SELECT DISTINCT r.workload, r.attempt, r.start_ms, r.end_ms FROM runs r
               JOIN workloads w USING (workload)
               WHERE w.status IN ('succeeded', 'failed') AND r.end_ms IS NOT NULL)
           GROUP BY workload"""
    ).fetchall()
    return {w: int(d) for w, d in rows}


def whatif(log: CanonicalLog, change: PolicyChange, *, keep_history: bool = False) -> WhatIf:
    """Re-simulate ``log`` under ``change``. The result's ``sim.con`` holds the
    tables the KPIs read, or (``keep_history``) the what-if's whole projection."""
    items = list(log)
    inputs: list[Input] = [
        it.event for it in items if isinstance(it, InputItem) and it.event is not None
    ]
    if not inputs:
        raise ValueError(f"{log.name}: the log has no inputs")
    # 1. the original, as recorded
    con0 = duckdb.connect()
    state0 = replay_into(items, con0)
    start_ms = min(ev.at_ms for ev in inputs[:1])
    end_ms = state0.now_ms
    original = compute_kpis(con0, start_ms, end_ms)
    original["wall_s"] = None  # recorded, not run here
    durations = _observed_durations(con0)
    con0.close()

    # 2. the world's inputs
    head = 0
    while head < len(inputs) and isinstance(inputs[head], CONFIG_TYPES):
        head += 1
    cluster: list[Input] = list(inputs[:head])
    timed: list[Input] = []
    dropped = 0
    submissions = 0
    for ev in inputs[head:]:
        if isinstance(ev, WorkloadSubmitted):
            if ev.duration_ms is None:
                d = durations.get(ev.workload)
                if d is None:
                    dropped += 1
                    continue
                ev = msgspec.structs.replace(ev, duration_ms=d)
            submissions += 1
            timed.append(ev)
        elif isinstance(ev, (NodeHealthChanged, *CONFIG_TYPES)):
            timed.append(ev)

    # 3. the changes
    root_owner = _root_owner(cluster)
    if change.budget is not None:
        root_owner = change.budget[0][2]
        cluster = [e for e in cluster if type(e) not in (BudgetSet, BudgetRemoved)]
        timed = [e for e in timed if type(e) not in (BudgetSet, BudgetRemoved)]
        at = cluster[-1].at_ms if cluster else start_ms
        budget_events = [
            BudgetSet(
                id=f"whatif/budget/{p}", at_ms=at, path=p, weight=w, owner=o, actor=root_owner
            )
            for p, w, o in change.budget
        ]
        n_nodes = sum(1 for e in cluster if type(e) is NodeRegistered)
        cluster = cluster[:n_nodes] + budget_events + cluster[n_nodes:]
        cluster = [
            msgspec.structs.replace(e, actor=root_owner) if type(e) is PolicySet else e
            for e in cluster
        ]
        timed = [
            msgspec.structs.replace(e, actor=root_owner) if type(e) is PolicySet else e
            for e in timed
        ]
    fields = change.policy_fields()
    if change.max_min_runtime_ms is not None:
        lookback = change.lookback_ms or _policy_of(cluster)["lookback_ms"]
        if change.max_min_runtime_ms > lookback:
            raise ValueError(
                f"max min runtime {format_duration(change.max_min_runtime_ms)} is longer than "
                f"the lookback {format_duration(lookback)}; the policy would be refused"
            )
    if fields:
        if not any(type(e) is PolicySet for e in cluster):
            at = cluster[-1].at_ms if cluster else start_ms
            cluster.append(
                PolicySet(id="whatif/policy", at_ms=at, actor=root_owner, **_policy_of(cluster))
            )
        cluster = [
            msgspec.structs.replace(e, **fields) if type(e) is PolicySet else e for e in cluster
        ]
        timed = [msgspec.structs.replace(e, **fields) if type(e) is PolicySet else e for e in timed]
    capped = 0
    if change.max_min_runtime_ms is not None:
        cap = change.max_min_runtime_ms
        for i, e in enumerate(timed):
            if type(e) is WorkloadSubmitted and e.min_runtime_ms > cap:
                timed[i] = msgspec.structs.replace(e, min_runtime_ms=cap)
                capped += 1

    # 4. re-simulate
    policy = change.policy or log.header.policy
    wall0 = time.perf_counter()
    sim: SimResult = simulate(
        cluster,
        (),
        (),
        policy=policy,
        start_ms=start_ms,
        end_ms=end_ms,
        timed_inputs=timed,
        history=keep_history,
        commit_every=COMMIT_EVERY if keep_history else KPI_COMMIT_EVERY,
    )
    assert sim.con is not None
    events = None if keep_history else sim.events
    kpis = compute_kpis(sim.con, start_ms, end_ms, time.perf_counter() - wall0, events)
    refused_before = {
        d.ref
        for it in items
        if isinstance(it, BatchItem)
        for d in it.batch.decisions
        if isinstance(d, InputRejected)
    }
    return WhatIf(
        original=original,
        whatif=kpis,
        original_policy=log.header.policy,
        whatif_policy=policy,
        start_ms=start_ms,
        end_ms=end_ms,
        submissions=submissions,
        dropped_no_duration=dropped,
        capped=capped,
        new_rejections=[(ref, why) for ref, why in sim.rejected if ref not in refused_before],
        sim=sim,
    )


def load_budget(path: str | Path) -> list[tuple[str, int, str]]:
    """``(path, weight, owner)`` from a TOML file's ``[budget]`` tables (a cluster
    file or just the budget), validated as a cluster file's; raises
    :class:`~apportion.replay.errors.InputFileError`."""
    from .cluster_file import cluster_from_dict
    from .errors import InputFileError
    from .textfile import read_text

    path = Path(path)
    text = read_text(path)  # UTF-8 (a byte-order mark is dropped) or one clear error
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputFileError(str(path), None, f"TOML syntax: {exc}") from None
    if "budget" not in doc:
        raise InputFileError(str(path), "budget", "no [budget] table")
    dummy = {
        "cluster": {
            "name": "whatif",
            "pool": [{"prefix": "n", "count": 1, "gpus_per_node": 1, "gpu_type": "x"}],
        },
        "budget": doc["budget"],
    }
    return cluster_from_dict(dummy, str(path)).budget


def _root_owner(cluster: Sequence[Input]) -> str:
    state = fold(cluster)
    node = state.budget.nodes.get(ROOT)
    return node.owner if node is not None else ""


def _policy_of(cluster: Sequence[Input]) -> dict[str, Any]:
    state = fold(cluster)
    p = state.policy
    return {
        "lookback_ms": p.lookback_ms,
        "max_min_runtime_ms": p.max_min_runtime_ms,
        "preemption_margin_ppm": p.preemption_margin_ppm,
        "preemption_margin_wait_ms": p.margin_wait_ms,
        "reservations": p.reservations,
    }
