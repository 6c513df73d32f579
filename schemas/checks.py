"""The bounds of :mod:`apportion.schemas.bounds`, checked once, in plain Python.

Two uses, one set of checks compiled from the input Structs' own annotations at
import (so a field added to an event is checked with no change here):

- :func:`valid_input`: is an input made in Python (the simulator, the command
  layer) within every bound of its schema? The answer a round trip through the
  codec gives (encode, then decode with the bounds), without encoding.
- :data:`FAST_INPUT_DECODERS` and :func:`from_fast`: decoders of the same
  Structs with every bound but the string patterns (the regular expressions
  cost most of a decode), and the patterns as plain tests (:data:`PLAIN_TESTS`:
  character sets and ``str.strip``, equal to the expressions for every string;
  ``tests/core/test_plain_bounds.py`` proves it on generated strings).

Both are *conservative*: they answer "within bounds" only when the codec would,
and otherwise send the caller to the codec itself (:mod:`apportion.schemas.codec`),
which gives the verdict and the error message. So a rejection reads exactly as
before, and only valid inputs take the fast path. A value of a type they do not
know (an ``int`` subclass, a list for a tuple, text outside ASCII in free text)
is simply not answered here.
"""

from __future__ import annotations

import functools
import operator
import string
import types
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union, cast, get_args, get_origin

import msgspec
from msgspec import Meta

from .bounds import (
    ENV_NAME_PATTERN,
    EVENT_ID_PATTERN,
    IMAGE_PATTERN,
    NAME_PATTERN,
    PATH_PATTERN,
    REASON_CODE_PATTERN,
)
from .events import INPUT_TYPES, SUPPORTED_VERSIONS, Event

Check = Callable[[Any], bool]

# -- the patterns as plain tests ------------------------------------------------

NAME_SET = string.ascii_letters + string.digits + "_.:@+-"
"""The characters of :data:`~apportion.schemas.bounds.NAME_CHARS`, listed."""
PATH_SET = NAME_SET + "/"
IMAGE_SET = string.ascii_letters + string.digits + "_.:@/-"
ENV_SET = string.ascii_letters + string.digits + "_"
CODE_SET = string.ascii_lowercase + string.digits + "_"

_NS: dict[str, Any] = {
    "NAME_SET": NAME_SET,
    "PATH_SET": PATH_SET,
    "IMAGE_SET": IMAGE_SET,
    "ENV_SET": ENV_SET,
    "CODE_SET": CODE_SET,
    "DIGITS": string.digits,
    "LOWER": string.ascii_lowercase,
    "UNSET": msgspec.UNSET,
}
"""The names the generated checks use."""

PLAIN_TEMPLATES: dict[str, str] = {
    # only characters of the set (``str.strip`` leaves the first one outside it);
    # ASCII letters and digits alone (the common case) are told at once
    NAME_PATTERN: "(({v}.isalnum() and {v}.isascii()) or not {v}.strip(NAME_SET))",
    # "" or non-empty names joined by "/"
    PATH_PATTERN: (
        "(not {v} or ((({v}.isascii() and {v}.replace('/', '').isalnum())"
        ' or not {v}.strip(PATH_SET)) and {v}[0] != "/" and {v}[-1] != "/" and "//" not in {v}))'
    ),
    # one or more of the set and "/"
    EVENT_ID_PATTERN: '(({v}.isalnum() and {v}.isascii()) or ({v} != "" and not {v}.strip(PATH_SET)))',
    # a letter or "_", then up to 127 letters, digits and "_"
    ENV_NAME_PATTERN: "(0 < len({v}) <= 128 and not {v}.strip(ENV_SET) and {v}[0] not in DIGITS)",
    IMAGE_PATTERN: "not {v}.strip(IMAGE_SET)",
    # a lower-case letter, then lower-case letters, digits and "_"
    REASON_CODE_PATTERN: '({v} != "" and not {v}.strip(CODE_SET) and {v}[0] in LOWER)',
}
"""Each bound's regular expression and a plain test (a Python expression of the
string ``{v}``) that accepts the same strings."""

PLAIN_TESTS: dict[str, Callable[[str], bool]] = {
    pattern: eval(f"lambda v: bool({template.format(v='v')})", dict(_NS))
    for pattern, template in PLAIN_TEMPLATES.items()
}
"""Each bound's regular expression and its plain test as a function."""

# -- compiling a type into checks ------------------------------------------------

_INT64 = (-(2**63), 2**63 - 1)
_META_KEYS = ("gt", "ge", "lt", "le", "multiple_of", "min_length", "max_length", "tz")
_NEVER = "False"
_OPS = (("ge", ">="), ("le", "<="), ("gt", ">"), ("lt", "<"))


class _Compiled:
    """A type compiled for the value ``v`` (a Python expression): ``full`` checks a
    value made in Python (its exact type and every bound), ``patterns`` only the
    patterns of a value a decoder without them produced (``None``: there are
    none), ``fast`` is that type for such a decoder."""

    def __init__(self, full: str, patterns: str | None, fast: Any) -> None:
        self.full, self.patterns, self.fast = full, patterns, fast


def _unknown(tp: Any) -> _Compiled:
    """A type not answered here: never "within bounds", so the codec decides."""
    return _Compiled(_NEVER, _NEVER, tp)


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "(" + " and ".join(parts) + ")"


def _compile(tp: Any, v: str, depth: int = 0) -> _Compiled:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extras = get_args(tp)
        inner = _compile(base, v, depth)
        metas = [m for m in extras if isinstance(m, Meta)]
        if len(metas) != len(extras) or any(m.multiple_of is not None or m.tz for m in metas):
            return _unknown(tp)
        full = [inner.full]
        if base is int and any(
            m.ge is not None and m.le is not None and _INT64[0] <= m.ge <= m.le <= _INT64[1]
            for m in metas
        ):
            full = [f"type({v}) is int"]  # the bounds are narrower than 64 bits
        patterns = [] if inner.patterns is None else [inner.patterns]
        fast_metas = []
        for m in metas:
            full += [f"{v} {op} {getattr(m, k)!r}" for k, op in _OPS if getattr(m, k) is not None]
            if m.min_length is not None:
                full.append(f"len({v}) >= {m.min_length}")
            if m.max_length is not None:
                full.append(f"len({v}) <= {m.max_length}")
            if m.pattern is not None:
                template = PLAIN_TEMPLATES.get(m.pattern)
                if template is None:  # a pattern with no plain test
                    return _unknown(tp)
                full.append(template.format(v=v))
                patterns.append(template.format(v=v))
            kept = {k: getattr(m, k) for k in _META_KEYS if getattr(m, k) is not None}
            if kept:
                fast_metas.append(Meta(**kept))
        fast = Annotated[(inner.fast, *fast_metas)] if fast_metas else inner.fast
        return _Compiled(_and(full), _and(patterns) if patterns else None, fast)
    if tp is str:  # text outside ASCII (its length, lone surrogates): the codec decides
        return _Compiled(f"(type({v}) is str and {v}.isascii())", None, str)
    if tp is int:
        return _Compiled(f"(type({v}) is int and {_INT64[0]} <= {v} <= {_INT64[1]})", None, int)
    if tp is bool:
        return _Compiled(f"({v} is True or {v} is False)", None, bool)
    if tp is type(None):
        return _Compiled(f"{v} is None", None, tp)
    if tp is msgspec.UnsetType:
        return _Compiled(f"{v} is UNSET", None, tp)
    if origin is Literal:
        values = get_args(tp)
        if not all(type(x) is str for x in values):
            return _unknown(tp)
        return _Compiled(f"(type({v}) is str and {v} in {tuple(values)!r})", None, tp)
    if origin is Union or origin is types.UnionType:
        members = [_compile(m, v, depth) for m in get_args(tp)]
        either = "(" + " or ".join(m.full for m in members) + ")"
        has_patterns = any(m.patterns is not None for m in members)
        fast = functools.reduce(operator.or_, [m.fast for m in members])
        return _Compiled(either, either if has_patterns else None, fast)
    if origin is tuple:
        args = get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            return _unknown(tp)
        x = f"x{depth}"
        item = _compile(args[0], x, depth + 1)
        return _Compiled(
            f"(type({v}) is tuple and (not {v} or all({item.full} for {x} in {v})))",
            None if item.patterns is None else f"(not {v} or all({item.patterns} for {x} in {v}))",
            tuple[item.fast, ...],  # type: ignore[name-defined]
        )
    if origin is dict:
        k, x = f"k{depth}", f"x{depth}"
        key_tp, value_tp = get_args(tp)
        key, value = _compile(key_tp, k, depth + 1), _compile(value_tp, x, depth + 1)
        pattern = None
        if key.patterns is not None or value.patterns is not None:
            both = [p for p in (key.patterns, value.patterns) if p is not None]
            pattern = f"(not {v} or all({_and(both)} for {k}, {x} in {v}.items()))"
        return _Compiled(
            f"(type({v}) is dict and (not {v} or all({key.full} and {value.full}"
            f" for {k}, {x} in {v}.items())))",
            pattern,
            dict[key.fast, value.fast],  # type: ignore[name-defined]
        )
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        # a Struct inside an input (a usage summary's charges): checked field by
        # field here; the fast decoders keep the Struct itself, with all its bounds
        _NS.setdefault(tp.__name__, tp)
        if _NS[tp.__name__] is not tp:
            return _unknown(tp)
        parts = [f"type({v}) is {tp.__name__}"]
        parts += [
            _compile(f.type, f"{v}.{f.name}", depth + 1).full for f in msgspec.structs.fields(tp)
        ]
        return _Compiled(_and(parts), None, tp)
    return _unknown(tp)


def _function(name: str, fields: list[tuple[str, str]]) -> Check:
    """``def name(e)``: ``True`` when every field's check holds (``e.<field>`` as ``v_<field>``)."""
    lines = [f"def {name}(e):"]
    for field, check in fields:
        lines.append(f"    v_{field} = e.{field}")
        lines.append(f"    if not {check}:")
        lines.append("        return False")
    lines.append("    return e.v in SUPPORTED_VERSIONS")
    ns = dict(_NS, SUPPORTED_VERSIONS=SUPPORTED_VERSIONS)
    exec("\n".join(lines), ns)  # generated from the schema's own annotations
    return cast(Check, ns[name])


class _InputChecks:
    """One input type compiled: its two checks and its fast decoder's type."""

    def __init__(self, cls: type[Event]) -> None:
        fields = msgspec.structs.fields(cls)
        compiled = [(f, _compile(f.type, f"v_{f.name}")) for f in fields]
        self.source_full = [(f.name, c.full) for f, c in compiled]
        self.source_patterns = [(f.name, c.patterns) for f, c in compiled if c.patterns]
        self.full = _function(f"valid_{cls.__name__}", self.source_full)
        self.patterns = _function(f"patterns_{cls.__name__}", self.source_patterns)
        config = cls.__struct_config__
        specs: list[Any] = []
        for f, c in compiled:
            if f.default is not msgspec.NODEFAULT:
                specs.append((f.name, c.fast, f.default))
            elif f.default_factory is not msgspec.NODEFAULT:
                specs.append((f.name, c.fast, msgspec.field(default_factory=f.default_factory)))
            else:
                specs.append((f.name, c.fast))
        self.fast_type = msgspec.defstruct(
            f"Fast{cls.__name__}",
            specs,
            kw_only=True,
            frozen=True,
            tag=config.tag,
            tag_field=config.tag_field,
            forbid_unknown_fields=config.forbid_unknown_fields,
        )


_CHECKS: dict[type, _InputChecks] = {cls: _InputChecks(cls) for cls in INPUT_TYPES}
_VALID: dict[type, Check] = {cls: c.full for cls, c in _CHECKS.items()}
_FROM_FAST: dict[type, tuple[type[Event], Check]] = {
    c.fast_type: (cls, c.patterns) for cls, c in _CHECKS.items()
}
_asdict = msgspec.structs.asdict

FastInput: Any = functools.reduce(operator.or_, [c.fast_type for c in _CHECKS.values()])
"""The input union with every bound but the patterns (those with a plain test)."""

FAST_INPUT_DECODERS: dict[str, Any] = {
    "json": msgspec.json.Decoder(FastInput),
    "msgpack": msgspec.msgpack.Decoder(FastInput),
}


def valid_input(event: Any) -> bool:
    """``True`` when ``event`` (made in Python) is an input within every bound of its
    schema, of a supported version: the codec would decode it back. ``False``
    means "ask the codec" (out of bounds, or of a type not answered here)."""
    check = _VALID.get(type(event))
    return check is not None and check(event)


def from_fast(decoded: Any) -> Event | None:
    """The input a fast decoder produced, as its own event type, when its patterns
    hold and its version is supported; ``None``: ask the codec."""
    cls, patterns = _FROM_FAST[type(decoded)]
    if not patterns(decoded):
        return None
    return cls(**_asdict(decoded))
