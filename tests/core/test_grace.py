"""Preemption with notice (grace): docs/semantics.md, "Preemption notice (grace)".

Each test folds a small history by hand and runs the real cycle (``step``), so
the fold and the cycle are checked together: a run preempted with notice keeps
its GPUs and its charge until its deadline (or its executor's report), then the
preemption's outcome applies; its beneficiary waits and preempts nobody else.
"""

from __future__ import annotations

import pytest
from apportion.core import State, apply, fold
from apportion.core.cycle import CycleResult, decide, step
from apportion.core.estimate import estimate_starts
from apportion.core.state import CorruptHistory
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    Event,
    NodeDrained,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadSubmitted,
)

S = 1000
MIN = 60 * S
HOUR = 60 * MIN
GRACE = 2 * MIN


def cluster(nodes: int = 1, **policy: object) -> State:
    """Teams ``a`` and ``b`` (weight 1 each, owned by root), ``nodes`` x 8 GPUs, margin 0."""
    events: list[Event] = [
        BudgetSet(id="b0", at_ms=0, path="", weight=1, owner="root", actor="root"),
        BudgetSet(id="b1", at_ms=0, path="a", weight=1, owner="root", actor="root"),
        BudgetSet(id="b2", at_ms=0, path="b", weight=1, owner="root", actor="root"),
    ]
    for i in range(1, nodes + 1):
        events.append(
            NodeRegistered(id=f"n{i}", at_ms=0, node=f"n{i}", gpus=8, gpu_type="h100", actor="root")
        )
    policy.setdefault("preemption_margin_ppm", 0)
    events.append(PolicySet(id="p", at_ms=0, actor="root", **policy))  # type: ignore[arg-type]
    state = fold(events)
    assert not state.rejections
    return state


def submit(
    state: State, wid: str, owner: str, gpus: int = 8, min_runtime_ms: int = 10 * MIN, **kw: object
) -> None:
    apply(
        state,
        WorkloadSubmitted(
            id=f"s-{wid}",
            at_ms=state.now_ms,
            workload=wid,
            owner=owner,
            gpus=gpus,
            min_runtime_ms=min_runtime_ms,
            submitted_by="root",
            **kw,  # type: ignore[arg-type]
        ),
    )


def tick(state: State, at_ms: int) -> None:
    apply(state, ClockTicked(id=f"t-{at_ms}-{state.input_seq}", at_ms=at_ms))


def finished(
    state: State, wid: str, outcome: str, attempt: int | None = 1, node: str = "n1"
) -> None:
    apply(
        state,
        WorkloadFinished(
            id=f"f-{wid}-{state.input_seq}",
            at_ms=state.now_ms,
            workload=wid,
            outcome=outcome,  # type: ignore[arg-type]
            attempt=attempt,
            actor=f"agent:{node}",
        ),
    )


def kinds(result: CycleResult) -> list[tuple[str, str]]:
    return [
        (type(d).__name__, getattr(d, "workload", getattr(d, "node", ""))) for d in result.decisions
    ]


def preemptions(result: CycleResult) -> list[WorkloadPreempted]:
    return [d for d in result.decisions if isinstance(d, WorkloadPreempted)]


def noticed(grace: int = GRACE, nodes: int = 1) -> tuple[State, CycleResult]:
    """``a1`` (team a, 8 GPUs) runs from 0 on n1; at 1 h ``b1`` (team b) preempts it
    for fair share with ``grace`` notice."""
    state = cluster(nodes, grace_ms=grace)
    submit(state, "a1", "a")
    assert kinds(step(state)) == [("WorkloadPlaced", "a1")]
    tick(state, HOUR)
    submit(state, "b1", "b")
    return state, step(state)


def test_grace_zero_is_todays_behaviour() -> None:
    state, result = noticed(grace=0)
    assert kinds(result) == [("WorkloadPreempted", "a1"), ("WorkloadPlaced", "b1")]
    assert preemptions(result)[0].grace_ms == 0
    assert state.status_of("a1") == "pending" and not state.stop_deadlines
    assert state.running["b1"].placement[0].node == "n1"


def test_fairshare_with_grace_holds_the_gpus_until_the_deadline_then_requeues() -> None:
    state, result = noticed()
    (p,) = preemptions(result)
    assert (p.workload, p.reason, p.requeued, p.for_workload, p.grace_ms) == (
        "a1",
        "fairshare",
        True,
        "b1",
        GRACE,
    )
    assert kinds(result) == [("WorkloadPreempted", "a1")]  # b1 waits for the GPUs
    assert result.next_wakeup_ms == HOUR + GRACE
    a1 = state.running["a1"]
    assert a1.stopping is not None and a1.stopping.until_ms == HOUR + GRACE
    assert state.nodes["n1"].free == 0 and state.stop_deadlines == [(HOUR + GRACE, "a1")]
    # nothing changes during the notice
    tick(state, HOUR + MIN)
    assert kinds(step(state)) == []
    assert state.usage("a") == 8 * (HOUR + MIN)  # still charged
    # a later input moves time past the deadline: the stop ended exactly at it
    tick(state, HOUR + 5 * MIN)
    a1 = state.workloads["a1"]
    assert a1.status == "pending" and a1.stopping is None and not state.stop_deadlines
    assert a1.run_ms == HOUR + GRACE  # progress includes the notice
    assert a1.queued_ms == HOUR + GRACE and a1.submitted_ms == 0 and a1.preemptions == 1
    assert state.usage("a") == 8 * (HOUR + GRACE)  # charged through the deadline, no further
    assert state.nodes["n1"].free == 8
    result = step(state)
    assert kinds(result) == [("WorkloadPlaced", "b1")]


def test_the_beneficiary_preempts_no_second_victim_set_during_the_notice() -> None:
    state = cluster(2, grace_ms=GRACE)
    submit(state, "a1", "a")
    submit(state, "a2", "a")
    assert kinds(step(state)) == [("WorkloadPlaced", "a1"), ("WorkloadPlaced", "a2")]
    tick(state, HOUR)
    submit(state, "b1", "b")
    first = step(state)
    assert [(p.workload, p.grace_ms) for p in preemptions(first)] == [("a1", GRACE)]
    for t in (HOUR + 1, HOUR + MIN, HOUR + GRACE - 1):
        tick(state, t)
        assert kinds(step(state)) == []  # a2 is as preemptible as a1 was: left alone
    assert state.running["a2"].stopping is None
    tick(state, HOUR + GRACE)  # the wake-up
    assert kinds(step(state)) == [("WorkloadPlaced", "b1")]
    assert state.running["b1"].placement[0].node == "n1"
    assert "a2" in state.running


def test_the_nodes_the_beneficiary_waits_for_take_no_other_work() -> None:
    state = cluster(1, grace_ms=GRACE)
    submit(state, "a1", "a", gpus=4)
    assert kinds(step(state)) == [("WorkloadPlaced", "a1")]
    tick(state, HOUR)
    submit(state, "b1", "b")  # needs the whole node: 4 free + a1's 4
    assert kinds(step(state)) == [("WorkloadPreempted", "a1")]
    submit(state, "u1", "a", gpus=4, min_runtime_ms=0)  # would fit on the 4 free GPUs
    submit(state, "a3", "a", gpus=4)
    assert kinds(step(state)) == []
    tick(state, HOUR + GRACE)
    assert kinds(step(state)) == [("WorkloadPlaced", "b1")]


def test_an_early_failed_report_frees_the_gpus_then_a_second_report_is_stale() -> None:
    state, _ = noticed()
    tick(state, HOUR + 30 * S)
    finished(state, "a1", "failed")
    a1 = state.workloads["a1"]
    assert a1.status == "pending" and a1.run_ms == HOUR + 30 * S
    assert state.nodes["n1"].free == 8 and state.usage("a") == 8 * (HOUR + 30 * S)
    assert not state.rejections and not state.stop_deadlines
    result = step(state)
    assert kinds(result) == [("WorkloadPlaced", "b1")]
    assert result.decisions[0].at_ms == HOUR + 30 * S
    finished(state, "a1", "failed")  # the agent reports again
    assert state.rejections and "stale" in state.rejections[-1][1]
    assert state.workloads["a1"].status == "pending"


def test_a_run_that_succeeds_during_its_notice_ends_succeeded() -> None:
    state, _ = noticed()
    tick(state, HOUR + MIN)
    finished(state, "a1", "succeeded")
    assert state.status_of("a1") == "succeeded" and not state.stop_deadlines
    assert state.usage("a") == 8 * (HOUR + MIN)
    assert kinds(step(state)) == [("WorkloadPlaced", "b1")]


def test_a_report_for_another_attempt_during_the_notice_is_stale() -> None:
    state, _ = noticed()
    finished(state, "a1", "failed", attempt=2)
    assert "attempt 2" in state.rejections[-1][1]
    assert state.running["a1"].stopping is not None


def test_a_non_resumable_run_ends_preempted_when_its_notice_ends() -> None:
    state = cluster(1, grace_ms=GRACE)
    submit(state, "a1", "a", resumable=False)
    step(state)
    tick(state, HOUR)
    submit(state, "b1", "b")
    (p,) = preemptions(step(state))
    assert not p.requeued and p.grace_ms == GRACE
    assert state.status_of("a1") == "running"
    tick(state, HOUR + GRACE)
    assert state.status_of("a1") == "preempted"


def test_a_workloads_own_grace_overrides_the_policy() -> None:
    state = cluster(1)  # policy grace 0
    submit(state, "u1", "a", min_runtime_ms=0, grace_ms=30 * S)
    step(state)
    tick(state, HOUR)
    submit(state, "b1", "b")
    result = step(state)
    (p,) = preemptions(result)
    assert (p.reason, p.grace_ms) == ("unallocated", 30 * S)
    assert result.next_wakeup_ms == HOUR + 30 * S
    submit(state, "b2", "b", grace_ms=0)  # 0: preempted at once, whatever the policy
    assert state.workloads["b2"].grace_ms == 0


def test_drain_with_grace_waits_for_the_stop_before_the_node_is_drained() -> None:
    state = cluster(1, grace_ms=GRACE)
    submit(state, "a1", "a")
    step(state)
    tick(state, HOUR)
    apply(state, NodeHealthChanged(id="h1", at_ms=HOUR, node="n1", state="draining", actor="root"))
    result = step(state)
    assert [(p.reason, p.grace_ms) for p in preemptions(result)] == [("drain", GRACE)]
    assert not any(isinstance(d, NodeDrained) for d in result.decisions)
    assert result.next_wakeup_ms == HOUR + GRACE
    tick(state, HOUR + MIN)
    assert kinds(step(state)) == []  # still stopping: not drained, not preempted again
    tick(state, HOUR + GRACE)
    assert kinds(step(state)) == [("NodeDrained", "n1")]
    assert state.workloads["a1"].status == "pending"


def test_a_node_going_down_ends_the_stop_at_once() -> None:
    state, _ = noticed()
    tick(state, HOUR + MIN)
    apply(
        state, NodeHealthChanged(id="h1", at_ms=HOUR + MIN, node="n1", state="down", actor="root")
    )
    result = step(state)
    (p,) = preemptions(result)
    assert (p.workload, p.reason, p.grace_ms, p.requeued) == ("a1", "node_down", 0, True)
    a1 = state.workloads["a1"]
    assert a1.status == "pending" and a1.run_ms == HOUR + MIN and a1.preemptions == 1
    assert not state.stop_deadlines and state.nodes["n1"].free == 8
    assert result.next_wakeup_ms is None


def test_a_cancel_during_the_notice_ends_it_at_once() -> None:
    state, _ = noticed()
    tick(state, HOUR + MIN)
    apply(state, WorkloadCancelled(id="c1", at_ms=HOUR + MIN, workload="a1", actor="root"))
    assert state.status_of("a1") == "cancelled" and not state.stop_deadlines
    assert state.nodes["n1"].free == 8 and state.usage("a") == 8 * (HOUR + MIN)
    assert kinds(step(state)) == [("WorkloadPlaced", "b1")]


def test_a_second_preemption_of_a_stopping_run_is_a_corrupt_history() -> None:
    state, _ = noticed()
    with pytest.raises(CorruptHistory, match="already stopping"):
        apply(
            state,
            WorkloadPreempted(
                id="x", at_ms=HOUR, workload="a1", reason="fairshare", requeued=True, grace_ms=0
            ),
        )


def test_grace_over_the_cap_is_refused() -> None:
    state = cluster(1, max_grace_ms=5 * MIN)
    submit(state, "a1", "a", grace_ms=5 * MIN + 1)
    assert "grace must be between 0 and 5 min" in state.rejections[-1][1]
    assert "a1" not in state.workloads
    submit(state, "a2", "a", grace_ms=5 * MIN)
    assert "a2" in state.workloads
    apply(state, PolicySet(id="p2", at_ms=0, actor="root", grace_ms=2 * MIN, max_grace_ms=MIN))
    assert "must not exceed max_grace" in state.rejections[-1][1]
    assert state.policy.grace_ms == 0 and state.policy.max_grace_ms == 5 * MIN


def test_policy_fields_are_folded() -> None:
    state = cluster(1, grace_ms=GRACE, max_grace_ms=10 * MIN, heartbeat_timeout_ms=MIN)
    p = state.policy
    assert (p.grace_ms, p.max_grace_ms, p.heartbeat_timeout_ms) == (GRACE, 10 * MIN, MIN)


def test_the_scheduler_may_mark_a_node_down_but_nothing_else() -> None:
    state = cluster(1)
    apply(
        state, NodeHealthChanged(id="h1", at_ms=0, node="n1", state="draining", actor="scheduler")
    )
    assert "scheduler may not change the health" in state.rejections[-1][1]
    apply(state, NodeHealthChanged(id="h2", at_ms=0, node="n1", state="down", actor="scheduler"))
    assert state.nodes["n1"].health == "down" and len(state.rejections) == 1
    apply(state, NodeHealthChanged(id="h3", at_ms=0, node="n1", state="healthy", actor="scheduler"))
    assert state.nodes["n1"].health == "down" and len(state.rejections) == 2


def test_the_snapshot_restores_the_stop_deadlines() -> None:
    state, _ = noticed()
    copy = State.from_bytes(state.to_bytes())
    assert copy.stop_deadlines == state.stop_deadlines == [(HOUR + GRACE, "a1")]
    assert copy.digest() == state.digest()
    assert decide(copy) == decide(state)
    for s in (state, copy):
        tick(s, HOUR + 3 * MIN)
        step(s)
    assert copy.digest() == state.digest() and "b1" in copy.running


def test_the_deadline_structure_orders_by_time_then_id() -> None:
    state = cluster(3, grace_ms=GRACE)
    for wid in ("a3", "a2", "a1"):
        submit(state, wid, "a")
    step(state)
    tick(state, HOUR)
    submit(state, "b1", "b", gpus=8)
    submit(state, "b2", "b", gpus=8)
    submit(state, "b3", "b", gpus=8)
    step(state)
    assert [wid for _, wid in state.stop_deadlines] == sorted(
        wid for _, wid in state.stop_deadlines
    )
    assert all(until == HOUR + GRACE for until, _ in state.stop_deadlines)
    tick(state, HOUR + GRACE + 1)
    assert not state.stop_deadlines
    placed = [d.workload for d in step(state).decisions if isinstance(d, WorkloadPlaced)]
    assert placed  # the beneficiaries go once the GPUs are back


def test_explain_says_when_a_stopping_run_releases_its_gpus() -> None:
    from apportion.services.views import History, explain

    state, _ = noticed()
    out = explain(state, History(), "a1")
    assert out is not None
    (line,) = [r for r in out["reasons"] if r.startswith("stopping:")]
    assert "with 120 s notice" in line and "01:02:00Z" in line and "at the latest" in line


def test_the_cluster_file_reads_grace_max_grace_and_heartbeat_timeout() -> None:
    from apportion.replay.cluster_file import cluster_from_dict
    from apportion.replay.errors import InputFileError

    doc: dict[str, object] = {
        "cluster": {
            "name": "x",
            "pool": [{"prefix": "n", "count": 1, "gpus_per_node": 8, "gpu_type": "h100"}],
        },
        "policy": {"grace": "2m", "max_grace": "10m", "heartbeat_timeout": "90s"},
        "budget": {"owner": "ops", "a": {"weight": 1, "owner": "a"}},
    }
    policy = cluster_from_dict(doc).events[-1]
    assert isinstance(policy, PolicySet)
    assert (policy.grace_ms, policy.max_grace_ms, policy.heartbeat_timeout_ms) == (
        2 * MIN,
        10 * MIN,
        90 * S,
    )
    doc["policy"] = {"grace": "20m"}  # over the default cap of 15 min
    with pytest.raises(InputFileError, match=r"policy\.grace: must not exceed max_grace \(15m\)"):
        cluster_from_dict(doc)
    doc["policy"] = {"heartbeat_timeout": 60}
    with pytest.raises(InputFileError, match=r"policy\.heartbeat_timeout"):
        cluster_from_dict(doc)


def test_the_estimate_places_the_beneficiary_when_the_notice_ends() -> None:
    """A stopping run ends by its deadline at the latest (even with a longer duration
    hint), and the workload it was preempted for starts then."""
    state = cluster(1, grace_ms=GRACE)
    submit(state, "a1", "a", duration_ms=10 * HOUR)
    step(state)
    tick(state, HOUR)
    submit(state, "b1", "b")
    result = step(state)
    assert state.running["a1"].stopping is not None
    est = estimate_starts(state, next_wakeup_ms=result.next_wakeup_ms)
    assert est.ends["a1"] == HOUR + GRACE
    assert est.starts["b1"] == HOUR + GRACE
