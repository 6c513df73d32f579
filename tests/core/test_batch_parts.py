"""A cycle too large for one message, split into parts: the cut, and the fold of the parts."""

from __future__ import annotations

import msgspec
import pytest
from apportion.core.history import (
    HistoryOrderError,
    batch_part,
    decide_batch,
    fold_history,
    fold_item,
    split_batch,
)
from apportion.core.state import State
from apportion.schemas.codec import decode_batch, encode
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    DecisionBatch,
    InputRejected,
    NodeRegistered,
    WorkloadPlaced,
    WorkloadSubmitted,
)
from apportion.schemas.history import BatchItem, HistoryItem, input_item

LONG = "x" * 400


def busy_history(placed: int = 24, rejected: int = 150) -> list[HistoryItem]:
    """A cluster of 4 x 8 GPUs, then ``placed`` 1-GPU submissions that fit and
    ``rejected`` ones to an unknown owner with 400-character ids: one cycle holds them all."""
    events = [
        BudgetSet(id="b0", at_ms=0, path="", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b1", at_ms=0, path="a", weight=1, owner="lead", actor="ops"),
    ]
    events += [
        NodeRegistered(id=f"n{i}", at_ms=0, node=f"n{i}", gpus=8, gpu_type="h100", actor="ops")
        for i in range(4)
    ]
    events += [
        WorkloadSubmitted(
            id=f"s{i}",
            at_ms=5,
            workload=f"w{i}",
            owner="a",
            gpus=1,
            min_runtime_ms=60,
            submitted_by="lead",
        )
        for i in range(placed)
    ]
    events += [
        WorkloadSubmitted(
            id=f"bad-{i}-{LONG}", at_ms=6, workload=f"b{i}", owner="nope", gpus=1, min_runtime_ms=0
        )
        for i in range(rejected)
    ]
    return [input_item(i + 1, e) for i, e in enumerate(events)]


@pytest.fixture
def decided() -> tuple[State, DecisionBatch]:
    state = fold_history(busy_history())
    batch, _ = decide_batch(state)
    return state, batch


def test_a_batch_that_fits_is_published_whole_and_encodes_as_before(decided) -> None:
    state, batch = decided
    assert split_batch(batch, state.decisions_folded, len(encode(batch))) == [batch]
    small = DecisionBatch(basis=3, decisions=(), next_wakeup_ms=None)
    assert encode(small) == b'{"basis":3,"decisions":[],"next_wakeup_ms":null,"v":1}'
    assert not small.is_part and not small.continued


def test_parts_fit_the_limit_and_together_are_the_cycle(decided) -> None:
    state, batch = decided
    kinds = {type(d) for d in batch.decisions}
    assert kinds == {WorkloadPlaced, InputRejected} and len(batch.decisions) == 24 + 150
    limit = 16_000
    assert len(encode(batch)) > 4 * limit
    parts = split_batch(batch, state.decisions_folded, limit)
    assert len(parts) >= 5
    assert all(len(encode(p)) <= limit for p in parts)
    assert tuple(d for p in parts for d in p.decisions) == batch.decisions
    assert [p.continued for p in parts] == [True] * (len(parts) - 1) + [False]
    assert [p.next_wakeup_ms for p in parts[:-1]] == [None] * (len(parts) - 1)
    assert parts[-1].next_wakeup_ms == batch.next_wakeup_ms
    counters = [p.decisions_before for p in parts]
    sizes = [len(p.decisions) for p in parts]
    assert counters == [state.decisions_folded + sum(sizes[:i]) for i in range(len(parts))]
    # deterministic, and a part survives the wire
    assert split_batch(batch, state.decisions_folded, limit) == parts
    assert all(decode_batch(encode(p)) == p for p in parts)
    # the audit cuts a recomputed batch where the recorded parts were cut
    start = 0
    for p in parts:
        stop = start + len(p.decisions)
        assert batch_part(batch, start, stop, state.decisions_folded) == p
        start = stop


def test_folding_the_parts_is_folding_the_batch(decided) -> None:
    state, batch = decided
    whole = state.copy()
    fold_item(whole, BatchItem(seq=1, batch=batch))
    parts = split_batch(batch, state.decisions_folded, 16_000)
    for i, part in enumerate(parts):
        fold_item(state, BatchItem(seq=i + 1, batch=part))
    assert state.digest() == whole.digest()
    assert state.rejections == [] and len(state.running) == 24


def test_a_part_out_of_place_is_refused_and_changes_nothing(decided) -> None:
    state, batch = decided
    parts = split_batch(batch, state.decisions_folded, 16_000)
    fold_item(state, BatchItem(seq=1, batch=parts[0]))
    digest = state.digest()
    for wrong in (parts[0], parts[2], parts[-1]):  # repeated, one skipped, the last too early
        with pytest.raises(HistoryOrderError):
            fold_item(state, BatchItem(seq=2, batch=wrong))
        assert state.digest() == digest
    fold_item(state, BatchItem(seq=2, batch=parts[1]))
    # an input between two parts moves the basis: the next part no longer applies
    interloper = input_item(state.input_seq + 1, ClockTicked(id="tick", at_ms=7))
    fold_item(state, interloper)
    with pytest.raises(HistoryOrderError):
        fold_item(state, BatchItem(seq=3, batch=parts[2]))


def test_a_decision_larger_than_the_limit_gets_a_part_of_its_own(decided) -> None:
    state, batch = decided
    biggest = max(len(encode(d)) for d in batch.decisions)
    parts = split_batch(batch, state.decisions_folded, biggest // 2)
    assert [len(p.decisions) for p in parts] == [1] * len(batch.decisions)


def test_the_rest_of_a_cycle_left_in_parts(decided) -> None:
    state, batch = decided
    parts = split_batch(batch, state.decisions_folded, 16_000)
    done = len(parts[0].decisions) + len(parts[1].decisions)
    rest = split_batch(batch, state.decisions_folded, 16_000, start=done)
    assert tuple(d for p in parts[:2] + rest for d in p.decisions) == batch.decisions
    assert rest[0].decisions_before == state.decisions_folded + done
    assert not rest[-1].continued and rest[-1].next_wakeup_ms == batch.next_wakeup_ms
    # everything published but the closing word: one empty last part
    (closing,) = split_batch(batch, state.decisions_folded, 16_000, start=len(batch.decisions))
    assert closing.decisions == () and closing.is_part and not closing.continued
    after = state.decisions_folded + len(batch.decisions)
    assert closing.decisions_before == after
    assert msgspec.json.decode(encode(closing))["decisions_before"] == after
