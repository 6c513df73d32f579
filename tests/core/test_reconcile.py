"""The one reconcile every executor runs (core/reconcile.py), table-driven: a
history -> the desired runs per host -> the plan against what a runtime holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from apportion.core.reconcile import (
    Ledger,
    Plan,
    Stop,
    desired_runs,
    end_report,
    health_change,
    reconcile,
    start_report_due,
)
from apportion.schemas.events import (
    MINUTE_MS,
    DecisionBatch,
    Event,
    InputRejected,
    NodeDrained,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadStarted,
)
from apportion.schemas.history import BatchItem, HistoryItem, InputItem
from core_builders import ADMIN, Scenario

GRACE = 30_000
DECISIONS = (WorkloadPlaced, WorkloadPreempted, NodeDrained, InputRejected)


def items(events: list[Event]) -> list[HistoryItem]:
    """The scenario's events as history items (each decision a batch of its own)."""
    out: list[HistoryItem] = []
    inputs = batches = 0
    for e in events:
        if isinstance(e, DECISIONS):
            batches += 1
            out.append(BatchItem(seq=batches, batch=DecisionBatch(basis=inputs, decisions=(e,))))
        else:
            inputs += 1
            out.append(InputItem(seq=inputs, at_ms=e.at_ms, ref=e.id, event=e))
    return out


def ledger_of(s: Scenario, hosts: list[str] | None = None) -> Ledger:
    ledger = Ledger(hosts)
    for item in items(s.events):
        ledger(item, s.state, None)
    return ledger


def preempt(s: Scenario, wid: str, grace_ms: int = 0, requeued: bool = True, reason="fairshare"):
    return s.apply(
        WorkloadPreempted(
            id=s._id(),
            at_ms=s.state.now_ms,
            workload=wid,
            reason=reason,
            requeued=requeued,
            grace_ms=grace_ms,
        )
    )


def base() -> Scenario:
    s = Scenario().tree("a", "a/x").nodes("n", 3).policy(grace_ms=GRACE)
    return s.at(MINUTE_MS)


def one_run(s: Scenario) -> Scenario:
    return s.submit("w1", "a/x", gpus=4, duration_ms=10 * MINUTE_MS).place("w1", "n0")


def gang(s: Scenario) -> Scenario:
    return s.submit("g", "a/x", gpus=16).place("g", "n1", "n2")


def noticed(s: Scenario) -> Scenario:
    one_run(s).after(1000).tick()
    return preempt(s, "w1", grace_ms=GRACE)


def finished(s: Scenario) -> Scenario:
    return one_run(s).after(1000).finish("w1")


def requeued(s: Scenario) -> Scenario:
    one_run(s).after(1000).tick()
    return preempt(s, "w1").place("w1", "n1")


def own_grace(s: Scenario) -> Scenario:
    return s.submit("w3", "a/x", gpus=8, min_runtime_ms=0, grace_ms=5_000).place("w3", "n2")


@dataclass
class Case:
    name: str
    history: Callable[[Scenario], Scenario]
    desired: dict[str | None, list[tuple[str, int, str, int, int, bool]]]
    """host (None: every run once) -> (workload, attempt, node, rank, slot GPUs, stopping)"""
    held: dict[str, list[tuple[tuple[str, int], bool]]] = field(default_factory=dict)
    plans: dict[str, Plan] = field(default_factory=dict)


CASES = [
    Case(
        "nothing placed",
        lambda s: s.submit("w1", "a/x", gpus=4),
        {"n0": [], "n1": [], None: []},
        {"n0": []},
        {"n0": Plan()},
    ),
    Case(
        "one run on one host",
        one_run,
        {"n0": [("w1", 1, "n0", 0, 4, False)], "n1": [], None: [("w1", 1, "n0", 0, 4, False)]},
        {"n0": [], "n1": []},
        {"n1": Plan()},
    ),
    Case(
        "a gang: a rank per host, once as its first host",
        gang,
        {
            "n0": [],
            "n1": [("g", 1, "n1", 0, 8, False)],
            "n2": [("g", 1, "n2", 1, 8, False)],
            None: [("g", 1, "n1", 0, 8, False)],
        },
        {"n1": [(("g", 1), False)]},
        {"n1": Plan()},  # held already: nothing to do
    ),
    Case(
        "preempted with notice: the live run gets the notice, an unseen one is not started",
        noticed,
        {"n0": [("w1", 1, "n0", 0, 4, True)], None: [("w1", 1, "n0", 0, 4, True)]},
        {"n0": [(("w1", 1), False)], "n1": []},
        {
            "n0": Plan(
                stop=(
                    Stop(
                        key=("w1", 1), reason="preempted (fairshare)", grace_ms=GRACE, ended=False
                    ),
                )
            ),
            "n1": Plan(),
        },
    ),
    Case(
        "finished: an ended run is gone, a live one is stopped with the workload's notice",
        finished,
        {"n0": [], None: []},
        {"n0": [(("w1", 1), True)], "n1": [(("w1", 1), False)]},
        {
            "n0": Plan(gone=(("w1", 1),)),
            "n1": Plan(
                stop=(Stop(key=("w1", 1), reason="ended", grace_ms=GRACE, ended=True),),
                gone=(("w1", 1),),
            ),
        },
    ),
    Case(
        "requeued elsewhere: the old host stops attempt 1, the new one starts attempt 2",
        requeued,
        {"n0": [], "n1": [("w1", 2, "n1", 0, 4, False)], None: [("w1", 2, "n1", 0, 4, False)]},
        {"n0": [(("w1", 1), False)], "n1": []},
        {
            "n0": Plan(
                stop=(Stop(key=("w1", 1), reason="preempted (fairshare)", grace_ms=0, ended=True),),
                gone=(("w1", 1),),
            ),
        },
    ),
    Case(
        "a workload's own notice",
        own_grace,
        {"n2": [("w3", 1, "n2", 0, 8, False)]},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_desired_runs_per_host(case: Case) -> None:
    s = case.history(base())
    ledger = ledger_of(s)
    for host, want in case.desired.items():
        got = desired_runs(s.state, ledger, host)
        assert [
            (r.workload, r.attempt, r.node, r.rank, r.slot_gpus, r.stopping) for r in got
        ] == want, host
        for r in got:
            w = s.state.running[r.workload]
            assert r.ranks == len(w.placement) and r.master == w.placement[0].node
            assert r.submission is not None and r.submission.workload == r.workload
            assert r.grace_ms == (r.submission.grace_ms or GRACE)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_plan_against_what_a_runtime_holds(case: Case) -> None:
    s = case.history(base())
    for host, held in case.held.items():
        ledger = ledger_of(s, [host])
        plan = reconcile(s.state, ledger, host=host, held=held, done=(), now_ms=s.state.now_ms)
        if host in case.plans:
            assert plan == case.plans[host], host
        held_keys = {k for k, _ in held}
        # whatever it does not hold and should run (not under notice) is started
        want = [
            r.key
            for r in desired_runs(s.state, ledger, host)
            if r.key not in held_keys and not r.stopping
        ]
        assert [r.key for r in plan.start] == want


def test_what_is_left_of_a_notice_after_a_restart_and_the_shorter_of_two_notices() -> None:
    s = noticed(base())
    ledger = ledger_of(s, ["n0"])
    later = s.state.now_ms + 10_000
    plan = reconcile(s.state, ledger, host="n0", held=[(("w1", 1), False)], done=(), now_ms=later)
    assert plan.stop[0].grace_ms == GRACE - 10_000
    preempt(s, "w1", reason="node_down")  # the host lost during the notice: at once
    ledger = ledger_of(s, ["n0"])
    plan = reconcile(s.state, ledger, host="n0", held=[(("w1", 1), False)], done=(), now_ms=later)
    assert plan.stop[0] == Stop(
        key=("w1", 1), reason="preempted (node_down)", grace_ms=0, ended=True
    )


def test_a_run_under_notice_is_taken_over_only_by_a_runtime_that_adopts_it() -> None:
    s = noticed(base())
    ledger = ledger_of(s)
    kw = {"held": [], "done": (), "now_ms": s.state.now_ms}
    assert reconcile(s.state, ledger, host=None, **kw).start == ()
    adopted = reconcile(s.state, ledger, host=None, adopts_under_notice=True, **kw).start
    assert [r.key for r in adopted] == [("w1", 1)]


def test_a_run_done_with_is_never_started_again() -> None:
    s = one_run(base())
    ledger = ledger_of(s, ["n0"])
    plan = reconcile(s.state, ledger, host="n0", held=[], done={("w1", 1)}, now_ms=0)
    assert plan.start == ()


def test_the_preemptions_of_other_hosts_runs_are_not_kept() -> None:
    s = requeued(base())
    assert set(ledger_of(s, ["n2"]).preempted) == set()
    assert set(ledger_of(s, ["n0"]).preempted) == {("w1", 1)}
    assert set(ledger_of(s).preempted) == {("w1", 1)}


def test_the_report_rules() -> None:
    s = gang(base())
    ledger = ledger_of(s)
    key = ("g", 1)
    assert start_report_due(s.state, ledger, key, "n2")
    s.apply(
        WorkloadStarted(
            id="started-g-1-n2", at_ms=s.t, workload="g", attempt=1, node="n2", actor="agent:n2"
        )
    )
    ledger = ledger_of(s)
    assert not start_report_due(s.state, ledger, key, "n2")
    assert start_report_due(s.state, ledger, key, "n1")
    assert end_report(s.state, ledger, key, 1, 0, False) == "rank 0 reports the gang"
    assert end_report(s.state, ledger, key, 1, 0, True) == ""  # lost: reported failed
    assert end_report(s.state, ledger, key, 1, 3, False) == ""  # a failing rank reports at once
    assert end_report(s.state, ledger, key, 0, 0, False) == ""
    assert end_report(s.state, ledger, ("g", 2), 0, 0, False) == "no longer the current run"
    s.apply(WorkloadFinished(id="finished-g-1", at_ms=s.t, workload="g", attempt=1, actor=ADMIN))
    ledger = ledger_of(s)
    assert end_report(s.state, ledger, key, 0, 0, False) == "already reported"


@pytest.mark.parametrize(
    ("health", "by", "probed", "want"),
    [
        ("healthy", "agent:n0", "healthy", "healthy"),  # as it is: nothing to publish
        ("healthy", "agent:n0", "draining", "draining"),
        ("healthy", "agent:n0", "down", "draining"),  # by way of draining
        ("draining", "agent:n0", "down", "down"),
        ("down", "agent:n0", "draining", None),  # never up to draining from down
        ("down", "agent:n0", "healthy", "healthy"),  # its own down
        ("down", "scheduler", "healthy", "healthy"),  # the heartbeat timeout
        ("draining", ADMIN, "healthy", None),  # an operator's drain stands
        ("down", ADMIN, "healthy", None),
    ],
)
def test_the_health_an_agent_may_publish(health: str, by: str, probed, want) -> None:
    s = base()
    if health != "healthy":
        if health == "down" and by != ADMIN:
            s.health("n0", "draining", actor="agent:n0")
        s.health("n0", health, actor=by)  # type: ignore[arg-type]
    ledger = ledger_of(s, ["n0"])
    assert health_change(s.state, ledger, "n0", "agent:n0", probed) == want
    assert health_change(s.state, ledger, "nope", "agent:nope", probed) is None
