"""Several clusters, one budget tree (docs/semantics.md, "Several clusters, one
budget tree"): what a cluster reports of its own usage, and whether a peer's
usage summary may be folded. One place for both sides, used by the fold, the
cycle and the read models.

**Reporting.** A cluster whose policy names a peer reports consecutive
intervals ``[start, end)`` of ``usage_summary_ms`` (aligned to multiples of it)
from the moment the policy first named a peer; each interval is reported once
time has reached its end, every one in turn, an idle one with no charges. A
charge is a node's own part of its subtree's charge in the interval (its
series' growth minus its children's): for a leaf all of it; an inner node has
one only from a child removed meanwhile (or the time it was a leaf). The
charges of an interval therefore add up to exactly the root's charge in it,
and consecutive intervals to the root's charge over their union: nothing
counted twice or lost. Only the cluster's own charge series is read, never its
peers' usage (which would count it again on every hop).

**Receiving.** A summary is keyed by ``(source, start_ms)``; the intervals
folded from each source are kept merged, so a repeat or an overlap is refused
(``usage_counted``) whatever order summaries arrive in, and a gap stays
visible as "not heard" until its summary arrives. Each charge goes to the
deepest node of its path that this tree has (a node removed here, or not
created yet, is charged to its nearest ancestor: the totals above it stay
exact) and to every ancestor, as a step at the interval's end
(:class:`~apportion.core.usage.PeerSeries`).
"""

from __future__ import annotations

from bisect import bisect_left

from apportion.schemas import reasons as R
from apportion.schemas.events import LeafCharge, UsageReported, UsageSummary
from apportion.schemas.reasons import Refusal

from ..budget import ancestors_of, path_error
from ..state import State
from ..usage import MAX_LOOKBACK_MS, PeerSeries
from .authority import is_operator

FEDERATION_PREFIX = "federation:"
"""The identity a peer cluster's usage summaries are sent as: this prefix and its name."""

MIN_SUMMARY_MS = 10_000
MAX_SUMMARY_MS = 3_600_000
"""Bounds of ``usage_summary_ms`` (a policy's) and of one summary's interval."""

MAX_FEDERATION_GPUS = 1 << 20
"""A charge above ``(end - start) * MAX_FEDERATION_GPUS`` GPU-ms is refused."""


def federation_of(cluster: str) -> str:
    """The identity of ``cluster``'s usage summaries in its peers' histories."""
    return f"{FEDERATION_PREFIX}{cluster}"


# -- reporting -------------------------------------------------------------------


def first_interval_start(now_ms: int, summary_ms: int) -> int:
    """Where reporting starts when a policy first names a peer: the start of the
    interval ``now`` falls in."""
    return now_ms - now_ms % summary_ms


def interval_end(start_ms: int, summary_ms: int) -> int:
    """The end of the interval starting at ``start_ms``: the next multiple of
    ``summary_ms`` (so a changed length realigns at once)."""
    return (start_ms // summary_ms + 1) * summary_ms


def leaf_commitments(state: State) -> tuple[LeafCharge, ...]:
    """This cluster's committed charges now per owner leaf (GPUs x the rest of the
    protection of its running allocated work), by path, zeros left out."""
    from ..ordering import committed_by_leaf

    return tuple(
        LeafCharge(leaf=leaf, gpu_ms=gpu_ms)
        for leaf, gpu_ms in sorted(committed_by_leaf(state).items())
        if gpu_ms > 0
    )


def interval_charges(state: State, start_ms: int, end_ms: int) -> tuple[LeafCharge, ...]:
    """This cluster's own charges in ``[start_ms, end_ms)`` per budget node (its
    subtree's charge minus its children's), nodes charged nothing left out, by path."""
    nodes = state.budget.nodes
    growth = {
        p: n.series.cumulative(end_ms) - n.series.cumulative(start_ms) for p, n in nodes.items()
    }
    out: list[LeafCharge] = []
    for path in sorted(nodes):
        own = growth[path] - sum(growth[c] for c in nodes[path].children)
        if own > 0:
            out.append(LeafCharge(leaf=path, gpu_ms=own))
    return tuple(out)


def due_intervals(state: State, now_ms: int) -> list[tuple[int, int]]:
    """The intervals ``[start, end)`` this cluster must report at ``now_ms``, in order."""
    start = state.reported_until_ms
    if start is None:
        return []
    length = state.policy.summary_ms
    out = []
    end = interval_end(start, length)
    while end <= now_ms:
        out.append((start, end))
        start, end = end, interval_end(end, length)
    return out


def next_report_ms(state: State, now_ms: int) -> int | None:
    """The end of the first interval not yet due at ``now_ms`` (a wake-up of the
    cycle), or ``None`` while the cluster reports no usage."""
    start = state.reported_until_ms
    if start is None:
        return None
    length = state.policy.summary_ms
    end = interval_end(start, length)
    while end <= now_ms:
        end = interval_end(end, length)
    return end


def summary_of(report: UsageReported, at_ms: int) -> UsageSummary:
    """The input every peer receives for ``report``, stamped ``at_ms``: the same
    interval, charges and commitments, id ``usage/<cluster>/<start_ms>`` (one per
    interval: the bus stores a repeat once and the fold refuses it), actor
    ``federation:<cluster>``."""
    return UsageSummary(
        id=f"usage/{report.cluster}/{report.start_ms}",
        at_ms=at_ms,
        source=report.cluster,
        start_ms=report.start_ms,
        end_ms=report.end_ms,
        charges=report.charges,
        actor=federation_of(report.cluster),
        committed=report.committed,
    )


# -- receiving -------------------------------------------------------------------


def summary_refusal(state: State, e: UsageSummary) -> Refusal | None:
    """Why the usage summary ``e`` may not be folded, or ``None``."""
    if not e.source:
        return Refusal(R.INVALID_NAME, "usage summary: the source cluster is empty")
    if e.actor != federation_of(e.source) and not is_operator(state, e.actor):
        return Refusal(
            R.NOT_AUTHORISED,
            f"{e.actor or '(no actor)'} may not report usage of cluster {e.source!r}: only "
            f"{federation_of(e.source)!r} or an operator",
        )
    if e.source == state.policy.cluster_name:
        return Refusal(
            R.OWN_USAGE,
            f"usage summary from {e.source!r}, which is this cluster: its own usage is "
            "already counted",
        )
    span = e.end_ms - e.start_ms
    if not 0 < span <= MAX_SUMMARY_MS:
        return Refusal(
            R.BAD_USAGE,
            f"usage summary from {e.source!r}: interval [{e.start_ms}, {e.end_ms}) must be "
            "non-empty and at most 1 h long",
        )
    if e.end_ms <= state.now_ms - MAX_LOOKBACK_MS:
        return Refusal(
            R.BAD_USAGE,
            f"usage summary from {e.source!r}: interval ending at {e.end_ms} is older than "
            "the longest lookback (90 d)",
        )
    seen: set[str] = set()
    cap = span * MAX_FEDERATION_GPUS
    for c in e.committed:
        bad = path_error(c.leaf)
        if bad:
            return Refusal(R.BAD_PATH, f"usage summary from {e.source!r}: {bad}")
        if c.gpu_ms < 0:
            return Refusal(
                R.BAD_USAGE, f"usage summary from {e.source!r}: negative commitment of {c.leaf!r}"
            )
    for c in e.charges:
        bad = path_error(c.leaf)
        if bad:
            return Refusal(R.BAD_PATH, f"usage summary from {e.source!r}: {bad}")
        if c.leaf in seen:
            return Refusal(
                R.BAD_USAGE, f"usage summary from {e.source!r}: node {c.leaf!r} named twice"
            )
        seen.add(c.leaf)
        if c.gpu_ms < 0:
            return Refusal(
                R.BAD_USAGE, f"usage summary from {e.source!r}: negative charge for {c.leaf!r}"
            )
        if c.gpu_ms > cap:
            return Refusal(
                R.BAD_USAGE,
                f"usage summary from {e.source!r}: {c.gpu_ms} GPU-ms for {c.leaf!r} is more "
                f"than the interval can hold ({MAX_FEDERATION_GPUS} GPUs for {span} ms)",
            )
    overlap = _overlap(state.peer_intervals.get(e.source, []), e.start_ms, e.end_ms)
    if overlap is not None:
        a, b = overlap
        what = "a repeat of" if (a, b) == (e.start_ms, e.end_ms) else "overlaps"
        return Refusal(
            R.USAGE_COUNTED,
            f"usage summary from {e.source!r} for [{e.start_ms}, {e.end_ms}) {what} the "
            f"usage already counted for [{a}, {b})",
        )
    return None


def _overlap(spans: list[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    """The folded span that ``[start, end)`` overlaps, or ``None``."""
    i = bisect_left(spans, (start, start))
    for j in (i - 1, i):
        if 0 <= j < len(spans):
            a, b = spans[j]
            if a < end and start < b:
                return a, b
    return None


def fold_summary(state: State, e: UsageSummary) -> None:
    """Count ``e`` (checked by :func:`summary_refusal`): note its interval as heard
    and charge each node and its ancestors at the interval's end."""
    horizon = state.now_ms - MAX_LOOKBACK_MS
    spans = state.peer_intervals.setdefault(e.source, [])
    i = bisect_left(spans, (e.start_ms, e.end_ms))
    spans.insert(i, (e.start_ms, e.end_ms))
    _merge_around(spans, i)
    while spans and spans[0][1] <= horizon:
        del spans[0]
    known = state.peer_committed.get(e.source)
    if known is None or known[0] < e.end_ms:  # the latest interval's word on commitments
        state.peer_committed[e.source] = (e.end_ms, e.committed)
        state.peer_committed_paths = None
    tree = state.budget
    # each node's charge summed over the summary first: one step of its series per
    # summary (the series is the same as adding the parts one by one at one time)
    per_node: dict[str, int] = {}
    for c in e.charges:
        if not c.gpu_ms:
            continue
        path = tree.deepest(c.leaf)
        for p in (*ancestors_of(path), path):
            per_node[p] = per_node.get(p, 0) + c.gpu_ms
    for p, gpu_ms in per_node.items():
        node = tree.nodes[p]
        if not isinstance(node.peer, PeerSeries):
            node.peer = PeerSeries()
        node.peer.add(e.end_ms, gpu_ms, horizon)


def _merge_around(spans: list[tuple[int, int]], i: int) -> None:
    """Merge the span at ``i`` with touching neighbours (disjoint by the overlap check)."""
    if i + 1 < len(spans) and spans[i][1] == spans[i + 1][0]:
        spans[i : i + 2] = [(spans[i][0], spans[i + 1][1])]
    if i > 0 and spans[i - 1][1] == spans[i][0]:
        spans[i - 1 : i + 1] = [(spans[i - 1][0], spans[i][1])]


def peer_committed(state: State) -> list[tuple[str, int]]:
    """``(node, gpu_ms)`` of what the peers last reported committed, each at the
    deepest node of its path this tree has (by source, then as reported)."""
    nodes = state.budget
    return [
        (nodes.deepest(c.leaf), c.gpu_ms)
        for _, (_, committed) in sorted(state.peer_committed.items())
        for c in committed
    ]


def peer_committed_paths(state: State) -> dict[str, int]:
    """:func:`peer_committed` summed per budget path: each node and its ancestors
    but the root. Kept by the state (read only) until a summary changes what a
    peer committed or the tree changes."""
    version = state.budget.weights_and_scales()
    cached = state.peer_committed_paths
    if cached is not None and cached[0] is version:
        return cached[1]
    out: dict[str, int] = {}
    for node, gpu_ms in peer_committed(state):
        for p in (*ancestors_of(node)[1:], node) if node else ():
            out[p] = out.get(p, 0) + gpu_ms
    state.peer_committed_paths = (version, out)
    return out


def heard_until(state: State, source: str) -> int | None:
    """The end of the contiguous run of intervals last heard from ``source`` (its
    latest span's end), or ``None`` if nothing was heard."""
    spans = state.peer_intervals.get(source)
    return spans[-1][1] if spans else None
