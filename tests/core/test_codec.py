"""Codecs: every event round-trips under JSON and msgpack; every bad input raises
:class:`EventDecodeError` with a message that says what to fix."""

from __future__ import annotations

import json

import msgspec
import pytest
from apportion.schemas import (
    EventDecodeError,
    decode_batch,
    decode_decision,
    decode_event,
    decode_input,
    encode,
)
from apportion.schemas.events import (
    ALL_TYPES,
    DECISION_TYPES,
    INPUT_TYPES,
    ClockTicked,
    DecisionBatch,
    NodeDrained,
    WorkloadSubmitted,
    kind_of,
)
from apportion.schemas.jsonschema import json_schemas
from click.testing import CliRunner
from core_builders import sample_events

from apportion.cli import main

FORMATS = ["json", "msgpack"]
SAMPLES = sample_events()


def test_samples_cover_every_kind() -> None:
    assert sorted(kind_of(e) for e in SAMPLES) == sorted(t.__struct_config__.tag for t in ALL_TYPES)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("event", SAMPLES, ids=kind_of)
def test_event_round_trips(event, fmt) -> None:
    data = encode(event, fmt)
    assert decode_event(data, fmt) == event
    if type(event) in INPUT_TYPES:
        assert decode_input(data, fmt) == event
    else:
        assert decode_decision(data, fmt) == event


@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_round_trips(fmt) -> None:
    decisions = tuple(e for e in SAMPLES if type(e) in DECISION_TYPES)
    batch = DecisionBatch(basis=42, decisions=decisions, next_wakeup_ms=99)
    assert decode_batch(encode(batch, fmt), fmt) == batch


@pytest.mark.parametrize("fmt", FORMATS)
def test_defaults_fill_in(fmt) -> None:
    """A publisher may leave out every field that has a default (``v`` included)."""
    raw = {
        "kind": "WorkloadSubmitted",
        "id": "s",
        "at_ms": 5,
        "workload": "w",
        "owner": "a/x",
        "gpus": 2,
        "min_runtime_ms": 0,
    }
    data = json.dumps(raw).encode() if fmt == "json" else msgspec.msgpack.encode(raw)
    event = decode_input(data, fmt)
    assert event == WorkloadSubmitted(
        id="s", at_ms=5, workload="w", owner="a/x", gpus=2, min_runtime_ms=0
    )
    assert (event.v, event.gpu_type, event.resumable, event.priority) == (1, "any", True, 0)


def _raw(fmt: str, obj: object) -> bytes:
    return json.dumps(obj).encode() if fmt == "json" else msgspec.msgpack.encode(obj)


TICK = {"kind": "ClockTicked", "id": "t1", "at_ms": 5}

BAD_INPUTS = [
    # (id, decoder, payload builder, words the message must contain)
    ("garbage-bytes", decode_input, lambda fmt: b"\xc1\xff{not", ["malformed"]),
    ("empty-bytes", decode_input, lambda fmt: b"", ["malformed"]),
    (
        "unknown-kind",
        decode_input,
        lambda fmt: _raw(fmt, {**TICK, "kind": "WorkloadExploded"}),
        ["WorkloadExploded"],
    ),
    (
        "decision-as-input",
        decode_input,
        lambda fmt: encode(NodeDrained(id="d", at_ms=1, node="n"), fmt),
        ["NodeDrained"],
    ),
    (
        "input-as-decision",
        decode_decision,
        lambda fmt: encode(ClockTicked(id="c", at_ms=1), fmt),
        ["ClockTicked"],
    ),
    ("missing-kind", decode_input, lambda fmt: _raw(fmt, {"id": "t1", "at_ms": 5}), ["kind"]),
    (
        "missing-field",
        decode_input,
        lambda fmt: _raw(
            fmt, {"kind": "NodeRegistered", "id": "n", "at_ms": 1, "node": "n1", "gpu_type": "a100"}
        ),
        ["gpus"],
    ),
    (
        "wrong-type",
        decode_input,
        lambda fmt: _raw(
            fmt,
            {
                "kind": "NodeRegistered",
                "id": "n",
                "at_ms": 1,
                "node": "n1",
                "gpus": "eight",
                "gpu_type": "a100",
            },
        ),
        ["gpus", "int"],
    ),
    ("float-time", decode_input, lambda fmt: _raw(fmt, {**TICK, "at_ms": 1.5}), ["at_ms", "int"]),
    (
        "bad-literal",
        decode_input,
        lambda fmt: _raw(
            fmt,
            {"kind": "NodeHealthChanged", "id": "h", "at_ms": 1, "node": "n1", "state": "sleepy"},
        ),
        ["state"],
    ),
    ("not-an-object", decode_input, lambda fmt: _raw(fmt, [1, 2, 3]), ["object"]),
    ("future-version", decode_input, lambda fmt: _raw(fmt, {**TICK, "v": 2}), ["v=2", "upgrade"]),
    ("version-zero-any", decode_event, lambda fmt: _raw(fmt, {**TICK, "v": 0}), ["v=0"]),
    (
        "batch-future-version",
        decode_batch,
        lambda fmt: _raw(fmt, {"basis": 3, "decisions": [], "v": 7}),
        ["v=7", "input 3"],
    ),
    (
        "batch-decision-version",
        decode_batch,
        lambda fmt: _raw(
            fmt,
            {
                "basis": 3,
                "decisions": [{"kind": "NodeDrained", "id": "d", "at_ms": 1, "node": "n", "v": 9}],
            },
        ),
        ["v=9", "'d'"],
    ),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("decoder", "payload", "words"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_raises_event_decode_error(decoder, payload, words, fmt) -> None:
    with pytest.raises(EventDecodeError) as info:
        decoder(payload(fmt), fmt)
    message = str(info.value)
    for word in words:
        assert word in message, message
    assert isinstance(info.value, ValueError)


def test_json_schemas_one_per_kind() -> None:
    schemas = json_schemas()
    kinds = [t.__struct_config__.tag for t in ALL_TYPES]
    assert sorted(schemas) == sorted([*kinds, "Input", "Decision", "DecisionBatch"])
    for kind in kinds:
        doc = schemas[kind]
        body = doc["$defs"][kind] if "$defs" in doc else doc
        assert body["properties"]["kind"] == {"enum": [kind]}, kind
        assert {"id", "at_ms"} <= set(body["required"]), kind
    json.dumps(schemas)  # plain JSON all the way down


def test_schema_export_writes_files(tmp_path) -> None:
    out = tmp_path / "schemas"
    result = CliRunner().invoke(main, ["schema", "export", str(out)])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(f"{k}.schema.json" for k in json_schemas())
    doc = json.loads((out / "WorkloadSubmitted.schema.json").read_text())
    assert doc == json_schemas()["WorkloadSubmitted"]
    assert f"wrote {len(names)} schemas" in result.output


def test_schema_export_unwritable_is_one_line_error(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = CliRunner().invoke(main, ["schema", "export", str(blocker / "sub")])
    assert result.exit_code == 2
    assert "apportion: cannot write schemas" in result.output
