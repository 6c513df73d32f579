"""Identity at the gateway: bearer tokens stored as hashes, a 401 without one, the
actor taken from the token and never from the body, the CLI's token lookup, and
`apportion up`'s local credentials (a real nats-server; no mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    WorkloadCancelled,
    WorkloadSubmitted,
)
from apportion.schemas.history import InputItem
from apportion.services import logs
from apportion.services.auth import (
    AuthError,
    CredentialsError,
    TokenAuthenticator,
    client_token,
    credentials_file,
    ensure_local_credentials,
    hash_token,
    issue_token,
    load_credentials,
    read_token_file,
    revoke_tokens,
    tree_principals,
)
from apportion.services.bus import JetStreamLog
from apportion.services.canonical import read_history
from apportion.services.stack import DEMO_CLUSTER_TOML, load_cluster_spec
from services_helpers import Roles, eventually, gateway_on, small_cluster

if TYPE_CHECKING:
    from conftest import Credentials

APPORTION = [sys.executable, "-m", "apportion"]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# -- the mechanism -------------------------------------------------------------------


def test_a_token_is_stored_only_as_its_hash_and_checked_against_it(tmp_path: Path) -> None:
    file = tmp_path / "tokens.toml"
    token = issue_token(file, "alice")
    assert token.startswith("apt_") and len(token) >= 40
    text = file.read_text()
    assert token not in text and hash_token(token) in text
    assert mode(file) == 0o600
    assert load_credentials(file) == {hash_token(token): "alice"}

    auth = TokenAuthenticator(file)
    assert auth.authenticate(bearer(token)) == "alice"
    assert auth.authenticate({"Authorization": f"bearer  {token} "}) == "alice"
    with pytest.raises(AuthError) as missing:
        auth.authenticate({})
    assert missing.value.error is None and "Bearer" in missing.value.reason
    with pytest.raises(AuthError) as wrong:
        auth.authenticate(bearer(token[:-1] + ("A" if token[-1] != "A" else "B")))
    assert wrong.value.error == "invalid_token"
    with pytest.raises(AuthError) as basic:
        auth.authenticate({"Authorization": "Basic YWxpY2U6eA=="})
    assert basic.value.error == "invalid_request"
    with pytest.raises(AuthError):
        auth.authenticate(bearer("x" * 10_000))

    # issuing and revoking take effect without a new authenticator (the file is read again)
    second = issue_token(file, "alice")
    bob = issue_token(file, "bob")
    assert auth.authenticate(bearer(second)) == "alice" and auth.authenticate(bearer(bob)) == "bob"
    assert revoke_tokens(file, "alice", hash_token(token)[:20]) == 1  # one of alice's two
    with pytest.raises(AuthError):
        auth.authenticate(bearer(token))
    assert auth.authenticate(bearer(second)) == "alice"
    assert revoke_tokens(file, "bob") == 1 and revoke_tokens(file, "bob") == 0
    with pytest.raises(AuthError):
        auth.authenticate(bearer(bob))
    assert mode(file) == 0o600


def test_revocation_is_deleting_the_line(tmp_path: Path) -> None:
    file = tmp_path / "tokens.toml"
    token = issue_token(file, "vic")
    auth = TokenAuthenticator(file)
    assert auth.authenticate(bearer(token)) == "vic"
    kept = [line for line in file.read_text().splitlines() if hash_token(token) not in line]
    file.write_text("\n".join(kept) + "\n")  # what an operator does with an editor
    with pytest.raises(AuthError):
        auth.authenticate(bearer(token))


@pytest.mark.parametrize(
    "text, words",
    [
        ("[tokens\n", "TOML syntax"),
        ('[tokens]\n"md5:abc" = "alice"\n', "64 hex digits"),
        (f'[tokens]\n"sha256:{"0" * 64}" = "a b"\n', "bad principal"),
        (f'[tokens]\n"sha256:{"0" * 64}" = 3\n', "must be a string"),
        ("version = 2\n[tokens]\n", "unsupported version"),
        ("[users]\n", "unknown keys"),
    ],
)
def test_a_malformed_credentials_file_is_refused(tmp_path: Path, text: str, words: str) -> None:
    file = tmp_path / "tokens.toml"
    file.write_text(text)
    with pytest.raises(CredentialsError, match=words):
        TokenAuthenticator(file)
    with pytest.raises(CredentialsError):
        issue_token(file, "alice")  # never appended to a file that cannot be read back
    assert file.read_text() == text
    with pytest.raises(ValueError, match="bad principal"):
        issue_token(tmp_path / "other.toml", "../etc")


@pytest.mark.parametrize("principal", ["scheduler", "agent:n000"])
def test_reserved_principals_get_no_token(tmp_path: Path, principal: str) -> None:
    from click.testing import CliRunner

    from apportion.cli import main

    file = tmp_path / "tokens.toml"
    with pytest.raises(ValueError, match="reserved"):
        issue_token(file, principal)
    assert not file.exists()
    result = CliRunner().invoke(main, ["auth", "issue", principal, "--file", str(file)])
    assert result.exit_code != 0
    assert "reserved for the scheduler and host agents" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not file.exists()


def test_ensure_local_credentials_is_idempotent_and_private(tmp_path: Path) -> None:
    spec = load_cluster_spec(None)
    principals = tree_principals(spec.budget)
    assert principals == ["admin", "alice", "victor"]  # the root's owner first: the admin

    first = ensure_local_credentials(tmp_path, principals)
    assert list(first) == principals
    folder = tmp_path / "credentials"
    assert mode(folder) == 0o700 and mode(credentials_file(tmp_path)) == 0o600
    tokens = {p: read_token_file(f) for p, f in first.items()}
    for principal, path in first.items():
        assert path == folder / f"{principal}.token" and mode(path) == 0o600
    auth = TokenAuthenticator(credentials_file(tmp_path))
    assert {auth.authenticate(bearer(t)) for t in tokens.values()} == set(principals)

    again = ensure_local_credentials(tmp_path, principals)
    assert again == first
    assert {p: read_token_file(f) for p, f in again.items()} == tokens
    assert len(load_credentials(credentials_file(tmp_path))) == 3

    # a lost token file, or a revoked token, gets a new token; the others stay
    first["alice"].unlink()
    revoke_tokens(credentials_file(tmp_path), "victor")
    third = ensure_local_credentials(tmp_path, [*principals, "newbie"])
    now = {p: read_token_file(f) for p, f in third.items()}
    assert now["admin"] == tokens["admin"]
    assert now["alice"] != tokens["alice"] and now["victor"] != tokens["victor"]
    assert {auth.authenticate(bearer(t)) for t in now.values()} == {*principals, "newbie"}
    with pytest.raises(AuthError):
        auth.authenticate(bearer(tokens["victor"]))
    assert all(mode(f) == 0o600 for f in third.values())


def test_a_client_finds_its_token_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("APPORTION_TOKEN", "APPORTION_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    assert client_token() == (None, "")

    up_admin = tmp_path / ".apportion" / "credentials" / "admin.token"
    up_admin.parent.mkdir(parents=True)
    up_admin.write_text("t-up\n")
    assert client_token()[0] == "t-up"
    config = tmp_path / "config" / "apportion" / "token"
    config.parent.mkdir(parents=True)
    config.write_text("t-config\n")
    assert client_token()[0] == "t-config"
    named = tmp_path / "named.token"
    named.write_text("  t-env-file \n")
    monkeypatch.setenv("APPORTION_TOKEN_FILE", str(named))
    assert client_token()[0] == "t-env-file"
    monkeypatch.setenv("APPORTION_TOKEN", "t-env")
    assert client_token() == ("t-env", "$APPORTION_TOKEN")
    flag = tmp_path / "flag.token"
    flag.write_text("t-flag")
    assert client_token(flag)[0] == "t-flag"
    with pytest.raises(CredentialsError, match="cannot read token file"):
        client_token(tmp_path / "missing.token")
    monkeypatch.delenv("APPORTION_TOKEN")
    monkeypatch.setenv("APPORTION_TOKEN_FILE", str(tmp_path / "missing.token"))
    with pytest.raises(CredentialsError):
        client_token()


# -- the gateway ---------------------------------------------------------------------


def http(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    """``(status, JSON body, headers)``."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


async def inputs_of(log: JetStreamLog) -> list[Any]:
    """The inputs of ``log`` (without the scheduler's clock ticks)."""
    return [
        i.event
        for i in await read_history(log, 10.0)
        if isinstance(i, InputItem) and i.event and not isinstance(i.event, ClockTicked)
    ]


async def test_every_v1_request_but_status_needs_a_known_token(
    roles: Roles, creds: Credentials
) -> None:
    async with gateway_on(roles, creds.authenticator) as gateway:
        url = gateway.url
        wrong = bearer("apt_" + "x" * 43)
        submit = {"id": "j1", "owner": "llm/a", "gpus": 1, "min_runtime_ms": 0}
        requests = [
            ("GET", "/v1/queue", None),
            ("GET", "/v1/share", None),
            ("GET", "/v1/budget", None),
            ("GET", "/v1/explain/j1", None),
            ("GET", "/v1/workloads/j1", None),
            ("POST", "/v1/workloads", submit),
            ("POST", "/v1/workloads/j1/cancel", {}),
            ("POST", "/v1/budget", {"set": [{"path": "llm/c", "weight": 1, "owner": "x"}]}),
            ("GET", "/v1/nope", None),  # 401 before 404: no map of the API for strangers
            ("PUT", "/v1/status", None),
        ]
        for method, path, body in requests:
            for headers, error in [(None, None), (wrong, "invalid_token")]:
                status, answer, got = await asyncio.to_thread(
                    http, method, url + path, body, headers
                )
                assert status == 401, (method, path, answer)
                assert answer["error"].startswith("not authenticated"), answer
                assert got["WWW-Authenticate"].startswith('Bearer realm="apportion"')
                assert (error is None) == ("invalid_token" not in got["WWW-Authenticate"])
        status, answer, _ = await asyncio.to_thread(
            http, "GET", url + "/v1/queue", None, {"Authorization": "Basic YTpi"}
        )
        assert status == 401 and "Bearer" in answer["error"]
        # the health check and the API description need nothing
        status, answer, _ = await asyncio.to_thread(http, "GET", url + "/v1/status")
        assert status == 200 and answer["input_seq"] >= len(small_cluster())
        status, doc, _ = await asyncio.to_thread(http, "GET", url + "/openapi.json")
        assert (
            status == 200 and doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        )
        assert doc["paths"]["/v1/status"]["get"]["security"] == []
        assert "401" in doc["paths"]["/v1/queue"]["get"]["responses"]
        # with a token: served
        status, _answer, _ = await asyncio.to_thread(
            http, "GET", url + "/v1/queue", None, creds.headers("mallory")
        )
        assert status == 200
    published = await inputs_of(roles.sched)
    assert len(published) == len(small_cluster())  # nothing unauthenticated was published


async def test_the_actor_is_the_tokens_principal_whatever_the_body_says(
    roles: Roles, creds: Credentials
) -> None:
    async with gateway_on(roles, creds.authenticator) as gateway:
        url = gateway.url

        async def call(as_: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
            status, answer, _ = await asyncio.to_thread(
                http, method, url + path, body, creds.headers(as_)
            )
            return status, answer

        # a submission claiming to be ops is stamped with the caller, `a`
        status, answer = await call(
            "a",
            "POST",
            "/v1/workloads",
            {"id": "j1", "owner": "llm/a", "gpus": 1, "min_runtime_ms": 0, "submitted_by": "ops"},
        )
        assert status == 202, answer
        # mallory owns nothing: claiming to be ops does not help her
        status, answer = await call(
            "mallory",
            "POST",
            "/v1/workloads",
            {"id": "m1", "owner": "llm/a", "gpus": 1, "min_runtime_ms": 0, "submitted_by": "a"},
        )
        assert status == 403 and "mallory may not submit" in answer["error"], answer
        status, answer = await call(
            "mallory",
            "POST",
            "/v1/budget",
            {"actor": "ops", "set": [{"path": "llm", "weight": 50, "owner": "mallory"}]},
        )
        assert status == 403 and "'mallory' does not own" in answer["error"], answer
        await eventually(lambda: "j1" in gateway.state.workloads, what="j1 folded")
        status, answer = await call("mallory", "POST", "/v1/workloads/j1/cancel", {"actor": "a"})
        assert status == 403 and "mallory may not cancel" in answer["error"], answer
        # alice owns llm: her edit is published as hers, not as the body's actor
        status, answer = await call(
            "alice",
            "POST",
            "/v1/budget",
            {"actor": "mallory", "set": [{"path": "llm/c", "weight": 1, "owner": "carol"}]},
        )
        assert status == 202, answer
        status, answer = await call("a", "POST", "/v1/workloads/j1/cancel", {"actor": "mallory"})
        assert status == 202, answer
        await eventually(lambda: gateway.state.status_of("j1") == "cancelled", what="j1 cancelled")
        await eventually(lambda: "llm/c" in gateway.state.budget.nodes, what="llm/c folded")
        status, answer = await call("b", "GET", "/v1/workloads/j1")
        assert status == 200 and answer["status"] == "cancelled"
    published = (await inputs_of(roles.sched))[len(small_cluster()) :]
    kinds = [
        (type(e).__name__, getattr(e, "actor", getattr(e, "submitted_by", None))) for e in published
    ]
    assert kinds == [
        ("WorkloadSubmitted", "a"),
        ("BudgetSet", "alice"),
        ("WorkloadCancelled", "a"),
    ], kinds
    assert isinstance(published[0], WorkloadSubmitted) and published[0].submitted_by == "a"
    assert isinstance(published[1], BudgetSet) and published[1].owner == "carol"
    assert isinstance(published[2], WorkloadCancelled) and published[2].workload == "j1"


async def test_a_revoked_token_is_refused_by_the_running_gateway(
    roles: Roles, creds: Credentials
) -> None:
    async with gateway_on(roles, creds.authenticator) as gateway:
        url = gateway.url
        status, _, _ = await asyncio.to_thread(
            http, "GET", url + "/v1/queue", None, creds.headers("b")
        )
        assert status == 200
        assert revoke_tokens(creds.file, "b") == 1
        status, answer, _ = await asyncio.to_thread(
            http, "GET", url + "/v1/queue", None, creds.headers("b")
        )
        assert status == 401 and "revoked" in answer["error"]
        fresh = issue_token(creds.file, "b")
        status, _, _ = await asyncio.to_thread(http, "GET", url + "/v1/queue", None, bearer(fresh))
        assert status == 200


async def test_without_auth_the_gateway_warns_and_takes_the_actor_from_the_body(
    roles: Roles,
) -> None:
    out = io.StringIO()
    logs.configure("warning", stream=out)
    try:
        async with gateway_on(roles, None) as gateway:
            status, answer, _ = await asyncio.to_thread(
                http,
                "POST",
                gateway.url + "/v1/workloads",
                {"id": "n1", "owner": "llm/a", "gpus": 1, "min_runtime_ms": 0, "submitted_by": "a"},
            )
            assert status == 202, answer
            status, answer, _ = await asyncio.to_thread(
                http,
                "POST",
                gateway.url + "/v1/budget",
                {"set": [{"path": "x", "weight": 1, "owner": "x"}]},
            )
            assert status == 400 and "actor" in answer["error"]
    finally:
        logs.configure("warning")
    warnings = [json.loads(line) for line in out.getvalue().splitlines()]
    assert any("no authentication" in w["event"] for w in warnings), warnings
    published = (await inputs_of(roles.sched))[len(small_cluster()) :]
    assert [(type(e).__name__, e.submitted_by) for e in published] == [("WorkloadSubmitted", "a")]


# -- the command line ----------------------------------------------------------------


async def cli(*args: str, env: dict[str, str], cwd: Path | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *APPORTION,
        *args,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def bare_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment with no token anywhere (its own HOME and config folder)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPORTION_")}
    return {**env, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "config"), **extra}


async def test_the_cli_sends_its_token_and_a_401_is_one_line(
    roles: Roles, creds: Credentials, tmp_path: Path
) -> None:
    async with gateway_on(roles, creds.authenticator) as gateway:
        env = bare_env(tmp_path, APPORTION_URL=gateway.url or "")
        a_file = str(creds.token_files["a"])

        code, out, err = await cli("queue", "--json", "--token-file", a_file, env=env, cwd=tmp_path)
        assert code == 0 and "pending" in json.loads(out), err
        code, out, err = await cli(
            "share", env={**env, "APPORTION_TOKEN_FILE": a_file}, cwd=tmp_path
        )
        assert code == 0, err
        code, out, err = await cli(
            "budget", "show", env={**env, "APPORTION_TOKEN": creds.tokens["b"]}, cwd=tmp_path
        )
        assert code == 0, err

        for name, extra in [("no token", {}), ("wrong token", {"APPORTION_TOKEN": "apt_nope"})]:
            for args in (
                ["queue"],
                ["submit", "--owner", "llm/a", "--gpus", "1", "--min-runtime", "0"],
            ):
                code, out, err = await cli(*args, env={**env, **extra}, cwd=tmp_path)
                assert code == 2 and out == "", (name, args, err)
                assert err.count("\n") == 1 and err.startswith("apportion: not authenticated"), err
                assert "APPORTION_TOKEN" in err and "Traceback" not in err, err
        code, out, err = await cli(
            "queue", "--token-file", str(tmp_path / "missing.token"), env=env, cwd=tmp_path
        )
        assert code == 2 and err.count("\n") == 1 and "cannot read token file" in err, err

        # --as is deprecated on the gateway path: noted, and the token's principal is used
        code, out, err = await cli(
            "submit", "--owner", "llm/a", "--gpus", "1", "--min-runtime", "0", "--id", "c1",
            "--as", "ops", "--token-file", a_file, env=env, cwd=tmp_path,
        )  # fmt: skip
        assert code == 0 and "--as is deprecated" in err, err
        await eventually(lambda: "c1" in gateway.state.workloads, what="c1 folded")
        assert gateway.state.workloads["c1"].submitted_by == "a"

        # tokens issued from the command line work at once; revoked ones stop at once
        code, token, err = await cli("auth", "issue", "b", "--file", str(creds.file), env=env)
        assert code == 0 and token.startswith("apt_") and "not shown again" in err, err
        token = token.strip()
        code, out, err = await cli("queue", env={**env, "APPORTION_TOKEN": token}, cwd=tmp_path)
        assert code == 0, err
        code, out, err = await cli("auth", "list", "--file", str(creds.file), env=env)
        assert code == 0 and re.search(r"^b +sha256:", out, re.M) and token not in out, out
        code, out, err = await cli("auth", "revoke", "b", "--file", str(creds.file), env=env)
        assert code == 0 and "revoked 2 tokens" in out, (out, err)
        code, out, err = await cli("queue", env={**env, "APPORTION_TOKEN": token}, cwd=tmp_path)
        assert code == 2 and "not authenticated" in err, err
        out_file = tmp_path / "b.token"
        code, out, err = await cli(
            "auth", "issue", "b", "--file", str(creds.file), "--out", str(out_file), env=env
        )
        assert code == 0 and mode(out_file) == 0o600 and read_token_file(out_file) not in out


def test_serve_gateway_needs_credentials_or_no_auth(tmp_path: Path) -> None:
    env = bare_env(tmp_path, NATS_URL="nats://127.0.0.1:1", APPORTION_TIMEOUT="1")
    out = subprocess.run(
        [*APPORTION, "serve", "gateway"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "credentials" in out.stderr and "--no-auth" in out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[tokens\n")
    out = subprocess.run(
        [*APPORTION, "serve", "gateway", "--credentials", str(bad)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "TOML syntax" in out.stderr, out.stderr


# -- apportion up ----------------------------------------------------------------------


@contextlib.contextmanager
def up(folder: Path, nats_url: str | None, cluster: str, *extra: str) -> Any:
    """`apportion up` run in ``folder`` (its default data dir) on the test server (on a
    nats-server of its own with ``nats_url`` None); yields (its printed text once
    started, its gateway URL)."""
    cluster_file = folder / "cluster.toml"
    cluster_file.write_text(DEMO_CLUSTER_TOML.replace('name = "demo"', f'name = "{cluster}"'))
    err_path = folder / "up.err"
    env = bare_env(folder, NATS_URL=nats_url or "")
    if nats_url is None:
        del env["NATS_URL"]
    with open(err_path, "w+") as err:
        proc = subprocess.Popen(
            [*APPORTION, "up", "--cluster", str(cluster_file), "--port", "0", *extra]
            + ["--log-level", "warning", "--no-executor"],
            env=env,
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                printed = err_path.read_text()
                if "Ctrl-C stops everything" in printed:
                    break
                time.sleep(0.05)
            printed = err_path.read_text()
            m = re.search(r"gateway: (http://\S+)", printed)
            assert m, printed
            yield printed, m.group(1)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(60)


async def test_up_makes_tokens_for_the_admin_and_the_owners(cluster: str, tmp_path: Path) -> None:
    with up(tmp_path, None, cluster) as (printed, url):
        folder = (tmp_path / ".apportion" / "credentials").resolve()
        for principal in ("admin", "alice", "victor"):
            path = folder / f"{principal}.token"
            assert re.search(rf"^  {principal} +{re.escape(str(path))}", printed, re.M), printed
            assert mode(path) == 0o600
        assert f"export APPORTION_TOKEN_FILE={folder / 'admin.token'}" in printed
        assert mode(folder) == 0o700 and mode(folder / "tokens.toml") == 0o600
        env = bare_env(tmp_path, APPORTION_URL=url)
        # the CLI run where `up` runs finds the admin token by itself
        deadline = time.monotonic() + 60
        while True:
            code, out, err = await cli("budget", "show", "--json", env=env, cwd=tmp_path)
            if code == 0 and json.loads(out)["children"]:
                break
            assert time.monotonic() < deadline, err
            await asyncio.sleep(0.1)
        assert json.loads(out)["owner"] == "admin"
        # elsewhere, without a token: 401, one line
        code, out, err = await cli("queue", env=env, cwd=tmp_path / ".apportion")
        assert code == 2 and "not authenticated" in err, err
        # alice acts as alice: her leaf is hers, victor's is not
        alice = {**env, "APPORTION_TOKEN_FILE": str(folder / "alice.token")}
        submit = ["submit", "--gpus", "8", "--min-runtime", "15m"]
        code, out, err = await cli(*submit, "--owner", "vision/detection", env=alice, cwd=tmp_path)
        assert code == 2 and "alice may not submit" in err, err
        code, out, err = await cli(
            *submit, "--owner", "llm/pretrain", "--id", "aj1", env=alice, cwd=tmp_path
        )
        assert code == 0, err
        status, answer, _ = await asyncio.to_thread(
            http,
            "GET",
            f"{url}/v1/workloads/aj1",
            None,
            bearer(read_token_file(folder / "alice.token")),
        )
        deadline = time.monotonic() + 60
        while status != 200:
            assert time.monotonic() < deadline, answer
            await asyncio.sleep(0.1)
            status, answer, _ = await asyncio.to_thread(
                http,
                "GET",
                f"{url}/v1/workloads/aj1",
                None,
                bearer(read_token_file(folder / "alice.token")),
            )
        assert answer["submitted_by"] == "alice"
    # a second `up` on the same folder keeps the tokens
    tokens = {p: read_token_file(folder / f"{p}.token") for p in ("admin", "alice", "victor")}
    with up(tmp_path, None, cluster):
        assert {p: read_token_file(folder / f"{p}.token") for p in tokens} == tokens


async def test_up_without_auth_warns_and_makes_no_tokens(cluster: str, tmp_path: Path) -> None:
    with up(tmp_path, None, cluster, "--no-auth") as (printed, url):
        assert "WARNING: --no-auth" in printed and "no authentication" in printed
        assert not (tmp_path / ".apportion" / "credentials").exists()
        deadline = time.monotonic() + 60
        while True:
            status, answer, _ = await asyncio.to_thread(http, "GET", f"{url}/v1/budget")
            if status == 200 and answer["children"]:
                break
            assert time.monotonic() < deadline, answer
            await asyncio.sleep(0.1)


async def test_up_runs_nats_with_the_users_of_production(tmp_path: Path) -> None:
    """Without NATS_URL, `up` starts nats-server with the accounts and users that
    apportion.services.natsconf generates (passwords beside the tokens, mode 0600):
    a client without a user is refused, no user may delete the streams (which deny
    it too), and the stack works through its own users end to end."""
    import nats
    import nats.errors
    from apportion.services.natsconf import load_nats_users, user_url

    with up(tmp_path, None, "demo") as (printed, url):
        folder = (tmp_path / ".apportion" / "credentials").resolve()
        assert mode(folder) == 0o700
        assert mode(folder / "nats-users.toml") == 0o600 and mode(folder / "nats.conf") == 0o600
        assert "nats: a user per role and per host" in printed
        users = load_nats_users(folder)
        assert {"scheduler", "gateway", "operator", "projector", "auditor", "executor"} <= set(
            users
        ) and "agent-h100-000" in users
        m = re.search(r"cluster 'demo' on (nats://\S+)", printed)
        assert m, printed
        server = m.group(1)
        # a client without a user: the server says so and closes the connection
        host, port = server.removeprefix("nats://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            await reader.readline()  # INFO
            writer.write(b'CONNECT {"verbose":false}\r\nPING\r\n')
            await writer.drain()
            answer = await asyncio.wait_for(reader.readline(), 10)
            assert answer.startswith(b"-ERR 'Authorization Violation'"), answer
        finally:
            writer.close()
            await writer.wait_closed()
        # the stack works as its users: a submission is placed
        env = bare_env(tmp_path, APPORTION_URL=url)
        code, out, err = await cli(
            "submit", "--owner", "llm/pretrain", "--gpus", "8", "--min-runtime", "15m",
            "--duration", "1h", "--id", "w-up", env=env, cwd=tmp_path,
        )  # fmt: skip
        assert code == 0, err
        deadline = time.monotonic() + 60
        while True:
            code, out, err = await cli("queue", "--json", env=env, cwd=tmp_path)
            if code == 0 and "w-up" in json.dumps(json.loads(out).get("running")):
                break
            assert time.monotonic() < deadline, out + err
            await asyncio.sleep(0.2)
        # streams deny deletes, and no user may ask for one
        sched = await nats.connect(
            user_url(server, "scheduler", users["scheduler"]), inbox_prefix="_INBOX_scheduler"
        )
        try:
            js = sched.jetstream(timeout=2.0)
            for stream in ("INPUTS_demo", "DECISIONS_demo"):
                info = await js.stream_info(stream)
                assert info.config.deny_delete and info.config.deny_purge
                with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                    await js.delete_stream(stream)
                with pytest.raises(Exception):  # noqa: B017 - refused: deny_delete
                    await js.delete_msg(stream, 1)
                assert (await js.stream_info(stream)).state.messages > 0
        finally:
            await sched.close()
        for user in ("gateway", "projector", "auditor"):
            other = await nats.connect(
                user_url(server, user, users[user]), inbox_prefix=f"_INBOX_{user}"
            )
            try:
                with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                    await other.request("$JS.API.STREAM.DELETE.INPUTS_demo", b"", timeout=0.5)
            finally:
                await other.close()


async def test_an_older_data_folder_keeps_its_history_under_users(tmp_path: Path) -> None:
    """The streams an `up` of before NATS users made (in the server's global
    account) are moved to the APPORTION account before the server starts with users."""
    from apportion.services.bus import connect
    from apportion.services.natsconf import NATS_CONF_FILE, ensure_nats_credentials, user_url
    from apportion.services.stack import adopt_unowned_streams, start_nats_server

    data = tmp_path / "nats"
    server = start_nats_server(data)
    try:
        nc = await connect(server.url, timeout_s=10)
        log = JetStreamLog(nc.jetstream(), "demo")
        await log.setup()
        await log.publish_inputs(small_cluster())
        await nc.close()
    finally:
        server.stop()
    users = ensure_nats_credentials(tmp_path / "credentials", "demo", ["h000"], server="")
    assert adopt_unowned_streams(data) and not adopt_unowned_streams(data)
    server = start_nats_server(data, config=tmp_path / "credentials" / NATS_CONF_FILE)
    try:
        nc = await connect(user_url(server.url, "auditor", users["auditor"]), timeout_s=10)
        assert await JetStreamLog(nc.jetstream(), "demo").last_input_seq() == len(small_cluster())
        await nc.close()
    finally:
        server.stop()


async def test_a_flood_of_401s_is_counted_and_logged_once(roles: Roles, creds: Credentials) -> None:
    """Every 401 counts in ``apportion_gateway_unauthenticated_total``; the log gets
    at most one line a minute (issue 24, item 6: log flooding)."""
    lines: list[tuple[str, dict[str, Any]]] = []

    class Recorder:
        def warning(self, event: str, **kw: Any) -> None:
            lines.append((event, kw))

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **kw: None

    async with gateway_on(roles, creds.authenticator) as gateway:
        gateway.logger = Recorder()  # type: ignore[assignment]
        for _ in range(30):
            status, _, _ = await asyncio.to_thread(
                http, "GET", f"{gateway.url}/v1/queue", None, bearer("apt_nope")
            )
            assert status == 401
        assert [e for e, _ in lines] == ["not authenticated"], lines

        def scrape() -> str:
            with urllib.request.urlopen(f"{gateway.url}/metrics", timeout=30) as resp:
                return str(resp.read().decode())

        text = await asyncio.to_thread(scrape)
        assert "apportion_gateway_unauthenticated_total 30.0" in text


async def test_405_says_what_is_allowed_and_a_nul_is_refused(
    roles: Roles, creds: Credentials
) -> None:
    async with gateway_on(roles, creds.authenticator) as gateway:
        status, answer, headers = await asyncio.to_thread(
            http, "DELETE", f"{gateway.url}/v1/queue", None, creds.headers()
        )
        assert status == 405 and answer["code"] == "method_not_allowed"
        assert headers["Allow"] == "GET, HEAD"
        for body in (
            {"command": ["sh", "-c", "a\x00b"]},
            {"command": ["true"], "env": {"X": "\x00"}},
        ):
            status, answer, _ = await asyncio.to_thread(
                http,
                "POST",
                f"{gateway.url}/v1/workloads",
                {"owner": "llm/a", "gpus": 1, "min_runtime_ms": 0, **body},
                creds.headers(),
            )
            assert (status, answer["code"]) == (400, "invalid_text"), answer
