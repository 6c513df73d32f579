"""The cluster file (TOML, docs/formats.md) as a list of input events.

::

    [cluster]
    name = "ai2"

    [[cluster.pool]]
    prefix = "h100-"          # nodes are named f"{prefix}{i:03d}", i = 0 .. count-1
    count = 128
    gpus_per_node = 8
    gpu_type = "h100"

    [policy]                   # optional; defaults 7d, 8h, 0 (see DEFAULT_MARGIN)
    lookback = "7d"
    max_min_runtime = "8h"
    preemption_margin = 0      # exact: converted to parts per million through Fraction
    preemption_margin_wait = "2h"  # queued this long, a workload is no longer held to the margin
    grace = "2m"               # preemption notice (default 0), at most max_grace (15m)
    max_grace = "15m"
    heartbeat_timeout = "1m"   # the live scheduler marks a silent node down (default 0: 300 s
                               # for hosts whose agent heartbeats; else at least 5 s)

    [budget]                   # the root
    owner = "ops"
    [budget.llm]               # child "llm"
    weight = 40
    owner = "alice"
    [budget.llm.pretrain]      # child "llm/pretrain"
    weight = 3
    owner = "bob"

**Several clusters, one budget tree** (a federation): ``[[clusters]]`` instead
of ``[cluster]``, each with its own ``name`` and ``[[clusters.pool]]``; one
``[policy]`` and one ``[budget]`` for all (each cluster's history gets them,
its ``PolicySet`` naming it and every cluster as its peers)::

    [[clusters]]
    name = "east"
    [[clusters.pool]]
    prefix = "e-h100-"
    count = 16
    gpus_per_node = 8
    gpu_type = "h100"

    [[clusters]]
    name = "west"
    [[clusters.pool]]
    prefix = "w-b200-"
    count = 8
    gpus_per_node = 8
    gpu_type = "b200"

    [policy]
    usage_summary = "5m"       # each cluster reports its usage to the others this often

    [federation]               # simulation only: how summaries travel
    delay = "5s"               # from a report to its arrival at every peer
    [[federation.partition]]   # the link of "west" is cut for a while:
    cluster = "west"           # summaries to and from it wait until it heals
    from = "2d"
    until = "2d6h"

Node names must differ across clusters. :func:`load_federation` reads either
form (a single cluster is a federation of one).

Budget children are created in file order (TOML tables keep their order).
Every :class:`BudgetSet` and the :class:`PolicySet` are issued by the root's
owner, who owns every ancestor. Errors raise :class:`InputFileError` naming the
file, the key and the reason.
"""

from __future__ import annotations

import re
import tomllib
from fractions import Fraction
from pathlib import Path
from typing import Any

import msgspec
from apportion.core.rules.federation import MAX_SUMMARY_MS, MIN_SUMMARY_MS
from apportion.core.rules.fence import heartbeat_timeout_problem
from apportion.core.rules.gpu_types import is_any
from apportion.schemas.bounds import MAX_GPUS, MAX_PEERS
from apportion.schemas.events import (
    HOUR_MS,
    PPM,
    BudgetSet,
    Input,
    NodeRegistered,
    PolicySet,
)

from .errors import InputFileError
from .textfile import read_text

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|d|w)\s*$")
_UNIT_MS = {
    "ms": 1,
    "s": 1000,
    "m": 60_000,
    "min": 60_000,
    "h": 3_600_000,
    "d": 86_400_000,
    "w": 604_800_000,
}


class ClusterSpec(msgspec.Struct, kw_only=True):
    name: str
    events: list[Input]
    """NodeRegistered per node, BudgetSet root first then children, PolicySet last."""
    nodes: list[tuple[str, int, str]]
    """``(node, gpus, gpu_type)`` in registration order."""
    budget: list[tuple[str, int, str]]
    """``(path, weight, owner)`` parents before children."""
    root_owner: str


def parse_duration_ms(text: Any) -> int:
    """``"7d"``, ``"8h"``, ``"15m"``, ``"30s"``, ``"250ms"``, ``"1.5h"`` -> exact milliseconds.

    Raises ``ValueError`` with a reason for anything else (a fractional millisecond too).
    """
    if not isinstance(text, str):
        raise ValueError(f'expected a duration such as "7d", "8h" or "15m", got {text!r}')
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f'expected a duration such as "7d", "8h" or "15m", got {text!r}')
    ms = Fraction(m.group(1)) * _UNIT_MS[m.group(2)]
    if ms.denominator != 1:
        raise ValueError(f"duration {text!r} is not a whole number of milliseconds")
    return int(ms)


def format_duration(ms: int) -> str:
    for unit in ("w", "d", "h", "m", "s"):
        if ms and ms % _UNIT_MS[unit] == 0:
            return f"{ms // _UNIT_MS[unit]}{unit}"
    return f"{ms}ms"


MAX_CLUSTER_NODES = 65_536
"""Nodes of one cluster, over all its pools (a cluster file of 70,000 nodes loads
and simulates a day of the debug trace in 3.5 s; past the bound a typo such as
``count = 100000000`` would fill the memory)."""
DEFAULT_MARGIN = 0
"""The preemption margin a cluster file gets when it names none: 0, so a workload
whose team is more under-served over the lookback window preempts work past its
contract at once. The contract is the hysteresis: a placed workload keeps its
GPUs for its minimum runtime, so near-equal teams cannot preempt each other back
and forth faster than that. A relative margin on 7-day usage is worth about
``margin x lookback`` of running at share (8.4 h at 0.05) and, once fair share
has brought the teams' ratios together, blocks every preemption between them:
``apportion diagnose`` measured it at 4.6-14.8% of owed GPU-hours on the
``make outcomes`` grid (README). A ``PolicySet`` event that omits the field
still means 0.05 (the event schema does not change meaning)."""

DEFAULT_MARGIN_WAIT_MS = 2 * HOUR_MS
"""How long a waiting workload is held to a margin when the cluster file sets a
margin but no ``preemption_margin_wait``: 2 h (with no margin the file's
``PolicySet`` carries no wait, as before the field existed). Queued that long, it outranks any
running workload whose side's ratio is strictly higher. Without a wait, a gang
whose team is under-served, but inside the margin of the teams holding the
nodes it needs, has no start the contract can tell (it may preempt none of
them) and waits for enough of them to end on their own at once; on the big-team
cells with margin 0.05 that was the `margin` cause of `apportion diagnose`
(4.9-10.3% of owed GPU-hours). A ``PolicySet`` event that omits the field means
0 (held however long it waits), as before the field existed."""


def margin_ppm(value: Any) -> int:
    """``0.05`` -> ``50000`` exactly (through the decimal text, never float arithmetic)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a number in [0, 1), got {value!r}")
    try:
        frac = Fraction(str(value))
    except ValueError:
        raise ValueError(f"expected a number in [0, 1), got {value!r}") from None
    if not 0 <= frac < 1:
        raise ValueError(f"must be in [0, 1), got {value}")
    ppm = frac * PPM
    if ppm.denominator != 1:
        raise ValueError(f"{value} is finer than one part per million")
    return int(ppm)


def load_cluster(path: str | Path, at_ms: int = 0) -> ClusterSpec:
    """Read a cluster TOML file; raise :class:`InputFileError` on any problem."""
    return cluster_from_dict(_read_toml(path), str(path), at_ms)


def _read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a document; :class:`InputFileError` if it cannot be read."""
    text = read_text(Path(path))  # UTF-8 (a byte-order mark is dropped) or one clear error
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputFileError(str(path), None, f"TOML syntax: {exc}") from None


def cluster_from_dict(doc: dict[str, Any], file: str = "<cluster>", at_ms: int = 0) -> ClusterSpec:
    def fail(key: str, reason: str) -> InputFileError:
        return InputFileError(file, key, reason)

    unknown = sorted(set(doc) - {"cluster", "policy", "budget"})
    if unknown == ["clusters"] or unknown == ["clusters", "federation"]:
        raise fail(
            "clusters",
            "a file of several clusters (read as a federation by simulate and outcomes); "
            "a live cluster takes one [cluster]: give each its own file "
            "(docs/federation.md)",
        )
    if unknown:
        raise fail(unknown[0], "unknown table (expected [cluster], [policy], [budget])")
    cluster = doc.get("cluster")
    if not isinstance(cluster, dict):
        raise fail("cluster", "missing [cluster] table")
    name = cluster.get("name", "cluster")
    if not isinstance(name, str) or not name:
        raise fail("cluster.name", "must be a non-empty string")
    pools = cluster.get("pool")
    if not isinstance(pools, list) or not pools:
        raise fail(
            "cluster.pool",
            "need at least one [[cluster.pool]] with prefix, count, gpus_per_node, gpu_type",
        )
    budget_doc = doc.get("budget", {})
    if not isinstance(budget_doc, dict):
        raise fail("budget", "must be a table")
    root_owner = budget_doc.get("owner", "root")
    if not isinstance(root_owner, str) or not root_owner:
        raise fail("budget.owner", "must be a non-empty string")
    # the root's owner registers the hosts and sets the budget and the policy
    events: list[Input] = []
    nodes: list[tuple[str, int, str]] = []
    seen: set[str] = set()
    for i, pool in enumerate(pools):
        key = f"cluster.pool[{i}]"
        if not isinstance(pool, dict):
            raise fail(key, "must be a table")
        extra = sorted(set(pool) - {"prefix", "count", "gpus_per_node", "gpu_type", "start"})
        if extra:
            raise fail(f"{key}.{extra[0]}", "unknown key")
        prefix = pool.get("prefix")
        if not isinstance(prefix, str) or not prefix:
            raise fail(f"{key}.prefix", "must be a non-empty string")
        for field in ("count", "gpus_per_node"):
            v = pool.get(field)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise fail(f"{key}.{field}", f"must be a positive integer, got {v!r}")
        if pool["gpus_per_node"] > MAX_GPUS:
            raise fail(
                f"{key}.gpus_per_node", f"at most {MAX_GPUS:,}, got {pool['gpus_per_node']:,}"
            )
        if len(nodes) + pool["count"] > MAX_CLUSTER_NODES:
            before = f" ({len(nodes):,} in the pools before)" if nodes else ""
            raise fail(
                f"{key}.count",
                f"a cluster has at most {MAX_CLUSTER_NODES:,} nodes{before}, got {pool['count']:,}",
            )
        gpu_type = pool.get("gpu_type")
        if not isinstance(gpu_type, str) or is_any(gpu_type):
            raise fail(f"{key}.gpu_type", f"must name a GPU type, got {gpu_type!r}")
        start = pool.get("start", 0)
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise fail(f"{key}.start", f"must be a non-negative integer, got {start!r}")
        for n in range(start, start + pool["count"]):
            node = f"{prefix}{n:03d}"
            if node in seen:
                raise fail(f"{key}.prefix", f"node name {node!r} repeats an earlier pool's")
            seen.add(node)
            nodes.append((node, pool["gpus_per_node"], gpu_type))
            events.append(
                NodeRegistered(
                    id=f"cluster/node/{node}",
                    at_ms=at_ms,
                    node=node,
                    gpus=pool["gpus_per_node"],
                    gpu_type=gpu_type,
                    actor=root_owner,
                )
            )

    root_weight = budget_doc.get("weight", 1)
    if isinstance(root_weight, bool) or not isinstance(root_weight, int) or root_weight <= 0:
        raise fail("budget.weight", f"must be a positive integer, got {root_weight!r}")
    budget: list[tuple[str, int, str]] = [("", root_weight, root_owner)]

    def walk(table: dict[str, Any], path: str, key: str) -> None:
        for child, value in table.items():
            if child in ("weight", "owner"):
                continue
            ckey = f"{key}.{child}"
            if not isinstance(value, dict):
                raise fail(
                    ckey, "unknown key (a budget table holds weight, owner and child tables)"
                )
            cpath = f"{path}/{child}" if path else child
            weight = value.get("weight")
            if isinstance(weight, bool) or not isinstance(weight, int) or weight <= 0:
                raise fail(f"{ckey}.weight", f"must be a positive integer, got {weight!r}")
            owner = value.get("owner")
            if not isinstance(owner, str) or not owner:
                raise fail(f"{ckey}.owner", f"must be a non-empty string, got {owner!r}")
            budget.append((cpath, weight, owner))
            walk(value, cpath, ckey)

    walk(budget_doc, "", "budget")
    if len(budget) == 1:
        raise fail(
            "budget",
            "the budget tree has no children; add [budget.NAME] tables with weight and owner",
        )
    for path_, weight, owner in budget:
        events.append(
            BudgetSet(
                id=f"cluster/budget/{path_}",
                at_ms=at_ms,
                path=path_,
                weight=weight,
                owner=owner,
                actor=root_owner,
            )
        )

    policy = doc.get("policy", {})
    if not isinstance(policy, dict):
        raise fail("policy", "must be a table")
    extra = sorted(
        set(policy)
        - {
            "lookback",
            "max_min_runtime",
            "preemption_margin",
            "reservations",
            "operators",
            "grace",
            "max_grace",
            "heartbeat_timeout",
            "preemption_margin_wait",
            "usage_summary",
        }
    )
    if extra:
        raise fail(f"policy.{extra[0]}", "unknown key")
    kwargs: dict[str, Any] = {}
    try:
        if "lookback" in policy:
            kwargs["lookback_ms"] = parse_duration_ms(policy["lookback"])
    except ValueError as exc:
        raise fail("policy.lookback", str(exc)) from None
    try:
        if "max_min_runtime" in policy:
            kwargs["max_min_runtime_ms"] = parse_duration_ms(policy["max_min_runtime"])
    except ValueError as exc:
        raise fail("policy.max_min_runtime", str(exc)) from None
    for key, field in (
        ("grace", "grace_ms"),
        ("max_grace", "max_grace_ms"),
        ("heartbeat_timeout", "heartbeat_timeout_ms"),
        ("preemption_margin_wait", "preemption_margin_wait_ms"),
        ("usage_summary", "usage_summary_ms"),
    ):
        try:
            if key in policy:
                kwargs[field] = parse_duration_ms(policy[key])
        except ValueError as exc:
            raise fail(f"policy.{key}", str(exc)) from None
    lookback_ms = kwargs.get("lookback_ms", PolicySet(id="-", at_ms=0).lookback_ms)
    if kwargs.get("preemption_margin_wait_ms", 0) > lookback_ms:
        raise fail("policy.preemption_margin_wait", "must not exceed the lookback")
    problem = heartbeat_timeout_problem(kwargs.get("heartbeat_timeout_ms", 0))
    if problem:
        raise fail("policy.heartbeat_timeout", problem)
    max_grace = kwargs.get("max_grace_ms", PolicySet(id="-", at_ms=0).max_grace_ms)
    if kwargs.get("grace_ms", 0) > max_grace:
        raise fail("policy.grace", f"must not exceed max_grace ({format_duration(max_grace)})")
    try:
        kwargs["preemption_margin_ppm"] = margin_ppm(
            policy.get("preemption_margin", DEFAULT_MARGIN)
        )
    except ValueError as exc:
        raise fail("policy.preemption_margin", str(exc)) from None
    summary = kwargs.get("usage_summary_ms")
    if summary is not None and not MIN_SUMMARY_MS <= summary <= MAX_SUMMARY_MS:
        raise fail("policy.usage_summary", "must be between 10s and 1h")
    if kwargs["preemption_margin_ppm"]:  # a wait only means something with a margin
        kwargs.setdefault("preemption_margin_wait_ms", DEFAULT_MARGIN_WAIT_MS)
    if "reservations" in policy:
        if not isinstance(policy["reservations"], bool):
            raise fail("policy.reservations", "must be true or false")
        kwargs["reservations"] = policy["reservations"]
    if "operators" in policy:
        ops = policy["operators"]
        if not isinstance(ops, list) or not all(isinstance(o, str) and o for o in ops):
            raise fail("policy.operators", "must be a list of names")
        kwargs["operators"] = tuple(ops)
    events.append(PolicySet(id="cluster/policy", at_ms=at_ms, actor=root_owner, **kwargs))
    return ClusterSpec(name=name, events=events, nodes=nodes, budget=budget, root_owner=root_owner)


DEFAULT_SUMMARY_DELAY_MS = 5_000
"""How long a usage report takes to reach every peer in a simulation (``[federation] delay``)."""


class Partition(msgspec.Struct, frozen=True, kw_only=True):
    """The link of ``cluster`` to every other is cut in ``[from_ms, until_ms)``."""

    cluster: str
    from_ms: int
    until_ms: int


class FederationSpec(msgspec.Struct, kw_only=True):
    """Several clusters, one budget tree and policy (a single cluster is one of one)."""

    clusters: list[ClusterSpec]
    """By name."""
    delay_ms: int = DEFAULT_SUMMARY_DELAY_MS
    partitions: list[Partition] = msgspec.field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.clusters]


def load_federation(path: str | Path, at_ms: int = 0) -> FederationSpec:
    """Read a cluster TOML file of one cluster or several; raise :class:`InputFileError`."""
    return federation_from_dict(_read_toml(path), str(path), at_ms)


def federation_from_dict(
    doc: dict[str, Any], file: str = "<cluster>", at_ms: int = 0
) -> FederationSpec:
    """A federation from a cluster document with ``[[clusters]]`` (or a federation
    of one from a document with ``[cluster]``)."""

    def fail(key: str, reason: str) -> InputFileError:
        return InputFileError(file, key, reason)

    if "clusters" not in doc:
        if "federation" in doc:
            raise fail("federation", "goes with [[clusters]] (several clusters)")
        return FederationSpec(clusters=[cluster_from_dict(doc, file, at_ms)])
    if "cluster" in doc:
        raise fail("cluster", "use either [cluster] or [[clusters]], not both")
    members = doc["clusters"]
    if not isinstance(members, list) or not members:
        raise fail("clusters", "need at least one [[clusters]] with a name and pools")
    if len(members) > MAX_PEERS:  # every cluster's policy names them all
        raise fail("clusters", f"at most {MAX_PEERS} clusters share a tree, got {len(members)}")
    fed = doc.get("federation", {})
    if not isinstance(fed, dict):
        raise fail("federation", "must be a table")
    extra = sorted(set(fed) - {"delay", "partition"})
    if extra:
        raise fail(f"federation.{extra[0]}", "unknown key")
    rest = {k: v for k, v in doc.items() if k not in ("clusters", "federation")}
    specs: list[ClusterSpec] = []
    names: list[str] = []
    for i, member in enumerate(members):
        if not isinstance(member, dict):
            raise fail(f"clusters[{i}]", "must be a table")
        name = member.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise fail(f"clusters[{i}].name", "must be a non-empty name, unique in the file")
        names.append(name)
        try:
            specs.append(cluster_from_dict({**rest, "cluster": member}, file, at_ms))
        except InputFileError as exc:
            raise InputFileError(file, f"clusters[{i}] ({name})", str(exc)) from None
    seen: dict[str, str] = {}
    for spec in specs:
        for node, _, _ in spec.nodes:
            if node in seen:
                raise fail("clusters", f"node {node!r} is in both {seen[node]!r} and {spec.name!r}")
            seen[node] = spec.name
    peers = tuple(sorted(names))
    for spec in specs:  # every cluster names itself and all the others
        policy = spec.events[-1]
        assert isinstance(policy, PolicySet)
        spec.events[-1] = msgspec.structs.replace(policy, cluster=spec.name, peers=peers)
    try:
        delay = parse_duration_ms(fed["delay"]) if "delay" in fed else DEFAULT_SUMMARY_DELAY_MS
    except ValueError as exc:
        raise fail("federation.delay", str(exc)) from None
    if delay <= 0:
        raise fail("federation.delay", "must be positive (a report reaches its peers later)")
    partitions = []
    for i, part in enumerate(fed.get("partition", [])):
        key = f"federation.partition[{i}]"
        if not isinstance(part, dict) or set(part) != {"cluster", "from", "until"}:
            raise fail(key, "needs exactly cluster, from and until")
        if part["cluster"] not in names:
            raise fail(f"{key}.cluster", f"no cluster {part['cluster']!r} in the file")
        try:
            a, b = parse_duration_ms(part["from"]), parse_duration_ms(part["until"])
        except ValueError as exc:
            raise fail(key, str(exc)) from None
        if not a < b:
            raise fail(key, "from must be before until")
        partitions.append(Partition(cluster=part["cluster"], from_ms=at_ms + a, until_ms=at_ms + b))
    specs.sort(key=lambda c: c.name)
    return FederationSpec(clusters=specs, delay_ms=delay, partitions=partitions)


def _toml_key(segment: str) -> str:
    return (
        segment
        if re.fullmatch(r"[A-Za-z0-9_-]+", segment)
        else '"' + segment.replace('"', '\\"') + '"'
    )


def write_cluster(
    path: str | Path,
    *,
    name: str,
    pools: list[tuple[str, int, int, str]],
    budget: list[tuple[str, int, str]],
    policy: dict[str, Any] | None = None,
    comment: str = "",
    clusters: list[tuple[str, list[tuple[str, int, int, str, int]]]] | None = None,
) -> None:
    """Write a cluster TOML: ``pools`` of ``(prefix, count, gpus_per_node, gpu_type)``,
    ``budget`` of ``(path, weight, owner)`` with the root ``""`` first, parents before
    children; with ``clusters`` (``(name, [(prefix, count, gpus_per_node, gpu_type,
    start)])``), the same nodes as several clusters (``[[clusters]]``) instead."""
    lines: list[str] = []
    for c in comment.splitlines():
        lines.append(f"# {c}".rstrip())
    members = clusters or [(name, [(*p, 0) for p in pools])]
    for cname, cpools in members:
        lines += ["[[clusters]]" if clusters else "[cluster]", f'name = "{cname}"', ""]
        for prefix, count, gpn, gtype, start in cpools:
            lines += [
                "[[clusters.pool]]" if clusters else "[[cluster.pool]]",
                f'prefix = "{prefix}"',
                f"count = {count}",
                f"gpus_per_node = {gpn}",
                f'gpu_type = "{gtype}"',
                *([f"start = {start}"] if start else []),
                "",
            ]
    lines.append("[policy]")
    for k, v in (
        policy or {"lookback": "7d", "max_min_runtime": "8h", "preemption_margin": DEFAULT_MARGIN}
    ).items():
        lines.append(
            f'{k} = "{v}"'
            if isinstance(v, str)
            else f"{k} = {str(v).lower() if isinstance(v, bool) else v}"
        )
    lines.append("")
    for p, weight, owner in budget:
        if p == "":
            lines += ["[budget]", f'owner = "{owner}"', ""]
        else:
            key = ".".join(_toml_key(s) for s in p.split("/"))
            lines += [f"[budget.{key}]", f"weight = {weight}", f'owner = "{owner}"', ""]
    Path(path).write_text("\n".join(lines))
