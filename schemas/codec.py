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

_DECODERS: dict[tuple[Format, Any], Any] = {}
for _type in (Input, Decision, AnyEvent, DecisionBatch):
    _DECODERS[("json", _type)] = msgspec.json.Decoder(_type)
    _DECODERS[("msgpack", _type)] = msgspec.msgpack.Decoder(_type)


def encode(obj: Event | DecisionBatch | msgspec.Struct, fmt: Format = "json") -> bytes:
    """Encode an event (or batch) as JSON or msgpack bytes."""
    if fmt == "json":
        return _json_encoder.encode(obj)
    return _msgpack_encoder.encode(obj)


def _check_version(v: int, what: str) -> None:
    if v not in SUPPORTED_VERSIONS:
        raise EventDecodeError(
            f"{what} has schema version v={v}; this apportion reads "
            f"v in {sorted(SUPPORTED_VERSIONS)} (upgrade apportion or publish v={SCHEMA_VERSION})"
        )


def _decode(data: bytes | str, type_: Any, fmt: Format, what: str) -> Any:
    """``type_`` decoded from ``data`` (callers cast to ``type_``; a union has no ``type[T]``)."""
    try:
        return _DECODERS[(fmt, type_)].decode(data)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"invalid {what}: {plain_bound(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"malformed {fmt} for {what}: {exc}") from None


def bounds_error(event: Input) -> str | None:
    """Why ``event``, made in Python rather than decoded, is not a valid input (a
    field out of its bounds, an unsupported ``v``), or ``None``.

    The same check as decoding: the event goes through the msgpack codec."""
    try:
        decode_input(_msgpack_encoder.encode(event), "msgpack")
    except OverflowError:
        try:  # an integer beyond 64 bits: JSON holds it, so the decoder can name the field
            decode_input(_json_encoder.encode(event))
        except EventDecodeError as exc:
            return str(exc)
        return "invalid input event: an integer is out of range"
    except (UnicodeEncodeError, msgspec.EncodeError, TypeError) as exc:
        return f"invalid input event: cannot be encoded ({exc})"
    except EventDecodeError as exc:
        return str(exc)
    return None


def decode_input(data: bytes | str, fmt: Format = "json") -> Input:
    """Decode one input event; raise :class:`EventDecodeError` if it is not one."""
    event = cast(Input, _decode(data, Input, fmt, "input event"))
    _check_version(event.v, f"input {event.id!r}")
    return event


def decode_decision(data: bytes | str, fmt: Format = "json") -> Decision:
    event = cast(Decision, _decode(data, Decision, fmt, "decision event"))
    _check_version(event.v, f"decision {event.id!r}")
    return event


def decode_event(data: bytes | str, fmt: Format = "json") -> AnyEvent:
    """Decode any event, input or decision."""
    event = cast(AnyEvent, _decode(data, AnyEvent, fmt, "event"))
    _check_version(event.v, f"event {event.id!r}")
    return event


def decode_batch(data: bytes | str, fmt: Format = "json") -> DecisionBatch:
    batch = cast(DecisionBatch, _decode(data, DecisionBatch, fmt, "decision batch"))
    _check_version(batch.v, f"decision batch based on input {batch.basis}")
    for decision in batch.decisions:
        _check_version(decision.v, f"decision {decision.id!r}")
    return batch
