"""The "clearly outranks" rule, level by level, is the rule at the first level where
two paths part (core/rules/outranking.py).

The cycle decides every preemption of allocated work through victim subtrees
(the siblings each node on the candidate's path clearly outranks, whole), and
``replay/diagnose.py`` through the three-way standing at the first level where
the paths part. These tests require the two to agree for every pair of leaves
of a random tree with random usage, with and without the cycle's caches.
"""

from __future__ import annotations

from apportion.core import fold
from apportion.core.cycle import Cycle
from apportion.core.rules.outranking import Outranking, Standing, held_to_margin
from apportion.core.state import Policy, Workload
from apportion.schemas.events import BudgetSet, PolicySet
from hypothesis import given, settings
from hypothesis import strategies as st

TREE = [("a", 3), ("a/x", 1), ("a/y", 2), ("a/y/p", 1), ("a/y/q", 1), ("b", 2), ("b/z", 1)]
TREE += [("b/w", 3), ("c", 1)]
PATHS = [p for p, _ in TREE]
LEAVES = [p for p in PATHS if not any(q.startswith(p + "/") for q in PATHS)]


def _state(margin_ppm: int):  # type: ignore[no-untyped-def]
    events = [BudgetSet(id="r", at_ms=0, path="", weight=1, owner="root", actor="root")]
    for path, weight in TREE:
        events.append(
            BudgetSet(id=f"b-{path}", at_ms=0, path=path, weight=weight, owner="o", actor="root")
        )
    events.append(PolicySet(id="p", at_ms=0, actor="root", preemption_margin_ppm=margin_ppm))
    return fold(events)


def _workload(owner: str, priority: int = 0, min_runtime_ms: int = 1) -> Workload:
    return Workload(
        id=f"{owner}-{priority}",
        owner=owner,
        gpus=1,
        gpu_type="any",
        min_runtime_ms=min_runtime_ms,
        resumable=True,
        priority=priority,
        submitted_ms=0,
    )


usages = st.fixed_dictionaries({p: st.integers(0, 50) for p in PATHS})


@settings(max_examples=200, deadline=None)
@given(usage=usages, margin=st.sampled_from([0, 50_000, 500_000]))
def test_victim_subtrees_are_the_first_level_where_the_paths_part(
    usage: dict[str, int], margin: int
) -> None:
    state = _state(margin)
    weight = {p: n.weight for p, n in state.budget.nodes.items()}
    rule = Outranking(state.budget, {"": 0, **usage}, weight, margin)
    cached = Cycle(state).scratch.outranking  # the cycle's, over its working usage
    cached.usage.update(usage)
    for a in LEAVES:
        subtrees = rule.victim_subtrees(a)
        assert cached.victim_subtrees(a) == subtrees
        c = _workload(a)
        for b in LEAVES:
            v = _workload(b)
            standing = rule.standing(c, v)
            if b == a:
                assert standing is Standing.NOT_LOWER  # same leaf, same priority
                assert not rule.may_preempt(c, v, subtrees)
                continue
            outranks = standing is Standing.OUTRANKS
            assert rule.covered(b, subtrees) == outranks, (a, b)
            assert cached.covered(b, subtrees) == outranks, (a, b)
            assert rule.may_preempt(c, v, subtrees) == outranks
            assert rule.may_preempt(c, _workload(b, min_runtime_ms=0), subtrees)  # unallocated
            if margin == 0 and standing is Standing.INSIDE_MARGIN:
                raise AssertionError("no margin: lower is clearly lower")


def test_inside_one_leaf_only_a_higher_priority_outranks() -> None:
    state = _state(50_000)
    weight = {p: n.weight for p, n in state.budget.nodes.items()}
    rule = Outranking(state.budget, dict.fromkeys(weight, 0), weight, 50_000)
    high, low = _workload("c", priority=2), _workload("c", priority=1)
    assert rule.standing(high, low) is Standing.OUTRANKS
    assert rule.standing(low, high) is Standing.NOT_LOWER
    assert rule.may_preempt(high, low, rule.victim_subtrees("c"))
    assert not rule.may_preempt(low, high, rule.victim_subtrees("c"))


def test_the_three_answers() -> None:
    # a/x and a/y part at the second level: a/x's ratio 10/1 against a/y's 30/2 = 15
    state = _state(500_000)
    weight = {p: n.weight for p, n in state.budget.nodes.items()}
    usage = dict.fromkeys(weight, 0) | {"a/x": 10, "a/y": 30}
    c, v = _workload("a/x"), _workload("a/y/p")
    assert Outranking(state.budget, usage, weight, 0).standing(c, v) is Standing.OUTRANKS
    # 10 < (1 - 0.5) * 15 = 7.5 is false: lower, but inside a 50% margin
    assert Outranking(state.budget, usage, weight, 500_000).standing(c, v) is (
        Standing.INSIDE_MARGIN
    )
    assert Outranking(state.budget, usage, weight, 0).standing(v, c) is Standing.NOT_LOWER


def test_held_to_the_margin_until_the_wait_ends() -> None:
    w = Workload(
        id="w",
        owner="a",
        gpus=8,
        gpu_type="h100",
        min_runtime_ms=1,
        resumable=True,
        priority=0,
        submitted_ms=0,
        queued_ms=1_000,
    )
    waited = Policy(preemption_margin_ppm=50_000, preemption_margin_wait_ms=3_600_000)
    assert held_to_margin(waited, w, 1_000 + 3_599_999)
    assert not held_to_margin(waited, w, 1_000 + 3_600_000)
    assert held_to_margin(Policy(preemption_margin_ppm=50_000), w, 10**12)  # 0: always held
    assert not held_to_margin(Policy(preemption_margin_ppm=0, preemption_margin_wait_ms=0), w, 0)
