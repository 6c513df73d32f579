"""Invariants of decide + fold over random input sequences (hypothesis state machine),
and determinism across processes with different hash seeds.

Every input is authorised (the root's owner ``root`` acts), so the machine
exercises placements, preemptions (with and without notice), drains and
finishes rather than rejections."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from apportion.core import State, apply, fold
from apportion.core.cycle import Cycle, step
from apportion.core.cycle.idle import idle
from apportion.schemas import encode
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    Event,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadSubmitted,
)
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

MIN = 60_000
HOUR = 60 * MIN
LEAVES = ["a/x", "a/y", "b/z", "c"]
NODES = [("n1", 8, "h100"), ("n2", 8, "h100"), ("n3", 8, "h100"), ("g1", 4, "a100")]


def setup_events() -> list[Event]:
    ev: list[Event] = [BudgetSet(id="b", at_ms=0, path="", weight=1, owner="root", actor="root")]
    for path, weight in [("a", 3), ("a/x", 1), ("a/y", 2), ("b", 2), ("b/z", 1), ("c", 1)]:
        ev.append(
            BudgetSet(id=f"b-{path}", at_ms=0, path=path, weight=weight, owner="o", actor="root")
        )
    ev.append(PolicySet(id="p", at_ms=0, actor="root", preemption_margin_ppm=50_000))
    for name, gpus, kind in NODES:
        ev.append(
            NodeRegistered(
                id=f"n-{name}", at_ms=0, node=name, gpus=gpus, gpu_type=kind, actor="root"
            )
        )
    return ev


class CycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[Event] = setup_events()
        self.log: list[Event] = list(self.inputs)
        self.state = fold(self.inputs)
        self.n = 0
        self.ids: list[str] = []
        self.now = 0
        self.preemptions = 0
        self.noticed = 0
        self._cycle()

    def _input(self, event: Event) -> None:
        self.inputs.append(event)
        self.log.append(event)
        before = {
            w.id: (w.min_runtime_ms, w.protected_until_ms) for w in self.state.running.values()
        }
        apply(self.state, event)
        self._cycle(before)

    def _cycle(self, before: dict[str, tuple[int, int]] | None = None) -> None:
        if before is None:
            before = {}
        t = self.state.now_ms
        running = self.state.running
        stopping = {w.id for w in running.values() if w.stopping is not None}
        waiting = {w.stopping.for_workload for w in running.values() if w.stopping is not None} - {
            None
        }
        # the whole cycle, assembled: the same result as decide's (which takes the
        # shortcut of a cycle with nothing to decide, core/cycle/idle.py, when it may)
        whole = Cycle(self.state).run()
        short = idle(self.state)
        if short is not None:
            assert short == whole == Cycle(self.state).run(report_reservation=True)
        result = step(self.state)
        assert result == whole
        self.log.extend(result.decisions)
        placed = {d.workload for d in result.decisions if isinstance(d, WorkloadPlaced)}
        waits = {  # beneficiaries of a preemption with notice: placed once it stops
            d.for_workload
            for d in result.decisions
            if isinstance(d, WorkloadPreempted) and d.grace_ms
        }
        for d in result.decisions:
            if isinstance(d, WorkloadPreempted):
                self.preemptions += 1
                self.noticed += d.grace_ms > 0
                min_runtime, protected_until = before.get(d.workload, (0, 0))
                if d.reason != "node_down":
                    # protected work is never preempted except when its node goes down
                    assert min_runtime == 0 or t >= protected_until, d
                    # a stopping run is never a victim; only node_down ends it early
                    assert d.workload not in stopping, d
                else:
                    assert d.grace_ms == 0, d
                if d.reason in ("fairshare", "unallocated"):
                    # no preemption without a placement that needed it (with notice:
                    # the beneficiary waits for the GPUs and stays pending)
                    if d.for_workload in waits:
                        assert self.state.workloads[d.for_workload].status == "pending", d
                        assert d.for_workload not in placed, d
                    else:
                        assert d.for_workload in placed, d
                    # no second victim set while runs stop for the same beneficiary
                    assert d.for_workload not in waiting, d
        if result.next_wakeup_ms is not None:
            assert result.next_wakeup_ms > t
        if self.state.stop_deadlines:
            # the live scheduler and the simulator wake up when a notice ends
            assert result.next_wakeup_ms is not None
            assert result.next_wakeup_ms <= self.state.stop_deadlines[0][0]

    def _id(self) -> str:
        self.n += 1
        return f"i{self.n}"

    @rule(
        owner=st.sampled_from([*LEAVES, "a", "nope"]),
        gpus=st.sampled_from([1, 2, 3, 4, 8, 16, 24, 32]),
        min_runtime=st.sampled_from([0, 5 * MIN, HOUR, 3 * HOUR, 9 * HOUR]),
        resumable=st.booleans(),
        priority=st.integers(0, 2),
        gpu_type=st.sampled_from(["any", "any", "h100", "a100", "tpu"]),
        grace=st.sampled_from([None, None, 0, 30_000, 30 * MIN]),
    )
    def submit(self, owner, gpus, min_runtime, resumable, priority, gpu_type, grace):
        wid = f"w{len(self.ids)}"
        self.ids.append(wid)
        self._input(
            WorkloadSubmitted(
                id=self._id(),
                at_ms=self.now,
                workload=wid,
                owner=owner,
                gpus=gpus,
                min_runtime_ms=min_runtime,
                resumable=resumable,
                priority=priority,
                gpu_type=gpu_type,
                submitted_by="root",
                grace_ms=grace,
            )
        )

    @initialize(grace=st.sampled_from([0, 30_000, 2 * MIN, 20 * MIN]))
    def first_policy(self, grace):
        self.policy(grace)

    @rule(
        owner=st.sampled_from(LEAVES),
        gpus=st.sampled_from([1, 4, 8, 16]),
        min_runtime=st.sampled_from([0, 5 * MIN, HOUR]),
        resumable=st.booleans(),
        grace=st.sampled_from([None, None, 0, 30 * MIN]),
    )
    def submit_valid(self, owner, gpus, min_runtime, resumable, grace):
        self.submit(owner, gpus, min_runtime, resumable, 0, "any", grace)

    @rule(grace=st.sampled_from([0, 1, 30_000, 2 * MIN, 20 * MIN]))
    def policy(self, grace):
        self._input(
            PolicySet(
                id=self._id(),
                at_ms=self.now,
                actor="root",
                preemption_margin_ppm=50_000,
                grace_ms=grace,
            )
        )

    @rule(dt=st.sampled_from([0, 1, 30_000, MIN, 20 * MIN, HOUR, 4 * HOUR]))
    def tick(self, dt):
        self.now += dt
        self._input(ClockTicked(id=self._id(), at_ms=self.now))

    @rule(back=st.integers(0, HOUR))
    def late_input(self, back):
        # an input stamped earlier than the current time folds at the current time
        self._input(ClockTicked(id=self._id(), at_ms=max(0, self.now - back)))
        assert self.state.now_ms == self.now

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), stale=st.booleans(), failed=st.booleans())
    def finish(self, data, stale, failed):
        wid = data.draw(st.sampled_from(self.ids))
        w = self.state.workloads.get(wid)
        attempt = (w.attempt - 1 if stale else w.attempt) if w else None
        self._report_end(wid, attempt, failed, "root")

    def _report_end(self, wid: str, attempt: int | None, failed: bool, actor: str) -> None:
        self._input(
            WorkloadFinished(
                id=self._id(),
                at_ms=self.now,
                workload=wid,
                outcome="failed" if failed else "succeeded",
                attempt=attempt,
                actor=actor,
            )
        )

    @precondition(lambda self: self.state.stop_deadlines)
    @rule(data=st.data(), failed=st.booleans(), agent=st.booleans())
    def finish_during_notice(self, data, failed, agent):
        # the executor of a run preempted with notice reports it stopped (or done) early
        wid = data.draw(st.sampled_from([w for _, w in self.state.stop_deadlines]))
        w = self.state.running[wid]
        attempt = w.attempt
        self._report_end(wid, attempt, failed, f"agent:{w.placement[0].node}" if agent else "root")
        # the run ended (a requeued one may be placed again at once, as a new attempt)
        again = self.state.running.get(wid)
        assert again is None or (again.attempt > attempt and again.stopping is None)

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def cancel(self, data):
        wid = data.draw(st.sampled_from(self.ids))
        self._input(WorkloadCancelled(id=self._id(), at_ms=self.now, workload=wid, actor="root"))

    @rule(
        node=st.sampled_from([n for n, _, _ in NODES]),
        to=st.sampled_from(["healthy", "draining", "down"]),
    )
    def health(self, node, to):
        self._input(
            NodeHealthChanged(id=self._id(), at_ms=self.now, node=node, state=to, actor="root")
        )

    @rule(path=st.sampled_from(["a", "b", "a/x", "c"]), weight=st.integers(1, 5))
    def reweigh(self, path, weight):
        self._input(
            BudgetSet(
                id=self._id(), at_ms=self.now, path=path, weight=weight, owner="o", actor="root"
            )
        )

    @invariant()
    def no_gpu_double_booked_and_capacity_never_exceeded(self):
        s = self.state
        held: dict[str, int] = {}
        for w in s.running.values():
            assert sum(slot.gpus for slot in w.placement) == w.gpus
            for slot in w.placement:
                held[slot.node] = held.get(slot.node, 0) + slot.gpus
                assert s.nodes[slot.node].workloads[w.id] == slot.gpus
        for name, node in s.nodes.items():
            assert 0 <= node.free <= node.gpus
            assert held.get(name, 0) + node.free == node.gpus
            assert sum(node.workloads.values()) == held.get(name, 0)

    @invariant()
    def node_index_matches_the_nodes(self):
        s = self.state
        index = s.node_index
        rebuilt = State.from_bytes(s.to_bytes()).node_index
        for field in ("node_ids", "buckets", "pool_nodes", "pool_free", "down", "draining"):
            assert getattr(index, field) == getattr(rebuilt, field), field
        for pool, by_free in index.buckets.items():
            for free, names in by_free.items():
                assert names == sorted(names)
                assert all(
                    s.nodes[n].free == free and s.nodes[n].health == "healthy" for n in names
                )
                assert all((s.nodes[n].gpu_type, s.nodes[n].gpus) == pool for n in names)

    @invariant()
    def stop_deadlines_match_the_stopping_runs(self):
        s = self.state
        expected = sorted((w.stopping.until_ms, w.id) for w in s.running.values() if w.stopping)
        assert s.stop_deadlines == expected
        assert all(until > s.now_ms for until, _ in expected)  # ended when time reached them
        assert State.from_bytes(s.to_bytes()).stop_deadlines == expected

    @invariant()
    def unallocated_time_is_never_charged(self):
        s = self.state
        # the root's charge rate is exactly the allocated GPUs running
        allocated = sum(w.gpus for w in s.running.values() if w.min_runtime_ms > 0)
        assert s.budget.root.series.rate == allocated
        assert s.usage("") >= 0

    def teardown(self) -> None:
        # folding the same events again gives the same state
        again = fold(self.log)
        assert again.digest() == self.state.digest()
        # the same inputs give the same decisions
        replay = State()
        decisions: list[bytes] = []
        for event in self.inputs:
            apply(replay, event)
            if event.id.startswith("i") or event.id == setup_events()[-1].id:
                decisions.extend(encode(d) for d in step(replay).decisions)
        original = [
            encode(d) for d in self.log if isinstance(d, (WorkloadPlaced, WorkloadPreempted))
        ]
        replayed = [d for d in decisions if b'"WorkloadPlaced"' in d or b'"WorkloadPreempted"' in d]
        assert replayed == original
        assert replay.digest() == self.state.digest()


CycleMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestCycleInvariants = CycleMachine.TestCase


SCRIPT = r"""
import random, hashlib, sys
sys.path.insert(0, sys.argv[1])
from tests.cycle.test_cycle_properties import setup_events, LEAVES
from apportion.core import fold, apply
from apportion.core.cycle import step
from apportion.schemas import encode
from apportion.schemas.events import WorkloadSubmitted, ClockTicked, WorkloadFinished, NodeHealthChanged
rng = random.Random(7)
s = fold(setup_events())
h = hashlib.sha256()
now = 0
for i in range(400):
    r = rng.random()
    if r < 0.6:
        e = WorkloadSubmitted(id=f"s{i}", at_ms=now, workload=f"w{i}", owner=rng.choice(LEAVES),
            gpus=rng.choice([1, 2, 4, 8, 16]), min_runtime_ms=rng.choice([0, 600000, 3600000]),
            priority=rng.randint(0, 2), submitted_by="root",
            grace_ms=rng.choice([None, 0, 120000]))
    elif r < 0.8 and s.running:
        e = WorkloadFinished(id=f"f{i}", at_ms=now, actor="root",
            outcome=rng.choice(["succeeded", "failed"]),
            workload=sorted(s.running)[rng.randrange(len(s.running))])
    elif r < 0.85:
        e = NodeHealthChanged(id=f"h{i}", at_ms=now, node=rng.choice(["n1", "n2", "n3"]),
            state=rng.choice(["healthy", "draining", "down"]), actor="root")
    else:
        now += rng.randint(0, 3600000)
        e = ClockTicked(id=f"t{i}", at_ms=now)
    apply(s, e)
    for d in step(s).decisions:
        h.update(encode(d))
print(s.digest(), h.hexdigest())
"""


def test_same_events_give_same_decisions_under_another_hash_seed():
    root = str(Path(__file__).resolve().parents[2])
    outputs = set()
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, root],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert len(out.split()) == 2
        outputs.add(out)
    assert len(outputs) == 1, outputs
    # and the run did decide something
    assert hashlib.sha256(b"").hexdigest() not in next(iter(outputs))
