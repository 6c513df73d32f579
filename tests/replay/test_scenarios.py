"""Scenarios are deterministic from their seed and have the promised shape."""

from __future__ import annotations

from collections import Counter

from apportion.replay.scenarios import ai2, debug, write_scenario


def test_ai2_deterministic_from_seed():
    a, b, c = ai2(days=3, seed=7), ai2(days=3, seed=7), ai2(days=3, seed=8)
    assert a.trace == b.trace and a.health == b.health and a.budget == b.budget
    assert a.trace != c.trace


def test_ai2_shape():
    s = ai2(days=7, seed=1)
    assert s.pools == [("h100-", 128, 8, "h100")]
    depth = Counter(p.count("/") for p, _, _ in s.budget[1:])
    assert depth[0] == 4 and depth[1] == 15 and 100 <= depth[2] <= 210
    leaves = {p for p, _, _ in s.budget if p.count("/") == 2}
    assert all(r.owner in leaves for r in s.trace)
    kinds = Counter(r.id.split("-")[0] for r in s.trace)
    assert kinds["debug"] > kinds["mid"] > kinds["train"] > 0 and kinds["free"] > 0
    train = [r for r in s.trace if r.id.startswith("train")]
    # gangs of 64-256 GPUs, never more than 1.5x the team's share; teams too small
    # for a 64-GPU gang train on 32 GPUs
    assert all(
        r.gpus in (32, 64, 128, 256) and 2 * 3_600_000 <= r.min_runtime_ms <= 8 * 3_600_000
        for r in train
    )
    assert {r.gpus for r in train} >= {32, 64, 128}
    assert all(
        r.gpus == 32
        for r in train
        if r.owner.startswith(("llm/eval/", "llm/safety/", "agents/web/"))
    )
    dbg = [r for r in s.trace if r.id.startswith("debug")]
    assert all(r.gpus <= 8 and 0 < r.min_runtime_ms <= 900_000 for r in dbg)
    assert {h.state for h in s.health} >= {"draining", "healthy"}


def test_debug_scenario_and_writing(tmp_path):
    s = debug(days=1, seed=3)
    paths = write_scenario(s, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.toml", "health.csv", "trace.csv"]
    assert (tmp_path / "trace.csv").read_text().count("\n") == len(s.trace) + 1
    assert paths["cluster"].endswith("cluster.toml")
