"""The NATS accounts and users of one cluster, generated (docs/security.md, "The bus").

The threat it answers (issue 24): a request's *reply subject* is not covered by
publish permissions, and the server itself publishes the answer there. In one
shared account, a direct get (allowed to every reader) with its reply set to
an inputs subject, the decisions subject or the lease key wrote into the
streams with any credential. So:

- the streams, the lease and the snapshots live in the account ``APPORTION``,
  whose only user is the **scheduler** (the one writer of decisions);
- every other credential has an **account of its own**: ``GATEWAY``,
  ``OPERATOR``, ``PROJECTOR``, ``AUDITOR``, ``EXECUTOR`` (the executor
  emulator of ``apportion up``, which reports runs for every host) and one
  ``AGENT_<host>`` per host. Each imports from ``APPORTION`` exactly what it
  needs: the direct-get and stream-info services of the two streams, the
  inputs subjects it may publish (a service: JetStream's acknowledgement comes
  back as its reply), the streams' subjects as a read-only stream (wake-ups),
  and for agents their own heartbeat subject, everyone's heartbeats and
  their own host's log subjects (``LOGS_<c>``, :mod:`.attempt_logs`; read
  by the gateway and the operator only). A
  reply the server sends for a request from such an account is delivered
  *inside that account*, where the only subjects that lead anywhere are the
  ones its credential may publish itself: no credential can make the server
  publish on a subject it could not publish on directly (tests/services/test_bus_attacks.py);
- each user may subscribe to its own inbox prefix only, ``_INBOX_<user>.>``
  (:func:`inbox_prefix`; :func:`apportion.services.bus.connect` uses it).

:func:`accounts_conf` writes the configuration (the ``accounts`` block with
its users and passwords, optionally with the server's ``listen`` and
``jetstream`` settings); ``infra/accounts.conf`` is its output for the demo
cluster, and ``apportion up`` starts its nats-server with it
(:func:`ensure_nats_credentials`).
"""

from __future__ import annotations

import os
import secrets
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from apportion.core.rules.subjects import AGENT_KINDS

from .attempt_logs import host_subjects, logs_prefix, stream_name

ROLE_KINDS: dict[str, tuple[str, ...]] = {
    "scheduler": ("ClockTicked", "NodeHealthChanged"),
    "gateway": (
        "WorkloadSubmitted",
        "WorkloadCancelled",
        "WorkloadHeld",
        "WorkloadReleased",
        "BudgetSet",
        "BudgetRemoved",
        "NodeHealthChanged",
    ),
    "operator": (
        "WorkloadSubmitted",
        "WorkloadCancelled",
        "WorkloadHeld",
        "WorkloadReleased",
        "BudgetSet",
        "BudgetRemoved",
        "PolicySet",
        "NodeRegistered",
        "NodeHealthChanged",
        "WorkloadFinished",
        "InputsLost",
    ),
    "projector": (),
    "auditor": (),
}
"""The input kinds each role publishes on ``apportion.<c>.inputs.<Kind>``. The
agent of a host publishes :data:`AGENT_KINDS` on ``...inputs.<Kind>.<host>``;
the executor emulator ``WorkloadStarted`` and ``WorkloadFinished`` on every host's."""

EXECUTOR_KINDS = ("WorkloadStarted", "WorkloadFinished")

SLURM = "slurm"
SLURM_KINDS = ("WorkloadSubmitted", "WorkloadCancelled")
"""The Slurm bridge (``apportion slurm``, opt-in: ``accounts_conf(..., slurm=True)``)
publishes these on ``apportion.<c>.inputs.<Kind>`` (a Slurm user's job and its
cancel: the actor is the Slurm user, authenticated by Slurm) and, as the agent of
every node it runs, :data:`AGENT_KINDS` on every host's subjects (docs/slurm.md)."""

SCHEDULER = "scheduler"
ROLES = ("scheduler", "gateway", "operator", "projector", "auditor", "executor")
"""Every user but the agents (one per host: :func:`agent_user`)."""

JS_ACCOUNT = "APPORTION"


def agent_user(host: str) -> str:
    """The NATS user of the agent of ``host``."""
    return f"agent-{host}"


def inbox_prefix(user: str | None) -> str:
    """The inbox prefix of ``user``: ``_INBOX_<user>`` (the only replies it may
    subscribe to); ``_INBOX`` without a user (a server without users)."""
    return f"_INBOX_{user}" if user else "_INBOX"


def users_of(hosts: Iterable[str], *, slurm: bool = False) -> list[str]:
    return [*ROLES, *([SLURM] if slurm else []), *(agent_user(h) for h in hosts)]


def _account_of(user: str) -> str:
    if user == SCHEDULER:
        return JS_ACCOUNT
    if user.startswith("agent-"):
        return "AGENT_" + user[len("agent-") :]
    return user.upper()


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _list(items: Iterable[str], indent: str) -> str:
    return "".join(f"{indent}{_q(i)}\n" for i in items)


class _Cluster:
    """The subjects, streams and permissions one cluster adds to the accounts."""

    def __init__(self, c: str, hosts: list[str], executor: bool) -> None:
        self.name = c
        inputs = f"apportion.{c}.inputs"
        self.inputs = inputs
        self.decisions = decisions = f"apportion.{c}.decisions"
        self.heartbeat = heartbeat = f"apportion.{c}.heartbeat"
        self.streams = streams = (f"INPUTS_{c}", f"DECISIONS_{c}")
        self.reads = [f"$JS.API.DIRECT.GET.{s}" for s in streams]
        """What every reader asks: batched direct gets, and ``last_by_subj`` for the
        last sequence (the JetStream API, stream info included, answers only inside
        APPORTION)."""
        self.leader_gets = [f"$JS.API.STREAM.MSG.GET.INPUTS_{c}"]
        """An input as the stream's leader holds it (a replica that answered a direct
        get may have lost it: a damaged R3 member). The scheduler's only: the
        JetStream API answers a request as if for the account it came from, so an
        import of it into another account is answered "JetStream not enabled for
        account" (docs/security.md, "Readers and a damaged replica")."""
        self.wakes = [f"{inputs}.>", decisions]
        self.logs_stream = logs_stream = stream_name(c)
        self.log_reads = [f"$JS.API.DIRECT.GET.{logs_stream}"]
        """Who reads the attempts' logs (services/attempt_logs.py): the gateway, which
        shows them with explain's authority, and the operator; not the agents (one
        host's agent has no business reading another's output), the projector or
        the auditor."""
        self.leases, self.snaps = f"apportion_{c}_leases", f"apportion_{c}_snapshots"
        self.usage_stream, self.usage = f"USAGE_{c}", f"apportion.{c}.usage"
        """The cluster's usage summaries for its peers (services/federation.py)."""
        self.guarded = [*self.streams, self.logs_stream, self.usage_stream]
        """The streams no user purges or creates a consumer on."""
        # what each non-scheduler user may publish into APPORTION (service imports)
        self.publishes: dict[str, list[str]] = {
            "gateway": [f"{inputs}.{k}" for k in ROLE_KINDS["gateway"]],
            "operator": [f"{inputs}.{k}" for k in ROLE_KINDS["operator"]],
            "projector": [],
            "auditor": [],
            "executor": [f"{inputs}.{k}.>" for k in EXECUTOR_KINDS],
        }
        if not executor:
            del self.publishes["executor"]
        self.hears: dict[str, list[str]] = {}
        for h in hosts:
            user = agent_user(h)
            self.publishes[user] = [
                *(f"{inputs}.{k}.{h}" for k in AGENT_KINDS),
                f"{heartbeat}.{h}",
                host_subjects(c, h),  # its own host's attempt logs only
            ]
            self.hears[user] = [f"{heartbeat}.>"]


def _each(clusters: list[_Cluster], part: Callable[[_Cluster], Iterable[str]]) -> list[str]:
    return [x for k in clusters for x in part(k)]


def _scheduler_api(k: _Cluster) -> list[str]:
    """The JetStream API the scheduler asks for cluster ``k``."""
    leases, snaps, logs_stream = k.leases, k.snaps, k.logs_stream
    return [
        *(f"$JS.API.STREAM.INFO.{s}" for s in k.streams),
        *k.reads,
        *k.leader_gets,
        *(f"$JS.API.STREAM.CREATE.{s}" for s in k.streams),
        *(f"$JS.API.STREAM.UPDATE.{s}" for s in k.streams),
        f"$JS.API.STREAM.INFO.{logs_stream}",
        f"$JS.API.STREAM.CREATE.{logs_stream}",
        f"$JS.API.STREAM.UPDATE.{logs_stream}",
        *k.log_reads,
        f"$JS.API.STREAM.INFO.KV_{leases}",
        f"$JS.API.STREAM.CREATE.KV_{leases}",
        f"$JS.API.DIRECT.GET.KV_{leases}.>",
        f"$JS.API.STREAM.MSG.GET.KV_{leases}",
        f"$JS.API.STREAM.INFO.OBJ_{snaps}",
        f"$JS.API.STREAM.CREATE.OBJ_{snaps}",
        f"$JS.API.STREAM.MSG.GET.OBJ_{snaps}",
        f"$JS.API.DIRECT.GET.OBJ_{snaps}.>",
        f"$JS.API.STREAM.PURGE.OBJ_{snaps}",
        f"$JS.API.CONSUMER.CREATE.OBJ_{snaps}",
        f"$JS.API.CONSUMER.CREATE.OBJ_{snaps}.>",
        f"$JS.API.CONSUMER.DELETE.OBJ_{snaps}.>",
        f"$JS.API.CONSUMER.INFO.OBJ_{snaps}.>",
        # federation (services/federation.py): its usage summaries, read back by the
        # forwarder to find where it got to; the sources of INPUTS are a stream update
        f"$JS.API.STREAM.INFO.{k.usage_stream}",
        f"$JS.API.STREAM.CREATE.{k.usage_stream}",
        f"$JS.API.STREAM.UPDATE.{k.usage_stream}",
        f"$JS.API.DIRECT.GET.{k.usage_stream}",
    ]


def accounts_conf(
    cluster: str | Sequence[str],
    hosts: Iterable[str],
    passwords: Mapping[str, str],
    *,
    server: str = "",
    executor: bool = True,
    slurm: bool = False,
) -> str:
    """The ``accounts`` block for cluster ``cluster`` (or for each of several
    clusters served by one nats-server: the same accounts and users, each with the
    subjects of every cluster) with an agent for each of ``hosts``; ``passwords``
    maps every user (:func:`users_of`) to its password.
    ``server`` is put first (``listen``, ``jetstream { ... }``, ...).
    ``executor``: with the executor emulator's user, which may report runs on
    every host (a demo device: leave it out where real agents run). ``slurm``:
    with the Slurm bridge's user (:data:`SLURM_KINDS`, and the agent kinds on
    every host's subjects)."""
    hosts = list(hosts)
    names = [cluster] if isinstance(cluster, str) else list(cluster)
    cs = [_Cluster(c, hosts, executor) for c in names]
    c = ", ".join(names)
    first = cs[0]
    publishes: dict[str, list[str]] = {
        u: [x for k in cs for x in k.publishes[u]] for u in first.publishes
    }
    hears: dict[str, list[str]] = {u: [x for k in cs for x in k.hears[u]] for u in first.hears}
    reads = _each(cs, lambda k: k.reads)
    wakes = _each(cs, lambda k: k.wakes)
    log_reads = _each(cs, lambda k: k.log_reads)
    log_readers = ["gateway", "operator"]
    if slurm:
        publishes[SLURM] = _each(
            cs,
            lambda k: [
                *(f"{k.inputs}.{kind}" for kind in SLURM_KINDS),
                *(f"{k.inputs}.{kind}.>" for kind in AGENT_KINDS),
            ],
        )
    writers = [_account_of(u) for u, subjects in publishes.items() if subjects]
    agents = [_account_of(agent_user(h)) for h in hosts]

    out = [
        f"# The NATS accounts of apportion cluster {c!r} (generated by",
        "# apportion.services.natsconf.accounts_conf; docs/security.md, 'The bus').",
        "# The streams live in APPORTION, whose only user is the scheduler; every other",
        "# credential has an account of its own that imports what it may read and publish,",
        "# so a reply the server sends for it stays in its own account.",
    ]
    if server:
        out += [server.rstrip(), ""]
    out.append("accounts {")
    # -- APPORTION: JetStream, the scheduler ----------------------------------
    sched_pub = [
        "$JS.API.INFO",
        "$JS.API.STREAM.NAMES",
        *_each(cs, _scheduler_api),
        "$JS.FC.>",
        "$JS.ACK.>",
        *_each(
            cs,
            lambda k: [
                f"$KV.{k.leases}.>",
                f"$O.{k.snaps}.>",
                k.decisions,
                k.usage,
                *(f"{k.inputs}.{kind}" for kind in ROLE_KINDS["scheduler"]),
            ],
        ),
    ]
    sched_deny = [
        "$JS.API.STREAM.DELETE.>",
        "$JS.API.STREAM.MSG.DELETE.>",
        *_each(cs, lambda k: (f"$JS.API.STREAM.PURGE.{s}" for s in k.guarded)),
        *_each(cs, lambda k: (f"$JS.API.CONSUMER.CREATE.{s}" for s in k.guarded)),
        *_each(cs, lambda k: (f"$JS.API.CONSUMER.CREATE.{s}.>" for s in k.guarded)),
        "$JS.API.CONSUMER.DURABLE.CREATE.>",
    ]
    sched_sub = [
        f"{inbox_prefix(SCHEDULER)}.>",
        *wakes,
        *_each(cs, lambda k: [f"$KV.{k.leases}.>"]),
        *_each(cs, lambda k: [f"$O.{k.snaps}.>"]),
        *_each(cs, lambda k: [f"{k.heartbeat}.>"]),
    ]
    out += [
        f"  {JS_ACCOUNT} {{",
        "    jetstream: enabled",
        "    users = [",
        "      {",
        "        # the only writer of decisions; moves the clock; owns its lease and snapshots",
        f"        user: {_q(SCHEDULER)}, password: {_q(passwords[SCHEDULER])}",
        "        permissions {",
        "          publish {",
        "            allow: [",
        _list(sched_pub, "              ").rstrip("\n"),
        "            ]",
        "            deny: [",
        _list(sched_deny, "              ").rstrip("\n"),
        "            ]",
        "          }",
        "          subscribe { allow: [",
        _list(sched_sub, "            ").rstrip("\n"),
        "          ] }",
        "        }",
        "      }",
        "    ]",
        "    exports = [",
        *(f"      {{ service: {_q(s)}, response_type: stream }}" for s in reads),
        *_each(
            cs,
            lambda k: [
                f"      {{ service: {_q(k.inputs + '.>')}, "
                f"accounts: [{', '.join(_q(a) for a in writers)}] }}",
                f"      {{ stream: {_q(k.inputs + '.>')} }}",
                f"      {{ stream: {_q(k.decisions)} }}",
            ],
        ),
    ]
    readers = ", ".join(_q(_account_of(u)) for u in log_readers if u in publishes)
    out += [
        *(
            f"      {{ service: {_q(s)}, response_type: stream, accounts: [{readers}] }}"
            for s in log_reads
        ),
    ]
    if agents:
        them = ", ".join(_q(a) for a in agents)
        out += _each(
            cs,
            lambda k: [
                f"      {{ service: {_q(k.heartbeat + '.>')}, accounts: [{them}] }}",
                f"      {{ service: {_q(logs_prefix(k.name) + '.>')}, accounts: [{them}] }}",
            ],
        )
    out += ["    ]", "  }"]
    # -- one account per other credential ---------------------------------------
    for user, pubs in publishes.items():
        account = _account_of(user)
        subs = [f"{inbox_prefix(user)}.>", *wakes, *hears.get(user, [])]
        user_reads = [*reads, *(log_reads if user in log_readers else [])]
        imports = [
            *(f"{{ service: {{ account: {JS_ACCOUNT}, subject: {_q(s)} }} }}" for s in user_reads),
            *(f"{{ service: {{ account: {JS_ACCOUNT}, subject: {_q(s)} }} }}" for s in pubs),
            *(f"{{ stream: {{ account: {JS_ACCOUNT}, subject: {_q(s)} }} }}" for s in wakes),
        ]
        exports: list[str] = []
        if user in hears:
            # heartbeats go from agent to agent directly (a gang's MASTER_ADDR): what
            # reaches APPORTION through a service import is not passed on to the
            # accounts that import it as a stream (checked against nats-server)
            host = user[len("agent-") :]
            others = [h for h in hosts if h != host]
            peers = ", ".join(_q(_account_of(agent_user(h))) for h in others)
            exports = [
                f"{{ stream: {_q(f'{k.heartbeat}.{host}')}, accounts: [{peers}] }}"
                for k in cs
                if others
            ]
            imports += [
                f"{{ stream: {{ account: {_q(_account_of(agent_user(h)))}, "
                f"subject: {_q(f'{k.heartbeat}.{h}')} }} }}"
                for k in cs
                for h in others
            ]
        out += [
            f"  {_q(account)} {{",
            "    users = [",
            "      {",
            f"        user: {_q(user)}, password: {_q(passwords[user])}",
            "        permissions {",
            "          publish { allow: [",
            _list([*user_reads, *pubs], "            ").rstrip("\n"),
            "          ] }",
            "          subscribe { allow: [",
            _list(subs, "            ").rstrip("\n"),
            "          ] }",
            "        }",
            "      }",
            "    ]",
            "    imports = [",
            *(f"      {i}" for i in imports),
            "    ]",
            *(["    exports = [", *(f"      {e}" for e in exports), "    ]"] if exports else []),
            "  }",
        ]
    out.append("}")
    return "\n".join(out) + "\n"


EXAMPLE_SERVER = """\
server_name: apportion-secure
listen: 127.0.0.1:4222

jetstream {
  store_dir: "./.apportion/nats-secure"
  max_memory_store: 256MB
  max_file_store: 20GB
  sync_interval: always  # one node: fsync before acknowledging (docs/services.md, "Durability")
}
"""


def example_conf() -> str:
    """``infra/accounts.conf``: the accounts of the demo cluster (``apportion up``'s
    bundled one: cluster ``demo``, its six hosts), each user's password
    ``<user>-secret``. Replace the passwords (or use nkeys / JWT accounts, with
    the same accounts, exports and imports) before any real deployment;
    ``apportion nats-config`` writes it for another cluster."""
    from apportion.schemas.events import NodeRegistered

    from .stack import load_cluster_spec

    spec = load_cluster_spec(None)
    hosts = [e.node for e in spec.events if isinstance(e, NodeRegistered)]
    passwords = {u: f"{u}-secret" for u in users_of(hosts)}
    return accounts_conf(spec.name, hosts, passwords, server=EXAMPLE_SERVER)


# -- apportion up: generated credentials -------------------------------------

NATS_USERS_FILE = "nats-users.toml"
NATS_CONF_FILE = "nats.conf"


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the user only (a new file renamed over)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def load_nats_users(folder: Path) -> dict[str, str]:
    """``<folder>/nats-users.toml``: each NATS user's password (``{}`` if none)."""
    path = folder / NATS_USERS_FILE
    if not path.exists():
        return {}
    data = tomllib.loads(path.read_text())
    users = data.get("users", {})
    return {str(k): str(v) for k, v in users.items()}


def ensure_nats_credentials(
    folder: Path, cluster: str, hosts: Iterable[str], server: str, *, slurm: bool = False
) -> dict[str, str]:
    """The NATS users of ``apportion up``: a password per user (kept from an
    earlier run, made for a new one) in ``<folder>/nats-users.toml`` and the
    server's configuration in ``<folder>/nats.conf``, both mode 0600 in a folder
    of mode 0700 (``slurm``: with the Slurm bridge's user). Returns user -> password."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    users = load_nats_users(folder)
    wanted = users_of(hosts, slurm=slurm)
    changed = False
    for user in wanted:
        if user not in users:
            users[user] = secrets.token_urlsafe(24)
            changed = True
    if changed or not (folder / NATS_USERS_FILE).exists():
        lines = [
            "# apportion up: the password of each NATS user (readable by you only).",
            "# A service connects as nats://<user>:<password>@host:port.",
            "[users]",
            *(f"{_q(u)} = {_q(p)}" for u, p in users.items()),
        ]
        _write_private(folder / NATS_USERS_FILE, "\n".join(lines) + "\n")
    _write_private(
        folder / NATS_CONF_FILE, accounts_conf(cluster, hosts, users, server=server, slurm=slurm)
    )
    return users


def user_url(url: str, user: str, password: str) -> str:
    """``url`` (one or more servers, comma-separated) with ``user:password@`` in each."""
    from urllib.parse import quote

    out = []
    for one in url.split(","):
        one = one.strip()
        scheme, sep, rest = one.partition("://")
        if not sep:
            scheme, rest = "nats", one
        rest = rest.rsplit("@", 1)[-1]
        out.append(f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{rest}")
    return ",".join(out)


# -- federation: a cluster's server as a leaf of the hub, and the hub ------------


def federated_server(
    cluster: str,
    hub_url: str,
    *,
    store_dir: str,
    listen: str = "127.0.0.1:4222",
    server_name: str = "",
    route_listen: str = "",
    routes: Sequence[str] = (),
) -> str:
    """The server settings of cluster ``cluster`` in a federation (put before its
    accounts, :func:`accounts_conf`'s ``server``): JetStream in the domain
    ``cluster`` (its streams stay its own) and a leaf link to the hub at
    ``hub_url`` (``nats://leaf-<c>:<password>@hub:7422``) that binds
    ``APPORTION`` to the hub's ``FEDERATION`` account. Removing the
    ``leafnodes`` block and reloading the server (``nats-server --signal
    reload``) cuts the link without a restart; putting it back rejoins. Without
    ``hub_url``: the same server, not linked (a cluster that left).

    A cluster of three servers: each one's with its own ``server_name``,
    ``route_listen`` (``host:port``) and the three ``routes``
    (``nats://host:port``); every member of the cluster has the same domain and
    a leaf link of its own (checked with nats-server 2.15.1: an R3 INPUTS goes on
    sourcing after its leader is killed, docs/federation.md)."""
    lines = [
        f"server_name: {_q(server_name or f'apportion-{cluster}')}",
        f"listen: {listen}",
        "jetstream {",
        f"  store_dir: {_q(store_dir)}",
        f"  domain: {_q(cluster)}  # each cluster its own JetStream (docs/federation.md)",
        "}",
    ]
    if route_listen:
        lines += [
            "cluster {",
            f"  name: {_q(cluster)}",
            f"  listen: {route_listen}",
            f"  routes: [{', '.join(_q(r) for r in routes)}]",
            "  # clients use the servers their URL lists, each with its user; an advertised",
            "  # one comes without a user and is refused (Authorization Violation)",
            "  no_advertise: true",
            "}",
        ]
    if hub_url:
        lines += [
            "leafnodes {",
            "  remotes = [",
            f"    {{ url: {_q(hub_url)}, account: {_q(JS_ACCOUNT)} }}",
            "  ]",
            "}",
        ]
    return "\n".join([*lines, ""])


def leaf_permissions(
    cluster: str, clusters: Sequence[str], hub_domain: str
) -> tuple[list[str], list[str]]:
    """What the leaf link of ``cluster`` may send into the hub and receive from it
    (its hub user's publish and subscribe permissions): stream sourcing only.
    Sent: consumer creates on the peers' ``USAGE_<p>`` and on ``TREE``, the
    answers to the peers' creates on its own ``USAGE_<c>``, its usage delivered
    to the peers, flow control. Received: the peers' creates on ``USAGE_<c>``,
    answers, what its own sources deliver, flow control. Subjects measured on
    nats-server 2.15.1 (docs/federation.md)."""
    from .federation import TREE_STREAM, deliver_prefix, usage_stream

    peers = [p for p in clusters if p != cluster]
    send = [
        *(f"$JS.{p}.API.CONSUMER.CREATE.{usage_stream(p)}.>" for p in peers),
        f"$JS.{hub_domain}.API.CONSUMER.CREATE.{TREE_STREAM}.>",
        "$JSC.R.>",
        *(f"{deliver_prefix(p, cluster)}.>" for p in peers),
        "$JS.FC.>",
    ]
    receive = [
        f"$JS.{cluster}.API.CONSUMER.CREATE.{usage_stream(cluster)}.>",
        "$JSC.R.>",
        f"apportion.fed.{cluster}.from.>",
        "$JS.FC.>",
    ]
    return send, receive


def hub_conf(
    clusters: Sequence[str],
    passwords: Mapping[str, str],
    *,
    store_dir: str,
    listen: str = "127.0.0.1:4222",
    leaf_listen: str = "127.0.0.1:7422",
    domain: str = "",
) -> str:
    """The hub's whole configuration: JetStream in its own domain (``TREE``), a
    leaf listener, and the account ``FEDERATION`` with a user per cluster's leaf
    link (``leaf-<c>``, :func:`leaf_permissions`), the tree's admin
    (``tree-admin``: publishes the tree's kinds on ``apportion.tree.inputs.<Kind>``
    and creates ``TREE``) and the clusters' gateways (``gateway``: ``BudgetSet``
    and ``BudgetRemoved`` on the tree, nothing else). ``passwords`` maps each of those users to its password.
    A cluster added later: generate it again and reload the hub
    (``nats-server --signal reload``); no member restarts."""
    from .federation import (
        FEDERATION_ACCOUNT,
        HUB_DOMAIN,
        TREE_ADMIN,
        TREE_GATEWAY,
        TREE_KINDS,
        TREE_STREAM,
        leaf_user,
        tree_subject,
    )

    domain = domain or HUB_DOMAIN
    admin_pub = [
        *(tree_subject(k) for k in TREE_KINDS),
        "$JS.API.INFO",
        f"$JS.API.STREAM.INFO.{TREE_STREAM}",
        f"$JS.API.STREAM.CREATE.{TREE_STREAM}",
        f"$JS.API.DIRECT.GET.{TREE_STREAM}",
    ]
    admin_deny = [
        "$JS.API.STREAM.DELETE.>",
        "$JS.API.STREAM.PURGE.>",
        "$JS.API.STREAM.MSG.DELETE.>",
        "$JS.API.CONSUMER.>",
    ]
    users = [
        *_hub_user(
            "publishes budget edits once, for every cluster; creates TREE",
            TREE_ADMIN,
            passwords[TREE_ADMIN],
            admin_pub,
            [inbox_prefix(TREE_ADMIN) + ".>"],
            deny=admin_deny,
        ),
        *_hub_user(
            "a cluster's gateway in a federation (serve gateway --hub): budget edits only",
            TREE_GATEWAY,
            passwords[TREE_GATEWAY],
            [tree_subject(k) for k in TREE_KINDS],
            [inbox_prefix(TREE_GATEWAY) + ".>"],
        ),
    ]
    for c in clusters:
        send, receive = leaf_permissions(c, clusters, domain)
        users += _hub_user(
            f"the leaf link of cluster {c}: stream sourcing only",
            leaf_user(c),
            passwords[leaf_user(c)],
            send,
            receive,
        )
    out = [
        "# The hub of a federation of apportion clusters (generated by",
        "# apportion.services.natsconf.hub_conf; docs/federation.md).",
        f"server_name: {_q('apportion-hub')}",
        f"listen: {listen}",
        "jetstream {",
        f"  store_dir: {_q(store_dir)}",
        f"  domain: {_q(domain)}",
        "}",
        f"leafnodes {{ listen: {leaf_listen} }}",
        "accounts {",
        f"  {FEDERATION_ACCOUNT} {{",
        "    jetstream: enabled",
        "    users = [",
        *users,
        "    ]",
        "  }",
        "}",
    ]
    return "\n".join(out) + "\n"


def _hub_user(
    why: str,
    user: str,
    password: str,
    publish: Iterable[str],
    subscribe: Iterable[str],
    deny: Iterable[str] = (),
) -> list[str]:
    """The lines of one user of the hub's account."""
    deny = list(deny)
    return [
        "      {",
        f"        # {why}",
        f"        user: {_q(user)}, password: {_q(password)}",
        "        permissions {",
        "          publish {",
        "            allow: [",
        _list(publish, "              ").rstrip("\n"),
        "            ]",
        *(
            ["            deny: [", _list(deny, "              ").rstrip("\n"), "            ]"]
            if deny
            else []
        ),
        "          }",
        "          subscribe { allow: [",
        _list(subscribe, "            ").rstrip("\n"),
        "          ] }",
        "        }",
        "      }",
    ]


def hub_users(clusters: Iterable[str]) -> list[str]:
    """The hub's users: the tree's admin, the clusters' gateways and a leaf link per cluster."""
    from .federation import TREE_ADMIN, TREE_GATEWAY, leaf_user

    return [TREE_ADMIN, TREE_GATEWAY, *(leaf_user(c) for c in clusters)]
