"""Importers for public GPU-cluster traces (``apportion trace import``).

**Philly** (``--format philly``): the job-level extract of the Microsoft Philly
trace from the Pollux artifact (``timestamp, duration, num_gpus, gpu_time,
cluster``) plus the Helios table of virtual-cluster sizes (``vc, node num``,
8 GPUs a node). Rules:

- the budget tree is root -> virtual cluster; each VC is a leaf (and so its own
  team), weight = its GPUs; the cluster is one pool of all VCs' nodes
  (352 nodes x 8 at full capacity), named ``philly-000`` ...;
  ``--capacity-scale s`` gives each VC ``max(1, round(nodes x s))`` nodes and
  the matching weight;
- jobs of virtual clusters without a size (23dbec, 51b7ef, 925e2b, 795a4c) are
  dropped and counted per VC in the report;
- exact duplicate rows (same text, 65 in the published file) are kept once;
- ``--from``/``--to`` keep jobs submitted in ``[from, to)`` (dates, the file's
  clock); submit times become seconds since ``--from`` (or since midnight of
  the first kept day);
- recorded GPUs, submit times and durations are kept as they are. A request of
  more than 8 GPUs that is not a multiple of 8 (12 or 24 GPUs, 14 jobs) is not
  a valid gang: it is written as recorded and the simulator reports it
  rejected, with its line;
- min runtime (``--min-runtime``): ``cap:8h`` (default) = min(duration, 8 h)
  rounded up to a whole minute: every job declares the contract a careful
  user would (its expected runtime, capped), so short jobs are protected to
  completion and long ones are preemptible after 8 h; ``fixed:DUR`` = the same
  for all (capped by the duration of zero-length jobs, never above 8 h);
  ``zero`` = all unallocated;
- job ids are ``philly-<line>``, the line in the source file; resumable; legacy
  priority ``normal``, not preemptible (Philly records neither).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import datetime
from fractions import Fraction
from pathlib import Path
from typing import Any

import msgspec
from apportion.schemas.events import HOUR_MS, MINUTE_MS

from .cluster_file import parse_duration_ms, write_cluster
from .errors import InputFileError
from .textfile import read_text
from .trace import TraceRow, time_to_ms, write_trace

PHILLY_VC_FILE = "philly_vc_nodes_helios.csv"
GPUS_PER_NODE = 8
MAX_MIN_RUNTIME_MS = 8 * HOUR_MS


class ImportReport(msgspec.Struct, kw_only=True):
    source: str
    read: int = 0
    duplicates: int = 0
    outside_window: int = 0
    dropped_vcs: dict[str, int] = msgspec.field(default_factory=dict)
    errors: list[str] = msgspec.field(default_factory=list)
    written: int = 0
    gpus: int = 0
    nodes: int = 0
    vcs: int = 0
    trace_path: str = ""
    cluster_path: str = ""
    span_days: float = 0.0

    def lines(self) -> list[str]:
        out = [
            f"{self.source}: {self.read:,} rows read, {self.duplicates} exact duplicates dropped, "
            f"{self.outside_window:,} outside the window, {len(self.errors)} malformed"
        ]
        for vc, n in sorted(self.dropped_vcs.items()):
            out.append(f"dropped {n:,} jobs of virtual cluster {vc} (no capacity in the VC file)")
        out.append(
            f"{self.written:,} jobs over {self.span_days:.1f} days on {self.vcs} virtual clusters, "
            f"{self.nodes} nodes x {GPUS_PER_NODE} = {self.gpus:,} GPUs"
        )
        out.append(f"wrote {self.cluster_path}")
        out.append(f"wrote {self.trace_path}")
        return out


def min_runtime_rule(rule: str):
    """Parse ``cap:DUR``, ``fixed:DUR`` or ``zero`` into ``duration_ms -> min_runtime_ms``."""
    rule = rule.strip().lower()
    if rule == "zero":
        return lambda d: 0
    kind, _, dur = rule.partition(":")
    if kind not in ("cap", "fixed") or not dur:
        raise ValueError(f"--min-runtime must be cap:DUR, fixed:DUR or zero, got {rule!r}")
    try:
        value = parse_duration_ms(dur)
    except ValueError as exc:
        raise ValueError(f"--min-runtime: {exc}") from None
    if value > MAX_MIN_RUNTIME_MS:
        raise ValueError("--min-runtime: at most 8h (the policy's max_min_runtime)")
    if kind == "fixed":
        return lambda d: value
    return lambda d: min(value, -(-d // MINUTE_MS) * MINUTE_MS)


def _date(text: str | None, what: str) -> datetime | None:
    if text is None:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%d")
    except ValueError:
        raise ValueError(f"{what} must be a date YYYY-MM-DD, got {text!r}") from None


def _csv_rows(reader: Any, file: str | Path) -> Iterator[Any]:
    """The reader's rows; a CSV error (a NUL byte, an unclosed quote) as :class:`InputFileError`."""
    try:
        yield from reader
    except csv.Error as exc:
        raise InputFileError(str(file), reader.line_num, f"CSV: {exc}") from None


def read_vc_file(path: Path) -> list[tuple[str, int]]:
    """``(vc, nodes)`` rows of the virtual-cluster table (columns ``vc, node num``)."""
    text = read_text(path)
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        header = [h.strip() for h in (reader.fieldnames or [])]
    except csv.Error as exc:
        raise InputFileError(str(path), 1, f"CSV: {exc}") from None
    reader.fieldnames = header
    if "vc" not in header or "node num" not in header:
        raise InputFileError(str(path), 1, "need columns vc, node num")
    out = []
    for rec in _csv_rows(reader, path):
        try:
            n = int(rec["node num"])
            if n <= 0 or not rec["vc"]:
                raise ValueError
        except (ValueError, TypeError):
            raise InputFileError(str(path), reader.line_num, f"bad row {rec}") from None
        out.append((rec["vc"].strip(), n))
    return out


def import_philly(
    file: str | Path,
    out_dir: str | Path,
    *,
    vc_file: str | Path | None = None,
    date_from: str | None = None,
    date_to: str | None = None,
    capacity_scale: float = 1.0,
    min_runtime_rule: str = "cap:8h",
) -> ImportReport:
    file = Path(file)
    vc_path = Path(vc_file) if vc_file else file.with_name(PHILLY_VC_FILE)
    rule = (
        min_runtime_rule
        if callable(min_runtime_rule)
        else globals()["min_runtime_rule"](min_runtime_rule)
    )
    if not capacity_scale > 0:
        raise ValueError("--capacity-scale must be positive")
    t_from, t_to = _date(date_from, "--from"), _date(date_to, "--to")
    text = read_text(file)  # the job file first: a missing FILE is named as FILE
    try:
        vcs = read_vc_file(vc_path)
    except InputFileError as exc:
        if vc_file is None and exc.reason.startswith("cannot read"):
            raise InputFileError(
                exc.file,
                None,
                f"{exc.reason} (the virtual-cluster sizes, looked for beside {file.name}; "
                "give the file with --vc-file)",
            ) from None
        raise
    scale = Fraction(str(capacity_scale))
    vc_nodes = {vc: max(1, round(n * scale)) for vc, n in vcs}
    report = ImportReport(source=str(file))
    jobs: list[tuple[datetime, int, int, int, str]] = []  # (submit, line, duration_ms, gpus, vc)
    seen: set[tuple[str, ...]] = set()
    reader = csv.reader(io.StringIO(text, newline=""))
    records = _csv_rows(reader, file)
    header = next(records, None)
    header = None if header is None else [h.strip() for h in header]
    need = ["timestamp", "duration", "num_gpus", "cluster"]
    if header is None or any(c not in header for c in need):
        raise InputFileError(str(file), 1, f"need columns {', '.join(need)}")
    ix = {c: header.index(c) for c in need}
    for rec in records:
        line = reader.line_num
        if not rec:
            continue  # a blank line
        report.read += 1
        key = tuple(rec)
        if key in seen:
            report.duplicates += 1
            continue
        seen.add(key)
        try:
            if len(rec) != len(header):
                raise ValueError(f"{len(rec)} fields, the header has {len(header)}")
            submit = datetime.strptime(rec[ix["timestamp"]].strip(), "%Y-%m-%d %H:%M:%S")
            dur_ms = time_to_ms(rec[ix["duration"]], "duration")
            gpus = int(rec[ix["num_gpus"]])
            if gpus <= 0:
                raise ValueError(f"num_gpus must be positive, got {gpus}")
            vc = rec[ix["cluster"]].strip()
        except ValueError as exc:
            report.errors.append(str(InputFileError(str(file), line, str(exc))))
            continue
        if (t_from and submit < t_from) or (t_to and submit >= t_to):
            report.outside_window += 1
            continue
        if vc not in vc_nodes:
            report.dropped_vcs[vc] = report.dropped_vcs.get(vc, 0) + 1
            continue
        jobs.append((submit, line, dur_ms, gpus, vc))
    jobs.sort()
    origin = t_from or (
        datetime(jobs[0][0].year, jobs[0][0].month, jobs[0][0].day)
        if jobs
        else datetime(2017, 1, 1)
    )
    rows = []
    for submit, line, dur_ms, gpus, vc in jobs:
        delta = submit - origin
        submit_ms = (delta.days * 86_400 + delta.seconds) * 1000
        rows.append(
            TraceRow(
                id=f"philly-{line:06d}",
                submit_ms=submit_ms,
                owner=vc,
                gpus=gpus,
                duration_ms=dur_ms,
                min_runtime_ms=rule(dur_ms),
                legacy_priority="normal",
                legacy_preemptible=False,
                line=line,
            )
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report.trace_path = str(out / "trace.csv")
    report.cluster_path = str(out / "cluster.toml")
    report.written = write_trace(report.trace_path, rows)
    report.nodes = sum(vc_nodes.values())
    report.gpus = report.nodes * GPUS_PER_NODE
    report.vcs = len(vc_nodes)
    if rows:
        report.span_days = (rows[-1].submit_ms - rows[0].submit_ms) / 86_400_000
    budget = [("", 1, "philly")] + [
        (vc, n * GPUS_PER_NODE, f"{vc}-admin") for vc, n in vc_nodes.items()
    ]
    write_cluster(
        report.cluster_path,
        name="philly",
        pools=[("philly-", report.nodes, GPUS_PER_NODE, "gpu")],
        budget=budget,
        comment=(
            f"imported from {file.name} and {vc_path.name}; capacity scale {capacity_scale}; "
            f"window {date_from or 'start'} .. {date_to or 'end'}"
        ),
    )
    return report
