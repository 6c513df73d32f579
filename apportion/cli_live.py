"""Live commands: ``apportion up`` and the client commands that talk to its gateway.

The gateway's URL comes from ``--url``, else ``$APPORTION_URL``, else
``http://127.0.0.1:8642`` (the port ``up`` listens on by default; ``up`` prints it).
Every client command gives up after ``--timeout`` seconds (else
``$APPORTION_TIMEOUT``, else 10) with one line on stderr and exit status 2.

Client commands authenticate with a bearer token from ``--token-file FILE``,
else ``$APPORTION_TOKEN``, else ``$APPORTION_TOKEN_FILE``, else
``~/.config/apportion/token``, else ``.apportion/credentials/admin.token`` (the
admin token of an ``apportion up`` run in this folder). The gateway takes who
acts from the token; a 401 ends the command with one line and status 2.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from apportion.cli import UserError, echo_json, main
from apportion.services.auth import CREDENTIALS_ENV

URL_HELP = "gateway URL (default: $APPORTION_URL, else http://127.0.0.1:8642)"
_timeout_option = click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="seconds to wait for the gateway (default: $APPORTION_TIMEOUT, else 10)",
)
_token_option = click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="file with your bearer token (default: $APPORTION_TOKEN, $APPORTION_TOKEN_FILE, "
    "~/.config/apportion/token, .apportion/credentials/admin.token)",
)
AS_DEPRECATED = (
    "--as is deprecated: a gateway that authenticates takes who you are from your token "
    "and ignores it (it only matters for a gateway run with --no-auth)"
)
_offline_log_option = click.option(
    "--log",
    "log_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="answer from this event log (or DuckDB projection) instead of the live gateway",
)

_gpu_type_option = click.option(
    "--gpu-type",
    default=None,
    metavar="TYPE",
    help="only work that asked for this GPU type: one of the cluster's, or any",
)


def _duration_ms(text: str | None, what: str) -> int | None:
    if text is None:
        return None
    from apportion.replay.cluster_file import parse_duration_ms

    if text.strip().isdigit():
        return int(text.strip()) * 1000  # bare number: seconds
    try:
        return parse_duration_ms(text)
    except ValueError as exc:
        raise UserError(f"--{what}: {exc}") from None


def _client(url: str | None, timeout: float | None = None, token_file: Path | None = None) -> Any:
    from apportion.services.client import GatewayClient

    try:
        return GatewayClient(url, timeout, token_file=token_file)
    except ValueError as exc:  # a bad $APPORTION_TIMEOUT, an unreadable token file
        raise UserError(str(exc)) from None


def offline_or_live(
    log_path: Path | None,
    offline: Any,
    route: str,
    query: dict[str, str],
    url: str | None,
    timeout: float | None,
    token_file: Path | None,
) -> Any:
    """The answer of a command with ``--log``: ``offline(log_path, query)`` from the
    log, else the gateway's (``GatewayClient.<route>(**query)``)."""
    if log_path is not None:
        return offline(log_path, query)
    return _call(getattr(_client(url, timeout, token_file), route), **query)


def _deprecated_as(client: Any, value: str | None) -> None:
    """A note on stderr when ``--as`` is given to a client that sends a token."""
    if value is not None and client.token:
        click.echo(f"apportion: note: {AS_DEPRECATED}", err=True)


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    from apportion.services.client import GatewayError

    try:
        return fn(*args, **kwargs)
    except GatewayError as exc:
        raise UserError(exc.reason) from None


def _echo_json(data: Any) -> None:
    echo_json(data)


# --------------------------------------------------------------------------
# up
# --------------------------------------------------------------------------


@main.command()
@click.option(
    "--cluster",
    "cluster_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="cluster TOML (default: the bundled demo)",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".apportion"),
    show_default=True,
    help="nats-server store and DuckDB projection",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8642, show_default=True, help="gateway port (0: any free port)")
@click.option(
    "--replicas",
    type=click.IntRange(1, 5),
    default=1,
    show_default=True,
    help="stream replicas (3 on a 3-node cluster)",
)
@click.option("--log-level", default="info", show_default=True)
@click.option("--no-executor", is_flag=True, help="do not run the executor emulator")
@click.option(
    "--agents",
    type=click.IntRange(min=0),
    default=0,
    help="run N host agents (fake GPUs, the cluster's first N nodes; the others are "
    "marked down) that run each workload's command, instead of the emulator",
)
@click.option(
    "--slurm",
    "slurm_partitions",
    multiple=True,
    help="run the Slurm bridge (apportion slurm) on this Slurm partition (repeat for "
    "several) instead of the emulator; the cluster file's other nodes are marked down",
)
@click.option(
    "--slurm-accounts",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="with --slurm: TOML [accounts] table, Slurm account -> budget leaf",
)
@click.option(
    "--no-auth",
    is_flag=True,
    help="the gateway authenticates nobody and takes actors from request bodies (insecure)",
)
def up(
    cluster_file: Path | None,
    data_dir: Path,
    host: str,
    port: int,
    replicas: int,
    log_level: str,
    no_executor: bool,
    agents: int,
    slurm_partitions: tuple[str, ...],
    slurm_accounts: Path | None,
    no_auth: bool,
) -> None:
    """Start nats-server (unless NATS_URL is set) and every service in one process; Ctrl-C stops.

    The gateway authenticates: up makes a bearer token for the budget root's
    owner (the admin) and for every other owner of the tree, in
    DATA_DIR/credentials, and prints where they are (--no-auth: none, insecure)."""
    from apportion.replay.errors import InputFileError
    from apportion.services import logs
    from apportion.services.auth import CredentialsError
    from apportion.services.stack import load_cluster_spec, start_nats_server

    try:
        spec = load_cluster_spec(cluster_file)
    except InputFileError as exc:
        raise UserError(str(exc)) from None
    from apportion.schemas.events import NodeRegistered

    nodes = sum(isinstance(e, NodeRegistered) for e in spec.events)
    if agents > nodes:
        raise UserError(f"--agents {agents}: the cluster has {nodes} nodes")
    slurm = None
    if slurm_partitions:
        from apportion.services.slurm import SlurmOptions
        from apportion.services.slurm_jobs import AccountMap

        if agents:
            raise UserError("--slurm and --agents: choose one executor")
        try:
            table = AccountMap.load(slurm_accounts).table
        except (OSError, ValueError) as exc:
            raise UserError(f"--slurm-accounts: {exc}") from None
        slurm = SlurmOptions(partitions=slurm_partitions, accounts=table)
    logs.configure(log_level)
    if no_auth:
        click.echo(
            "apportion up: WARNING: --no-auth: the gateway authenticates nobody; anyone who "
            "can reach it may act as anyone (actors come from request bodies); NATS runs "
            "without users: any local process may publish decisions or delete the streams",
            err=True,
        )
    url = os.environ.get("NATS_URL")
    server = None
    nats_users = None
    if not url:
        config = None
        if not no_auth:
            from apportion.services.natsconf import NATS_CONF_FILE, ensure_nats_credentials
            from apportion.services.stack import adopt_unowned_streams

            folder = data_dir / "credentials"
            hosts = [e.node for e in spec.events if isinstance(e, NodeRegistered)]
            nats_users = ensure_nats_credentials(
                folder, spec.name, hosts, server="", slurm=slurm is not None
            )
            config = folder / NATS_CONF_FILE
            adopt_unowned_streams(data_dir / "nats")
        try:
            server = start_nats_server(data_dir / "nats", config=config)
        except (FileNotFoundError, RuntimeError) as exc:
            raise UserError(str(exc)) from None
        url = server.url
    try:
        asyncio.run(
            _up(
                url,
                spec,
                data_dir,
                host,
                port,
                replicas,
                not no_executor,
                not no_auth,
                server,
                agents,
                nats_users,
                slurm,
            )
        )
    except (OSError, ValueError, CredentialsError) as exc:
        raise UserError(f"cannot start: {exc}") from None
    finally:
        if server is not None:
            server.stop()


async def _up(
    url: str,
    spec: Any,
    data_dir: Path,
    host: str,
    port: int,
    replicas: int,
    executor: bool,
    auth: bool = True,
    nats: Any = None,
    agents: int = 0,
    nats_users: dict[str, str] | None = None,
    slurm: Any = None,
) -> None:
    from apportion.services.runner import STOP_GRACE_S
    from apportion.services.stack import Stack

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stack = Stack(
        url,
        spec,
        data_dir=data_dir,
        host=host,
        port=port,
        replicas=replicas,
        executor=executor,
        auth=auth,
        agents=agents,
        nats_users=nats_users,
        slurm=slurm,
        nats=nats,  # supervised: started again if it dies
        exit_grace_s=3 * STOP_GRACE_S,  # a stop that hangs ends the process
    )
    runner = asyncio.create_task(stack.run(stop))
    started = asyncio.create_task(stack.started.wait())
    await asyncio.wait([runner, started], return_when=asyncio.FIRST_COMPLETED)
    if stack.started.is_set():
        gw = stack.gateway.url if stack.gateway else None
        print(
            f"apportion up: cluster {spec.name!r} on {url}\n"
            f"gateway: {gw}\n"
            f"  export APPORTION_URL={gw}\n"
            + _credentials_text(stack.tokens, data_dir)
            + _nats_users_text(nats_users, data_dir)
            + (
                f"agents: {', '.join(stack.agents) or agents} (fake GPUs; attempts and logs in "
                f"{(data_dir / 'agents').resolve()})\n"
                f"  apportion submit --owner {_first_leaf(spec)} --gpus 1 --min-runtime 0 "
                "-- python -c 'import os; print(os.environ[\"CUDA_VISIBLE_DEVICES\"])'\n"
                if agents
                else ""
            )
            + f"  apportion submit --owner {_first_leaf(spec)} --gpus 8 --min-runtime 15m --duration 2m\n"
            "Ctrl-C stops everything.",
            file=sys.stderr,
            flush=True,
        )
    else:
        started.cancel()
    try:
        await runner
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _credentials_text(tokens: dict[str, Path], data_dir: Path) -> str:
    """What ``up`` prints about its tokens: each principal's token file, and how to use one."""
    from apportion.services.auth import ADMIN, DEFAULT_DATA_DIR, credentials_file

    if not tokens:
        return "  no authentication (--no-auth): anyone who reaches the gateway may act as anyone\n"
    admin, admin_file = next(iter(tokens.items()))
    width = max(len(p) for p in tokens)
    lines = [
        f"credentials: bearer tokens, readable by you only "
        f"(hashes in {credentials_file(data_dir).resolve()}):"
    ]
    for principal, path in tokens.items():
        role = "  (admin: owns the budget root)" if principal == admin else ""
        lines.append(f"  {principal:<{width}}  {path.resolve()}{role}")
    lines.append(f"  export APPORTION_TOKEN_FILE={admin_file.resolve()}   # act as {admin}")
    if admin == ADMIN and data_dir == DEFAULT_DATA_DIR:
        lines.append("  (the CLI run in this folder uses the admin token without it)")
    lines.append(
        "  to act as someone else, point APPORTION_TOKEN_FILE at their file; more tokens: "
        f"apportion auth issue NAME --file {credentials_file(data_dir).resolve()}"
    )
    return "\n".join(lines) + "\n"


def _nats_users_text(users: dict[str, str] | None, data_dir: Path) -> str:
    """What ``up`` prints about its NATS users."""
    from apportion.services.natsconf import NATS_USERS_FILE

    if users is None:
        return ""
    file = (data_dir / "credentials" / NATS_USERS_FILE).resolve()
    return (
        f"nats: a user per role and per host ({len(users)}), passwords readable by you only in {file}\n"
        "  (audit or replay --cluster as the auditor: NATS_URL=nats://auditor:<password>@host:port)\n"
    )


def _first_leaf(spec: Any) -> str:
    paths = [p for p, _w, _o in spec.budget if p]
    leaves = [p for p in paths if not any(q.startswith(p + "/") for q in paths)]
    return leaves[0] if leaves else "<leaf>"


# --------------------------------------------------------------------------
# client commands
# --------------------------------------------------------------------------


JOB_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "owner": str,
    "gpus": int,
    "min_runtime": (str, int, float),
    "duration": (str, int, float),
    "priority": int,
    "resumable": bool,
    "gpu_type": str,
    "command": (list, str),
    "env": dict,
    "image": str,
    "grace": (str, int, float),
}
"""The fields of ``submit --file job.toml`` (the CLI's options, by the same names)."""


def _read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's tables, or a one-line error naming the file."""
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: TOML syntax: {exc}") from None


def read_job_file(path: Path) -> dict[str, Any]:
    """A job file (TOML): the fields of :data:`JOB_FIELDS`, checked; a ``[job]``
    table or the top level."""
    import shlex

    doc = _read_toml(path)
    table = doc.get("job", doc)
    if not isinstance(table, dict):
        raise UserError(f"{path}: [job] must be a table")
    unknown = sorted(set(table) - set(JOB_FIELDS))
    if unknown:
        raise UserError(
            f"{path}: unknown field {unknown[0]!r} (known: {', '.join(sorted(JOB_FIELDS))})"
        )
    for key, value in table.items():
        kind = JOB_FIELDS[key]
        if isinstance(value, bool) and kind is not bool:
            raise UserError(f"{path}: {key}: expected {_kind_name(kind)}, got a boolean")
        if not isinstance(value, kind):
            raise UserError(f"{path}: {key}: expected {_kind_name(kind)}")
    job = dict(table)
    if isinstance(job.get("command"), str):
        job["command"] = shlex.split(job["command"])
    if not all(isinstance(a, str) for a in job.get("command", [])):
        raise UserError(f"{path}: command: a list of strings (or one string)")
    env = job.get("env", {})
    if not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in env.values()):
        raise UserError(f"{path}: env: values must be strings or numbers")
    job["env"] = {str(k): str(v) for k, v in env.items()}
    for key in ("min_runtime", "duration", "grace"):
        if isinstance(job.get(key), int | float):
            job[key] = str(job[key])  # a bare number: seconds
    return job


def _kind_name(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    names |= {list: "a list", dict: "a table"}
    return " or ".join(dict.fromkeys(names[k] for k in kinds))


def _env_pairs(pairs: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise UserError(f"--env {pair!r}: give NAME=VALUE")
        out[name] = value
    return out


@main.command(context_settings={"allow_interspersed_args": False})
@click.option("--owner", default=None, help="budget leaf path, e.g. llm/pretrain (required)")
@click.option("--gpus", type=int, default=None, help="GPUs (required)")
@click.option(
    "--min-runtime",
    default=None,
    help='protected minimum runtime ("15m", "2h", "0" for unallocated; required)',
)
@click.option(
    "--duration",
    default=None,
    help="how long it runs (the emulator honours it; an agent runs a job without a "
    "command for that long)",
)
@click.option("--priority", type=int, default=None, help="order inside the leaf only (default 0)")
@click.option("--no-resume", is_flag=True, help="a preemption ends it instead of requeueing")
@click.option("--gpu-type", default=None, help="GPU type (default: any)")
@click.option(
    "--id",
    "workload_id",
    default=None,
    help="workload id (default: generated here, so that a retry is stored once)",
)
@click.option(
    "--env",
    "env_pairs",
    multiple=True,
    metavar="NAME=VALUE",
    help="environment for the command (repeatable)",
)
@click.option(
    "--grace",
    default=None,
    help='preemption notice: SIGTERM, then SIGKILL after this ("30s"; default: the policy\'s)',
)
@click.option("--image", default=None, help="run the command in this container image")
@click.option(
    "--file",
    "job_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="a job file (TOML) with these fields; options given here override it",
)
@click.option(
    "--as",
    "submitted_by",
    default=None,
    help="deprecated: who submits, for a gateway run with --no-auth only (default: $USER)",
)
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
@click.option("--json", "as_json", is_flag=True)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def submit(
    owner: str | None,
    gpus: int | None,
    min_runtime: str | None,
    duration: str | None,
    priority: int | None,
    no_resume: bool,
    gpu_type: str | None,
    workload_id: str | None,
    env_pairs: tuple[str, ...],
    grace: str | None,
    image: str | None,
    job_file: Path | None,
    submitted_by: str | None,
    url: str | None,
    timeout: float | None,
    token_file: Path | None,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Submit a workload (as the principal of your token): apportion submit --owner
    llm/a --gpus 8 --min-runtime 1h -- python train.py --lr 3e-4

    The host agents run COMMAND (after --) with --env and the contract variables
    (docs/agent.md). A submit the gateway could not get acknowledged (504) is
    sent again with the same id until it is, or until the timeout; then the
    error names the id, and submitting again with ``--id`` is safe (an id is
    stored once)."""
    from apportion.services.client import GatewayError, new_workload_id

    job = read_job_file(job_file) if job_file is not None else {}
    given = {
        "id": workload_id,
        "owner": owner,
        "gpus": gpus,
        "min_runtime": min_runtime,
        "duration": duration,
        "priority": priority,
        "gpu_type": gpu_type,
        "image": image,
        "grace": grace,
        "command": list(command) or None,
    }
    job.update({k: v for k, v in given.items() if v is not None})
    if no_resume:
        job["resumable"] = False
    job["env"] = {**job.get("env", {}), **_env_pairs(env_pairs)}
    missing = [f"--{k.replace('_', '-')}" for k in ("owner", "gpus", "min_runtime") if k not in job]
    if missing:
        raise UserError(f"missing {', '.join(missing)} (give it here or in --file)")
    workload = job.get("id") or new_workload_id()
    client = _client(url, timeout, token_file)
    _deprecated_as(client, submitted_by)
    try:
        out = client.submit(
            id=workload,
            owner=job["owner"],
            gpus=job["gpus"],
            min_runtime_ms=_duration_ms(job["min_runtime"], "min-runtime"),
            duration_ms=_duration_ms(job.get("duration"), "duration"),
            priority=job.get("priority", 0),
            resumable=job.get("resumable", True),
            gpu_type=job.get("gpu_type", "any"),
            submitted_by=submitted_by or os.environ.get("USER", ""),
            command=job.get("command") or None,
            env=job["env"] or None,
            image=job.get("image") or None,
            grace_ms=_duration_ms(job.get("grace"), "grace"),
        )
    except GatewayError as exc:
        if exc.status == 504 or exc.sent:
            raise UserError(
                f"{exc.reason} [workload {workload}: it may be stored; to retry, submit again "
                f"with --id {workload}]"
            ) from None
        raise UserError(exc.reason) from None
    if as_json:
        _echo_json(out)
    elif out.get("seq") is None:
        click.echo(f"submitted {out['workload']} (an earlier attempt was stored)")
    else:
        click.echo(
            f"submitted {out['workload']} (input {out['seq']}{', duplicate' if out.get('duplicate') else ''})"
        )


@main.command()
@click.argument("workload")
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
def cancel(workload: str, url: str | None, timeout: float | None, token_file: Path | None) -> None:
    """Cancel a pending or running workload (retried like a submit; a cancel is stored once)."""
    out = _call(_client(url, timeout, token_file).cancel, workload, os.environ.get("USER", ""))
    _echo_published("cancel", out)


def _echo_published(what: str, out: dict[str, Any]) -> None:
    """``cancel of w published (input 12)``, or that an earlier attempt was stored."""
    if out.get("seq") is None:
        click.echo(f"{what} of {out['workload']} published (an earlier attempt was stored)")
    else:
        click.echo(f"{what} of {out['workload']} published (input {out['seq']})")


def _hold_command(
    workload: str, release: bool, url: str | None, timeout: float | None, token_file: Path | None
) -> None:
    what = "release" if release else "hold"
    client = _client(url, timeout, token_file)
    out = _call(client.hold, workload, os.environ.get("USER", ""), release)
    _echo_published(what, out)


@main.command()
@click.argument("workload")
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
def hold(workload: str, url: str | None, timeout: float | None, token_file: Path | None) -> None:
    """Hold a pending workload: it stays in the queue but is not placed until released
    (like scontrol hold; its submitter or an owner above its leaf may)."""
    _hold_command(workload, False, url, timeout, token_file)


@main.command()
@click.argument("workload")
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
def release(workload: str, url: str | None, timeout: float | None, token_file: Path | None) -> None:
    """Release a held workload: it is scheduled again at its old place in the queue."""
    _hold_command(workload, True, url, timeout, token_file)


def _ratios(row: dict[str, Any]) -> str:
    """``llm 42% > llm/pretrain 80%``: each level's usage as a percentage of its share."""
    parts = []
    for r in row.get("ratios", []):
        pct = r.get("share_pct")
        parts.append(f"{r['path']} {pct:.0f}%" if pct is not None else f"{r['path']} -")
    return " > ".join(parts) or "-"


def _start(row: dict[str, Any], now_ms: int) -> str:
    from apportion.services.views import iso, relative

    start = row.get("estimated_start_ms")
    if start is None:
        return "unknown"
    rel = relative(start, now_ms)
    return f"{iso(start)[5:16].replace('T', ' ')} ({rel})"


def _section(name: str, shown: int, total: int | None) -> str:
    """``running: 4``, or ``running: 1 of 4`` when a filter left some out."""
    if total is None or total == shown:
        return f"{name}: {shown}"
    return f"{name}: {shown} of {total}"


def _print_queue(data: dict[str, Any]) -> None:
    from apportion.services.views import span

    now = data.get("now_ms", data["at_ms"])
    totals = data.get("totals") or {}
    state = (data.get("filter") or {}).get("state")
    if state != "running":
        click.echo(_section("pending", len(data["pending"]), totals.get("pending")))
        click.echo(
            f"{'POS':>4} {'WORKLOAD':<24} {'OWNER':<22} {'GPUS':>5} {'PRIO':>4} {'WAIT':>12}  "
            f"{'START (UTC, estimated)':<32} {'REASON':<22} USED OF SHARE (top down)"
        )
        for row in data["pending"]:
            click.echo(
                f"{row['position'] if row['position'] is not None else '-':>4} {row['workload']:<24} {row['owner']:<22} {row['gpus']:>5} "
                f"{row['priority']:>4} {span(row['wait_ms']):>12}  {_start(row, now):<32} "
                f"{row.get('reason', '-'):<22} "
                f"{_ratios(row) if row['allocated'] else 'unallocated'}"
                + (
                    f" [ranked low by other clusters: {oc}]"
                    if (oc := row.get("other_clusters"))
                    else ""
                )
            )
        if data.get("estimate_assumption"):
            click.echo(f"START: estimated {data['estimate_assumption']}")
    if state == "pending":
        return
    click.echo(_section("running", len(data["running"]), totals.get("running")))
    click.echo(
        f"{'':>4} {'WORKLOAD':<24} {'OWNER':<22} {'GPUS':>5} {'RAN':>12}  "
        f"{'ENDS (UTC, estimated)':<32} NODES"
    )
    for row in data["running"]:
        where = ",".join(f"{n}:{g}" for n, g in row["placement"])
        end = row.get("expected_end_ms")
        ends = _start({"estimated_start_ms": end}, now)
        ran = span(max(0, now - row["started_ms"]))
        click.echo(
            f"{'':>4} {row['workload']:<24} {row['owner']:<22} {row['gpus']:>5} {ran:>12}  "
            f"{ends:<32} {where}"
        )


@main.command()
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--watch",
    "watch",
    type=click.FloatRange(min=0.2),
    default=None,
    metavar="SECONDS",
    help="show the queue again every SECONDS until Ctrl-C",
)
@click.option("--user", default=None, help="only work submitted by this principal")
@click.option("--team", default=None, help="only work owned at or below this budget path")
@click.option("--state", default=None, metavar="STATE", help="only pending or only running work")
@_gpu_type_option
def queue(
    url: str | None,
    timeout: float | None,
    token_file: Path | None,
    as_json: bool,
    watch: float | None,
    user: str | None,
    team: str | None,
    state: str | None,
    gpu_type: str | None,
) -> None:
    """Pending workloads in scheduling order (how much of its share each level of the
    sort key has used, the estimated start), then running ones; like squeue,
    --user, --team and --state keep some of them (POS stays the place in the whole
    queue); --gpu-type keeps the work that asked for that GPU type.

    WAIT is measured to now; START is when the workload is estimated to start if
    nothing new arrives (no new submission, cancel or health change; running work
    ends when its duration hint says); REASON why it waits (docs/reasons.md). RAN is how long a run has run; ENDS when
    it is expected to end (from its duration hint)."""
    import time

    client = _client(url, timeout, token_file)
    try:
        while True:
            data = _call(client.queue, user=user, team=team, state=state, gpu_type=gpu_type)
            if as_json:
                echo_json(data, indent=None if watch else 2)  # --watch: one document a line
            else:
                if watch:
                    from apportion.services.views import iso

                    click.clear()
                    now = iso(data.get("now_ms", data["at_ms"]))
                    click.echo(f"apportion queue at {now} (every {watch:g} s, Ctrl-C stops)")
                _print_queue(data)
            if not watch:
                return
            time.sleep(watch)
    except KeyboardInterrupt:  # --watch ends with Ctrl-C
        return


@main.command()
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
@click.option("--json", "as_json", is_flag=True)
def share(url: str | None, timeout: float | None, token_file: Path | None, as_json: bool) -> None:
    """The budget tree with usage against allocation (like sshare).

    USED/SHARE is the usage charged in the lookback window as a percentage of the
    node's share of it (global share x healthy GPUs x window); RUN GPUS and PEND
    GPUS are the GPUs of its allocated work running and pending now.

    On a cluster that shares its tree with others (docs/semantics.md, "Several
    clusters, one budget tree"): HERE is the usage charged on this cluster, ELSEWHERE
    on the others (from their usage summaries), RANKED what the ratios count (both,
    plus the committed rest of running work's protections), and OF SHARE that as a
    percentage of the node's share of what the whole tree used; then until when
    each other cluster's usage is counted."""
    data = _call(_client(url, timeout, token_file).share)
    if as_json:
        _echo_json(data)
        return
    if "federation" in data:
        _print_federated_share(data)
        return
    click.echo(
        f"{'PATH':<30} {'WEIGHT':>6} {'SHARE':>7} {'ALLOCATION':>14} {'USAGE':>14} {'USED/SHARE':>10} {'RUN GPUS':>8} {'PEND GPUS':>9}"
    )

    def cells(n: dict[str, Any]) -> str:
        alloc = n.get("allocation_gpu_h", 0.0)
        used = f"{100 * n['usage_gpu_h'] / alloc:.0f}%" if alloc else "-"
        return (
            f"{alloc:>8.1f} GPU-h {n['usage_gpu_h']:>8.1f} GPU-h {used:>10} "
            f"{n['running_gpus']:>8} {n['pending_gpus']:>9}"
        )

    _print_share_tree(data, cells)


def _print_share_tree(data: dict[str, Any], cells: Callable[[dict[str, Any]], str]) -> None:
    """One line per budget node, depth first: its name indented by depth, weight,
    global share, then ``cells(node)``."""

    def walk(n: dict[str, Any], depth: int) -> None:
        name = ("  " * depth + (n["path"].rsplit("/", 1)[-1] or "(root)"))[:30]
        click.echo(f"{name:<30} {n['weight']:>6} {100 * n['global_share']:>6.1f}% " + cells(n))
        for c in n["children"]:
            walk(c, depth + 1)

    walk(data, 0)


def _print_federated_share(data: dict[str, Any]) -> None:
    """``apportion share`` of a federated cluster: usage here and on the other
    clusters, what ranks, the percentage of the share of the tree's usage."""
    import time

    from apportion.services.views import peers_words

    fed = data["federation"]
    click.echo(
        f"{'PATH':<30} {'WEIGHT':>6} {'SHARE':>7} {'HERE':>14} {'ELSEWHERE':>14} "
        f"{'RANKED':>14} {'OF SHARE':>8} {'RUN GPUS':>8} {'PEND GPUS':>9}"
    )

    def cells(n: dict[str, Any]) -> str:
        pct = n.get("share_pct")
        used = f"{pct:.0f}%" if pct is not None else "-"
        return (
            f"{n['usage_here_gpu_h']:>8.1f} GPU-h {n['usage_peers_gpu_h']:>8.1f} GPU-h "
            f"{n['ranked_gpu_h']:>8.1f} GPU-h {used:>8} {n['running_gpus']:>8} "
            f"{n['pending_gpus']:>9}"
        )

    _print_share_tree(data, cells)
    me = fed.get("cluster") or "this cluster"
    click.echo(f"OF SHARE: {fed['share_basis_text']} ({me}'s capacity alone is no measure)")
    for line in peers_words(fed["peers"], int(time.time() * 1000)):
        click.echo(line)


def _parse_at(text: str | None) -> int | None:
    """``--at``: ISO-8601 (``2026-11-30T14:05:00Z``; no zone = UTC), epoch milliseconds,
    or simulated time ``day D HH:MM`` (day 0 starts at epoch 0)."""
    if text is None:
        return None
    import datetime as dt
    import re

    t = text.strip()
    if t.isdigit():
        return int(t)
    sim = re.fullmatch(r"day\s+(\d{1,6})(?:\s+(\d{1,2}):(\d{2}))?", t, re.IGNORECASE)
    if sim:
        day, hour, minute = int(sim[1]), int(sim[2] or 0), int(sim[3] or 0)
        if hour > 23 or minute > 59:
            raise UserError(f"--at: {text!r}: the time of day is HH:MM, 00:00 to 23:59")
        return ((day * 24 + hour) * 60 + minute) * 60_000
    try:
        when = dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise UserError(
            f"--at: {text!r} is neither an ISO-8601 time (2026-11-30T14:05:00Z), "
            "a simulated time (day 3 14:05) nor epoch ms"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp() * 1000)


def explain_offline(log_path: Path, workload: str, at_ms: int | None) -> dict[str, Any] | None:
    """``explain`` from an event log (or a DuckDB projection): the log folded, then
    the live gateway's view function, with times relative to the log's time
    (or ``at_ms``), never the wall clock; a simulation's times (before 2000) read
    ``day D HH:MM``."""
    from apportion.replay.eventlog import LogError, open_log
    from apportion.services.views import explain as explain_view
    from apportion.services.views import is_simulated, replay_history, simulated_clock

    try:
        log = open_log(log_path)
        state, history = replay_history(log, at_ms, cluster=log.header.cluster)
    except LogError as exc:
        raise UserError(str(exc)) from None
    now = max(state.now_ms, at_ms) if at_ms is not None else state.now_ms
    with simulated_clock(is_simulated(now)):
        return explain_view(state, history, workload, now_ms=now)


@main.command()
@click.argument("workload")
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
@click.option("--json", "as_json", is_flag=True)
@_offline_log_option
@click.option(
    "--at",
    "at",
    default=None,
    metavar="TIME",
    help="with --log: the answer as it stood at TIME (ISO-8601, UTC if no zone; or epoch ms)",
)
def explain(
    workload: str,
    url: str | None,
    timeout: float | None,
    token_file: Path | None,
    as_json: bool,
    log_path: Path | None,
    at: str | None,
) -> None:
    """Why a workload is pending, running, preempted or ended (and when it is
    estimated to start). With --log FILE the answer comes from history, the same
    way the gateway answers live."""
    if at is not None and log_path is None:
        raise UserError("--at needs --log FILE (the live answer is always now)")
    if log_path is not None:
        data = explain_offline(log_path, workload, _parse_at(at))
        if data is None:
            raise UserError(f"unknown workload {workload!r} in {log_path}")
    else:
        data = _call(_client(url, timeout, token_file).explain, workload)
    if as_json:
        _echo_json(data)
        return
    click.echo(f"{data['workload']}: {data['status']}")
    for r in data.get("reasons", []):
        click.echo(f"  - {r}")


def jobs_offline(log_path: Path, query: dict[str, str]) -> dict[str, Any]:
    """``jobs`` from an event log (or a DuckDB projection), as the gateway answers it."""
    from apportion.replay.eventlog import LogError, open_log
    from apportion.services.job_history import JobQuery, QueryError, list_jobs
    from apportion.services.views import gpu_types_of, replay_history

    try:
        log = open_log(log_path)
        state, history = replay_history(log, cluster=log.header.cluster)
    except LogError as exc:
        raise UserError(str(exc)) from None
    now = state.now_ms  # times and --since measured to the log's last event
    try:
        parsed = JobQuery.parse(query, now, gpu_types_of(state))
    except QueryError as exc:
        raise UserError(str(exc)) from None
    return list_jobs(history.jobs, parsed, now)


def _print_jobs(data: dict[str, Any]) -> None:
    from apportion.services.views import iso

    rows = data["jobs"]
    click.echo(
        f"{'WORKLOAD':<24} {'STATE':<10} {'OWNER':<22} {'USER':<12} {'GPUS':>5} {'TRIES':>5} "
        f"{'ENDED (UTC)':<20} {'EXIT':>5}  NODES / WHY"
    )
    for r in rows:
        ended = iso(r["ended_ms"])[:19].replace("T", " ") if r["ended_ms"] is not None else "-"
        code = "-" if r["exit_code"] is None else str(r["exit_code"])
        where = ",".join(r["nodes"])
        why = "  ".join(x for x in (where, r["note"]) if x) or "-"
        status = "held" if r.get("held_ms") is not None else r["status"]
        click.echo(
            f"{r['workload']:<24} {status:<10} {r['owner']:<22} "
            f"{(r['submitted_by'] or '-'):<12} {r['gpus']:>5} {r['attempts']:>5} "
            f"{ended:<20} {code:>5}  {why}"
        )
    more = f"; the newest {len(rows)} shown (--limit)" if data["truncated"] else ""
    click.echo(f"{data['matched']} matched{more}")
    kept = data.get("kept") or {}
    if kept.get("dropped"):
        click.echo(
            f"(the gateway keeps the last {kept['max_ended']:,} ended workloads; "
            f"{kept['dropped']:,} older ones are in the projection: apportion sql)"
        )


@main.command()
@click.option(
    "--state",
    "states",
    multiple=True,
    metavar="STATE",
    help="succeeded, failed, cancelled, preempted, rejected, pending, running, held "
    "(pending and held); or ended (the default), live, all; repeat or comma-separate for several",
)
@click.option("--all", "all_states", is_flag=True, help="every state (the same as --state all)")
@click.option("--user", default=None, help="submitted by this principal")
@click.option("--team", default=None, help="owned at or below this budget path (llm, llm/pretrain)")
@click.option("--id", "wid", default=None, help="workloads whose id contains this")
@click.option(
    "--since",
    default=None,
    metavar="WHEN",
    help="ended since: a duration back (2d, 12h, 90m; at most a year), an ISO-8601 time "
    "(UTC if no zone) or epoch ms; live jobs always match",
)
@click.option(
    "--limit", type=int, default=None, help="at most this many, newest first (1-1000, default 50)"
)
@_gpu_type_option
@click.option("--json", "as_json", is_flag=True)
@_offline_log_option
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
def jobs(
    states: tuple[str, ...],
    all_states: bool,
    user: str | None,
    team: str | None,
    wid: str | None,
    since: str | None,
    limit: int | None,
    gpu_type: str | None,
    as_json: bool,
    log_path: Path | None,
    url: str | None,
    timeout: float | None,
    token_file: Path | None,
) -> None:
    """Ended workloads (or any, with --all / --state), newest first: state, owner,
    who submitted, attempts, when it ended, exit code, where its last attempt ran
    and why it ended. `apportion explain ID` has a workload's whole history."""
    if all_states and states:
        raise UserError("give --all or --state, not both")
    query: dict[str, str] = {}
    if all_states or states:
        query["state"] = "all" if all_states else ",".join(states)
    for key, value in (
        ("user", user),
        ("team", team),
        ("id", wid),
        ("since", since),
        ("gpu_type", gpu_type),
    ):
        if value is not None:
            query[key] = value
    if limit is not None:
        query["limit"] = str(limit)
    data = offline_or_live(log_path, jobs_offline, "jobs", query, url, timeout, token_file)
    if as_json:
        _echo_json(data)
        return
    from apportion.services.views import is_simulated, simulated_clock

    # a simulation's log (its time before 2000): ENDED reads day D HH:MM
    offline_sim = log_path is not None and is_simulated(data.get("now_ms", data.get("at_ms", 0)))
    with simulated_clock(offline_sim):
        _print_jobs(data)


FOLLOW_POLL_S = 1.0
"""How long ``logs --follow`` waits between two reads."""
FOLLOW_END_S = 15.0
"""How long ``logs --follow`` waits, once the attempt has ended, for its agent to
ship the end of its log before it stops anyway (a dead agent ships nothing)."""


def _last_lines(text: str, lines: int) -> str:
    if lines <= 0:
        return ""
    parts = text.splitlines(keepends=True)
    return "".join(parts[-lines:])


@main.command()
@click.argument("workload")
@click.option("--attempt", type=click.IntRange(min=1), default=None, help="default: the last")
@click.option(
    "--node", default=None, help="the host of a gang's rank (default: the first that started it)"
)
@click.option("--follow", "-f", is_flag=True, help="keep printing new output until the run ends")
@click.option(
    "--tail",
    "tail_lines",
    type=click.IntRange(min=0),
    default=None,
    metavar="LINES",
    help="print only the last LINES lines of what is there now",
)
@click.option("--json", "as_json", is_flag=True, help="the API's answer (not with --follow)")
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
def logs(
    workload: str,
    attempt: int | None,
    node: str | None,
    follow: bool,
    tail_lines: int | None,
    as_json: bool,
    url: str | None,
    timeout: float | None,
    token_file: Path | None,
) -> None:
    """An attempt's output (stdout and stderr), as its host's agent shipped it to the
    bus: the last MiB of each attempt, for 7 days (docs/agent.md, "Logs on the
    bus"). The emulator's runs have none. --follow prints new output as it comes
    and stops once the attempt has ended and all of it was read."""
    import time

    from apportion.services.client import GatewayError

    if as_json and follow:
        raise UserError("--json shows one answer: give it without --follow")
    client = _client(url, timeout, token_file)

    def read(offset: int) -> dict[str, Any]:
        return _call(client.logs, workload, attempt, node, offset)

    try:
        while True:
            try:
                data = client.logs(workload, attempt, node, 0)
                break
            except GatewayError as exc:
                if not follow or exc.status != 400:
                    raise UserError(exc.reason) from None
                # a workload not placed yet: wait for its first attempt
                state = _call(client.workload, workload).get("status")
                if state != "pending":
                    raise UserError(exc.reason) from None
                time.sleep(FOLLOW_POLL_S)
        if as_json:
            _echo_json(data)
            return
        if not data["shipped"] and data["complete"]:
            raise UserError(f"{workload}: {data['note']}")
        if data["note"] and data["shipped"]:
            click.echo(f"apportion: note: {data['note']}", err=True)
        text = data["text"]
        if tail_lines is not None:
            text = _last_lines(text, tail_lines)
        click.echo(text, nl=False)
        sys.stdout.flush()
        if not follow:
            return
        attempt, node = data["attempt"], data["node"]  # follow this one
        quiet_since: float | None = None
        while not data["complete"]:
            time.sleep(FOLLOW_POLL_S)
            before = data["next"]
            data = read(before)
            if data["dropped"]:
                click.echo(
                    f"\napportion: note: {data['dropped']:,} bytes dropped while following "
                    "(over the bound)",
                    err=True,
                )
            click.echo(data["text"], nl=False)
            sys.stdout.flush()
            if data["attempt_ended"] and not data["complete"]:
                if data["next"] != before or quiet_since is None:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > FOLLOW_END_S:
                    click.echo(
                        f"apportion: attempt {attempt} ended, but its agent shipped no end of "
                        f"its log within {FOLLOW_END_S:g} s; stopped following",
                        err=True,
                    )
                    break
        if data["status"] in ("pending", "running") and data["attempts"][-1] != attempt:
            click.echo(
                f"apportion: note: {workload} runs again as attempt {data['attempts'][-1]}: "
                f"apportion logs {workload} --attempt {data['attempts'][-1]} --follow",
                err=True,
            )
    except KeyboardInterrupt:
        sys.exit(130)


def _print_nodes(data: dict[str, Any]) -> None:
    from apportion.services.views import iso, relative

    now = data.get("now_ms", data["at_ms"])
    click.echo(
        f"{'NODE':<20} {'TYPE':<10} {'GPUS':>4} {'FREE':>4} {'STATE':<9} {'RUNS':>4} "
        f"{'PROTECTED UNTIL (UTC)':<22} WORKLOADS / LAST CHANGE"
    )
    for r in data["nodes"]:
        shown = "drained" if r["drained"] else r["state"]
        until = r["protected_until_ms"]
        protected = iso(until)[5:16].replace("T", " ") if until is not None else "-"
        parts = [",".join(r["workloads"])] if r["workloads"] else []
        change = r.get("last_change")
        if change:
            words = (
                f"{change['state']} by {change['actor'] or '?'} {relative(change['at_ms'], now)}"
            )
            if change.get("reason"):
                words += f": {change['reason']}"
            parts.append(words)
        click.echo(
            f"{r['node']:<20} {r['gpu_type']:<10} {r['gpus']:>4} {r['free']:>4} {shown:<9} "
            f"{len(r['workloads']):>4} {protected:<22} {'  '.join(parts) or '-'}"
        )
    total = sum(r["gpus"] for r in data["nodes"])
    free = sum(r["free"] for r in data["nodes"])
    which = f" {data['state']}" if data.get("state") else ""
    click.echo(f"{len(data['nodes'])}{which} nodes, {total} GPUs, {free} free")


@main.command()
@click.option(
    "--state",
    default=None,
    metavar="STATE",
    help="only nodes in this state: healthy, draining (drained ones too) or down",
)
@click.option("--json", "as_json", is_flag=True)
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
def nodes(
    state: str | None,
    as_json: bool,
    url: str | None,
    timeout: float | None,
    token_file: Path | None,
) -> None:
    """Every node, like sinfo: GPU type, GPUs, free GPUs, state (drained: a draining
    node with nothing left on it), the workloads running there, when the last of
    their protections ends, and the last health change (who, when, why) when the
    gateway saw it."""
    data = _call(_client(url, timeout, token_file).nodes, state)
    if as_json:
        _echo_json(data)
        return
    _print_nodes(data)


@main.group()
def node() -> None:
    """Drain, undrain or take down a node (operators and the budget root's owner)."""


_HEALTH_OF = {"drain": "draining", "undrain": "healthy", "down": "down"}
_HEALTH_HELP = {
    "drain": "Drain NODE: it takes no new work; running work keeps its protection, then "
    "is preempted; `apportion nodes` says drained once it is empty.",
    "undrain": "Put NODE back in service (healthy), from draining or down.",
    "down": "Take NODE down now: its running work is preempted at once (requeued if "
    "resumable) and it takes nothing until undrained.",
}


def _health_command(verb: str) -> None:
    @node.command(verb, help=_HEALTH_HELP[verb])
    @click.argument("name", metavar="NODE")
    @click.option("--reason", default="", help="why, in words (kept in the history)")
    @click.option("--url", default=None, help=URL_HELP)
    @_timeout_option
    @_token_option
    def command(
        name: str, reason: str, url: str | None, timeout: float | None, token_file: Path | None
    ) -> None:
        state = _HEALTH_OF[verb]
        out = _call(
            _client(url, timeout, token_file).node_health,
            name,
            state,
            reason,
            os.environ.get("USER", ""),
        )
        if out.get("seq") is None:
            click.echo(f"node {name}: {state} (an earlier attempt was stored)")
        else:
            click.echo(f"node {name}: {state} (input {out['seq']})")


for _verb in _HEALTH_OF:
    _health_command(_verb)


@main.command()
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
@click.option("--json", "as_json", is_flag=True)
def status(url: str | None, timeout: float | None, token_file: Path | None, as_json: bool) -> None:
    """The gateway's view: cluster, inputs and batches folded, nodes, pending, running."""
    from apportion.services.views import iso

    data = _call(_client(url, timeout, token_file).status)
    if as_json:
        _echo_json(data)
        return
    click.echo(
        f"cluster {data['cluster']}: {data['nodes']} nodes, {data['pending']} pending, "
        f"{data['running']} running; {data['input_seq']} inputs and {data['batches']} "
        f"decision batches folded, last event at {iso(data['now_ms'])}"
    )
    if data.get("caught_up") is False:
        click.echo("the gateway is still catching up with the history")
    missing = data.get("missing")
    if missing:
        click.echo(
            f"history NOT WHOLE: inputs {missing['first']}..{missing['through']} "
            f"({missing['count']} inputs) are missing from INPUTS and no loss was accepted; "
            "submits are refused (503) until an operator runs "
            f"`apportion history accept-loss --cluster {data['cluster']} "
            f"--through {missing['through']}` (docs/services.md, 'Lost inputs')"
        )
    for first, through in data.get("lost") or []:
        click.echo(f"inputs {first}..{through} were lost; the loss was accepted")


@main.group()
def budget() -> None:
    """Show or edit the budget tree."""


def _strip_detail(node: dict[str, Any]) -> dict[str, Any]:
    keep = ("path", "weight", "owner", "global_share", "usage_gpu_h")
    return {**{k: node[k] for k in keep}, "children": [_strip_detail(c) for c in node["children"]]}


@budget.command("show")
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
@click.option("--json", "as_json", is_flag=True)
def budget_show(
    url: str | None, timeout: float | None, token_file: Path | None, as_json: bool
) -> None:
    """The tree as nested {path, weight, owner, global_share, usage_gpu_h, children}."""
    data = _strip_detail(_call(_client(url, timeout, token_file).budget))
    if as_json:
        _echo_json(data)
        return

    def walk(n: dict[str, Any], depth: int) -> None:
        name = "  " * depth + (n["path"].rsplit("/", 1)[-1] or "(root)")
        click.echo(
            f"{name:<30} weight {n['weight']:>5}  owner {n['owner']:<12} share {n['global_share']:.4f}  usage {n['usage_gpu_h']:.2f} GPU-h"
        )
        for c in n["children"]:
            walk(c, depth + 1)

    walk(data, 0)


def budget_from_toml(doc: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """``(root owner, [{"path","weight","owner"}...])`` parents first, from a file's ``[budget]`` table."""
    table = doc.get("budget")
    if not isinstance(table, dict):
        raise UserError("no [budget] table in the file")
    root_owner = table.get("owner", "")
    out: list[dict[str, Any]] = []
    if root_owner:
        out.append({"path": "", "weight": int(table.get("weight", 1)), "owner": root_owner})

    def walk(t: dict[str, Any], path: str) -> None:
        for key, value in t.items():
            if key in ("weight", "owner"):
                continue
            if not isinstance(value, dict):
                raise UserError(
                    f"budget.{path.replace('/', '.') + '.' if path else ''}{key}: expected a table"
                )
            child = f"{path}/{key}" if path else key
            if "weight" not in value or "owner" not in value:
                raise UserError(f"budget node {child!r} needs weight and owner")
            out.append({"path": child, "weight": value["weight"], "owner": value["owner"]})
            walk(value, child)

    walk(table, "")
    return root_owner, out


@budget.command("apply")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--as",
    "actor",
    default=None,
    help="deprecated: who edits, for a gateway run with --no-auth only "
    "(default: the file's root owner)",
)
@click.option(
    "--prune", is_flag=True, help="also remove nodes that are not in the file (leaves first)"
)
@click.option("--url", default=None, help=URL_HELP)
@_timeout_option
@_token_option
def budget_apply(
    file: Path,
    actor: str | None,
    prune: bool,
    url: str | None,
    timeout: float | None,
    token_file: Path | None,
) -> None:
    """Make the tree match FILE's [budget] part (a cluster file or just [budget] tables),
    as the principal of your token (who must own the parents of what changes)."""
    root_owner, nodes = budget_from_toml(_read_toml(file))
    client = _client(url, timeout, token_file)
    _deprecated_as(client, actor)
    remove: list[str] = []
    if prune:
        current = _call(client.budget)
        wanted = {n["path"] for n in nodes}

        def walk(n: dict[str, Any]) -> None:
            for c in n["children"]:
                walk(c)
            if n["path"] and n["path"] not in wanted:
                remove.append(n["path"])

        walk(current)
    out = _call(client.budget_apply, actor or root_owner, nodes, remove)
    click.echo(
        f"budget: {len(nodes)} nodes set, {len(remove)} removed ({out['published']} inputs published)"
    )


@main.command()
@click.argument("kind", type=click.Choice(["scheduler", "projector", "gateway", "executor"]))
@click.option("--cluster-name", default="demo", show_default=True, help="which cluster's streams")
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="projector: DuckDB file",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="listen address (the gateway's, and --metrics-port's)",
)
@click.option("--port", default=8642, show_default=True, help="gateway: port")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="scheduler, projector, executor: serve Prometheus metrics at http://HOST:PORT/metrics "
    "(0: any free port, logged; default: no metrics server). The gateway serves "
    "/metrics on --port",
)
@click.option("--replicas", type=click.IntRange(1, 5), default=1, show_default=True)
@click.option("--log-level", default="info", show_default=True)
@click.option(
    "--credentials",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=CREDENTIALS_ENV,
    default=None,
    help="gateway: the credentials file of token hashes (default: $APPORTION_CREDENTIALS); "
    "see docs/security.md",
)
@click.option(
    "--no-auth",
    is_flag=True,
    help="gateway: authenticate nobody and take actors from request bodies (insecure)",
)
@click.option(
    "--agent-work-dir",
    default=None,
    metavar="DIR",
    help="gateway: the host agents' --work-dir (the same on every host), so that explain "
    "names each attempt's log in full (default: <work-dir>)",
)
@click.option(
    "--hub",
    "hub_url",
    default=None,
    envvar="APPORTION_HUB_URL",
    help="gateway, in a federation: the hub's NATS URL as its gateway user; budget edits are "
    "then made once, on the hub's tree, for every cluster [env APPORTION_HUB_URL]",
)
def serve(
    kind: str,
    cluster_name: str,
    db: Path | None,
    host: str,
    port: int,
    metrics_port: int | None,
    replicas: int,
    log_level: str,
    credentials: Path | None,
    no_auth: bool,
    agent_work_dir: str | None,
    hub_url: str | None,
) -> None:
    """Run one service in this process against $NATS_URL (production shape: one process per service).

    The gateway needs --credentials FILE (or $APPORTION_CREDENTIALS), or --no-auth."""
    from apportion.services import logs
    from apportion.services.runner import serve as run_service

    url = os.environ.get("NATS_URL")
    if not url:
        raise UserError("set NATS_URL to the NATS server or cluster (apportion up starts its own)")
    if kind == "projector" and db is None:
        raise UserError("projector needs --db FILE")
    if metrics_port is not None and kind == "gateway":
        raise UserError("--metrics-port is not for the gateway: it serves /metrics on --port")
    if kind == "gateway" and credentials is not None and no_auth:
        raise UserError("give --credentials FILE or --no-auth, not both")
    if agent_work_dir is not None and kind != "gateway":
        raise UserError("--agent-work-dir is for the gateway only")
    if hub_url is not None and kind != "gateway":
        raise UserError("--hub is for the gateway only")
    logs.configure(log_level)
    try:
        asyncio.run(
            run_service(
                kind,
                url,
                cluster_name,
                db=db,
                host=host,
                port=port,
                replicas=replicas,
                credentials=credentials,
                insecure=no_auth,
                metrics_port=metrics_port,
                agent_work_dir=agent_work_dir,
                hub_url=hub_url,
            )
        )
    except (OSError, ValueError) as exc:
        raise UserError(f"{kind}: {exc}") from None
