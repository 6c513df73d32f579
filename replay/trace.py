"""Trace and health CSVs (formats in docs/formats.md).

**Trace CSV**, one workload a row: ``id, submit, owner, gpus, duration,
min_runtime`` and optionally ``resumable`` (default true), ``priority``
(default 0), ``gpu_type`` (default ``any``), ``legacy_priority``
(``low``/``normal``/``high``, default ``high``), ``legacy_preemptible``
(default false), ``cluster`` (default: routed, in a simulation of several
clusters). Times are seconds (fractional allowed) from the start of the
simulation, rounded to the nearest millisecond, or durations with a unit as in
the cluster file and the CLI (``90s``, ``45m``, ``1h``, ``2d``): :func:`time_to_ms`.

**Health CSV**: ``at`` (a time as above), ``node``, ``state`` (healthy/draining/down).

Text: UTF-8 with or without a byte-order mark (:mod:`.textfile`). A malformed
row is reported as :class:`InputFileError` (file, line, reason) and skipped; the
valid rows still run. A missing or undecodable file, or a missing required
column, stops the read.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Iterator
from fractions import Fraction
from pathlib import Path

import msgspec
from apportion.schemas.events import HealthState, LegacyPriority

from .cluster_file import parse_duration_ms
from .errors import InputFileError
from .textfile import read_text

TRACE_COLUMNS = ("id", "submit", "owner", "gpus", "duration", "min_runtime")
TRACE_OPTIONAL = ("resumable", "priority", "gpu_type", "legacy_priority", "legacy_preemptible")
TRACE_CLUSTER = "cluster"
"""One more optional column, written only when a row names a cluster."""
HEALTH_COLUMNS = ("at", "node", "state")
_TRUE = {"true", "1", "yes", "y", "t"}
_FALSE = {"false", "0", "no", "n", "f", ""}
LEGACY_PRIORITIES: tuple[LegacyPriority, ...] = ("low", "normal", "high")
HEALTH_STATES: tuple[HealthState, ...] = ("healthy", "draining", "down")


class TraceRow(msgspec.Struct, kw_only=True):
    id: str
    submit_ms: int
    owner: str
    gpus: int
    duration_ms: int
    min_runtime_ms: int
    resumable: bool = True
    priority: int = 0
    gpu_type: str = "any"
    legacy_priority: LegacyPriority = "high"
    legacy_preemptible: bool = False
    line: int = 0
    """Line in the file it came from (0 when generated in memory)."""
    cluster: str | msgspec.UnsetType = msgspec.UNSET
    """The cluster it must run on, in a simulation of several (unset: routed,
    :mod:`apportion.replay.federation`; not encoded then, so a row encodes as
    before the field existed)."""


MAX_GENERATED_ROWS = 2_000_000
"""The most workloads a generated scenario may hold (the family at 16,384 GPUs and
load 4 makes about 67,000 in 10 days); past it generation stops with a
``ValueError`` instead of filling the machine's memory."""


class NumberedRows:
    """Generated trace rows with ids ``<kind>-<n>`` numbered in the order they are made."""

    def __init__(self) -> None:
        self.rows: list[TraceRow] = []

    def add(
        self,
        kind: str,
        owner: str,
        submit_ms: int,
        gpus: int,
        duration_ms: int,
        min_runtime_ms: int,
        *,
        resumable: bool = True,
        gpu_type: str = "any",
        legacy_priority: LegacyPriority = "normal",
        legacy_preemptible: bool = False,
    ) -> TraceRow:
        if len(self.rows) >= MAX_GENERATED_ROWS:
            raise ValueError(
                f"the scenario would hold more than {MAX_GENERATED_ROWS:,} workloads: "
                "ask for fewer days, fewer GPUs or a lower load"
            )
        row = TraceRow(
            id=f"{kind}-{len(self.rows) + 1:06d}",
            submit_ms=submit_ms,
            owner=owner,
            gpus=gpus,
            duration_ms=duration_ms,
            min_runtime_ms=min_runtime_ms,
            resumable=resumable,
            gpu_type=gpu_type,
            legacy_priority=legacy_priority,
            legacy_preemptible=legacy_preemptible,
        )
        self.rows.append(row)
        return row


class HealthRow(msgspec.Struct, kw_only=True):
    at_ms: int
    node: str
    state: HealthState
    line: int = 0


def seconds_to_ms(text: str) -> int:
    """``"12.5"`` -> ``12500``: exact decimal, rounded to the nearest ms (half to even)."""
    text = text.strip()
    if text.isascii() and text.isdigit():  # whole seconds, the usual cell: what Fraction gives
        return int(text) * 1000
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"not a number of seconds: {text!r}") from None
    if value < 0:
        raise ValueError(f"negative time {text}")
    return round(value * 1000)


def time_to_ms(text: str, column: str) -> int:
    """A time cell: a bare number is seconds (``"90"``, ``"12.5"``, rounded to the
    nearest ms as :func:`seconds_to_ms`); with a unit it is a duration as in the
    cluster file and the CLI (``"90s"``, ``"45m"``, ``"1h"``, ``"2d"``, ``"1.5h"``,
    :func:`~.cluster_file.parse_duration_ms`: a whole number of milliseconds)."""
    t = text.strip()
    try:
        if t.startswith("-"):
            raise ValueError("negative time")
        return parse_duration_ms(t) if t[-1:].isalpha() else seconds_to_ms(t)
    except ValueError as exc:
        reason = str(exc)
        if reason.startswith("duration"):  # parse_duration_ms: a fraction of a millisecond
            reason = "not a whole number of milliseconds"
        elif not reason.startswith("negative"):
            reason = "not a number of seconds or a duration such as 90s, 45m, 1h or 2d"
        raise ValueError(f"{reason}: {column} {text!r}") from None


def ms_to_seconds(ms: int) -> str:
    """``12500`` -> ``"12.5"``; ``12000`` -> ``"12"``."""
    if ms % 1000 == 0:
        return str(ms // 1000)
    sign = "-" if ms < 0 else ""
    ms = abs(ms)
    return f"{sign}{ms // 1000}.{ms % 1000:03d}".rstrip("0")


def _bool(text: str, column: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"{column} must be true or false, got {text!r}")


def _int(text: str, column: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{column} must be an integer, got {text!r}") from None


def _reader(path: str | Path, required: tuple[str, ...]) -> csv.DictReader[str]:
    """A reader over the file's text (:mod:`.textfile`: UTF-8 with or without a BOM),
    its header trimmed and checked for the ``required`` columns."""
    text = read_text(path)
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        header = [h.strip() for h in (reader.fieldnames or [])]
    except csv.Error as exc:
        raise InputFileError(str(path), 1, f"CSV: {exc}") from None
    if not header:
        raise InputFileError(
            str(path), None, f"empty file; need a header line with {', '.join(required)}"
        )
    reader.fieldnames = header
    missing = [c for c in required if c not in header]
    if missing:
        raise InputFileError(
            str(path), 1, f"missing column(s) {', '.join(missing)}; need {', '.join(required)}"
        )
    return reader


def _records(
    path: str | Path, required: tuple[str, ...], errors: list[InputFileError]
) -> Iterator[tuple[int, dict[str, str]]]:
    """``(line, record)`` for each data row with the header's number of fields; a
    row with more or fewer fields, and a CSV error (which stops the reading), go to
    ``errors`` with their line. A file that cannot be read or decoded raises."""
    reader = _reader(path, required)
    try:
        for rec in reader:
            line = reader.line_num
            if None in rec:
                errors.append(InputFileError(str(path), line, "more fields than the header has"))
            elif any(rec.get(c) is None for c in required):
                errors.append(InputFileError(str(path), line, "fewer fields than the header has"))
            else:
                yield line, rec
    except csv.Error as exc:
        errors.append(InputFileError(str(path), reader.line_num, f"CSV: {exc}"))


def read_trace(path: str | Path) -> tuple[list[TraceRow], list[InputFileError]]:
    """Rows sorted by (submit, line), and one error per rejected row."""
    rows: list[TraceRow] = []
    errors: list[InputFileError] = []
    seen: dict[str, int] = {}
    for line, rec in _records(path, TRACE_COLUMNS, errors):
        try:
            wid = rec["id"].strip()
            if not wid:
                raise ValueError("id is empty")
            if wid in seen:
                raise ValueError(f"id {wid!r} repeats line {seen[wid]}")
            owner = rec["owner"].strip()
            if not owner:
                raise ValueError("owner is empty")
            gpus = _int(rec["gpus"], "gpus")
            if gpus <= 0:
                raise ValueError(f"gpus must be positive, got {gpus}")
            submit = time_to_ms(rec["submit"], "submit")
            duration = time_to_ms(rec["duration"], "duration")
            min_rt = time_to_ms(rec["min_runtime"], "min_runtime")
            row = TraceRow(
                id=wid,
                submit_ms=submit,
                owner=owner,
                gpus=gpus,
                duration_ms=duration,
                min_runtime_ms=min_rt,
                line=line,
            )
            if (v := rec.get("resumable")) not in (None, ""):
                row.resumable = _bool(v, "resumable")
            if (v := rec.get("priority")) not in (None, ""):
                row.priority = _int(v, "priority")
            if (v := rec.get("gpu_type")) not in (None, ""):
                row.gpu_type = v.strip()
            if (v := rec.get("legacy_priority")) not in (None, ""):
                lp = v.strip().lower()
                if lp not in LEGACY_PRIORITIES:
                    raise ValueError(f"legacy_priority must be low, normal or high, got {v!r}")
                row.legacy_priority = lp
            if (v := rec.get("legacy_preemptible")) not in (None, ""):
                row.legacy_preemptible = _bool(v, "legacy_preemptible")
            if (v := rec.get(TRACE_CLUSTER)) not in (None, ""):
                row.cluster = v.strip()
        except ValueError as exc:
            errors.append(InputFileError(str(path), line, str(exc)))
            continue
        seen[wid] = line
        rows.append(row)
    rows.sort(key=lambda r: (r.submit_ms, r.line))
    return rows, errors


def read_health(path: str | Path) -> tuple[list[HealthRow], list[InputFileError]]:
    rows: list[HealthRow] = []
    errors: list[InputFileError] = []
    for line, rec in _records(path, HEALTH_COLUMNS, errors):
        try:
            at = time_to_ms(rec["at"], "at")
            node = rec["node"].strip()
            if not node:
                raise ValueError("node is empty")
            state = rec["state"].strip().lower()
            if state not in HEALTH_STATES:
                raise ValueError(f"state must be healthy, draining or down, got {rec['state']!r}")
        except ValueError as exc:
            errors.append(InputFileError(str(path), line, str(exc)))
            continue
        rows.append(HealthRow(at_ms=at, node=node, state=state, line=line))
    rows.sort(key=lambda r: (r.at_ms, r.line))
    return rows, errors


def write_trace(path: str | Path, rows: Iterable[TraceRow]) -> int:
    n = 0
    rows = list(rows)
    clusters = any(r.cluster for r in rows)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(TRACE_COLUMNS + TRACE_OPTIONAL + ((TRACE_CLUSTER,) if clusters else ()))
        for r in rows:
            w.writerow(
                (
                    r.id,
                    ms_to_seconds(r.submit_ms),
                    r.owner,
                    r.gpus,
                    ms_to_seconds(r.duration_ms),
                    ms_to_seconds(r.min_runtime_ms),
                    str(r.resumable).lower(),
                    r.priority,
                    r.gpu_type,
                    r.legacy_priority,
                    str(r.legacy_preemptible).lower(),
                    *((r.cluster or "",) if clusters else ()),
                )
            )
            n += 1
    return n


def write_health(path: str | Path, rows: Iterable[HealthRow]) -> int:
    n = 0
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(HEALTH_COLUMNS)
        for r in rows:
            w.writerow((ms_to_seconds(r.at_ms), r.node, r.state))
            n += 1
    return n
