"""Passing over what cannot be placed changes no decision.

A cycle may skip, without a search, the rest of a leaf's queue whose shape
cannot be placed (core/cycle/doomed.py; ``FairShareWalk.skip_doomed``), and
a whole budget node whose pending work all lacks room (core/cycle/prune.py;
``FairShareWalk.prune``). These tests run the same cycles with the skipping on
and off, over random histories with deep leaf queues, and require identical
decisions and wake-ups at every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from apportion.core import State, apply, fold
from apportion.core.cycle import Cycle, CycleResult
from apportion.core.cycle.doomed import DOOM_FROM
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    Decision,
    Event,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    WorkloadFinished,
    WorkloadSubmitted,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import builders

MIN = 60_000
HOUR = 60 * MIN
LEAVES = ("a/x", "a/y", "b/z", "c")


def _setup(margin_ppm: int, reservations: bool, grace_ms: int, margin_wait_ms: int) -> list[Event]:
    ev: list[Event] = [BudgetSet(id="b", at_ms=0, path="", weight=1, owner="root", actor="root")]
    for path, weight in [("a", 3), ("a/x", 1), ("a/y", 2), ("b", 2), ("b/z", 1), ("c", 1)]:
        ev.append(
            BudgetSet(id=f"b-{path}", at_ms=0, path=path, weight=weight, owner="o", actor="root")
        )
    ev.append(
        PolicySet(
            id="p",
            at_ms=0,
            actor="root",
            preemption_margin_ppm=margin_ppm,
            preemption_margin_wait_ms=margin_wait_ms,
            reservations=reservations,
            grace_ms=grace_ms,
        )
    )
    for i in range(4):
        ev.append(
            NodeRegistered(id=f"n{i}", at_ms=0, node=f"h{i}", gpus=8, gpu_type="h100", actor="root")
        )
    for i in range(2):
        ev.append(
            NodeRegistered(id=f"g{i}", at_ms=0, node=f"g{i}", gpus=4, gpu_type="a100", actor="root")
        )
    return ev


SKIPPED: list[int] = []
"""Leaves walked by shape in each cycle with skipping on (the tests check that some were)."""
PRUNED: list[int] = []
"""Budget nodes passed over whole in each cycle with skipping on (likewise)."""


Decided = tuple[tuple[Decision, ...], int | None]
"""A cycle's decisions and wake-up."""


Variant = Callable[[State], Cycle]
"""A cycle on a state, e.g. ``partial(Cycle, pool_bound=Checked)``."""


def alike(state: State, *variants: Variant, report_reservation: bool = False) -> CycleResult:
    """One cycle of each of ``variants`` (of the cycle, with checked or plain
    shortcuts) on ``state``, unchanged: they must give the same result, which is
    returned."""
    first, *rest = (variant(state).run(report_reservation) for variant in variants)
    for other in rest:
        assert other == first
    return first


def decided(result: CycleResult) -> Decided:
    return result.decisions, result.next_wakeup_ms


def _decide(state: State, skip: bool) -> Decided:
    cycle = Cycle(state, skip_doomed=skip)
    result = cycle.run()
    if skip:
        walk = cycle.scratch.walk
        SKIPPED.append(len(walk.merged) if walk is not None else 0)
        PRUNED.append(len(cycle.pruning.pruned))
    return decided(result)


submission = st.tuples(
    st.sampled_from(LEAVES),
    st.sampled_from([1, 1, 2, 3, 4, 8, 16]),
    st.sampled_from(["any", "any", "h100", "a100"]),
    st.sampled_from([0, 10 * MIN, HOUR, 4 * HOUR]),
    st.integers(0, 2),
)


Item = tuple[str, int, str, int, int]
"""A submission: leaf, GPUs, GPU type, minimum runtime, priority."""

histories = st.fixed_dictionaries(
    {
        "margin": st.sampled_from([0, 50_000, 500_000]),
        "margin_wait": st.sampled_from([0, 5 * MIN, 20 * MIN]),
        "reservations": st.booleans(),
        "grace": st.sampled_from([0, 0, 5 * MIN]),
        "first": st.lists(submission, min_size=10, max_size=30),
        "deep": st.lists(submission, min_size=2 * DOOM_FROM, max_size=3 * DOOM_FROM),
        "steps": st.lists(
            st.tuples(
                st.sampled_from(["finish", "tick", "submit", "drain", "down"]),
                st.integers(0, 10**6),
            ),
            min_size=3,
            max_size=12,
        ),
    }
)
"""Random histories: :func:`run_history`'s arguments but ``decide``."""


def run_history(
    decide: Callable[[State], Decided],
    margin: int,
    margin_wait: int,
    reservations: bool,
    grace: int,
    first: list[Item],
    deep: list[Item],
    steps: list[tuple[str, int]],
) -> None:
    """Fill the cluster with ``first``, queue ``deep`` (mostly in one leaf), then take
    ``steps`` (finishes, submissions, drains, nodes going down, ticks), with a cycle
    after each part:
    ``decide(state)`` returns ``(decisions, wake-up)`` (comparing what it likes) and
    its decisions are folded."""
    state = fold(_setup(margin, reservations, grace, margin_wait))
    assert not state.rejections and len(state.nodes) == 6
    n = 0
    t = 0

    def submit(item: Item, at: int) -> None:
        nonlocal n
        leaf, gpus, gpu_type, min_runtime, priority = item
        n += 1
        builders.submit(
            state,
            f"w{n}",
            leaf,
            gpus,
            min_runtime,
            at_ms=at,
            gpu_type=gpu_type,
            priority=priority,
            submitted_by="root",
        )

    def cycle() -> None:
        for d in decide(state)[0]:
            apply(state, d)

    for item in first:  # fill the cluster
        submit(item, t)
    cycle()
    t += 30 * MIN
    for i, item in enumerate(deep):  # then a deep queue, mostly of one leaf
        submit(item if i % 4 == 3 else ("a/x", *item[1:]), t)
    cycle()
    for i, (what, pick) in enumerate(steps):
        t += 20 * MIN
        if what == "finish" and state.running:
            running = sorted(state.running)
            wid = running[pick % len(running)]
            apply(state, WorkloadFinished(id=f"f{i}", at_ms=t, workload=wid, actor="root"))
        elif what == "submit":
            submit(("b/z", 1 + pick % 8, "any", HOUR, pick % 3), t)
        elif what in ("drain", "down"):
            node = f"h{pick % 4}"
            health = "draining" if what == "drain" else "down"
            apply(
                state,
                NodeHealthChanged(id=f"d{i}", at_ms=t, node=node, state=health, actor="root"),
            )
        else:
            apply(state, ClockTicked(id=f"t{i}", at_ms=t))
        cycle()


def _on_equals_off(state: State) -> Decided:
    on = _decide(state, True)
    assert on == _decide(state, False)
    return on


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=histories)
def test_skipping_doomed_shapes_changes_no_decision(h: dict[str, Any]) -> None:
    run_history(_on_equals_off, **h)


def test_a_deep_queue_that_cannot_be_placed_is_passed_over_by_shape() -> None:
    """A full cluster and 60 waiting workloads of one leaf that outranks nobody:
    the walk goes over them by shape, and the decisions are the ones of the
    workload-by-workload walk."""
    state = fold(_setup(50_000, True, 0, 0))
    n = 0
    for leaf, gpus in [("c", 8)] * 5:  # c fills every node (8-GPU nodes; a100 too)
        n += 1
        apply(
            state,
            WorkloadSubmitted(
                id=f"s{n}",
                at_ms=0,
                workload=f"w{n}",
                owner=leaf,
                gpus=gpus,
                gpu_type="h100" if n <= 4 else "a100",
                min_runtime_ms=4 * HOUR,
                submitted_by="root",
            ),
        )
    for d in _decide(state, False)[0]:
        apply(state, d)  # type: ignore[arg-type]
    for i in range(60):
        n += 1
        apply(
            state,
            WorkloadSubmitted(
                id=f"s{n}",
                at_ms=MIN,
                workload=f"w{n}",
                owner="a/x",
                gpus=(8, 4, 2, 1)[i % 4],
                min_runtime_ms=HOUR,
                priority=i % 3,
                submitted_by="root",
            ),
        )
    SKIPPED.clear()
    assert _decide(state, True) == _decide(state, False)
    assert SKIPPED == [1]  # a/x was walked by shape


def test_the_property_test_walked_by_shape() -> None:
    """The random histories above did exercise the skipping (not vacuous): leaves
    walked by shape, and budget nodes passed over whole."""
    SKIPPED.clear()
    PRUNED.clear()
    test_skipping_doomed_shapes_changes_no_decision()
    assert sum(SKIPPED) > 0
    assert sum(PRUNED) > 0


def test_a_workload_with_runs_stopping_for_it_is_never_passed_over() -> None:
    """``w`` preempted unallocated work with notice on h002 and waits for it to
    stop; h002 has 2 GPUs free meanwhile, h001 is protected. In the next cycle a
    16-GPU workload fails first (so the walk may pass over whole budget nodes),
    and ``w``'s team has no room for 8 GPUs now; the walk must still reach ``w``,
    which holds h002, so that ``small`` of a later team does not take its free
    GPUs (it would, were ``w``'s team passed over)."""
    from apportion.core.cycle import step

    from .builders import HOUR, MIN, Cluster, placed, preempted, submit

    s = (
        Cluster()
        .team("a", 1)
        .team("big", 2)
        .team("c", 1)
        .team("e", 1)
        .nodes(2, prefix="h")
        .policy(grace_ms=5 * MIN, reservations=False)
        .state()
    )
    submit(s, "u", "c", 6, 0)  # unallocated: placed after allocated work, on h002
    submit(s, "prot", "c", 8, 4 * HOUR)  # protected, on h001
    step(s)
    assert {w: s.running[w].placement[0].node for w in s.running} == {
        "u": "h002",
        "prot": "h001",
    }
    submit(s, "w", "a", 8, HOUR, at_ms=s.now_ms + MIN)
    first = step(s)
    assert preempted(first) == {"u": "unallocated"} and s.running["u"].stopping is not None
    submit(s, "huge", "big", 16, HOUR, at_ms=s.now_ms + MIN)
    submit(s, "small", "e", 2, HOUR)
    cycle = Cycle(s)
    result = cycle.run()
    assert placed(result) == {}  # h001's free GPUs stay held for w
    assert cycle.scratch.held == {"h002": "w"}
    assert result.decisions == Cycle(s, skip_doomed=False).run().decisions
