"""The level-by-level pool bound of the preemption search equals the plain one.

``_Cycle._pool_short`` decides whether a pool lacks the GPUs a workload asks for
even counting every GPU it could free there, stopping at the first ancestor of
the workload's leaf where an upper bound is already short (core/cycle.py). These
tests check it, at every call made by real cycles over random histories, against
the plain sum over the leaf's victim subtrees, and check that the cycles make
the same decisions as the plain search.
"""

from __future__ import annotations

from apportion.core import State, apply, fold
from apportion.core.cycle import _Cycle
from apportion.schemas.events import (
    ClockTicked,
    NodeHealthChanged,
    WorkloadFinished,
    WorkloadSubmitted,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_skip_doomed import MIN, _setup, submission

CHECKED: list[bool] = []
"""Every answer of the checked bound (the tests require both answers to occur)."""


class _CheckedCycle(_Cycle):
    def _pool_short(self, leaf: str, key: tuple[str, int], g: int) -> bool:
        short = super()._pool_short(leaf, key, g)
        expired = self.pool_expired.get(key, {})
        subtrees = self.victim_subtrees(leaf)
        total = (
            self.pool_free.get(key, 0)
            + self.pool_unalloc.get(key, 0)
            + expired.get(leaf, 0)
            + sum(expired.get(p, 0) for p in subtrees)
        )
        assert short == (total < g), (leaf, key, g, total)
        CHECKED.append(short)
        return short


class _PlainCycle(_Cycle):
    """The search with the plain bound only (its victim subtrees always computed)."""

    def _pool_short(self, leaf: str, key: tuple[str, int], g: int) -> bool:
        expired = self.pool_expired.get(key, {})
        total = (
            self.pool_free.get(key, 0)
            + self.pool_unalloc.get(key, 0)
            + expired.get(leaf, 0)
            + sum(expired.get(p, 0) for p in self.victim_subtrees(leaf))
        )
        return total < g


def _decide(state: State, kind: type[_Cycle]) -> tuple[object, ...]:
    result = kind(state).run()
    return (result.decisions, result.next_wakeup_ms)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    margin=st.sampled_from([0, 50_000, 500_000]),
    reservations=st.booleans(),
    grace=st.sampled_from([0, 0, 5 * MIN]),
    first=st.lists(submission, min_size=10, max_size=30),
    later=st.lists(submission, min_size=5, max_size=40),
    steps=st.lists(
        st.tuples(st.sampled_from(["finish", "tick", "submit", "drain"]), st.integers(0, 10**6)),
        min_size=3,
        max_size=12,
    ),
)
def test_the_pool_bound_is_the_plain_sum_and_changes_no_decision(
    margin: int,
    reservations: bool,
    grace: int,
    first: list[tuple[str, int, str, int, int]],
    later: list[tuple[str, int, str, int, int]],
    steps: list[tuple[str, int]],
) -> None:
    state = fold(_setup(margin, reservations, grace))
    n = 0
    t = 0

    def submit(item: tuple[str, int, str, int, int], at: int) -> None:
        nonlocal n
        leaf, gpus, gpu_type, min_runtime, priority = item
        n += 1
        apply(
            state,
            WorkloadSubmitted(
                id=f"s{n}",
                at_ms=at,
                workload=f"w{n}",
                owner=leaf,
                gpus=gpus,
                gpu_type=gpu_type,
                min_runtime_ms=min_runtime,
                priority=priority,
                submitted_by="root",
            ),
        )

    def cycle() -> None:
        checked = _decide(state, _CheckedCycle)
        assert checked == _decide(state, _PlainCycle) == _decide(state, _Cycle)
        for d in checked[0]:
            apply(state, d)  # type: ignore[arg-type]

    for item in first:  # fill the cluster
        submit(item, t)
    cycle()
    for i, (what, pick) in enumerate(steps):
        t += 20 * MIN
        if what == "finish" and state.running:
            running = sorted(state.running)
            wid = running[pick % len(running)]
            apply(state, WorkloadFinished(id=f"f{i}", at_ms=t, workload=wid, actor="root"))
        elif what == "submit":
            for item in later[pick % len(later) :][:4]:
                submit(item, t)
        elif what == "drain":
            node = f"h{pick % 4}"
            apply(
                state,
                NodeHealthChanged(id=f"d{i}", at_ms=t, node=node, state="draining", actor="root"),
            )
        else:
            apply(state, ClockTicked(id=f"t{i}", at_ms=t))
        cycle()


def test_the_property_test_saw_short_and_roomy_pools() -> None:
    """Runs after the property test (file order): both answers were checked."""
    assert True in CHECKED and False in CHECKED
