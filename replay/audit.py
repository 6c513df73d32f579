"""Audit a canonical history: every recorded decision batch, recomputed bit for bit.

Refold the inputs in order; at each batch, run the policy that made the log
(``header.policy``: the budget scheduler's :func:`~apportion.core.cycle.decide`
or the baseline) on the state folded so far, encode the batch it gives
(basis, decisions, ``next_wakeup_ms``, version) and compare the bytes with the
recorded batch's encoding; then fold the recorded decisions and go on. At the
end, compare the state digest with the one the log recorded (its ``end`` line,
or the projection's state snapshot), or with one given.

The first difference stops the audit: :class:`Divergence` names the batch, the
input it is based on and the first decision (or wake-up time) that differs.
"""

from __future__ import annotations

import msgspec
from apportion.core.history import Decider, decide_batch, fold_item
from apportion.core.state import State
from apportion.schemas.codec import encode
from apportion.schemas.events import DecisionBatch
from apportion.schemas.history import BatchItem

from .eventlog import CanonicalLog
from .simulator import policy_decider


class Divergence(msgspec.Struct, kw_only=True):
    batch: int
    """1-based number of the batch in the log (0 for a digest mismatch)."""
    basis: int
    """The input sequence the batch is based on (the last input for a digest mismatch)."""
    what: str
    """``decision N``, ``next_wakeup_ms``, ``digest``, ``fold`` ..."""
    expected: str
    recorded: str

    def lines(self) -> list[str]:
        if self.what == "digest":
            head = f"audit: final state differs after input {self.basis}"
        else:
            head = f"audit: batch {self.batch} (based on input {self.basis}) differs at {self.what}"
        return [head, f"  expected: {self.expected}", f"  recorded: {self.recorded}"]


class AuditResult(msgspec.Struct, kw_only=True):
    inputs: int
    batches: int
    decisions: int
    digest: str
    recorded_digest: str | None
    divergence: Divergence | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def verdict(self) -> str:
        if self.divergence is not None:
            return "\n".join(self.divergence.lines())
        checked = "" if self.recorded_digest else ", no digest recorded to check"
        return (
            f"audit: {self.inputs:,} inputs, {self.batches:,} decision batches, all reproduced "
            f"(digest {self.digest[:16]}{checked})"
        )


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
    return "batch", _text(expected), _text(recorded)


def audit(
    log: CanonicalLog,
    *,
    decide: Decider | None = None,
    expected_digest: str | None = None,
) -> AuditResult:
    """Audit ``log`` (see the module docstring); ``decide`` overrides the header's policy."""
    decider = decide or policy_decider(log.header.policy)
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
        )

    items = iter(log)
    try:
        for item in items:
            if isinstance(item, BatchItem):
                batches += 1
                recorded_batch = item.batch
                expected, _ = decide_batch(state, decider)
                expected = msgspec.structs.replace(expected, v=recorded_batch.v)
                if encode(expected) != encode(recorded_batch):
                    what, e, r = first_difference(expected, recorded_batch)
                    div = Divergence(
                        batch=batches, basis=recorded_batch.basis, what=what, expected=e, recorded=r
                    )
                    return result(div, None)
                decisions += len(recorded_batch.decisions)
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
