"""The fold binds an input to the subject it was stored on (core/rules/subjects.py):
the kind its subject names, a host agent's own host, and the actor ``agent:<host>``
taken from the subject, never from the payload. Without a subject (simulations,
older files) nothing changes."""

from __future__ import annotations

import msgspec
import pytest
from apportion.core.history import fold_item
from apportion.core.rules.subjects import parse_input_subject, subject_refusal
from apportion.core.state import State
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    Input,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    WorkloadFinished,
    WorkloadStarted,
)
from apportion.schemas.history import InputItem
from test_commands import world

C = "apportion.demo.inputs"


def fold_on(state: State, event: Input, subject: str | None) -> tuple[str | None, str | None]:
    """Fold ``event`` stored on ``subject`` as the next input: (reason, code) if refused."""
    item = InputItem(
        seq=state.input_seq + 1, at_ms=event.at_ms, ref=event.id, event=event, subject=subject
    )
    before = len(state.rejections)
    reason = fold_item(state, item)
    if len(state.rejections) == before:
        return None, None
    return reason, state.rejections[-1][2]


def test_subjects_parse() -> None:
    assert parse_input_subject(f"{C}.BudgetSet") == ("BudgetSet", None)
    assert parse_input_subject(f"{C}.WorkloadFinished.h1") == ("WorkloadFinished", "h1")
    assert parse_input_subject(f"{C}.WorkloadFinished.node.a.b") == ("WorkloadFinished", "node.a.b")
    assert parse_input_subject("apportion.demo.decisions") is None
    assert subject_refusal(f"{C}.BudgetSet", "BudgetSet") is None
    assert subject_refusal(f"{C}.raw", "BudgetSet") is not None


def test_a_kind_on_the_subject_of_another_is_refused_and_changes_nothing() -> None:
    """The attack of issue 24, item 2: a PolicySet (operators += mallory) stored on the
    WorkloadCancelled subject, which the gateway's credential may publish."""
    state = world()
    policy = PolicySet(id="p", at_ms=1, actor="admin", operators=("mallory",))
    before, seq = state.policy, state.input_seq
    reason, code = fold_on(state, policy, f"{C}.WorkloadCancelled")
    assert code == "wrong_subject" and "PolicySet stored on the subject of WorkloadCancelled" in (
        reason or ""
    )
    assert state.policy == before and state.input_seq == seq + 1
    # on its own subject it applies
    assert fold_on(state, policy, f"{C}.PolicySet") == (None, None)
    assert state.policy.operators == ("mallory",)


@pytest.mark.parametrize(
    "event",
    [
        BudgetSet(id="b", at_ms=1, path="llm/x", weight=1, owner="x", actor="admin"),
        ClockTicked(id="t", at_ms=1),
        PolicySet(id="p", at_ms=1, actor="admin"),
    ],
)
def test_an_agent_may_send_only_the_agent_kinds(event: Input) -> None:
    state = world()
    kind = type(event).__name__
    _, code = fold_on(state, event, f"{C}.{kind}.n0")
    assert code == "wrong_subject"


def test_an_agent_speaks_for_its_own_host_only() -> None:
    state = world()  # "run" runs on n0
    # the end of a run on another host, even stated as an operator (admin): refused
    finish = WorkloadFinished(id="f", at_ms=1, workload="run", actor="admin")
    reason, code = fold_on(state, finish, f"{C}.WorkloadFinished.n1")
    assert code == "wrong_host" and "'n1'" in (reason or "")
    assert "run" in state.running
    # health of another node
    down = NodeHealthChanged(id="d", at_ms=1, node="n0", state="down", actor="agent:n0")
    _, code = fold_on(state, down, f"{C}.NodeHealthChanged.n1")
    assert code == "wrong_host" and state.nodes["n0"].health == "healthy"
    register = NodeRegistered(id="r", at_ms=1, node="n7", gpus=8, gpu_type="a100", actor="admin")
    assert fold_on(state, register, f"{C}.NodeRegistered.n1")[1] == "wrong_host"
    started = WorkloadStarted(id="s", at_ms=1, workload="run", attempt=1, node="n0")
    assert fold_on(state, started, f"{C}.WorkloadStarted.n1")[1] == "wrong_host"
    # from its own host: the actor is the subject's, whatever the payload says
    assert fold_on(state, started, f"{C}.WorkloadStarted.n0") == (None, None)
    assert fold_on(state, finish, f"{C}.WorkloadFinished.n0") == (None, None)
    assert state.ended["run"] == "succeeded"


def test_the_actor_of_an_agent_input_comes_from_the_subject() -> None:
    """A payload that names an operator does not make the agent one: an agent may
    not drain a host by saying it is ``admin`` ... of another host; of its own it may."""
    state = world()
    drain = NodeHealthChanged(id="d", at_ms=1, node="n1", state="draining", actor="admin")
    assert fold_on(state, drain, f"{C}.NodeHealthChanged.n1") == (None, None)
    assert state.nodes["n1"].health == "draining"


def test_without_a_subject_nothing_changes() -> None:
    state, other = world(), world()
    finish = WorkloadFinished(id="f", at_ms=1, workload="run", actor="admin")
    assert fold_on(state, finish, None) == (None, None)
    other_finish = msgspec.structs.replace(finish)
    assert fold_on(other, other_finish, f"{C}.WorkloadFinished") == (None, None)
    assert state.to_bytes() == other.to_bytes()


def _history() -> list[InputItem]:
    from apportion.schemas.events import BudgetSet as B

    return [
        InputItem(
            seq=1,
            at_ms=0,
            ref="root",
            event=B(id="root", at_ms=0, path="", weight=1, owner="admin", actor="admin"),
            subject=f"{C}.BudgetSet",
        ),
        InputItem(
            seq=2,
            at_ms=0,
            ref="p",
            event=PolicySet(id="p", at_ms=0, actor="admin", operators=("mallory",)),
            subject=f"{C}.WorkloadCancelled",
        ),
        InputItem(seq=3, at_ms=0, ref="t", event=ClockTicked(id="t", at_ms=0)),
    ]


def test_a_log_file_keeps_the_subjects_and_folds_the_same(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The JSON-lines log keeps each input's subject, so replay and audit of a file
    refuse what the live fold refused (a file without subjects folds as before)."""
    from apportion.core.history import fold_history
    from apportion.replay.eventlog import Header, LogWriter, read_file

    items = _history()
    writer = LogWriter(tmp_path / "log.jsonl", Header())
    for item in items:
        writer.add(item)
    writer.close()
    back = list(read_file(tmp_path / "log.jsonl"))
    assert [i.subject for i in back] == [i.subject for i in items]  # type: ignore[union-attr]
    state = fold_history(back)
    assert state.policy.operators == () and state.rejections[0][2] == "wrong_subject"


def test_a_projection_keeps_the_subjects_and_folds_the_same(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import duckdb
    from apportion.core.history import fold_history
    from apportion.replay.eventlog import read_duckdb
    from apportion.replay.projection import Projection

    items = _history()
    path = tmp_path / "p.duckdb"
    projection = Projection(duckdb.connect(str(path)))
    state = fold_history(items, observer=projection)
    projection.commit(state)
    projection.con.close()
    back = list(read_duckdb(path))
    assert [i.subject for i in back] == [i.subject for i in items]  # type: ignore[union-attr]
    again = fold_history(back)
    assert again.digest() == state.digest() and again.rejections[0][2] == "wrong_subject"
