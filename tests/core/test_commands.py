"""The command layer and the reason codes: every code the fold records comes from
a hand-made request, the command layer answers it with the same code (it calls
the fold's own checks), and docs/reasons.md lists exactly the codes defined."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from apportion.core import commands
from apportion.core.fold import apply
from apportion.core.history import fold_item
from apportion.core.state import State
from apportion.schemas.bounds import MAX_GPUS
from apportion.schemas.events import (
    HOUR_MS,
    BudgetRemoved,
    BudgetSet,
    Input,
    InputRejected,
    LeafCharge,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    UsageSummary,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadHeld,
    WorkloadReleased,
    WorkloadStarted,
    WorkloadSubmitted,
)
from apportion.schemas.history import input_item, malformed_item
from apportion.schemas.reasons import CODES, FOLD_CODES, REQUEST_CODES, Refusal
from core_builders import ADMIN, Scenario

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reasons.md"


def world() -> State:
    """Root owned by admin; ``llm`` (owner lead) > ``llm/a`` (alice); ``vision`` (dan);
    hosts n0, n1 (8 a100 each); ``run`` running on n0, ``pend`` pending, ``done`` ended."""
    s = Scenario()
    s.budget("", owner=ADMIN).budget("llm", owner="lead").budget("llm/a", owner="alice")
    s.budget("vision", owner="dan")
    s.node("n0").node("n1")
    s.submit("run", "llm/a", gpus=8).place("run", "n0")
    s.submit("done", "llm/a", gpus=4).place("done", "n1").finish("done", actor=ADMIN)
    s.submit("pend", "vision", gpus=8)
    s.policy(cluster="west", peers=("east", "west"))
    s.apply(
        UsageSummary(
            id="east-0", at_ms=0, source="east", start_ms=0, end_ms=300_000, actor="federation:east"
        )
    )
    return s.state


def sub(**kw: object) -> WorkloadSubmitted:
    fields: dict[str, object] = {
        "id": "req",
        "at_ms": 0,
        "workload": "new",
        "owner": "llm/a",
        "gpus": 1,
        "min_runtime_ms": HOUR_MS,
        "submitted_by": "alice",
    }
    fields.update(kw)
    return commands.submission(**fields)  # type: ignore[arg-type]


def budget_set(path: str, weight: int = 1, owner: str = "o", actor: str = ADMIN) -> BudgetSet:
    return BudgetSet(id="req", at_ms=0, path=path, weight=weight, owner=owner, actor=actor)


def removed(path: str, actor: str = ADMIN) -> BudgetRemoved:
    return BudgetRemoved(id="req", at_ms=0, path=path, actor=actor)


def node(name: str, gpus: int = 8, gpu_type: str = "a100", actor: str = ADMIN) -> NodeRegistered:
    return NodeRegistered(id="req", at_ms=0, node=name, gpus=gpus, gpu_type=gpu_type, actor=actor)


def health(name: str, state: str = "draining", actor: str = ADMIN) -> NodeHealthChanged:
    return NodeHealthChanged(id="req", at_ms=0, node=name, state=state, actor=actor)  # type: ignore[arg-type]


def hold(workload: str, actor: str = ADMIN, release: bool = False) -> Input:
    kind = WorkloadReleased if release else WorkloadHeld
    return kind(id="req", at_ms=0, workload=workload, actor=actor)


def cancel(workload: str, actor: str = ADMIN) -> WorkloadCancelled:
    return WorkloadCancelled(id="req", at_ms=0, workload=workload, actor=actor)


def finished(workload: str, attempt: int | None = None, actor: str = ADMIN) -> WorkloadFinished:
    return WorkloadFinished(id="req", at_ms=0, workload=workload, attempt=attempt, actor=actor)


def started(workload: str, node: str, attempt: int = 1, actor: str = ADMIN) -> WorkloadStarted:
    return WorkloadStarted(
        id="req", at_ms=0, workload=workload, attempt=attempt, node=node, actor=actor
    )


def usage(source: str = "east", start: int = 300_000, end: int = 600_000, **kw: object) -> Input:
    fields: dict[str, object] = {"actor": f"federation:{source}", **kw}
    return UsageSummary(id="req", at_ms=0, source=source, start_ms=start, end_ms=end, **fields)  # type: ignore[arg-type]


def policy(**kw: object) -> PolicySet:
    return PolicySet(id="req", at_ms=0, **{"actor": ADMIN, **kw})  # type: ignore[arg-type]


# (expected code, the request as an input event, words of the fold's message)
CASES: list[tuple[str, Callable[[], Input], str]] = [
    ("invalid_name", lambda: sub(workload=""), "workload id is empty"),
    ("invalid_name", lambda: sub(workload=".."), "is not allowed"),
    ("invalid_name", lambda: node(""), "node name is empty"),
    ("invalid_name", lambda: node("."), "is not allowed"),
    ("invalid_name", lambda: budget_set("vision/x", owner=""), "owner is empty"),
    ("bad_path", lambda: budget_set("llm/_x"), "bad budget path"),
    ("not_positive", lambda: sub(gpus=0), "gpus must be positive"),
    ("not_positive", lambda: node("n9", gpus=0), "gpus must be positive"),
    ("not_positive", lambda: budget_set("llm/b", weight=0), "weight must be a positive"),
    ("invalid_gpu_type", lambda: node("n9", gpu_type="any"), "must name a real GPU type"),
    ("invalid_gpu_type", lambda: node("n9", gpu_type=""), "must name a real GPU type"),
    ("out_of_range", lambda: policy(lookback_ms=0), "lookback must be between"),
    ("out_of_range", lambda: policy(max_min_runtime_ms=8 * 24 * HOUR_MS), "max_min_runtime"),
    ("out_of_range", lambda: policy(preemption_margin_ppm=1_000_000), "preemption margin"),
    ("out_of_range", lambda: policy(grace_ms=60_000, max_grace_ms=1), "must not exceed max_grace"),
    ("over_cap", lambda: sub(min_runtime_ms=9 * HOUR_MS), "min_runtime must be between"),
    ("over_cap", lambda: sub(grace_ms=HOUR_MS), "grace must be between"),
    ("unknown_owner", lambda: sub(owner="nope"), "unknown owner 'nope'"),
    ("unknown_owner", lambda: sub(owner=""), "unknown owner ''"),
    ("not_a_leaf", lambda: sub(owner="llm", submitted_by="lead"), "is not a leaf"),
    ("unknown_gpu_type", lambda: sub(gpu_type="h100"), "no nodes of gpu_type 'h100'"),
    ("invalid_gang", lambda: sub(gpus=12), "is not a valid gang"),
    ("unknown_workload", lambda: cancel("ghost"), "unknown workload 'ghost'"),
    ("unknown_workload", lambda: finished("ghost"), "unknown workload 'ghost'"),
    ("unknown_workload", lambda: started("ghost", "n0"), "unknown workload 'ghost'"),
    ("unknown_node", lambda: health("n9"), "unknown node 'n9'"),
    ("unknown_budget_node", lambda: removed("zzz"), "unknown budget node 'zzz'"),
    ("unknown_parent", lambda: budget_set("x/y"), "parent 'x' does not exist"),
    ("not_authorised", lambda: sub(submitted_by="mallory"), "mallory may not submit"),
    ("not_authorised", lambda: cancel("run", "mallory"), "mallory may not cancel"),
    ("not_authorised", lambda: budget_set("llm/b", actor="mallory"), "'mallory' does not own"),
    ("not_authorised", lambda: removed("llm/a", actor="alice"), "'alice' does not own"),
    ("not_authorised", lambda: policy(actor="mallory"), "does not own the root"),
    ("not_authorised", lambda: health("n0", actor="mallory"), "mallory may not change"),
    ("not_authorised", lambda: node("n9", actor="mallory"), "mallory may not register"),
    ("not_authorised", lambda: finished("run", actor="mallory"), "may not report the end"),
    ("not_authorised", lambda: started("run", "n0", actor="mallory"), "may not report the start"),
    ("duplicate_id", lambda: sub(workload="pend"), "already exists"),
    ("duplicate_id", lambda: sub(workload="done"), "already exists"),
    ("already_ended", lambda: cancel("done"), "already ended as succeeded"),
    ("already_ended", lambda: finished("done"), "already ended as succeeded (stale report)"),
    ("already_ended", lambda: started("done", "n1"), "already ended as succeeded"),
    ("stale_report", lambda: finished("run", attempt=2), "report for attempt 2"),
    ("stale_report", lambda: finished("pend"), "is pending, not running"),
    ("stale_report", lambda: started("run", "n0", attempt=2), "is not its current run"),
    ("wrong_node", lambda: started("run", "n1"), "is not placed on 'n1'"),
    ("no_change", lambda: health("n0", "healthy"), "already healthy (no change)"),
    ("no_change", lambda: node("n1"), "already registered (no change)"),
    ("has_work", lambda: removed("llm/a"), "pending or running workloads"),
    ("has_work", lambda: budget_set("llm/a/sub"), "has pending or running work"),
    ("has_work", lambda: node("n0", gpus=4), "has running work"),
    ("has_children", lambda: removed("llm"), "has children"),
    ("root_not_removable", lambda: removed(""), "root of the budget tree cannot be removed"),
    ("reserved_name", lambda: budget_set("llm/b", owner="scheduler"), "is reserved"),
    ("reserved_name", lambda: budget_set("llm/b", owner="agent:n0"), "is reserved"),
    ("invalid_text", lambda: sub(command=("run", "a\0b")), "argument 1 holds a NUL"),
    ("invalid_text", lambda: sub(env={"X": "\0"}), "value X holds a NUL"),
    ("not_pending", lambda: hold("run"), "is running, not pending"),
    ("not_held", lambda: hold("pend", release=True), "is pending, not held"),
    ("not_authorised", lambda: hold("pend", "mallory"), "mallory may not hold"),
    ("unknown_workload", lambda: hold("ghost", release=True), "unknown workload 'ghost'"),
    ("already_ended", lambda: hold("done"), "already ended as succeeded"),
    ("usage_counted", lambda: usage(start=0, end=300_000), "a repeat of"),
    ("usage_counted", lambda: usage(start=200_000, end=400_000), "overlaps"),
    ("own_usage", lambda: usage("west"), "which is this cluster"),
    ("bad_usage", lambda: usage(end=300_000), "non-empty and at most 1 h"),
    (
        "bad_usage",
        lambda: usage(charges=(LeafCharge("llm/a", 1), LeafCharge("llm/a", 2))),
        "named twice",
    ),
    ("bad_usage", lambda: usage(charges=(LeafCharge("llm/a", 2**52),)), "more than the interval"),
    ("bad_path", lambda: usage(charges=(LeafCharge("llm/-x", 1),)), "bad budget path"),
    ("not_authorised", lambda: usage(actor="federation:north"), "may not report usage"),
    ("invalid_name", lambda: usage(""), "source cluster is empty"),
    ("invalid_name", lambda: policy(peers=("east",)), "must name itself"),
    ("out_of_range", lambda: policy(usage_summary_ms=1_000), "between 10 s and 1 h"),
]

SUBJECT_CODES = {"wrong_subject", "wrong_host", "duplicate_input", "stale_input"}
"""Codes of the subject an input was stored on and of its identity (when it was
sent, its id), which a request does not have (tests/core/test_subjects.py,
tests/core/test_input_identity.py)."""


@pytest.fixture(scope="module")
def base() -> State:
    return world()


@pytest.mark.parametrize(
    ("code", "make", "words"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_the_fold_and_the_command_layer_give_the_same_code(
    base: State, code: str, make: Callable[[], Input], words: str
) -> None:
    event = make()
    refusal = commands.check(base, event)
    assert refusal is not None, f"{event} was accepted"
    assert refusal.code == code, refusal
    state = base.copy()
    before = state.to_bytes()
    apply(state, event)
    ref, reason, fold_code = state.rejections[-1]
    assert (ref, fold_code) == ("req", code)
    assert words in reason and refusal.message in reason, (reason, refusal.message)
    assert base.to_bytes() == before  # the command layer changed nothing


def test_every_code_of_the_fold_is_produced_by_a_hand_made_request() -> None:
    covered = {code for code, _, _ in CASES} | {"malformed"} | SUBJECT_CODES  # below, elsewhere
    assert covered == set(FOLD_CODES)


def test_a_request_out_of_bounds_is_malformed_in_both() -> None:
    state = world()
    event = sub(gpus=MAX_GPUS + 1)
    refusal = commands.check(state, event)
    assert refusal is not None and refusal.code == "malformed"
    assert refusal.message.startswith("malformed input: ") and "$.gpus" in refusal.message
    why = fold_item(state, input_item(state.input_seq + 1, event))
    assert why == refusal.message and state.rejections[-1] == ("req", why, "malformed")


def test_the_cycle_puts_the_code_in_the_input_rejected_decision() -> None:
    from apportion.core.cycle import decide

    state = world()
    apply(state, sub(owner="nope"))
    (rejected,) = [d for d in decide(state).decisions if isinstance(d, InputRejected)]
    assert (rejected.ref, rejected.code) == ("req", "unknown_owner")


def test_accepted_requests_become_their_events() -> None:
    state = world()
    event = sub()
    assert commands.submit(state, event) is event
    assert commands.check(state, event) is None
    c = commands.cancel(state, "pend", "dan", 5)
    assert c == WorkloadCancelled(id="cancel-pend", at_ms=5, workload="pend", actor="dan")
    h = commands.health(state, "n1", "draining", ADMIN, 5, "h1")
    assert isinstance(h, NodeHealthChanged) and h.state == "draining"
    ids = iter(["b1", "b2", "b3"])
    edits = commands.budget(
        state, ADMIN, [("ml", 1, "eve"), ("ml/x", 2, "eve")], ["ml/x"], 7, lambda: next(ids)
    )
    assert not isinstance(edits, Refusal)
    assert [(type(e).__name__, e.id, e.path) for e in edits] == [
        ("BudgetSet", "b1", "ml"),
        ("BudgetSet", "b2", "ml/x"),  # its parent is created by the edit before it
        ("BudgetRemoved", "b3", "ml/x"),
    ]
    assert "ml" not in state.budget.nodes  # checked on a copy


def test_refused_requests_give_a_refusal() -> None:
    state = world()
    assert commands.submit(state, sub(owner="llm")) == Refusal(
        "not_a_leaf", "owner 'llm' is not a leaf of the budget tree (it has children)"
    )
    assert commands.cancel(state, "ghost", ADMIN, 0) == Refusal(
        "unknown_workload", "unknown workload 'ghost'"
    )
    assert commands.cancel(state, "done", ADMIN, 0) == Refusal(
        "already_ended", "workload 'done' already ended as succeeded"
    )
    refusal = commands.cancel(state, "pend", "alice", 0)
    assert isinstance(refusal, Refusal) and refusal.code == "not_authorised"
    assert commands.budget(state, ADMIN, [], [], 0, lambda: "b") == Refusal(
        "empty_request", "nothing to change: give 'set' and/or 'remove'"
    )
    later = commands.budget(state, ADMIN, [("ml", 1, "eve")], ["ml", "ml"], 0, lambda: "b")
    assert isinstance(later, Refusal) and later.code == "unknown_budget_node"  # the 2nd removal
    refusal = commands.health(state, "n0", "healthy", ADMIN, 0, "h")
    assert isinstance(refusal, Refusal) and refusal.code == "no_change"


def test_the_submission_builder_keeps_the_events_defaults() -> None:
    minimal = {"id": "s", "at_ms": 1, "workload": "w", "owner": "o", "gpus": 1, "min_runtime_ms": 0}
    assert commands.submission(**minimal) == WorkloadSubmitted(**minimal)  # type: ignore[arg-type]
    assert commands.submit_id("w") == "submit-w" and commands.cancel_id("w") == "cancel-w"


def test_a_refusal_has_a_known_code() -> None:
    with pytest.raises(ValueError, match="unknown reason code"):
        Refusal("no_such_code", "x")
    assert str(Refusal("malformed", "words")) == "words"
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", c) and len(c) <= 64 for c in CODES)
    assert set(FOLD_CODES).isdisjoint(REQUEST_CODES) and [*FOLD_CODES, *REQUEST_CODES] == list(
        CODES
    )


def doc_codes(section: str) -> list[str]:
    """The codes of the table under the heading ``section`` of docs/reasons.md."""
    text = DOCS.read_text(encoding="utf-8")
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z0-9_]+)` \|", body, flags=re.MULTILINE)


def test_the_doc_lists_exactly_the_codes_defined() -> None:
    fold, gateway = doc_codes("The codes the fold records"), doc_codes("The gateway's own codes")
    assert fold == FOLD_CODES  # every one, once, in the order defined
    assert gateway == REQUEST_CODES


# -- schema evolution -------------------------------------------------------------


def test_an_input_rejected_without_a_code_decodes_and_encodes_as_before() -> None:
    from apportion.schemas.codec import decode_decision, encode

    old = (
        b'{"kind":"InputRejected","id":"d1","at_ms":0,"v":1,"ref":"sub/x",'
        b'"reason":"unknown owner \'c\': submit to a leaf of the budget tree"}'
    )
    decision = decode_decision(old)
    assert isinstance(decision, InputRejected) and decision.code is msgspec.UNSET
    assert encode(decision) == old
    new = msgspec.structs.replace(decision, code="unknown_owner")
    assert encode(new) == old[:-1] + b',"code":"unknown_owner"}'
    assert decode_decision(encode(new)) == new
    with pytest.raises(Exception, match="code"):
        decode_decision(old[:-1] + b',"code":"Not A Code"}')


def test_a_snapshot_without_pending_rejections_encodes_as_before_codes() -> None:
    state = world()
    assert not state.rejections
    assert b"rejection_codes" not in state.to_bytes()


def test_a_snapshot_keeps_the_codes_of_pending_rejections() -> None:
    state = world()
    apply(state, sub(owner="nope"))
    fold_item(state, malformed_item(state.input_seq + 1, 0, "m1", "invalid JSON"))
    copy = state.copy()
    assert copy.rejections == state.rejections
    assert [c for _, _, c in copy.rejections] == ["unknown_owner", "malformed"]
    assert copy.digest() == state.digest()


def test_a_snapshot_from_before_codes_still_restores_and_announces() -> None:
    from apportion.core.cycle import decide
    from apportion.core.state import StateSnapshot

    state = world()
    apply(state, sub(owner="nope"))
    snap = state.snapshot()
    old = msgspec.structs.replace(
        snap, rejection_codes=msgspec.UNSET
    )  # as an older version wrote it
    restored = State.from_bytes(msgspec.msgpack.encode(old))
    assert [(r, c) for r, _, c in restored.rejections] == [("req", msgspec.UNSET)]
    (rejected,) = [d for d in decide(restored).decisions if isinstance(d, InputRejected)]
    assert rejected.code is msgspec.UNSET and rejected.reason == state.rejections[0][1]
    assert isinstance(snap, StateSnapshot)
