"""The bounds checked once, in plain Python (``schemas/checks.py``), against the
reference they replace: the regular expressions of ``schemas/bounds.py`` and the
codec's round trip (encode, then decode with every bound).

Over generated strings (the edge cases among them: empty, NUL, newlines,
non-ASCII, lone surrogates, digits of other scripts, each bound's maximum length
and one more), every plain test accepts exactly what its expression accepts;
over generated inputs, as bytes and as events made in Python, the fast decoder
and the plain check give the same verdict, the same event and the same message
as the reference.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest
from apportion.schemas.bounds import (
    ENV_NAME_PATTERN,
    EVENT_ID_PATTERN,
    IMAGE_PATTERN,
    MAX_EVENT_ID_LEN,
    MAX_NAME_LEN,
    MAX_PATH_LEN,
    NAME_CHARS,
    NAME_PATTERN,
    PATH_PATTERN,
    REASON_CODE_PATTERN,
)
from apportion.schemas.checks import (
    _CHECKS,
    FAST_INPUT_DECODERS,
    NAME_SET,
    PLAIN_TESTS,
    valid_input,
)
from apportion.schemas.codec import (
    EventDecodeError,
    bounds_error,
    codec_bounds_error,
    decode_input,
    decode_input_with_patterns,
)
from apportion.schemas.events import INPUT_TYPES, WorkloadSubmitted
from core_builders import sample_events
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_bounds import input_bodies, python_events

EDGE_CHARS = NAME_SET + "/ \t\n\r\x00\x7f\x0b\x0c" + "é٣ª²ⅷ\u200b\u3000\U0001f600\ud800\udfff"
"""The safe set, '/', blanks and control characters (NUL, a final newline), and
characters that are letters or digits outside ASCII (which ``isalnum`` and
``isdigit`` accept), a zero-width space, an emoji, lone surrogates."""

EDGE_STRINGS = [
    "",
    "\n",
    "a\n",
    "\na",
    "a\x00",
    "/",
    "//",
    "a/",
    "/a",
    "a//b",
    "a/b",
    "_",
    "0a",
    "a0",
    "A" * 128,
    "A" * 129,
    "a" * MAX_NAME_LEN,
    "a" * (MAX_NAME_LEN + 1),
    "/".join(["a" * 63] * 4),
    "a" * MAX_EVENT_ID_LEN,
    "é",
    "٣",
    "\ud800",
]

strings = st.one_of(
    st.sampled_from(EDGE_STRINGS),
    st.text(alphabet=st.sampled_from(EDGE_CHARS), max_size=20),
    st.text(alphabet=st.sampled_from(NAME_SET + "/"), min_size=120, max_size=MAX_PATH_LEN + 2),
    st.text(max_size=8),
    st.text(alphabet=st.characters(codec=None), max_size=8),
)

PATTERNS = [
    NAME_PATTERN,
    PATH_PATTERN,
    EVENT_ID_PATTERN,
    ENV_NAME_PATTERN,
    IMAGE_PATTERN,
    REASON_CODE_PATTERN,
]


def test_every_pattern_of_the_bounds_has_a_plain_test() -> None:
    assert sorted(PLAIN_TESTS) == sorted(PATTERNS)


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=600, deadline=None)
@given(s=strings)
def test_a_plain_test_accepts_what_its_expression_accepts(pattern: str, s: str) -> None:
    """``msgspec`` checks a pattern with ``re.search``: the plain test agrees."""
    for edge in EDGE_STRINGS:
        assert PLAIN_TESTS[pattern](edge) == bool(re.search(pattern, edge)), (pattern, edge)
    assert PLAIN_TESTS[pattern](s) == bool(re.search(pattern, s)), (pattern, s)


def test_the_listed_set_is_the_expression_class_for_every_character() -> None:
    cls = re.compile(f"[{NAME_CHARS}]")
    listed = set(NAME_SET)
    for code in range(0x110000):
        ch = chr(code)
        assert (cls.fullmatch(ch) is not None) == (ch in listed), hex(code)


def test_every_input_type_is_answered_by_the_plain_checks() -> None:
    """No field of an input is left to the codec by a type the checks do not know."""
    for cls in INPUT_TYPES:
        for name, source in _CHECKS[cls].source_full:
            assert source != "False", (cls.__name__, name)
    for event in sample_events():
        if type(event) in INPUT_TYPES:
            assert valid_input(event), event


def _reference(data: bytes, fmt: Any) -> Any:
    try:
        return decode_input_with_patterns(data, fmt)
    except EventDecodeError as exc:
        return str(exc)


def _decoded(data: bytes, fmt: Any) -> Any:
    try:
        return decode_input(data, fmt)
    except EventDecodeError as exc:
        return str(exc)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=input_bodies())
def test_bytes_decode_to_the_same_event_or_the_same_message(body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    got, want = _decoded(data, "json"), _reference(data, "json")
    assert got == want and type(got) is type(want)
    try:
        packed = msgspec.msgpack.encode(body)
    except OverflowError:
        return
    got, want = _decoded(packed, "msgpack"), _reference(packed, "msgpack")
    assert got == want and type(got) is type(want)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=strings, field=st.sampled_from(["id", "workload", "owner", "gpu_type", "image"]))
@example(s="a\n", field="workload")
@example(s="", field="id")
def test_a_string_field_decodes_like_the_reference(s: str, field: str) -> None:
    body = {
        "kind": "WorkloadSubmitted",
        "id": "s1",
        "at_ms": 0,
        "workload": "w",
        "owner": "a/b",
        "gpus": 1,
        "min_runtime_ms": 0,
    }
    body[field] = s
    try:
        data = json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        data = json.dumps(body).encode()  # a lone surrogate: escaped, as a publisher may send it
    assert _decoded(data, "json") == _reference(data, "json")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(event=python_events())
def test_events_made_in_python_get_the_codecs_verdict_and_message(event: Any) -> None:
    assert bounds_error(event) == codec_bounds_error(event)
    if valid_input(event):
        assert codec_bounds_error(event) is None


@settings(max_examples=300, deadline=None)
@given(s=strings, field=st.sampled_from(["id", "workload", "owner", "submitted_by", "image"]))
def test_a_python_string_field_gets_the_codecs_message(s: str, field: str) -> None:
    event = msgspec.structs.replace(
        WorkloadSubmitted(id="p1", at_ms=0, workload="w", owner="a/b", gpus=1, min_runtime_ms=0),
        **{field: s},
    )
    assert bounds_error(event) == codec_bounds_error(event)


def test_values_of_other_types_are_left_to_the_codec() -> None:
    """An ``int`` subclass, a list for a tuple: not answered by the plain check; the
    codec's verdict stands (accepted here, as it encodes as the plain value)."""
    import enum

    class Gpus(enum.IntEnum):
        EIGHT = 8

    base = WorkloadSubmitted(id="p1", at_ms=0, workload="w", owner="a/b", gpus=1, min_runtime_ms=0)
    for changes in ({"gpus": Gpus.EIGHT}, {"command": ["a", "b"]}, {"gpus": True}, {"gpus": 8.0}):
        event = msgspec.structs.replace(base, **changes)
        assert not valid_input(event)
        assert bounds_error(event) == codec_bounds_error(event)


def test_the_fast_decoder_holds_every_bound_but_the_patterns() -> None:
    data = json.dumps(
        {
            "kind": "WorkloadSubmitted",
            "id": "s",
            "at_ms": 0,
            "workload": "w",
            "owner": "a",
            "gpus": 65_537,
            "min_runtime_ms": 0,
        }
    ).encode()
    with pytest.raises(msgspec.ValidationError, match="<= 65536"):
        FAST_INPUT_DECODERS["json"].decode(data)
    assert "<= 65536 - at `$.gpus`" in _decoded(data, "json")
