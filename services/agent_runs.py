"""An agent's attempts on disk: launching, watching, signalling and re-adopting them.

Layout under the agent's folder (``<work-dir>/<cluster>/<node>``)::

    <workload>/attempt-<n>/spec.json       what was started (argv, env, GPU indices, rank)
                           shim.pid        the supervisor (agent_shim) pid
                           pid             the workload's pid (= its process group)
                           exit            {"exit_code": N} once it ended
                           output.log      stdout and stderr
                           preempt-notice  written when a preemption notice begins
                           started         marker: WorkloadStarted published
                           reported        marker: WorkloadFinished published (or not needed)

Creating ``attempt-<n>`` is the claim: an agent never starts an attempt whose
folder exists (a crash between the claim and the start leaves a folder without
``shim.pid``: that attempt is reported failed, never started twice).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .agent_shim import EXIT, OUTPUT, PID, SHIM_PID, SPEC, write_atomic

SHIM_MODULE = "apportion.services.agent_shim"
STARTED = "started"
REPORTED = "reported"


@dataclass
class Attempt:
    """One attempt of a workload on this host (its rank of a gang)."""

    workload: str
    attempt: int
    dir: Path
    indices: tuple[int, ...]
    rank: int = 0
    ranks: int = 1
    container: str = ""
    runtime: str = ""
    exit_code: int | None = None
    exited: bool = False
    lost: bool = False
    """No supervisor and no exit status: the host went down with it, or the agent
    crashed between the claim and the start."""
    stop_reason: str = ""
    kill_at: float | None = None
    """Monotonic time of the SIGKILL after a notice (``None``: not stopping)."""
    killed: bool = False
    started_reported: bool = False
    end_reported: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        return (self.workload, self.attempt)

    @property
    def stopping(self) -> bool:
        return self.kill_at is not None


def attempt_dir(root: Path, workload: str, attempt: int) -> Path:
    return root / workload / f"attempt-{attempt}"


def claim(path: Path) -> bool:
    """Create the attempt's folder; ``False`` if it exists (claimed before)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir()
    except FileExistsError:
        return False
    return True


def launch(
    run: Attempt,
    argv: list[str],
    env: dict[str, str],
    cwd: str | None,
    fence: dict[str, Any] | None = None,
) -> None:
    """Write ``spec.json`` and start the supervisor (which forks into its own session
    and writes ``shim.pid`` before this returns). ``fence``: the lease's path
    (``lease``) and the lease as it is now (``renewed_ms``, ``fence_after_ms``,
    ``notice_ms``), which the supervisor reads until the lease file says more."""
    spec = {
        "workload": run.workload,
        "attempt": run.attempt,
        "argv": argv,
        "env": env,
        "cwd": cwd,
        "indices": list(run.indices),
        "rank": run.rank,
        "ranks": run.ranks,
        "container": run.container,
        "runtime": run.runtime,
        **(fence or {}),
    }
    write_atomic(run.dir / SPEC, json.dumps(spec) + "\n")
    subprocess.run(
        [sys.executable, "-m", SHIM_MODULE, str(run.dir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=30,
        check=True,
    )


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def read_exit(path: Path) -> tuple[bool, int | None]:
    """``(exited, exit code)`` from an attempt's folder."""
    try:
        data = json.loads((path / EXIT).read_text())
    except FileNotFoundError:
        return False, None
    except (OSError, ValueError):
        return True, None
    code = data.get("exit_code") if isinstance(data, dict) else None
    return True, code if isinstance(code, int) else None


def shim_alive(path: Path) -> bool:
    """The attempt's supervisor still runs (``/proc/<pid>/cmdline`` is that shim for
    that folder, so a reused pid is never mistaken for it)."""
    pid = _read_int(path / SHIM_PID)
    if pid is None:
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and SHIM_MODULE.encode() in argv and str(path).encode() in argv


def check(run: Attempt) -> None:
    """Update ``run.exited`` / ``exit_code`` / ``lost`` from its folder."""
    if run.exited:
        return
    exited, code = read_exit(run.dir)
    if exited:
        run.exited, run.exit_code = True, code
        return
    if not shim_alive(run.dir):
        exited, code = read_exit(run.dir)  # it may have written its exit meanwhile
        run.exited, run.exit_code = True, code
        run.lost = not exited


def send(run: Attempt, sig: int) -> None:
    """``sig`` to the workload's process group (and, for SIGKILL, its container)."""
    pid = _read_int(run.dir / PID)
    if pid is not None and pid > 1:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
    if sig == signal.SIGKILL and run.container and run.runtime:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                [run.runtime, "kill", run.container],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=10,
            )


def mark(run: Attempt, name: str, text: str = "") -> None:
    with contextlib.suppress(OSError):
        write_atomic(run.dir / name, text or f"{int(time.time() * 1000)}\n")


def note(run: Attempt, text: str) -> None:
    """A line from the agent in the attempt's ``output.log``."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with contextlib.suppress(OSError), open(run.dir / OUTPUT, "a") as out:
        out.write(f"[apportion {stamp}] {text}\n")


def scan(root: Path) -> list[Attempt]:
    """Every attempt folder under ``root`` (an agent starting again), with its state."""
    found: list[Attempt] = []
    if not root.is_dir():
        return found
    for wdir in sorted(p for p in root.iterdir() if p.is_dir()):
        for adir in sorted(wdir.glob("attempt-*")):
            try:
                n = int(adir.name.split("-", 1)[1])
            except ValueError:
                continue
            try:
                spec = json.loads((adir / SPEC).read_text())
            except (OSError, ValueError):
                spec = {}
            run = Attempt(
                workload=wdir.name,
                attempt=n,
                dir=adir,
                indices=tuple(int(i) for i in spec.get("indices", ())),
                rank=int(spec.get("rank", 0)),
                ranks=int(spec.get("ranks", 1)),
                container=str(spec.get("container", "")),
                runtime=str(spec.get("runtime", "")),
                started_reported=(adir / STARTED).exists(),
                end_reported=(adir / REPORTED).exists(),
            )
            if run.end_reported:
                run.exited = True
                continue  # done with; kept on disk for its log
            check(run)
            found.append(run)
    return found
