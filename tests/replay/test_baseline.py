"""The priority baseline (``apportion.replay.baseline``) is pure: a history's
decisions do not depend on what else ran in the process, and its placement is
the budget scheduler's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
from apportion.core.cycle import decide
from apportion.core.fold import apply
from apportion.core.state import State
from apportion.replay.baseline import decide_baseline, default_limits
from apportion.schemas.events import (
    BudgetSet,
    Event,
    NodeRegistered,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadSubmitted,
)

HERE = Path(__file__).resolve().parent


def _setup(*nodes: tuple[str, int, str]) -> list[Event]:
    events: list[Event] = [
        BudgetSet(id="b0", at_ms=0, path="", weight=1, owner="root", actor="root"),
        BudgetSet(id="b1", at_ms=0, path="t", weight=1, owner="root", actor="root"),
    ]
    for name, gpus, gpu_type in nodes:
        events.append(
            NodeRegistered(
                id=f"n-{name}", at_ms=0, node=name, gpus=gpus, gpu_type=gpu_type, actor="root"
            )
        )
    return events


def _submit(workload: str, at_ms: int, gpus: int = 8, gpu_type: str = "any") -> WorkloadSubmitted:
    return WorkloadSubmitted(
        id=f"sub-{workload}",
        at_ms=at_ms,
        workload=workload,
        owner="t",
        gpus=gpus,
        min_runtime_ms=0,
        gpu_type=gpu_type,
        legacy_priority="normal",
        submitted_by="root",
    )


def decisions(first: str, second: str) -> list[str]:
    """One 8-GPU node; ``first`` and ``second`` (8 GPUs each) submitted in that
    order, one cycle with both pending, the placed one finishes, another cycle.
    Every decision as JSON."""
    state = State()
    out: list[str] = []

    def cycle() -> None:
        for d in decide_baseline(state, default_limits(state)).decisions:
            out.append(msgspec.json.encode(d).decode())
            apply(state, d)

    for e in [*_setup(("n1", 8, "h100")), _submit(first, 10), _submit(second, 20)]:
        apply(state, e)
    cycle()
    running = next(iter(state.running))
    apply(
        state,
        WorkloadFinished(id="fin", at_ms=100, workload=running, attempt=1, actor="root"),
    )
    cycle()
    return out


def _in_subprocess(first: str, second: str) -> list[str]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "from test_baseline import decisions; "
        "print(json.dumps(decisions(sys.argv[2], sys.argv[3])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(HERE), first, second],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(done.stdout)


def _placed_first(got: list[str]) -> str:
    return json.loads(got[0])["workload"]


def test_a_history_decides_the_same_alone_after_another_and_in_its_own_process() -> None:
    """Same workload ids, swapped submit order: each history places its earlier
    submission first, whatever ran before it in the process."""
    alone_xy = _in_subprocess("x", "y")
    alone_yx = _in_subprocess("y", "x")
    assert _placed_first(alone_xy) == "x" and _placed_first(alone_yx) == "y"
    assert decisions("x", "y") == alone_xy
    assert decisions("y", "x") == alone_yx
    assert decisions("x", "y") == alone_xy
    assert decisions("y", "x") == decisions("y", "x") == alone_yx


def test_the_baseline_places_by_best_fit_across_pools_like_the_cycle() -> None:
    """An "any" request of 4 GPUs: the a100 node has 8 free, the h100 node 4. The
    cycle's rule (the fewest free GPUs that still fit, across every pool) picks
    the h100 node; the baseline follows it (before sharing the rule it took the
    first pool, ``("a100", 8)``, that had a fit)."""
    state = State()
    for e in [*_setup(("a1", 8, "a100"), ("h1", 8, "h100")), _submit("pre", 0, 4, "h100")]:
        apply(state, e)
    for d in decide_baseline(state, default_limits(state)).decisions:
        apply(state, d)
    assert [s.node for s in state.running["pre"].placement] == ["h1"]
    apply(state, _submit("w", 10, 4))
    for choose in (decide, lambda s: decide_baseline(s, default_limits(s))):
        placed = [d for d in choose(state).decisions if isinstance(d, WorkloadPlaced)]
        assert [(d.workload, [s.node for s in d.placement]) for d in placed] == [("w", ["h1"])]
