"""An input is folded once (core/rules/identity.py), and only an operator's record of
lost inputs bridges a gap (core/history.py, ``bridge_refusal``): the fold decides
both, so the scheduler, the followers, ``replay`` and ``audit`` agree.

The attacks (issue 24): a writer makes the server append the bytes of an older
stored input again (a direct get whose reply is its own input subject); after
JetStream's 120 s duplicate window only the fold can tell the copy from a new
input. And an ``InputsLost`` from someone who is not an operator would move
the history over inputs it never folded."""

from __future__ import annotations

import msgspec
import pytest
from apportion.core.history import LossNotAccepted, fold_item
from apportion.core.rules.identity import WINDOW_MS
from apportion.core.state import State
from apportion.schemas.events import (
    MINUTE_MS,
    BudgetSet,
    ClockTicked,
    Input,
    InputsLost,
    PolicySet,
)
from apportion.schemas.history import InputItem, input_item

C = "apportion.demo.inputs"
T0 = 1_800_000_000_000
"""An epoch time in ms (2027): inputs are stored from then on."""


def stored(state: State, event: Input, at_ms: int, sent_ms: int | None) -> InputItem:
    """``event`` as the next input, stored at ``at_ms`` on its kind's subject, sent at
    ``sent_ms`` (as a reader of the live stream gives it: the payload's ``at_ms``)."""
    return InputItem(
        seq=state.input_seq + 1,
        at_ms=at_ms,
        ref=event.id,
        event=msgspec.structs.replace(event, at_ms=at_ms),
        subject=f"{C}.{type(event).__name__}",
        sent_ms=sent_ms,
    )


def fold(state: State, item: InputItem) -> str | None:
    """Fold ``item``: the code it was refused with, or ``None``."""
    before = len(state.rejections)
    fold_item(state, item)
    return state.rejections[-1][2] if len(state.rejections) > before else None  # type: ignore[return-value]


ROOT = BudgetSet(id="b-root", at_ms=0, path="", weight=1, owner="admin", actor="admin")
TEAM = BudgetSet(id="b-llm", at_ms=0, path="llm", weight=3, owner="alice", actor="admin")
EDIT = BudgetSet(id="b-llm-2", at_ms=0, path="llm", weight=9, owner="alice", actor="admin")


def cluster() -> State:
    state = State()
    for i, e in enumerate((ROOT, TEAM)):
        assert fold(state, stored(state, e, T0 + i, T0 + i)) is None
    return state


def test_a_copy_of_an_input_is_refused_inside_the_window_and_after_it() -> None:
    """The admin's edit, then a copy of the first version appended again: inside the
    window the id is remembered (``duplicate_input``); after it the copy was sent too
    long before it was stored (``stale_input``). Either way the later edit stands."""
    state = cluster()
    assert fold(state, stored(state, EDIT, T0 + 10, T0 + 10)) is None
    assert state.budget.nodes["llm"].weight == 9
    for after in (3 * MINUTE_MS, WINDOW_MS, WINDOW_MS + 2, 30 * 24 * 60 * MINUTE_MS):
        code = fold(state, stored(state, TEAM, T0 + after, T0 + 1))  # the same bytes
        assert code == ("duplicate_input" if after <= WINDOW_MS else "stale_input"), after
        assert state.budget.nodes["llm"].weight == 9
    assert "b-llm" not in state.input_ids  # forgotten once its window passed


def test_a_new_input_is_accepted_and_memory_is_bounded_by_the_window() -> None:
    state = cluster()
    for k in range(200):  # one input a minute: at most a window's worth remembered
        at = T0 + 100 + k * MINUTE_MS
        assert fold(state, stored(state, ClockTicked(id=f"t{k}", at_ms=0), at, at - 50)) is None
        # what is remembered: the inputs sent within the window before this one
        assert all(until >= at for until in state.input_ids.values())
        assert len(state.input_ids) <= WINDOW_MS // MINUTE_MS + 3
    # a writer's clock a little behind or ahead is fine; a retry re-stamps (same id)
    at = state.now_ms + 1
    assert fold(state, stored(state, ClockTicked(id="late", at_ms=0), at, at - 60_000)) is None
    assert fold(state, stored(state, ClockTicked(id="early", at_ms=0), at, at + 60_000)) is None


def test_identity_survives_a_snapshot_and_replays_exactly() -> None:
    state = cluster()
    restored = State.from_bytes(state.to_bytes())
    assert restored.input_ids == state.input_ids and restored.digest() == state.digest()
    assert fold(restored, stored(restored, TEAM, T0 + 5, T0 + 1)) == "duplicate_input"
    assert fold(state, stored(state, TEAM, T0 + 5, T0 + 1)) == "duplicate_input"
    assert restored.digest() == state.digest()


def test_a_history_without_sending_times_folds_as_before() -> None:
    """Simulations and files written before: no ``sent_ms``, nothing remembered."""
    state = State()
    for i, e in enumerate((ROOT, TEAM, TEAM)):
        fold_item(state, input_item(i + 1, msgspec.structs.replace(e, at_ms=i)))
    assert state.input_ids == {} and state.budget.nodes["llm"].weight == 3


# -- a gap bridged only by an operator ------------------------------------------------


def loss(actor: str, first: int, through: int, subject: str = f"{C}.InputsLost") -> InputItem:
    """An acceptance of inputs ``first`` .. ``through`` as lost, placed at its gap."""
    e = InputsLost(id=f"lost-{actor}", at_ms=T0 + 50, first=first, through=through, actor=actor)
    return InputItem(seq=through, at_ms=T0 + 50, ref=e.id, event=e, subject=subject)


@pytest.mark.parametrize(
    ("actor", "subject", "code"),
    [
        ("mallory", f"{C}.InputsLost", "not_authorised"),
        ("", f"{C}.InputsLost", "not_authorised"),
        ("admin", f"{C}.WorkloadCancelled", "wrong_subject"),
        ("admin", f"{C}.InputsLost.h1", "wrong_subject"),
    ],
)
def test_a_gap_is_not_bridged_by_a_non_operator(actor: str, subject: str, code: str) -> None:
    state = cluster()
    before = state.to_bytes()
    with pytest.raises(LossNotAccepted) as raised:
        fold_item(state, loss(actor, 3, 5, subject))
    assert raised.value.refusal.code == code
    assert state.to_bytes() == before  # the history stays stopped at the gap


def test_an_operator_bridges_a_gap_the_root_owner_or_one_the_policy_names() -> None:
    state = cluster()
    fold_item(state, loss("admin", 3, 5))
    assert state.input_seq == 5
    policy = PolicySet(id="p", at_ms=0, actor="admin", operators=("olga",))
    assert fold(state, stored(state, policy, T0 + 60, T0 + 60)) is None
    fold_item(state, loss("olga", 7, 9))
    assert state.input_seq == 9
    # at its own position, a non-operator's record is refused as before
    own = InputsLost(id="own", at_ms=0, first=1, through=2, actor="mallory")
    assert fold(state, stored(state, own, T0 + 70, T0 + 70)) == "not_authorised"


# -- replay enforces it too ---------------------------------------------------------


def test_the_file_and_the_projection_keep_when_each_input_was_sent(tmp_path) -> None:
    """``replay``/``audit`` of a JSON-lines log or a DuckDB projection refuse the copy
    as the live fold did: ``sent_ms`` is part of the history item they read."""
    import duckdb
    from apportion.core.history import fold_history
    from apportion.replay.eventlog import Header, read_duckdb, read_file, write_log
    from apportion.replay.projection import Projection

    state = State()
    items = []
    for event, at, sent in ((ROOT, T0, T0), (TEAM, T0 + 1, T0 + 1), (EDIT, T0 + 9, T0 + 9)):
        items.append(stored(state, event, at, sent))
        fold_item(state, items[-1])
    items.append(stored(state, TEAM, T0 + 20 * MINUTE_MS, T0 + 1))  # the copy
    assert fold(state, items[-1]) == "stale_input"
    path = tmp_path / "h.jsonl"
    write_log(path, Header(source="test"), items, state.digest())
    con = duckdb.connect(str(tmp_path / "p.duckdb"))
    projection = Projection(con, snapshot=False)
    projected = fold_history(items, observer=projection)
    projection.commit(projected)
    con.close()
    for log in (read_file(path), read_duckdb(tmp_path / "p.duckdb")):
        again = list(log)
        assert [i.sent_ms for i in again] == [i.sent_ms for i in items]  # type: ignore[union-attr]
        replayed = fold_history(again)
        assert replayed.digest() == state.digest() and replayed.rejections[-1][2] == "stale_input"


def on_tree(item: InputItem) -> InputItem:
    """``item`` as the tree's source stores it: ``<Kind>.tree`` (docs/federation.md)."""
    assert item.subject is not None
    return msgspec.structs.replace(item, subject=f"{item.subject}.tree")


def test_a_tree_edit_arriving_after_a_long_cut_is_folded_once() -> None:
    """A budget edit made on the federation's tree while this cluster was cut off
    from the hub for an hour: stream sourcing stores it when the link returns, sent
    an hour before. On the tree's subject it is folded (no writer re-appended it);
    the same bytes on the kind's own subject are refused as stale; a second copy
    from the source is a duplicate for the window after it was folded."""
    hour = 60 * MINUTE_MS
    state = cluster()
    stale = stored(state, EDIT, T0 + hour, T0 + 10)
    assert fold(state, stale) == "stale_input"
    assert state.budget.nodes["llm"].weight == 3
    assert fold(state, on_tree(stored(state, EDIT, T0 + hour + 1, T0 + 10))) is None
    assert state.budget.nodes["llm"].weight == 9
    for after in (1, WINDOW_MS):
        again = on_tree(stored(state, EDIT, T0 + hour + 1 + after, T0 + 10))
        assert fold(state, again) == "duplicate_input", after
    # only the tree's kinds may come on a tree subject
    policy = PolicySet(id="p-tree", at_ms=0, actor="admin")
    assert fold(state, on_tree(stored(state, policy, T0 + 2 * hour, T0 + 2 * hour))) == (
        "wrong_subject"
    )
