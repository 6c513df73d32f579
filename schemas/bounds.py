"""The bounds of every field, in one place: msgspec constraints the decoders enforce.

Every string and integer an event (or a gateway request) carries has a type
from this module. The decoders (:mod:`apportion.schemas.codec`, the gateway's
request decoder) check them, so a value out of bounds is a malformed input: it
is rejected before the fold sees it, with a reason that names the field and
the bound (``Expected `int` <= 65536 - at `$.gpus```). docs/formats.md lists
them ("Bounds").

The bounds are chosen so that every consumer holds every value exactly:
DuckDB ``INTEGER`` (32-bit) and ``BIGINT`` (64-bit) columns, msgpack
snapshots (64-bit integers), JSON readers that use doubles (integers up to
2**53), and so that the sums the scheduler makes stay in range: a time plus a
duration, and GPUs x milliseconds of charge (900,000 GPUs charged without a
pause from time 0 to the largest time stay below 2**63).

Strings use one safe character set (letters, digits and ``_ . - : @ +``; no
spaces, no control characters, no NUL). Names (workload and node ids, owners,
actors, GPU types) have no ``/``; budget paths are ``/``-separated segments of
the set; event ids may contain ``/`` (``cluster/node/h100-000``). The
scheduler's own rules (a path segment starts with a letter or digit, a
workload id is not empty, GPUs are positive, ...) stay in the fold, which
gives reasons a person can act on; the bounds only say what can be held.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

# -- strings -------------------------------------------------------------------

NAME_CHARS = "A-Za-z0-9_.:@+\\-"
"""The safe character set, as the inside of a regular-expression class."""

MAX_NAME_LEN = 128
"""Workload ids, node ids, owners, actors, ``submitted_by``, GPU types."""
MAX_PATH_LEN = 256
"""Budget paths (a workload's ``owner`` leaf too): room for a few levels of names."""
MAX_EVENT_ID_LEN = 512
"""Event ids and ``InputRejected.ref``: room for a prefix plus a path or a name
(``cluster/budget/<path>``, ``finished-<workload>-<attempt>``)."""
MAX_REASON_LEN = 1024
"""``InputRejected.reason``: longer reasons are cut (see :func:`clip_reason`)."""

_END = "$(?!\\n)"
"""End of the string, in Python (whose bare ``$`` also matches before a final
newline) and in ECMAScript (JSON Schema) alike."""

NAME_PATTERN = f"^[{NAME_CHARS}]*{_END}"
PATH_PATTERN = f"^(?:[{NAME_CHARS}]+(?:/[{NAME_CHARS}]+)*)?{_END}"
EVENT_ID_PATTERN = f"^[{NAME_CHARS}/]+{_END}"

Name = Annotated[str, Meta(max_length=MAX_NAME_LEN, pattern=NAME_PATTERN)]
MAX_OPERATORS = 64
"""Names in a policy's ``operators``."""
MAX_PEERS = 64
"""Clusters in a policy's ``peers``."""
"""An id or a person: up to 128 characters of the safe set, no ``/`` (may be
empty where the event allows it; the fold refuses an empty one where it must not)."""
Path = Annotated[str, Meta(max_length=MAX_PATH_LEN, pattern=PATH_PATTERN)]
"""A budget path: ``""`` (the root) or non-empty names joined by ``/``."""
EventId = Annotated[str, Meta(min_length=1, max_length=MAX_EVENT_ID_LEN, pattern=EVENT_ID_PATTERN)]
"""An event id (the dedup key) or a reference to one: 1 to 512 characters of the set and ``/``."""
Reason = Annotated[str, Meta(max_length=MAX_REASON_LEN)]
"""Free text a person reads (the scheduler writes only printable text: :func:`clip_reason`)."""
MAX_REASON_CODE_LEN = 64
REASON_CODE_PATTERN = f"^[a-z][a-z0-9_]*{_END}"
ReasonCode = Annotated[str, Meta(max_length=MAX_REASON_CODE_LEN, pattern=REASON_CODE_PATTERN)]
"""``InputRejected.code``: a stable snake_case word (:mod:`apportion.schemas.reasons`);
any such word decodes, so a log with codes added later still reads."""

MAX_ARGS = 256
"""Arguments of a workload's ``command``."""
MAX_ARG_LEN = 4096
"""Characters of one argument or one environment value (printable text)."""
MAX_ENV = 64
"""Variables of a workload's ``env``."""
MAX_IMAGE_LEN = 512
"""A container image reference (``registry/name:tag@sha256:...``)."""

ENV_NAME_PATTERN = f"^[A-Za-z_][A-Za-z0-9_]{{0,127}}{_END}"
IMAGE_PATTERN = f"^[A-Za-z0-9_.:@/\\-]*{_END}"

Arg = Annotated[str, Meta(max_length=MAX_ARG_LEN)]
"""One argument of a command or one environment value: up to 4,096 characters
(the fold refuses NUL characters, which no process can receive)."""
EnvName = Annotated[str, Meta(max_length=128, pattern=ENV_NAME_PATTERN)]
"""An environment variable name: a letter or ``_``, then letters, digits, ``_``."""
Image = Annotated[str, Meta(max_length=MAX_IMAGE_LEN, pattern=IMAGE_PATTERN)]
"""A container image reference, or ``""`` for none."""

# -- integers ------------------------------------------------------------------

INT32_MAX = 2**31 - 1
MAX_GPUS = 65_536
"""GPUs of a workload, of a node, of one slot of a placement."""
MAX_DURATION_MS = 100 * 365 * 24 * 3_600_000
"""100 years of 365 days (3,153,600,000,000 ms): min runtimes, durations, lookback."""
MAX_TIME_MS = 10**13
"""Times (``at_ms``): epoch milliseconds up to the year 2286, or simulated ms."""
MAX_DEADLINE_MS = MAX_TIME_MS + MAX_DURATION_MS
"""A time plus a duration (``protected_until_ms``)."""
PPM_MAX = 1_000_000
MAX_GPU_MS = 2**53 - 1
"""GPU-milliseconds of one charge in a usage summary: exact in every JSON reader.
The fold also refuses a charge above the interval times
:data:`MAX_FEDERATION_GPUS` (``core/refusals.py``)."""
MAX_LEAF_CHARGES = 65_536
"""Budget nodes charged in one usage interval (``UsageReported.charges``)."""

Gpus = Annotated[int, Meta(ge=0, le=MAX_GPUS)]
DurationMs = Annotated[int, Meta(ge=0, le=MAX_DURATION_MS)]
TimeMs = Annotated[int, Meta(ge=0, le=MAX_TIME_MS)]
DeadlineMs = Annotated[int, Meta(ge=0, le=MAX_DEADLINE_MS)]
Priority = Annotated[int, Meta(ge=-(2**31), le=INT32_MAX)]
"""A 32-bit signed integer."""
Weight = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT32_MAX)]
"""Attempts, schema versions: a 32-bit count."""
Ppm = Annotated[int, Meta(ge=0, le=PPM_MAX)]
GpuMs = Annotated[int, Meta(ge=0, le=MAX_GPU_MS)]
"""A charge: GPU-milliseconds, 0 to 2**53 - 1."""
ExitCode = Annotated[int, Meta(ge=-255, le=255)]
"""A process exit status: 0-255, or minus the number of the signal that killed it."""
"""Parts per million, 0 to 1,000,000."""


_PATTERN_WORDS = {
    NAME_PATTERN: "of letters, digits and '_.:@+-' (no '/', spaces or control characters)",
    PATH_PATTERN: "of names (letters, digits and '_.:@+-') joined by '/'",
    EVENT_ID_PATTERN: "of letters, digits and '_.:@+-/'",
    ENV_NAME_PATTERN: "of a letter or '_' then letters, digits and '_' (an environment name)",
    IMAGE_PATTERN: "of letters, digits and '_.:@/-' (a container image)",
}


def plain_bound(message: str) -> str:
    """A decoder's message with the regular expression of a bound said in words:
    ``Expected `str` matching regex '^[A-Za-z...' - at `$.workload``` becomes
    ``Expected `str` of letters, digits and ... - at `$.workload```."""
    for pattern, words in _PATTERN_WORDS.items():
        message = message.replace(f"matching regex {pattern!r}", words)
    return message


def clip_reason(reason: str) -> str:
    """``reason`` as an ``InputRejected`` can carry it: control characters become
    spaces and it is cut to :data:`MAX_REASON_LEN` characters (ending in ``...``)."""
    if reason.isprintable() and len(reason) <= MAX_REASON_LEN:
        return reason
    text = "".join(c if c.isprintable() else " " for c in reason)
    if len(text) > MAX_REASON_LEN:
        text = text[: MAX_REASON_LEN - 3] + "..."
    return text
