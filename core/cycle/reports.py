"""Step 0b: a cluster whose policy names peers reports every usage interval its
time has reached the end of, in order (``UsageReported``;
:mod:`apportion.core.rules.federation`). The reports read only the cluster's
own charge series, which nothing in the cycle changes, so they come first and
change no other decision."""

from __future__ import annotations

from typing import TYPE_CHECKING

from apportion.schemas.events import UsageReported

from ..rules.federation import due_intervals, interval_charges, leaf_commitments

if TYPE_CHECKING:
    from .scratch import Scratch


def report_usage(s: Scratch) -> None:
    """Step 0b (module docstring)."""
    state = s.state
    due = due_intervals(state, s.t)
    committed = leaf_commitments(state) if due else ()
    for start, end in due:
        s.emit(
            UsageReported,
            cluster=state.policy.cluster_name,
            start_ms=start,
            end_ms=end,
            charges=interval_charges(state, start, end),
            committed=committed,
        )
