"""The one fold of history items: inputs, undecodable inputs, batches, and canonical order."""

from __future__ import annotations

import pytest
from apportion.core.history import HistoryOrderError, decide_batch, fold_history, fold_item
from apportion.core.state import State
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    DecisionBatch,
    NodeRegistered,
    WorkloadSubmitted,
)
from apportion.schemas.history import BatchItem, HistoryItem, input_item, malformed_item


def _cluster() -> list[HistoryItem]:
    events = [
        BudgetSet(id="b0", at_ms=0, path="", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b1", at_ms=0, path="a", weight=1, owner="lead", actor="ops"),
        NodeRegistered(id="n0", at_ms=0, node="n0", gpus=8, gpu_type="h100", actor="ops"),
        WorkloadSubmitted(
            id="s1",
            at_ms=5,
            workload="w1",
            owner="a",
            gpus=8,
            min_runtime_ms=60,
            submitted_by="lead",
        ),
    ]
    return [input_item(i + 1, e) for i, e in enumerate(events)]


def test_inputs_and_a_batch_fold_in_order_and_report_rejections() -> None:
    state = State()
    seen: list[tuple[int, str | None]] = []
    fold_history(_cluster(), state, lambda item, _s, why: seen.append((item.seq, why)))
    assert [s for s, _ in seen] == [1, 2, 3, 4] and all(why is None for _, why in seen)
    bad = input_item(
        5, WorkloadSubmitted(id="s2", at_ms=6, workload="w2", owner="zz", gpus=1, min_runtime_ms=0)
    )
    assert "unknown owner" in (fold_item(state, bad) or "")
    batch, _ = decide_batch(state)
    assert batch.basis == 5 and {type(d).__name__ for d in batch.decisions} == {
        "InputRejected",
        "WorkloadPlaced",
    }
    assert fold_item(state, BatchItem(seq=1, batch=batch)) is None
    assert "w1" in state.running and state.rejections == []


def test_an_undecodable_input_moves_the_clock_and_is_rejected() -> None:
    state = fold_history(_cluster())
    why = fold_item(state, malformed_item(5, 99, "seq:5", "invalid JSON"))
    assert why == "malformed input: invalid JSON"
    assert (state.input_seq, state.now_ms, state.rejections) == (
        5,
        99,
        [("seq:5", why, "malformed")],
    )


def test_items_out_of_order_are_refused_and_change_nothing() -> None:
    state = fold_history(_cluster())
    digest = state.digest()
    with pytest.raises(HistoryOrderError):
        fold_item(state, input_item(4, ClockTicked(id="again", at_ms=7)))  # a repeat
    with pytest.raises(HistoryOrderError):
        fold_item(state, input_item(6, ClockTicked(id="gap", at_ms=7)))  # a gap
    batch, _ = decide_batch(state)
    early = BatchItem(seq=1, batch=DecisionBatch(basis=3, decisions=batch.decisions))
    with pytest.raises(HistoryOrderError):
        fold_item(state, early)  # based on an input that is not the last one folded
    assert state.digest() == digest


def test_folding_the_same_items_twice_gives_the_same_state() -> None:
    a, b = fold_history(_cluster()), fold_history(_cluster())
    assert a.digest() == b.digest()
