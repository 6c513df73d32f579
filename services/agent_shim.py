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
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SPEC = "spec.json"
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
        code = proc.wait()
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
