"""Event and envelope Structs, codecs and JSON Schema export (imports msgspec only)."""

from .codec import (
    EventDecodeError,
    decode_batch,
    decode_decision,
    decode_event,
    decode_input,
    encode,
)
from .events import *  # noqa: F403
from .events import __doc__ as _events_doc  # noqa: F401

__all__ = [
    "EventDecodeError",
    "decode_batch",
    "decode_decision",
    "decode_event",
    "decode_input",
    "encode",
]
