"""Why did a team not get its share? Owed-but-undelivered GPU-hours, split by cause.

``apportion diagnose RUN`` refolds a run's history (a log file or a projection)
and, after every decision batch, looks at each team the way the KPIs do:

- **owed** (GPUs, at that moment) = min(global share x healthy GPUs, the
  team's allocated demand: GPUs of its allocated workloads pending or running);
- **ran** = GPUs of its allocated runs;
- **shortfall** = owed - ran, when positive.

The state does not change between two batches (nothing happens without an
input), so each shortfall holds until the next batch. For a team with a
shortfall, the first of its pending allocated workloads in scheduling order
(the one the next cycle tries first: its *head*) is examined, and the
shortfall is attributed to why that workload is not running:

==================  =========================================================  ==========
cause               the head workload ...                                      controlled
==================  =========================================================  ==========
``fragmentation``   has enough free GPUs of its type, but not on one node /    scheduler
                    on whole nodes
``reservation``     would fit, but the nodes are held by a reservation for     scheduler
                    another workload
``type_full``       asks for a GPU type that is full, while another type has   scheduler*
                    room for it
``unallocated``     is blocked by free (zero-min-runtime) work it could        scheduler
                    preempt
``margin``          is blocked by others' work past its contract that it       scheduler
                    does not outrank by the preemption margin
``contracts``       is blocked by others' work still inside its contract       price
                    (protected): the price of the scheduling contract
``own_work``        is blocked by its own team's running work (a gang larger   price
                    than what the team's share leaves free)
``nodes_down``      needs more nodes of its type than are healthy now (hosts    price
                    down or draining)
``window``          is blocked by work of teams that are more under-served      price
                    over the lookback window (this team used more than its
                    share earlier: fair share is kept over the window, not
                    hour by hour)
``other``           none of the above (a cause not named yet)                  scheduler
==================  =========================================================  ==========

(*) typed work that cannot run elsewhere is a price, untyped work that fills
the scarce type is the scheduler's choice; the report names both.

When the capacity is held by several kinds of work, the shortfall is split in
proportion to the GPUs each kind holds on the nodes the workload could use.
Holders are named per team ("who had it"). Per hour the causes are scaled to
the hourly shortfall the ``delivery_ratio`` KPI counts (owed and delivered per
hour, delivered capped at owed), so the table adds up to the KPI.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from apportion.core.cycle import Reservation, decide
from apportion.core.history import fold_item
from apportion.core.ordering import FairShareView, queue_order
from apportion.core.placement import FreeGPUs
from apportion.core.rules.classes import team_of
from apportion.core.rules.contract import is_allocated, is_protected, may_use_reserved
from apportion.core.rules.gpu_types import is_any
from apportion.core.rules.outranking import Outranking, Standing
from apportion.core.state import State, Workload
from apportion.schemas.events import HOUR_MS
from apportion.schemas.history import BatchItem, HistoryItem

CAUSES = (
    "fragmentation",
    "reservation",
    "type_full",
    "unallocated",
    "margin",
    "contracts",
    "own_work",
    "window",
    "nodes_down",
    "other",
)
SCHEDULER_CAUSES = ("fragmentation", "reservation", "type_full", "unallocated", "margin", "other")
"""Causes the scheduler controls (losses to these are bugs); the rest are the contract's price."""


@dataclass
class TeamHour:
    """GPU-ms of one team in one hour."""

    owed: float = 0.0
    ran: float = 0.0
    causes: dict[str, float] = field(default_factory=dict)
    holders: dict[str, float] = field(default_factory=dict)

    @property
    def shortfall(self) -> float:
        return max(0.0, self.owed - min(self.ran, self.owed))


@dataclass
class Diagnosis:
    start_ms: int
    end_ms: int
    hours: dict[tuple[str, int], TeamHour] = field(default_factory=dict)

    def add(
        self,
        team: str,
        a: int,
        b: int,
        owed: float,
        ran: float,
        split: dict[str, float],
        holders: dict[str, float],
    ) -> None:
        """``owed``/``ran`` GPUs and the shortfall split (GPUs by cause) held over ``[a, b)``."""
        while a < b:
            h = (a - self.start_ms) // HOUR_MS
            end = min(b, self.start_ms + (h + 1) * HOUR_MS)
            ms = end - a
            th = self.hours.setdefault((team, h), TeamHour())
            th.owed += owed * ms
            th.ran += ran * ms
            for cause, gpus in split.items():
                th.causes[cause] = th.causes.get(cause, 0.0) + gpus * ms
            for who, gpus in holders.items():
                th.holders[who] = th.holders.get(who, 0.0) + gpus * ms
            a = end

    def teams(self) -> list[str]:
        return sorted({t for t, _ in self.hours})

    def daily(self, team: str | None = None) -> dict[int, dict[str, float]]:
        """Shortfall GPU-hours by cause per day (scaled as in :meth:`rows`)."""
        out: dict[int, dict[str, float]] = {}
        for (t, h), th in self.hours.items():
            if team is not None and t != team:
                continue
            short, raw = th.shortfall, sum(th.causes.values())
            if short <= 0:
                continue
            day = out.setdefault(h // 24, dict.fromkeys(CAUSES, 0.0))
            if raw <= 0:
                day["other"] += short / HOUR_MS
            for cause, v in th.causes.items():
                day[cause] += short * v / raw / HOUR_MS if raw > 0 else 0.0
        return out

    def rows(
        self, team: str | None = None, from_ms: int | None = None, to_ms: int | None = None
    ) -> list[dict[str, Any]]:
        """One row per team: owed, delivered and the shortfall by cause (GPU-hours),
        each hour's causes scaled to that hour's KPI shortfall."""
        per: dict[str, dict[str, Any]] = {}
        for (t, h), th in sorted(self.hours.items()):
            at = self.start_ms + h * HOUR_MS
            if team is not None and t != team:
                continue
            if (from_ms is not None and at < from_ms) or (to_ms is not None and at >= to_ms):
                continue
            row = per.setdefault(
                t,
                {
                    "team": t,
                    "owed_gpu_h": 0.0,
                    "delivered_gpu_h": 0.0,
                    "shortfall_gpu_h": 0.0,
                    "causes": dict.fromkeys(CAUSES, 0.0),
                    "holders": {},
                },
            )
            row["owed_gpu_h"] += th.owed / HOUR_MS
            row["delivered_gpu_h"] += min(th.ran, th.owed) / HOUR_MS
            short = th.shortfall
            row["shortfall_gpu_h"] += short / HOUR_MS
            raw = sum(th.causes.values())
            if short > 0:
                scale = short / raw if raw > 0 else 0.0
                if raw <= 0:
                    row["causes"]["other"] += short / HOUR_MS
                for cause, v in th.causes.items():
                    row["causes"][cause] += v * scale / HOUR_MS
                held = sum(th.holders.values())
                for who, v in th.holders.items():
                    row["holders"][who] = row["holders"].get(who, 0.0) + short * v / held / HOUR_MS
        out = []
        for t in sorted(per):
            row = per[t]
            row["delivery"] = (
                round(row["delivered_gpu_h"] / row["owed_gpu_h"], 4) if row["owed_gpu_h"] else None
            )
            for k in ("owed_gpu_h", "delivered_gpu_h", "shortfall_gpu_h"):
                row[k] = round(row[k], 1)
            row["causes"] = {c: round(v, 1) for c, v in row["causes"].items()}
            top = sorted(row["holders"].items(), key=lambda kv: (-kv[1], kv[0]))[:5]
            row["holders"] = {who: round(v, 1) for who, v in top}
            out.append(row)
        return out


_STANDING_LEVEL = {Standing.OUTRANKS: 2, Standing.INSIDE_MARGIN: 3, Standing.NOT_LOWER: 4}
"""A block's level by how the candidate stands against a running allocated workload
(:meth:`~apportion.core.rules.outranking.Outranking.standing`, the rule the cycle
preempts by): 2 if it outranks it clearly, 3 if its ratio is lower but inside the
margin, 4 if it is not lower (the victim's side is more under-served over the
lookback window)."""


class _Moment:
    """One state, right after a batch: the teams' shortfalls and their causes."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.t = state.now_ms
        self.view = FairShareView(state)
        self.outranking = Outranking(
            state.budget, self.view.usage, self.view.weight, state.policy.preemption_margin_ppm
        )
        self.free = FreeGPUs(state)
        self._reservation: Reservation | None = None
        self._reservation_known = False

    def reservation(self) -> Reservation | None:
        """The reservation in force (a cycle run on this state, computed on first use)."""
        if not self._reservation_known:
            self._reservation = decide(self.state, report_reservation=True).reservation
            self._reservation_known = True
        return self._reservation

    def explain(self, w: Workload, team: str) -> tuple[str, dict[str, float]]:
        """Why ``w`` is not running: the cause, and GPUs held per holder team.

        Each running workload on a node ``w`` could use gets a *level*: what it
        would take to move it (unallocated work, then allocated work ``w``
        outranks clearly, then work inside the margin, then work of teams more
        under-served over the window, then work inside its contract, then the
        team's own work). The lowest level at which enough nodes clear for
        ``w`` names the cause: the hardest thing on the cheapest nodes."""
        state, free = self.state, self.free
        pools = free.pools_for(w.gpu_type)
        match_free = sum(free.pool_free.get(p, 0) for p in pools)
        if match_free >= w.gpus:
            if free.fit(w.gpus, w.gpu_type) is None:
                return "fragmentation", {}
            gated = self._gated(w)
            if gated and free.fit(w.gpus, w.gpu_type, lambda n: n not in gated) is None:
                return "reservation", {}
            return "other", {}
        if not is_any(w.gpu_type):
            other_free = sum(v for p, v in free.pool_free.items() if p not in pools)
            if other_free >= w.gpus:
                return "type_full", {}
        if not any(
            len(free.pool_nodes[p]) >= (1 if w.gpus <= p[1] else w.gpus // p[1])
            for p in pools
            if w.gpus <= p[1] or w.gpus % p[1] == 0
        ):
            return "nodes_down", {}  # too few healthy nodes of its type for the gang
        gated = self._gated(w)
        best = self._cheapest_level(w, team, pools, gated)
        if gated:
            ungated = self._cheapest_level(w, team, pools, frozenset())
            if ungated is not None and (best is None or ungated[0] < best[0]):
                if ungated[0] <= _PLACEABLE:
                    # it could run now but for the nodes a reservation holds
                    return "reservation", {}
                best = ungated  # blocked there too: name what blocks it there
        if best is None or best[0] >= _NEVER:
            return "other", {}
        level, names = best
        holders: dict[str, float] = {}
        running = state.running
        for name in names:
            for wid, gpus in state.nodes[name].workloads.items():
                vteam = team_of(running[wid].owner)
                if vteam != team:
                    holders[vteam] = holders.get(vteam, 0.0) + gpus
        return _LEVEL_CAUSE[level], holders

    def _gated(self, w: Workload) -> frozenset[str]:
        """The nodes the reservation in force keeps ``w`` off (the reservation gate)."""
        held = self.reservation()
        if held is None or may_use_reserved(self.t, w.min_runtime_ms, held.start_ms):
            return frozenset()
        return frozenset(held.nodes)

    def _cheapest_level(
        self, w: Workload, team: str, pools: list[tuple[str, int]], gated: frozenset[str]
    ) -> tuple[int, list[str]] | None:
        """The lowest level at which enough nodes (not in ``gated``) clear for ``w``,
        and those nodes; ``None`` if no pool can hold it."""
        best: tuple[int, list[str]] | None = None
        free = self.free
        for pool in pools:
            size = pool[1]
            if w.gpus > size and w.gpus % size:
                continue
            options = sorted(
                (self._node_level(w, team, name, min(w.gpus, size)), name)
                for name in free.pool_nodes[pool]
                if name not in gated
            )
            need = 1 if w.gpus <= size else w.gpus // size
            if len(options) < need:
                continue
            level = options[need - 1][0]
            if best is None or level < best[0]:
                best = (level, [n for _, n in options[:need]])
        return best

    def _node_level(self, w: Workload, team: str, name: str, want: int) -> int:
        """The lowest level at which ``want`` GPUs of node ``name`` come free for ``w``."""
        node = self.state.nodes[name]
        have = self.free.free[name]
        if have >= want:
            return 0
        running = self.state.running
        levels = []
        for wid, gpus in node.workloads.items():
            v = running[wid]
            if not is_allocated(v):
                level = 1
            elif team_of(v.owner) == team:
                level = 6
            elif is_protected(v, self.t):
                level = 5
            else:
                level = _STANDING_LEVEL[self.outranking.standing(w, v)]
            levels.append((level, gpus))
        for level, gpus in sorted(levels):
            have += gpus
            if have >= want:
                return level
        return _NEVER


_NEVER = 99
_PLACEABLE = 2
"""Levels up to this one (free GPUs, free work, work it outranks) the cycle could take now."""
_LEVEL_CAUSE = {
    0: "other",
    1: "unallocated",
    2: "other",
    3: "margin",
    4: "window",
    5: "contracts",
    6: "own_work",
}
"""The cause of a block by the lowest level that clears: at 0-2 the scheduler could
have placed it (free GPUs, free work, work it outranks), so a block there is a cause
not named yet unless the reservation explains it."""


def diagnose(items: Iterable[HistoryItem], start_ms: int | None = None) -> Diagnosis:
    """Refold ``items`` and attribute every team's shortfall to causes (module docstring)."""
    state = State()
    diag: Diagnosis | None = None
    pending_moment: (
        tuple[int, dict[str, tuple[float, float, dict[str, float], dict[str, float]]]] | None
    ) = None

    def hold_until(diag: Diagnosis, end: int) -> None:
        """The teams' figures of the last batch held from its time until ``end``."""
        if pending_moment is not None:
            at, teams = pending_moment
            for team, (owed, ran, split, holders) in teams.items():
                diag.add(team, at, end, owed, ran, split, holders)

    for item in items:
        fold_item(state, item)
        if not isinstance(item, BatchItem):
            continue
        if diag is None:
            diag = Diagnosis(start_ms=state.now_ms if start_ms is None else start_ms, end_ms=0)
        hold_until(diag, state.now_ms)
        pending_moment = (state.now_ms, _teams_now(state))
    if diag is None:
        return Diagnosis(start_ms=0, end_ms=0)
    hold_until(diag, state.now_ms)
    diag.end_ms = state.now_ms
    return diag


def _teams_now(state: State) -> dict[str, tuple[float, float, dict[str, float], dict[str, float]]]:
    """Per team: owed and ran GPUs now, and its shortfall split by cause (GPUs) with holders."""
    healthy = sum(n.gpus for n in state.nodes.values() if n.health == "healthy")
    demand: dict[str, int] = {}
    ran: dict[str, int] = {}
    for w in state.workloads.values():
        if is_allocated(w):
            team = team_of(w.owner)
            demand[team] = demand.get(team, 0) + w.gpus
            if w.status == "running":
                ran[team] = ran.get(team, 0) + w.gpus
    out: dict[str, tuple[float, float, dict[str, float], dict[str, float]]] = {}
    moment: _Moment | None = None
    heads: dict[str, Workload] | None = None
    tree = state.budget
    for leaf in tree.leaves():
        team = team_of(leaf)
        if team in out:
            continue
        share = float(tree.global_share(team)) * healthy
        owed = min(share, float(demand.get(team, 0)))
        got = float(ran.get(team, 0))
        split: dict[str, float] = {}
        holders: dict[str, float] = {}
        short = owed - min(got, owed)
        if short > 0:
            if moment is None:
                moment = _Moment(state)
                heads = {}
                for w in queue_order(state, moment.view):
                    if is_allocated(w):
                        heads.setdefault(team_of(w.owner), w)
            assert heads is not None
            head = heads.get(team)
            if head is not None:
                cause, held = moment.explain(head, team)
                split = {cause: short}
                hsum = sum(held.values())
                holders = {who: short * v / hsum for who, v in held.items()} if hsum else {}
            else:
                split = {"other": short}
        out[team] = (owed, got, split, holders)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The text table of :meth:`Diagnosis.rows`."""
    head = ["team", "owed GPU-h", "delivered", "short", *CAUSES, "held by (GPU-h)"]
    lines = [head]
    total = {"owed_gpu_h": 0.0, "delivered_gpu_h": 0.0, "shortfall_gpu_h": 0.0}
    causes = dict.fromkeys(CAUSES, 0.0)
    for r in rows:
        for k in total:
            total[k] += r[k]
        for c in CAUSES:
            causes[c] += r["causes"][c]
        who = ", ".join(f"{k} {v:,.0f}" for k, v in list(r["holders"].items())[:3])
        lines.append(
            [
                r["team"],
                f"{r['owed_gpu_h']:,.0f}",
                f"{100 * r['delivery']:.1f}%" if r["delivery"] is not None else "-",
                f"{r['shortfall_gpu_h']:,.0f}",
                *(f"{r['causes'][c]:,.0f}" for c in CAUSES),
                who,
            ]
        )
    ratio = total["delivered_gpu_h"] / total["owed_gpu_h"] if total["owed_gpu_h"] else None
    lines.append(
        [
            "all",
            f"{total['owed_gpu_h']:,.0f}",
            f"{100 * ratio:.1f}%" if ratio is not None else "-",
            f"{total['shortfall_gpu_h']:,.0f}",
            *(f"{causes[c]:,.0f}" for c in CAUSES),
            "",
        ]
    )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for i, line in enumerate(lines):
        out.append(
            "  ".join(
                c.ljust(widths[j]) if j in (0, len(head) - 1) else c.rjust(widths[j])
                for j, c in enumerate(line)
            ).rstrip()
        )
        if i == 0 or i == len(lines) - 2:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def controlled_share(rows: list[dict[str, Any]]) -> float | None:
    """GPU-hours lost to causes the scheduler controls, as a fraction of all owed GPU-hours."""
    owed = sum(r["owed_gpu_h"] for r in rows)
    lost = sum(r["causes"][c] for r in rows for c in SCHEDULER_CAUSES)
    return lost / owed if owed else None
