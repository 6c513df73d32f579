"""The sliding usage window: exact GPU-ms over ``[t - W, t]`` from a cumulative charge function."""

from __future__ import annotations

import pytest
from apportion.core import ChargeSeries
from apportion.core.usage import MAX_LOOKBACK_MS
from hypothesis import given, settings
from hypothesis import strategies as st

DAY = 24 * 3_600_000


def series(*changes: tuple[int, int]) -> ChargeSeries:
    s = ChargeSeries()
    for at, delta in changes:
        s.change_rate(at, delta)
    return s


# one run of 4 GPUs from 100 to 300: 800 GPU-ms in all
ONE_RUN = [(100, 4), (300, -4)]
# 2 GPUs 0..10, 5 GPUs 5..10 overlap, 3 GPUs 10..20
OVERLAP = [(0, 2), (5, 3), (10, -2), (20, -3)]
# +2, +3, -2, +1 all at 10 after +2 at 0: rate 2 on [0,10), 4 on [10,20)
SAME_MS = [(0, 2), (10, 3), (10, -2), (10, 1), (20, -4)]

WINDOWS = [
    # (case, changes, now, lookback, expected GPU-ms) -- computed by hand
    ("empty", [], 1_000, 500, 0),
    ("before-first-run", ONE_RUN, 50, 1_000, 0),
    ("whole-run-inside", ONE_RUN, 300, 1_000, 4 * 200),
    ("run-still-going", ONE_RUN, 250, 1_000, 4 * 150),
    ("window-inside-run", ONE_RUN, 250, 100, 4 * 100),
    ("straddles-window-start", ONE_RUN, 350, 200, 4 * (300 - 150)),
    ("straddles-window-end", ONE_RUN, 200, 150, 4 * (200 - 100)),
    ("window-starts-at-run-end", ONE_RUN, 500, 200, 0),
    ("window-starts-at-run-start", ONE_RUN, 400, 300, 800),
    ("slid-out", ONE_RUN, 1_000, 500, 0),
    ("zero-lookback", ONE_RUN, 200, 0, 0),
    ("overlap-all", OVERLAP, 20, 100, 2 * 10 + 3 * 15),
    ("overlap-tail", OVERLAP, 20, 12, 5 * 2 + 3 * 10),
    ("overlap-mid", OVERLAP, 9, 6, 2 * 2 + 5 * 4),
    ("same-ms-all", SAME_MS, 20, 20, 2 * 10 + 4 * 10),
    ("same-ms-from-change", SAME_MS, 25, 15, 4 * 10),
    ("same-ms-across-change", SAME_MS, 15, 10, 2 * 5 + 4 * 5),
]


@pytest.mark.parametrize(
    ("changes", "now", "lookback", "expected"),
    [c[1:] for c in WINDOWS],
    ids=[c[0] for c in WINDOWS],
)
def test_window(changes, now, lookback, expected) -> None:
    assert series(*changes).window(now, lookback) == expected


def test_same_ms_changes_make_one_breakpoint() -> None:
    s = series(*SAME_MS)
    assert s.times == [0, 10, 20]
    assert s.cums == [0, 20, 60]
    assert s.rates == [2, 4, 0]
    assert s.rate == 0


def test_rate_is_current_gpus() -> None:
    s = series((0, 2), (5, 3))
    assert s.rate == 5
    assert ChargeSeries().rate == 0
    assert s.cumulative(7) == 2 * 5 + 5 * 2


def naive_window(changes: list[tuple[int, int]], now: int, lookback: int) -> int:
    """GPU-ms inside [now - lookback, now], integrating the rate ms segment by segment."""
    lo = now - lookback
    total = 0
    rate = 0
    prev = None
    for at, delta in [*changes, (now, 0)]:
        if prev is not None:
            a, b = max(prev, lo), min(at, now)
            if b > a:
                total += rate * (b - a)
        if at > now:
            break
        rate += delta
        prev = at
    return total


def test_pruning_keeps_every_reachable_window_exact() -> None:
    """2,000 rate changes over 200 days: old breakpoints go, windows stay exact."""
    step = 200 * DAY // 2_000
    changes = [(i * step, (3 if i % 2 == 0 else -3) + (i % 5 == 0)) for i in range(2_000)]
    s = ChargeSeries()
    pruned = False
    for n, (at, delta) in enumerate(changes, 1):
        s.change_rate(at, delta)
        pruned = pruned or len(s.times) < n
        now = at
        for lookback in (1, DAY, 7 * DAY, MAX_LOOKBACK_MS):
            if n % 97 == 0 or n == len(changes):
                assert s.window(now, lookback) == naive_window(changes[:n], now, lookback), (
                    n,
                    lookback,
                )
    assert pruned
    # a prune halves the list once its older half is out of reach: at most twice the
    # breakpoints of the longest lookback (90 days = 900 here) are kept
    assert len(s.times) <= 2 * (MAX_LOOKBACK_MS // step) + 2
    assert (
        s.times[0] <= changes[-1][0] - MAX_LOOKBACK_MS
    )  # the breakpoint in force at the horizon stays
    # the cumulative total survives pruning
    assert s.cumulative(changes[-1][0]) == naive_window(changes, changes[-1][0], 10**15)
    # and reading later, with the rate still running
    later = changes[-1][0] + DAY
    assert s.window(later, 7 * DAY) == naive_window(changes, later, 7 * DAY)


def test_fold_usage_follows_policy_lookback(scenario) -> None:
    """A 2-GPU allocated run from 1 h to 3 h; read at 4 h with a 2 h and a 7 d window."""
    h = 3_600_000
    s = (
        scenario.tree("t")
        .node("n0")
        .at(h)
        .submit("w", "t", gpus=2)
        .place("w", "n0")
        .at(3 * h)
        .finish("w")
        .tick(4 * h)
    )
    assert s.state.usage("t") == 2 * 2 * h
    s.policy(lookback_ms=2 * h, max_min_runtime_ms=h)
    assert s.state.usage("t") == 2 * h  # [2 h, 4 h] holds 1 h of the run
    assert s.state.usage("") == 2 * h


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(-3, 3)), min_size=0, max_size=12),
    st.integers(-20, 700),
    st.integers(0, 400),
)
def test_window_is_the_difference_of_cumulatives(
    steps: list[tuple[int, int]], now: int, lookback: int
) -> None:
    """``window`` (which spells ``cumulative`` inline) at any time, before the first
    breakpoint, between breakpoints or after the last, for any lookback."""
    changes, at = [], 0
    for gap, delta in steps:
        at += gap
        changes.append((at, delta))
    s = series(*changes)
    assert s.window(now, lookback) == s.cumulative(now) - s.cumulative(now - lookback)
