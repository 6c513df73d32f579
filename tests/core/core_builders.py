"""Builders for core tests: one sample of every event, and a fluent :class:`Scenario`.

A :class:`Scenario` keeps a :class:`State` and the list of events it folded, so
a test reads as the history it describes::

    s = Scenario().tree("a", "a/x").node("n1", 8).at(HOUR_MS).submit("w1", "a/x", gpus=4)
    s.place("w1", "n1")

Every event gets a fresh id (``e1``, ``e2``, ...) and the scenario's current
time; ``at(t)`` moves that time (``after(d)`` moves it by ``d``). Decisions are
built from the state (``attempt``, ``allocated`` and ``protected_until_ms``
filled in the way the scheduler would), so tests only say what they mean.
"""

from __future__ import annotations

from fractions import Fraction as F
from typing import Any

import msgspec
from apportion.core import State, apply
from apportion.core.budget import ancestors_of
from apportion.schemas.events import (
    HOUR_MS,
    BudgetRemoved,
    BudgetSet,
    ClockTicked,
    Event,
    HealthState,
    InputRejected,
    InputsLost,
    LeafCharge,
    NodeDrained,
    NodeHealthChanged,
    NodeRegistered,
    Outcome,
    PolicySet,
    PreemptReason,
    Slot,
    UsageReported,
    UsageSummary,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadHeld,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadReleased,
    WorkloadStarted,
    WorkloadSubmitted,
)
from apportion.schemas.reasons import CODES

ADMIN = "admin"
"""Owner of the root in every scenario (so it may edit anything)."""


class Scenario:
    """A history under construction, folded as it is written."""

    def __init__(self, *, root_owner: str = ADMIN) -> None:
        self.t = 0
        self.n = 0
        self.events: list[Event] = []
        self.state = State()
        self._expect: tuple[str, ...] | None = None
        self._expect_code: str | None = None
        self.reason = ""
        self.code: object = None
        """The reason code of the last rejection :meth:`rejects` announced."""
        if root_owner:
            self.apply(
                BudgetSet(id=self._id(), at_ms=0, path="", weight=1, owner=root_owner, actor="")
            )

    # -- plumbing --------------------------------------------------------
    def _id(self) -> str:
        self.n += 1
        return f"e{self.n}"

    def apply(self, event: Event) -> Scenario:
        """Fold ``event``. An input the fold rejects fails the test unless
        :meth:`rejects` announced it; then the rejection is checked to have
        changed nothing: the state must equal a twin that folded a
        ``ClockTicked`` with the same id and time instead, plus the rejection
        record."""
        expect, self._expect = self._expect, None
        expect_code, self._expect_code = self._expect_code, None
        before = len(self.state.rejections)
        twin = self.state.copy() if expect is not None else None
        self.events.append(event)
        apply(self.state, event)
        rejected = len(self.state.rejections) > before
        if expect is None:
            assert not rejected, f"unexpected rejection: {self.state.rejections[-1]}"
            return self
        assert rejected, f"{type(event).__name__} {event.id} was accepted; expected a rejection"
        ref, reason, code = self.state.rejections[-1]
        assert ref == event.id
        for word in expect:
            assert word in reason, f"{word!r} not in {reason!r}"
        assert isinstance(code, str) and code in CODES, code
        if expect_code is not None:
            assert code == expect_code, f"code {code!r}, expected {expect_code!r} ({reason!r})"
        assert twin is not None
        apply(twin, ClockTicked(id=event.id, at_ms=event.at_ms))
        twin.rejections.append((ref, reason, code))
        assert twin.digest() == self.state.digest(), "a rejected input changed the state"
        self.reason = reason
        self.code = code
        return self

    def rejects(self, *words: str, code: str | None = None) -> Scenario:
        """The next input must be rejected, change nothing, and give a reason containing
        ``words`` (and, if given, the reason code ``code``; always one of the codes)."""
        self._expect = words
        self._expect_code = code
        return self

    def at(self, t_ms: int) -> Scenario:
        self.t = t_ms
        return self

    def after(self, d_ms: int) -> Scenario:
        self.t += d_ms
        return self

    @property
    def last(self) -> Event:
        return self.events[-1]

    # -- inputs ----------------------------------------------------------
    def budget(
        self, path: str, weight: int = 1, owner: str | None = None, actor: str = ADMIN
    ) -> Scenario:
        owner = owner if owner is not None else f"{path or 'root'}-owner"
        return self.apply(
            BudgetSet(
                id=self._id(), at_ms=self.t, path=path, weight=weight, owner=owner, actor=actor
            )
        )

    def tree(self, *specs: str | tuple[str, int]) -> Scenario:
        """``tree("a", ("a/x", 2))``: create nodes (weight 1 unless given), as ``ADMIN``."""
        for spec in specs:
            path, weight = (spec, 1) if isinstance(spec, str) else spec
            self.budget(path, weight)
        return self

    def remove(self, path: str, actor: str = ADMIN) -> Scenario:
        return self.apply(BudgetRemoved(id=self._id(), at_ms=self.t, path=path, actor=actor))

    def policy(self, actor: str = ADMIN, **fields: Any) -> Scenario:
        return self.apply(PolicySet(id=self._id(), at_ms=self.t, actor=actor, **fields))

    def node(
        self, name: str, gpus: int = 8, gpu_type: str = "a100", actor: str = ADMIN
    ) -> Scenario:
        return self.apply(
            NodeRegistered(
                id=self._id(), at_ms=self.t, node=name, gpus=gpus, gpu_type=gpu_type, actor=actor
            )
        )

    def nodes(self, prefix: str, count: int, gpus: int = 8, gpu_type: str = "a100") -> Scenario:
        for i in range(count):
            self.node(f"{prefix}{i}", gpus, gpu_type)
        return self

    def health(self, name: str, state: HealthState, actor: str = ADMIN) -> Scenario:
        return self.apply(
            NodeHealthChanged(id=self._id(), at_ms=self.t, node=name, state=state, actor=actor)
        )

    def submit(
        self, wid: str, owner: str, gpus: int = 1, min_runtime_ms: int = HOUR_MS, **fields: Any
    ) -> Scenario:
        leaf = self.state.budget.nodes.get(owner)
        fields.setdefault("submitted_by", leaf.owner if leaf is not None else ADMIN)
        return self.apply(
            WorkloadSubmitted(
                id=self._id(),
                at_ms=self.t,
                workload=wid,
                owner=owner,
                gpus=gpus,
                min_runtime_ms=min_runtime_ms,
                **fields,
            )
        )

    def cancel(self, wid: str, actor: str = ADMIN) -> Scenario:
        return self.apply(WorkloadCancelled(id=self._id(), at_ms=self.t, workload=wid, actor=actor))

    def finish(
        self,
        wid: str,
        outcome: Outcome = "succeeded",
        attempt: int | None = None,
        actor: str = ADMIN,
    ) -> Scenario:
        return self.apply(
            WorkloadFinished(
                id=self._id(),
                at_ms=self.t,
                workload=wid,
                outcome=outcome,
                attempt=attempt,
                actor=actor,
            )
        )

    def hear(self, event: Event) -> Scenario:
        """Fold input ``event`` stamped at the scenario's time."""
        return self.apply(msgspec.structs.replace(event, at_ms=self.t))

    def tick(self, t_ms: int | None = None) -> Scenario:
        if t_ms is not None:
            self.t = t_ms
        return self.apply(ClockTicked(id=self._id(), at_ms=self.t))

    # -- decisions (stamped at the state's time, like the scheduler's) ----
    def place(self, wid: str, *nodes: str | tuple[str, int]) -> Scenario:
        """Place ``wid`` on ``nodes`` (a name takes all its GPUs, or ``(name, gpus)``);
        with one bare node name, the workload's whole gang goes there."""
        w = self.state.pending[wid]
        if len(nodes) == 1 and isinstance(nodes[0], str):
            slots = (Slot(nodes[0], w.gpus),)
        else:
            slots = tuple(
                Slot(n, self.state.nodes[n].gpus) if isinstance(n, str) else Slot(*n) for n in nodes
            )
        now = self.state.now_ms
        return self.apply(
            WorkloadPlaced(
                id=self._id(),
                at_ms=now,
                workload=wid,
                placement=slots,
                allocated=w.min_runtime_ms > 0,
                protected_until_ms=now + w.min_runtime_ms,
                attempt=w.attempt + 1,
            )
        )

    def preempt(
        self, wid: str, requeued: bool = True, reason: PreemptReason = "fairshare"
    ) -> Scenario:
        return self.apply(
            WorkloadPreempted(
                id=self._id(),
                at_ms=self.state.now_ms,
                workload=wid,
                reason=reason,
                requeued=requeued,
            )
        )

    def drained(self, name: str) -> Scenario:
        return self.apply(NodeDrained(id=self._id(), at_ms=self.state.now_ms, node=name))

    def announce(self, ref: str) -> Scenario:
        return self.apply(
            InputRejected(id=self._id(), at_ms=self.state.now_ms, ref=ref, reason="x")
        )


def sample_events() -> list[Event]:
    """One event of every kind, every optional field set to a non-default value somewhere."""
    return [
        NodeRegistered(id="i1", at_ms=1, node="n1", gpus=8, gpu_type="h100"),
        NodeHealthChanged(id="i2", at_ms=2, node="n1", state="draining", reason="bad fan"),
        BudgetSet(id="i3", at_ms=3, path="llm/pretrain", weight=3, owner="bob", actor="alice"),
        BudgetRemoved(id="i4", at_ms=4, path="llm/old", actor="alice"),
        PolicySet(
            id="i5",
            at_ms=5,
            lookback_ms=3 * HOUR_MS,
            max_min_runtime_ms=HOUR_MS,
            preemption_margin_ppm=10,
            actor="alice",
            reservations=False,
            operators=("ops",),
            grace_ms=30_000,
            max_grace_ms=HOUR_MS,
            heartbeat_timeout_ms=90_000,
        ),
        WorkloadSubmitted(
            id="i6",
            at_ms=6,
            workload="w1",
            owner="llm/pretrain",
            gpus=16,
            min_runtime_ms=HOUR_MS,
            gpu_type="h100",
            resumable=False,
            priority=-3,
            submitted_by="carol",
            duration_ms=5 * HOUR_MS,
            legacy_priority="low",
            legacy_preemptible=True,
            command=("python", "train.py", "--lr", "3e-4"),
            env={"WANDB_MODE": "offline"},
            image="ghcr.io/lab/train:1.2",
            grace_ms=60_000,
        ),
        WorkloadCancelled(id="i7", at_ms=7, workload="w1", actor="carol"),
        WorkloadHeld(id="i12", at_ms=7, workload="w1", actor="carol"),
        WorkloadReleased(id="i13", at_ms=7, workload="w1", actor="ops"),
        WorkloadFinished(
            id="i8", at_ms=8, workload="w1", outcome="failed", attempt=2, exit_code=-9, actor="x"
        ),
        WorkloadStarted(id="i10", at_ms=9, workload="w1", attempt=2, node="n1", actor="agent:n1"),
        ClockTicked(id="i9", at_ms=9),
        InputsLost(id="i11", at_ms=9, first=3, through=5, actor="ops", note="block damaged"),
        WorkloadPlaced(
            id="d1",
            at_ms=10,
            workload="w1",
            placement=(Slot("n1", 8), Slot("n2", 8)),
            allocated=True,
            protected_until_ms=10 + HOUR_MS,
            attempt=1,
        ),
        WorkloadPreempted(
            id="d2",
            at_ms=11,
            workload="w1",
            reason="fairshare",
            requeued=True,
            for_workload="w9",
            grace_ms=30_000,
        ),
        NodeDrained(id="d3", at_ms=12, node="n1"),
        InputRejected(id="d4", at_ms=13, ref="i4", reason="unknown budget node 'llm/old'"),
        UsageSummary(
            id="i14",
            at_ms=13,
            source="east",
            start_ms=0,
            end_ms=300_000,
            charges=(LeafCharge("llm/pretrain", 3_600_000), LeafCharge("", 5)),
            actor="federation:east",
        ),
        UsageReported(
            id="d5",
            at_ms=300_000,
            cluster="west",
            start_ms=0,
            end_ms=300_000,
            charges=(LeafCharge("llm/pretrain", 7),),
        ),
    ]


def reference_order(state: State) -> list[str]:
    """The documented order taken literally: per level ``(ratio, -weight, path)`` from
    the top level down, ratio = (charged usage + committed) / weight, committed = GPUs
    x the rest of the protection of running allocated work under the path (not on a
    down node); then ``-priority``, submit time, id; unallocated after, by submit time, id.
    Held work is out of the order (no cycle walks it)."""
    nodes = state.budget.nodes
    now = state.now_ms

    def committed(path: str) -> int:
        return sum(
            r.gpus * (r.protected_until_ms - now)
            for r in state.running.values()
            if r.min_runtime_ms > 0
            and r.protected_until_ms > now
            and (r.owner == path or r.owner.startswith(path + "/"))
            and all(state.nodes[s.node].health != "down" for s in r.placement)
        )

    def key(w: Any) -> tuple:
        if w.min_runtime_ms == 0:
            return (1, [], 0, w.submitted_ms, w.id)
        levels = [
            (F(state.usage(p) + committed(p), nodes[p].weight), -nodes[p].weight, p)
            for p in [*ancestors_of(w.owner)[1:], w.owner]
        ]
        return (0, levels, -w.priority, w.submitted_ms, w.id)

    return [w.id for w in sorted((w for w in state.pending.values() if not w.held), key=key)]
