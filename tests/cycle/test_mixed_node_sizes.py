"""A failure to place says nothing about a request a pool takes that the failed one did not.

The cycle skips, without a search, work that cannot be placed because a smaller
request of the same kind just failed (core/cycle/: the failure memo of
``memo.py``, the doomed shapes of deep queues of ``doomed.py``, the unallocated
pass of ``unallocated.py``). "At least as many GPUs
fails too" holds pool by pool only where both requests are possible: on nodes
of 4 and 8 GPUs, 6 GPUs fit one 8-GPU node but no 4-GPU gang, while 8 GPUs also
fit two whole 4-GPU nodes. These tests fail if the skipping forgets that.
"""

from __future__ import annotations

from apportion.core import State
from apportion.core.cycle import decide

from .builders import HOUR, Cluster, finish, placed, step, submit


def _busy_big_node_and_free_small_ones(min_runtime_ms: int) -> State:
    """One 8-GPU node taken by protected work of team b, two free 4-GPU nodes, and
    two waiting workloads of team a (any GPU type): 6 GPUs, then 8 GPUs."""
    s = (
        Cluster()
        .team("a", 1)
        .team("b", 1)
        .nodes(1, gpus=8, gpu_type="h100", prefix="big")
        .nodes(2, gpus=4, gpu_type="h100", prefix="small")
        .state()
    )
    submit(s, "fill-1", "b", 4, 4 * HOUR, gpu_type="h100")
    submit(s, "fill-2", "b", 4, 4 * HOUR, gpu_type="h100")
    step(s)  # best fit: one on each small node
    submit(s, "b-job", "b", 8, 4 * HOUR, gpu_type="h100")
    step(s)
    assert {w: s.running[w].placement[0].node for w in s.running} == {
        "fill-1": "small002",
        "fill-2": "small003",
        "b-job": "big001",
    }
    finish(s, "fill-1")  # the small nodes come free again
    finish(s, "fill-2")
    submit(s, "six", "a", 6, min_runtime_ms, gpu_type="any")
    submit(s, "eight", "a", 8, min_runtime_ms, gpu_type="any", at_ms=s.now_ms + 1)
    return s


def test_allocated_work_a_smaller_failure_cannot_rule_out_is_placed() -> None:
    """``six`` fails (the 8-GPU node is protected; 6 GPUs is no 4-GPU gang);
    ``eight`` of the same leaf comes after it and fits two whole 4-GPU nodes."""
    s = _busy_big_node_and_free_small_ones(HOUR)
    result = decide(s)
    assert placed(result) == {"eight": ("small002", "small003")}


def test_unallocated_work_a_smaller_failure_cannot_rule_out_is_placed() -> None:
    """The same with unallocated work (minimum runtime 0), placed by submit time."""
    s = _busy_big_node_and_free_small_ones(0)
    result = decide(s)
    assert placed(result) == {"eight": ("small002", "small003")}


def test_a_deep_queue_passed_over_by_shape_still_places_what_another_pool_takes() -> None:
    """``six`` and 40 more 6-GPU workloads of the leaf, then ``eight``: the walk
    passes over the 6-GPU shape once it failed (a deep queue), but not over
    8 GPUs, which two whole 4-GPU nodes take."""
    from apportion.core.cycle import Cycle
    from apportion.core.cycle.doomed import DOOM_FROM

    s = _busy_big_node_and_free_small_ones(HOUR)
    for i in range(DOOM_FROM + 8):
        submit(s, f"six-{i:02d}", "a", 6, HOUR, gpu_type="any", at_ms=s.now_ms)
    cycle = Cycle(s)
    result = cycle.run()
    walk = cycle.scratch.walk
    assert walk is not None and "a" in walk.merged  # walked by shape
    assert placed(result) == {"eight": ("small002", "small003")}
