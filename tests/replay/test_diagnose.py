"""``diagnose`` on hand-built histories: one per cause, each with its expected split.

Each history is written event by event with the core tests' :class:`Scenario`
(folded by the real core as it is written) and cut into canonical history
items by :class:`Run`: :meth:`Run.batch` makes the events since the last cut
into inputs followed by one decision batch (the decisions the test wrote, or
none: a cycle that placed nothing). Every test ends with an empty batch one hour
after the moment it examines, so the figures read as GPUs over that hour.

Teams hang under the root, each with one leaf ``TEAM/u``; the budget's weights
give the shares (``share x healthy GPUs`` is what a team is owed, capped by its
allocated demand). Unless a test says otherwise the margin is 0 and
reservations are off, so only the cause under test is in play.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from apportion.replay.diagnose import CAUSES, SCHEDULER_CAUSES, controlled_share, diagnose
from apportion.schemas.events import (
    HOUR_MS,
    MINUTE_MS,
    DecisionBatch,
    InputRejected,
    NodeDrained,
    WorkloadPlaced,
    WorkloadPreempted,
)
from apportion.schemas.history import BatchItem, HistoryItem, input_item
from core_builders import Scenario

DECISIONS = (WorkloadPlaced, WorkloadPreempted, NodeDrained, InputRejected)


class Run:
    """A :class:`Scenario` cut into history items (module docstring)."""

    def __init__(
        self,
        teams: dict[str, int],
        nodes: int = 3,
        gpus: int = 8,
        gpu_type: str = "h100",
        margin_ppm: int = 0,
        reservations: bool = False,
        extra_nodes: tuple[tuple[str, int, str], ...] = (),
        margin_wait_ms: int = 0,
        node_prefix: str = "n",
        **policy: object,
    ) -> None:
        """``policy``: more fields of the policy (a federated cluster's ``cluster`` and
        ``peers``)."""
        s = self.s = Scenario()
        s.policy(
            preemption_margin_ppm=margin_ppm,
            reservations=reservations,
            preemption_margin_wait_ms=margin_wait_ms,
            **policy,
        )
        for team, weight in teams.items():
            s.budget(team, weight, owner=f"{team}-owner")
            s.budget(f"{team}/u", owner=f"{team}-user")
        for i in range(1, nodes + 1):
            s.node(f"{node_prefix}{i}", gpus, gpu_type)
        for name, size, kind in extra_nodes:
            s.node(name, size, kind)
        self.parts: list[object] = []
        """Inputs (events) and batches (lists of decisions), in history order."""
        self.done = 0

    def at(self, t_ms: int) -> Run:
        if t_ms != self.s.t:
            self.s.tick(t_ms)
        return self

    def submit(self, wid: str, team: str, gpus: int, min_runtime_ms: int, **kw) -> Run:
        self.s.submit(wid, f"{team}/u", gpus=gpus, min_runtime_ms=min_runtime_ms, **kw)
        return self

    def place(self, wid: str, *nodes) -> Run:
        self.s.place(wid, *nodes)
        return self

    def _sync(self) -> None:
        for e in self.s.events[self.done :]:
            if isinstance(e, DECISIONS):
                assert self.parts and isinstance(self.parts[-1], list), "a decision outside a batch"
                self.parts[-1].append(e)
            else:
                self.parts.append(e)
        self.done = len(self.s.events)

    def batch(self) -> Run:
        """A cycle here: the decisions written next (before any input) are its batch."""
        self._sync()
        self.parts.append([])
        return self

    @property
    def items(self) -> list[HistoryItem]:
        self._sync()
        out: list[HistoryItem] = []
        inputs = batches = 0
        for part in self.parts:
            if isinstance(part, list):
                batches += 1
                batch = DecisionBatch(basis=inputs, decisions=tuple(part))
                out.append(BatchItem(seq=batches, batch=batch))
            else:
                inputs += 1
                out.append(input_item(inputs, part))  # type: ignore[arg-type]
        return out

    def rows(self) -> dict[str, dict]:
        return {r["team"]: r for r in diagnose(self.items).rows()}


def split(row: dict) -> dict[str, float]:
    """The causes of a row that are not zero."""
    assert set(row["causes"]) == set(CAUSES)
    return {c: v for c, v in row["causes"].items() if v}


T0 = 0
T1 = MINUTE_MS
"""The moment most tests examine (one minute in: the work placed at 0 weighs on its
team's ratio by its committed charge)."""


def _full_cluster(run: Run, a_min: int = 4 * HOUR_MS, c_min: int = 4 * HOUR_MS) -> Run:
    """At 0: ``a0`` (a, 8 GPUs) on n1 and ``c1`` (c, 8 GPUs) on n3, both protected."""
    run.submit("a0", "a", 8, a_min).submit("c1", "c", 8, c_min)
    return run.batch().place("a0", "n1").place("c1", "n3")


def test_admission_placed_for_a_less_under_served_team_while_the_waiter_waited():
    """Three teams of weight 1 on 3 x 8 GPUs (owed 8 each). At 0: a0 (a) on n1 and
    c1 (c) on n3, 4 h contracts. At 1 min b1 (b, 8 GPUs) is pending when the batch
    places a2 (a, 8 GPUs, 4 h) on n2: a's ratio then is its committed charge
    8 x 1 min charged + 8 x 239 min committed > b's 0, so a2 was placed for a team less under-served than b,
    whose work was waiting: ``admission``.

    b is short 8 GPUs for the hour. b1's cheapest node is n2 (its level-5 run is
    an admission; n1 and n3 hold contracts placed before b1 was pending):
    admission 8 GPU-h, held by a."""
    run = _full_cluster(Run({"a": 1, "b": 1, "c": 1}))
    run.batch()
    run.at(T1).submit("b1", "b", 8, HOUR_MS).submit("a2", "a", 8, 4 * HOUR_MS)
    run.batch().place("a2", "n2")
    run.at(T1 + HOUR_MS).batch()
    b = run.rows()["b"]
    assert b["shortfall_gpu_h"] == pytest.approx(8.0)
    assert split(b) == {"admission": pytest.approx(8.0)}
    assert b["holders"] == {"a": pytest.approx(8.0)}
    assert "admission" in SCHEDULER_CAUSES


def test_contracts_when_the_holder_was_placed_before_the_waiter_was_pending():
    """As above, but a2 is placed at 1 min and b1 submitted at 2 min: every run on
    the cluster was placed before b1 was pending. b is short 8 GPUs for the hour,
    all ``contracts`` (the first node by name, n1, held by a0): 8 GPU-h, held by a."""
    run = _full_cluster(Run({"a": 1, "b": 1, "c": 1}))
    run.batch()
    run.at(T1).submit("a2", "a", 8, 4 * HOUR_MS).batch().place("a2", "n2")
    run.at(2 * T1).submit("b1", "b", 8, HOUR_MS).batch()
    run.at(2 * T1 + HOUR_MS).batch()
    b = run.rows()["b"]
    assert split(b) == {"contracts": pytest.approx(8.0)}
    assert b["holders"] == {"a": pytest.approx(8.0)}


def test_contracts_when_the_holder_team_was_more_under_served_than_the_waiter():
    """b (weight 2) and a, c (weight 1) on 3 x 8 GPUs: b is owed 12, a and c 6.
    At 0: a0 (a, 8 GPUs, 1 h contract) on n1, b0 (b, 8 GPUs, 4 h) on n3. At 1 min
    b1 (b, 8) is pending when a2 (a, 8, 4 h) is placed on n2. a's ratio is then
    (8 x 1 charged + 8 x 59 committed) / 1 = 480 GPU-min, b's 8 x 240 / 2 = 960:
    a was more under-served than b, so a2 is the price of the contract for b1, not an admission.

    b runs 8 of its 12 owed: short 4 for the hour, explained by b1 (4 of its 8
    GPUs). Every other node's run is a contract (n1: a0, placed before b1; n2: a2;
    b's own b0 on n3 is level 6): ``contracts`` 4, held by a."""
    run = Run({"a": 1, "b": 2, "c": 1})
    run.submit("a0", "a", 8, HOUR_MS).submit("b0", "b", 8, 4 * HOUR_MS)
    run.batch().place("a0", "n1").place("b0", "n3")
    run.at(T1).submit("b1", "b", 8, HOUR_MS).submit("a2", "a", 8, 4 * HOUR_MS)
    run.batch().place("a2", "n2")
    run.at(T1 + HOUR_MS).batch()
    b = run.rows()["b"]
    assert b["shortfall_gpu_h"] == pytest.approx(4.0)
    assert split(b) == {"contracts": pytest.approx(4.0)}
    assert set(b["holders"]) == {"a"}


def test_a_holder_past_its_contract_is_not_named_under_contracts():
    """b's 16-GPU gang b1 needs two whole nodes of 3 x 8. At 0: a0 (a, 8 GPUs, 30 min
    contract) on n1, c1 (c, 4 h) on n2 and c2 (c, 4 h) on n3; b1 submitted at 0.
    Examined at 1 h (a0 past its contract; b's ratio 0 is clearly below a's):
    n1 clears at level 2 (a0 may be preempted), n2 and n3 at level 5. The cheapest
    two nodes are n1 and n2; the blocking level is 5, whose runs on them are c1
    only: b's shortfall of 8 (owed 8 of its 16 demand) is ``contracts`` 8, held
    by c alone (a, on n1 past its contract, is not a holder at that level: the old
    diagnosis named a and c 4 each)."""
    run = Run({"a": 1, "b": 1, "c": 1})
    run.submit("a0", "a", 8, 30 * MINUTE_MS).submit("b1", "b", 16, HOUR_MS)
    run.submit("c1", "c", 8, 4 * HOUR_MS).submit("c2", "c", 8, 4 * HOUR_MS)
    run.batch().place("a0", "n1").place("c1", "n2").place("c2", "n3")
    run.at(HOUR_MS).batch()
    run.at(2 * HOUR_MS).batch()
    late = diagnose(run.items).rows(from_ms=HOUR_MS)
    b = {r["team"]: r for r in late}["b"]
    assert b["shortfall_gpu_h"] == pytest.approx(8.0)
    assert split(b) == {"contracts": pytest.approx(8.0)}
    assert b["holders"] == {"c": pytest.approx(8.0)}


def test_window_names_the_holder_past_its_contract():
    """a (weight 1) and b (weight 3) on 3 x 8 GPUs: b is owed 18. At 0 b0 and b2
    (b, 8 GPUs each, 30 min contracts) run on n2 and n3, b1 (b, 8) waits; at 50 min
    a0 (a, 8 GPUs, 5 min contract) is placed on n1 (the only free node; b1 was
    not placed there in this history). Examined at 1 h: b's ratio 16 x 60 / 3 =
    320 GPU-min, a's 8 x 10 / 1 = 80: b's side is not lower, so a0, past its
    contract, is at level 4. b runs 16 of 18 owed: short 2, explained by b1
    (n1 level 4, n2 and n3 b's own work): ``window`` 2, held by a."""
    run = Run({"a": 1, "b": 3})
    run.submit("b0", "b", 8, 30 * MINUTE_MS).submit("b2", "b", 8, 30 * MINUTE_MS)
    run.submit("b1", "b", 8, HOUR_MS)
    run.batch().place("b0", "n2").place("b2", "n3")
    run.at(50 * MINUTE_MS).submit("a0", "a", 8, 5 * MINUTE_MS).batch().place("a0", "n1")
    run.at(HOUR_MS).batch()
    run.at(2 * HOUR_MS).batch()
    b = {r["team"]: r for r in diagnose(run.items).rows(from_ms=HOUR_MS)}["b"]
    assert b["shortfall_gpu_h"] == pytest.approx(2.0)
    assert split(b) == {"window": pytest.approx(2.0)}
    assert b["holders"] == {"a": pytest.approx(2.0)}


def test_fragmentation_is_bounded_by_the_idle_gpus():
    """a, c (weight 1) and b (weight 2) on 3 x 8 GPUs: b is owed 12. At 0 a0 (a, 4
    GPUs) on n1, c1 (c, 4) on n2, c2 (c, 8) on n3, all 4 h contracts; b1 and b2
    (b, 8 GPUs each) wait. 8 GPUs are idle (4 on n1, 4 on n2), none 8 on one node.

    b is short 12: b1 explains 8 of it, b2 the other 4. b1: ``fragmentation``,
    bounded by the 8 idle GPUs: 8 (the ledger is now empty). b2 sees the same
    fragmentation but no idle GPU is left to explain, so its 4 go to the level
    explanation: the cheapest node is n1 (4 free, a0's 4 inside its contract,
    placed with every ratio 0: ``contracts``), held by a. The old diagnosis put all
    12 on ``fragmentation`` (more than the 8 idle GPUs)."""
    run = Run({"a": 1, "b": 2, "c": 1})
    run.submit("a0", "a", 4, 4 * HOUR_MS).submit("c1", "c", 4, 4 * HOUR_MS)
    run.submit("c2", "c", 8, 4 * HOUR_MS)
    run.submit("b1", "b", 8, HOUR_MS).submit("b2", "b", 8, HOUR_MS)
    run.batch().place("a0", ("n1", 4)).place("c1", ("n2", 4)).place("c2", "n3")
    run.at(HOUR_MS).batch()
    b = run.rows()["b"]
    assert b["shortfall_gpu_h"] == pytest.approx(12.0)
    assert split(b) == {"fragmentation": pytest.approx(8.0), "contracts": pytest.approx(4.0)}
    assert b["holders"] == {"a": pytest.approx(4.0)}


def test_reservation_explains_the_idle_gpus_it_holds():
    """Three teams of weight 1 on 3 x 8 GPUs (owed 8 each), reservations on. At 0
    a0 (a, 8 GPUs, 1 h contract) on n2 and a1 (a, 8, 2 h) on n3; b's gang b1 (16
    GPUs) and c1 (c, 8 GPUs, 4 h contract) wait. The cycle reserves n1 and n2 for
    b1 from 1 h, so c1 (protected past 1 h) may not use the idle n1.

    Examined for the half hour to 30 min. b (fair-share order: b before c at equal
    ratio 0, by path) is short 8 GPUs: b1 needs n1 (free) and n2 (a0 inside its
    contract, placed with every ratio 0): ``contracts`` 8 x 0.5 h = 4 GPU-h, held
    by a. c is short 8: c1 fits on n1 but for the reservation: ``reservation``
    4 GPU-h, the idle GPUs the reservation holds."""
    run = Run({"a": 1, "b": 1, "c": 1}, reservations=True)
    run.submit("a0", "a", 8, HOUR_MS).submit("a1", "a", 8, 2 * HOUR_MS)
    run.submit("b1", "b", 16, HOUR_MS).submit("c1", "c", 8, 4 * HOUR_MS)
    run.batch().place("a0", "n2").place("a1", "n3")
    run.at(30 * MINUTE_MS).batch()
    rows = {r["team"]: r for r in diagnose(run.items).rows()}
    assert split(rows["b"]) == {"contracts": pytest.approx(4.0)}
    assert rows["b"]["holders"] == {"a": pytest.approx(4.0)}
    assert split(rows["c"]) == {"reservation": pytest.approx(4.0)}


def test_type_full_is_bounded_by_the_idle_gpus_of_other_types():
    """a and c (weight 1) on 3 x 8 h100 and one 8-GPU a100 node m1 (32 GPUs, owed
    16 each). At 0 a0 (a, 8 a100) on m1, a1 and a2 (a, 8 h100) on n2 and n3, all
    4 h contracts; c1 and c2 (c, 8 a100 each) wait. The a100 pool is full, 8 h100
    GPUs are idle (n1).

    c is short 16: c1 explains 8, ``type_full`` bounded by the 8 idle h100 GPUs: 8.
    c2 sees the same, with no idle GPU left: its 8 go to what holds the a100 node:
    a0 inside its contract: ``contracts`` 8, held by a."""
    run = Run({"a": 1, "c": 1}, extra_nodes=(("m1", 8, "a100"),))
    run.submit("a0", "a", 8, 4 * HOUR_MS, gpu_type="a100")
    run.submit("a1", "a", 8, 4 * HOUR_MS).submit("a2", "a", 8, 4 * HOUR_MS)
    run.submit("c1", "c", 8, HOUR_MS, gpu_type="a100").submit(
        "c2", "c", 8, HOUR_MS, gpu_type="a100"
    )
    run.batch().place("a0", "m1").place("a1", "n2").place("a2", "n3")
    run.at(HOUR_MS).batch()
    c = run.rows()["c"]
    assert c["shortfall_gpu_h"] == pytest.approx(16.0)
    assert split(c) == {"type_full": pytest.approx(8.0), "contracts": pytest.approx(8.0)}
    assert c["holders"] == {"a": pytest.approx(8.0)}


def test_unallocated_work_it_could_preempt():
    """Three teams of weight 1 on 3 x 8 GPUs. At 0 u1 (c, 8 GPUs, free: no minimum
    runtime) on n1, a0 (a, 8, 4 h) on n2, c1 (c, 8, 4 h) on n3; b1 (b, 8) waits.
    b is short 8: n1 clears at level 1 (free work): ``unallocated`` 8, held by c."""
    run = Run({"a": 1, "b": 1, "c": 1})
    run.submit("u1", "c", 8, 0).submit("a0", "a", 8, 4 * HOUR_MS)
    run.submit("c1", "c", 8, 4 * HOUR_MS).submit("b1", "b", 8, HOUR_MS)
    run.batch().place("u1", "n1").place("a0", "n2").place("c1", "n3")
    run.at(HOUR_MS).batch()
    b = run.rows()["b"]
    assert split(b) == {"unallocated": pytest.approx(8.0)}
    assert b["holders"] == {"c": pytest.approx(8.0)}


def _inside_the_margin(margin_wait_ms: int) -> dict:
    """b's row from 1 h on of the history the next two tests describe."""
    run = Run({"a": 1, "b": 1, "c": 1}, margin_ppm=500_000, margin_wait_ms=margin_wait_ms)
    run.submit("a0", "a", 8, 30 * MINUTE_MS).submit("b0", "b", 4, 30 * MINUTE_MS)
    run.submit("c1", "c", 8, 4 * HOUR_MS).submit("b1", "b", 8, HOUR_MS)
    run.batch().place("a0", "n1").place("b0", ("n2", 4)).place("c1", "n3")
    run.at(HOUR_MS).batch()
    run.at(2 * HOUR_MS).batch()
    b = {r["team"]: r for r in diagnose(run.items).rows(from_ms=HOUR_MS)}["b"]
    return b


def test_margin_past_its_contract_inside_the_margin():
    """Three teams of weight 1 on 3 x 8 GPUs (owed 8 each), margin 50%. At 0 a0 (a,
    8 GPUs, 30 min) on n1, b0 (b, 4 GPUs, 30 min) on n2, c1 (c, 8, 4 h) on n3; b1
    (b, 8) waits. Examined at 1 h: b's ratio 4 GPU-h is below a's 8 but not by the
    margin (4 < 0.5 x 8 is false): a0 is at level 3. b runs 4 of 8 owed: short 4,
    explained by b1 (n1 level 3; n2: 4 free and b's own b0; n3 a contract):
    ``margin`` 4, held by a."""
    b = _inside_the_margin(0)
    assert b["shortfall_gpu_h"] == pytest.approx(4.0)
    assert split(b) == {"margin": pytest.approx(4.0)}
    assert b["holders"] == {"a": pytest.approx(4.0)}


def test_past_the_margin_wait_the_same_block_is_the_schedulers_not_the_margins():
    """As above, with a margin wait of 30 minutes: at 1 h b1 has waited an hour, is
    no longer held to the margin, and outranks a0 (b's ratio is strictly lower): a0
    is at level 2, work the cycle could take, so the shortfall is not ``margin``
    (a named cause the scheduler could have placed past: ``other``)."""
    b = _inside_the_margin(30 * MINUTE_MS)
    assert b["shortfall_gpu_h"] == pytest.approx(4.0)
    assert split(b) == {"other": pytest.approx(4.0)}


def test_own_work_of_a_gang_larger_than_what_the_share_leaves():
    """a (weight 1) and b (weight 3) on 3 x 8 GPUs: b is owed 18. At 0 b0 and b2 (b,
    8 GPUs, 4 h) on n1 and n2; b's gang b1 (16 GPUs) waits; n3 is idle. b runs 16:
    short 2, explained by b1, which needs n3 and one of b's own nodes:
    ``own_work`` 2, no other team holding anything."""
    run = Run({"a": 1, "b": 3})
    run.submit("b0", "b", 8, 4 * HOUR_MS).submit("b2", "b", 8, 4 * HOUR_MS)
    run.submit("b1", "b", 16, HOUR_MS)
    run.batch().place("b0", "n1").place("b2", "n2")
    run.at(HOUR_MS).batch()
    b = run.rows()["b"]
    assert b["shortfall_gpu_h"] == pytest.approx(2.0)
    assert split(b) == {"own_work": pytest.approx(2.0)}
    assert b["holders"] == {}


def test_nodes_down_when_too_few_healthy_nodes_are_left_for_the_gang():
    """a and b (weight 1) on 3 x 8 GPUs, n3 down: 16 healthy GPUs, owed 8 each. b's
    gang b1 (24 GPUs: three whole nodes) waits on an idle cluster: b is short 8,
    ``nodes_down`` 8."""
    run = Run({"a": 1, "b": 1})
    run.s.health("n3", "down")
    run.submit("b1", "b", 24, HOUR_MS)
    run.batch()
    run.at(HOUR_MS).batch()
    rows = run.rows()
    assert split(rows["b"]) == {"nodes_down": pytest.approx(8.0)}
    assert controlled_share(list(rows.values())) == 0.0


@pytest.mark.parametrize(
    ("a0_ends", "expected"),
    [
        (True, {"contracts": 4.0, "admission": 4.0}),
        (False, {"contracts": 8.0}),
    ],
)
def test_a_gang_on_admitted_and_contracted_nodes_pays_the_contracts_until_they_end(
    a0_ends: bool, expected: dict[str, float]
) -> None:
    """As in the admission test, but b1 is a 16-GPU gang (two whole nodes). At 1
    min: n1 holds a0 (placed at 0, before b1 was pending: ``contracts``), n2 a2
    (placed at 1 min for a, less under-served than b, while b1 waited:
    ``admission``), n3 c1 (placed at 0: ``contracts``). The cheapest two nodes are
    n2 (an admission is cheaper to clear than a contract) and n1. Had the
    scheduler admitted nothing, b1 would still wait for a0's contract on n1, so
    while a0 runs the part is ``contracts``. If a0 ends at 31 min, from then the
    admitted a2 alone keeps b1 off (n1 free, n2 admitted): ``admission``. b is
    short 8 GPUs for the hour (owed 8 of its 16 demand), all held by a (c's node
    is not among the cheapest)."""
    run = Run({"a": 1, "b": 1, "c": 1})
    run.submit("a0", "a", 8, 4 * HOUR_MS).submit("c1", "c", 8, 4 * HOUR_MS)
    run.batch().place("a0", "n1").place("c1", "n3")
    run.at(T1).submit("b1", "b", 16, HOUR_MS).submit("a2", "a", 8, 4 * HOUR_MS)
    run.batch().place("a2", "n2")
    if a0_ends:
        run.at(T1 + HOUR_MS // 2)
        run.s.finish("a0")
        run.batch()
    run.at(T1 + HOUR_MS).batch()
    b = run.rows()["b"]
    assert b["shortfall_gpu_h"] == pytest.approx(8.0)
    assert split(b) == {k: pytest.approx(v) for k, v in expected.items()}
    assert b["holders"] == {"a": pytest.approx(8.0)}
