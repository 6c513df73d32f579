"""A cycle with nothing to decide is not assembled (core/cycle/idle.py), and that
changes no result: random histories, each cycle run both ways (the state machine
of test_cycle_properties.py does the same at every step)."""

from __future__ import annotations

import random

from apportion.core import apply, fold
from apportion.core.cycle import Cycle, decide
from apportion.core.cycle.idle import idle
from apportion.schemas.events import (
    ClockTicked,
    Event,
    NodeHealthChanged,
    PolicySet,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadSubmitted,
)

from . import builders
from .test_cycle_properties import LEAVES, setup_events


def _history(seed: int) -> tuple[int, int]:
    """A random history (submissions valid and not, finishes, cancels, notices, drains,
    nodes down and back, late inputs), every cycle run with and without the shortcut;
    returns how many cycles took it and how many did not."""
    rng = random.Random(seed)
    s = fold(setup_events())
    now = 0
    taken = whole = 0
    for i in range(300):
        r = rng.random()
        e: Event
        if r < 0.3:
            e = WorkloadSubmitted(
                id=f"s{i}",
                at_ms=now,
                workload=f"w{i}",
                owner=rng.choice([*LEAVES, "nope"]),
                gpus=rng.choice([1, 2, 4, 8, 16]),
                min_runtime_ms=rng.choice([0, 600_000, 3_600_000]),
                priority=rng.randint(0, 2),
                submitted_by="root",
                grace_ms=rng.choice([None, 0, 120_000]),
            )
        elif r < 0.65 and s.running:
            e = WorkloadFinished(
                id=f"f{i}",
                at_ms=now,
                actor="root",
                outcome=rng.choice(["succeeded", "failed"]),
                workload=sorted(s.running)[rng.randrange(len(s.running))],
            )
        elif r < 0.7 and s.pending:
            e = WorkloadCancelled(
                id=f"c{i}", at_ms=now, actor="root", workload=sorted(s.pending)[0]
            )
        elif r < 0.75:
            e = NodeHealthChanged(
                id=f"h{i}",
                at_ms=now,
                node=rng.choice(["n1", "n2", "n3", "g1"]),
                state=rng.choice(["healthy", "healthy", "draining", "down"]),
                actor="root",
            )
        elif r < 0.78:
            e = PolicySet(
                id=f"p{i}",
                at_ms=now,
                actor="root",
                preemption_margin_ppm=50_000,
                grace_ms=rng.choice([0, 120_000]),
            )
        elif r < 0.82:
            e = ClockTicked(id=f"l{i}", at_ms=max(0, now - rng.randint(0, 3_600_000)))  # late
        else:
            now += rng.randint(0, 3_600_000)
            e = ClockTicked(id=f"t{i}", at_ms=now)
        apply(s, e)
        plain = Cycle(s).run()
        short = idle(s)
        if short is not None:
            taken += 1
            assert short == plain == Cycle(s).run(report_reservation=True)
        else:
            whole += 1
        result = decide(s)
        assert result == plain
        for d in result.decisions:
            apply(s, d)
    return taken, whole


def test_a_cycle_with_nothing_to_decide_gives_the_whole_cycles_result() -> None:
    taken = whole = 0
    for seed in range(12):
        t, w = _history(seed)
        taken += t
        whole += w
    assert taken > 100 and whole > 100  # both kinds of cycle were compared


def test_a_notice_still_running_is_the_wake_up_of_a_cycle_with_nothing_to_decide() -> None:
    """Free work stops with notice for allocated work, which is then cancelled: the
    queue is empty while the notice runs, and the idle cycle wakes up at its end,
    as the whole cycle does."""
    state = builders.Cluster().team("a", 1).team("b", 1).nodes(1).policy(grace_ms=120_000).state()
    builders.submit(state, "free", "b", 8, 0)
    for d in decide(state).decisions:
        apply(state, d)
    builders.submit(state, "big", "a", 8, builders.HOUR, at_ms=builders.MIN)
    result = decide(state)
    assert builders.preempted(result) == {"free": "unallocated"}
    for d in result.decisions:
        apply(state, d)
    assert state.stop_deadlines == [(builders.MIN + 120_000, "free")]
    apply(state, WorkloadCancelled(id="c", at_ms=2 * builders.MIN, actor="root", workload="big"))
    short = idle(state)
    assert short is not None and short.next_wakeup_ms == builders.MIN + 120_000
    assert short == Cycle(state).run() == decide(state)
