"""A hypothesis state machine over random histories, checked against an independent model.

Inputs are random (valid and invalid budget edits incl. removals, node
registrations and health changes, submissions, cancels, holds and releases,
finishes, clock ticks, some stamped in the past); decisions are built by the test the way a scheduler
may make them (place a pending workload on free GPUs of healthy nodes; preempt a
running one, requeued iff resumable; announce rejections; announce drained
nodes), because ``decide()`` is not this test's subject. Some preemptions give
notice (``grace_ms``): the model keeps the run (and its charge) until its
deadline, an early report, a cancel or the loss of its host.

The model keeps its own record of allocated runs (which budget nodes each one
charges, from when to when) and computes every node's window usage from those
runs alone, so the fold's charge series are checked against a plain integral.
"""

from __future__ import annotations

from apportion.core import State, apply, fold, queue_order
from apportion.core.budget import ancestors_of
from apportion.core.cycle import decide
from apportion.core.ordering import FairShareView, committed_charges
from apportion.schemas.events import (
    DAY_MS,
    HOUR_MS,
    MINUTE_MS,
    BudgetRemoved,
    BudgetSet,
    ClockTicked,
    Event,
    HealthState,
    InputRejected,
    LeafCharge,
    NodeDrained,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    Slot,
    UsageSummary,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadHeld,
    WorkloadPlaced,
    WorkloadPreempted,
    WorkloadReleased,
    WorkloadSubmitted,
)
from core_builders import reference_order
from hypothesis import HealthCheck, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

ADMIN = "admin"
PATHS = ["a", "b", "a/x", "a/y", "b/z", "a/x/deep", "c"]
ACTORS = [ADMIN, ADMIN, "a-o", "b-o", "a/x-o", "mallory"]
NODES = ["n0", "n1", "n2", "n3"]


class Run:
    __slots__ = ("chain", "gpus", "start", "end")

    def __init__(self, chain: tuple[tuple[str, int], ...], gpus: int, start: int) -> None:
        self.chain, self.gpus, self.start, self.end = chain, gpus, start, None

    def overlap(self, lo: int, hi: int) -> int:
        end = hi if self.end is None else self.end
        return self.gpus * max(0, min(end, hi) - max(self.start, lo))


class FoldMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = State()
        self.events: list[Event] = []
        self.n = 0
        self.t = 0
        # the model
        self.now = 0
        self.lookback = 7 * DAY_MS
        self.incarnation: dict[str, int] = {"": 0}
        self.next_inc = 1
        self.dirty: set[str] = set()
        """Parents whose usage may exceed their children's (kept history of a removed
        child, or charged while they were a leaf)."""
        self.runs: list[Run] = []
        self.current: dict[str, Run] = {}
        self.specs: dict[str, WorkloadSubmitted] = {}
        self.model_status: dict[str, str] = {}
        self.ids: list[str] = []
        self.submitted: dict[str, int] = {}
        self.stops: dict[str, tuple[int, bool]] = {}
        """Runs preempted with notice: workload -> (deadline, requeued)."""
        self.held: dict[str, str] = {}
        """Held workloads (pending, out of scheduling) -> who held them."""
        self.heard: dict[str, list[tuple[int, int]]] = {}
        """Usage intervals folded per peer cluster."""
        self.peer_steps: list[tuple[int, int, tuple[tuple[str, int], ...]]] = []
        """Peer charges: (interval end, GPU-ms, the chain of (path, incarnation) charged)."""

    # -- plumbing -------------------------------------------------------------
    def _id(self) -> str:
        self.n += 1
        return f"e{self.n}"

    def end_stops(self, at_ms: int) -> None:
        """In the model, end every notice due by ``at_ms`` (time moves there), at its deadline."""
        if at_ms <= self.now:
            return
        for until, wid in sorted((u, w) for w, (u, _) in self.stops.items()):
            if until <= at_ms:
                requeued = self.stops.pop(wid)[1]
                run = self.current.pop(wid, None)
                if run is not None:
                    run.end = until
                self.model_status[wid] = "pending" if requeued else "preempted"

    def feed(self, event: Event) -> bool:
        """Fold ``event``; return whether it was accepted (inputs) ."""
        before = len(self.state.rejections)
        self.events.append(event)
        self.end_stops(event.at_ms)
        apply(self.state, event)
        self.now = max(self.now, event.at_ms)
        return len(self.state.rejections) == before

    def stamp(self, back: bool = False) -> int:
        return self.t - 1_000 if back and self.t >= 1_000 else self.t

    def charged_ever(self, path: str) -> int:
        key = (path, self.incarnation[path])
        own = sum(r.overlap(0, self.now) for r in self.runs if key in r.chain)
        return own + sum(g for _, g, chain in self.peer_steps if key in chain)

    def sync_tree(self) -> None:
        """Follow creations and removals in the model (the fold decides validity)."""
        nodes = self.state.budget.nodes
        for path in list(self.incarnation):
            if path not in nodes:
                if self.charged_ever(path):
                    self.dirty.add(path.rpartition("/")[0])
                del self.incarnation[path]
                self.dirty.discard(path)
        for path in nodes:
            if path not in self.incarnation:
                parent = path.rpartition("/")[0]
                if self.charged_ever(parent) and parent:
                    self.dirty.add(parent)  # a leaf with history becomes a parent
                self.incarnation[path] = self.next_inc
                self.next_inc += 1

    @initialize()
    def setup(self) -> None:
        self.feed(BudgetSet(id=self._id(), at_ms=0, path="", weight=1, owner=ADMIN, actor=""))
        for path, weight in (("a", 1), ("a/x", 2), ("a/y", 1), ("b", 3)):
            self.feed(
                BudgetSet(
                    id=self._id(), at_ms=0, path=path, weight=weight, owner=f"{path}-o", actor=ADMIN
                )
            )
        for node, gpus, kind in (("n0", 8, "a100"), ("n1", 8, "a100"), ("n2", 4, "h100")):
            self.feed(
                NodeRegistered(
                    id=self._id(), at_ms=0, node=node, gpus=gpus, gpu_type=kind, actor=ADMIN
                )
            )
        self.sync_tree()
        # some work running from the start, so that every example has charges to check
        for owner, gpus, min_runtime in (
            ("a/x", 4, HOUR_MS),
            ("a/y", 2, 0),
            ("b", 8, 8 * HOUR_MS),
            ("a/y", 1, MINUTE_MS),
        ):
            e = WorkloadSubmitted(
                id=self._id(),
                at_ms=0,
                workload=f"w{len(self.ids)}",
                owner=owner,
                gpus=gpus,
                min_runtime_ms=min_runtime,
                submitted_by=f"{owner}-o",
            )
            assert self.feed(e)
            self.ids.append(e.workload)
            self.specs[e.workload] = e
            self.model_status[e.workload] = "pending"
            self.submitted[e.workload] = 0
        self.schedule()
        assert len(self.runs) == 3
        self.t = HOUR_MS

    # -- inputs -------------------------------------------------------------------
    @rule(
        remove=st.sampled_from([False, False, True]),
        path=st.sampled_from(PATHS),
        weight=st.integers(-1, 4),
        actor=st.sampled_from(ACTORS),
        back=st.booleans(),
    )
    def budget_edit(self, remove: bool, path: str, weight: int, actor: str, back: bool) -> None:
        """Create, edit or remove a budget node (one rule, so removals stay a minority)."""
        if remove:
            self.feed(BudgetRemoved(id=self._id(), at_ms=self.stamp(back), path=path, actor=actor))
        else:
            self.feed(
                BudgetSet(
                    id=self._id(),
                    at_ms=self.stamp(back),
                    path=path,
                    weight=weight,
                    owner=f"{path}-o",
                    actor=actor,
                )
            )
        self.sync_tree()

    @rule(
        source=st.sampled_from(["east", "north"]),
        k=st.integers(0, 40),
        charges=st.lists(
            st.tuples(st.sampled_from(["", *PATHS, "gone/leaf"]), st.integers(0, 10**7)),
            max_size=3,
            unique_by=lambda c: c[0],
        ),
        actor=st.sampled_from(["federation:east", "federation:north", ADMIN, "mallory"]),
    )
    def usage_summary(
        self, source: str, k: int, charges: list[tuple[str, int]], actor: str
    ) -> None:
        """A peer cluster's usage: counted once, at its interval's end, on the deepest
        node of its path the tree has and every ancestor."""
        start, end = k * 5 * MINUTE_MS, (k + 1) * 5 * MINUTE_MS
        heard = self.heard.setdefault(source, [])
        expect = actor in (f"federation:{source}", ADMIN) and all(
            b <= start or end <= a for a, b in heard
        )
        e = UsageSummary(
            id=self._id(),
            at_ms=self.stamp(),
            source=source,
            start_ms=start,
            end_ms=end,
            charges=tuple(LeafCharge(p, g) for p, g in charges),
            actor=actor,
        )
        assert self.feed(e) == expect
        hypothesis_event("usage summary folded" if expect else "usage summary refused")
        if not expect:
            return
        heard.append((start, end))
        nodes = self.state.budget.nodes
        for path, gpu_ms in charges:
            while path not in nodes:
                path = path.rpartition("/")[0]
            if not gpu_ms:
                continue
            chain = tuple((p, self.incarnation[p]) for p in (*ancestors_of(path), path))
            self.peer_steps.append((end, gpu_ms, chain))
            if nodes[path].children or path == "":
                self.dirty.add(path)  # charged above its children

    @rule(
        lookback=st.sampled_from([HOUR_MS, DAY_MS, 7 * DAY_MS, 0]),
        actor=st.sampled_from([ADMIN, "mallory"]),
        grace=st.sampled_from([0, 0, MINUTE_MS, 20 * MINUTE_MS]),
    )
    def policy(self, lookback: int, actor: str, grace: int) -> None:
        if self.feed(
            PolicySet(
                id=self._id(),
                at_ms=self.stamp(),
                lookback_ms=lookback,
                max_min_runtime_ms=min(lookback, 8 * HOUR_MS),
                actor=actor,
                grace_ms=grace,
            )
        ):
            assert grace <= self.state.policy.max_grace_ms
            self.lookback = lookback

    @rule(
        register=st.booleans(),
        node=st.sampled_from(NODES),
        gpus=st.sampled_from([0, 4, 8, 8]),
        kind=st.sampled_from(["a100", "a100", "h100", "any"]),
        health=st.sampled_from(["healthy", "healthy", "draining", "down"]),
    )
    def host(self, register: bool, node: str, gpus: int, kind: str, health: HealthState) -> None:
        """Register (or re-register) a node, or change its health."""
        if register:
            self.feed(
                NodeRegistered(
                    id=self._id(),
                    at_ms=self.stamp(),
                    node=node,
                    gpus=gpus,
                    gpu_type=kind,
                    actor=f"agent:{node}",
                )
            )
        else:
            self.feed(
                NodeHealthChanged(
                    id=self._id(), at_ms=self.stamp(), node=node, state=health, actor=ADMIN
                )
            )

    @rule(
        data=st.data(),
        valid=st.sampled_from([True, True, False]),
        gpus=st.sampled_from([-1, 0, 1, 2, 4, 8, 12, 16, 32]),
        min_runtime=st.sampled_from([0, 15 * MINUTE_MS, HOUR_MS, 8 * HOUR_MS, 9 * HOUR_MS, -1]),
        kind=st.sampled_from(["any", "any", "a100", "h100", "tpu"]),
        resumable=st.booleans(),
        priority=st.integers(0, 2),
        back=st.booleans(),
        grace=st.sampled_from([None, None, 0, MINUTE_MS, 15 * MINUTE_MS]),
    )
    def submit(
        self, data, valid, gpus, min_runtime, kind, resumable, priority, back, grace
    ) -> None:
        """A submission: usually plausible (a current leaf, a gang that fits some node, a
        contract under the cap), otherwise anything (unknown or inner owners, bad gangs,
        unknown types, contracts out of range, reused ids)."""
        leaves = sorted(self.state.budget.leaves())
        if valid and leaves:
            owner = data.draw(st.sampled_from(leaves))
            gpus, kind = max(1, min(gpus, 8)), "any"
            min_runtime = max(0, min(min_runtime, self.state.policy.max_min_runtime_ms))
            wid = f"w{len(self.ids)}"
            # the leaf's owner or someone else (refused: the tree gives them no authority)
            by = data.draw(st.sampled_from([f"{owner}-o", f"{owner}-o", "mallory"]))
        else:
            owner = data.draw(st.sampled_from([*PATHS, "ghost", ""]))
            reuse = data.draw(st.booleans())
            wid = self.ids[-1] if reuse and self.ids else f"w{len(self.ids)}"
            by = f"{owner}-o"
        e = WorkloadSubmitted(
            id=self._id(),
            at_ms=self.stamp(back),
            workload=wid,
            owner=owner,
            gpus=gpus,
            min_runtime_ms=min_runtime,
            gpu_type=kind,
            resumable=resumable,
            priority=priority,
            submitted_by=by,
            grace_ms=grace,
        )
        accepted = self.feed(e)
        if by == "mallory":
            assert not accepted
        if wid not in self.ids:
            self.ids.append(wid)
        if accepted:
            assert wid not in self.model_status
            self.specs[wid] = e
            self.model_status[wid] = "pending"
            self.submitted[wid] = self.now

    def _end_run(self, wid: str) -> None:
        run = self.current.pop(wid, None)
        if run is not None:
            run.end = self.now

    @rule(data=st.data())
    def cancel(self, data) -> None:
        wid = data.draw(st.sampled_from([*self.ids, "ghost"]))
        spec = self.specs.get(wid)
        # the submitter, the root's owner, or someone with no authority over it
        actor = data.draw(st.sampled_from([spec.submitted_by if spec else ADMIN, ADMIN, "mallory"]))
        self.end_stops(self.stamp())
        expect = self.model_status.get(wid) in ("pending", "running") and actor != "mallory"
        accepted = self.feed(
            WorkloadCancelled(id=self._id(), at_ms=self.stamp(), workload=wid, actor=actor)
        )
        assert accepted == expect
        if accepted:  # a cancel during a notice ends the run at once
            self._end_run(wid)
            self.stops.pop(wid, None)
            self.held.pop(wid, None)
            self.model_status[wid] = "cancelled"

    @rule(data=st.data(), release=st.booleans())
    def hold(self, data, release: bool) -> None:
        """Hold a workload (only a pending one not held already), or release one (only
        a held one), as its submitter, the root's owner or someone without authority."""
        likely = sorted(self.held) if release else sorted(self.state.pending)
        pool = likely if likely and data.draw(st.booleans()) else [*self.ids, "ghost"]
        wid = data.draw(st.sampled_from(pool))
        spec = self.specs.get(wid)
        actor = data.draw(st.sampled_from([spec.submitted_by if spec else ADMIN, ADMIN, "mallory"]))
        self.end_stops(self.stamp())
        if release:
            expect = wid in self.held and actor != "mallory"
            event: Event = WorkloadReleased(
                id=self._id(), at_ms=self.stamp(), workload=wid, actor=actor
            )
        else:
            expect = (
                self.model_status.get(wid) == "pending"
                and wid not in self.held
                and actor != "mallory"
            )
            event = WorkloadHeld(id=self._id(), at_ms=self.stamp(), workload=wid, actor=actor)
        assert self.feed(event) == expect
        hypothesis_event(
            f"{'release' if release else 'hold'} {'accepted' if expect else 'refused'}"
        )
        if not expect:
            return
        order = [w.id for w in queue_order(self.state)]
        if release:
            del self.held[wid]
            assert wid in order and not self.state.workloads[wid].held  # placeable again
        else:
            self.held[wid] = actor
            assert wid not in order  # no cycle walks it
            placed = {
                d.workload for d in decide(self.state).decisions if isinstance(d, WorkloadPlaced)
            }
            assert not placed & set(self.held), "the scheduler placed held work"

    @rule(data=st.data(), outcome=st.sampled_from(["succeeded", "failed"]))
    def finish(self, data, outcome) -> None:
        running = sorted(self.state.running)
        wid = data.draw(
            st.sampled_from(
                running if running and data.draw(st.booleans()) else [*self.ids, "ghost"]
            )
        )
        w = self.state.workloads.get(wid)
        attempt = data.draw(
            st.sampled_from([None, w.attempt if w else 1, (w.attempt if w else 1) - 1])
        )
        on = w.placement[0].node if w is not None and w.placement else "n0"
        # an operator, the agent of a host it runs on, or another host's agent
        actor = data.draw(st.sampled_from([ADMIN, f"agent:{on}", "agent:elsewhere"]))
        self._finish(wid, outcome, attempt, actor)

    @precondition(lambda self: self.stops)
    @rule(data=st.data(), outcome=st.sampled_from(["failed", "failed", "succeeded"]))
    def exit_during_notice(self, data, outcome) -> None:
        """A run stopping under notice exits (a checkpointing job killed by SIGTERM
        exits 143: ``failed``) and its agent reports it, maybe after the deadline."""
        wid = data.draw(st.sampled_from(sorted(self.stops)))
        w = self.state.running[wid]
        self._finish(wid, outcome, w.attempt, f"agent:{w.placement[0].node}")

    def _finish(self, wid: str, outcome: str, attempt: int | None, actor: str) -> None:
        w = self.state.workloads.get(wid)
        self.end_stops(self.stamp())
        expect = (
            self.model_status.get(wid) == "running"
            and (attempt is None or attempt == w.attempt)
            and actor != "agent:elsewhere"
        )
        accepted = self.feed(
            WorkloadFinished(
                id=self._id(),
                at_ms=self.stamp(),
                workload=wid,
                outcome=outcome,
                attempt=attempt,
                actor=actor,
            )
        )
        assert accepted == expect
        if accepted:
            self._end_run(wid)
            stop = self.stops.pop(wid, None)
            if stop is not None and outcome == "failed":
                # stopped during its notice: the preemption's outcome stands
                self.model_status[wid] = "pending" if stop[1] else "preempted"
            else:
                self.model_status[wid] = outcome

    @rule(
        step=st.sampled_from([0, MINUTE_MS, HOUR_MS, 12 * HOUR_MS, 2 * DAY_MS, 5 * DAY_MS]),
        back=st.booleans(),
        cycle=st.booleans(),
    )
    def tick(self, step: int, back: bool, cycle: bool) -> None:
        """Time moves (sometimes stamped in the past); then, maybe, a crude cycle places work."""
        self.t += step
        self.feed(ClockTicked(id=self._id(), at_ms=self.stamp(back)))
        if cycle:
            self.schedule()

    # -- decisions, as a scheduler may make them ------------------------------------
    def placements(self) -> list[tuple[str, tuple[Slot, ...]]]:
        out = []
        healthy = [n for n in self.state.nodes.values() if n.health == "healthy"]
        for w in self.state.pending.values():
            if w.held:
                continue  # held work is not placed (the fold refuses it as corrupt)
            fits = [n for n in healthy if w.gpu_type in ("any", n.gpu_type)]
            single = [n for n in fits if n.free >= w.gpus]
            if single:
                out.append((w.id, (Slot(single[0].node, w.gpus),)))
            for kind in sorted({n.gpu_type for n in fits}):
                whole = [n for n in fits if n.gpu_type == kind and n.free == n.gpus]
                size = whole[0].gpus if whole else 0
                if size and w.gpus > size and w.gpus % size == 0:
                    same = [n for n in whole if n.gpus == size]
                    if len(same) >= w.gpus // size:
                        out.append(
                            (w.id, tuple(Slot(n.node, size) for n in same[: w.gpus // size]))
                        )
        return out

    @precondition(lambda self: self.placements())
    @rule(data=st.data())
    def place(self, data) -> None:
        wid, slots = data.draw(st.sampled_from(self.placements()))
        self._place(wid, slots)

    def _place(self, wid: str, slots: tuple[Slot, ...]) -> None:
        w = self.state.pending[wid]
        self.feed(
            WorkloadPlaced(
                id=self._id(),
                at_ms=self.state.now_ms,
                workload=wid,
                placement=slots,
                allocated=w.min_runtime_ms > 0,
                protected_until_ms=self.state.now_ms + w.min_runtime_ms,
                attempt=w.attempt + 1,
            )
        )
        spec = self.specs[wid]
        assert self.model_status[wid] == "pending"
        self.model_status[wid] = "running"
        if spec.min_runtime_ms > 0:
            chain = tuple((p, self.incarnation[p]) for p in [*ancestors_of(spec.owner), spec.owner])
            run = Run(chain, spec.gpus, self.now)
            self.runs.append(run)
            self.current[wid] = run

    @rule()
    def schedule(self) -> None:
        """Place every pending workload that fits, first come first placed (a crude cycle)."""
        while True:
            options = self.placements()
            if not options:
                return
            wid, slots = options[0]
            self._place(wid, slots)

    @precondition(lambda self: self.state.running)
    @rule(
        data=st.data(),
        reason=st.sampled_from(["fairshare", "unallocated", "drain", "node_down"]),
        grace=st.sampled_from([0, 0, 1, MINUTE_MS, HOUR_MS]),
    )
    def preempt(self, data, reason, grace) -> None:
        wid = data.draw(st.sampled_from(sorted(self.state.running)))
        requeued = self.specs[wid].resumable
        if wid in self.stops or reason == "node_down":
            reason, grace = "node_down", 0  # only a lost host ends a notice early
        self.feed(
            WorkloadPreempted(
                id=self._id(),
                at_ms=self.state.now_ms,
                workload=wid,
                reason=reason,
                requeued=requeued,
                grace_ms=grace,
            )
        )
        if grace:  # it keeps its GPUs and its charge until the deadline
            self.stops[wid] = (self.state.now_ms + grace, requeued)
            return
        self.stops.pop(wid, None)
        self._end_run(wid)
        self.model_status[wid] = "pending" if requeued else "preempted"

    @precondition(lambda self: self.state.rejections)
    @rule()
    def announce(self) -> None:
        ref = self.state.rejections[0][0]
        self.feed(
            InputRejected(id=self._id(), at_ms=self.state.now_ms, ref=ref, reason="announced")
        )

    @precondition(
        lambda self: any(
            n.health == "draining" and not n.workloads and not n.drained
            for n in self.state.nodes.values()
        )
    )
    @rule()
    def drained(self) -> None:
        node = next(
            n
            for n in self.state.nodes.values()
            if n.health == "draining" and not n.workloads and not n.drained
        )
        self.feed(NodeDrained(id=self._id(), at_ms=self.state.now_ms, node=node.node))

    # -- invariants --------------------------------------------------------------------
    def model_usage(self, path: str) -> int:
        key = (path, self.incarnation[path])
        lo = self.now - self.lookback
        own = sum(r.overlap(lo, self.now) for r in self.runs if key in r.chain)
        peer = sum(g for end, g, chain in self.peer_steps if lo < end <= self.now and key in chain)
        return own + peer

    @invariant()
    def clock_matches(self) -> None:
        assert self.state.now_ms == self.now

    @invariant()
    def usage_matches_model(self) -> None:
        nodes = self.state.budget.nodes
        assert sorted(nodes) == sorted(self.incarnation)
        for path, node in nodes.items():
            used = self.state.usage(path)
            assert used >= 0
            assert used == self.model_usage(path), path
            children = sum(self.state.usage(c) for c in node.children)
            if node.children and path not in self.dirty:
                assert used == children, path
            else:
                assert used >= children, path
        # unallocated work is never charged: the root's whole history is the allocated runs
        total = sum(r.overlap(0, self.now) for r in self.runs)
        assert self.state.budget.root.series.cumulative(self.now) == total

    @invariant()
    def stops_match_model(self) -> None:
        assert self.state.stop_deadlines == sorted((u, w) for w, (u, _) in self.stops.items())
        for wid, (until, requeued) in self.stops.items():
            stop = self.state.running[wid].stopping
            assert stop is not None and (stop.until_ms, stop.requeue) == (until, requeued)
            assert until > self.now
        assert State.from_bytes(self.state.to_bytes()).stop_deadlines == self.state.stop_deadlines

    @invariant()
    def gpus_add_up(self) -> None:
        for node in self.state.nodes.values():
            assert 0 <= node.free <= node.gpus
            assert node.free + sum(node.workloads.values()) == node.gpus
        for w in self.state.running.values():
            assert all(self.state.nodes[s.node].workloads[w.id] == s.gpus for s in w.placement)

    @invariant()
    def statuses_match_model(self) -> None:
        for wid, status in self.model_status.items():
            assert self.state.status_of(wid) == status, wid
            live = self.state.workloads.get(wid)
            if live is not None:  # requeues keep the original submit time
                assert live.submitted_ms == self.submitted[wid], wid

    @invariant()
    def held_work_is_pending_and_never_placed(self) -> None:
        held = {wid: w.held_by for wid, w in self.state.workloads.items() if w.held}
        assert held == self.held
        for wid in held:
            w = self.state.workloads[wid]
            assert w.status == "pending" and wid not in self.state.running and not w.placement
            assert w.held_ms is not None and w.held_ms <= self.now

    @invariant()
    def order_is_the_literal_definition(self) -> None:
        assert [w.id for w in queue_order(self.state)] == reference_order(self.state)

    @invariant()
    def committed_per_path_is_the_sum(self) -> None:
        # the view reads each path's committed charge from the protection index's
        # per-path sums; committed_charges sums the leaves up the tree
        whole = committed_charges(self.state)
        view = FairShareView(self.state)
        for path in sorted({*whole, *self.state.budget.nodes}):
            assert view.committed[path] == whole.get(path, 0), path
            assert view.committed.get(path, 0) == whole.get(path, 0), path

    @invariant()
    def replay_and_snapshot_agree(self) -> None:
        digest = self.state.digest()
        assert fold(self.events).digest() == digest
        assert State.from_bytes(self.state.to_bytes()).digest() == digest

    @invariant()
    def pending_index_is_its_definition(self) -> None:
        # kept by the fold since its first read (order_is_the_literal_definition reads it
        # at every step), against its definition and against the indexes of a refold and
        # of a restore (each built from the pending workloads at its first read, below)
        index = self.state.pending_index
        by_leaf: dict[str, list[tuple[int, int, str]]] = {}
        by_shape: dict[str, dict[tuple[str, int, int], list[tuple[int, int, str]]]] = {}
        free: dict[tuple[str, int], list[tuple[int, str]]] = {}
        for w in self.state.pending.values():
            if w.held:
                continue  # out of the index until released
            if w.min_runtime_ms > 0:
                key = (-w.priority, w.submitted_ms, w.id)
                by_leaf.setdefault(w.owner, []).append(key)
                shape = (w.gpu_type, w.gpus, w.min_runtime_ms)
                by_shape.setdefault(w.owner, {}).setdefault(shape, []).append(key)
            else:
                free.setdefault((w.gpu_type, w.gpus), []).append((w.submitted_ms, w.id))
        for keys in [
            *by_leaf.values(),
            *(k for s in by_shape.values() for k in s.values()),
            *free.values(),
        ]:
            keys.sort()
        refolded = fold(self.events).pending_index
        restored = State.from_bytes(self.state.to_bytes()).pending_index
        paths: dict[str, int] = {}
        live: dict[str, set[str]] = {}
        for leaf in by_leaf:
            for p in (*ancestors_of(leaf)[1:], leaf):
                paths[p] = 0
                live.setdefault(ancestors_of(p)[-1], set()).add(p)
        for other in (index, refolded, restored):
            assert other.by_leaf == by_leaf
            assert other.free == free
            assert other.by_shape == by_shape
            # the walk's start, kept until a leaf's queue appears or empties
            kept_paths, kept_live = other.live_paths()
            assert kept_paths == paths
            assert {p: set(c) for p, c in kept_live.items()} == live
            assert all(len(c) == len(set(c)) for c in kept_live.values())


FoldMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestFoldMachine = FoldMachine.TestCase
