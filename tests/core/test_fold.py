"""The fold: workload lifecycle, charging, stale and bad inputs, time, corrupt decisions."""

from __future__ import annotations

from typing import Any

import pytest
from apportion.core import CorruptHistory, State, apply, fold
from apportion.schemas.events import (
    HOUR_MS,
    MINUTE_MS,
    InputRejected,
    NodeDrained,
    Slot,
    WorkloadPlaced,
    WorkloadPreempted,
)
from core_builders import Scenario

H = HOUR_MS


def team() -> Scenario:
    """root -> org (weight 1) -> team -> {alice, bob}; plus a top-level leaf ``solo``.
    Nodes n0, n1 (8 x a100)."""
    return (
        Scenario().tree("org", "org/team", "org/team/alice", "org/team/bob", "solo").nodes("n", 2)
    )


def usage_of(s: Scenario, *paths: str) -> list[int]:
    return [s.state.usage(p) for p in paths]


CHAIN = ("", "org", "org/team", "org/team/alice")

# -- lifecycle ---------------------------------------------------------------------


def test_submit_place_finish() -> None:
    s = (
        team()
        .at(10 * MINUTE_MS)
        .submit("w", "org/team/alice", gpus=4, min_runtime_ms=H, priority=2)
    )
    w = s.state.pending["w"]
    assert (w.status, w.submitted_ms, w.queued_ms, w.attempt, w.first_placed_ms) == (
        "pending",
        10 * MINUTE_MS,
        10 * MINUTE_MS,
        0,
        None,
    )
    assert s.state.status_of("w") == "pending"
    s.at(20 * MINUTE_MS).tick().place("w", "n1")
    w = s.state.running["w"]
    assert (w.status, w.started_ms, w.protected_until_ms, w.attempt, w.first_placed_ms) == (
        "running",
        20 * MINUTE_MS,
        20 * MINUTE_MS + H,
        1,
        20 * MINUTE_MS,
    )
    assert w.placement == (Slot("n1", 4),)
    assert s.state.nodes["n1"].free == 4 and s.state.nodes["n1"].workloads == {"w": 4}
    s.at(80 * MINUTE_MS).finish("w", "failed", attempt=1)
    assert s.state.status_of("w") == "failed"
    assert "w" not in s.state.workloads and "w" not in s.state.running
    assert s.state.nodes["n1"].free == 8 and s.state.nodes["n1"].workloads == {}
    assert usage_of(s, *CHAIN) == [4 * H] * 4  # 4 GPUs for 60 min on the leaf and every ancestor
    assert usage_of(s, "org/team/bob", "solo") == [0, 0]


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_finish_outcome(outcome) -> None:
    s = team().submit("w", "solo").place("w", "n0").after(5).finish("w", outcome)
    assert s.state.ended == {"w": outcome}


def test_cancel_pending() -> None:
    s = team().submit("w", "solo").after(5).cancel("w")
    assert s.state.ended == {"w": "cancelled"} and not s.state.pending
    assert s.state.active_by_owner == {}


def test_cancel_running_charges_until_cancel() -> None:
    s = team().submit("w", "solo", gpus=8).place("w", "n0").after(30 * MINUTE_MS).cancel("w")
    assert s.state.ended == {"w": "cancelled"}
    assert s.state.nodes["n0"].free == 8
    assert usage_of(s, "solo", "") == [8 * 30 * MINUTE_MS] * 2


def test_gang_over_two_nodes() -> None:
    s = team().submit("w", "solo", gpus=16).place("w", "n0", "n1")
    assert [n.free for n in s.state.nodes.values()] == [0, 0]
    s.after(H).finish("w")
    assert [n.free for n in s.state.nodes.values()] == [8, 8]
    assert s.state.usage("solo") == 16 * H


def test_preempt_requeue_keeps_submit_time_and_progress() -> None:
    s = team().at(H).submit("w", "solo", gpus=2, min_runtime_ms=10 * MINUTE_MS)
    s.at(2 * H).tick().place("w", "n0")
    s.at(3 * H).tick().preempt("w", requeued=True)
    w = s.state.pending["w"]
    assert (w.status, w.submitted_ms, w.queued_ms, w.run_ms, w.preemptions, w.attempt) == (
        "pending",
        H,
        3 * H,
        H,
        1,
        1,
    )
    assert (
        w.placement == () and s.state.nodes["n0"].free == 8 and s.state.nodes["n0"].workloads == {}
    )
    s.at(5 * H).tick().place("w", "n1")
    w = s.state.running["w"]
    assert (w.attempt, w.first_placed_ms, w.started_ms, w.protected_until_ms) == (
        2,
        2 * H,
        5 * H,
        5 * H + 10 * MINUTE_MS,
    )
    s.at(5 * H + 30 * MINUTE_MS).finish("w", attempt=2)
    assert s.state.ended["w"] == "succeeded"
    assert w.run_ms == H + 30 * MINUTE_MS
    # charged only while running: 2 GPUs x (1 h + 30 min); nothing while requeued
    assert s.state.usage("solo") == 2 * (H + 30 * MINUTE_MS)


def test_preempt_without_requeue_ends_as_preempted() -> None:
    s = (
        team()
        .submit("w", "solo", resumable=False)
        .place("w", "n0")
        .after(H)
        .tick()
        .preempt("w", requeued=False)
    )
    assert s.state.ended == {"w": "preempted"}
    assert s.state.workloads == {} and s.state.running == {} and s.state.pending == {}
    assert s.state.nodes["n0"].free == 8
    assert s.state.usage("solo") == H


@pytest.mark.parametrize(
    ("min_runtime", "protected_from_place"),
    [(0, 0), (MINUTE_MS, MINUTE_MS), (8 * H, 8 * H)],
    ids=["unallocated", "one-minute", "cap"],
)
def test_protected_until_is_placement_plus_min_runtime(min_runtime, protected_from_place) -> None:
    s = (
        team()
        .at(7 * H)
        .submit("w", "solo", min_runtime_ms=min_runtime)
        .at(9 * H)
        .tick()
        .place("w", "n0")
    )
    assert s.state.running["w"].protected_until_ms == 9 * H + protected_from_place


def test_unallocated_never_charged() -> None:
    s = team().submit("free", "org/team/bob", gpus=8, min_runtime_ms=0).place("free", "n0")
    s.after(5 * H).tick()
    assert not s.state.running["free"].allocated
    assert usage_of(s, "", "org", "org/team", "org/team/bob") == [0, 0, 0, 0]
    s.preempt("free", requeued=True).place("free", "n1").after(H).finish("free")
    assert all(s.state.usage(p) == 0 for p in s.state.budget.nodes)
    assert all(not n.series.times for n in s.state.budget.nodes.values())


def test_charges_overlap_and_sum_up_the_tree() -> None:
    """alice 4 GPUs over [0, 2h], bob 2 GPUs over [1h, 3h], solo 8 GPUs over [0, 1h];
    read at 3 h with a 7-day window."""
    s = team().submit("a", "org/team/alice", gpus=4).submit("b", "org/team/bob", gpus=2)
    s.submit("s", "solo", gpus=8).place("a", "n0").place("s", "n1")
    s.at(H).tick().finish("s").place("b", "n1").at(2 * H).finish("a").at(3 * H).finish("b")
    assert usage_of(s, "org/team/alice", "org/team/bob", "org/team", "org", "solo", "") == [
        8 * H,
        4 * H,
        12 * H,
        12 * H,
        8 * H,
        20 * H,
    ]


def test_three_day_run_slides_out_of_window() -> None:
    day = 24 * H
    s = team().submit("w", "solo", gpus=1).place("w", "n0").at(3 * day).finish("w")
    for now, expected in [(3 * day, 3 * day), (8 * day, 2 * day), (10 * day, 0), (30 * day, 0)]:
        s.tick(now)
        assert s.state.usage("solo") == expected, now


# -- stale inputs --------------------------------------------------------------------

STALE = [
    # (case, setup, stale input, words in the reason)
    (
        "finish-pending",
        lambda s: s.submit("w", "solo"),
        lambda s: s.finish("w"),
        ["is pending, not running", "stale"],
    ),
    (
        "finish-requeued",
        lambda s: s.submit("w", "solo").place("w", "n0").after(1).preempt("w"),
        lambda s: s.finish("w"),
        ["pending, not running"],
    ),
    (
        "finish-ended",
        lambda s: s.submit("w", "solo").place("w", "n0").after(1).finish("w"),
        lambda s: s.finish("w", "failed"),
        ["already ended as succeeded"],
    ),
    (
        "finish-preempted",
        lambda s: s.submit("w", "solo").place("w", "n0").after(1).preempt("w", requeued=False),
        lambda s: s.finish("w"),
        ["already ended as preempted"],
    ),
    ("finish-unknown", lambda s: s, lambda s: s.finish("ghost"), ["unknown workload 'ghost'"]),
    (
        "finish-old-attempt",
        lambda s: (
            s.submit("w", "solo")
            .place("w", "n0")
            .after(1)
            .preempt("w")
            .after(1)
            .tick()
            .place("w", "n1")
        ),
        lambda s: s.finish("w", attempt=1),
        ["attempt 1", "on attempt 2"],
    ),
    (
        "cancel-ended",
        lambda s: s.submit("w", "solo").cancel("w"),
        lambda s: s.cancel("w"),
        ["already ended as cancelled"],
    ),
    (
        "cancel-finished",
        lambda s: s.submit("w", "solo").place("w", "n0").after(1).finish("w"),
        lambda s: s.cancel("w"),
        ["already ended as succeeded"],
    ),
    ("cancel-unknown", lambda s: s, lambda s: s.cancel("ghost"), ["unknown workload"]),
    (
        "resubmit-live-id",
        lambda s: s.submit("w", "solo"),
        lambda s: s.submit("w", "solo"),
        ["already exists"],
    ),
    (
        "resubmit-ended-id",
        lambda s: s.submit("w", "solo").cancel("w"),
        lambda s: s.submit("w", "solo"),
        ["already exists"],
    ),
    ("health-same", lambda s: s, lambda s: s.health("n0", "healthy"), ["already healthy"]),
    ("health-unknown-node", lambda s: s, lambda s: s.health("n9", "down"), ["unknown node 'n9'"]),
    ("register-again", lambda s: s, lambda s: s.node("n0", 8), ["already registered"]),
    (
        "register-resize-busy",
        lambda s: s.submit("w", "solo").place("w", "n0"),
        lambda s: s.node("n0", 4),
        ["running work"],
    ),
    ("register-zero-gpus", lambda s: s, lambda s: s.node("n5", 0), ["gpus must be positive"]),
    ("register-any-type", lambda s: s, lambda s: s.node("n5", 8, "any"), ["real GPU type"]),
    ("register-empty-name", lambda s: s, lambda s: s.node("", 8), ["empty"]),
    (
        "policy-not-root-owner",
        lambda s: s,
        lambda s: s.policy(actor="org-owner"),
        ["does not own the root"],
    ),
    ("policy-zero-lookback", lambda s: s, lambda s: s.policy(lookback_ms=0), ["lookback"]),
    (
        "policy-lookback-over-90d",
        lambda s: s,
        lambda s: s.policy(lookback_ms=91 * 24 * H),
        ["lookback"],
    ),
    (
        "policy-cap-over-lookback",
        lambda s: s,
        lambda s: s.policy(lookback_ms=H, max_min_runtime_ms=2 * H),
        ["max_min_runtime"],
    ),
    (
        "policy-margin-one",
        lambda s: s,
        lambda s: s.policy(preemption_margin_ppm=1_000_000),
        ["margin"],
    ),
]


@pytest.mark.parametrize(
    ("setup", "stale", "words"), [c[1:] for c in STALE], ids=[c[0] for c in STALE]
)
def test_stale_or_bad_input_changes_nothing(setup, stale, words) -> None:
    s = setup(team()).after(MINUTE_MS)
    stale(s.rejects(*words))
    assert s.state.rejections[-1][0] == s.last.id


def test_resize_idle_node_and_accepted_policy() -> None:
    s = (
        team()
        .node("n0", 4, "h100")
        .policy(lookback_ms=H, max_min_runtime_ms=H, preemption_margin_ppm=0)
    )
    assert (s.state.nodes["n0"].gpus, s.state.nodes["n0"].free, s.state.nodes["n0"].gpu_type) == (
        4,
        4,
        "h100",
    )
    assert s.state.pools == {("a100", 8): 1, ("h100", 4): 1}
    assert (s.state.policy.lookback_ms, s.state.policy.preemption_margin_ppm) == (H, 0)
    s.rejects("min_runtime must be between 0 and 1 h (the policy's max_min_runtime), got").submit(
        "w", "solo", min_runtime_ms=H + 1
    )


def test_rejection_is_cleared_by_its_input_rejected_decision() -> None:
    s = team().rejects().cancel("ghost")
    ref = s.last.id
    assert [r for r, _, _ in s.state.rejections] == [ref]
    assert s.code == "unknown_workload"
    s.announce(ref)
    assert s.state.rejections == [] and s.state.decisions_folded == 1


# -- submission validation --------------------------------------------------------


def cluster() -> Scenario:
    """Leaves org/team/alice and solo; pools: 4 x 8 a100, 2 x 4 h100."""
    return team().nodes("a", 2, 8, "a100").nodes("h", 2, 4, "h100")


SUBMISSIONS = [
    # (case, owner, gpus, min_runtime, extra fields, None if accepted else words)
    ("ok-one-gpu", "solo", 1, H, {}, None),
    ("ok-whole-node", "solo", 8, H, {}, None),
    ("ok-two-nodes", "solo", 16, H, {"gpu_type": "a100"}, None),
    ("ok-whole-pool", "solo", 32, H, {}, None),
    ("ok-unallocated", "solo", 1, 0, {}, None),
    ("ok-at-cap", "solo", 1, 8 * H, {}, None),
    ("ok-h100-gang", "solo", 8, H, {"gpu_type": "h100"}, None),
    ("ok-deep-leaf", "org/team/alice", 4, H, {}, None),
    ("unknown-owner", "ghost", 1, H, {}, ["unknown owner 'ghost'"]),
    ("root-owner", "", 1, H, {}, ["unknown owner ''", "leaf"]),
    ("non-leaf-owner", "org/team", 1, H, {}, ["not a leaf"]),
    ("zero-gpus", "solo", 0, H, {}, ["gpus must be positive, got 0"]),
    ("negative-gpus", "solo", -4, H, {}, ["gpus must be positive"]),
    (
        "not-a-multiple",
        "solo",
        12,
        H,
        {"gpu_type": "a100"},
        ["12 GPUs is not a valid gang", "4 x 8 a100"],
    ),
    ("larger-than-pool", "solo", 40, H, {}, ["40 GPUs is not a valid gang"]),
    ("h100-larger-than-pool", "solo", 12, H, {"gpu_type": "h100"}, ["2 x 4 h100"]),
    (
        "unknown-gpu-type",
        "solo",
        1,
        H,
        {"gpu_type": "tpu"},
        ["no nodes of gpu_type 'tpu'", "a100, h100"],
    ),
    ("negative-min-runtime", "solo", 1, -1, {}, ["min_runtime must be between 0 and 8 h"]),
    ("over-cap", "solo", 1, 8 * H + 1, {}, ["min_runtime", "8 h", "got 28800001 ms"]),
    ("negative-duration", "solo", 1, H, {"duration_ms": -5}, ["duration"]),
]


@pytest.mark.parametrize(
    ("owner", "gpus", "min_runtime", "extra", "words"),
    [c[1:] for c in SUBMISSIONS],
    ids=[c[0] for c in SUBMISSIONS],
)
def test_submission_validation(owner, gpus, min_runtime, extra, words) -> None:
    s = cluster()
    if words is None:
        s.submit("w", owner, gpus=gpus, min_runtime_ms=min_runtime, **extra)
        assert s.state.pending["w"].gpus == gpus
    else:
        s.rejects(*words).submit("w", owner, gpus=gpus, min_runtime_ms=min_runtime, **extra)
        assert s.state.status_of("w") is None


def test_submission_empty_id_and_no_nodes() -> None:
    Scenario().tree("t").node("n0").rejects("workload id is empty").submit("", "t")
    Scenario().tree("t").rejects("known types: none").submit("w", "t")


def test_down_nodes_still_count_for_gang_validity() -> None:
    """Validity is about the cluster's shape; a node being down is the cycle's problem."""
    s = cluster().health("a0", "down")
    s.submit("w", "solo", gpus=32, gpu_type="a100")


# -- time ----------------------------------------------------------------------


def test_time_never_goes_backwards() -> None:
    s = team().at(10_000).tick()
    s.at(4_000).submit("late", "solo", gpus=1, min_runtime_ms=H)
    assert s.state.now_ms == 10_000
    assert s.state.pending["late"].submitted_ms == 10_000
    s.at(2_000).tick()
    assert s.state.now_ms == 10_000
    s.place("late", "n0").at(3_000).finish("late")  # ends at 10 000, not 3 000: zero run
    assert s.state.usage("solo") == 0
    assert s.state.input_seq == len(s.events) - 1  # every event but the placement is an input
    assert s.state.decisions_folded == 1


def test_decision_stamped_earlier_folds_at_now() -> None:
    s = team().at(5 * H).submit("w", "solo", gpus=1)
    s.apply(
        WorkloadPlaced(
            id="p",
            at_ms=H,
            workload="w",
            placement=(Slot("n0", 1),),
            allocated=True,
            protected_until_ms=2 * H,
            attempt=1,
        )
    )
    assert s.state.running["w"].started_ms == 5 * H
    assert s.state.running["w"].protected_until_ms == 6 * H  # from the fold's time, not the event's


# -- corrupt decisions -------------------------------------------------------------


def placed(w: str, *slots: tuple[str, int], allocated: bool = True, at: int = 0) -> WorkloadPlaced:
    return WorkloadPlaced(
        id="bad",
        at_ms=at,
        workload=w,
        placement=tuple(Slot(*x) for x in slots),
        allocated=allocated,
        protected_until_ms=0,
        attempt=1,
    )


def base() -> Scenario:
    s = (
        team()
        .node("h0", 4, "h100")
        .submit("w", "solo", gpus=8, gpu_type="a100")
        .submit("u", "solo", gpus=2, min_runtime_ms=0)
    )
    return s.submit("r", "solo", gpus=4).place("r", "n1")


CORRUPT = [
    ("place-unknown-workload", placed("ghost", ("n0", 8)), "not pending"),
    ("place-running-workload", placed("r", ("n0", 4)), "not pending"),
    ("place-allocated-mismatch", placed("u", ("n0", 2)), "against its contract"),
    ("place-unallocated-mismatch", placed("w", ("n0", 8), allocated=False), "against its contract"),
    ("place-too-few-gpus", placed("w", ("n0", 4)), "for 8 GPUs"),
    ("place-too-many-gpus", placed("w", ("n0", 8), ("n1", 4)), "for 8 GPUs"),
    ("place-unknown-node", placed("w", ("n9", 8)), "'n9'"),
    ("place-over-free", placed("w", ("n1", 8)), "cannot take 8"),
    ("place-zero-slot", placed("w", ("n0", 8), ("n1", 0)), "cannot take 0"),
    ("place-same-node-twice", placed("w", ("n0", 4), ("n0", 4)), "names a node twice"),
    ("place-wrong-type", placed("u", ("h0", 2), allocated=False), None),
    ("place-later-than-input", placed("w", ("n0", 8), at=10**12), "later than the input"),
    (
        "preempt-pending",
        WorkloadPreempted(id="bad", at_ms=0, workload="w", reason="fairshare", requeued=True),
        "not running",
    ),
    (
        "preempt-unknown",
        WorkloadPreempted(id="bad", at_ms=0, workload="ghost", reason="fairshare", requeued=True),
        "not running",
    ),
    (
        "drained-healthy-node",
        NodeDrained(id="bad", at_ms=0, node="n0"),
        "not an empty draining node",
    ),
    (
        "drained-unknown-node",
        NodeDrained(id="bad", at_ms=0, node="n9"),
        "not an empty draining node",
    ),
    (
        "rejected-unknown-ref",
        InputRejected(id="bad", at_ms=0, ref="e2", reason="?"),
        "was not rejected",
    ),
]


@pytest.mark.parametrize(("event", "words"), [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_decision_that_cannot_apply_is_corrupt_history(event, words) -> None:
    s = base()
    if words is None:  # placing on the wrong type needs a typed workload
        s.submit("typed", "solo", gpus=2, gpu_type="a100", min_runtime_ms=0)
        event = placed("typed", ("h0", 2), allocated=False)
        words = "wrong GPU type"
    with pytest.raises(CorruptHistory, match=words):
        apply(s.state, event)


@pytest.mark.parametrize("health", ["draining", "down"])
def test_place_on_unschedulable_node_is_corrupt(health) -> None:
    s = base().health("n0", health)
    with pytest.raises(CorruptHistory, match="cannot take"):
        apply(s.state, placed("w", ("n0", 8)))


def test_drained_busy_draining_node_is_corrupt_then_fine_once_empty() -> None:
    s = base().health("n1", "draining")
    with pytest.raises(CorruptHistory):
        apply(s.state, NodeDrained(id="bad", at_ms=0, node="n1"))
    s.preempt("r", reason="drain").drained("n1")
    assert s.state.nodes["n1"].drained
    s.health("n1", "healthy")
    assert not s.state.nodes["n1"].drained


def test_any_type_workload_may_go_anywhere() -> None:
    s = base().place("u", ("h0", 2))
    assert s.state.nodes["h0"].free == 2


def test_fold_equals_apply_one_by_one() -> None:
    s = team().submit("w", "solo").place("w", "n0").after(H).finish("w")
    assert fold(s.events).digest() == s.state.digest()
    assert fold(s.events, State()).digest() == s.state.digest()


def test_apply_refuses_non_events() -> None:
    with pytest.raises(TypeError, match="not an apportion event"):
        not_an_event: Any = Slot("n0", 1)  # the wrong type on purpose
        apply(State(), not_an_event)


# -- parents keep history their children no longer show ------------------------------


def test_removed_child_history_stays_with_its_parent() -> None:
    s = team().submit("w", "org/team/bob", gpus=2).place("w", "n0").at(H).finish("w")
    s.remove("org/team/bob")
    assert usage_of(s, "org/team", "org/team/alice") == [2 * H, 0]  # parent > sum of children
    s.budget("org/team/bob")  # a new bob starts with no history
    assert usage_of(s, "org/team/bob", "org/team", "") == [0, 2 * H, 2 * H]


def test_leaf_with_history_that_gets_children_keeps_it() -> None:
    s = team().submit("w", "solo", gpus=3).place("w", "n0").at(H).finish("w").budget("solo/kid")
    assert usage_of(s, "solo", "solo/kid") == [3 * H, 0]
    s.submit("k", "solo/kid", gpus=1).place("k", "n0").at(2 * H).finish("k")
    assert usage_of(s, "solo", "solo/kid", "") == [4 * H, H, 4 * H]


def test_durations_in_refusals_read_as_a_person_typed_them() -> None:
    from apportion.core.refusals import duration_text

    assert duration_text(32_400_000) == "9 h"
    assert duration_text(5_400_000) == "90 min"
    assert duration_text(250) == "250 ms"
    assert duration_text(-1) == "-1 ms"
    assert duration_text(0) == "0"
    assert duration_text(7 * 86_400_000) == "7 d"
