"""Several clusters, one budget tree (core/rules/federation.py): a peer's usage
summaries fold exactly once, late ones count at their own time, and a cluster
with peers reports every interval of its own charges, none lost or counted twice."""

from __future__ import annotations

import random

import msgspec
import pytest
from apportion.core.cycle import decide, step
from apportion.core.fold import apply, fold
from apportion.core.history import fold_item
from apportion.core.ordering import FairShareView, committed_charges
from apportion.core.rules.federation import heard_until
from apportion.core.state import CorruptHistory, State
from apportion.schemas.events import (
    HOUR_MS,
    MINUTE_MS,
    ClockTicked,
    Event,
    LeafCharge,
    UsageReported,
    UsageSummary,
)
from apportion.schemas.history import InputItem
from core_builders import ADMIN, Scenario
from hypothesis import given, settings
from hypothesis import strategies as st

S = 5 * MINUTE_MS


def summary(
    start: int,
    charges: tuple[tuple[str, int], ...] = (),
    *,
    source: str = "east",
    end: int | None = None,
    actor: str | None = None,
    at: int = 0,
    id: str | None = None,
) -> UsageSummary:
    return UsageSummary(
        id=id or f"{source}-{start}",
        at_ms=at,
        source=source,
        start_ms=start,
        end_ms=start + S if end is None else end,
        charges=tuple(LeafCharge(p, g) for p, g in charges),
        actor=f"federation:{source}" if actor is None else actor,
    )


def west(peers: tuple[str, ...] = ("east",)) -> Scenario:
    """Cluster ``west`` of a federation: teams ``a`` (a/x, a/y) and ``b`` (b/z), weight 1
    each; two 8-GPU hosts."""
    s = Scenario()
    s.tree("a", "a/x", "a/y", "b", "b/z").nodes("n", 2)
    s.policy(cluster="west", peers=peers, lookback_ms=HOUR_MS * 24)
    return s


def test_a_summary_charges_the_leaf_and_every_ancestor_at_its_interval_end() -> None:
    s = west()
    s.at(10 * MINUTE_MS).hear(summary(0, (("a/x", 1000), ("b/z", 10))))
    st_ = s.state
    assert [st_.usage(p) for p in ("", "a", "a/x", "a/y", "b", "b/z")] == [
        1010,
        1000,
        1000,
        0,
        10,
        10,
    ]
    assert st_.budget.nodes["a"].series.window(st_.now_ms, st_.policy.lookback_ms) == 0
    assert heard_until(st_, "east") == S
    view = FairShareView(st_)
    assert view.ratio("a") > view.ratio("b")  # a's usage on east counts here


def test_a_repeat_or_an_overlap_is_refused_and_changes_nothing() -> None:
    s = west()
    s.at(S).hear(summary(0, (("a/x", 1000),)))
    s.rejects("a repeat of", code="usage_counted").hear(summary(0, (("a/x", 1000),), id="again"))
    s.rejects("overlaps", code="usage_counted").hear(
        summary(S // 2, (("a/x", 5),), id="half", end=S + S // 2)
    )
    s.at(2 * S).hear(summary(S, (("a/x", 7),)))  # the next interval is fine
    assert s.state.peer_intervals == {"east": [(0, 2 * S)]}
    assert s.state.usage("a/x") == 1007


def test_who_may_send_a_summary() -> None:
    s = west()
    s.rejects("may not report usage", code="not_authorised").apply(
        summary(0, actor="federation:north")
    )
    s.rejects("may not report usage", code="not_authorised").hear(summary(0, actor="alice"))
    s.rejects("which is this cluster", code="own_usage").hear(summary(0, source="west"))
    s.hear(summary(0, actor=ADMIN))  # an operator may


def test_the_subject_names_the_source_and_gives_the_actor() -> None:
    s = west()
    state = s.state
    base = "apportion.west.inputs.UsageSummary"

    def on(event: UsageSummary, subject: str) -> str | None:
        item = InputItem(
            seq=state.input_seq + 1, at_ms=event.at_ms, ref=event.id, event=event, subject=subject
        )
        before = len(state.rejections)
        fold_item(state, item)
        return state.rejections[-1][2] if len(state.rejections) > before else None  # type: ignore[return-value]

    assert on(summary(0, actor="anyone"), f"{base}.east") is None  # actor from the subject
    assert on(summary(S, source="north", actor="federation:north"), f"{base}.east") == (
        "wrong_subject"
    )
    assert on(summary(S, actor="federation:east"), base) is None  # its own kind's subject
    assert on(summary(2 * S), "apportion.west.inputs.ClockTicked") == "wrong_subject"


def test_a_summary_sent_long_before_it_is_stored_counts_on_its_source_subject() -> None:
    """After an hour cut off, a peer's summaries arrive by stream sourcing stamped
    with the time they were sent: on the source's subject (which only sourcing
    writes) they count; on the kind's own subject (an operator's) such a summary is
    refused as stale, like any input sent long before it was stored."""
    s = west()
    state = s.state
    base = "apportion.west.inputs.UsageSummary"
    hour = 60 * MINUTE_MS

    def stored(event: UsageSummary, subject: str, at: int, sent: int) -> str | None:
        item = InputItem(
            seq=state.input_seq + 1,
            at_ms=at,
            ref=event.id,
            event=msgspec.structs.replace(event, at_ms=at),
            subject=subject,
            sent_ms=sent,
        )
        before = len(state.rejections)
        fold_item(state, item)
        return state.rejections[-1][2] if len(state.rejections) > before else None  # type: ignore[return-value]

    late = summary(0, (("a/x", 5_000),))
    assert stored(late, base, hour, S + 1) == "stale_input"
    assert stored(late, f"{base}.east", hour + 1, S + 1) is None
    assert state.budget.nodes["a/x"].peer is not None


def test_an_unknown_leaf_is_charged_to_its_nearest_node_here() -> None:
    s = west()
    s.at(S).hear(summary(0, (("a/gone", 40), ("c/new/leaf", 2))))
    assert s.state.usage("a") == 40 and s.state.usage("") == 42
    assert s.state.usage("a/x") == s.state.usage("a/y") == 0


@pytest.mark.parametrize(
    ("charges", "end", "words"),
    [
        ((("a/x", 1), ("a/x", 2)), S, "named twice"),
        ((("a/x", 1),), 0, "non-empty"),
        ((("a/x", 1),), 2 * HOUR_MS, "at most 1 h"),
        ((("a/x", S * (1 << 20) + 1),), S, "more than the interval can hold"),
        ((("a/x", -1),), S, "negative charge"),
    ],
)
def test_a_summary_that_cannot_be_exact_is_refused(
    charges: tuple[tuple[str, int], ...], end: int, words: str
) -> None:
    west().rejects(words, code="bad_usage").hear(summary(0, charges, end=end))


def test_a_late_summary_counts_where_it_was_used() -> None:
    """After a partition, the ratios are those of a history that heard every
    summary on time: each charge steps up at its interval's end, not at arrival."""
    on_time, late = west(), west()
    intervals = [(k * S, (("a/x", 100 * (k + 1)), ("b/z", 7 * k))) for k in range(12)]
    for start, charges in intervals:
        on_time.at(start + S + 5_000).hear(summary(start, charges))
    on_time.at(2 * HOUR_MS).tick()
    # partitioned for the first hour: everything arrives at 2 h, newest first
    late.at(2 * HOUR_MS)
    for start, charges in reversed(intervals):
        late.hear(summary(start, charges))
    for s in (on_time, late):
        s.at(2 * HOUR_MS + 30 * MINUTE_MS).tick()
    a, b = on_time.state, late.state
    for path in a.budget.nodes:
        assert a.usage(path) == b.usage(path), path
        assert a.budget.nodes[path].peer == b.budget.nodes[path].peer, path
    assert FairShareView(a).ratio("a") == FairShareView(b).ratio("a")
    # and the window slides over them exactly: one hour later the first intervals leave
    for s in (on_time, late):
        s.at(24 * HOUR_MS + 30 * MINUTE_MS).tick()
    assert a.usage("a/x") == b.usage("a/x") == sum(100 * (k + 1) for k in range(6, 12))


def test_the_peer_state_survives_a_snapshot() -> None:
    s = west()
    s.at(S).hear(summary(0, (("a/x", 5),)))
    s.at(3 * S).hear(summary(2 * S, (("b/z", 6),)))
    again = State.from_bytes(s.state.to_bytes())
    assert again.digest() == s.state.digest()
    assert again.peer_intervals == {"east": [(0, S), (2 * S, 3 * S)]}
    assert again.reported_until_ms == s.state.reported_until_ms == 0
    apply(again, summary(S, (("a/x", 1),), at=3 * S))
    assert again.peer_intervals == {"east": [(0, 3 * S)]}


def test_a_single_cluster_encodes_and_decides_as_before() -> None:
    s = Scenario()
    s.tree("a", "a/x").nodes("n", 1).policy()
    assert s.state.reported_until_ms is None
    assert b"peer" not in s.state.to_bytes() and b"reported" not in s.state.to_bytes()
    s.at(HOUR_MS).tick()
    assert decide(s.state).next_wakeup_ms is None


# -- reporting ------------------------------------------------------------------


def run_until(s: Scenario, t_ms: int) -> list[UsageReported]:
    """Tick to ``t_ms`` at each wake-up, folding every cycle; the usage reports made."""
    reports: list[UsageReported] = []
    while True:
        result = step(s.state)
        reports += [d for d in result.decisions if isinstance(d, UsageReported)]
        wake = result.next_wakeup_ms
        if wake is None or wake > t_ms:
            return reports
        s.at(wake).tick()


def test_a_cluster_with_peers_reports_every_interval_exactly() -> None:
    s = west()
    s.at(2 * MINUTE_MS).submit("w1", "a/x", gpus=8, min_runtime_ms=HOUR_MS)
    s.submit("w2", "b/z", gpus=4, min_runtime_ms=30 * MINUTE_MS)
    reports = run_until(s, 17 * MINUTE_MS)
    s.at(17 * MINUTE_MS).finish("w2")
    s.budget("a/old").at(17 * MINUTE_MS)
    reports += run_until(s, 40 * MINUTE_MS)
    assert [(r.start_ms, r.end_ms) for r in reports] == [(k * S, (k + 1) * S) for k in range(8)]
    assert all(r.cluster == "west" for r in reports)
    by_interval = [{c.leaf: c.gpu_ms for c in r.charges} for r in reports]
    assert by_interval[0] == {"a/x": 8 * 3 * MINUTE_MS, "b/z": 4 * 3 * MINUTE_MS}
    assert by_interval[3] == {"a/x": 8 * S, "b/z": 4 * 2 * MINUTE_MS}
    assert by_interval[4] == {"a/x": 8 * S}
    root = s.state.budget.root.series
    assert sum(c.gpu_ms for r in reports for c in r.charges) == root.cumulative(8 * S)


def test_a_removed_leaf_is_reported_at_its_parent() -> None:
    s = west()
    s.budget("a/tmp").submit("w", "a/tmp", gpus=2).place("w", "n0")
    s.at(2 * MINUTE_MS).finish("w").remove("a/tmp")
    (report,) = run_until(s, S)
    assert report.charges == (LeafCharge("a", 2 * 2 * MINUTE_MS),)


def test_reporting_starts_where_the_policy_names_a_peer_and_stops_without() -> None:
    s = Scenario()
    s.tree("a", "a/x").nodes("n", 1).at(7 * MINUTE_MS)
    s.policy(cluster="west", peers=("west",))  # only itself: no peer
    assert s.state.reported_until_ms is None
    s.policy(cluster="west", peers=("west", "east"), usage_summary_ms=2 * MINUTE_MS)
    assert s.state.reported_until_ms == 6 * MINUTE_MS
    assert decide(s.state).next_wakeup_ms == 8 * MINUTE_MS
    s.policy()
    assert s.state.reported_until_ms is None


def test_a_report_out_of_turn_is_a_corrupt_history() -> None:
    s = west()
    s.at(2 * S).tick()
    bad = UsageReported(id="d", at_ms=2 * S, cluster="west", start_ms=S, end_ms=2 * S)
    with pytest.raises(CorruptHistory):
        apply(s.state.copy(), bad)
    early = UsageReported(id="d", at_ms=2 * S, cluster="west", start_ms=0, end_ms=3 * S)
    with pytest.raises(CorruptHistory):
        apply(s.state.copy(), early)


# -- properties -------------------------------------------------------------------

intervals = st.lists(
    st.tuples(
        st.sampled_from(["east", "north"]),
        st.integers(0, 30),
        st.lists(
            st.tuples(st.sampled_from(["a/x", "a/y", "b/z", "c/gone"]), st.integers(0, 10**6)),
            max_size=3,
            unique_by=lambda c: c[0],
        ),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(intervals, st.randoms(use_true_random=False))
def test_summaries_fold_once_in_any_order(
    raw: list[tuple[str, int, list[tuple[str, int]]]], rnd: random.Random
) -> None:
    """Delivered in any order, each as often as you like: every interval counts once,
    the per-node totals are the sums of the distinct intervals, and the state is
    the same as for one delivery each in order; folding the whole history again
    from scratch gives the same digest."""
    events = [summary(k * S, tuple(ch), source=src) for src, k, ch in raw]
    first: dict[tuple[str, int], UsageSummary] = {}
    for e in events:
        first.setdefault((e.source, e.start_ms), e)
    delivered = list(first.values()) * 2  # a source says one thing of each interval
    rnd.shuffle(delivered)
    t = 40 * S

    def history(items: list[UsageSummary]) -> list[Event]:
        arrived = [msgspec.structs.replace(e, at_ms=t) for e in items]
        return [*west().events, *arrived, ClockTicked(id="end", at_ms=t)]

    shuffled = fold(history(delivered))
    once = fold(history(sorted(first.values(), key=lambda e: (e.source, e.start_ms))))
    for path, node in once.budget.nodes.items():
        assert shuffled.budget.nodes[path].peer == node.peer, path
        assert shuffled.usage(path) == once.usage(path)
    assert shuffled.peer_intervals == once.peer_intervals
    expect: dict[str, int] = {}
    for e in first.values():
        for c in e.charges:
            leaf = "c" if c.leaf == "c/gone" else c.leaf
            leaf = "" if leaf == "c" else leaf  # no "c" in the tree: the root takes it
            expect[leaf] = expect.get(leaf, 0) + c.gpu_ms
    assert once.usage("") == sum(expect.values())
    for leaf in ("a/x", "a/y", "b/z"):
        assert once.usage(leaf) == expect.get(leaf, 0)
    again = fold(history(delivered))
    assert again.digest() == shuffled.digest()


def test_a_peer_commitment_counts_until_a_later_interval_replaces_it() -> None:
    s = west()
    s.at(S).hear(msgspec.structs.replace(summary(0), committed=(LeafCharge("a/x", 8 * HOUR_MS),)))
    assert committed_charges(s.state) == {"a": 8 * HOUR_MS, "a/x": 8 * HOUR_MS}
    s.at(3 * S).hear(msgspec.structs.replace(summary(2 * S), committed=()))
    assert committed_charges(s.state) == {}
    s.hear(msgspec.structs.replace(summary(S), committed=(LeafCharge("b/z", 5),)))  # older
    assert committed_charges(s.state) == {}
    again = State.from_bytes(s.state.to_bytes())
    assert again.peer_committed == s.state.peer_committed


def test_a_report_carries_the_commitments_of_its_time() -> None:
    s = west()
    s.submit("w", "a/x", gpus=8, min_runtime_ms=HOUR_MS).place("w", "n0")
    (report,) = run_until(s, S)
    assert report.committed == (LeafCharge("a/x", 8 * (HOUR_MS - S)),)
