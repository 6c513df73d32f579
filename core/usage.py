"""Exact sliding-window usage from a cumulative charge function.

A :class:`ChargeSeries` is the cumulative charge ``C(x)`` of one budget node: the
GPU-milliseconds charged to its subtree up to time ``x``. ``C`` is piecewise
linear; between breakpoints it grows at ``rate`` GPUs (the allocated GPUs
running under the node). Usage over the window ``[t - W, t]`` is
``C(t) - C(t - W)``: one multiplication for ``C(t)`` and one binary search for
``C(t - W)``, however long the history. Time only moves forward, so the series
drops breakpoints older than the longest lookback the policy allows.

Everything is an integer: GPUs, milliseconds, GPU-milliseconds.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import msgspec

MAX_LOOKBACK_MS = 90 * 24 * 3_600_000
"""History kept for the usage window; :class:`PolicySet` may not ask for more."""

_PRUNE_MIN = 512


class ChargeSeries(msgspec.Struct, array_like=True):
    """Breakpoints ``(times[i], cums[i], rates[i])``: ``C(times[i]) == cums[i]``
    and ``C`` grows at ``rates[i]`` GPUs from ``times[i]`` to the next breakpoint.
    Before the first breakpoint ``C`` is zero. A msgspec Struct, so that it
    snapshots as it is."""

    times: list[int] = msgspec.field(default_factory=list)
    cums: list[int] = msgspec.field(default_factory=list)
    rates: list[int] = msgspec.field(default_factory=list)

    @property
    def rate(self) -> int:
        """GPUs currently charged to this node."""
        return self.rates[-1] if self.rates else 0

    def change_rate(self, at_ms: int, delta_gpus: int) -> None:
        """From ``at_ms`` on (never before the last breakpoint) the rate changes by ``delta_gpus``."""
        change_rates((self,), at_ms, delta_gpus)

    def cumulative(self, x: int) -> int:
        """``C(x)``: GPU-ms charged up to time ``x``."""
        times = self.times
        if not times:
            return 0
        if x >= times[-1]:
            return self.cums[-1] + self.rates[-1] * (x - times[-1])
        i = bisect_right(times, x) - 1
        if i < 0:
            # C is flat before the first breakpoint (zero until history is pruned).
            return self.cums[0]
        return self.cums[i] + self.rates[i] * (x - times[i])

    def window(self, now_ms: int, lookback_ms: int) -> int:
        """GPU-ms charged inside ``[now - lookback, now]``: ``C(now) - C(now -
        lookback)``, with :meth:`cumulative` spelled inline (every cycle asks it of
        every budget node)."""
        times = self.times
        if not times:
            return 0
        cums, rates = self.cums, self.rates
        last = times[-1]
        if now_ms >= last:
            end = cums[-1] + rates[-1] * (now_ms - last)
        else:
            i = bisect_right(times, now_ms) - 1
            end = cums[0] if i < 0 else cums[i] + rates[i] * (now_ms - times[i])
        x = now_ms - lookback_ms
        if x >= last:
            return end - (cums[-1] + rates[-1] * (x - last))
        i = bisect_right(times, x) - 1
        return end - (cums[0] if i < 0 else cums[i] + rates[i] * (x - times[i]))

    def _prune(self, horizon: int) -> None:
        """Drop breakpoints no window can reach; the one in force at ``horizon`` stays."""
        i = bisect_right(self.times, horizon) - 1
        if i > 0:
            del self.times[:i]
            del self.cums[:i]
            del self.rates[:i]


def change_rates(chain: tuple[ChargeSeries, ...], at_ms: int, delta_gpus: int) -> None:
    """:meth:`ChargeSeries.change_rate` for every series of ``chain`` (a leaf and its
    ancestors): the fold's hot path, so written as one loop."""
    horizon = at_ms - MAX_LOOKBACK_MS
    for series in chain:
        times = series.times
        rates = series.rates
        if times:
            last = times[-1]
            if last == at_ms:
                rates[-1] += delta_gpus
                continue
            rate = rates[-1]
            cums = series.cums
            cums.append(cums[-1] + rate * (at_ms - last))
            rates.append(rate + delta_gpus)
        else:
            series.cums.append(0)
            rates.append(delta_gpus)
        times.append(at_ms)
        n = len(times)
        if n > _PRUNE_MIN and times[n >> 1] < horizon:
            series._prune(horizon)


class PeerSeries(msgspec.Struct, array_like=True):
    """The cumulative charge of one budget node on the *other* clusters of its
    federation, from their usage summaries: a step function, ``C(x) = cums[i]``
    for the last ``times[i] <= x`` (``0`` before the first). A summary's charge
    steps up at its interval's end, whenever it arrives: one that arrives late
    (after a partition) is inserted at its own time, so the window is the same
    as if it had arrived on time. Pruned like :class:`ChargeSeries`."""

    times: list[int] = msgspec.field(default_factory=list)
    cums: list[int] = msgspec.field(default_factory=list)

    def add(self, at_ms: int, gpu_ms: int, horizon: int) -> None:
        """Charge ``gpu_ms`` at ``at_ms`` (later than any breakpoint pruned at or
        before ``horizon``: older summaries are refused)."""
        times, cums = self.times, self.cums
        i = bisect_left(times, at_ms)
        if i == len(times) or times[i] != at_ms:
            times.insert(i, at_ms)
            cums.insert(i, cums[i - 1] if i else 0)
        for j in range(i, len(cums)):
            cums[j] += gpu_ms
        n = len(times)
        if n > _PRUNE_MIN and times[n >> 1] < horizon:
            k = bisect_right(times, horizon) - 1
            if k > 0:
                del times[:k]
                del cums[:k]

    def cumulative(self, x: int) -> int:
        i = bisect_right(self.times, x) - 1
        return self.cums[i] if i >= 0 else 0

    def window(self, now_ms: int, lookback_ms: int) -> int:
        """Peer GPU-ms charged inside ``(now - lookback, now]`` (steps at their interval ends)."""
        return self.cumulative(now_ms) - self.cumulative(now_ms - lookback_ms)
