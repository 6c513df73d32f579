"""Clients that end: every command that talks to NATS or the gateway gives up with
one line on stderr and exit status 2 when nothing answers (no traceback, no
endless reconnecting). No timing assertions: each command just has to return
within a generous subprocess timeout."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from apportion.services.auth import issue_token

APPORTION = [sys.executable, "-m", "apportion"]
NO_NATS = "nats://127.0.0.1:1"


def run_all(commands: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, str]:
    """Run the commands at once (``name: (args, env)``); each must end with one line
    and exit status 2: ``{name: its stderr}``."""
    procs = {
        name: subprocess.Popen(
            APPORTION + args,
            env={**os.environ, "APPORTION_TIMEOUT": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        for name, (args, env) in commands.items()
    }
    errs = {}
    for name, proc in procs.items():
        try:
            _out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 2, (name, proc.returncode, err[-2000:])
        assert err.count("\n") == 1 and err.startswith("apportion: "), (name, err[-2000:])
        assert "Traceback" not in err
        errs[name] = err
    return errs


def test_commands_that_read_or_serve_a_cluster_end_without_nats(tmp_path: Path) -> None:
    nats = {"NATS_URL": NO_NATS}
    credentials = tmp_path / "tokens.toml"
    issue_token(credentials, "admin")
    errs = run_all(
        {
            "audit": (["audit", "--cluster", "demo", "--nats", NO_NATS], {}),
            "replay": (["replay", "--cluster", "demo", "--out", str(tmp_path / "r.duckdb")], nats),
            "diagnose": (["diagnose", "--cluster", "demo", "--nats", NO_NATS], {}),
            "serve gateway": (["serve", "gateway", "--credentials", str(credentials)], nats),
            "serve projector": (["serve", "projector", "--db", str(tmp_path / "p.duckdb")], nats),
            "up": (["up", "--data-dir", str(tmp_path / "up"), "--port", "0"], nats),
            "federation join": (["federation", "join", "--cluster", "demo", "--peer", "b"], nats),
            "federation status": (["federation", "status", "--cluster", "demo"], nats),
            "federation tree-set": (
                ["federation", "tree-set", "llm", "--weight", "1", "--owner", "a"]
                + ["--actor", "admin", "--hub", NO_NATS],
                {},
            ),
        }
    )
    for name, err in errs.items():
        assert "cannot reach NATS at nats://127.0.0.1:1" in err, (name, err)
        assert "gave up within 1 s" in err and "APPORTION_TIMEOUT" in err, (name, err)


CLIENT_COMMANDS = {
    "submit": ["submit", "--owner", "llm/a", "--gpus", "1", "--min-runtime", "0"],
    "cancel": ["cancel", "w1"],
    "queue": ["queue"],
    "share": ["share"],
    "explain": ["explain", "w1"],
    "budget show": ["budget", "show"],
    "status": ["status"],
    "nodes": ["nodes"],
    "node drain": ["node", "drain", "h1", "--reason", "fans"],
}


def test_client_commands_end_when_the_gateway_is_away_or_silent() -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        commands = {
            f"{name} (away)": (args, {"APPORTION_URL": "http://127.0.0.1:9"})
            for name, args in CLIENT_COMMANDS.items()
        }
        commands |= {
            f"{name} (silent)": ([*args, "--timeout", "1.5"], {"APPORTION_URL": silent_url})
            for name, args in CLIENT_COMMANDS.items()
        }
        commands["bad timeout"] = (["queue"], {"APPORTION_TIMEOUT": "-1"})
        errs = run_all(commands)
    for name in CLIENT_COMMANDS:
        assert "cannot reach the gateway" in errs[f"{name} (away)"]
        silent_err = errs[f"{name} (silent)"]
        assert "no answer from the gateway" in silent_err and "within 1.5 s" in silent_err
    # the id the CLI made is named, so that submitting again with it is stored once
    assert re.search(r"--id w-[0-9a-f]{12}\b", errs["submit (silent)"]), errs["submit (silent)"]
    assert "APPORTION_TIMEOUT" in errs["bad timeout"]
