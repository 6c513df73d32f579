"""A family of generated workloads: one generator, documented knobs, deterministic from a seed.

``family`` makes clusters of the kind apportion is for: two GPU types, a tree
of programs, teams and users with unequal weights, bursty teams, multi-day
training gangs sized against the teams' shares, contracts of a few minutes to
8 hours, debug work, squatters (long protected sessions that hold GPUs), free
filler work and hosts that drain or fail. Every knob has a default; the grid of
``make outcomes`` varies ``load`` and the seed, and its big-team cells set
``big_team`` and ``margin``.

Knobs (:class:`Knobs`; ``apportion trace generate --scenario family --set KEY=VALUE``):

==================  ========  ====================================================
knob                default   meaning
==================  ========  ====================================================
``gpus``            512       cluster size (whole 8-GPU nodes, 16 to 65,536)
``scarce_fraction`` 0.25      share of nodes of the scarce type (``a100``; the rest ``h100``)
``programs``        3         programs under the root (weights 1-5)
``teams``           8         teams, spread over the programs (weights 1-4)
``users``           3         users (leaves) per team
``load``            2.5       allocated demand outstanding at the start (pending and
                              running GPUs) as a multiple of the cluster; afterwards
                              allocated work arrives at ``arrival`` x the cluster
``arrival``         0.85      allocated GPU-time submitted per hour, as a fraction of
                              the cluster's GPU-hours (teams in proportion to shares)
``gang_factor``     2.0       largest training gang as a multiple of the team's share
                              of GPUs (gangs are 64, 128 or 256 GPUs; 32 if none fits)
``long_contracts``  0.5       fraction of training and mid-size work with 4-8 h
                              contracts (the rest: 30 min - 2 h)
``bursty``          0.5       fraction of teams whose weeks alternate busy (1.6x)
                              and quiet (0.4x)
``typed``           0.3       fraction of training and mid-size work that asks for a
                              GPU type (the scarce one for a third of those)
``squatters``       0.15      fraction of users who keep a protected interactive
                              session (1-8 GPUs, 8 h contract, 12-24 h) most days
``free``            0.4       zero-min-runtime filler submitted per hour, as a
                              fraction of the cluster's GPU-hours
``debug``           2.0       debug jobs per user per working hour (1-8 GPUs,
                              2-20 min, 5-15 min contracts)
``drain_rate``      0.015     hosts that degrade per host-day; one in ten goes
                              ``down`` (2-6 h), the rest drain (6-16 h repair)
``margin``          0         the cluster's preemption margin (policy)
``margin_wait``     2         hours a waiting workload is held to the margin
                              (policy ``preemption_margin_wait``; 0: always held)
``big_team``        0         0: off. Else the global share of one more team,
                              ``big/team`` (its own program, 3 levels like the
                              rest, :data:`BIG_TEAM`), whose allocated work is all
                              gangs of a third to half of the cluster (whole nodes,
                              any type, at most the largest pool); the other
                              programs keep their relative weights in the rest of
                              the tree, and the big team is never bursty
==================  ========  ====================================================

Legacy columns for the baseline priority policy follow the ``ai2`` scenario:
training ``normal`` (15% ``high``), debug and squatter sessions ``high``,
free work and a third of mid-size work ``low`` and ``legacy_preemptible``.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import TYPE_CHECKING

import msgspec
from apportion.schemas.events import DAY_MS, HOUR_MS, MINUTE_MS, LegacyPriority

from .cluster_file import format_duration
from .trace import HealthRow, NumberedRows

if TYPE_CHECKING:
    from .scenarios import Scenario

NODE_GPUS = 8
MAX_GPUS = 65_536
"""Four times the largest cluster measured (16,384 GPUs, README "At scale")."""
TYPES = ("h100", "a100")  # common, scarce
BIG_TEAM = "big/team"
"""The team the ``big_team`` knob adds (program ``big``, users ``big/team/u<j>``)."""
BIG_GANG_MIN, BIG_GANG_MAX = Fraction(1, 3), Fraction(1, 2)
"""The big team's gangs: whole nodes, from a third to half of the cluster's GPUs."""
WEIGHT_SCALE = 100
"""With a big team, program weights are scaled by this so that the big team's
integer weight gives it its share to within half a point."""


class Knobs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The family's knobs; see the module docstring for each."""

    gpus: int = 512
    scarce_fraction: float = 0.25
    programs: int = 3
    teams: int = 8
    users: int = 3
    load: float = 2.5
    arrival: float = 0.85
    gang_factor: float = 2.0
    long_contracts: float = 0.5
    bursty: float = 0.5
    typed: float = 0.3
    squatters: float = 0.15
    free: float = 0.4
    debug: float = 2.0
    drain_rate: float = 0.015
    margin: float = 0.0
    margin_wait: float = 2.0
    big_team: float = 0.0
    clusters: int = 1

    def check(self) -> None:
        """Raise ``ValueError`` naming the first knob out of its range."""
        if not 2 * NODE_GPUS <= self.gpus <= MAX_GPUS or self.gpus % NODE_GPUS:
            raise ValueError(f"gpus must be a multiple of {NODE_GPUS} from 16 to {MAX_GPUS:,}")
        if not 1 <= self.programs <= self.teams <= 64:
            raise ValueError("need 1 <= programs <= teams <= 64")
        if not 1 <= self.users <= 32:
            raise ValueError("users must be between 1 and 32")
        for name in ("scarce_fraction", "long_contracts", "bursty", "typed", "squatters"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be between 0 and 1")
        if not 0 <= self.margin < 1:
            raise ValueError("margin must be in [0, 1)")
        if not 0 <= self.margin_wait <= 7 * 24:
            raise ValueError("margin_wait must be between 0 and 168 hours (the lookback)")
        if self.clusters not in (1, 2, 3):
            raise ValueError("clusters must be 1, 2 or 3")
        if self.clusters > 1 and not self.scarce_fraction:
            raise ValueError("clusters 2 or 3 need a scarce type (scarce_fraction > 0)")
        if not 0 <= self.big_team < 1:
            raise ValueError("big_team must be in [0, 1) (0: no big team)")
        for name in ("load", "arrival", "gang_factor", "free", "debug", "drain_rate"):
            if not 0 <= getattr(self, name) <= 100:
                raise ValueError(f"{name} must be between 0 and 100")


def parse_knobs(pairs: list[str]) -> Knobs:
    """``["load=4", "gpus=1024"]`` as :class:`Knobs` (``ValueError`` names a bad one)."""
    names = [f.name for f in msgspec.structs.fields(Knobs)]
    values: dict[str, float | int] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in names:
            raise ValueError(f"--set {pair}: expected KEY=VALUE with KEY one of {', '.join(names)}")
        try:
            values[key] = int(raw) if raw.strip().lstrip("-").isdigit() else float(raw)
        except ValueError:
            raise ValueError(f"--set {pair}: {raw!r} is not a number") from None
    try:
        knobs = msgspec.convert(values, Knobs, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--set: {exc}") from None
    knobs.check()
    return knobs


def _lognormal_ms(rng: random.Random, median_ms: int, sigma: float, lo: int, hi: int) -> int:
    v = int(median_ms * math.exp(rng.gauss(0.0, sigma)))
    return max(lo, min(hi, v)) // MINUTE_MS * MINUTE_MS or MINUTE_MS


def family(days: int = 10, seed: int = 1, knobs: Knobs | None = None) -> Scenario:
    """The scenario for ``knobs`` (defaults for every knob not given)."""
    from .scenarios import Scenario

    k = knobs or Knobs()
    k.check()
    rng = random.Random(seed)
    nodes = k.gpus // NODE_GPUS
    scarce_nodes = max(1, round(nodes * k.scarce_fraction)) if k.scarce_fraction else 0
    common_nodes = nodes - scarce_nodes
    pools = [("h100-", common_nodes, NODE_GPUS, "h100")]
    if scarce_nodes:
        pools.append(("a100-", scarce_nodes, NODE_GPUS, "a100"))
    capacity = k.gpus

    # the tree: programs, teams spread round-robin, users
    budget: list[tuple[str, int, str]] = [("", 1, "ops")]
    shares: dict[str, Fraction] = {}
    programs = [f"p{i}" for i in range(k.programs)]
    pweights = {p: rng.randint(1, 5) for p in programs}
    team_of_program: dict[str, list[str]] = {p: [] for p in programs}
    for i in range(k.teams):
        team_of_program[programs[i % k.programs]].append(f"{programs[i % k.programs]}/t{i}")
    users: dict[str, list[str]] = {}
    ptotal = sum(pweights.values())
    if k.big_team:
        # the big team's program weighs big_team / (1 - big_team) of the others together
        pweights = {p: w * WEIGHT_SCALE for p, w in pweights.items()}
        big_weight = max(1, round(k.big_team / (1 - k.big_team) * ptotal * WEIGHT_SCALE))
        ptotal = sum(pweights.values()) + big_weight
        big_program = BIG_TEAM.split("/")[0]
        budget.append((big_program, big_weight, f"{big_program}-lead"))
        budget.append((BIG_TEAM, 1, "big-lead"))
        shares[BIG_TEAM] = Fraction(big_weight, ptotal)
        users[BIG_TEAM] = [f"{BIG_TEAM}/u{j}" for j in range(k.users)]
        for u in users[BIG_TEAM]:
            budget.append((u, 1, u.replace("/", "-")))
    for p in programs:
        budget.append((p, pweights[p], f"{p}-lead"))
        tweights = {t: rng.randint(1, 4) for t in team_of_program[p]}
        ttotal = sum(tweights.values())
        for t in team_of_program[p]:
            budget.append((t, tweights[t], f"{t.rsplit('/', 1)[1]}-lead"))
            shares[t] = Fraction(pweights[p], ptotal) * Fraction(tweights[t], ttotal)
            users[t] = [f"{t}/u{j}" for j in range(k.users)]
            for u in users[t]:
                budget.append((u, 1, u.replace("/", "-")))
    teams = sorted(users)

    weeks = days // 7 + 2
    activity: dict[str, list[float]] = {}
    for t in teams:
        if t == BIG_TEAM:  # sustained load: never bursty
            activity[t] = [1.0] * weeks
            continue
        if rng.random() < k.bursty:
            first = rng.random() < 0.5
            activity[t] = [1.6 if (w % 2 == 0) == first else 0.4 for w in range(weeks)]
        else:
            activity[t] = [1.0] * weeks

    made = NumberedRows()

    def contract() -> int:
        if rng.random() < k.long_contracts:
            return rng.randrange(8, 17) * 30 * MINUTE_MS  # 4 h .. 8 h
        return rng.randrange(1, 5) * 30 * MINUTE_MS  # 30 min .. 2 h

    def gpu_type() -> str:
        if rng.random() >= k.typed:
            return "any"
        return TYPES[1] if scarce_nodes and rng.random() < 1 / 3 else TYPES[0]

    def training(team: str, submit: int) -> tuple[int, int]:
        fair = float(shares[team]) * capacity
        sizes = [s for s in (64, 128, 256) if s <= k.gang_factor * fair] or [32]
        gpus = rng.choice(sizes)
        duration = _lognormal_ms(rng, 10 * HOUR_MS, 0.7, 2 * HOUR_MS, 48 * HOUR_MS)
        typ = gpu_type()
        if typ == "a100" and gpus > scarce_nodes * NODE_GPUS:
            typ = "h100"
        lp: LegacyPriority = "high" if rng.random() < 0.15 else "normal"
        made.add(
            "train",
            rng.choice(users[team]),
            submit,
            gpus,
            duration,
            contract(),
            gpu_type=typ,
            legacy_priority=lp,
        )
        return gpus, duration

    def mid(team: str, submit: int) -> tuple[int, int]:
        gpus = rng.choice((8, 16, 32))
        duration = _lognormal_ms(rng, 3 * HOUR_MS, 0.8, 30 * MINUTE_MS, 12 * HOUR_MS)
        pre = rng.random() < 1 / 3
        lp: LegacyPriority = "low" if pre else "normal"
        owner = rng.choice(users[team])
        made.add(
            "mid",
            owner,
            submit,
            gpus,
            duration,
            contract(),
            gpu_type=gpu_type(),
            legacy_priority=lp,
            legacy_preemptible=pre,
        )
        return gpus, duration

    largest_pool_nodes = max(c for _, c, _, _ in pools)
    big_sizes = [
        n * NODE_GPUS
        for n in range(
            max(1, math.ceil(BIG_GANG_MIN * nodes)),
            min(largest_pool_nodes, math.floor(BIG_GANG_MAX * nodes)) + 1,
        )
    ] or [largest_pool_nodes * NODE_GPUS]

    def big_gang(team: str, submit: int) -> tuple[int, int]:
        gpus = rng.choice(big_sizes)
        duration = _lognormal_ms(rng, 10 * HOUR_MS, 0.7, 2 * HOUR_MS, 48 * HOUR_MS)
        lp: LegacyPriority = "high" if rng.random() < 0.15 else "normal"
        made.add(
            "train", rng.choice(users[team]), submit, gpus, duration, contract(), legacy_priority=lp
        )
        return gpus, duration

    def allocated(team: str, submit: int) -> tuple[int, int]:
        if team == BIG_TEAM:
            return big_gang(team, submit)
        return training(team, submit) if rng.random() < 0.6 else mid(team, submit)

    # 1. the backlog at time 0: each team's share of load x capacity, in GPUs outstanding
    for team in teams:
        want = float(shares[team]) * k.load * capacity
        have = 0
        while have < want:
            have += allocated(team, rng.randrange(0, 10 * MINUTE_MS))[0]
    # 2. arrivals: each team its share of arrival x capacity GPU-time per hour (times its week)
    horizon = days * DAY_MS
    for team in teams:
        owed = 0.0
        for hour in range(horizon // HOUR_MS):
            week = hour // (7 * 24)
            owed += float(shares[team]) * k.arrival * capacity * activity[team][week] * HOUR_MS
            while owed > 0:
                gpus, duration = allocated(team, hour * HOUR_MS + rng.randrange(HOUR_MS))
                owed -= gpus * duration
    # 3. free filler, any team, by submit hour
    budget_free = 0.0
    for hour in range(days * 24):
        budget_free += k.free * capacity * HOUR_MS
        while budget_free > 0:
            team = rng.choice(teams)
            gpus = rng.choice((1, 2, 4, 8, 16, 32))
            duration = _lognormal_ms(rng, 2 * HOUR_MS, 0.8, 20 * MINUTE_MS, 8 * HOUR_MS)
            made.add(
                "free",
                rng.choice(users[team]),
                hour * HOUR_MS + rng.randrange(HOUR_MS),
                gpus,
                duration,
                0,
                resumable=rng.random() < 0.8,
                legacy_priority="low",
                legacy_preemptible=True,
            )
            budget_free -= gpus * duration
    # 4. debug work in working hours, squatters' sessions each day
    for day in range(days):
        for team in teams:
            for user in users[team]:
                n = int(k.debug * 12 * activity[team][day // 7] * rng.uniform(0.5, 1.5))
                for _ in range(n):
                    at = day * DAY_MS + 8 * HOUR_MS + rng.randrange(12 * HOUR_MS)
                    made.add(
                        "debug",
                        user,
                        at,
                        rng.choice((1, 2, 4, 8)),
                        rng.randrange(2, 21) * MINUTE_MS,
                        rng.randrange(1, 4) * 5 * MINUTE_MS,
                        resumable=False,
                        legacy_priority="high",
                    )
    squatters = [u for t in teams for u in users[t] if rng.random() < k.squatters]
    for day in range(days):
        for user in squatters:
            if rng.random() < 0.8:
                at = day * DAY_MS + 8 * HOUR_MS + rng.randrange(2 * HOUR_MS)
                made.add(
                    "session",
                    user,
                    at,
                    rng.choice((1, 2, 4, 8)),
                    rng.randrange(12, 25) * HOUR_MS,
                    8 * HOUR_MS,
                    resumable=False,
                    legacy_priority="high",
                )
    rows = [r for r in made.rows if r.submit_ms < horizon]
    rows.sort(key=lambda r: (r.submit_ms, r.id))

    # 5. hosts that degrade
    health: list[HealthRow] = []
    names = [f"{p}{i:03d}" for p, c, _, _ in pools for i in range(c)]
    free_at = dict.fromkeys(names, 0)
    for day in range(days):
        for _ in range(round(nodes * k.drain_rate * rng.uniform(0.5, 1.5))):
            node = rng.choice(names)
            at = day * DAY_MS + rng.randrange(DAY_MS)
            if at < free_at[node]:
                continue
            down = rng.random() < 0.1
            back = at + rng.randrange(*((2, 6) if down else (6, 16))) * HOUR_MS
            health.append(HealthRow(at_ms=at, node=node, state="down" if down else "draining"))
            health.append(HealthRow(at_ms=back, node=node, state="healthy"))
            free_at[node] = back + MINUTE_MS
    health = sorted((h for h in health if h.at_ms < horizon), key=lambda h: (h.at_ms, h.node))
    return Scenario(
        name="family",
        pools=pools,
        clusters=cluster_layout(pools, k.clusters),
        budget=budget,
        trace=rows,
        health=health,
        days=days,
        seed=seed,
        policy={
            "lookback": "7d",
            "max_min_runtime": "8h",
            "preemption_margin": k.margin,
            **(
                {"preemption_margin_wait": format_duration(round(k.margin_wait * HOUR_MS))}
                if k.margin
                else {}
            ),
        },
    )


ClusterPools = list[tuple[str, list[tuple[str, int, int, str, int]]]]
"""``(cluster name, [(prefix, count, gpus_per_node, gpu_type, first index)])``."""


def cluster_layout(pools: list[tuple[str, int, int, str]], clusters: int) -> ClusterPools:
    """The family's nodes as ``clusters`` clusters (``[]`` for one): ``big`` holds the
    common pool, ``small`` the scarce one; with 3, ``mid`` takes the last third
    of the common nodes (node names stay those of the single cluster)."""
    if clusters == 1:
        return []
    (cprefix, common, gpn, ctype), (sprefix, scarce, sgpn, stype) = pools
    mid = common // 3 if clusters == 3 else 0
    out: ClusterPools = [("big", [(cprefix, common - mid, gpn, ctype, 0)])]
    if mid:
        out.append(("mid", [(cprefix, mid, gpn, ctype, common - mid)]))
    out.append(("small", [(sprefix, scarce, sgpn, stype, 0)]))
    return out
