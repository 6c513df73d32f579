"""Allocation usage over time: hour by hour, what each team and user was owed and got.

The definitions are the KPIs' (``replay/kpi.py``, docs/formats.md "KPI keys"),
applied to the live history the gateway follows instead of a projection:

- **healthy GPU-time** of an hour: GPUs x time each node is ``healthy``
  (draining and down time is not available);
- **demand** of a budget node in an hour: GPU-time of its allocated
  (``min_runtime > 0``) workloads between their accepted submission and their
  end, pending or running;
- **used**: GPU-time of its allocated runs in the hour (placement to end);
- **free**: GPU-time of its unallocated (``min_runtime == 0``) runs in the hour
  (charged to nobody; ``apportion report`` shows it beside the used time);
- **owed** = min(global share x healthy GPU-time of the hour, demand);
- **delivered** = min(used, owed) (:func:`owed_delivered`).

A team is the budget node one level above the leaves (a leaf directly under the
root is its own team, :func:`~apportion.core.rules.classes.team_of`); a user is a leaf.
A team's demand and use are its leaves' summed (leaves since removed included,
as the KPIs count them), its owed is capped by that sum. Shares are the current
budget tree's (as the KPIs take the budget table).

:class:`UsageHistory` keeps this incrementally from the canonical history, in
exact integer GPU-milliseconds: four piecewise-constant rates (healthy GPUs;
per leaf, GPUs demanded, GPUs running allocated work and GPUs running
unallocated work), each credited to
hour buckets (UTC hours, ``epoch_ms // HOUR_MS``) when it changes. Only the
lookback window's hours are kept (the policy's ``lookback``, 7 days by
default; ``keep_ms`` keeps more, as the offline ``apportion report`` does);
older ones are dropped. An input counts only once the cycle after it
has said whether the fold refused it (its ``InputRejected``): inputs are held
until the next decision batch (every part of it), then applied at their own
times, so a refused submission or cancel never moves a line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

from apportion.core.budget import ROOT, BudgetTree
from apportion.core.rules.classes import team_of
from apportion.core.rules.contract import is_allocated
from apportion.schemas.events import (
    DAY_MS,
    HOUR_MS,
    InputRejected,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadSubmitted,
)
from apportion.schemas.history import BatchItem, HistoryItem, InputItem

DEFAULT_WINDOW_MS = 7 * DAY_MS


def owed_delivered(
    share_gpu_ms: Fraction | float, demand_gpu_ms: int | float, used_gpu_ms: int | float
) -> tuple[Fraction | float, Fraction | float]:
    """One node in one hour: ``(owed, delivered)`` with owed = min(share of the
    healthy GPU-time, demand) and delivered = min(used, owed) (the KPIs' rule:
    ``replay.kpi.TeamHour.owed_ms`` and ``delivery_kpis``)."""
    owed = min(share_gpu_ms, demand_gpu_ms)
    return owed, min(used_gpu_ms, owed)


def _ran(w: _Live) -> str:
    """The rate a run of ``w`` counts in: ``used`` (allocated) or ``free``."""
    return "used" if w.allocated else "free"


def hours_in(window_ms: int) -> int:
    """How many hours a window covers (a partial hour counts)."""
    return max(1, -(-window_ms // HOUR_MS))


class _Hour:
    __slots__ = ("healthy", "demand", "used", "free")

    def __init__(self) -> None:
        self.healthy = 0
        self.demand: dict[str, int] = {}
        self.used: dict[str, int] = {}
        self.free: dict[str, int] = {}


class _Live:
    __slots__ = ("leaf", "gpus", "allocated", "running")

    def __init__(self, leaf: str, gpus: int, allocated: bool) -> None:
        self.leaf = leaf
        self.gpus = gpus
        self.allocated = allocated
        self.running = False


class UsageHistory:
    """Hourly healthy, demanded and used GPU-time, kept from the canonical history.

    Feed it every item in canonical order with :meth:`record` (the gateway's
    ``TimelineHistory`` does); read it with :meth:`hourly` or
    :func:`usage_over_time`. It folds nothing and needs no state: it follows the
    events the fold accepted (see the module doc)."""

    def __init__(self, window_ms: int = DEFAULT_WINDOW_MS, keep_ms: int | None = None) -> None:
        self.window_ms = window_ms
        """The lookback: hours older than it are dropped (a ``PolicySet`` changes it)."""
        self.keep_ms = keep_ms
        """When set, hours are kept this long instead of the lookback (whatever the policy)."""
        self.clock = 0
        """Time of the last input applied (the fold's clock: it never goes back)."""
        self.first_ms: int | None = None
        """Time of the first input applied: where the data starts (``None``: none yet)."""
        self.hours: dict[int, _Hour] = {}
        """Hour index (``epoch_ms // HOUR_MS``) -> GPU-ms credited to it so far."""
        self.nodes: dict[str, tuple[int, bool]] = {}
        """Node -> (GPUs, healthy)."""
        self.live: dict[str, _Live] = {}
        """Live (pending or running) workloads the fold accepted."""
        self.healthy = [0, 0]
        """``[healthy GPUs, since ms]``: the rate not yet credited."""
        self.demand: dict[str, list[int]] = {}
        """Leaf -> ``[GPUs demanded, since ms]``."""
        self.used: dict[str, list[int]] = {}
        """Leaf -> ``[GPUs of allocated runs, since ms]``."""
        self.free: dict[str, list[int]] = {}
        """Leaf -> ``[GPUs of unallocated runs, since ms]``."""
        self._held: list[InputItem] = []
        self._held_decisions: list[Any] = []
        self._refused: Counter[str] = Counter()
        self._pruned_hour = 0

    # -- feeding -------------------------------------------------------------
    def record(self, items: Iterable[HistoryItem]) -> None:
        """Take ``items`` (the next ones of the canonical history, folded or not)."""
        for item in items:
            if isinstance(item, InputItem):
                self._held.append(item)
                continue
            self._batch(item)

    def _batch(self, item: BatchItem) -> None:
        batch = item.batch
        for d in batch.decisions:
            if isinstance(d, InputRejected):
                self._refused[d.ref] += 1
            else:
                self._held_decisions.append(d)
        if batch.continued:
            return  # the cycle's next part may still refuse one of the held inputs
        self._apply_inputs()
        decisions, self._held_decisions = self._held_decisions, []
        for d in decisions:
            self._decision(d)
        self._prune()

    def _apply_inputs(self) -> None:
        held, self._held = self._held, []
        refused, self._refused = self._refused, Counter()
        # an id used twice: the later input is the one refused (a repeat, a duplicate)
        left = Counter(i.ref for i in held if i.ref in refused) if refused else Counter()
        for item in held:
            e = item.event
            t = e.at_ms if e is not None else item.at_ms
            if t > self.clock:
                self.clock = t
            if self.first_ms is None:
                self.first_ms = t
            if refused and item.ref in refused:
                left[item.ref] -= 1
                if left[item.ref] < refused[item.ref]:
                    continue
            if e is not None:
                self._input(e)

    def _input(self, e: Any) -> None:
        now = self.clock
        if isinstance(e, WorkloadSubmitted):
            if e.workload in self.live:
                return
            w = self.live[e.workload] = _Live(e.owner, e.gpus, is_allocated(e))
            if w.allocated:
                self._change("demand", w.leaf, w.gpus, now)
        elif isinstance(e, WorkloadCancelled | WorkloadFinished):
            gone = self.live.pop(e.workload, None)
            if gone is not None:
                self._end(gone, now)
        elif isinstance(e, NodeRegistered):
            gpus, healthy = self.nodes.get(e.node, (0, True))
            if healthy:
                self._change_healthy(e.gpus - gpus, now)
            self.nodes[e.node] = (e.gpus, healthy)
        elif isinstance(e, NodeHealthChanged):
            known = self.nodes.get(e.node)
            if known is None:
                return
            gpus, was = known
            healthy = e.state == "healthy"
            if healthy != was:
                self._change_healthy(gpus if healthy else -gpus, now)
            self.nodes[e.node] = (gpus, healthy)
        elif isinstance(e, PolicySet):
            self.window_ms = e.lookback_ms

    def _decision(self, d: Any) -> None:
        now = self.clock
        if isinstance(d, WorkloadPlaced):
            w = self.live.get(d.workload)
            if w is not None and not w.running:
                w.running = True
                self._change(_ran(w), w.leaf, w.gpus, now)
        elif isinstance(d, WorkloadPreempted):
            w = self.live.get(d.workload)
            if w is None:
                return
            if d.requeued:
                if w.running:
                    self._change(_ran(w), w.leaf, -w.gpus, now)
                w.running = False
            else:
                del self.live[d.workload]
                self._end(w, now)

    def _end(self, w: _Live, now: int) -> None:
        if w.running:
            self._change(_ran(w), w.leaf, -w.gpus, now)
        if w.allocated:
            self._change("demand", w.leaf, -w.gpus, now)

    # -- rates and hour buckets ------------------------------------------------
    def _change(self, kind: str, leaf: str, delta: int, now: int) -> None:
        """Leaf ``leaf``'s ``kind`` rate (``demand``, ``used`` or ``free``) changes by
        ``delta`` GPUs at ``now``: what it was is credited up to ``now`` first."""
        table: dict[str, list[int]] = getattr(self, kind)
        rate = table.get(leaf)
        if rate is None:
            table[leaf] = [delta, now]
            return
        self._credit(kind, leaf, rate[0], rate[1], now)
        rate[0] += delta
        rate[1] = now

    def _change_healthy(self, delta: int, now: int) -> None:
        if delta == 0:
            return
        self._credit(None, "", self.healthy[0], self.healthy[1], now)
        self.healthy[0] += delta
        self.healthy[1] = now

    def _credit(self, kind: str | None, leaf: str, rate: int, t0: int, t1: int) -> None:
        """Add ``rate`` GPUs over ``[t0, t1)`` to the hours (``kind``: ``demand``,
        ``used`` or ``free`` of ``leaf``; ``None`` for healthy capacity)."""
        if rate == 0:
            return
        t0 = max(t0, self._oldest_ms(t1))
        hours = self.hours
        for h, ms in _spread(t0, t1):
            bucket = hours.get(h)
            if bucket is None:
                bucket = hours[h] = _Hour()
            if kind is None:
                bucket.healthy += rate * ms
            else:
                table: dict[str, int] = getattr(bucket, kind)
                table[leaf] = table.get(leaf, 0) + rate * ms

    def _oldest_ms(self, now: int) -> int:
        """Start of the oldest hour kept at ``now``."""
        kept = self.window_ms if self.keep_ms is None else self.keep_ms
        return (now // HOUR_MS - hours_in(kept)) * HOUR_MS

    def _prune(self) -> None:
        oldest = self._oldest_ms(self.clock) // HOUR_MS
        if oldest <= self._pruned_hour:
            return
        self._pruned_hour = oldest
        for h in [h for h in self.hours if h < oldest]:
            del self.hours[h]
        # (a rate open since before the window is clipped to it when credited)
        for table in (self.demand, self.used, self.free):
            for leaf in [leaf for leaf, (r, _) in table.items() if r == 0]:
                del table[leaf]  # an idle leaf holds no memory

    # -- reading ---------------------------------------------------------------
    def hours_of_data(self, now_ms: int) -> int:
        """How many hours, up to the one holding ``now_ms``, hold data (at least 1,
        at most the lookback window's): a new cluster's charts span only these."""
        most = hours_in(self.window_ms)
        if self.first_ms is None:
            return 1
        now_ms = max(now_ms, self.clock)
        last = now_ms // HOUR_MS if now_ms % HOUR_MS else now_ms // HOUR_MS - 1
        return max(1, min(most, last - self.first_ms // HOUR_MS + 1))

    def kept_from_ms(self) -> int | None:
        """Start of the first whole hour held (``None``: no data yet): the hour of the
        first input, or the oldest hour not dropped, whichever is later."""
        if self.first_ms is None:
            return None
        return max(self.first_ms // HOUR_MS * HOUR_MS, self._oldest_ms(self.clock))

    def hourly(
        self, now_ms: int, hours: int | None = None, *, last_hour: int | None = None
    ) -> Hourly:
        """The last ``hours`` hours (default: the lookback window's) up to the one
        holding ``now_ms`` (or up to hour index ``last_hour``), the open rates credited
        up to ``now_ms``. Changes nothing."""
        now_ms = max(now_ms, self.clock)
        n = hours if hours is not None else hours_in(self.window_ms)
        last = now_ms // HOUR_MS if now_ms % HOUR_MS else now_ms // HOUR_MS - 1
        if last_hour is not None:
            last = last_hour
        first = last - n + 1
        index = {h: i for i, h in enumerate(range(first, last + 1))}
        healthy = [0] * n
        demand: dict[str, list[int]] = {}
        used: dict[str, list[int]] = {}
        free: dict[str, list[int]] = {}
        for h, bucket in self.hours.items():
            i = index.get(h)
            if i is None:
                continue
            healthy[i] += bucket.healthy
            for table, out in ((bucket.demand, demand), (bucket.used, used), (bucket.free, free)):
                for leaf, ms in table.items():
                    out.setdefault(leaf, [0] * n)[i] += ms
        start = first * HOUR_MS

        def add_open(row: list[int], rate: int, since: int) -> None:
            for h, ms in _spread(max(since, start), now_ms):
                i = index.get(h)
                if i is not None:
                    row[i] += rate * ms

        add_open(healthy, self.healthy[0], self.healthy[1])
        for rates, out in ((self.demand, demand), (self.used, used), (self.free, free)):
            for leaf, (rate, since) in rates.items():
                if rate:
                    add_open(out.setdefault(leaf, [0] * n), rate, since)
        return Hourly(start, n, now_ms, healthy, demand, used, free)


class Hourly:
    """GPU-ms per hour of ``n`` hours from ``start_ms``: healthy capacity, and per
    leaf demand, use and free (unallocated) use (exact integers; the last hour
    runs to ``now_ms``)."""

    __slots__ = ("start_ms", "n", "now_ms", "healthy", "demand", "used", "free")

    def __init__(
        self,
        start_ms: int,
        n: int,
        now_ms: int,
        healthy: list[int],
        demand: dict[str, list[int]],
        used: dict[str, list[int]],
        free: dict[str, list[int]] | None = None,
    ) -> None:
        self.start_ms = start_ms
        self.n = n
        self.now_ms = now_ms
        self.healthy = healthy
        self.demand = demand
        self.used = used
        self.free = free if free is not None else {}

    def summed(self, leaves: Iterable[str]) -> tuple[list[int], list[int]]:
        """Demand and use of ``leaves`` together, per hour."""
        return self.summed_of(leaves, self.demand), self.summed_of(leaves, self.used)

    def summed_of(self, leaves: Iterable[str], table: dict[str, list[int]]) -> list[int]:
        """``table``'s rows (:attr:`demand`, :attr:`used` or :attr:`free`) of ``leaves``
        added up, per hour."""
        row = [0] * self.n
        for leaf in leaves:
            got = table.get(leaf)
            if got is not None:
                for i, ms in enumerate(got):
                    row[i] += ms
        return row

    def node(self, path: str, share: Fraction, leaves: Iterable[str]) -> dict[str, Any]:
        """One budget node (``share``: its global share) over the hours: per hour and
        in total, share, demand, owed, used and delivered GPU-ms, and the delivery ratio."""
        demand, used = self.summed(leaves)
        rows = []
        tot_owed: Fraction | float = Fraction(0)
        tot_delivered: Fraction | float = Fraction(0)
        for i in range(self.n):
            share_ms = share * self.healthy[i]
            owed, delivered = owed_delivered(share_ms, demand[i], used[i])
            tot_owed += owed
            tot_delivered += delivered
            rows.append(
                {
                    "start_ms": self.start_ms + i * HOUR_MS,
                    "share_gpu_ms": _num(share_ms),
                    "demand_gpu_ms": demand[i],
                    "owed_gpu_ms": _num(owed),
                    "used_gpu_ms": used[i],
                    "delivered_gpu_ms": _num(delivered),
                }
            )
        return {
            "path": path,
            "global_share": float(share),
            "owed_gpu_h": float(tot_owed) / HOUR_MS,
            "delivered_gpu_h": float(tot_delivered) / HOUR_MS,
            "used_gpu_h": sum(used) / HOUR_MS,
            "demand_gpu_h": sum(demand) / HOUR_MS,
            "delivery_ratio": float(Fraction(tot_delivered) / Fraction(tot_owed))
            if tot_owed
            else None,
            "hours": rows,
        }


def _num(x: Fraction | float | int) -> float | int:
    """An exact integer stays one; a fraction becomes a float."""
    if isinstance(x, Fraction) and x.denominator == 1:
        return x.numerator
    return x if isinstance(x, int) else float(x)


def _spread(t0: int, t1: int) -> Iterable[tuple[int, int]]:
    """``(hour index, ms of [t0, t1) in it)`` for each hour ``[t0, t1)`` touches."""
    if t1 <= t0:
        return
    h = t0 // HOUR_MS
    while True:
        end = (h + 1) * HOUR_MS
        if t1 <= end:
            yield h, t1 - max(t0, h * HOUR_MS)
            return
        yield h, end - max(t0, h * HOUR_MS)
        h += 1


def teams_of(tree: BudgetTree) -> dict[str, list[str]]:
    """Each team of the current tree -> its current leaves (users), sorted."""
    out: dict[str, list[str]] = {}
    for leaf in sorted(tree.leaves()):
        if leaf != ROOT:
            out.setdefault(team_of(leaf), []).append(leaf)
    return dict(sorted(out.items()))


def usage_over_time(
    usage: UsageHistory,
    tree: BudgetTree,
    now_ms: int,
    *,
    team: str | None = None,
    hours: int | None = None,
) -> dict[str, Any]:
    """Owed, delivered and used per hour for every team of ``tree`` (or only
    ``team``) and each of its users, over the last ``hours`` (default: the
    lookback window). Raises ``KeyError`` for a ``team`` that is not one."""
    hourly = usage.hourly(now_ms, hours)
    teams = teams_of(tree)
    if team is not None:
        if team not in teams:
            raise KeyError(team)
        teams = {team: teams[team]}
    tracked = set(hourly.demand) | set(hourly.used)
    out = []
    for t, users in teams.items():
        members = sorted({*users, *(leaf for leaf in tracked if team_of(leaf) == t)})
        row = hourly.node(t, tree.global_share(t), members)
        row["users"] = (
            []
            if users == [t]  # a leaf under the root is its own team
            else [hourly.node(u, tree.global_share(u), [u]) for u in users]
        )
        out.append(row)
    return {
        "now_ms": hourly.now_ms,
        "hour_ms": HOUR_MS,
        "start_ms": hourly.start_ms,
        "hours": hourly.n,
        "healthy_gpu_ms": hourly.healthy,
        "teams": out,
    }
