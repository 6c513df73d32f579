"""A real Slurm 22.05 cluster on this machine: one slurmctld and a few slurmd with fake GPUs.

Follows what was verified on these machines (Debian's ``slurm-wlm`` and ``munge``):
every node is ``NodeAddr=127.0.0.1`` with a port of its own, one ``slurmd -N
<node>`` per node; munge runs on a private socket; the fake GPUs are character
devices (``mknod c 195 N``) named in ``gres.conf``. The governed partition holds
every job at submission by a ``job_submit.lua`` rule (priority 0: held), the
submit-side rule docs/slurm.md recommends. Everything lives under one folder;
:meth:`SlurmCluster.stop` ends the daemons by their pid files.

Needs root (slurmd starts jobs as their user) and the binaries: ``make test``
installs ``slurm-wlm`` when root and missing; otherwise :func:`skip_reason` says
why the Slurm tests skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from apportion.services.stack import free_port

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "munged", "mungekey")

HOLD_RULE = """\
-- apportion: every job submitted to the governed partition is held (priority 0)
-- until apportion places it (docs/slurm.md, "Intake").
function slurm_job_submit(job_desc, part_list, submit_uid)
  if job_desc.partition == nil or job_desc.partition == "{partition}" then
    job_desc.priority = 0
  end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end
"""


def skip_reason() -> str | None:
    """Why a real Slurm cannot start here, or ``None``."""
    if os.geteuid() != 0:
        return "the Slurm tests need root (slurmd starts jobs as their user)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing): `make test` installs "
            "slurm-wlm and munge when run as root"
        )
    return None


class SlurmCluster:
    """``nodes`` nodes ``<prefix>0..`` with ``gpus`` fake GPUs of type ``gpu_type`` each,
    in partition ``partition``, under ``root``."""

    def __init__(
        self,
        root: Path,
        *,
        nodes: int = 3,
        gpus: int = 4,
        gpu_type: str = "fake",
        partition: str = "gpu",
        prefix: str = "sn",
        name: str = "lab",
        hold_rule: bool = True,
        names: list[str] | None = None,
        min_job_age_s: int = 600,
    ) -> None:
        self.root = root
        self.min_job_age_s = min_job_age_s
        self.nodes = names or [f"{prefix}{i}" for i in range(nodes)]
        self.gpus = gpus
        self.gpu_type = gpu_type
        self.partition = partition
        self.name = name
        self.hold_rule = hold_rule
        self.conf = root / "slurm.conf"
        self.out = root / "out"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        r = self.root
        for d in ("state", "dev", "out", *(f"spool/{n}" for n in self.nodes)):
            (r / d).mkdir(parents=True, exist_ok=True)
        for i in range(self.gpus):
            dev = r / "dev" / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(195, i))  # a character device
        key = r / "munge.key"
        if not key.exists():
            subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
            key.chmod(0o400)
        subprocess.run(
            [
                "munged",
                f"--key-file={key}",
                f"--socket={r / 'munge.sock'}",
                f"--pid-file={r / 'munged.pid'}",
                f"--log-file={r / 'munged.log'}",
                f"--seed-file={r / 'munged.seed'}",
                "--force",
            ],
            check=True,
            capture_output=True,
            timeout=20,
        )
        self.conf.write_text(self._slurm_conf())
        (r / "gres.conf").write_text(
            f"AutoDetect=off\nName=gpu Type={self.gpu_type} "
            f"File={r}/dev/nvidia[0-{self.gpus - 1}]\n"
        )
        if self.hold_rule:
            (r / "job_submit.lua").write_text(HOLD_RULE.replace("{partition}", self.partition))
        self._daemon(["slurmctld", "-i", "-f", str(self.conf)])
        for n in self.nodes:
            self._daemon(["slurmd", "-f", str(self.conf), "-N", n])
        self.wait_idle(30)

    def _daemon(self, argv: list[str]) -> None:
        subprocess.run(argv, check=True, env=self.env, capture_output=True, timeout=30)

    def _slurm_conf(self) -> str:
        r = self.root
        ports = [free_port() for _ in range(len(self.nodes) + 1)]
        lines = [
            f"ClusterName={self.name}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge.sock,cred_expire=10",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "JobRequeue=1",
            f"MinJobAge={self.min_job_age_s}",
            # the end of every run, for the bridge once squeue no longer shows the job
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={r}/jobcomp.log",
            "KillWait=5",
            "MpiDefault=none",
            # apportion releases each job when it places it: Slurm's deferral of batch
            # scheduling (3 s by default) would only add latency (docs/slurm.md)
            "SchedulerParameters=batch_sched_delay=0",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd-%n.log",
        ]
        if self.hold_rule:
            lines.append("JobSubmitPlugins=lua")
        for n, port in zip(self.nodes, ports[1:], strict=True):
            lines.append(
                f"NodeName={n} NodeAddr=127.0.0.1 Port={port} CPUs=8 RealMemory=1000 "
                f"Gres=gpu:{self.gpu_type}:{self.gpus} State=UNKNOWN"
            )
        lines.append(
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES "
            "MaxTime=INFINITE State=UP"
        )
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        """Cancel every job, then end slurmd, slurmctld and munged by their pid files."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "-p", self.partition, check=False)
        pids = [*(self.root / f"slurmd-{n}.pid" for n in self.nodes)]
        pids += [self.root / "slurmctld.pid", self.root / "munged.pid"]
        for f in pids:
            _kill_by_pid_file(f)

    def stop_node(self, node: str) -> None:
        """End ``node``'s slurmd (its jobs' processes run on, as when a host's
        daemon dies); Slurm hears nothing from it until :meth:`start_node`."""
        _kill_by_pid_file(self.root / f"slurmd-{node}.pid")

    def start_node(self, node: str) -> None:
        self._daemon(["slurmd", "-f", str(self.conf), "-N", node])

    # -- driving it ----------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        done = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, *args: str, script: str = "sleep 1\n") -> int:
        """Submit ``script`` (bash) with ``args``; the job id. Output in ``out/<id>.out``."""
        path = self.root / f"job-{time.monotonic_ns()}.sh"
        path.write_text("#!/bin/bash\n" + script)
        out = self.run(
            "sbatch", "--parsable", f"--output={self.out}/%j.out", *args, str(path)
        ).strip()
        return int(out.split(";")[0])

    def jobs(self) -> dict[int, dict[str, Any]]:
        data = json.loads(self.run("squeue", "--json"))
        return {j["job_id"]: j for j in data["jobs"]}

    def job(self, job_id: int) -> dict[str, Any]:
        return self.jobs()[job_id]

    def output(self, job_id: int) -> str:
        path = self.out / f"{job_id}.out"
        return path.read_text() if path.exists() else ""

    def wait_idle(self, timeout: float = 30) -> None:
        """Until every node is idle (and slurmd answers)."""
        deadline = time.monotonic() + timeout
        want = len(self.nodes)
        while True:
            out = self.run("sinfo", "-h", "-t", "idle", "-o", "%D", check=False).split()
            if sum(int(x) for x in out if x.isdigit()) >= want:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not idle after {timeout} s: {self.run('sinfo')}")
            time.sleep(0.1)

    def clean(self) -> None:
        """Between tests: cancel every job and wait until the nodes are idle again."""
        self.run("scancel", "--full", "-p", self.partition, check=False)
        for n in self.nodes:
            self.run("scontrol", "update", f"NodeName={n}", "State=RESUME", check=False)
        self.wait_idle(60)


def _kill_by_pid_file(path: Path, timeout: float = 15) -> None:
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
