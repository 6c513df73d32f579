"""Synthetic scenarios, deterministic from a seed (``random.Random(seed)``; never in core/).

``ai2``
    1,024 H100 GPUs (128 nodes x 8); 4 programs with unequal weights over 15
    teams; about 150 users, the leaves. Each team and week is busy, normal or
    quiet (:data:`ACTIVITY`): the team submits allocated work at 1.25, 1.0 or
    0.6 times ``load`` times its global share of the cluster, and
    zero-min-runtime work at 1.6, 0.7 or 0.25 times ``unallocated_load`` times
    its share: budgets are what a team is funded for, so a busy team's extra
    demand goes to free, preemptible work (as at Ai2, where 18% of GPU time
    ran unallocated). Classes:

    - long multi-node training: 64-256 GPUs, never more than ``size_factor``
      (1.5) times the team's share (teams too small for a 64-GPU gang train on
      32 GPUs; ``flagship=True`` adds 512-GPU runs for the largest team),
      3 h to 3 days, min runtime 2-8 h, resumable;
    - mid-size jobs: 8-32 GPUs, 30 min to 12 h, min runtime 30 min-2 h;
    - many debug jobs: 1-8 GPUs, 2-20 min, min runtime 5-15 min, not
      resumable, mostly in working hours;
    - zero-min-runtime sweeps: 16 or 32 GPUs, 1-8 h, free and preemptible.

    A backlog of ``backlog`` cluster-days of training and mid-size work is
    submitted at time 0; ``apportion simulate`` runs two warm-up days before
    the measured ones. About 1.5% of hosts a day degrade: they drain and come
    back healthy after a repair of 6-16 h; one in ten goes down instead and is
    back after 2-6 h. Total demand (allocated and free) is 2-3x capacity.

    Legacy columns for the baseline: training and mid-size jobs ``normal``
    (15% of training claims ``high``), debug ``high``, zero-min-runtime work
    and a third of mid-size jobs ``low`` and ``legacy_preemptible``.

``debug``
    Hand-built: 16 nodes x 8 GPUs; team ``train`` (weight 3, users ``ana``,
    ``ben``) keeps the cluster full with 64-GPU, 2-day training jobs (min
    runtime 8 h); team ``dev`` (weight 1, users ``cy``, ``di``, ``ed``) submits
    a 1-4 GPU debug job (5 min, min runtime 10 min) every 10 minutes of the
    working day. The seed only jitters submit times.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, TypeVar

import msgspec
from apportion.schemas.events import DAY_MS, HOUR_MS, MINUTE_MS, LegacyPriority

from .trace import HealthRow, NumberedRows, TraceRow

if TYPE_CHECKING:
    from .family import Knobs

T = TypeVar("T")


class Scenario(msgspec.Struct, kw_only=True):
    name: str
    pools: list[tuple[str, int, int, str]]
    """``(prefix, count, gpus_per_node, gpu_type)``"""
    budget: list[tuple[str, int, str]]
    """``(path, weight, owner)``, root first, parents before children."""
    trace: list[TraceRow]
    health: list[HealthRow]
    days: int
    seed: int
    policy: dict[str, object] = msgspec.field(
        default_factory=lambda: {
            "lookback": "7d",
            "max_min_runtime": "8h",
            "preemption_margin": 0,
        }
    )
    clusters: list[tuple[str, list[tuple[str, int, int, str, int]]]] = msgspec.field(
        default_factory=list
    )
    """The same nodes as several clusters sharing the tree, ``(name, [(prefix,
    count, gpus_per_node, gpu_type, first index)])``; ``[]``: one cluster."""


AI2_PROGRAMS: list[tuple[str, int, list[tuple[str, int]]]] = [
    ("llm", 40, [("pretrain", 6), ("posttrain", 4), ("data", 2), ("eval", 1), ("safety", 1)]),
    ("mm", 25, [("vision", 3), ("video", 2), ("speech", 2), ("robotics", 1)]),
    ("science", 20, [("climate", 2), ("bio", 2), ("materials", 1)]),
    ("agents", 15, [("code", 2), ("web", 1), ("reasoning", 2)]),
]


def _budget_shares(budget: list[tuple[str, int, str]]) -> dict[str, Fraction]:
    children: dict[str, list[tuple[str, int]]] = {}
    for path, weight, _ in budget[1:]:
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        children.setdefault(parent, []).append((path, weight))
    share: dict[str, Fraction] = {"": Fraction(1)}
    for path, _weight, _ in budget[1:]:
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        total = sum(w for _, w in children[parent])
        share[path] = share[parent] * Fraction(dict(children[parent])[path], total)
    return share


def _pick(rng: random.Random, items: Sequence[T], weights: Sequence[float]) -> T:
    return rng.choices(items, weights=weights, k=1)[0]


def _lognormal_ms(rng: random.Random, median_ms: int, sigma: float, lo: int, hi: int) -> int:
    v = int(median_ms * math.exp(rng.gauss(0.0, sigma)))
    return max(lo, min(hi, v))


def _round_to(ms: int, step: int) -> int:
    return max(step, (ms + step // 2) // step * step)


def _working_hours_time(rng: random.Random, day: int) -> int:
    """A submit time in ``day``: 80% between 08:00 and 20:00, else any time."""
    if rng.random() < 0.8:
        return day * DAY_MS + 8 * HOUR_MS + rng.randrange(12 * HOUR_MS)
    return day * DAY_MS + rng.randrange(DAY_MS)


ACTIVITY = {"busy": (1.25, 1.6), "normal": (1.0, 0.7), "quiet": (0.6, 0.25)}
"""Week kind -> (allocated work, zero-min-runtime work) as multiples of a team's share."""


def ai2(
    days: int = 30,
    seed: int = 1,
    load: float = 0.75,
    unallocated_load: float = 0.8,
    backlog: float = 0.5,
    size_factor: float = 1.5,
    flagship: bool = False,
) -> Scenario:
    rng = random.Random(seed)
    nodes, gpn = 128, 8
    capacity = nodes * gpn
    budget: list[tuple[str, int, str]] = [("", 1, "ops")]
    team_users: dict[str, list[str]] = {}
    for program, pweight, program_teams in AI2_PROGRAMS:
        budget.append((program, pweight, f"{program}-lead"))
        for team, tweight in program_teams:
            tpath = f"{program}/{team}"
            budget.append((tpath, tweight, f"{team}-lead"))
            n_users = rng.randint(6, 14)
            users = [f"{tpath}/u{i:02d}" for i in range(n_users)]
            team_users[tpath] = users
            for u in users:
                budget.append((u, 1, u.rsplit("/", 1)[1]))
    shares = _budget_shares(budget)
    teams = list(team_users)
    biggest = max(teams, key=lambda t: (shares[t], t))

    weeks = (days + 6) // 7 + 1
    activity: dict[str, list[tuple[float, float]]] = {}
    for t in teams:
        activity[t] = [ACTIVITY[_pick(rng, list(ACTIVITY), [0.3, 0.4, 0.3])] for _ in range(weeks)]

    made = NumberedRows()

    def add(
        team: str,
        submit: int,
        gpus: int,
        duration: int,
        min_rt: int,
        resumable: bool,
        lp: LegacyPriority,
        lpre: bool,
        kind: str,
        user: str | None = None,
    ) -> int:
        owner = user or rng.choice(team_users[team])
        made.add(
            kind,
            owner,
            submit,
            gpus,
            duration,
            min_rt,
            resumable=resumable,
            legacy_priority=lp,
            legacy_preemptible=lpre,
        )
        return gpus * duration

    def large_job(team: str, submit: int) -> int:
        fair = float(shares[team]) * capacity
        sizes = [s for s in (64, 128, 256, 512) if s <= size_factor * fair] or [32]
        if flagship and team == biggest and 512 not in sizes:
            sizes.append(512)  # the flagship pretraining run, now and then
        gpus = _pick(rng, sizes, [8, 6, 4, 1][: len(sizes)])
        duration = _round_to(
            _lognormal_ms(rng, 12 * HOUR_MS, 0.8, 3 * HOUR_MS, 72 * HOUR_MS), MINUTE_MS
        )
        min_rt = rng.randrange(4, 17) * 30 * MINUTE_MS  # 2 h .. 8 h in half hours
        lp: LegacyPriority = "high" if rng.random() < 0.15 else "normal"
        return add(team, submit, gpus, duration, min_rt, True, lp, False, "train")

    def mid_job(team: str, submit: int) -> int:
        gpus = _pick(rng, [8, 16, 32], [5, 3, 2])
        duration = _round_to(
            _lognormal_ms(rng, 3 * HOUR_MS, 0.9, 30 * MINUTE_MS, 12 * HOUR_MS), MINUTE_MS
        )
        min_rt = rng.randrange(1, 5) * 30 * MINUTE_MS
        pre = rng.random() < 1 / 3
        return add(
            team, submit, gpus, duration, min_rt, True, "low" if pre else "normal", pre, "mid"
        )

    def free_job(team: str, submit: int) -> int:
        gpus = _pick(rng, [16, 32], [3, 2])
        duration = _round_to(_lognormal_ms(rng, 3 * HOUR_MS, 0.7, HOUR_MS, 8 * HOUR_MS), MINUTE_MS)
        return add(team, submit, gpus, duration, 0, rng.random() < 0.8, "low", True, "free")

    def debug_job(team: str, submit: int) -> int:
        gpus = _pick(rng, [1, 2, 4, 8], [4, 2, 2, 2])
        duration = rng.randrange(2, 21) * MINUTE_MS
        min_rt = rng.randrange(1, 4) * 5 * MINUTE_MS
        return add(team, submit, gpus, duration, min_rt, False, "high", False, "debug")

    day_capacity = capacity * DAY_MS
    # A backlog at time 0: about one and a half cluster-days of training and mid-size work.
    for team in teams:
        target = float(shares[team]) * day_capacity * backlog
        done = 0
        while done < target:
            done += (
                large_job(team, rng.randrange(0, HOUR_MS))
                if rng.random() < 0.6
                else mid_job(team, rng.randrange(0, HOUR_MS))
            )
    # Each class keeps a running balance per team, so chunky jobs (a 512-GPU,
    # 2-day run) do not overshoot a small team's daily target.
    balance: dict[tuple[str, str], float] = {}
    for day in range(days):
        week = day // 7
        for team in teams:
            act, act_free = activity[team][week]
            target = float(shares[team]) * day_capacity
            for cls, fraction, make in (
                (
                    "large",
                    0.6 * load * act,
                    lambda t, d=day: large_job(t, d * DAY_MS + rng.randrange(DAY_MS)),
                ),
                ("mid", 0.4 * load * act, lambda t, d=day: mid_job(t, _working_hours_time(rng, d))),
                (
                    "free",
                    unallocated_load * act_free,
                    lambda t, d=day: free_job(t, d * DAY_MS + rng.randrange(DAY_MS)),
                ),
            ):
                key = (team, cls)
                balance[key] = balance.get(key, 0.0) + target * fraction
                while balance[key] > 0:
                    balance[key] -= make(team)
            n_debug = max(1, int(round(len(team_users[team]) * 3 * act * rng.uniform(0.7, 1.3))))
            for _ in range(n_debug):
                debug_job(team, _working_hours_time(rng, day))
    rows = [r for r in made.rows if r.submit_ms < days * DAY_MS]
    rows.sort(key=lambda r: (r.submit_ms, r.id))

    health: list[HealthRow] = []
    names = [f"h100-{i:03d}" for i in range(nodes)]
    busy_until = dict.fromkeys(names, 0)
    for day in range(days):
        for _ in range(max(1, round(nodes * 0.015 * rng.uniform(0.5, 1.5)))):
            node = rng.choice(names)
            at = day * DAY_MS + rng.randrange(DAY_MS)
            if at < busy_until[node]:
                continue
            if rng.random() < 0.1:
                back = at + rng.randrange(2 * HOUR_MS, 6 * HOUR_MS)
                health.append(HealthRow(at_ms=at, node=node, state="down"))
            else:
                back = at + rng.randrange(6 * HOUR_MS, 16 * HOUR_MS)
                health.append(HealthRow(at_ms=at, node=node, state="draining"))
            health.append(HealthRow(at_ms=back, node=node, state="healthy"))
            busy_until[node] = back + MINUTE_MS
    health = [h for h in health if h.at_ms < days * DAY_MS]
    health.sort(key=lambda h: (h.at_ms, h.node))
    return Scenario(
        name="ai2",
        pools=[("h100-", nodes, gpn, "h100")],
        budget=budget,
        trace=rows,
        health=health,
        days=days,
        seed=seed,
    )


def debug(days: int = 3, seed: int = 1) -> Scenario:
    rng = random.Random(seed)
    budget = [
        ("", 1, "ops"),
        ("train", 3, "train-lead"),
        ("train/ana", 1, "ana"),
        ("train/ben", 1, "ben"),
        ("dev", 1, "dev-lead"),
        ("dev/cy", 1, "cy"),
        ("dev/di", 1, "di"),
        ("dev/ed", 1, "ed"),
    ]
    rows: list[TraceRow] = []
    n = 0
    # Training: each of ana and ben keeps two 64-GPU jobs queued per day.
    for day in range(days):
        for user in ("ana", "ben"):
            for k in range(2):
                n += 1
                rows.append(
                    TraceRow(
                        id=f"train-{n:04d}",
                        submit_ms=day * DAY_MS + k * HOUR_MS + rng.randrange(10 * MINUTE_MS),
                        owner=f"train/{user}",
                        gpus=64,
                        duration_ms=2 * DAY_MS,
                        min_runtime_ms=8 * HOUR_MS,
                        legacy_priority="normal",
                        legacy_preemptible=False,
                    )
                )
    users = ["cy", "di", "ed"]
    for day in range(days):
        t = day * DAY_MS + 8 * HOUR_MS
        i = 0
        while t < day * DAY_MS + 20 * HOUR_MS:
            n += 1
            rows.append(
                TraceRow(
                    id=f"debug-{n:04d}",
                    submit_ms=t + rng.randrange(MINUTE_MS),
                    owner=f"dev/{users[i % 3]}",
                    gpus=(1, 2, 4)[i % 3],
                    duration_ms=5 * MINUTE_MS,
                    min_runtime_ms=10 * MINUTE_MS,
                    resumable=False,
                    legacy_priority="high",
                    legacy_preemptible=False,
                )
            )
            t += 10 * MINUTE_MS
            i += 1
    rows.sort(key=lambda r: (r.submit_ms, r.id))
    return Scenario(
        name="debug",
        pools=[("node-", 16, 8, "h100")],
        budget=budget,
        trace=rows,
        health=[],
        days=days,
        seed=seed,
    )


def _family(days: int = 10, seed: int = 1, knobs: Knobs | None = None) -> Scenario:
    from .family import family

    return family(days, seed, knobs)


SCENARIOS: dict[str, Callable[..., Scenario]] = {"ai2": ai2, "debug": debug, "family": _family}

MAX_SCENARIO_DAYS = 365
"""The most days of a scenario one may ask for (``simulate`` and ``trace generate``
``--days``); :func:`generate` makes up to two more, the warm-up days ``simulate``
adds (``run.WARMUP_DAYS``)."""


def check_scenario_days(days: float) -> None:
    """Raise ``ValueError`` unless ``days`` is a scenario length one may ask for."""
    if not 1 <= days <= MAX_SCENARIO_DAYS or days != int(days):
        raise ValueError(
            f"--days of a scenario must be a whole number from 1 to {MAX_SCENARIO_DAYS}, got {days:g}"
        )


def generate(name: str, days: int, seed: int, knobs: list[str] | None = None) -> Scenario:
    """Scenario ``name``; ``knobs`` (``KEY=VALUE``) only for ``family`` (see :mod:`.family`)."""
    try:
        make = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})") from None
    if not 1 <= days <= MAX_SCENARIO_DAYS + 2:
        raise ValueError(
            f"a scenario is 1 to {MAX_SCENARIO_DAYS} days long (plus 2 of warm-up), got {days}"
        )
    if name == "family":
        from .family import parse_knobs

        return make(days=days, seed=seed, knobs=parse_knobs(knobs or []))
    if knobs:
        raise ValueError(f"--set is for the family scenario; {name!r} has no knobs")
    return make(days=days, seed=seed)


def write_scenario(scenario: Scenario, out_dir) -> dict[str, str]:
    """Write ``trace.csv``, ``health.csv`` and ``cluster.toml`` into ``out_dir``."""
    from pathlib import Path

    from .cluster_file import write_cluster
    from .trace import write_health, write_trace

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "trace": str(out / "trace.csv"),
        "health": str(out / "health.csv"),
        "cluster": str(out / "cluster.toml"),
    }
    write_trace(paths["trace"], scenario.trace)
    write_health(paths["health"], scenario.health)
    write_cluster(
        paths["cluster"],
        name=scenario.name,
        pools=scenario.pools,
        budget=scenario.budget,
        policy=scenario.policy,
        comment=f"apportion scenario {scenario.name}, seed {scenario.seed}, {scenario.days} days",
        clusters=scenario.clusters,
    )
    return paths
