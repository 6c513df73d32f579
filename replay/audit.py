"""Audit a canonical history: every recorded decision batch, recomputed bit for bit.

Refold the inputs in order; at each batch, run the policy that made the log
(``header.policy``: the budget scheduler's :func:`~apportion.core.cycle.decide`
or the baseline) on the state folded so far, encode the batch it gives
(basis, decisions, ``next_wakeup_ms``, version) and compare the bytes with the
recorded batch's encoding; then fold the recorded decisions and go on. At the
end, compare the state digest with the one the log recorded (its ``end`` line,
or the projection's state snapshot), or with one given.

A cycle published in several parts (consecutive batches with one basis, see
:mod:`apportion.core.history`) is recomputed once, at its first part, and cut
where the recorded parts were cut (:func:`~apportion.core.history.batch_part`):
each part's bytes are compared, counters and ``more`` included, so the parts
together must be exactly the cycle's batch. A log that ends inside a cycle
(read while its parts were being published) is checked up to its last part.

A log recorded before reason codes has ``InputRejected`` decisions without a
``code``: the recomputed decision's code is left out where the recorded one
has none (:func:`as_recorded`; the code labels the rejection, the reason is
still compared), so such a log still audits as reproduced.

The first difference stops the audit: :class:`Divergence` names the batch, the
input it is based on and the first decision (or wake-up time) that differs.

Every batch records the version of the logic that made it
(:attr:`~apportion.schemas.events.DecisionBatch.logic`). The label itself is
not compared (a newer version that decides the same reproduces an older log);
the verdict names the versions the log holds, and a divergence in a batch made
by another version than the audit's names both, so a change of logic is told
apart from a tampered or corrupt log.
"""

from __future__ import annotations

import msgspec
from apportion.core.history import Decider, batch_part, decide_batch, fold_item
from apportion.core.state import State
from apportion.schemas.codec import encode
from apportion.schemas.events import DecisionBatch, InputRejected
from apportion.schemas.history import BatchItem

from .eventlog import CanonicalLog
from .simulator import policy_decider, policy_logic


class Divergence(msgspec.Struct, kw_only=True):
    batch: int
    """1-based number of the batch in the log (0 for a digest mismatch)."""
    basis: int
    """The input sequence the batch is based on (the last input for a digest mismatch)."""
    what: str
    """``decision N``, ``next_wakeup_ms``, ``part``, ``digest``, ``fold`` ..."""
    expected: str
    recorded: str
    logic: str = ""
    """The version of the logic this audit ran."""
    recorded_logic: str = ""
    """The version recorded by the batch that differs (``""``: none recorded)."""

    def lines(self) -> list[str]:
        if self.what == "digest":
            head = f"audit: final state differs after input {self.basis}"
        else:
            head = f"audit: batch {self.batch} (based on input {self.basis}) differs at {self.what}"
        out = [head, f"  expected: {self.expected}", f"  recorded: {self.recorded}"]
        if self.what != "digest" and self.recorded_logic != self.logic:
            made = (
                f"logic {self.recorded_logic}"
                if self.recorded_logic
                else "a version before batches recorded theirs"
            )
            out.append(
                f"  logic: the batch was made by {made}; this audit runs logic {self.logic} "
                "(audit with the version that made the log)"
            )
        return out


class AuditResult(msgspec.Struct, kw_only=True):
    inputs: int
    batches: int
    decisions: int
    digest: str
    recorded_digest: str | None
    divergence: Divergence | None = None
    foreign: list[str] = msgspec.field(default_factory=list)
    """Messages of the source that are not part of the history (left out, named)."""
    logic: str = ""
    """The version of the logic this audit ran."""
    recorded_logic: list[str] = msgspec.field(default_factory=list)
    """The versions the log's batches record, in the order first seen (``""``: none)."""
    gaps: list[str] = msgspec.field(default_factory=list)
    """Lost inputs (:attr:`~apportion.replay.eventlog.CanonicalLog.gaps`), one line each."""
    whole: bool = True
    """``False``: inputs are missing with no loss accepted; the audit covers the
    history before them only."""

    @property
    def ok(self) -> bool:
        return self.divergence is None and not self.foreign and self.whole

    def verdict(self) -> str:
        gaps = [f"audit: {note}" for note in self.gaps]
        foreign = [
            f"audit: {len(self.foreign):,} messages on the decisions stream are not part of the "
            "history (left out):",
            *(f"  {note}" for note in self.foreign),
        ]
        if self.divergence is not None:
            return "\n".join(self.divergence.lines() + gaps + (foreign if self.foreign else []))
        checked = "" if self.recorded_digest else ", no digest recorded to check"
        made = ", ".join(v or "unrecorded" for v in self.recorded_logic)
        by = f" by logic {self.logic}" + (
            f", made by {made}" if made and made != self.logic else ""
        )
        line = (
            f"audit: {self.inputs:,} inputs, {self.batches:,} decision batches, all reproduced"
            f"{by} (digest {self.digest[:16]}{checked})"
        )
        return "\n".join([line, *gaps, *(foreign if self.foreign else [])])


def _text(obj: msgspec.Struct | None) -> str:
    return "(none)" if obj is None else encode(obj).decode()


def first_difference(expected: DecisionBatch, recorded: DecisionBatch) -> tuple[str, str, str]:
    """``(what, expected, recorded)`` for the first field of two batches that differs."""
    for i in range(max(len(expected.decisions), len(recorded.decisions))):
        e = expected.decisions[i] if i < len(expected.decisions) else None
        r = recorded.decisions[i] if i < len(recorded.decisions) else None
        if e is None or r is None or encode(e) != encode(r):
            return f"decision {i + 1}", _text(e), _text(r)
    if expected.next_wakeup_ms != recorded.next_wakeup_ms:
        return "next_wakeup_ms", str(expected.next_wakeup_ms), str(recorded.next_wakeup_ms)
    if (expected.decisions_before, expected.more) != (recorded.decisions_before, recorded.more):
        return "part", _part_text(expected), _part_text(recorded)
    return "batch", _text(expected), _text(recorded)


def as_recorded(expected: DecisionBatch, recorded: DecisionBatch) -> DecisionBatch:
    """``expected`` with the labels that are not compared taken from ``recorded``:
    the schema version, the logic version, and the ``code`` of each
    ``InputRejected`` left out where the recorded decision in its place is an
    ``InputRejected`` without one (a log made before reason codes)."""
    expected = msgspec.structs.replace(expected, v=recorded.v, logic=recorded.logic)
    if not any(
        isinstance(r, InputRejected) and r.code is msgspec.UNSET for r in recorded.decisions
    ):
        return expected
    decisions = (
        tuple(
            msgspec.structs.replace(e, code=msgspec.UNSET)
            if isinstance(e, InputRejected)
            and isinstance(r, InputRejected)
            and r.code is msgspec.UNSET
            else e
            for e, r in zip(expected.decisions, recorded.decisions, strict=False)
        )
        + expected.decisions[len(recorded.decisions) :]
    )
    return msgspec.structs.replace(expected, decisions=decisions)


def _part_text(batch: DecisionBatch) -> str:
    if not batch.is_part:
        return "a whole cycle"
    follows = "more follow" if batch.continued else "the last part"
    return f"a part after decision {batch.decisions_before}, {follows}"


def audit(
    log: CanonicalLog,
    *,
    decide: Decider | None = None,
    logic: str | None = None,
    expected_digest: str | None = None,
) -> AuditResult:
    """Audit ``log`` (see the module docstring); ``decide`` (whose version is
    ``logic``) overrides the header's policy."""
    decider = decide or policy_decider(log.header.policy)
    logic = logic or policy_logic(log.header.policy)
    seen: list[str] = []
    state = State()
    batches = 0
    decisions = 0

    def result(div: Divergence | None, recorded: str | None) -> AuditResult:
        return AuditResult(
            inputs=state.input_seq,
            batches=batches,
            decisions=decisions,
            digest=state.digest(),
            recorded_digest=recorded,
            divergence=div,
            foreign=log.foreign,
            logic=logic,
            recorded_logic=seen,
            gaps=list(log.gaps),
            whole=log.whole,
        )

    items = iter(log)
    cycle: DecisionBatch | None = None
    """The recomputed batch of the cycle whose parts are being compared."""
    cycle_start = done = 0
    """Decisions folded when that cycle began; decisions of it compared so far."""
    try:
        for item in items:
            if isinstance(item, BatchItem):
                batches += 1
                recorded_batch = item.batch
                made_by = "" if recorded_batch.logic is msgspec.UNSET else recorded_batch.logic
                if made_by not in seen:
                    seen.append(made_by)
                if cycle is None:
                    cycle, _ = decide_batch(state, decider, logic)
                    cycle_start, done = state.decisions_folded, 0
                if recorded_batch.is_part or done:
                    stop = done + len(recorded_batch.decisions)
                    expected = batch_part(cycle, done, stop, cycle_start)
                else:
                    expected = cycle
                expected = as_recorded(expected, recorded_batch)
                if encode(expected) != encode(recorded_batch):
                    what, e, r = first_difference(expected, recorded_batch)
                    div = Divergence(
                        batch=batches,
                        basis=recorded_batch.basis,
                        what=what,
                        expected=e,
                        recorded=r,
                        logic=logic,
                        recorded_logic=made_by,
                    )
                    return result(div, None)
                decisions += len(recorded_batch.decisions)
                done += len(recorded_batch.decisions)
                if not recorded_batch.continued:
                    cycle = None
            elif cycle is not None:
                div = Divergence(
                    batch=batches,
                    basis=cycle.basis,
                    what="part",
                    expected=f"a part after decision {cycle_start + done}, the cycle goes on",
                    recorded=f"input {item.seq}",
                )
                return result(div, None)
            fold_item(state, item)
    finally:
        items.close()  # releases the file at a divergence
    recorded = expected_digest or (log.end.digest if log.end is not None else None)
    digest = state.digest()
    if recorded is not None and recorded != digest:
        div = Divergence(
            batch=0, basis=state.input_seq, what="digest", expected=digest, recorded=recorded
        )
        return result(div, recorded)
    return result(None, recorded)
