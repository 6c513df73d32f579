"""JSON and msgpack codecs for events and decision batches.

Each decoder is built once, at import. Every failure to decode (bad bytes, an
unknown ``kind``, a missing or mistyped field, a value out of its bounds
(:mod:`apportion.schemas.bounds`), an unsupported ``v``) raises
:class:`EventDecodeError` whose message says what to fix.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import msgspec

from .bounds import plain_bound
from .checks import FAST_INPUT_DECODERS, from_fast, valid_input
from .events import (
    SCHEMA_VERSION,
    SUPPORTED_VERSIONS,
    AnyEvent,
    Decision,
    DecisionBatch,
    Event,
    Input,
)

Format = Literal["json", "msgpack"]


class EventDecodeError(ValueError):
    """Bytes that are not a valid event of a supported version."""


_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def _decoders(type_: Any) -> dict[Format, Any]:
    """A decoder of ``type_`` for each format: one dict per type, keyed by format
    alone (a key holding the type would be hashed per event, and a union of
    event types hashes slower than a small event decodes)."""
    return {"json": msgspec.json.Decoder(type_), "msgpack": msgspec.msgpack.Decoder(type_)}


_INPUT_DECODERS = _decoders(Input)
_DECISION_DECODERS = _decoders(Decision)
_EVENT_DECODERS = _decoders(AnyEvent)
_BATCH_DECODERS = _decoders(DecisionBatch)


def encode(obj: Event | DecisionBatch | msgspec.Struct, fmt: Format = "json") -> bytes:
    """Encode an event (or batch) as JSON or msgpack bytes."""
    if fmt == "json":
        return _json_encoder.encode(obj)
    return _msgpack_encoder.encode(obj)


def _unsupported_version(v: int, what: str) -> EventDecodeError:
    """The error for a ``v`` not in :data:`SUPPORTED_VERSIONS` (callers check
    ``v`` first, so that ``what`` is only formatted for an error)."""
    return EventDecodeError(
        f"{what} has schema version v={v}; this apportion reads "
        f"v in {sorted(SUPPORTED_VERSIONS)} (upgrade apportion or publish v={SCHEMA_VERSION})"
    )


def _decode(data: bytes | str, decoders: dict[Format, Any], fmt: Format, what: str) -> Any:
    """``data`` decoded by ``decoders[fmt]`` (callers cast to the decoded type; a
    union has no ``type[T]``)."""
    try:
        return decoders[fmt].decode(data)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"invalid {what}: {plain_bound(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"malformed {fmt} for {what}: {exc}") from None


def bounds_error(event: Input) -> str | None:
    """Why ``event``, made in Python rather than decoded, is not a valid input (a
    field out of its bounds, an unsupported ``v``), or ``None``.

    The same verdict as decoding: an event within its bounds is told so by
    :func:`~apportion.schemas.checks.valid_input` (no encoding); any other goes
    through the msgpack codec, whose error is the message."""
    if valid_input(event):
        return None
    return codec_bounds_error(event)


def codec_bounds_error(event: Input) -> str | None:
    """:func:`bounds_error` by the codec alone: ``event`` encoded as msgpack and
    decoded with every bound (the reference the plain checks agree with, and the
    source of every message)."""
    try:
        decode_input_with_patterns(_msgpack_encoder.encode(event), "msgpack")
    except OverflowError:
        try:  # an integer beyond 64 bits: JSON holds it, so the decoder can name the field
            decode_input_with_patterns(_json_encoder.encode(event))
        except EventDecodeError as exc:
            return str(exc)
        return "invalid input event: an integer is out of range"
    except (UnicodeEncodeError, msgspec.EncodeError, TypeError) as exc:
        return f"invalid input event: cannot be encoded ({exc})"
    except EventDecodeError as exc:
        return str(exc)
    return None


def decode_input(data: bytes | str, fmt: Format = "json") -> Input:
    """Decode one input event; raise :class:`EventDecodeError` if it is not one.

    Decoded first without the string patterns, which are then checked by plain
    tests (:mod:`apportion.schemas.checks`); anything that fails there is decoded
    again with every bound, whose error is the message."""
    try:
        fast = from_fast(FAST_INPUT_DECODERS[fmt].decode(data))
    except msgspec.DecodeError:  # ValidationError included
        fast = None
    if fast is not None:
        return cast(Input, fast)
    return decode_input_with_patterns(data, fmt)


def decode_input_with_patterns(data: bytes | str, fmt: Format = "json") -> Input:
    """:func:`decode_input` by the decoder that holds every bound, the patterns as
    regular expressions: the reference, and the source of every message."""
    event = cast(Input, _decode(data, _INPUT_DECODERS, fmt, "input event"))
    if event.v not in SUPPORTED_VERSIONS:
        raise _unsupported_version(event.v, f"input {event.id!r}")
    return event


def decode_decision(data: bytes | str, fmt: Format = "json") -> Decision:
    event = cast(Decision, _decode(data, _DECISION_DECODERS, fmt, "decision event"))
    if event.v not in SUPPORTED_VERSIONS:
        raise _unsupported_version(event.v, f"decision {event.id!r}")
    return event


def decode_event(data: bytes | str, fmt: Format = "json") -> AnyEvent:
    """Decode any event, input or decision."""
    event = cast(AnyEvent, _decode(data, _EVENT_DECODERS, fmt, "event"))
    if event.v not in SUPPORTED_VERSIONS:
        raise _unsupported_version(event.v, f"event {event.id!r}")
    return event


def decode_batch(data: bytes | str, fmt: Format = "json") -> DecisionBatch:
    batch = cast(DecisionBatch, _decode(data, _BATCH_DECODERS, fmt, "decision batch"))
    if batch.v not in SUPPORTED_VERSIONS:
        raise _unsupported_version(batch.v, f"decision batch based on input {batch.basis}")
    for decision in batch.decisions:
        if decision.v not in SUPPORTED_VERSIONS:
            raise _unsupported_version(decision.v, f"decision {decision.id!r}")
    return batch
