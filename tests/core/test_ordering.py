"""Hierarchical fair-share ordering (docs/semantics.md, "The ordering"), cases computed by hand."""

from __future__ import annotations

from fractions import Fraction as F

import pytest
from apportion.core import FairShareView, queue_order
from apportion.core.budget import ancestors_of
from apportion.core.ordering import FairShareWalk
from apportion.core.ratio import clearly_below_pair, ratio
from core_builders import Scenario, reference_order
from hypothesis import given, settings
from hypothesis import strategies as st

H = 3_600_000
DAY = 24 * H


def order(s: Scenario) -> list[str]:
    return [w.id for w in queue_order(s.state)]


def research() -> Scenario:
    """root -> research (1) -> nlp (1) -> ann; research -> cv (1) -> ben; root -> ops (1) -> oz.
    8 nodes of 8 GPUs."""
    s = Scenario().tree(
        "research", "research/nlp", "research/nlp/ann", "research/cv", "research/cv/ben"
    )
    return s.tree("ops", "ops/oz").nodes("n", 8)


def test_teams_flip_as_old_usage_slides_out_of_the_window() -> None:
    """nlp ran 8 GPUs over day [0, 1]; cv ran 8 GPUs over day [5, 5.5].

    at day 6:     nlp 192 GPU-h > cv 96 GPU-h          -> cv first
    at day 7.75:  window [0.75 d, 7.75 d]: nlp keeps 6 h x 8 = 48 GPU-h < cv 96 -> nlp first
    """
    s = research().submit("old", "research/nlp/ann", gpus=8).place("old", "n0")
    s.at(DAY).finish("old").at(5 * DAY).submit("mid", "research/cv/ben", gpus=8).place("mid", "n0")
    s.at(5 * DAY + 12 * H).finish("mid")
    s.at(6 * DAY).submit("nlp-w", "research/nlp/ann").submit("cv-w", "research/cv/ben")
    view = FairShareView(s.state)
    assert (view.usage["research/nlp"], view.usage["research/cv"]) == (192 * H, 96 * H)
    assert view.usage["research"] == 288 * H
    assert order(s) == ["cv-w", "nlp-w"]
    s.tick(7 * DAY + 18 * H)
    view = FairShareView(s.state)
    assert (view.usage["research/nlp"], view.usage["research/cv"]) == (48 * H, 96 * H)
    assert order(s) == ["nlp-w", "cv-w"]
    assert view.path_ratios("research/nlp/ann") == [
        ("research", 144 * H, 1, F(144 * H)),
        ("research/nlp", 48 * H, 1, F(48 * H)),
        ("research/nlp/ann", 48 * H, 1, F(48 * H)),
    ]
    s.tick(13 * DAY)  # everything slid out: equal ratios and weights, so by path: cv < nlp
    assert order(s) == ["cv-w", "nlp-w"]


def test_top_level_decides_before_lower_levels() -> None:
    """ops/oz used a little, research as a whole used more: every research workload
    follows ops, however under-served its own team is inside research."""
    s = research().submit("r1", "research/cv/ben", gpus=8).place("r1", "n0")
    s.submit("o1", "ops/oz", gpus=1).place("o1", "n1").at(H).finish("r1").finish("o1")
    s.submit("ann", "research/nlp/ann").submit("ben", "research/cv/ben").submit("oz", "ops/oz")
    # ratios: research 8 GPU-h vs ops 1 GPU-h; inside research nlp 0 < cv 8
    assert order(s) == ["oz", "ann", "ben"]


@pytest.mark.parametrize(
    ("wa", "ua", "wb", "ub", "expected"),
    [
        (1, 1, 2, 2, ["b", "a"]),  # twice the weight, twice the usage: tie, larger weight first
        (2, 2, 1, 1, ["a", "b"]),
        (1, 1, 1, 1, ["a", "b"]),  # same weight and usage: by path
        (3, 3, 3, 3, ["a", "b"]),
        (1, 0, 5, 0, ["b", "a"]),  # both idle: ratio 0 ties, larger weight first
        (1, 1, 2, 3, ["a", "b"]),  # 1/1 < 3/2
        (2, 1, 1, 1, ["a", "b"]),  # 1/2 < 1/1
    ],
    ids=[
        "2w-2u-ties",
        "2w-2u-ties-mirrored",
        "equal-by-path",
        "equal-heavier",
        "idle-ties",
        "usage-decides",
        "weight-decides",
    ],
)
def test_sibling_ties(wa, ua, wb, ub, expected) -> None:
    """Usage in GPU-hours: each team runs ``u`` GPUs for one hour."""
    s = Scenario().tree(("a", wa), ("b", wb)).nodes("n", 2)
    for team, gpus in (("a", ua), ("b", ub)):
        if gpus:
            s.submit(f"{team}-run", team, gpus=gpus).place(f"{team}-run", f"n{'ab'.index(team)}")
    s.at(H).tick()
    for team, gpus in (("a", ua), ("b", ub)):
        if gpus:
            s.finish(f"{team}-run")
    s.submit("b", "b").submit("a", "a")
    assert order(s) == expected
    assert FairShareView(s.state).ratio("a") == F(ua * H, wa)


def test_priority_only_sorts_inside_a_leaf() -> None:
    s = (
        Scenario()
        .tree("x", "y")
        .nodes("n", 1)
        .submit("yrun", "y", gpus=4)
        .place("yrun", "n0")
        .at(H)
        .finish("yrun")
    )
    s.submit("y-low", "y", priority=0).submit("x-low", "x", priority=-5).submit(
        "y-high", "y", priority=100
    )
    s.after(1).submit("x-high", "x", priority=1)
    # x is under-served: all of x first, whatever y's priorities; inside each leaf priority first
    assert order(s) == ["x-high", "x-low", "y-high", "y-low"]


def test_inside_a_leaf_priority_then_submit_time_then_id() -> None:
    s = Scenario().tree("t").nodes("n", 1)
    s.at(10).submit("b", "t").submit("a", "t").at(5).submit("late-stamp", "t")  # folds at 10
    s.at(20).submit("c", "t").submit("p", "t", priority=1).at(30).submit("q", "t", priority=1)
    assert order(s) == ["p", "q", "a", "b", "late-stamp", "c"]


def test_allocated_before_unallocated() -> None:
    """An unallocated workload of an idle team submitted first still follows every allocated one."""
    s = Scenario().tree("busy", "idle").nodes("n", 1)
    s.submit("run", "busy", gpus=8).place("run", "n0").at(H).finish("run")
    s.submit("free-early", "idle", min_runtime_ms=0).after(1).submit("busy-w", "busy")
    assert order(s) == ["busy-w", "free-early"]


def test_unallocated_by_submit_time_then_id_ignoring_team_and_priority() -> None:
    s = Scenario().tree("busy", "idle").nodes("n", 1)
    s.submit("run", "busy", gpus=8).place("run", "n0").at(H).finish("run")
    s.submit("u2", "idle", min_runtime_ms=0, priority=9).submit("u1", "busy", min_runtime_ms=0)
    s.after(1).submit("u0", "idle", min_runtime_ms=0, priority=99)
    assert order(s) == ["u1", "u2", "u0"]


@pytest.mark.parametrize("min_runtime", [H, 0], ids=["allocated", "unallocated"])
def test_requeued_work_keeps_its_original_submit_time(min_runtime) -> None:
    s = Scenario().tree("t").nodes("n", 1)
    s.at(0).submit("old", "t", gpus=8, min_runtime_ms=min_runtime).place("old", "n0")
    s.at(5).submit("new", "t", min_runtime_ms=min_runtime).at(10).tick().preempt(
        "old", requeued=True
    )
    assert s.state.pending["old"].queued_ms == 10 and s.state.pending["old"].submitted_ms == 0
    assert order(s) == ["old", "new"]


def test_ranks_and_keys() -> None:
    s = research().submit("r", "research/cv/ben", gpus=2).place("r", "n0").at(H).tick()
    view = FairShareView(s.state)
    assert {p: view.rank(p) for p in s.state.budget.nodes} == {
        "": 0,
        "research": 1,
        "ops": 0,
        "research/nlp": 0,
        "research/cv": 1,
        "research/nlp/ann": 0,
        "research/cv/ben": 0,
        "ops/oz": 0,
    }
    # leaves in fair-share order: ops/oz, research/nlp/ann, research/cv/ben
    positions = [view.leaf_position(p) for p in ("ops/oz", "research/nlp/ann", "research/cv/ben")]
    assert positions == sorted(positions) and len(set(positions)) == 3
    assert view.leaf_position("research") == -1


def test_the_walk_re_ranks_after_each_charge() -> None:
    """Two idle teams of equal weight: with nothing charged, a's workloads all come
    first (ties by path); charging each workload as it comes alternates the teams."""
    s = Scenario().tree("a", "b").nodes("n", 1)
    for i in range(2):
        s.submit(f"a{i}", "a", gpus=1).submit(f"b{i}", "b", gpus=1)
    assert order(s) == ["a0", "a1", "b0", "b1"]
    walk = FairShareWalk(s.state, FairShareView(s.state))
    seen = []
    for w in walk:
        seen.append(w.id)
        walk.charge(w)
    assert seen == ["a0", "b0", "a1", "b1"]
    assert walk.usage["a"] == walk.usage["b"] == 2 * H


def test_queue_order_matches_the_literal_definition_on_a_busy_history() -> None:
    s = research().tree(("ops/ozzy", 3), ("research/cv/bea", 2))
    leaves = ["research/nlp/ann", "research/cv/ben", "research/cv/bea", "ops/oz", "ops/ozzy"]
    for i in range(40):
        s.at(i * 3 * H).tick()
        wid = f"w{i}"
        s.submit(wid, leaves[i % 5], gpus=1 + i % 8, min_runtime_ms=(i % 4) * H, priority=i % 3)
        if i % 3 != 2:
            node = f"n{i % 8}"
            if s.state.nodes[node].free >= s.state.pending[wid].gpus:
                s.place(wid, node)
        if i % 5 == 4:
            for r in list(s.state.running)[:2]:
                s.finish(r)
        assert order(s) == reference_order(s.state), i


@pytest.mark.parametrize(
    ("cand", "victim", "margin_ppm", "expected"),
    [
        (F(94), F(100), 50_000, True),
        (F(95), F(100), 50_000, False),  # exactly (1 - 5%) x 100 is not clearly below
        (F(0), F(0), 50_000, False),
        (F(0), F(1, 10**9), 0, True),
        (F(1, 3), F(1, 3), 0, False),
    ],
    ids=["below", "at-margin", "both-zero", "zero-margin", "equal"],
)
def test_clearly_below_is_exact(cand, victim, margin_ppm, expected) -> None:
    """The margin test on ``usage / weight`` pairs, cross-multiplied."""
    args = (cand.numerator, cand.denominator, victim.numerator, victim.denominator, margin_ppm)
    assert clearly_below_pair(*args) is expected
    assert ratio(6, 4) == F(3, 2)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(0, 3), st.integers(1, 9)),
        min_size=1,
        max_size=14,
    )
)
def test_leaf_positions_order_leaves_as_their_rank_tuples_do(spec) -> None:
    """The position of a leaf (one number per leaf, read from its path's families)
    orders the leaves exactly as sorting every leaf by the ranks of its ancestors
    and its own does, whatever the tree's shape and usage."""
    s = Scenario()
    made: list[str] = []
    for parent_pick, weight, _, _ in spec:
        parent = made[parent_pick % len(made)] if made and parent_pick else ""
        path = f"{parent}/n{len(made)}" if parent else f"n{len(made)}"
        s.budget(path, weight)
        made.append(path)
    s.nodes("h", 2)
    leaves = s.state.budget.leaves()
    for i, (_, _, pick, gpus) in enumerate(spec):
        leaf = leaves[pick % len(leaves)]
        s.submit(f"w{i}", leaf, gpus=min(gpus, 8), min_runtime_ms=0)
        if s.state.nodes[f"h{i % 2}"].free >= min(gpus, 8):
            s.place(f"w{i}", f"h{i % 2}")
        s.after(H // 7)
    s.tick()
    view = FairShareView(s.state)

    def ranks(leaf: str) -> tuple[int, ...]:
        return tuple(view.rank(p) for p in [*ancestors_of(leaf)[1:], leaf])

    by_position = sorted(leaves, key=view.leaf_position)
    assert by_position == sorted(leaves, key=ranks)
    assert len({view.leaf_position(p) for p in leaves}) == len(leaves)
    assert all(view.leaf_position(p) >= 0 for p in leaves)


def test_view_usage_is_computed_on_first_read_and_equals_the_windows() -> None:
    """The view computes a node's usage when first read (a cycle reads a few
    families): every node reads as its window plus its commitment, ``get`` computes
    too, a path outside the tree gets the default, and the working copy starts
    from the view's usage and takes charges without changing it."""
    s = research().submit("old", "research/nlp/ann", gpus=8).place("old", "n0")
    s.at(DAY).finish("old").submit("now", "research/cv/ben", gpus=8, min_runtime_ms=H)
    s.place("now", "n1").tick(DAY + 10 * 60_000)
    state = s.state
    view = FairShareView(state)
    assert dict(view.usage) == {}  # nothing read yet
    now, lookback = state.now_ms, state.policy.lookback_ms
    for path, node in state.budget.nodes.items():
        charged = node.charged(now, lookback)
        assert view.charged.get(path) == charged
        assert view.usage[path] == charged + view.committed.get(path, 0)
    assert view.committed["research/cv/ben"] == 8 * 50 * 60_000
    assert view.usage.get("no/such", -1) == -1 and "no/such" not in view.usage
    working = view.working()
    working["research"] += 5
    assert working["research"] == view.usage["research"] + 5
    assert working["ops"] == view.usage["ops"]
