"""The supervisor of one attempt: ``python -m apportion.services.agent_shim ATTEMPT_DIR``.

The agent runs it and it forks at once: the parent writes the supervisor's pid
to ``shim.pid`` and exits, the child starts a session of its own (so it is
never the agent's child and outlives the agent: a restarted agent re-adopts it
by that pid). It reads ``spec.json`` from the attempt's folder
(``argv``, ``env``, ``cwd``), writes its starts the
command in a new process group with stdout and stderr appended to
``output.log``, writes the command's pid to ``pid`` (the agent signals that
process group), waits for it, and writes its exit status to ``exit``: the exit
code, or minus the signal that killed it (like ``subprocess``). Every file is
written atomically (a temporary file renamed). The shim ignores SIGTERM,
SIGINT and SIGHUP, so a notice sent to the workload's group (or a Ctrl-C in
the agent's terminal) never keeps the exit from being recorded.

A command that cannot be started (not found, not executable) is recorded as
exit status 127 with the reason in ``output.log``.

**Fencing.** While the command runs, the shim reads the agent's lease
(``spec.json``'s ``lease``: ``<agent folder>/lease.json``, which the agent
rewrites after each heartbeat the bus confirmed, with the bounds it derives
from the policy; :mod:`apportion.core.rules.fence`). Once the lease is older
than its ``fence_after_ms`` (the agent is cut off from the bus, hung, stopped
or killed) the shim stops the command on its own: the ``preempt-notice`` file,
SIGTERM to its group, SIGKILL ``notice_ms`` later, so nothing the agent started
runs unfenced. Times are ``CLOCK_BOOTTIME`` milliseconds (the same for every
process of the host, and counting a suspend).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

SPEC = "spec.json"
LEASE = "lease.json"
NOTICE = "preempt-notice"
POLL_S = 0.2
"""How often the shim reads the lease (part of the margin ``M``)."""
SHIM_PID = "shim.pid"
PID = "pid"
EXIT = "exit"
OUTPUT = "output.log"


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def boot_ms() -> int:
    """Milliseconds of ``CLOCK_BOOTTIME``: the clock of the lease (agent and shims)."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000


def read_lease(path: Path) -> dict[str, int]:
    """The lease's integer fields (``{}`` when it is missing or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool)}


class Fencer:
    """Stops the command once the agent's lease is older than its bound."""

    def __init__(self, spec: dict[str, object], attempt_dir: Path, out: BinaryIO) -> None:
        lease = spec.get("lease")
        self.lease = Path(lease) if isinstance(lease, str) and lease else None
        self.spec = spec
        self.dir = attempt_dir
        self.out = out
        self.fallback = {
            k: v
            for k in ("renewed_ms", "fence_after_ms", "notice_ms")
            if isinstance(v := spec.get(k), int)
        }
        self.kill_at: int | None = None
        self.killed = False

    def check(self, pgid: int) -> None:
        if self.lease is None or self.killed:
            return
        now = boot_ms()
        if self.kill_at is None:
            lease = {**self.fallback, **read_lease(self.lease)}
            renewed, after = lease.get("renewed_ms"), lease.get("fence_after_ms")
            if renewed is None or after is None or now - renewed <= after:
                return
            notice = max(0, lease.get("notice_ms", 0))
            self.kill_at = now + notice
            silent = (now - renewed) / 1000
            reason = f"fenced: the agent has had no contact with the bus for {silent:.1f} s"
            deadline_ms = time.time_ns() // 1_000_000 + notice
            notice_text = {"reason": reason, "grace_ms": notice, "deadline_ms": deadline_ms}
            if not (self.dir / NOTICE).exists():
                write_atomic(self.dir / NOTICE, json.dumps(notice_text) + "\n")
            self._say(
                f"{reason} (bound {after / 1000:g} s): SIGTERM, SIGKILL in {notice / 1000:g} s"
            )
            _signal(pgid, signal.SIGTERM)
        if now >= self.kill_at:
            self.killed = True
            self._say("fence notice over: SIGKILL")
            _signal(pgid, signal.SIGKILL)
            runtime, name = self.spec.get("runtime"), self.spec.get("container")
            if isinstance(runtime, str) and runtime and isinstance(name, str) and name:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run(
                        [runtime, "kill", name],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        timeout=10,
                    )

    def _say(self, text: str) -> None:
        self.out.write(f"[apportion {_stamp()}] {text}\n".encode())


def _signal(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run(attempt_dir: Path) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    spec = json.loads((attempt_dir / SPEC).read_text())
    argv: list[str] = spec["argv"]
    with open(attempt_dir / OUTPUT, "ab", buffering=0) as out:
        out.write(f"[apportion {_stamp()}] start: {json.dumps(argv)}\n".encode())
        try:
            proc = subprocess.Popen(
                argv,
                env=spec["env"],
                cwd=spec.get("cwd") or None,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                process_group=0,  # its own group: the agent signals the whole job
                # the job must not inherit the shim's ignored signals
                preexec_fn=_default_signals,
            )
        except OSError as exc:
            out.write(f"[apportion {_stamp()}] cannot start: {exc}\n".encode())
            write_atomic(attempt_dir / EXIT, json.dumps({"exit_code": 127}) + "\n")
            return 0
        write_atomic(attempt_dir / PID, f"{proc.pid}\n")
        fencer = Fencer(spec, attempt_dir, out)
        while True:
            try:
                code = proc.wait(POLL_S)
                break
            except subprocess.TimeoutExpired:
                fencer.check(proc.pid)
        out.write(f"[apportion {_stamp()}] exit: {code}\n".encode())
    write_atomic(attempt_dir / EXIT, json.dumps({"exit_code": code}) + "\n")
    return 0


def _default_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m apportion.services.agent_shim ATTEMPT_DIR", file=sys.stderr)
        return 2
    attempt_dir = Path(sys.argv[1])
    child = os.fork()
    if child:
        write_atomic(attempt_dir / SHIM_PID, f"{child}\n")
        os._exit(0)
    os.setsid()
    fd = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(fd, std)
    try:
        return run(attempt_dir)
    except BaseException as exc:  # record something: the agent waits for `exit`
        with open(attempt_dir / OUTPUT, "ab") as out:
            out.write(f"[apportion {_stamp()}] supervisor failed: {exc!r}\n".encode())
        if not (attempt_dir / EXIT).exists():
            write_atomic(attempt_dir / EXIT, json.dumps({"exit_code": 126}) + "\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
