"""Fencing: the bounds that keep one attempt of a workload running at a time.

A host whose agent is silent is marked ``down`` by the live scheduler after the
**heartbeat timeout** ``H``, and its runs are requeued (started elsewhere). An
agent cut off from the bus cannot hear that decision, so it stops its runs on
its own first: once it has had no confirmed contact with the bus for the
**self-fence bound** ``F``, every run on its host gets a **notice** ``N``
(SIGTERM, the notice file) and then SIGKILL. The rule that makes the requeue
safe (the old attempt is dead before the new one can start) is::

    H  >=  F + N + M

where ``M`` is a **margin** for what the bounds do not count (how often the
supervisor looks at its lease, the time a SIGKILL takes, clocks ticking at
slightly different rates). Every bound is derived from ``H`` alone, so the rule
holds by construction and no two settings can disagree:

=========  ==============================  ===========  ===========
bound      value                           H = 300 s    H = 6 s
=========  ==============================  ===========  ===========
``N``      ``min(30 s, H / 10)``           30 s         0.6 s
``M``      ``max(2 s, H / 20)``            15 s         2 s
``F``      ``H - N - M``                   255 s        3.4 s
=========  ==============================  ===========  ===========

``H`` must be 0 or at least :data:`MIN_HEARTBEAT_TIMEOUT_MS` (5 s, so that
``F`` is at least 2.5 s): :func:`heartbeat_timeout_problem` says why a value
is refused (the cluster file refuses it). A history that recorded a smaller
one (before this rule) keeps it, and the live services read it as 5 s
(:func:`effective_timeout_ms`).

The policy's ``heartbeat_timeout_ms = 0`` (the schema's default, and so every
history that never set it) means :data:`DEFAULT_HEARTBEAT_TIMEOUT_MS` for the
hosts that heartbeat (that run an agent), and nothing for hosts that never do
(the executor emulator, simulations, replays): :func:`watches_every_host`.

Pure integers; no I/O and no clock (the callers bring the times).
"""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_HEARTBEAT_TIMEOUT_MS = 300_000
"""The heartbeat timeout of a policy that sets none (0): 300 s, like Slurm's
``SlurmdTimeout``; it applies to the hosts that heartbeat."""

MIN_HEARTBEAT_TIMEOUT_MS = 5_000
"""The smallest heartbeat timeout (``F`` is then 2.5 s)."""

MAX_FENCE_NOTICE_MS = 30_000
MIN_FENCE_MARGIN_MS = 2_000


class FenceBounds(NamedTuple):
    """The bounds of one heartbeat timeout, in milliseconds (see the module doc)."""

    heartbeat_timeout_ms: int
    """``H``: the scheduler marks a host silent for this long ``down``."""
    fence_after_ms: int
    """``F``: an agent without contact with the bus for this long stops its runs."""
    notice_ms: int
    """``N``: SIGTERM, then SIGKILL this much later."""
    margin_ms: int
    """``M``: ``H - F - N``."""


def effective_timeout_ms(policy_timeout_ms: int) -> int:
    """The heartbeat timeout the live services use for a policy's value (0: the default)."""
    if policy_timeout_ms <= 0:
        return DEFAULT_HEARTBEAT_TIMEOUT_MS
    return max(policy_timeout_ms, MIN_HEARTBEAT_TIMEOUT_MS)


def watches_every_host(policy_timeout_ms: int) -> bool:
    """A policy that sets a timeout watches every host that is not down (each must
    heartbeat); the default (0) watches only the hosts heard from."""
    return policy_timeout_ms > 0


def fence_bounds(policy_timeout_ms: int) -> FenceBounds:
    """The bounds for a policy's ``heartbeat_timeout_ms`` (0: the default)."""
    h = effective_timeout_ms(policy_timeout_ms)
    notice = min(MAX_FENCE_NOTICE_MS, h // 10)
    margin = max(MIN_FENCE_MARGIN_MS, h // 20)
    return FenceBounds(h, h - notice - margin, notice, margin)


def heartbeat_timeout_problem(ms: int) -> str:
    """Why ``ms`` cannot be a policy's heartbeat timeout (``""``: it can)."""
    if ms < 0:
        return "must not be negative"
    if 0 < ms < MIN_HEARTBEAT_TIMEOUT_MS:
        return (
            f"must be 0 (the default, {DEFAULT_HEARTBEAT_TIMEOUT_MS // 1000} s for hosts "
            f"that heartbeat) or at least {MIN_HEARTBEAT_TIMEOUT_MS // 1000} s: it must "
            "exceed the agents' self-fence bound + their notice + a margin "
            f"(docs/agent.md, Fencing); {ms} ms leaves no time to fence"
        )
    return ""
