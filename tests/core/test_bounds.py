"""Bounds of every field: extreme and malformed inputs through decode -> fold ->
decisions -> DuckDB projection -> snapshot, with no crash and no change on rejection.

The inputs are what a publisher can send: JSON bytes read the way the live
readers read them (``services.bus.to_input_item``), and events made in Python
the way the simulator makes them (``schemas.history.input_item``).
"""

from __future__ import annotations

import json
from typing import Any, get_args, get_origin

import duckdb
import msgspec
import pytest
from apportion.core.history import decide_batch, fold_history, fold_item
from apportion.core.state import State
from apportion.replay.projection import Projection
from apportion.schemas.bounds import (
    MAX_DURATION_MS,
    MAX_EVENT_ID_LEN,
    MAX_GPUS,
    MAX_NAME_LEN,
    MAX_PATH_LEN,
    MAX_REASON_LEN,
    MAX_TIME_MS,
    clip_reason,
)
from apportion.schemas.codec import bounds_error, decode_batch, decode_input, encode
from apportion.schemas.events import (
    DAY_MS,
    INPUT_TYPES,
    BudgetSet,
    ClockTicked,
    InputRejected,
    NodeRegistered,
    PolicySet,
    WorkloadSubmitted,
    kind_of_type,
)
from apportion.schemas.history import BatchItem, HistoryItem, InputItem, input_item
from apportion.schemas.jsonschema import json_schemas
from apportion.services.bus import to_input_item
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# -- a small cluster with a running and a pending workload ---------------------


def _base_history() -> list[HistoryItem]:
    events = [
        NodeRegistered(id="n0", at_ms=0, node="h000", gpus=8, gpu_type="h100"),
        NodeRegistered(id="n1", at_ms=0, node="h001", gpus=8, gpu_type="h100"),
        BudgetSet(id="b0", at_ms=0, path="", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b1", at_ms=0, path="llm", weight=3, owner="alice", actor="ops"),
        BudgetSet(id="b2", at_ms=0, path="llm/a", weight=1, owner="a", actor="alice"),
        BudgetSet(id="b3", at_ms=0, path="vision", weight=1, owner="vic", actor="ops"),
        PolicySet(id="p0", at_ms=0, actor="ops"),
        WorkloadSubmitted(
            id="s1",
            at_ms=10,
            workload="r1",
            owner="llm/a",
            gpus=16,
            min_runtime_ms=60_000,
            submitted_by="a",
        ),
        WorkloadSubmitted(
            id="s2",
            at_ms=20,
            workload="q1",
            owner="vision",
            gpus=8,
            min_runtime_ms=0,
            submitted_by="vic",
        ),
    ]
    state = State()
    items: list[HistoryItem] = []
    for i, e in enumerate(events):
        item = input_item(i + 1, e)
        fold_item(state, item)
        items.append(item)
    batch, _ = decide_batch(state)
    items.append(BatchItem(seq=1, batch=batch))
    return items


BASE = _base_history()


def _replayed() -> tuple[State, Projection]:
    state = State()
    projection = Projection(duckdb.connect())
    fold_history(BASE, state, projection)
    projection.commit(state)
    assert "r1" in state.running and "q1" in state.pending
    return state, projection


def _unchanged_but_for_the_rejection(before: State, after: State, item: InputItem) -> None:
    """A rejected input changes what a ``ClockTicked`` at its time would, plus the record
    (and the memory of its id: core/rules/identity.py, an input is folded once)."""
    twin = before.copy()
    at_ms = item.event.at_ms if item.event is not None else item.at_ms
    fold_item(twin, input_item(item.seq, ClockTicked(id="twin", at_ms=at_ms)))
    twin.rejections.append(after.rejections[-1])
    assert set(after.input_ids) - set(before.input_ids) <= {item.ref}
    twin.input_ids, twin.input_id_expiry = after.input_ids, after.input_id_expiry
    assert after.to_bytes() == twin.to_bytes()


def _fold_and_decide(
    state: State, projection: Projection, item: InputItem, batches: int
) -> str | None:
    """One input, then the cycle after it, through the fold and the projection; the
    checks every consumer relies on."""
    before = state.copy()
    why = fold_item(state, item)
    projection(item, state, why)
    if why is not None:
        _unchanged_but_for_the_rejection(before, state, item)
    batch, _ = decide_batch(state)
    assert decode_batch(encode(batch)) == batch  # what the scheduler publishes decodes
    if why is not None:
        rejected = [d for d in batch.decisions if isinstance(d, InputRejected)]
        assert [d.ref for d in rejected] == [item.ref]
    batch_item = BatchItem(seq=batches + 1, batch=batch)
    fold_item(state, batch_item)
    projection(batch_item, state, None)
    projection.commit(state)  # every value fits its DuckDB column
    restored = State.from_bytes(state.to_bytes())
    assert restored.digest() == state.digest()
    return why


# -- values a publisher may send ---------------------------------------------------

EXTREME_INTS = [
    0,
    1,
    -1,
    8,
    16,
    60_000,
    MAX_GPUS,
    MAX_GPUS + 1,
    MAX_DURATION_MS,
    MAX_DURATION_MS + 1,
    MAX_TIME_MS,
    MAX_TIME_MS + 1,
    2**31 - 1,
    2**31,
    -(2**31),
    -(2**31) - 1,
    2**53,
    2**63 - 1,
    2**63,
    -(2**63),
    -(2**63) - 1,
    2**64,
    10**12,
    10**20,
    99999999999999999999 * DAY_MS,
]
EXTREME_STRINGS = [
    "",
    "a",
    "h000",
    "h100",
    "any",
    "llm",
    "llm/a",
    "vision",
    "ops",
    "alice",
    "r1",
    "q1",
    "a" * MAX_NAME_LEN,
    "a" * (MAX_NAME_LEN + 1),
    "/".join(["a" * 63] * 4),
    "/".join(["a" * 64] * 4) + "x",
    "a" * (MAX_EVENT_ID_LEN + 1),
    "a/b",
    "a//b",
    "/a",
    "a/",
    "a\x00b",
    "a\nb",
    "a\n",
    "\x7f",
    "é",
    "a b",
    "seq:1",
]
ints = st.one_of(st.sampled_from(EXTREME_INTS), st.integers(-(2**70), 2**70))
strings = st.one_of(st.sampled_from(EXTREME_STRINGS), st.text(max_size=12))
junk = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.lists(st.integers()))


def _values_for(annotation: Any) -> st.SearchStrategy[Any]:
    """Well-typed extreme values for a field (sometimes a value of the wrong type)."""
    args = get_args(annotation)
    base = args[0] if get_origin(annotation) is not None and args else annotation
    if get_origin(annotation) is not None and type(None) in args:  # X | None
        inner = [a for a in args if a is not type(None)][0]
        return st.one_of(st.none(), _values_for(inner))
    if get_origin(annotation) is not None and msgspec.UnsetType in args:  # X | UnsetType
        inner = [a for a in args if a is not msgspec.UnsetType][0]
        return _values_for(inner)  # unset: the field is left out (input_bodies' choice)
    if base is bool:
        return st.booleans()
    if get_origin(base) is tuple:  # a bounded list of names or arguments
        return st.one_of(st.lists(strings, max_size=3), st.lists(strings, min_size=257), junk)
    if get_origin(base) is dict:  # a bounded environment
        return st.one_of(st.dictionaries(strings, strings, max_size=3), junk)
    if base is int:
        typed: st.SearchStrategy[Any] = ints
    elif base is str:
        typed = strings
    else:  # a Literal
        typed = st.one_of(st.sampled_from(list(get_args(annotation))), strings)
    return st.one_of(typed, typed, typed, junk)


@st.composite
def input_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A JSON object for a random input kind: every field present (or left out, or extra)."""
    type_ = draw(st.sampled_from(INPUT_TYPES))
    body: dict[str, Any] = {"kind": kind_of_type(type_)}
    hints = msgspec.structs.fields(type_)
    for f in hints:
        if f.name == "v" and draw(st.integers(0, 9)):
            continue  # the version is mostly left to its default
        if f.required or draw(st.booleans()):
            body[f.name] = draw(_values_for(f.type))
    if draw(st.integers(0, 19)) == 0:
        body.pop(draw(st.sampled_from(sorted(body))), None)
    return body


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(input_bodies(), min_size=1, max_size=3))
def test_extreme_inputs_never_break_a_consumer(bodies: list[dict[str, Any]]) -> None:
    state, projection = _replayed()
    batches = 1
    for body in bodies:
        data = json.dumps(body).encode()
        seq = state.input_seq + 1
        msg_id = body.get("id") if isinstance(body.get("id"), str) else None
        item = to_input_item(seq, 1_000 + seq, data, msg_id)
        why = _fold_and_decide(state, projection, item, batches)
        batches += 1
        if item.event is None:
            assert why is not None and why.startswith("malformed input")
            workload = body.get("workload")
            if body.get("kind") == "WorkloadSubmitted" and isinstance(workload, str):
                # no row as if it were valid: only the other workloads' rows
                rows = projection.con.execute(
                    "SELECT count(*) FROM workloads WHERE workload = ? AND status = 'rejected'",
                    [workload],
                ).fetchone()
                assert rows == (0,)


@st.composite
def python_events(draw: st.DrawFn) -> Any:
    """Events made in Python (as the simulator makes them), fields of the right Python type."""
    type_ = draw(st.sampled_from(INPUT_TYPES))
    fields: dict[str, Any] = {}
    for f in msgspec.structs.fields(type_):
        if f.required or draw(st.booleans()):
            value = draw(_values_for(f.type).filter(lambda v: not isinstance(v, list | float)))
            if value is None and f.name not in ("duration_ms", "attempt", "for_workload"):
                continue
            if isinstance(value, bool) != (f.name in ("resumable", "legacy_preemptible")):
                continue
            fields[f.name] = value
    if "id" not in fields or not isinstance(fields["id"], str):
        fields["id"] = "py"
    if "at_ms" not in fields or not isinstance(fields["at_ms"], int):
        fields["at_ms"] = 0
    try:
        return type_(**fields)
    except TypeError:
        return ClockTicked(id="py", at_ms=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(python_events())
def test_events_made_in_python_are_checked_like_bytes(event: Any) -> None:
    """``input_item`` (the simulator's path) refuses exactly what the decoder refuses."""
    try:
        data = msgspec.json.encode(event)
    except (TypeError, msgspec.EncodeError):
        return  # not an event at all
    try:
        decode_input(data)
        decodes = True
    except ValueError:
        decodes = False
    item = input_item(1, event)
    assert (item.event is not None) == decodes, item.rejection
    state, projection = _replayed()
    item = input_item(state.input_seq + 1, event)
    _fold_and_decide(state, projection, item, 1)


# -- the cases of the issue ----------------------------------------------------------


def _submit(**over: Any) -> bytes:
    body = {
        "kind": "WorkloadSubmitted",
        "id": "submit-x",
        "at_ms": 0,
        "workload": "x",
        "owner": "llm/a",
        "gpus": 1,
        "min_runtime_ms": 0,
        "submitted_by": "a",
        **over,
    }
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("data", "field", "bound"),
    [
        (_submit(duration_ms=99999999999999999999 * DAY_MS), "$.duration_ms", "<= 3153600000000"),
        (_submit(duration_ms=2**63), "$.duration_ms", "<= 3153600000000"),
        (_submit(priority=2**31), "$.priority", "<= 2147483647"),
        (_submit(priority=-(2**31) - 1), "$.priority", ">= -2147483648"),
        (_submit(gpus=10**12), "$.gpus", "<= 65536"),
        (_submit(gpus=2**64), "$.gpus", "<= 65536"),
        (_submit(min_runtime_ms=2**64 + 5), "$.min_runtime_ms", "<= 3153600000000"),
        (_submit(at_ms=2**63), "$.at_ms", "<= 10000000000000"),
        (_submit(workload="w" * 450_000), "$.workload", "length <= 128"),
        (_submit(id="i" * 450_000), "$.id", "length <= 512"),
        (_submit(owner="llm/" + "a" * 300), "$.owner", "length <= 256"),
        (_submit(workload="a/b"), "$.workload", "no '/'"),
        (_submit(workload="a\x00b"), "$.workload", "control characters"),
        (_submit(submitted_by="bob\n"), "$.submitted_by", "control characters"),
        (
            json.dumps(
                {
                    "kind": "NodeRegistered",
                    "id": "n9",
                    "at_ms": 0,
                    "node": "h009",
                    "gpus": 2**31,
                    "gpu_type": "h100",
                }
            ).encode(),
            "$.gpus",
            "<= 65536",
        ),
        (
            json.dumps(
                {
                    "kind": "BudgetSet",
                    "id": "b9",
                    "at_ms": 0,
                    "path": "llm/b",
                    "weight": 2**64,
                    "owner": "o",
                    "actor": "alice",
                }
            ).encode(),
            "$.weight",
            "<= 2147483647",
        ),
        (
            json.dumps(
                {"kind": "PolicySet", "id": "p9", "at_ms": 0, "preemption_margin_ppm": 10**7}
            ).encode(),
            "$.preemption_margin_ppm",
            "<= 1000000",
        ),
    ],
)
def test_a_value_out_of_bounds_is_a_malformed_input_naming_field_and_bound(
    data: bytes, field: str, bound: str
) -> None:
    state, projection = _replayed()
    seq = state.input_seq + 1
    item = to_input_item(seq, 5_000, data, "submit-x")
    assert item.event is None
    reason = item.rejection or ""
    assert reason.startswith("malformed input") and field in reason and bound in reason, reason
    assert len(reason) <= MAX_REASON_LEN
    workloads_before = projection.con.execute("SELECT count(*) FROM workloads").fetchone()
    _fold_and_decide(state, projection, item, 1)
    # no events row and no workloads row: its InputRejected is its only trace
    assert projection.con.execute("SELECT count(*) FROM workloads").fetchone() == workloads_before
    assert projection.con.execute("SELECT count(*) FROM malformed_inputs").fetchone() == (1,)


def test_a_huge_message_id_becomes_a_sequence_reference() -> None:
    state, projection = _replayed()
    seq = state.input_seq + 1
    item = to_input_item(seq, 5_000, _submit(id="i" * 450_000), "i" * 450_000)
    assert item.ref == f"seq:{seq}"
    _fold_and_decide(state, projection, item, 1)


def test_a_refused_submission_within_bounds_keeps_a_rejected_row() -> None:
    """Refused by the fold (a gang no node can hold), not malformed: its row holds
    values every column can take, with status ``rejected``."""
    state, projection = _replayed()
    seq = state.input_seq + 1
    item = to_input_item(seq, 5_000, _submit(workload="big", gpus=MAX_GPUS), "submit-big")
    assert item.event is not None
    why = _fold_and_decide(state, projection, item, 1)
    assert why is not None and "not a valid gang" in why
    row = projection.con.execute(
        "SELECT gpus, status FROM workloads WHERE workload = 'big'"
    ).fetchone()
    assert row == (MAX_GPUS, "rejected")


def test_a_python_event_beyond_64_bits_is_named_too() -> None:
    event = WorkloadSubmitted(
        id="sub/x", at_ms=0, workload="x", owner="llm/a", gpus=1, min_runtime_ms=0, priority=2**70
    )
    assert "$.priority" in (bounds_error(event) or "")
    item = input_item(3, event)
    assert item.event is None and item.ref == "sub/x" and "$.priority" in (item.rejection or "")


def test_the_largest_values_within_bounds_fit_every_consumer() -> None:
    """The largest gang, charged from the start of time to the largest time."""
    state, projection = _replayed()
    events = [
        NodeRegistered(
            id="n-big", at_ms=0, node="n" * 128, gpus=MAX_GPUS, gpu_type="t", actor="ops"
        ),
        NodeRegistered(
            id="n-big2", at_ms=0, node="m" * 128, gpus=MAX_GPUS, gpu_type="t", actor="ops"
        ),
        BudgetSet(id="b-big", at_ms=0, path="big", weight=2**31 - 1, owner="s" * 128, actor="ops"),
        PolicySet(
            id="p-big",
            at_ms=0,
            actor="ops",
            lookback_ms=90 * DAY_MS,
            max_min_runtime_ms=90 * DAY_MS,
        ),
        WorkloadSubmitted(
            id="s-big",
            at_ms=0,
            workload="w" * 128,
            owner="big",
            gpus=MAX_GPUS,
            min_runtime_ms=90 * DAY_MS,
            priority=2**31 - 1,
            duration_ms=MAX_DURATION_MS,
            gpu_type="t",
            submitted_by="s" * 128,
        ),
        ClockTicked(id="t-late", at_ms=MAX_TIME_MS),
    ]
    for n, event in enumerate(events):
        item = input_item(state.input_seq + 1, event)
        assert item.event is not None, item.rejection
        assert _fold_and_decide(state, projection, item, n + 1) is None
    big = state.running["w" * 128]
    assert big.protected_until_ms < big.started_ms + 90 * DAY_MS + 1
    assert state.usage("big") == MAX_GPUS * 90 * DAY_MS  # the window: exact, in range
    assert state.budget.nodes["big"].series.cumulative(MAX_TIME_MS) < 2**63


def test_reasons_are_cut_to_their_bound_and_made_printable() -> None:
    assert clip_reason("fine") == "fine"
    long = clip_reason("x" * 5000)
    assert len(long) == MAX_REASON_LEN and long.endswith("...")
    assert clip_reason("a\nb\x00c") == "a b c"


def test_the_json_schemas_carry_the_bounds() -> None:
    """Publishers in other languages see the same bounds (and the patterns are ECMAScript too)."""
    submitted = json_schemas()["WorkloadSubmitted"]
    props = submitted["$defs"]["WorkloadSubmitted"]["properties"]
    assert props["gpus"]["maximum"] == MAX_GPUS and props["gpus"]["minimum"] == 0
    assert props["priority"]["maximum"] == 2**31 - 1
    assert props["workload"]["maxLength"] == MAX_NAME_LEN
    assert props["owner"]["maxLength"] == MAX_PATH_LEN
    assert "\\Z" not in props["workload"]["pattern"]
