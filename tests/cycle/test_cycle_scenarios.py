"""Named scenarios for every rule of the scheduling cycle, expectations worked out by hand."""

from __future__ import annotations

import pytest
from apportion.core import State
from apportion.core.cycle import step
from apportion.schemas.events import InputRejected, NodeDrained, WorkloadPlaced, WorkloadPreempted

from .builders import HOUR, MIN, Cluster, finish, health, placed, preempted, submit, tick


def two_teams(nodes: int = 1, **policy: object) -> Cluster:
    c = Cluster().team("a", 1).team("b", 1).nodes(nodes)
    if policy:
        c.policy(**policy)
    return c


# -- placement -----------------------------------------------------------------


def test_best_fit_picks_the_node_with_fewest_free_gpus_that_still_fits():
    s = two_teams(3).state()
    submit(s, "w6", "a", 6, HOUR)
    submit(s, "w4", "b", 4, HOUR)
    step(s)  # w6 -> n001 (2 free left); w4 -> n002 (first empty node, ties by id)
    assert s.nodes["n001"].free == 2 and s.nodes["n002"].free == 4
    submit(s, "w2", "a", 2, HOUR)
    r = step(s)
    assert placed(r) == {"w2": ("n001",)}  # 2 free on n001 beats 4 on n002 and 8 on n003


def test_ties_in_best_fit_break_by_node_id():
    s = two_teams(3).state()
    submit(s, "w", "a", 1, HOUR)
    assert placed(step(s)) == {"w": ("n001",)}


def test_multi_node_gang_takes_whole_free_nodes_all_at_once():
    s = two_teams(3).state()
    submit(s, "small", "a", 1, HOUR)
    step(s)  # n001 now has 7 free
    submit(s, "big", "b", 16, HOUR)
    r = step(s)
    assert placed(r) == {"big": ("n002", "n003")}
    submit(s, "big2", "b", 16, HOUR)
    assert placed(step(s)) == {}  # only n001 is partly free: no partial gang


def test_work_just_placed_counts_its_protection_against_its_team_across_cycles():
    # b ran 1 GPU-h and is idle; a placed 8 GPUs protected for 4 h a minute ago, so
    # it has been charged only 8 GPU-min. Counting the 4 h its contract commits it
    # to, a is the more served, and the one free node goes to b.
    s = two_teams(2).state()
    submit(s, "b-old", "b", 1, HOUR)
    step(s)
    finish(s, "b-old", HOUR)
    submit(s, "a-big", "a", 8, 4 * HOUR)
    step(s)
    tick(s, HOUR + MIN)
    submit(s, "a-next", "a", 8, HOUR)
    submit(s, "b-next", "b", 8, HOUR)
    assert placed(step(s)) == {"b-next": ("n002",)}


def test_gpu_type_is_respected():
    s = Cluster().team("a", 1).nodes(1, gpu_type="a100").nodes(1, gpu_type="h100").state()
    submit(s, "h", "a", 8, HOUR, gpu_type="h100")
    submit(s, "x", "a", 8, HOUR, gpu_type="a100")
    assert placed(step(s)) == {"h": ("n002",), "x": ("n001",)}


@pytest.mark.parametrize("state_", ["draining", "down"])
def test_unhealthy_nodes_take_no_new_work(state_):
    s = two_teams(2).state()
    health(s, "n001", state_)
    submit(s, "w", "a", 8, HOUR)
    submit(s, "v", "b", 8, HOUR)
    r = step(s)
    assert list(placed(r).values()) == [("n002",)]


def test_a_node_back_to_healthy_takes_work_again():
    s = two_teams(1).state()
    health(s, "n001", "down")
    submit(s, "w", "a", 8, HOUR)
    assert placed(step(s)) == {}
    health(s, "n001", "healthy")
    assert placed(step(s)) == {"w": ("n001",)}


# -- the contract ---------------------------------------------------------------


def test_placement_protects_for_min_runtime_and_allocated_flag_follows_the_contract():
    s = two_teams(1).state()
    tick(s, 1000)
    submit(s, "alloc", "a", 4, 30 * MIN)
    submit(s, "free", "b", 4, 0)
    r = step(s)
    by_id = {d.workload: d for d in r.decisions if isinstance(d, WorkloadPlaced)}
    assert by_id["alloc"].allocated and by_id["alloc"].protected_until_ms == 1000 + 30 * MIN
    assert not by_id["free"].allocated and by_id["free"].protected_until_ms == 1000


def test_allocated_work_is_charged_for_all_the_time_it_runs_and_unallocated_never():
    s = two_teams(1).state()
    submit(s, "alloc", "a", 4, 10 * MIN)
    submit(s, "free", "b", 4, 0)
    step(s)
    tick(s, 2 * HOUR)  # runs far past its minimum runtime
    assert s.usage("a") == 4 * 2 * HOUR
    assert s.usage("b") == 0
    assert s.usage("") == 4 * 2 * HOUR


def test_one_under_served_team_cannot_sweep_every_free_gpu_in_one_cycle():
    # Both teams at zero usage; a's first placement adds 8 GPUs x 1 h of projected
    # charge, so b's workload ranks next, then a's again.
    s = two_teams(4).state()
    for i in range(4):
        submit(s, f"a{i}", "a", 8, HOUR, at_ms=0)
    for i in range(4):
        submit(s, f"b{i}", "b", 8, HOUR, at_ms=0)
    r = step(s)
    order = [d.workload for d in r.decisions if isinstance(d, WorkloadPlaced)]
    assert order == ["a0", "b0", "a1", "b1"]  # a first: equal ratio and weight, then path


# -- preemption -------------------------------------------------------------------


def busy_over_served_team(min_runtime: int = HOUR) -> tuple:
    """Team a has run 8 GPUs for 2 h; team b has used nothing."""
    s = two_teams(1).state()
    submit(s, "big", "a", 8, min_runtime)
    step(s)
    tick(s, 2 * HOUR)
    return s


def test_debug_job_of_under_served_team_preempts_expired_job_of_over_served_team():
    s = busy_over_served_team(HOUR)
    submit(s, "debug", "b", 1, 10 * MIN)
    r = step(s)
    assert preempted(r) == {"big": "fairshare"}
    assert placed(r) == {"debug": ("n001",)}
    pre = next(d for d in r.decisions if isinstance(d, WorkloadPreempted))
    assert pre.for_workload == "debug" and pre.requeued
    # requeued with its original submit time and its progress
    assert s.pending["big"].submitted_ms == 0 and s.pending["big"].run_ms == 2 * HOUR


def test_protected_job_is_never_preempted():
    s = busy_over_served_team(8 * HOUR)  # protected until 8 h; now is 2 h
    submit(s, "debug", "b", 1, 10 * MIN)
    r = step(s)
    assert preempted(r) == {} and placed(r) == {}
    assert r.next_wakeup_ms == 8 * HOUR  # the protection expiry
    tick(s, 8 * HOUR)
    r = step(s)
    assert preempted(r) == {"big": "fairshare"} and placed(r) == {"debug": ("n001",)}


def test_any_allocated_job_preempts_unallocated_work_even_from_an_over_served_team():
    s = two_teams(1).state()
    submit(s, "heavy", "a", 4, HOUR)
    step(s)
    tick(s, 5 * HOUR)
    submit(s, "free", "b", 4, 0)
    step(s)
    finish(s, "heavy")
    submit(s, "old", "a", 4, HOUR)
    submit(s, "more", "a", 4, HOUR)
    # a is over-served (b has used nothing), yet its allocated job preempts b's free work
    r = step(s)
    assert preempted(r) == {"free": "unallocated"}
    assert placed(r) == {"old": ("n001",), "more": ("n001",)}


def test_unallocated_work_never_preempts():
    s = busy_over_served_team(HOUR)
    submit(s, "free", "b", 1, 0)
    r = step(s)
    assert preempted(r) == {} and placed(r) == {}


def test_non_resumable_victim_ends_as_preempted():
    s = two_teams(1).state()
    submit(s, "big", "a", 8, HOUR, resumable=False)
    step(s)
    tick(s, 2 * HOUR)
    submit(s, "debug", "b", 1, 10 * MIN)
    r = step(s)
    pre = next(d for d in r.decisions if isinstance(d, WorkloadPreempted))
    assert not pre.requeued and s.status_of("big") == "preempted"


def near_shares(c: Cluster) -> State:
    """a1 (a, 8 GPUs) from 0 and b1 (b, 8 GPUs) from 3 min on two nodes, at 2 h: b's
    ratio is 97.5% of a's, both past their 10-minute contracts."""
    s = c.state()
    submit(s, "a1", "a", 8, 10 * MIN)
    step(s)
    tick(s, 3 * MIN)
    submit(s, "b1", "b", 8, 10 * MIN)
    step(s)
    tick(s, 2 * HOUR)
    return s


def test_two_teams_near_their_shares_do_not_thrash_inside_the_margin():
    # a: 8 GPUs x 2 h, b: 8 GPUs x 1 h 57 min: b's ratio is 97.5% of a's, inside
    # the 5% margin, so b may not preempt a (nor a preempt b).
    s = near_shares(two_teams(2))
    assert s.usage("a") == 8 * 2 * HOUR and s.usage("b") == 8 * (2 * HOUR - 3 * MIN)
    submit(s, "a2", "a", 8, 10 * MIN)
    submit(s, "b2", "b", 8, 10 * MIN)
    r = step(s)
    assert preempted(r) == {} and placed(r) == {}


def test_a_workload_that_waited_past_the_margin_wait_outranks_on_any_lower_ratio():
    # As above (b's ratio just below a's, inside the 5% margin), with a margin wait
    # of 1 h: b2 is held to the margin for its first hour of waiting, the cycle
    # wakes when the hour ends, and then b2 preempts a1 (b is strictly lower).
    s = near_shares(two_teams(2, preemption_margin_ppm=50_000, preemption_margin_wait_ms=HOUR))
    submit(s, "b2", "b", 8, 10 * MIN)
    r = step(s)
    assert preempted(r) == {} and placed(r) == {}
    assert r.next_wakeup_ms == 3 * HOUR
    tick(s, 3 * HOUR - 1)
    assert preempted(step(s)) == {}
    tick(s, 3 * HOUR)
    assert 0 < 8 * 3 * HOUR - s.usage("b") < 8 * 3 * HOUR // 20  # still inside the margin
    r = step(s)
    assert preempted(r) == {"a1": "fairshare"} and placed(r) == {"b2": ("n001",)}


def test_a_workload_held_to_the_margin_reserves_from_the_end_of_its_wait():
    # As above, b2 needs a whole node: while it is held to the margin it outranks no
    # holder, but it will outrank a1 (b is strictly lower) once its hour of waiting
    # ends, so its reservation holds a1's node from then (with no wait: no start the
    # contract can tell, no reservation).
    s = near_shares(two_teams(2, preemption_margin_ppm=50_000, preemption_margin_wait_ms=HOUR))
    submit(s, "b2", "b", 8, 10 * MIN)
    r = step(s, report_reservation=True)
    assert preempted(r) == {} and r.reservation is not None
    assert r.reservation.workload == "b2" and r.reservation.start_ms == 3 * HOUR
    assert r.reservation.nodes == (s.running["a1"].placement[0].node,)
    s = near_shares(two_teams(2, preemption_margin_ppm=50_000))
    submit(s, "b2", "b", 8, 10 * MIN)
    assert step(s, report_reservation=True).reservation is None


def test_a_margin_wait_longer_than_the_lookback_is_refused():
    s = two_teams(1, preemption_margin_wait_ms=8 * 24 * HOUR).state()
    assert s.policy.margin_wait_ms == 0
    assert any("preemption_margin_wait" in r[1] for r in s.rejections)


def test_outside_the_margin_the_under_served_team_preempts():
    s = two_teams(2).state()
    submit(s, "a1", "a", 8, 10 * MIN)
    step(s)
    tick(s, 30 * MIN)
    submit(s, "b1", "b", 8, 10 * MIN)
    step(s)
    tick(s, 2 * HOUR)  # b's ratio is 75% of a's
    submit(s, "b2", "b", 8, 10 * MIN)
    r = step(s)
    assert preempted(r) == {"a1": "fairshare"} and placed(r) == {"b2": ("n001",)}


def test_priority_only_preempts_inside_one_leaf_and_only_when_strictly_higher():
    s = two_teams(1).state()
    submit(s, "low", "a", 8, 10 * MIN, priority=1)
    step(s)
    tick(s, HOUR)
    submit(s, "same", "a", 8, 10 * MIN, priority=1)
    assert preempted(step(s)) == {}
    submit(s, "high", "a", 8, 10 * MIN, priority=5)
    r = step(s)
    assert preempted(r) == {"low": "fairshare"} and placed(r) == {"high": ("n001",)}


def test_cheapest_victim_set_prefers_unallocated_then_fewest_gpus_beyond_need():
    s = two_teams(2).state()
    submit(s, "a4", "a", 4, 10 * MIN)  # n001
    submit(s, "a2", "a", 4, 10 * MIN)  # n001 (best fit)
    step(s)
    submit(s, "f6", "a", 6, 0)  # n002 unallocated
    step(s)
    tick(s, 2 * HOUR)
    submit(s, "b6", "b", 6, 10 * MIN)
    r = step(s)
    # freeing the 6 unallocated GPUs on n002 beats preempting allocated work on n001
    assert preempted(r) == {"f6": "unallocated"} and placed(r) == {"b6": ("n002",)}


def test_no_preemption_when_no_victim_set_makes_the_candidate_fit():
    s = two_teams(1).state()
    submit(s, "prot", "a", 4, 8 * HOUR)
    submit(s, "old", "a", 4, 10 * MIN)
    step(s)
    tick(s, HOUR)
    submit(s, "b8", "b", 8, 10 * MIN)  # needs the whole node; "prot" is protected
    r = step(s)
    assert preempted(r) == {} and placed(r) == {}


# -- draining and down nodes --------------------------------------------------------


def test_draining_node_empties_exactly_at_its_workloads_protection_expiries():
    s = two_teams(2).state()
    submit(s, "short", "a", 2, 1 * HOUR)
    submit(s, "long", "b", 2, 3 * HOUR)
    submit(s, "free", "a", 4, 0)
    step(s)  # best fit packs all three onto n001
    assert (s.nodes["n001"].free, s.nodes["n002"].free) == (0, 8)
    drain = "n001"
    health(s, drain, "draining")
    r = step(s)
    # unallocated work leaves at once (and, resumable, finds room on n002)
    assert preempted(r) == {"free": "drain"} and placed(r) == {"free": ("n002",)}
    assert r.next_wakeup_ms == 1 * HOUR
    tick(s, 1 * HOUR)
    r = step(s)
    assert preempted(r) == {"short": "drain"} and r.next_wakeup_ms == 3 * HOUR
    assert not any(isinstance(d, NodeDrained) for d in r.decisions)
    tick(s, 3 * HOUR)
    r = step(s)
    assert preempted(r) == {"long": "drain"}
    assert [d.node for d in r.decisions if isinstance(d, NodeDrained)] == [drain]
    assert s.nodes[drain].drained
    assert not any(isinstance(d, NodeDrained) for d in step(s).decisions)  # announced once


def test_down_node_requeues_resumable_work_and_ends_the_rest():
    s = two_teams(2).state()
    submit(s, "res", "a", 4, 8 * HOUR)
    submit(s, "gone", "b", 4, 8 * HOUR, resumable=False)
    step(s)
    assert s.nodes["n001"].free == 0
    health(s, "n001", "down")
    r = step(s)
    assert preempted(r) == {"res": "node_down", "gone": "node_down"}
    assert s.status_of("gone") == "preempted"
    # the resumable one is placed again on the healthy node, even though protected work was lost
    assert placed(r) == {"res": ("n002",)}


def test_invalid_submission_changes_nothing_and_is_announced():
    s = two_teams(1).state()
    submit(s, "ok", "a", 8, HOUR)
    step(s)
    before = s.snapshot()
    submit(s, "bad", "a", 8, 9 * HOUR)  # over the 8 h cap
    r = step(s)
    rejected = [d for d in r.decisions if isinstance(d, InputRejected)]
    assert [d.ref for d in rejected] == ["sub-bad"] and "min_runtime" in rejected[0].reason
    after = s.snapshot()
    assert after.workloads == before.workloads and after.nodes == before.nodes
    assert s.status_of("bad") is None and s.rejections == []


# -- fragmentation ----------------------------------------------------------------


def test_reservation_holds_the_nodes_that_free_up_earliest():
    s = two_teams(2).state()
    submit(s, "p1", "a", 4, 2 * HOUR)  # n001
    submit(s, "p2", "a", 4, 5 * HOUR)  # n001
    submit(s, "p3", "a", 8, 3 * HOUR)  # n002
    step(s)
    tick(s, 10 * MIN)  # a now has usage, b none: b outranks a clearly
    submit(s, "big", "b", 16, HOUR)
    r = step(s, report_reservation=True)
    assert r.reservation is not None
    assert r.reservation.workload == "big" and r.reservation.nodes == ("n001", "n002")
    assert r.reservation.start_ms == 5 * HOUR
    assert r.next_wakeup_ms == 2 * HOUR  # the first protection expiry comes earlier


def test_reservation_leaves_out_nodes_that_come_free_before_its_start():
    # b's 16-GPU gang can start at 3 h (n002 and n003 both free then); n001 frees
    # at 1 h. Holding n002 and n003 gives the same start and leaves n001 to a's
    # long-protected job, which holding n001 would have kept waiting until 3 h.
    s = two_teams(3).state()
    submit(s, "p1", "a", 8, 1 * HOUR)
    submit(s, "p2", "a", 8, 3 * HOUR)
    submit(s, "p3", "a", 8, 3 * HOUR)
    step(s)
    tick(s, 10 * MIN)
    submit(s, "big", "b", 16, HOUR)
    r = step(s, report_reservation=True)
    assert r.reservation is not None
    assert (r.reservation.nodes, r.reservation.start_ms) == (("n002", "n003"), 3 * HOUR)
    finish(s, "p1", 1 * HOUR)
    submit(s, "long", "a", 8, 4 * HOUR)
    r = step(s)
    assert placed(r) == {"long": ("n001",)}
    finish(s, "p2", 3 * HOUR)
    finish(s, "p3", 3 * HOUR)
    assert placed(step(s)) == {"big": ("n002", "n003")}


def test_lower_ranked_work_uses_reserved_gpus_only_if_preemptible_before_the_reservation():
    s = two_teams(1).state()
    submit(s, "p", "a", 4, 2 * HOUR)
    step(s)
    tick(s, 30 * MIN)  # a has usage now, so b's big job ranks first
    submit(s, "big", "b", 8, HOUR)  # blocked until 2 h: reservation on n001
    submit(s, "long", "a", 4, 3 * HOUR)  # would still be protected at 2 h
    submit(s, "short", "a", 4, HOUR)  # preemptible at 1.5 h, before 2 h
    r = step(s)
    assert r.reservation is not None and r.reservation.start_ms == 2 * HOUR
    assert placed(r) == {"short": ("n001",)}


def test_without_reservations_lower_ranked_work_takes_the_gpus():
    s = two_teams(1).state()
    tick(s, 0)
    step(s)
    s2 = Cluster().team("a", 1).team("b", 1).nodes(1).policy(reservations=False).state()
    submit(s2, "p", "a", 4, 2 * HOUR)
    step(s2)
    submit(s2, "big", "b", 8, HOUR)
    submit(s2, "long", "a", 4, 3 * HOUR)
    r = step(s2)
    assert r.reservation is None and placed(r) == {"long": ("n001",)}
