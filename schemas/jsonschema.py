"""JSON Schema documents for publishers written in other languages.

:func:`json_schemas` returns one self-contained schema per event kind (plus the
input and decision unions and the decision batch). ``apportion schema export
DIR`` writes them to files; this module does no I/O.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .events import ALL_TYPES, Decision, DecisionBatch, Input, kind_of, kind_of_type


def json_schemas() -> dict[str, dict[str, Any]]:
    """``{name: schema}`` for every event kind, ``Input``, ``Decision`` and ``DecisionBatch``."""
    out: dict[str, dict[str, Any]] = {}
    for type_ in ALL_TYPES:
        out[kind_of_type(type_)] = msgspec.json.schema(type_)
    out["Input"] = msgspec.json.schema(Input)
    out["Decision"] = msgspec.json.schema(Decision)
    out["DecisionBatch"] = msgspec.json.schema(DecisionBatch)
    # as JSON holds them (a tuple default such as ``command: ()`` becomes ``[]``)
    return msgspec.json.decode(msgspec.json.encode(out), type=dict[str, dict[str, Any]])


__all__ = ["json_schemas", "kind_of", "kind_of_type"]
