"""Step 3c: the reservation for the first allocated workload that cannot be placed.

It holds the node (or the ``k`` whole nodes of one pool) whose GPUs become free
or preemptible *for it* earliest: free now, unallocated now, allocated work it
outranks at its ``protected_until``, the end of a notice, work it will outrank
once its margin wait ends at the later of its ``protected_until`` and that end
(:meth:`Reserver.outranks_from`), anything else never.
A gang of ``k`` nodes starts when its ``k``-th node comes whole, and of the
nodes whole by then it holds the ``k`` that come whole last (ties by node id):
the start is the same, and nodes that free sooner stay open to protected work
meanwhile. Until the start, later work may use a reserved node only if it will
be preemptible by then (:func:`~apportion.core.rules.contract.may_use_reserved`, the
gate of :meth:`~.scratch.Scratch.may_use`).

It is computed only when it changes a decision (:meth:`Reserver.settle`, before
the first placement after the block) or when asked for; until then only
failures happened, which change nothing, so the result is what it would have
been at the block. A gang's nodes are found by their floors
(:mod:`.floors`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..rules.contract import is_allocated, preemptible_from, protected_until
from ..state import Workload
from .floors import WholeNodes
from .result import Reservation
from .scratch import NEVER

if TYPE_CHECKING:
    from .scratch import Scratch


class Reserver:
    """The reservation of step 3c (module docstring)."""

    def __init__(
        self, s: Scratch, whole_nodes: Callable[[Scratch, Reserver], WholeNodes] = WholeNodes
    ) -> None:
        self.s = s
        self.whole = whole_nodes(s, self)

    def settle(self) -> None:
        """Compute the reservation owed to the first blocked workload, if not yet done.

        Called before the first placement after the block (and at the end of
        the cycle when asked): until then only failures happened, which change
        nothing, so the result is what it would have been at the block."""
        s = self.s
        if s.to_reserve is not None:
            w, s.to_reserve = s.to_reserve, None
            self.reserve(w)

    def reserve(self, c: Workload) -> None:
        """Hold for ``c`` the nodes that become free or preemptible for it earliest: for a
        gang of ``k`` nodes, the start is when the ``k``-th node comes whole, and of the
        nodes whole by then it holds the ``k`` that come whole last."""
        s = self.s
        g = c.gpus
        subtrees = s.outranking_for(c).victim_subtrees(c.owner)
        memo: dict[tuple[str, int], int] = {}
        best: tuple[int, tuple[str, ...]] | None = None
        option: tuple[int, tuple[str, ...]] | None
        for key in s.pools_for(c):
            size = key[1]
            names = s.pool_nodes[key]
            if g <= size:
                first = min(
                    ((self.release_time(c, n, subtrees, memo, g), n) for n in names),
                    default=None,
                )
                option = (first[0], (first[1],)) if first is not None else None
            elif g % size == 0 and len(names) >= g // size:
                k = g // size
                ready = self.whole.earliest_whole(c, key, k, subtrees, memo)
                start = ready[k - 1][0]
                # Of the nodes whole by ``start``, hold those that come whole last: the
                # start is the same, and the nodes that come whole sooner stay usable
                # by protected work until then.
                held = [r for r in ready if r[0] <= start][-k:]
                option = (start, tuple(sorted(n for _, n in held)))
            else:
                option = None
            if option is not None and option[0] < NEVER and (best is None or option < best):
                best = option
        if best is None or best[0] <= s.t:
            return
        start, nodes = best
        s.reservation = Reservation(workload=c.id, nodes=nodes, start_ms=start)
        for n in nodes:
            s.reserved[n] = start

    def release_time(
        self,
        c: Workload,
        name: str,
        subtrees: dict[str, None],
        memo: dict[tuple[str, int], int],
        k: int | None,
    ) -> int:
        """When the ``k``-th GPU of ``name`` (``None``: the last one) becomes free or
        preemptible for ``c``: a GPU comes at the protection expiry of work ``c``
        outranks, at the end of a notice, never (as far as the contract tells) under
        work it does not outrank."""
        t = self.s.t
        times = self.gpu_release_times(c, name, subtrees, memo)
        if k is None:  # only the latest counts, and nothing comes after never
            last = t
            for at, _ in times:
                if at >= NEVER:
                    return NEVER
                last = max(last, at)
            return last
        have = 0
        for at, gpus in sorted(times):
            have += gpus
            if have >= k:
                return at
        raise AssertionError(f"{name} has fewer than {k} GPUs")  # pools hold nodes of >= k

    def gpu_release_times(
        self,
        c: Workload,
        name: str,
        subtrees: dict[str, None],
        memo: dict[tuple[str, int], int],
    ) -> Iterator[tuple[int, int]]:
        """``(when, GPUs)`` for the GPUs of node ``name`` (:meth:`release_time`), each
        at or after the cycle's time."""
        s = self.s
        t = s.t
        outranks_from = self.outranks_from
        free = s.free[name]
        if free:
            yield (t, free)
        running = s.state.running
        gone, noticed = s.gone, s.noticed
        for wid, gpus in s.state.nodes[name].workloads.items():
            if wid in gone:
                until = noticed.get(wid)
                if until is not None:  # preempted with notice this cycle
                    yield (until, gpus)
                continue
            v = running[wid]
            if v.stopping is not None:
                yield (v.stopping.until_ms, gpus)
                continue
            who = (v.owner, v.priority if is_allocated(v) else -1)
            since = memo.get(who)
            if since is None:
                since = memo[who] = outranks_from(c, v, subtrees)
            yield (max(preemptible_from(v, t), since), gpus)
        for v, gpus in s.added.get(name, ()):
            since = outranks_from(c, v, subtrees)
            yield (max(protected_until(t, v.min_runtime_ms), since), gpus)

    def outranks_from(self, c: Workload, v: Workload, subtrees: dict[str, None]) -> int:
        """From when ``c`` outranks ``v`` as far as the rule tells now: the cycle's time
        if it does (``subtrees``: ``c``'s victim subtrees under the rule it has); the
        end of ``c``'s margin wait if only the rule without the margin says so
        (:func:`~apportion.core.rules.outranking.held_to_margin`); else never."""
        s = self.s
        rule = s.outranking_for(c)
        if rule.may_preempt(c, v, subtrees):
            return s.t
        waited = s.outranking_waited
        if waited is rule:
            return NEVER  # no margin, or no wait, or waited already: the rule said no
        if waited.may_preempt(c, v, waited.victim_subtrees(c.owner)):
            return c.queued_ms + s.state.policy.margin_wait_ms
        return NEVER
