"""Slurm as the bridge sees it: the command-line calls (bounded, no PySlurm) and the
mapping rules from a Slurm job to a workload (docs/slurm.md).

- :class:`SlurmCli`: ``squeue --json``, ``scontrol show node -o``, ``scontrol
  update/release/hold/requeuehold``, ``scancel``, each a subprocess with a
  timeout (killed when it runs over);
- :class:`SlurmJob`: the fields of ``squeue --json`` (Slurm 22.05,
  ``openapi/v0.0.38``) the bridge reads;
- the mapping: :func:`workload_id`, :class:`AccountMap` (``--account`` -> budget
  leaf), :func:`submission` (a held job -> ``WorkloadSubmitted`` or the reason it
  cannot be one), :func:`exit_code_of` (Slurm's wait status -> the executor
  contract's exit code), :class:`Claim` (the bridge's record in a job's
  ``Comment`` of which attempt it released).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec
from apportion.schemas.events import ANY_GPU_TYPE, MINUTE_MS, HealthState, WorkloadSubmitted

CMD_TIMEOUT_S = 10.0
"""Every Slurm command is bounded by this many seconds (then killed; retried next round)."""

LIVE_STATES = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED"})
"""Job states in which a released run still holds its nodes."""
END_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)
"""Job states that end a run (a job stays visible in ``squeue`` for ``MinJobAge``)."""
REQUEUE_SETTLE_S = 2
"""A requeued job is released no sooner than this many seconds after its requeue:
slurmd refuses to launch a job in the same second as it killed it ("Job N already
killed, do not launch batch job": its credential's time is compared in seconds
with the revocation), and the run would fail at once with exit 1."""
LOST_STATES = frozenset({"NODE_FAIL", "BOOT_FAIL"})
"""Ends for which the run is reported lost (``failed`` whatever the exit code)."""


UNTYPED_GPU = "gpu"
"""The GPU type a node whose gres names none is registered with (apportion's nodes
always have a type; a job that names none runs on any)."""


class SlurmError(Exception):
    """A Slurm command failed or timed out."""


class SlurmJob(msgspec.Struct, kw_only=True):
    """One job of ``squeue --json`` (the fields the bridge reads)."""

    job_id: int
    job_state: str = ""
    partition: str = ""
    account: str = ""
    user_name: str = ""
    cluster: str = ""
    comment: str = ""
    state_reason: str = ""
    priority: int = 0
    nice: int = 0
    requeue: bool = True
    time_limit: int = 0
    time_minimum: int = 0
    tres_per_node: str = ""
    tres_per_job: str = ""
    node_count: int = 1
    nodes: str = ""
    restart_cnt: int = 0
    exit_code: int = 0
    batch_flag: bool = True
    submit_time: int = 0
    """Epoch seconds of the submission, or of the last requeue."""

    @property
    def held(self) -> bool:
        """Pending and held (priority 0: ``--hold``, ``scontrol hold``, the submit rule)."""
        return self.job_state == "PENDING" and self.priority == 0

    @property
    def live(self) -> bool:
        return self.job_state in LIVE_STATES

    @property
    def ended(self) -> bool:
        return self.job_state in END_STATES


def decode_jobs(text: str | bytes) -> list[SlurmJob]:
    """The jobs of ``squeue --json``; a field it writes as ``null`` (not set) takes
    its default, and fields the bridge does not read are left out."""
    data = msgspec.json.decode(text)
    fields = set(SlurmJob.__struct_fields__)
    return [
        msgspec.convert({k: v for k, v in j.items() if k in fields and v is not None}, SlurmJob)
        for j in data.get("jobs", [])
    ]


class SlurmNode(msgspec.Struct, frozen=True, kw_only=True):
    """One node of ``scontrol show node -o``."""

    name: str
    gpus: int
    gpu_type: str
    state: str
    """Slurm's state flags, e.g. ``IDLE``, ``MIXED+DRAIN``, ``DOWN*+NOT_RESPONDING``."""
    partitions: tuple[str, ...]
    reason: str = ""
    """Why it is drained or down (``Reason=``, without Slurm's ``[user@time]``)."""

    @property
    def health(self) -> HealthState:
        """apportion's health for it: ``down``, ``draining`` or ``healthy``.

        ``NOT_RESPONDING`` alone is not ``down``: a node shows it for about a second
        after ``State=RESUME``, and Slurm sets ``DOWN`` itself once ``SlurmdTimeout``
        passes without an answer."""
        flags = set(re.split(r"[+*]", self.state.upper()))
        if flags & {"DOWN", "FAIL", "POWERED_DOWN", "POWER_DOWN"}:
            return "down"
        if flags & {"DRAIN", "DRAINING", "DRAINED"}:
            return "draining"
        return "healthy"


def partition_types(nodes: list[SlurmNode]) -> dict[str, str]:
    """Partition -> the GPU type all its nodes have (partitions of mixed types are
    left out)."""
    types: dict[str, set[str]] = {}
    for n in nodes:
        for p in n.partitions:
            types.setdefault(p, set()).add(n.gpu_type)
    return {p: next(iter(ts)) for p, ts in types.items() if len(ts) == 1 and ANY_GPU_TYPE not in ts}


def parse_nodes(text: str) -> list[SlurmNode]:
    """``scontrol show node -o`` (one node a line, ``Key=value`` words)."""
    out = []
    for line in text.splitlines():
        line, _, reason = line.partition(" Reason=")
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        name = fields.get("NodeName")
        if not name:
            continue
        gpus, gpu_type = gres_gpus(fields.get("Gres", ""))
        out.append(
            SlurmNode(
                name=name,
                gpus=gpus,
                gpu_type=gpu_type or UNTYPED_GPU,
                state=fields.get("State", ""),
                partitions=tuple(p for p in fields.get("Partitions", "").split(",") if p),
                reason=re.sub(r"\s*\[[^\]]*\]\s*$", "", reason.strip()),
            )
        )
    return out


_GRES = re.compile(r"(?:gres[:/])?gpu(?::([A-Za-z0-9_.\-]+))?[:=](\d+)")


def gres_gpus(text: str) -> tuple[int, str | None]:
    """GPUs and their type in a gres or TRES string: ``gpu:fake:4``,
    ``gres:gpu:2``, ``gres/gpu=2`` (``(0, None)``: none; ``None``: no type)."""
    for part in re.split(r"[,\s]", text):
        m = _GRES.fullmatch(part.split("(")[0])
        if m:
            return int(m.group(2)), m.group(1)
    return 0, None


def exit_code_of(status: int) -> int:
    """The executor contract's exit code of Slurm's wait status (``exit_code`` of
    ``squeue --json``): the exit status, or minus the signal that killed it."""
    if status & 0x7F:
        return -(status & 0x7F)
    return (status >> 8) & 0xFF


def wait_status(exit_code: str) -> int:
    """Slurm's ``ExitCode`` text ``<exit>:<signal>`` (``sacct``, the job completion
    log) as the wait status ``squeue --json`` gives (:func:`exit_code_of` reads both)."""
    code, _, sig = exit_code.partition(":")
    return ((int(code) & 0xFF) << 8) | (int(sig or 0) & 0x7F)


def parse_sacct(text: str, job_id: int) -> SlurmJob | None:
    """The final run of ``job_id`` from ``sacct -n -P -X -o JobID,State,ExitCode``
    (``State`` may read ``CANCELLED by <uid>``); ``None`` when it has no ended row."""
    found = None
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or parts[0] != str(job_id):
            continue
        state = parts[1].split(" ")[0]
        if state in END_STATES:
            found = SlurmJob(job_id=job_id, job_state=state, exit_code=wait_status(parts[2]))
    return found


_JOBCOMP_FIELD = re.compile(r"(\w+)=(\S*)")


def parse_jobcomp(lines: Iterable[str], job_id: int) -> SlurmJob | None:
    """The last end of ``job_id`` in Slurm's job completion log
    (``JobCompType=jobcomp/filetxt``: one line per ended run, ``JobId=N ...
    JobState=S ... ExitCode=E:G``); ``None`` when the log has no end of it."""
    head = f"JobId={job_id} "
    found = None
    for line in lines:
        if not line.startswith(head):
            continue
        fields = dict(_JOBCOMP_FIELD.findall(line))
        state = fields.get("JobState", "")
        if state in END_STATES:
            found = SlurmJob(
                job_id=job_id,
                job_state=state,
                exit_code=wait_status(fields.get("ExitCode", "0:0")),
            )
    return found


def workload_id(job: SlurmJob) -> str:
    """The workload of a Slurm job: ``slurm-<cluster>-<job id>``."""
    return f"slurm-{job.cluster or 'slurm'}-{job.job_id}"


class AccountMap:
    """``--account`` -> budget leaf: the table first (``[accounts]`` of a TOML
    file: ``"llm_pretrain" = "llm/pretrain"``), else the account itself with each
    ``.`` read as ``/`` (``llm.pretrain.alice`` -> ``llm/pretrain/alice``; a ``/``
    is kept as it is)."""

    def __init__(self, table: Mapping[str, str] | None = None) -> None:
        self.table = dict(table or {})

    @classmethod
    def load(cls, path: Path | None) -> AccountMap:
        if path is None:
            return cls()
        data = tomllib.loads(path.read_text())
        table = data.get("accounts", {})
        if not isinstance(table, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in table.items()
        ):
            raise ValueError(f"{path}: [accounts] must map account names to budget paths")
        return cls(table)

    def leaf(self, account: str) -> str:
        if account in self.table:
            return self.table[account]
        return account.replace(".", "/")


def submission(
    job: SlurmJob,
    accounts: AccountMap,
    gpus_per_node: Mapping[str, int],
    at_ms: int,
    partition_type: str | None = None,
) -> WorkloadSubmitted | str:
    """The ``WorkloadSubmitted`` of held job ``job``, or why it cannot be one (a
    reason for its ``Comment``). ``gpus_per_node``: GPU type -> GPUs per node of
    the governed nodes; ``partition_type``: the GPU type of every node of the
    job's partition, if they have one (a job whose gres names no type gets it, so
    that it is placed on its own partition's nodes only). The fold checks the
    rest (owner, authority, the cap, the gang) with the same rules as for every
    other submission."""
    if not job.account:
        return "no --account: name your budget leaf with --account (see docs/slurm.md)"
    if not job.batch_flag:
        return "not a batch job: submit with sbatch"
    per_node, gres_type = gres_gpus(job.tres_per_node)
    nodes = max(1, job.node_count)
    if per_node:
        gpus = per_node * nodes
    else:
        gpus, gres_type = gres_gpus(job.tres_per_job)
        per_node = gpus
        if nodes > 1:
            return "GPUs per job over several nodes: ask per node with --gres=gpu:N --nodes=K"
    if gpus <= 0:
        return "no GPUs asked: use --gres=gpu:N (N GPUs on one node)"
    gpu_type = gres_type or partition_type or ANY_GPU_TYPE
    if nodes > 1:
        sizes = {n for t, n in gpus_per_node.items() if gpu_type in (ANY_GPU_TYPE, t)}
        if per_node not in sizes:
            whole = " or ".join(str(n) for n in sorted(sizes)) or "a whole node's"
            return (
                f"not a valid gang: {nodes} nodes x {per_node} GPUs; a job over several nodes "
                f"takes whole nodes (--gres=gpu:{whole}), a smaller one --nodes=1"
            )
    return WorkloadSubmitted(
        id=f"slurm-submit-{workload_id(job)}",
        at_ms=at_ms,
        workload=workload_id(job),
        owner=accounts.leaf(job.account),
        gpus=gpus,
        gpu_type=gpu_type,
        min_runtime_ms=job.time_minimum * MINUTE_MS,
        resumable=job.requeue,
        priority=max(-(2**31), min(2**31 - 1, -job.nice)),
        submitted_by=job.user_name,
    )


class Claim(msgspec.Struct, frozen=True):
    """What the bridge wrote in a job's ``Comment`` when it released it: attempt
    ``attempt`` of ``workload``, released at Slurm restart count ``run``."""

    workload: str
    attempt: int
    run: int


COMMENT_PREFIX = "apportion: "
_CLAIM = re.compile(r"^apportion: (\S+) attempt (\d+) run (\d+)")


def claim_text(claim: Claim, nodes: list[str]) -> str:
    return (
        f"{COMMENT_PREFIX}{claim.workload} attempt {claim.attempt} run {claim.run} "
        f"on {','.join(nodes)}"
    )


def parse_claim(comment: str) -> Claim | None:
    m = _CLAIM.match(comment)
    return None if m is None else Claim(m.group(1), int(m.group(2)), int(m.group(3)))


def _read_jobcomp(path: Path, job_id: int) -> SlurmJob | None:
    try:
        with path.open(encoding="utf-8", errors="replace") as lines:
            return parse_jobcomp(lines, job_id)
    except OSError:
        return None


class SlurmCli:
    """The Slurm commands, each bounded by ``timeout`` seconds; ``env`` carries ``SLURM_CONF``."""

    def __init__(self, env: Mapping[str, str] | None = None, timeout: float = CMD_TIMEOUT_S):
        self.env = dict(env) if env is not None else None
        self.timeout = timeout

    async def run(self, *argv: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise SlurmError(f"{' '.join(argv)}: no answer within {self.timeout:g} s") from None
        if proc.returncode != 0:
            text = err.decode(errors="replace").strip()
            raise SlurmError(f"{' '.join(argv)}: exit {proc.returncode}: {text}")
        return out.decode(errors="replace")

    async def jobs(self, partitions: frozenset[str]) -> list[SlurmJob]:
        """The jobs of ``partitions`` that ``squeue`` shows (ended ones for ``MinJobAge``)."""
        jobs = decode_jobs(await self.run("squeue", "--json"))
        return [j for j in jobs if j.partition in partitions]

    async def nodes(self, partitions: frozenset[str]) -> list[SlurmNode]:
        nodes = parse_nodes(await self.run("scontrol", "show", "node", "-o"))
        return [n for n in nodes if partitions.intersection(n.partitions)]

    async def cluster_name(self) -> str:
        """Slurm's ``ClusterName`` (``scontrol show config``)."""
        name = (await self.config()).get("ClusterName")
        if name is None:
            raise SlurmError("scontrol show config: no ClusterName")
        return name

    async def config(self) -> dict[str, str]:
        """``scontrol show config`` as key -> value."""
        out = {}
        for line in (await self.run("scontrol", "show", "config")).splitlines():
            key, sep, value = line.partition("=")
            if sep:
                out[key.strip()] = value.strip()
        return out

    async def ended_job(self, job_id: int) -> SlurmJob | None:
        """How job ``job_id`` ended, once ``squeue`` no longer shows it: from
        ``sacct`` (slurmdbd), else from the job completion log when Slurm writes
        one the bridge can read (``JobCompType=jobcomp/filetxt``); ``None`` when
        neither knows."""
        with contextlib.suppress(SlurmError):
            argv = ("sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "JobID,State,ExitCode")
            found = parse_sacct(await self.run(*argv), job_id)
            if found is not None:
                return found
        config = await self.config()
        path = config.get("JobCompLoc", "")
        if config.get("JobCompType") != "jobcomp/filetxt" or not path.startswith("/"):
            return None
        return await asyncio.to_thread(_read_jobcomp, Path(path), job_id)

    async def comment(self, job_id: int, text: str) -> None:
        await self.run("scontrol", "update", f"JobId={job_id}", f"Comment={text}")

    async def hold(self, job_id: int) -> None:
        await self.run("scontrol", "hold", str(job_id))

    async def pin_and_release(self, job_id: int, nodes: list[str], comment: str) -> None:
        """Pin to exactly ``nodes``, clear ``--time-min`` (under backfill Slurm would
        cut the time limit to it) and the ``BeginTime`` a requeue sets, record the
        claim, then release."""
        k = len(nodes)
        await self.run(
            "scontrol",
            "update",
            f"JobId={job_id}",
            f"NumNodes={k}-{k}",
            f"ReqNodeList={','.join(nodes)}",
            "TimeMin=0",
            "StartTime=now",
            f"Comment={comment}",
        )
        await self.run("scontrol", "release", str(job_id))

    async def signal(self, job_id: int, sig: str = "TERM") -> None:
        """Signal the batch script and every step."""
        await self.run("scancel", f"--signal={sig}", "--full", str(job_id))

    async def requeue_held(self, job_id: int) -> None:
        await self.run("scontrol", "requeuehold", str(job_id))

    async def cancel(self, job_id: int) -> None:
        await self.run("scancel", str(job_id))

    async def drain(self, node: str, reason: str) -> None:
        await self.run("scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")

    async def resume(self, node: str) -> None:
        await self.run("scontrol", "update", f"NodeName={node}", "State=RESUME")
