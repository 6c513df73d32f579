"""The host agent's health: heartbeats, and the probes that drain and down its host.

:class:`HostHealth` publishes a heartbeat every ``heartbeat_s`` on the plain NATS
subject ``apportion.<cluster>.heartbeat.<node>`` (JSON with the advertised
address: the other hosts of a gang learn ``MASTER_ADDR`` from it, and hears
theirs into ``peers``), and runs the probes every ``interval_s``
(``nvidia-smi -L`` when the GPUs were found with it, then ``--health-command``):
``drain_after`` failures in a row make :attr:`HostHealth.probed` ``draining``,
``down_after`` ``down``, a pass ``healthy``. Which of these the agent may
publish is :func:`apportion.core.reconcile.health_change`'s rule.

Also here: finding the host's GPUs (:func:`discover_gpus`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from typing import Any

from apportion.schemas.events import HealthState

from .agent_shim import boot_ms
from .bus import EventLog

PROBE_TIMEOUT_S = 10.0
"""Every probe is bounded by this many seconds."""

FLUSH_TIMEOUT_S = 2.0
"""A heartbeat's round trip to the server is bounded by this (or the interval)."""


def gpu_type_of(name: str) -> str:
    """A GPU type from an ``nvidia-smi`` name: ``NVIDIA H100 80GB HBM3`` -> ``h100``."""
    words = [w for w in re.split(r"[\s\-_/]+", name.lower()) if w and w != "nvidia"]
    for w in words:
        if re.fullmatch(r"[a-z]+\d+[a-z]*", w):
            return w
    return "-".join(re.sub(r"[^a-z0-9.]", "", w) for w in words)[:64] or "gpu"


def discover_gpus(timeout_s: float = 20.0) -> tuple[int, str] | None:
    """``(count, type)`` from ``nvidia-smi``, or ``None`` when it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
    return (len(names), gpu_type_of(names[0])) if names else None


class HostHealth:
    """The heartbeats and health probes of host ``node`` (see the module doc)."""

    def __init__(
        self,
        *,
        node: str,
        addr: str,
        gpus: int,
        gpu_type: str,
        logger: Any,
        clock: Callable[[], int],
        heartbeat_s: float = 2.0,
        health_command: str | None = None,
        health_interval_s: float = 10.0,
        drain_after: int = 3,
        down_after: int = 10,
        probe_nvidia: bool = False,
        on_contact: Callable[[int], None] | None = None,
        max_interval_s: Callable[[], float] | None = None,
    ) -> None:
        self.node = node
        self.on_contact = on_contact
        """Called with the ``CLOCK_BOOTTIME`` ms a heartbeat was sent at, once the
        server confirmed it (the agent's lease)."""
        self.max_interval_s = max_interval_s
        """The longest interval the fence bounds allow (a quarter of the self-fence bound)."""
        self._failing = False
        self.addr = addr
        self.gpus = gpus
        self.gpu_type = gpu_type
        self.logger = logger
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self.health_command = health_command
        self.health_interval_s = health_interval_s
        self.drain_after = drain_after
        self.down_after = down_after
        self.probe_nvidia = probe_nvidia
        self.peers: dict[str, str] = {node: addr}
        """Advertised addresses of the hosts heard from (heartbeats)."""
        self.probe_state: HealthState = "healthy"
        """What the probes say."""

    def interval_s(self) -> float:
        """``heartbeat_s``, at most what the fence bounds allow."""
        cap = self.max_interval_s() if self.max_interval_s is not None else self.heartbeat_s
        return max(0.05, min(self.heartbeat_s, cap))

    @property
    def probing(self) -> bool:
        return bool(self.probe_nvidia or self.health_command)

    async def heartbeats(self, log: EventLog, stop: asyncio.Event) -> None:
        """Publish a heartbeat every ``heartbeat_s``; learn the other hosts' addresses."""
        nc = getattr(log, "nc", None)
        if nc is None:
            return
        subjects = log.subjects

        async def heard(msg: Any) -> None:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                data = json.loads(msg.data)
                node, addr = data.get("node"), data.get("addr")
                if isinstance(node, str) and isinstance(addr, str) and node != self.node:
                    self.peers[node] = addr

        try:
            sub = await nc.subscribe(subjects.heartbeats, cb=heard)
        except Exception as exc:  # no gang addresses then; heartbeats still go
            self.logger.error("cannot hear the other hosts' heartbeats", error=error_text(exc))
            sub = None
        try:
            while not stop.is_set():
                payload = {
                    "node": self.node,
                    "addr": self.addr,
                    "gpus": self.gpus,
                    "gpu_type": self.gpu_type,
                    "at_ms": self.clock(),
                    "health": self.probe_state,
                }
                sent = boot_ms()
                interval = self.interval_s()
                try:
                    await confirmed_publish(
                        nc,
                        subjects.heartbeat(self.node),
                        json.dumps(payload).encode(),
                        max(0.1, min(interval, FLUSH_TIMEOUT_S)),
                    )
                except Exception as exc:  # a reconnect; the next one may pass
                    if not self._failing:
                        self.logger.warning("heartbeat failed", error=error_text(exc))
                    self._failing = True
                else:
                    if self._failing:
                        self.logger.info("heartbeats confirmed again")
                    self._failing = False
                    if self.on_contact is not None:
                        self.on_contact(sent)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval)
        finally:
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def probes(self, stop: asyncio.Event) -> None:
        """Run the health probes every ``health_interval_s``; count failures in a row."""
        failures = 0
        while not stop.is_set():
            ok, why = await self.probe_once()
            if ok:
                if failures:
                    self.logger.info("health probe passes again", after=failures)
                failures = 0
                self.probe_state = "healthy"
            else:
                failures += 1
                self.logger.warning("health probe failed", failures=failures, why=why)
                if failures >= self.down_after:
                    self.probe_state = "down"
                elif failures >= self.drain_after:
                    self.probe_state = "draining"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.health_interval_s)

    async def probe_once(self) -> tuple[bool, str]:
        probes: list[tuple[list[str], bool]] = []
        if self.probe_nvidia:
            probes.append((["nvidia-smi", "-L"], False))
        if self.health_command:
            probes.append((["/bin/sh", "-c", self.health_command], True))
        for argv, _shell in probes:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as exc:
                return False, f"{argv[0]}: {exc}"
            try:
                _out, err = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                return False, f"{' '.join(argv)}: no answer within {PROBE_TIMEOUT_S:g} s"
            if proc.returncode != 0:
                tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
                return False, f"{' '.join(argv)}: exit {proc.returncode} {' '.join(tail)}".strip()
        return True, ""


async def confirmed_publish(nc: Any, subject: str, data: bytes, timeout_s: float) -> None:
    """Publish and make sure the server has it: a PING/PONG round trip on the same
    connection, with no disconnection in between (nats-py's ``flush`` returns at
    once, without a round trip, while it is reconnecting); raises otherwise."""
    if not nc.is_connected:
        raise ConnectionError("not connected")
    reconnects = nc.stats.get("reconnects", 0)
    await nc.publish(subject, data)
    await nc.flush(timeout=timeout_s)
    if not nc.is_connected or nc.stats.get("reconnects", 0) != reconnects:
        raise ConnectionError("the connection dropped before the server confirmed")


def error_text(exc: BaseException) -> str:
    """The first line of an error, with its type (for a log line)."""
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}".rstrip(": ")
