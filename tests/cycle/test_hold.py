"""Hold and release: a held workload stays pending, is never placed, keeps its place."""

from __future__ import annotations

from apportion.core import State, apply
from apportion.core.cycle import step
from apportion.schemas.events import WorkloadHeld, WorkloadReleased

from .builders import MIN, Cluster, placed, submit


def _hold(s: State, wid: str, actor: str, release: bool = False) -> State:
    kind = WorkloadReleased if release else WorkloadHeld
    return apply(s, kind(id=f"h-{wid}-{s.input_seq}", at_ms=s.now_ms, workload=wid, actor=actor))


def test_held_is_never_placed_and_released_is() -> None:
    s = Cluster().team("a", 1, owner="alice").nodes(1).state()
    submit(s, "w1", "a", 8, 10 * MIN, submitted_by="alice")
    submit(s, "w2", "a", 8, 10 * MIN, at_ms=MIN, submitted_by="alice")
    _hold(s, "w1", "alice")
    assert s.workloads["w1"].held_by == "alice" and s.status_of("w1") == "pending"
    before = s.digest()
    r = step(s)
    assert placed(r) == {"w2": ("n001",)}
    assert "w1" in s.pending and s.digest() != before
    copy = s.copy()  # snapshot round trip keeps the hold and the index
    assert copy.workloads["w1"].held and copy.digest() == s.digest()


def test_release_keeps_its_place_and_authority_is_enforced() -> None:
    s = Cluster().team("a", 1, owner="alice").nodes(1).state()
    submit(s, "w1", "a", 8, 10 * MIN, submitted_by="alice")
    submit(s, "w2", "a", 8, 10 * MIN, at_ms=MIN, submitted_by="alice")
    _hold(s, "w1", "mallory")
    assert s.rejections[-1][2] == "not_authorised" and not s.workloads["w1"].held
    _hold(s, "w1", "alice", release=True)
    assert s.rejections[-1][2] == "not_held"
    _hold(s, "w1", "alice")
    _hold(s, "w1", "alice")
    assert s.rejections[-1][2] == "not_pending"
    _hold(s, "w1", "alice", release=True)
    assert not s.workloads["w1"].held
    s.rejections.clear()
    r = step(s)
    assert placed(r) == {"w1": ("n001",)}  # its old place: ahead of w2
    _hold(s, "w1", "alice")
    assert s.rejections[-1][2] == "not_pending"  # running
