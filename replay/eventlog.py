"""The canonical history as a file: JSON lines, read and written with msgspec.

One JSON object a line, in canonical order (input 1, the batch based on 1,
input 2, ...):

- ``{"header": {"version": 1, "policy": "budget", "source": "simulate", "cluster": "..."}}``
  first (``policy`` is the one that computed the batches: ``budget`` or ``priority``);
- ``{"seq": k, "input": <event>}``: input ``k`` of ``INPUTS`` (``at_ms`` is the
  time the log recorded it), with ``"subject": "<subject>"`` after ``seq`` when
  the subject it was stored on is known (the fold checks the event against it:
  :mod:`apportion.core.rules.subjects`; older files have none), then
  ``"sent_ms": <ms>`` when the time its writer sent it is known
  (:mod:`apportion.core.rules.identity`: an input is folded once);
- ``{"seq": k, "malformed": {"at_ms": ..., "ref": ..., "reason": ...}}``: an
  input whose bytes did not decode (the scheduler folds it as a rejection);
- ``{"batch": <DecisionBatch>}``: right after the input named by its ``basis``;
- ``{"end": {"inputs": N, "batches": M, "digest": "<sha256>"}}`` last, when the
  writer knew the final state (``digest`` = :meth:`State.digest` after folding
  every line).

Sources: such a file; the ``events``/``batches``/``malformed_inputs`` tables of a
DuckDB projection (``simulate --out``, the live projector, ``replay``); a live
cluster's JetStream streams (read by the services, which hand them over as a
:class:`CanonicalLog` too). Every reader yields the same history items
(:mod:`apportion.schemas.history`: an :class:`InputItem` per input, a
:class:`BatchItem` per decision batch) and checks the canonical order (inputs
numbered 1, 2, ... with no gap; a batch's basis is the last input before it)
as it goes, raising :class:`LogError`.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import msgspec
from apportion.core.history import bridges_gap
from apportion.schemas.codec import EventDecodeError, decode_batch, decode_input, encode
from apportion.schemas.events import (
    INPUT_TYPES,
    BudgetRemoved,
    BudgetSet,
    DecisionBatch,
    InputsLost,
    NodeRegistered,
    PolicySet,
)
from apportion.schemas.history import BatchItem, HistoryItem, InputItem, decoded_item

LOG_VERSION = 1
"""The log format version this code writes and reads."""

CONFIG_TYPES = (NodeRegistered, BudgetSet, BudgetRemoved, PolicySet)


class LogError(ValueError):
    """A log that cannot be read, or is not in canonical order."""


class Header(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: int = LOG_VERSION
    policy: str = "budget"
    source: str = ""
    cluster: str = ""


class End(msgspec.Struct, kw_only=True):
    inputs: int
    batches: int
    digest: str | None = None


class _MalformedBody(msgspec.Struct, kw_only=True):
    at_ms: int
    ref: str
    reason: str


class _Line(msgspec.Struct, kw_only=True):
    header: Header | None = None
    seq: int | None = None
    subject: str | None = None
    sent_ms: int | None = None
    input: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    malformed: _MalformedBody | None = None
    batch: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    end: End | None = None


_line_decoder = msgspec.json.Decoder(_Line)
_enc = msgspec.json.Encoder()


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


class LogWriter:
    """Writes a log file. An observer of the one fold (it ignores the state), so
    the simulator and ``replay`` can hand it the history as they fold it."""

    def __init__(self, path: str | Path | IO[bytes], header: Header) -> None:
        if isinstance(path, str | Path):
            self._f: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed in close()
            self._own = True
        else:
            self._f, self._own = path, False
        self.inputs = 0
        self.batches = 0
        self._f.write(b'{"header":' + _enc.encode(header) + b"}\n")

    def __call__(self, item: HistoryItem, state: object = None, rejected: object = None) -> None:
        self.add(item)

    def add(self, item: HistoryItem) -> None:
        f = self._f
        if isinstance(item, BatchItem):
            self.batches += 1
            f.write(b'{"batch":' + encode(item.batch) + b"}\n")
            return
        self.inputs = item.seq
        if item.event is not None:
            subject = b"" if item.subject is None else b',"subject":' + _enc.encode(item.subject)
            if item.sent_ms is not None:
                subject += b',"sent_ms":%d' % item.sent_ms
            f.write(b'{"seq":%d%s,"input":' % (item.seq, subject) + encode(item.event) + b"}\n")
        else:
            body = _MalformedBody(at_ms=item.at_ms, ref=item.ref, reason=item.rejection or "")
            f.write(b'{"seq":%d,"malformed":' % item.seq + _enc.encode(body) + b"}\n")

    def close(self, digest: str | None = None) -> None:
        end = End(inputs=self.inputs, batches=self.batches, digest=digest)
        self._f.write(b'{"end":' + _enc.encode(end) + b"}\n")
        if self._own:
            self._f.close()
        else:
            self._f.flush()


def write_log(
    path: str | Path, header: Header, items: Iterable[HistoryItem], digest: str | None = None
) -> LogWriter:
    w = LogWriter(path, header)
    for item in items:
        w.add(item)
    w.close(digest)
    return w


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------


class CanonicalLog:
    """A readable history: ``header``, the items (iterate once), then ``end``
    (known only after iterating, ``None`` when the source records no end)."""

    def __init__(
        self,
        header: Header,
        items: Iterable[HistoryItem],
        name: str,
        foreign: list[str] | None = None,
        gaps: list[str] | None = None,
        whole: bool = True,
    ) -> None:
        self.header = header
        self.name = name
        self.foreign: list[str] = foreign or []
        """Messages of the source that are not part of the history (a live cluster's
        DECISIONS stream can hold them), described; the audit reports them."""
        self.gaps: list[str] = gaps or []
        """Lost inputs, one line each: an accepted loss (an ``InputsLost`` at its
        gap), inputs missing with no loss accepted, batches left out for them."""
        self.whole = whole
        """``False`` when inputs are missing with no loss accepted: the items end
        before them."""
        self.end: End | None = None
        self._items = items

    def __iter__(self) -> Generator[HistoryItem, None, None]:
        return _checked(self)


def _checked(log: CanonicalLog) -> Generator[HistoryItem, None, None]:
    """The items, checking canonical order (and the end line's counts)."""
    name = log.name
    seq = 0
    last_basis = 0
    batches = 0
    continued = False  # the last batch was a part of a cycle that goes on in the next one
    for item in log._items:
        if isinstance(item, BatchItem):
            basis = item.batch.basis
            if basis != seq or (basis <= last_basis and last_basis and not continued):
                raise LogError(
                    f"{name}: decisions based on input {basis} follow input {seq} (not canonical order)"
                )
            last_basis = basis
            continued = item.batch.continued
            batches += 1
        else:
            k = item.seq
            if k != seq + 1 and not bridges_gap(seq, item):
                raise LogError(f"{name}: input {k} follows input {seq} (a gap or a repeat)")
            seq = k
        yield item
    end = log.end
    if end is not None and (end.inputs, end.batches) != (seq, batches):
        raise LogError(
            f"{name}: the log holds {seq} inputs and {batches} batches but its end line says "
            f"{end.inputs} and {end.batches} (truncated?)"
        )


def open_log(path: str | Path) -> CanonicalLog:
    """A log file (JSON lines) or a DuckDB projection, told apart by content."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise LogError(f"{path}: cannot read: {exc.strerror}") from None
    if head[8:12] == b"DUCK":
        return read_duckdb(path)
    return read_file(path)


def read_file(path: str | Path) -> CanonicalLog:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            first = f.readline()
    except OSError as exc:
        raise LogError(f"{path}: cannot read: {exc.strerror}") from None
    if not first.strip():
        raise LogError(f"{path}:1: empty file (expected a log header line)")
    try:
        line = _line_decoder.decode(first)
    except msgspec.DecodeError as exc:
        raise LogError(f"{path}:1: not an apportion log ({_short(exc)})") from None
    if line.header is None:
        raise LogError(f'{path}:1: not an apportion log (the first line must be {{"header": ...}})')
    if line.header.version != LOG_VERSION:
        raise LogError(
            f"{path}:1: log version {line.header.version}; this apportion reads version {LOG_VERSION}"
        )
    log = CanonicalLog(line.header, (), str(path))
    log._items = _file_items(path, log)
    return log


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200]


def _file_items(path: Path, log: CanonicalLog) -> Iterator[HistoryItem]:
    try:
        f = open(path, "rb")  # noqa: SIM115
    except OSError as exc:
        raise LogError(f"{path}: cannot read: {exc.strerror}") from None
    with f:
        f.readline()
        n = 1
        batches = 0
        for raw in f:
            n += 1
            if not raw.strip():
                continue
            if log.end is not None:
                raise LogError(f"{path}:{n}: a line after the end line")
            try:
                line = _line_decoder.decode(raw)
                if line.input and line.seq is not None:
                    item = decoded_item(line.seq, decode_input(line.input))
                    if line.subject is not None and item.event is not None:
                        item = msgspec.structs.replace(item, subject=line.subject)
                    if line.sent_ms is not None and item.event is not None:
                        item = msgspec.structs.replace(item, sent_ms=line.sent_ms)
                    yield item
                elif line.malformed is not None and line.seq is not None:
                    m = line.malformed
                    yield InputItem(seq=line.seq, at_ms=m.at_ms, ref=m.ref, rejection=m.reason)
                elif line.batch:
                    batches += 1
                    yield BatchItem(seq=batches, batch=decode_batch(line.batch))
                elif line.end is not None:
                    log.end = line.end
                else:
                    raise LogError(f"{path}:{n}: expected an input, malformed, batch or end line")
            except msgspec.DecodeError as exc:
                raise LogError(f"{path}:{n}: {_short(exc)}") from None
            except EventDecodeError as exc:
                raise LogError(f"{path}:{n}: {_short(exc)}") from None


def read_duckdb(path: str | Path) -> CanonicalLog:
    """The history in a projection database (needs its ``batches`` table)."""
    import duckdb

    path = Path(path)
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error as exc:
        raise LogError(f"{path}: cannot open the database: {_short(exc)}") from None
    try:
        names = {
            r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()
        }
        if not {"events", "projection_position"} <= names:
            raise LogError(f"{path}: not an apportion projection (no events table)")
        if "projection_state" in names:
            found = con.execute(
                "SELECT input_seq, batches, pos FROM projection_position"
            ).fetchone()
            saved = con.execute("SELECT state FROM projection_state").fetchone()
            row = None if found is None else (*found, saved[0] if saved else None)
        else:  # written before projection_state (read-only here: not migrated)
            row = con.execute(
                "SELECT input_seq, batches, pos, state FROM projection_position"
            ).fetchone()
        if row is None or row[3] is None:
            raise LogError(f"{path}: the projection is empty")
        n_batch_rows = 0
        if "batches" in names:
            count = con.execute("SELECT COUNT(*) FROM batches").fetchone()
            assert count is not None  # COUNT(*) always returns one row
            n_batch_rows = count[0]
        if n_batch_rows != row[1]:
            raise LogError(
                f"{path}: the projection folded {row[1]} decision batches but records {n_batch_rows} "
                "(written before batches were recorded); rebuild it with simulate --out or replay"
            )
        meta = (
            dict(con.execute("SELECT key, value FROM log_meta").fetchall())
            if "log_meta" in names
            else {}
        )
    except duckdb.Error as exc:
        raise LogError(f"{path}: {_short(exc)}") from None
    finally:
        con.close()
    from apportion.core.state import State

    header = Header(
        policy=meta.get("policy", "budget"), source="duckdb", cluster=meta.get("cluster", "")
    )
    log = CanonicalLog(header, (), str(path))
    end = End(inputs=row[0], batches=row[1], digest=State.from_bytes(row[3]).digest())
    log._items = _duckdb_items(path, log, end, row[2])
    return log


def _rows(cur: Any) -> Iterator[tuple]:
    while True:
        rows = cur.fetchmany(5000)
        if not rows:
            return
        yield from rows


def _duckdb_items(path: Path, log: CanonicalLog, end: End, last_pos: int) -> Iterator[HistoryItem]:
    """Input ``k`` is the ``k``-th input row of ``events`` (or ``malformed_inputs`` row ``k``);
    batch ``i`` takes the next ``decisions`` decision rows, which must sit at
    ``pos + 1 ..``; a batch follows the input named by its basis."""
    import duckdb
    from apportion.schemas.codec import decode_decision

    kinds = [t.__struct_config__.tag for t in INPUT_TYPES]
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error as exc:
        raise LogError(f"{path}: cannot open the database: {_short(exc)}") from None
    try:
        malformed = {
            r[0]: InputItem(seq=r[0], at_ms=r[1], ref=r[2], rejection=r[3])
            for r in con.execute("SELECT seq, at_ms, ref, reason FROM malformed_inputs").fetchall()
        }
        has_logic = con.execute(
            "SELECT COUNT(*) FROM duckdb_columns() WHERE table_name = 'batches' "
            "AND column_name = 'logic'"
        ).fetchone()
        logic_col = "logic" if has_logic and has_logic[0] else "NULL"  # files before versions
        has_subject = con.execute(
            "SELECT COUNT(*) FROM duckdb_columns() WHERE table_name = 'events' "
            "AND column_name = 'subject'"
        ).fetchone()
        subject_col = "subject" if has_subject and has_subject[0] else "NULL"  # files before
        has_sent = con.execute(
            "SELECT COUNT(*) FROM duckdb_columns() WHERE table_name = 'events' "
            "AND column_name = 'sent_ms'"
        ).fetchone()
        sent_col = "sent_ms" if has_sent and has_sent[0] else "NULL"  # files before
        batches = con.execute(
            f"SELECT basis, pos, decisions, next_wakeup_ms, v, batch, {logic_col} FROM batches "
            "ORDER BY batch"
        ).fetchall()
        icur, dcur = con.cursor(), con.cursor()
        icur.execute(
            f"SELECT pos, body, {subject_col}, {sent_col} FROM events WHERE pos <= ? "
            "AND kind IN (SELECT unnest(?::VARCHAR[])) ORDER BY pos",
            [last_pos, kinds],
        )
        dcur.execute(
            "SELECT pos, body FROM events WHERE pos <= ? AND kind NOT IN (SELECT unnest(?::VARCHAR[])) "
            "ORDER BY pos",
            [last_pos, kinds],
        )
        inputs, decisions = _rows(icur), _rows(dcur)
        bi = 0
        folded = 0  # decisions before the batch: a part of a split cycle names it
        seq = 0
        while seq < end.inputs:
            seq += 1
            if seq in malformed:
                yield malformed[seq]
            else:
                row = next(inputs, None)
                if row is None:
                    raise LogError(f"{path}: input {seq} is missing from the events table")
                try:
                    event = decode_input(row[1])
                except EventDecodeError as exc:
                    raise LogError(f"{path}: events row {row[0]}: {_short(exc)}") from None
                if isinstance(event, InputsLost) and event.first == seq < event.through:
                    seq = event.through  # a loss accepted at its gap: the inputs it names
                item = decoded_item(seq, event)
                if row[2] is not None and item.event is not None:
                    item = msgspec.structs.replace(item, subject=row[2])
                if row[3] is not None and item.event is not None:
                    item = msgspec.structs.replace(item, sent_ms=row[3])
                yield item
            run = bi
            while run < len(batches) and batches[run][0] == seq:
                run += 1
            split = run - bi > 1  # a cycle in parts (the table keeps no part fields)
            while bi < run:
                basis, bpos, n, wake, v, number, logic = batches[bi]
                got = []
                for k in range(n):
                    row = next(decisions, None)
                    if row is None or row[0] != bpos + 1 + k:
                        raise LogError(
                            f"{path}: decision {k + 1} of batch {bi + 1} is not at events row {bpos + 1 + k}"
                        )
                    try:
                        got.append(decode_decision(row[1]))
                    except EventDecodeError as exc:
                        raise LogError(f"{path}: events row {row[0]}: {_short(exc)}") from None
                batch = DecisionBatch(
                    basis=basis,
                    decisions=tuple(got),
                    next_wakeup_ms=wake,
                    v=v,
                    logic=msgspec.UNSET if logic is None else logic,
                )
                if split:
                    more = True if bi + 1 < run else msgspec.UNSET
                    batch = msgspec.structs.replace(batch, decisions_before=folded, more=more)
                folded += n
                yield BatchItem(seq=number, batch=batch)
                bi += 1
        if (
            bi != len(batches)
            or next(inputs, None) is not None
            or next(decisions, None) is not None
        ):
            raise LogError(f"{path}: the batches table does not match the events table")
        log.end = end
    except duckdb.Error as exc:
        raise LogError(f"{path}: {_short(exc)}") from None
    finally:
        con.close()
