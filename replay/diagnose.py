"""Why did a team not get its share? Owed-but-undelivered GPU-hours, split by cause.

``apportion diagnose RUN`` refolds a run's history (a log file or a projection)
and, after every decision batch, looks at each team the way the KPIs do:

- **owed** (GPUs, at that moment) = min(global share x healthy GPUs, the
  team's allocated demand: GPUs of its allocated workloads pending or running);
- **ran** = GPUs of its allocated runs;
- **shortfall** = owed - ran, when positive.

The state does not change between two batches (nothing happens without an
input), so each shortfall holds until the next batch.

**Per workload.** A team's shortfall is split over its pending allocated
workloads in scheduling order (the order the next cycle tries them): each
explains at most its own GPUs, in order, until the shortfall is used up (a
team short of 20 GPUs with pending jobs of 16, 8 and 8 GPUs: the first explains
16, the second 4, the third nothing). Each part gets the causes of why *that*
workload is not running:

==================  =========================================================  ==========
cause               the workload ...                                           controlled
==================  =========================================================  ==========
``fragmentation``   has enough free GPUs of its type, but not on one node /    scheduler
                    on whole nodes (bounded: see below)
``reservation``     would fit, but the nodes are held by a reservation for     scheduler
                    another workload (bounded)
``type_full``       asks for a GPU type that is full, while another type has   scheduler*
                    room for it (bounded)
``unallocated``     is blocked by free (zero-min-runtime) work it could        scheduler
                    preempt
``margin``          is blocked by others' work past its contract that it       scheduler
                    does not outrank by the preemption margin (while it is
                    still held to the margin: queued for less than the
                    policy's ``preemption_margin_wait``)
``admission``       is blocked by others' work inside its contract that the    scheduler
                    scheduler placed *while this workload was already waiting*,
                    for a team that was then *less under-served* than this
                    workload's team (a choice of the scheduler)
``contracts``       is blocked by others' work inside its contract placed       price
                    before this workload was pending, or for a team at least
                    as under-served as this one then: the price of the
                    scheduling contract
``own_work``        is blocked by its own team's running work (a gang larger   price
                    than what the team's share leaves free)
``nodes_down``      needs more nodes of its type than are healthy now (hosts    price
                    down or draining)
``window``          is blocked by work past its contract of teams that are      price
                    more under-served over the lookback window (this team used
                    more than its share earlier: fair share is kept over the
                    window, not hour by hour)
``other``           none of the above (a cause not named yet, or it fits now)  scheduler
==================  =========================================================  ==========

(*) typed work that cannot run elsewhere is a price, untyped work that fills
the scarce type is the scheduler's choice; the report names both.

**The level explanation.** Each running workload on a node the waiting workload
``w`` could use gets a *level*: what it would take to move it: 1 free work, 2
allocated work past its contract that ``w`` clearly outranks, 3 work past its
contract that ``w``'s side is lower than but inside the margin, 4 work past its
contract whose side is not lower (``window``), 5 others' work inside its
contract, 6 the team's own work (:meth:`Outranking.standing` at the first level
where the budget paths part, the rule the cycle preempts by). A node's level is
the lowest level at which enough of its GPUs come free for ``w`` (its free GPUs
first, then its runs by level); the cheapest set of nodes that would hold ``w``
(nodes the reservation keeps ``w`` off left out, as the cycle does) has the
level of its hardest node: the **blocking level**, whose cause
(``unallocated``/``other``/``margin``/``window``/level 5/``own_work``) explains
the part. The **holders** are the runs *at the blocking level* on those nodes
(those a node's clearing takes at that level), not every run on them: work
past its contract is therefore never named under level 5. At level 5 the part
is split over the holder runs in proportion to their GPUs on those nodes, each
run ``contracts`` or ``admission`` by its placement (below). Inside level 5 an
admission run is cheaper to clear than a contract (undoing a choice of the
scheduler comes before a fairly placed contract): a node's runs are taken
admission first, and among nodes of one level those whose clearing takes fewer
GPUs of ``contracts`` come first (then by name). The part is ``admission`` only
when the admitted runs alone keep ``w`` from running now (its cheapest nodes
need no contract cleared): had the scheduler admitted nothing, it would be
running. While a fairly placed contract is still among the nodes it needs, it
would wait anyway, so the whole part is ``contracts`` (the holders are still
every run at that level). Over time this charges a gang's wait to the
contracts until the last of them ends, and to admission from then on.

- at each decision batch, before folding it, every allocated ``WorkloadPlaced``
  is recorded with the teams with pending allocated work whose standing was
  then *strictly lower* than the placed team's (more under-served: at the first
  level where their budget paths part, ratio ``(usage + committed) / weight``
  of the fair-share view of that state, compared exactly by
  :func:`~apportion.core.ratio.below_pair`);
- a holder run is ``admission`` for ``w`` when ``w``'s team is among those and
  ``w`` itself was pending at that batch (its current queue episode, from its
  submission or requeue, began at an earlier item of the history; an episode
  started by an input the fold did not tie to ``w`` counts when it began at an
  earlier millisecond); else ``contracts`` (also for runs placed before the
  history began). Equal standing is ``contracts``: the scheduler did not
  prefer a less under-served team.

**Bounded by idle capacity.** ``fragmentation``, ``type_full`` and
``reservation`` say capacity sat idle, so they may explain only GPUs that were
idle at that moment: free GPUs on healthy nodes of ``w``'s types
(``fragmentation``), of the other types (``type_full``), or on the nodes the
reservation holds (``reservation``). Every moment keeps one ledger of idle GPUs
per node; the teams' parts are visited in the global scheduling order, and each
such part takes ``min(its GPUs, idle GPUs left in its set)`` from the ledger;
the rest of the part goes to the level explanation of ``w`` (what holds the
other GPUs it needs). So, at any moment, these three causes together never
exceed the idle GPUs, and no idle GPU is counted twice. (A workload that fits
now takes its idle GPUs too, under ``other``.)

Per hour the causes are scaled to the hourly shortfall the ``delivery_ratio``
KPI counts (owed and delivered per hour, delivered capped at owed), so the
table adds up to the KPI; holders ("who had it", per team, the team's own work
left out) are scaled the same way, so they add up to the GPU-hours explained by
levels 1-5.

**Several clusters** (:func:`diagnose_federation`: the histories of a federated
run, each cluster's own, sharing one budget tree). The histories are refolded
in lockstep on event time: at each millisecond where some cluster decides a
batch, every cluster folds its inputs and batches up to that time (a cluster's
state is the one right after its last batch, as above), then the whole tree is
looked at:

- **owed** = min(global share x the healthy GPUs of *every* cluster, the team's
  allocated demand on every cluster); **ran** = its allocated runs on every
  cluster; **shortfall** = owed - ran, when positive. A team short on one
  cluster while served on another is therefore not short over the tree, and
  a team short over the tree can be waiting on a cluster where it runs its
  own share of that cluster: what the tree owes is the tree's, wherever it
  runs. (The shares come from the first cluster's tree by name: one tree.)
- **per workload**: the shortfall is split over the team's pending allocated
  workloads on every cluster, each cluster's in its own scheduling order, the
  clusters taking turns in name order, one of the team's workloads per turn
  (its first on ``a``, its first on ``b``, its second on ``a``, ...), each
  explaining at most its own GPUs until the shortfall is used up. A cluster's
  order already counts the peers' usage (the ``UsageSummary`` inputs folded
  into its state); the turns are a convention (nothing ranks a workload on
  one cluster against one on another) and are written down so the split is
  deterministic.
- each part gets its causes **on its own cluster**, by the rules above: that
  cluster's levels and holders, its reservation, its admission ledger, and
  its own ledger of idle GPUs (every cluster's parts, of all teams, in that
  cluster's scheduling order).
- the rows of the tree's diagnosis also say **where** the shortfall waited
  (``clusters``: GPU-hours by the cluster of the explaining workloads, scaled
  like the causes).

Beside it, each cluster on its own is diagnosed exactly as one cluster (owed =
global share x *its* healthy GPUs, capped by the team's demand on it; ran = on
it): the same rows as :func:`diagnose` of that cluster's history. Those rows
do not add up to the tree's: a team served on another cluster shows short on
this one. The tree's is the one the tree's KPIs count (``ctrl loss`` of the
federated cells of ``make outcomes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from apportion.core.budget import ancestors_of
from apportion.core.cycle import Reservation, decide
from apportion.core.history import fold_item
from apportion.core.ordering import FairShareView, FairShareWalk
from apportion.core.placement import FreeGPUs
from apportion.core.ratio import below_pair
from apportion.core.rules.classes import team_of
from apportion.core.rules.contract import is_allocated, is_protected, may_use_reserved
from apportion.core.rules.gpu_types import is_any
from apportion.core.rules.outranking import Outranking, Standing, held_to_margin
from apportion.core.state import State, Workload
from apportion.schemas.events import HOUR_MS, PolicySet, WorkloadPlaced, WorkloadPreempted
from apportion.schemas.history import BatchItem, HistoryItem, InputItem
from msgspec import UnsetType

CAUSES = (
    "fragmentation",
    "reservation",
    "type_full",
    "unallocated",
    "margin",
    "admission",
    "contracts",
    "own_work",
    "window",
    "nodes_down",
    "other",
)
SCHEDULER_CAUSES = (
    "fragmentation",
    "reservation",
    "type_full",
    "unallocated",
    "margin",
    "admission",
    "other",
)
"""Causes the scheduler controls (losses to these are bugs); the rest are the contract's price."""
BOUNDED_CAUSES = ("fragmentation", "reservation", "type_full")
"""Causes that say capacity sat idle: each explains at most the idle GPUs left (module docstring)."""


@dataclass
class TeamHour:
    """GPU-ms of one team in one hour."""

    owed: float = 0.0
    ran: float = 0.0
    causes: dict[str, float] = field(default_factory=dict)
    holders: dict[str, float] = field(default_factory=dict)
    where: dict[str, float] = field(default_factory=dict)
    """Of the explained shortfall, the GPU-ms whose workloads waited on each cluster
    (the whole tree's diagnosis only)."""

    @property
    def shortfall(self) -> float:
        return max(0.0, self.owed - min(self.ran, self.owed))


@dataclass
class Diagnosis:
    start_ms: int
    end_ms: int
    hours: dict[tuple[str, int], TeamHour] = field(default_factory=dict)
    clusters: tuple[str, ...] = ()
    """The clusters of a whole tree's diagnosis (:func:`diagnose_federation`): its rows
    then say where the shortfall waited (``clusters``); ``()`` for one cluster."""

    def add(
        self,
        team: str,
        a: int,
        b: int,
        owed: float,
        ran: float,
        split: dict[str, float],
        holders: dict[str, float],
        where: dict[str, float] | None = None,
    ) -> None:
        """``owed``/``ran`` GPUs and the shortfall split (GPUs by cause) held over ``[a, b)``;
        ``where``: the same shortfall's GPUs by the cluster its workloads waited on."""
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
            for name, gpus in (where or {}).items():
                th.where[name] = th.where.get(name, 0.0) + gpus * ms
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
                    **({"clusters": dict.fromkeys(self.clusters, 0.0)} if self.clusters else {}),
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
                for who, v in th.holders.items():
                    row["holders"][who] = row["holders"].get(who, 0.0) + v * scale / HOUR_MS
                for name, v in th.where.items():  # its parts' GPUs: they add up to ``raw``
                    row["clusters"][name] += v * scale / HOUR_MS
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
            if self.clusters:
                row["clusters"] = {name: round(v, 1) for name, v in row["clusters"].items()}
            out.append(row)
        return out


_STANDING_LEVEL = {Standing.OUTRANKS: 2, Standing.INSIDE_MARGIN: 3, Standing.NOT_LOWER: 4}
"""A block's level by how the candidate stands against a running allocated workload
(:meth:`~apportion.core.rules.outranking.Outranking.standing`, the rule the cycle
preempts by): 2 if it outranks it clearly, 3 if its ratio is lower but inside the
margin, 4 if it is not lower (the victim's side is more under-served over the
lookback window)."""
_NEVER = 99
_PLACEABLE = 2
"""Levels up to this one (free GPUs, free work, work it outranks) the cycle could take now."""
_PROTECTED = 5
_LEVEL_CAUSE = {
    0: "other",
    1: "unallocated",
    2: "other",
    3: "margin",
    4: "window",
    6: "own_work",
}
"""The cause of a block by its blocking level (5, work inside its contract, is
``contracts`` or ``admission`` run by run): at 0-2 the scheduler could have placed
it (free GPUs, free work, work it outranks), so a block there is a cause not named
yet unless the reservation explains it."""


@dataclass(frozen=True)
class Placement:
    """An allocated run's placement as the diagnosis recorded it (before its batch folded)."""

    at_ms: int
    item: int
    """Index of its batch in the history (items counted from 0)."""
    over: frozenset[str]
    """Teams with pending allocated work then that were more under-served than its team."""


@dataclass
class Ledger:
    """What a refold records for the diagnosis: placements, and when each
    workload's current queue episode began (item index, for same-millisecond order)."""

    placements: dict[str, Placement] = field(default_factory=dict)
    episodes: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Workload id -> (its ``queued_ms``, index of the item that queued it)."""

    def was_waiting(self, w: Workload, p: Placement) -> bool:
        """Whether ``w`` (pending now) was already pending when ``p`` was decided."""
        ep = self.episodes.get(w.id)
        if ep is not None and ep[0] == w.queued_ms:
            return ep[1] < p.item
        return w.queued_ms < p.at_ms


def _team_path(team: str) -> tuple[str, ...]:
    return (*ancestors_of(team)[1:], team)


def more_under_served(view: FairShareView, a: str, b: str) -> bool:
    """Whether team ``a`` stands strictly lower (more under-served) than team ``b``
    at the first level where their budget paths part (exact, no margin)."""
    usage, weight = view.usage, view.weight
    for x, y in zip(_team_path(a), _team_path(b), strict=False):
        if x != y:
            return below_pair(usage[x], weight[x], usage[y], weight[y])
    return False


def record_placements(state: State, item: BatchItem, index: int, ledger: Ledger) -> None:
    """Before ``item`` folds into ``state``: note each allocated placement it makes,
    with the waiting teams it was placed over (:class:`Placement`)."""
    placed = [d for d in item.batch.decisions if isinstance(d, WorkloadPlaced) and d.allocated]
    if not placed:
        return
    waiting = sorted({team_of(leaf) for leaf, keys in state.pending_index.by_leaf.items() if keys})
    view: FairShareView | None = None
    over: dict[str, frozenset[str]] = {}
    for d in placed:
        w = state.workloads.get(d.workload)
        if w is None:
            continue
        team = team_of(w.owner)
        teams = over.get(team)
        if teams is None:
            if view is None:
                view = FairShareView(state)
            teams = over[team] = frozenset(
                t for t in waiting if t != team and more_under_served(view, t, team)
            )
        ledger.placements[d.workload] = Placement(state.now_ms, index, teams)


def record_episodes(state: State, item: HistoryItem, index: int, ledger: Ledger) -> None:
    """After ``item`` folded: the workloads it queued (a submission, a requeue)."""
    if isinstance(item, InputItem):
        wids: list[str] = []
        wid = getattr(item.event, "workload", None)
        if isinstance(wid, str):
            wids.append(wid)
    else:
        wids = [
            d.workload
            for d in item.batch.decisions
            if isinstance(d, WorkloadPreempted) and d.requeued
        ]
    for wid in wids:
        w = state.pending.get(wid)
        if w is not None and w.queued_ms == state.now_ms:
            ledger.episodes[wid] = (w.queued_ms, index)


class _Idle:
    """The idle GPUs of one moment that bounded causes may still explain, per node."""

    def __init__(self, free: FreeGPUs) -> None:
        self.free = free
        self.left: dict[str, float] = {}

    def take(self, names: Iterable[str], want: float) -> float:
        """Take up to ``want`` idle GPUs from ``names`` (in order); how many were taken."""
        got = 0.0
        left, free = self.left, self.free.free
        for name in names:
            if got >= want:
                break
            have = left.get(name, float(free[name]))
            t = min(have, want - got)
            if t > 0:
                left[name] = have - t
                got += t
        return got


Block = tuple[int, list[tuple[str, str, float, str]]]
"""A blocking level and its holder runs: (workload id, holder team, GPUs on the
nodes, the cause it names)."""


class _Moment:
    """One state, right after a batch: the teams' shortfalls and their causes."""

    def __init__(self, state: State, ledger: Ledger) -> None:
        self.state = state
        self.ledger = ledger
        self.t = state.now_ms
        self.view = FairShareView(state)
        policy = state.policy
        self.outranking = Outranking(
            state.budget, self.view.usage, self.view.weight, policy.preemption_margin_ppm
        )
        """The rule with the margin, for a waiting workload still held to it."""
        self.outranking_waited = Outranking(state.budget, self.view.usage, self.view.weight, 0)
        """The rule for one that waited past ``preemption_margin_wait``."""
        self.free = FreeGPUs(state)
        self.idle = _Idle(self.free)
        self._reservation: Reservation | None = None
        self._reservation_known = False
        self._blocks: dict[tuple[Any, ...], tuple[str | None, Block | None]] = {}

    def reservation(self) -> Reservation | None:
        """The reservation in force (a cycle run on this state, computed on first use)."""
        if not self._reservation_known:
            self._reservation = decide(self.state, report_reservation=True).reservation
            self._reservation_known = True
        return self._reservation

    def explain(
        self, w: Workload, team: str, part: float
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Why ``part`` of ``w``'s GPUs are not running: GPUs by cause, and GPUs per
        holder team (module docstring: the bounded causes first, then the level
        explanation for the rest)."""
        free = self.free
        pools = free.pools_for(w.gpu_type)
        match_free = sum(free.pool_free.get(p, 0) for p in pools)
        bounded: str | None = None
        idle_nodes: list[str] = []
        if match_free >= w.gpus:
            gated = self._gated(w)
            if free.fit(w.gpus, w.gpu_type) is None:
                bounded = "fragmentation"
                idle_nodes = [n for p in pools for n in free.pool_nodes[p]]
            elif gated and free.fit(w.gpus, w.gpu_type, lambda n: n not in gated) is None:
                bounded = "reservation"
                idle_nodes = [n for p in pools for n in free.pool_nodes[p] if n in gated]
            else:
                # it fits now and is not placed: a cause not named yet
                self.idle.take([n for p in pools for n in free.pool_nodes[p]], part)
                return {"other": part}, {}
        elif not is_any(w.gpu_type) and (
            sum(v for p, v in free.pool_free.items() if p not in pools) >= w.gpus
        ):
            bounded = "type_full"
            idle_nodes = [
                n for p, names in free.pool_nodes.items() if p not in pools for n in names
            ]
        elif not any(
            len(free.pool_nodes[p]) >= (1 if w.gpus <= p[1] else w.gpus // p[1])
            for p in pools
            if w.gpus <= p[1] or w.gpus % p[1] == 0
        ):
            return {"nodes_down": part}, {}  # too few healthy nodes of its type for the gang
        reserved, block = self._block(w, team, pools)
        if bounded is None and reserved is not None:
            bounded = reserved
            gated = self._gated(w)
            idle_nodes = [n for p in pools for n in free.pool_nodes[p] if n in gated]
        causes: dict[str, float] = {}
        rest = part
        if bounded is not None:
            took = self.idle.take(idle_nodes, part)
            if took > 0:
                causes[bounded] = took
            rest = part - took
        holders: dict[str, float] = {}
        if rest > 0:
            self._explain_level(w, team, rest, block, causes, holders)
        return causes, holders

    def _explain_level(
        self,
        w: Workload,
        team: str,
        rest: float,
        block: Block | None,
        causes: dict[str, float],
        holders: dict[str, float],
    ) -> None:
        """``rest`` GPUs of ``w`` by the blocking level and its holder runs."""
        if block is None or block[0] >= _NEVER:
            causes["other"] = causes.get("other", 0.0) + rest
            return
        level, runs = block
        total = sum(g for _, _, g, _ in runs)
        if total <= 0:
            cause = _LEVEL_CAUSE.get(level, "other")
            causes[cause] = causes.get(cause, 0.0) + rest
            return
        for _, vteam, g, cause in runs:
            causes[cause] = causes.get(cause, 0.0) + rest * g / total
            if vteam != team:
                holders[vteam] = holders.get(vteam, 0.0) + rest * g / total

    def _gated(self, w: Workload) -> frozenset[str]:
        """The nodes the reservation in force keeps ``w`` off (the reservation gate)."""
        held = self.reservation()
        if (
            held is None
            or held.workload == w.id  # the nodes are held for it
            or may_use_reserved(self.t, w.min_runtime_ms, held.start_ms)
        ):
            return frozenset()
        return frozenset(held.nodes)

    def _block(
        self, w: Workload, team: str, pools: list[tuple[str, int]]
    ) -> tuple[str | None, Block | None]:
        """The blocking level of ``w`` and its holder runs, on the cheapest nodes it
        may use (off the reservation); ``"reservation"`` first if, but for the
        reservation, it could be placed now (cached per shape and owner)."""
        key = (
            w.owner,
            w.priority,
            w.gpu_type,
            w.gpus,
            w.min_runtime_ms,
            w.queued_ms,
            self.ledger.episodes.get(w.id),
        )
        got = self._blocks.get(key)
        if got is None:
            gated = self._gated(w)
            best = self._cheapest(w, team, pools, gated)
            reserved: str | None = None
            if gated:
                ungated = self._cheapest(w, team, pools, frozenset())
                if ungated is not None and (best is None or ungated[0] < best[0]):
                    if ungated[0] <= _PLACEABLE:
                        reserved = "reservation"  # it could run now but for the reservation
                    else:
                        best = ungated  # blocked there too: name what blocks it there
            block = None if best is None else (best[0], self._holders(w, team, best))
            got = self._blocks[key] = (reserved, block)
        return got

    def _cheapest(
        self, w: Workload, team: str, pools: list[tuple[str, int]], gated: frozenset[str]
    ) -> tuple[int, list[str], int] | None:
        """The lowest level at which enough nodes (not in ``gated``) clear for ``w``,
        those nodes and the GPUs wanted on each; ``None`` if no pool can hold it."""
        best: tuple[int, list[str], int] | None = None
        free = self.free
        for pool in pools:
            size = pool[1]
            if w.gpus > size and w.gpus % size:
                continue
            want = min(w.gpus, size)
            options = sorted(
                (*self._node_level(w, team, name, want)[:2], name)
                for name in free.pool_nodes[pool]
                if name not in gated
            )
            need = 1 if w.gpus <= size else w.gpus // size
            if len(options) < need:
                continue
            level = max(o[0] for o in options[:need])
            if best is None or level < best[0]:
                best = (level, [o[2] for o in options[:need]], want)
        return best

    def _holders(
        self, w: Workload, team: str, best: tuple[int, list[str], int]
    ) -> list[tuple[str, str, float, str]]:
        """The runs at the blocking level that clearing ``best``'s nodes takes, each
        with the cause it names."""
        level, names, want = best
        out: list[tuple[str, str, float, str]] = []
        running = self.state.running
        for name in names:
            for wid, wlevel, sub, gpus in self._node_level(w, team, name, want)[2]:
                if wlevel == level:
                    if level == _PROTECTED:
                        cause = "contracts" if sub else "admission"
                    else:
                        cause = _LEVEL_CAUSE.get(level, "other")
                    out.append((wid, team_of(running[wid].owner), float(gpus), cause))
        if level == _PROTECTED and any(run[3] == "contracts" for run in out):
            # Fairly placed contracts among the nodes it needs: it would still wait had
            # the scheduler admitted nothing, so the whole part is the contracts' price
            # now. It becomes ``admission`` once the admitted runs alone keep it off.
            out = [(wid, vteam, gpus, "contracts") for wid, vteam, gpus, _ in out]
        return out

    def _admitted(self, v: Workload, w: Workload, team: str) -> bool:
        """Whether running ``v`` (inside its contract) is ``admission`` for ``w``:
        placed while ``w`` was waiting, for a team less under-served than ``w``'s."""
        p = self.ledger.placements.get(v.id)
        return p is not None and team in p.over and self.ledger.was_waiting(w, p)

    def _node_level(
        self, w: Workload, team: str, name: str, want: int
    ) -> tuple[int, int, list[tuple[str, int, int, int]]]:
        """The lowest level at which ``want`` GPUs of node ``name`` come free for ``w``,
        the GPUs of ``contracts`` runs that takes, and the runs it takes (id, level,
        0 for ``admission`` / 1 else, GPUs), lowest first (admission before contracts
        inside level 5: undoing a choice of the scheduler comes before a fair contract)."""
        node = self.state.nodes[name]
        have = self.free.free[name]
        if have >= want:
            return 0, 0, []
        running = self.state.running
        levels = []
        for wid, gpus in node.workloads.items():
            v = running[wid]
            sub = 1
            if not is_allocated(v):
                level = 1
            elif team_of(v.owner) == team:
                level = 6
            elif is_protected(v, self.t):
                level = _PROTECTED
                sub = 0 if self._admitted(v, w, team) else 1
            else:
                rule = (
                    self.outranking
                    if held_to_margin(self.state.policy, w, self.t)
                    else self.outranking_waited
                )
                level = _STANDING_LEVEL[rule.standing(w, v)]
            levels.append((level, sub, gpus, wid))
        taken: list[tuple[str, int, int, int]] = []
        held = 0
        for level, sub, gpus, wid in sorted(levels):
            have += gpus
            taken.append((wid, level, sub, gpus))
            if level == _PROTECTED and sub:
                held += gpus
            if have >= want:
                return level, held, taken
        return _NEVER, held, taken


Figures = tuple[float, float, dict[str, float], dict[str, float]]
"""A team at one moment: owed GPUs, ran GPUs, its shortfall's GPUs by cause, by holder team."""


def refold(state: State, ledger: Ledger, item: HistoryItem, index: int) -> None:
    """Fold ``item`` (number ``index`` of its history) into ``state``, noting in
    ``ledger`` what the diagnosis needs (placements before a batch folds, queue
    episodes after)."""
    if isinstance(item, BatchItem):
        record_placements(state, item, index, ledger)
    fold_item(state, item)
    record_episodes(state, item, index, ledger)


def diagnose(items: Iterable[HistoryItem], start_ms: int | None = None) -> Diagnosis:
    """Refold ``items`` and attribute every team's shortfall to causes (module docstring)."""
    state = State()
    ledger = Ledger()
    diag: Diagnosis | None = None
    pending_moment: tuple[int, dict[str, Figures]] | None = None

    def hold_until(diag: Diagnosis, end: int) -> None:
        """The teams' figures of the last batch held from its time until ``end``."""
        if pending_moment is not None:
            at, teams = pending_moment
            for team, (owed, ran, split, holders) in teams.items():
                diag.add(team, at, end, owed, ran, split, holders)

    for index, item in enumerate(items):
        refold(state, ledger, item, index)
        if not isinstance(item, BatchItem):
            continue
        if diag is None:
            diag = Diagnosis(start_ms=state.now_ms if start_ms is None else start_ms, end_ms=0)
        hold_until(diag, state.now_ms)
        pending_moment = (state.now_ms, _teams_now(state, ledger))
    if diag is None:
        return Diagnosis(start_ms=0, end_ms=0)
    hold_until(diag, state.now_ms)
    diag.end_ms = state.now_ms
    return diag


def _allocated(state: State) -> tuple[int, dict[str, int], dict[str, int]]:
    """Healthy GPUs, and per team the GPUs of its allocated workloads (pending or
    running) and of its running ones."""
    healthy = sum(n.gpus for n in state.nodes.values() if n.health == "healthy")
    demand: dict[str, int] = {}
    ran: dict[str, int] = {}
    for w in state.workloads.values():
        if is_allocated(w):
            team = team_of(w.owner)
            demand[team] = demand.get(team, 0) + w.gpus
            if w.status == "running":
                ran[team] = ran.get(team, 0) + w.gpus
    return healthy, demand, ran


def _owed(
    state: State, healthy: int, demand: dict[str, int], ran: dict[str, int]
) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """Per team of ``state``'s budget tree: (owed, ran) GPUs, and the shortfalls."""
    figures: dict[str, tuple[float, float]] = {}
    left: dict[str, float] = {}
    tree = state.budget
    for leaf in tree.leaves():
        team = team_of(leaf)
        if team in figures:
            continue
        share = float(tree.global_share(team)) * healthy
        owed = min(share, float(demand.get(team, 0)))
        got = float(ran.get(team, 0))
        figures[team] = (owed, got)
        short = owed - min(got, owed)
        if short > 0:
            left[team] = short
    return figures, left


def _teams_now(
    state: State,
    ledger: Ledger | None = None,
    moment: Callable[[], _Moment] | None = None,
    allocated: tuple[int, dict[str, int], dict[str, int]] | None = None,
) -> dict[str, Figures]:
    """Per team: owed and ran GPUs now, and its shortfall split by cause (GPUs) with
    holders: the teams' pending allocated workloads in scheduling order, each
    explaining at most its own GPUs of its team's shortfall. ``moment``: the
    state's :class:`_Moment` (made here if not given); ``allocated``: the state's
    :func:`_allocated` (computed here if not given)."""
    figures, left = _owed(state, *(allocated or _allocated(state)))
    splits: dict[str, dict[str, float]] = {t: {} for t in left}
    holders: dict[str, dict[str, float]] = {t: {} for t in left}
    if left:
        make = moment or (lambda: _Moment(state, ledger or Ledger()))
        _split_over(left, [("", state, make)], splits, holders, {t: {} for t in left})
    return {
        team: (owed, got, splits.get(team, {}), holders.get(team, {}))
        for team, (owed, got) in figures.items()
    }


def _split_over(
    left: dict[str, float],
    clusters: list[tuple[str, State, Callable[[], _Moment]]],
    splits: dict[str, dict[str, float]],
    holders: dict[str, dict[str, float]],
    where: dict[str, dict[str, float]],
) -> None:
    """Split each team's shortfall ``left`` over its pending allocated workloads on
    ``clusters`` (name, state, its moment), in the team's order: its first on the
    first cluster, its first on the second, ..., its second on the first, ...
    (each cluster's in its scheduling order), each at most its own GPUs until the
    shortfall is used up (module docstring, "Several clusters"; with one cluster,
    scheduling order). Each part is then explained on its own cluster, every
    cluster's parts in its scheduling order (the order its idle GPUs are taken
    in). Adds to ``splits``, ``holders`` and ``where`` (GPUs by cluster)."""
    walked: list[tuple[str, _Moment, list[Workload]]] = []
    for name, state, make in clusters:
        waiting: dict[str, int] = {}  # short teams' pending allocated workloads not walked yet
        for leaf, keys in state.pending_index.by_leaf.items():
            team = team_of(leaf)
            if keys and left.get(team, 0.0) > 0:
                waiting[team] = waiting.get(team, 0) + len(keys)
        if not waiting:
            continue
        moment = make()
        seen: dict[str, float] = {}  # GPUs walked per short team: no team takes more than ``left``
        order: list[Workload] = []
        walk = FairShareWalk(state, moment.view)
        while any(n > 0 and seen.get(t, 0.0) < left[t] for t, n in waiting.items()):
            w = next(walk, None)
            if w is None:
                break
            team = team_of(w.owner)
            if team not in waiting:
                continue
            waiting[team] -= 1
            if seen.get(team, 0.0) < left[team]:
                seen[team] = seen.get(team, 0.0) + w.gpus
                order.append(w)
        walked.append((name, moment, order))
    # each team's parts: the clusters take turns, one of its workloads each
    queues: dict[str, list[list[Workload]]] = {t: [] for t in left}
    for _, _, order in walked:
        mine: dict[str, list[Workload]] = {}
        for w in order:
            mine.setdefault(team_of(w.owner), []).append(w)
        for team, per_cluster in queues.items():
            per_cluster.append(mine.get(team, []))
    parts: dict[int, float] = {}  # by id(): a workload id may repeat on two clusters
    for team, per in queues.items():
        rest = left[team]
        turn = 0
        while rest > 0 and any(turn < len(ws) for ws in per):
            for ws in per:
                if turn < len(ws) and rest > 0:
                    part = min(float(ws[turn].gpus), rest)
                    parts[id(ws[turn])] = part
                    rest -= part
            turn += 1
        left[team] = rest
    for name, moment, order in walked:
        for w in order:
            part = parts.get(id(w), 0.0)
            if part <= 0:
                continue
            team = team_of(w.owner)
            causes, held = moment.explain(w, team, part)
            split, hold = splits[team], holders[team]
            for c, v in causes.items():
                split[c] = split.get(c, 0.0) + v
            for who, v in held.items():
                hold[who] = hold.get(who, 0.0) + v
            where[team][name] = where[team].get(name, 0.0) + part
    for team, rest in left.items():
        if rest > 0:  # no pending work left to explain it (cannot happen: owed <= demand)
            splits[team]["other"] = splits[team].get("other", 0.0) + rest


@dataclass
class TreeDiagnosis:
    """A federated run's diagnosis: the whole tree's, and each cluster's own."""

    tree: Diagnosis
    clusters: dict[str, Diagnosis]
    """Each cluster's own diagnosis, by name (empty when not asked for)."""
    labels: dict[str, str] = field(default_factory=dict)
    """Each cluster's history by name, as the caller named it (a file)."""


class _ClusterFold:
    """One cluster's history refolded a segment at a time: the inputs up to and
    including the next decision batch."""

    def __init__(self, label: str, items: Iterable[HistoryItem]) -> None:
        self.label = label
        self.items = iter(items)
        self.state = State()
        self.ledger = Ledger()
        self.index = 0
        self.segment: list[HistoryItem] = []
        self.time: int | None = None
        """When the next segment's batch is decided (``None``: no batch left)."""
        self.tail: list[HistoryItem] = []
        """Inputs after the last batch."""
        self._moment: _Moment | None = None
        self._allocated: tuple[int, dict[str, int], dict[str, int]] | None = None
        self.own: tuple[int, dict[str, Figures]] | None = None
        """The cluster's own figures at its last batch (per-cluster diagnosis)."""
        self._read()
        self.name = self._named()

    def _read(self) -> None:
        """Read the next segment and the time its batch is decided (the fold's clock:
        the latest input time so far, as the fold sets it; nothing is folded)."""
        seg: list[HistoryItem] = []
        t = self.state.now_ms
        for item in self.items:
            seg.append(item)
            if isinstance(item, BatchItem):
                self.segment, self.time = seg, t
                return
            at = item.event.at_ms if item.event is not None else item.at_ms
            t = max(t, at)
        self.segment, self.time, self.tail = [], None, seg

    def _named(self) -> str:
        """The cluster's name, from the policy its first segment sets."""
        name = ""
        for item in self.segment or self.tail:
            event = item.event if isinstance(item, InputItem) else None
            if isinstance(event, PolicySet) and isinstance(event.cluster, str):
                name = event.cluster
        if not name:
            raise ValueError(
                f"{self.label}: its policy names no cluster: not a cluster of a federated run"
            )
        return name

    def advance(self) -> None:
        """Fold the next segment (its inputs and its batch)."""
        for item in self.segment:
            refold(self.state, self.ledger, item, self.index)
            self.index += 1
        self._moment = self._allocated = None
        self._read()

    def finish(self) -> None:
        """Fold the inputs after the last batch (they move the clock to the end)."""
        for item in self.tail:
            refold(self.state, self.ledger, item, self.index)
            self.index += 1
        self.tail = []

    def allocated(self) -> tuple[int, dict[str, int], dict[str, int]]:
        """:func:`_allocated` of the state (computed once per state)."""
        if self._allocated is None:
            self._allocated = _allocated(self.state)
        return self._allocated

    def moment(self) -> _Moment:
        """The state's :class:`_Moment` (made once per state), with every idle GPU
        free to explain again."""
        if self._moment is None:
            self._moment = _Moment(self.state, self.ledger)
        else:
            self._moment.idle = _Idle(self._moment.free)
        return self._moment


def _check_peers(folds: list[_ClusterFold]) -> None:
    """The histories are the clusters of one federated run: one each, and each
    counts every other as a peer."""
    seen: dict[str, str] = {}
    for f in folds:
        if f.name in seen:
            raise ValueError(f"{f.label}: cluster {f.name!r} again (also {seen[f.name]})")
        seen[f.name] = f.label
    for f in folds:
        policy = f.state.policy
        peers = () if isinstance(policy.peers, UnsetType) else policy.peers
        for other in folds:
            if other is not f and other.name not in peers:
                raise ValueError(
                    f"{f.label}: cluster {f.name!r} does not count {other.name!r} as a peer: "
                    "not the clusters of one federated run"
                )


def _tree_now(folds: list[_ClusterFold]) -> dict[str, tuple[Figures, dict[str, float]]]:
    """Per team, over the whole tree now (``folds``: the clusters that have begun): owed (its global share of every cluster's
    healthy GPUs, capped by its allocated demand on all of them), ran (on all of
    them), its shortfall split by cause with holders (:func:`_split_over`), and
    where (GPUs by cluster)."""
    healthy = 0
    demand: dict[str, int] = {}
    ran: dict[str, int] = {}
    for f in folds:
        h, d, r = f.allocated()
        healthy += h
        for team, g in d.items():
            demand[team] = demand.get(team, 0) + g
        for team, g in r.items():
            ran[team] = ran.get(team, 0) + g
    figures, left = _owed(folds[0].state, healthy, demand, ran)  # the first's tree: one tree
    splits: dict[str, dict[str, float]] = {t: {} for t in left}
    holders: dict[str, dict[str, float]] = {t: {} for t in left}
    where: dict[str, dict[str, float]] = {t: {} for t in left}
    if left:
        _split_over(left, [(f.name, f.state, f.moment) for f in folds], splits, holders, where)
    return {
        team: ((owed, got, splits.get(team, {}), holders.get(team, {})), where.get(team, {}))
        for team, (owed, got) in figures.items()
    }


def diagnose_federation(
    histories: Iterable[tuple[str, Iterable[HistoryItem]]],
    start_ms: int | None = None,
    per_cluster: bool = True,
) -> TreeDiagnosis:
    """Refold the histories of a federated run's clusters (each ``(label, items)``,
    the label naming it in errors) in lockstep on event time and diagnose the
    whole tree, and each cluster on its own if ``per_cluster`` (module docstring,
    "Several clusters")."""
    folds = [_ClusterFold(label, items) for label, items in histories]
    if not folds:
        raise ValueError("no cluster history to diagnose")
    folds.sort(key=lambda f: f.name)
    labels = {f.name: f.label for f in folds}
    names = tuple(f.name for f in folds)
    tree: Diagnosis | None = None
    own: dict[str, Diagnosis] = {}
    held: tuple[int, dict[str, tuple[Figures, dict[str, float]]]] | None = None
    checked = False

    def hold_tree(end: int) -> None:
        if held is not None and tree is not None:
            at, teams = held
            for team, ((owed, got, split, holders), where) in teams.items():
                tree.add(team, at, end, owed, got, split, holders, where)

    def hold_own(f: _ClusterFold, end: int) -> None:
        if f.own is not None:
            at, teams = f.own
            for team, (owed, got, split, holders) in teams.items():
                own[f.name].add(team, at, end, owed, got, split, holders)

    while True:
        times = [f.time for f in folds if f.time is not None]
        if not times:
            break
        t = min(times)
        moved = []
        for f in folds:
            while f.time is not None and f.time <= t:
                f.advance()
                if f not in moved:
                    moved.append(f)
        if not checked and all(f.index for f in folds):
            _check_peers(folds)  # once every cluster folded its policy
            checked = True
        if tree is None:
            first = t if start_ms is None else start_ms
            tree = Diagnosis(start_ms=first, end_ms=0, clusters=names)
            if per_cluster:
                own = {name: Diagnosis(start_ms=first, end_ms=0) for name in names}
        hold_tree(t)
        held = (t, _tree_now([f for f in folds if f.index]))
        if per_cluster:
            for f in moved:
                hold_own(f, f.state.now_ms)
                f.own = (
                    f.state.now_ms,
                    _teams_now(f.state, f.ledger, f.moment, f.allocated()),
                )
    for f in folds:
        f.finish()
    if not checked:
        _check_peers(folds)
    if tree is None:
        return TreeDiagnosis(Diagnosis(0, 0, clusters=names), {}, labels)
    end = max(f.state.now_ms for f in folds)
    hold_tree(end)
    tree.end_ms = end
    for f in folds:
        if per_cluster:
            hold_own(f, f.state.now_ms)
            own[f.name].end_ms = f.state.now_ms
    return TreeDiagnosis(tree, own, labels)


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
