"""The host agent's lease: how its runs fence themselves when it loses the bus.

The agent renews the lease (``<agent folder>/lease.json``) after every heartbeat
the server confirmed (a publish followed by a flush, the PING/PONG round trip:
the server has the heartbeat, so the scheduler can hear it). The lease holds
the time the confirmed heartbeat was *sent* (``renewed_ms``, milliseconds of
``CLOCK_BOOTTIME``) and the bounds derived from the policy's heartbeat timeout
(:func:`apportion.core.rules.fence.fence_bounds`): ``fence_after_ms`` and
``notice_ms``. Each run's supervisor (:mod:`~apportion.services.agent_shim`)
reads it and stops its command (notice, then SIGKILL) once it is older than
``fence_after_ms``: when the agent is cut off from the bus, hung, stopped or
killed. The agent itself starts nothing while its lease is out of date.

A restarted agent keeps the lease it finds (its time and its bounds) until it
has confirmed a heartbeat and caught up with the policy, so the runs it
re-adopts stay fenced by the bounds they were started under.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from apportion.core.rules.fence import FenceBounds, fence_bounds

from .agent_shim import LEASE, boot_ms, read_lease

__all__ = ["LEASE", "Lease", "boot_ms"]


class Lease:
    """The lease of the agent whose folder is ``root`` (see the module doc)."""

    def __init__(self, root: Path, logger: Any) -> None:
        self.path = root / LEASE
        self.logger = logger
        found = read_lease(self.path)
        self.renewed_ms: int | None = found.get("renewed_ms")
        """``CLOCK_BOOTTIME`` ms of the last heartbeat the server confirmed (sent then)."""
        default = fence_bounds(0)
        after = found.get("fence_after_ms", default.fence_after_ms)
        notice = found.get("notice_ms", default.notice_ms)
        self.fence_after_ms = after
        self.notice_ms = notice
        self.heartbeat_timeout_ms = found.get("heartbeat_timeout_ms", default.heartbeat_timeout_ms)
        self.fenced = False
        """The lease ran out (logged once per silence)."""

    def fields(self) -> dict[str, int]:
        """What the lease says now (also written into each run's ``spec.json``)."""
        out = {
            "fence_after_ms": self.fence_after_ms,
            "notice_ms": self.notice_ms,
            "heartbeat_timeout_ms": self.heartbeat_timeout_ms,
            "pid": os.getpid(),
        }
        if self.renewed_ms is not None:
            out["renewed_ms"] = self.renewed_ms
        return out

    def renew(self, sent_ms: int) -> None:
        """A heartbeat sent at ``sent_ms`` was confirmed by the server."""
        if self.renewed_ms is None or sent_ms > self.renewed_ms:
            self.renewed_ms = sent_ms
        self._write()

    def follow(self, policy_timeout_ms: int) -> FenceBounds:
        """Take the bounds of the policy's heartbeat timeout (the agent has caught up)."""
        b = fence_bounds(policy_timeout_ms)
        if (b.fence_after_ms, b.notice_ms) != (self.fence_after_ms, self.notice_ms):
            self.fence_after_ms, self.notice_ms = b.fence_after_ms, b.notice_ms
            self.heartbeat_timeout_ms = b.heartbeat_timeout_ms
            self.logger.info(
                "fence bounds",
                heartbeat_timeout_s=b.heartbeat_timeout_ms / 1000,
                fence_after_s=b.fence_after_ms / 1000,
                notice_s=b.notice_ms / 1000,
                margin_s=b.margin_ms / 1000,
            )
            self._write()
        return b

    def silent_ms(self, now_ms: int | None = None) -> int | None:
        """How long since the last confirmed heartbeat (``None``: none yet)."""
        if self.renewed_ms is None:
            return None
        return (boot_ms() if now_ms is None else now_ms) - self.renewed_ms

    def valid(self, now_ms: int | None = None) -> bool:
        """Within the bound: the agent may start runs."""
        silent = self.silent_ms(now_ms)
        return silent is not None and silent <= self.fence_after_ms

    def check(self) -> bool:
        """Log the start and the end of a silence past the bound; ``True`` while fenced."""
        silent = self.silent_ms()
        over = silent is not None and silent > self.fence_after_ms
        if over and not self.fenced:
            self.fenced = True
            self.logger.error(
                "fenced: no contact with the bus; the supervisors stop every run",
                silent_s=round((silent or 0) / 1000, 1),
                fence_after_s=self.fence_after_ms / 1000,
                notice_s=self.notice_ms / 1000,
            )
        elif not over and self.fenced and silent is not None:
            self.fenced = False
            self.logger.warning("contact with the bus again; starting runs again")
        return self.fenced

    def _write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.fields()) + "\n")
            os.replace(tmp, self.path)
