"""The family's ``big_team`` knob, and the default family traces unchanged by it."""

from __future__ import annotations

import hashlib
from fractions import Fraction

import msgspec
import pytest
from apportion.replay.family import BIG_TEAM, Knobs, family, parse_knobs
from apportion.replay.outcomes import BIG_CELLS, DEFAULT_GRID, Cell

DEFAULT_DIGESTS = {
    # (days, seed, knobs): digest of pools, budget, trace, health, policy, days, seed,
    # recorded before the big_team knob existed
    (12, 1, ()): "3b7286945ba843d27463b04680d4a945029bf2d4d23db74957636ec01eb17f58",
    (12, 2, (("load", 4.0),)): "4953847d94b8d7d7ce544f8a820209bd97e16c24175cb855b9337c46ac2166a2",
    (5, 3, (("load", 4.0), ("margin", 0.05))): (
        "e492cd7f727b07106465fb67dfc89d8104ab101ee7733871d225a4a85d14b996"
    ),
    (9, 4, (("gpus", 128), ("drain_rate", 0.1))): (
        "a934e31c7be5a2f111a77bba7671a96cda778c0d1871614d7ec62511734d23d5"
    ),
}


def _digest(s) -> str:
    # the policy's margin wait came after these digests (a policy key a margin brings,
    # not part of the trace): left out, so the digests still check everything else
    policy = {k: v for k, v in s.policy.items() if k != "preemption_margin_wait"}
    return hashlib.sha256(
        msgspec.json.encode([s.pools, s.budget, s.trace, s.health, policy, s.days, s.seed])
    ).hexdigest()


@pytest.mark.parametrize("days,seed,knobs", list(DEFAULT_DIGESTS))
def test_family_without_big_team_generates_what_it_did(days, seed, knobs):
    assert _digest(family(days, seed, Knobs(**dict(knobs)))) == DEFAULT_DIGESTS[(days, seed, knobs)]


def _global_shares(budget) -> dict[str, Fraction]:
    weight = {p: w for p, w, _ in budget}

    def share(path: str) -> Fraction:
        parts = path.split("/")
        f = Fraction(1)
        for i in range(len(parts)):
            node, parent = "/".join(parts[: i + 1]), "/".join(parts[:i])
            siblings = [
                q
                for q in weight
                if q and q.count("/") == i and "/".join(q.split("/")[:i]) == parent
            ]
            f *= Fraction(weight[node], sum(weight[q] for q in siblings))
        return f

    return {p: share(p) for p in weight if p.count("/") == 1}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_big_team_is_the_largest_share_and_asks_for_big_gangs(seed):
    s = family(6, seed, Knobs(big_team=0.3, load=3.5))
    shares = _global_shares(s.budget)
    assert len(shares) == 9 and sum(shares.values()) == 1
    assert abs(shares[BIG_TEAM] - Fraction(3, 10)) < Fraction(1, 200)
    assert max(shares, key=lambda t: shares[t]) == BIG_TEAM
    big = [r for r in s.trace if r.owner.startswith(BIG_TEAM + "/") and r.min_runtime_ms > 0]
    gangs = [r for r in big if r.id.startswith("train")]
    # every allocated row of the big team that is not debug or a session is a gang of
    # a third to half of the 512 GPUs, whole nodes, any type
    assert gangs and {r.id.split("-")[0] for r in big} <= {"train", "debug", "session"}
    assert all(176 <= r.gpus <= 256 and r.gpus % 8 == 0 and r.gpu_type == "any" for r in gangs)
    assert all(
        4 * 3_600_000 <= r.min_runtime_ms <= 8 * 3_600_000 or r.min_runtime_ms <= 2 * 3_600_000
        for r in gangs
    )
    # its backlog at the start is at least its share of load x the cluster
    assert sum(r.gpus for r in gangs if r.submit_ms < 10 * 60_000) >= 0.3 * 3.5 * 512
    # the other teams keep their relative shares
    plain = _global_shares(family(6, seed, Knobs(load=3.5)).budget)
    ratio = {t: shares[t] / plain[t] for t in plain}
    assert max(ratio.values()) - min(ratio.values()) < Fraction(1, 10**9)


def test_big_team_knob_is_checked_and_parsed():
    assert parse_knobs(["big_team=0.3"]) == Knobs(big_team=0.3)
    for bad in (["big_team=1"], ["big_team=-0.1"]):
        with pytest.raises(ValueError):
            parse_knobs(bad)


def test_outcomes_has_big_team_cells_beside_the_old_ones():
    old = tuple(Cell(load, seed, 10) for load in (1.5, 2.5, 4.0) for seed in (1, 2, 3))
    assert DEFAULT_GRID[: len(old) + 1] == (*old, Cell(4.0, 1, 30))
    assert set(BIG_CELLS) <= set(DEFAULT_GRID)
    assert {(c.load, c.knobs) for c in BIG_CELLS} == {
        (3.5, ("big_team=0.3", "margin=0")),
        (3.5, ("big_team=0.3", "margin=0.05")),
    }
    assert BIG_CELLS[-1].label() == "big 0.3 m 0.05" and Cell(1.5, 1, 2).label() == "-"
