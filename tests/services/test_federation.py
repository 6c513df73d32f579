"""Clusters joined through NATS itself (issue 29, services/federation.py).

Real nats-servers as the topology of docs/federation.md: a hub (JetStream
domain ``hub``, the ``TREE`` stream) and one server per cluster (its own
JetStream domain, the production accounts, a leaf link binding ``APPORTION``
to the hub's ``FEDERATION`` account with the generated leaf permissions).
Each cluster's INPUTS sources its peer's ``USAGE_<peer>`` and the hub's
``TREE``; a forwarder publishes the ``UsageReported`` decisions of its
cluster's batches to ``USAGE_<c>``.

Most tests write the decision batches by hand as JSON (the forwarder reads them
as JSON and does not need the decision's schema); the end-to-end one runs a
real scheduler, forwarder and executor emulator on each cluster, and audits
each cluster's history after a partition.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from apportion.services import federation as fed
from apportion.services.bus import JetStreamLog, connect
from apportion.services.direct import DirectGetError
from apportion.services.natsconf import (
    accounts_conf,
    federated_server,
    hub_conf,
    hub_users,
    user_url,
    users_of,
)
from apportion.services.stack import free_port
from conftest import NatsServer, nats_server_binary, password
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

pytestmark = pytest.mark.nats

CLUSTERS = ("east", "west")
WAIT_S = 120.0
"""The bound of every wait for sourced messages (sources retry with a back-off
after a link comes back)."""


class Topology:
    """A hub and a server per cluster, each started from its generated configuration."""

    def __init__(
        self, tmp: Path, clusters: tuple[str, ...], sizes: dict[str, int] | None = None
    ) -> None:
        binary = nats_server_binary()
        if binary is None:
            pytest.skip("no nats-server binary")
        self.clusters = clusters
        self.sizes = {c: (sizes or {}).get(c, 1) for c in clusters}
        self._tmp = tmp
        self.leaf_port = free_port()
        self.monitor_port = free_port()
        hub_port = free_port()
        self.hub = NatsServer(
            f"nats://127.0.0.1:{hub_port}",
            binary,
            tmp / "hub",
            hub_port,
            conf=hub_conf(
                clusters,
                {u: password(u) for u in hub_users(clusters)},
                store_dir=str(tmp / "hub" / "js"),
                listen=f"127.0.0.1:{hub_port}",
                leaf_listen=f"127.0.0.1:{self.leaf_port}",
            )
            + f"http: 127.0.0.1:{self.monitor_port}\n",
        )
        self.routes = {c: [free_port() for _ in range(n)] for c, n in self.sizes.items() if n > 1}
        self.members: dict[str, list[NatsServer]] = {}
        for c in clusters:
            self.members[c] = []
            for i in range(self.sizes[c]):
                port = free_port()
                conf = self.conf(c, linked=True, member=i)
                self.members[c].append(
                    NatsServer(f"nats://127.0.0.1:{port}", binary, tmp / f"{c}{i}", port, conf=conf)
                )
        self.servers = {c: m[0] for c, m in self.members.items()}
        """The first server of each cluster (the only one where a cluster has one)."""

    def conf(self, c: str, *, linked: bool, member: int = 0) -> str:
        hub_url = user_url(f"nats://127.0.0.1:{self.leaf_port}", f"leaf-{c}", password(f"leaf-{c}"))
        routes = self.routes.get(c, [])
        server = federated_server(
            c,
            hub_url if linked else "",
            store_dir=str(self._tmp / f"{c}{member}" / "js"),
            listen="127.0.0.1:4222",  # the port is given on the command line
            server_name=f"{c}-{member}",
            route_listen=f"127.0.0.1:{routes[member]}" if routes else "",
            routes=[f"nats://127.0.0.1:{r}" for r in routes],
        )
        return accounts_conf(c, [], {u: password(u) for u in users_of([])}, server=server)

    def url_as(self, c: str, user: str) -> str:
        """Every server of cluster ``c``, as ``user``."""
        return ",".join(m.url_as(user) for m in self.members[c])

    def start(self) -> None:
        self.hub.start()
        for members in self.members.values():
            for m in members:
                m.start()

    def stop(self) -> None:
        for m in [*(m for ms in self.members.values() for m in ms), self.hub]:
            m.stop()

    def relink(self, c: str, linked: bool) -> None:
        """Reload cluster ``c``'s server with (or without) its leaf link: no restart."""
        server = self.servers[c]
        server.conf = self.conf(c, linked=linked)
        assert server.store is not None and server.proc is not None
        (server.store / "server.conf").write_text(server.conf)
        server.proc.send_signal(signal.SIGHUP)

    def leafs(self) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/leafz", timeout=5) as r:
            return int(json.load(r).get("leafnodes", 0))

    async def wait_leafs(self, n: int) -> None:
        async with asyncio.timeout(WAIT_S):
            while await asyncio.to_thread(self.leafs) != n:
                await asyncio.sleep(0.1)


@pytest.fixture
async def topology(tmp_path: Path) -> AsyncIterator[Topology]:
    t = Topology(tmp_path, CLUSTERS)
    t.start()
    try:
        await t.wait_leafs(len(CLUSTERS))
        yield t
    finally:
        t.stop()


class Side:
    """One cluster as its scheduler sees it: its streams, its forwarder, a batch writer."""

    def __init__(self, c: str, nc: Any) -> None:
        self.c = c
        self.nc = nc
        self.js = nc.jetstream(timeout=5.0)
        self.forwarder = fed.UsageForwarder(nc, c)
        self.starts: list[int] = []
        self._batches = 0

    async def batch(self, *starts: int) -> None:
        """Store a decision batch holding a ``UsageReported`` for each interval start
        (and a placement, which the forwarder leaves alone)."""
        decisions: list[dict[str, Any]] = [
            {"kind": "WorkloadPlaced", "id": f"p{self._batches}", "at_ms": 1, "workload": "w"}
        ]
        for s in starts:
            decisions.append(
                {
                    "kind": fed.REPORT_KIND,
                    "id": f"r-{self.c}-{s}",
                    "at_ms": s + 60_000,
                    "cluster": self.c,
                    "start_ms": s,
                    "end_ms": s + 60_000,
                    "charges": [["llm/pretrain", 8 * 60_000]],
                }
            )
        body = json.dumps({"basis": self._batches, "decisions": decisions}).encode()
        try:
            await self.js.publish(
                f"apportion.{self.c}.decisions",
                body,
                headers={"Nats-Expected-Last-Sequence": str(self._batches)},
            )
        except APIError as exc:
            # an earlier attempt was stored, its answer lost (a leader died under it)
            if exc.err_code != 10071 or await self._last_batch() != self._batches + 1:
                raise
        self._batches += 1
        self.starts += starts

    async def _last_batch(self) -> int:
        return int((await self.js.stream_info(f"DECISIONS_{self.c}")).state.last_seq)

    async def batch_retrying(self, *starts: int) -> None:
        """:meth:`batch` again and again while the stream elects a leader."""
        async with asyncio.timeout(WAIT_S):
            while True:
                try:
                    return await self.batch(*starts)
                except (NoStreamResponseError, ServiceUnavailableError, TimeoutError):
                    await asyncio.sleep(0.2)


async def _forwarded(side: Side) -> int:
    """``forward_once``, counting an error of a stream electing its leader as nothing sent."""
    try:
        return await side.forwarder.forward_once()
    except (NoStreamResponseError, ServiceUnavailableError, TimeoutError, DirectGetError):
        return 0


async def _side(t: Topology, c: str) -> Side:
    nc = await connect(t.url_as(c, "scheduler"), name=f"sched-{c}")
    await JetStreamLog(nc.jetstream(), c, replicas=min(t.sizes[c], 3)).setup()
    return Side(c, nc)


async def _tree_admin(t: Topology) -> Any:
    nc = await connect(t.hub.url_as(fed.TREE_ADMIN), name="tree-admin")
    await fed.ensure_tree_stream(nc.jetstream(timeout=5.0))
    return nc


async def _publish_tree(
    admin: Any, path: str, weight: int, owner: str = "alice", actor: str = "admin"
) -> str:
    event_id = f"budget-{path}-{weight}"
    body = {
        "kind": "BudgetSet",
        "id": event_id,
        "at_ms": 1,
        "path": path,
        "weight": weight,
        "owner": owner,
        "actor": actor,
    }
    await admin.jetstream(timeout=5.0).publish(
        fed.tree_subject("BudgetSet"), json.dumps(body).encode(), headers={"Nats-Msg-Id": event_id}
    )
    return event_id


async def _messages(side: Side, stream: str) -> list[tuple[str, dict[str, Any]]]:
    """Every message of the side's stream ``stream`` (``INPUTS``, ``DECISIONS``):
    (subject, payload). INPUTS as its leader holds it; the scheduler may read
    the others with direct gets only."""
    name = f"{stream}_{side.c}"
    info = await side.js.stream_info(name)
    out = []
    for seq in range(info.state.first_seq or 1, info.state.last_seq + 1):
        m = await side.js.get_msg(name, seq, direct=stream != "INPUTS")
        out.append((m.subject, json.loads(m.data)))
    return out


async def _inputs(side: Side) -> list[tuple[str, dict[str, Any]]]:
    """Every message of the side's INPUTS: (subject, payload)."""
    return await _messages(side, "INPUTS")


async def _until(side: Side, done: Any) -> list[tuple[str, dict[str, Any]]]:
    async with asyncio.timeout(WAIT_S):
        while True:
            try:
                got = await _inputs(side)
            except (NoStreamResponseError, ServiceUnavailableError, TimeoutError):
                got = []  # a stream electing its leader: ask again
            if got and done(got):
                return got
            await asyncio.sleep(0.2)


def _summaries(got: list[tuple[str, dict[str, Any]]], me: str, source: str) -> list[int]:
    subject = fed.summary_subject(me, source)
    return [body["start_ms"] for subj, body in got if subj == subject]


def _tree_ids(got: list[tuple[str, dict[str, Any]]], me: str) -> list[str]:
    return [body["id"] for subj, body in got if subj == f"apportion.{me}.inputs.BudgetSet.tree"]


async def _check_arrived(
    sides: dict[str, Side], tree: list[str]
) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Wait until every summary of each side and every tree edit are in every
    peer's INPUTS, then check each arrived exactly once and in order."""
    out = {}
    for me, side in sides.items():
        peers = [p for p in sides if p != me]

        def complete(
            got: list[tuple[str, dict[str, Any]]], me: str = me, peers: list[str] = peers
        ) -> bool:
            return len(_tree_ids(got, me)) >= len(tree) and all(
                len(_summaries(got, me, p)) >= len(sides[p].starts) for p in peers
            )

        got = await _until(side, complete)
        for p in peers:
            assert _summaries(got, me, p) == sides[p].starts, (me, p)
        assert _tree_ids(got, me) == tree, me
        out[me] = got
    return out


async def test_summaries_and_tree_edits_reach_every_cluster_once(topology: Topology) -> None:
    t = topology
    admin = await _tree_admin(t)
    sides = {c: await _side(t, c) for c in CLUSTERS}
    try:
        for c, side in sides.items():
            names = await fed.join(side.js, c, [p for p in CLUSTERS if p != c])
            assert names == [f"USAGE_{p}" for p in CLUSTERS if p != c] + ["TREE"]
        await sides["east"].batch(0, 60_000)
        await sides["east"].batch()  # a batch without a summary
        await sides["west"].batch(0)
        await sides["east"].batch(120_000)
        for side in sides.values():
            await side.forwarder.forward_once()
        tree = [await _publish_tree(admin, "llm", 3)]
        got = await _check_arrived(sides, tree)

        # what a peer stores is a UsageSummary input naming its source, with the
        # report's fields as they were; its id is the dedup key
        body = next(b for s, b in got["west"] if s == fed.summary_subject("west", "east"))
        assert body == {
            "kind": fed.SUMMARY_KIND,
            "id": "usage:east:0",
            "at_ms": body["at_ms"],  # the time the forwarder sent it
            "source": "east",
            "start_ms": 0,
            "end_ms": 60_000,
            "charges": [["llm/pretrain", 480_000]],
        }

        # a forwarder started again (another scheduler leading) sends nothing twice
        again = fed.UsageForwarder(sides["east"].nc, "east")
        assert await again.forward_once() == 0
        await sides["east"].batch(180_000)
        assert await again.forward_once() == 1
        assert await sides["east"].forwarder.forward_once() == 0  # fenced, then caught up
        await _check_arrived(sides, tree)

        # status names each source, and the scheduler's metrics show them
        states = await fed.status(sides["west"].js, "west")
        assert [s.name for s in states] == ["USAGE_east", "TREE"]
        from apportion.services.scheduler import Scheduler

        text = (await Scheduler(JetStreamLog(sides["west"].js, "west")).metrics_text()).decode()
        for name in ("USAGE_east", "TREE"):
            assert f'apportion_federation_source_lag{{source="{name}"}} 0.0' in text, text
            assert f'apportion_federation_source_error{{source="{name}"}} 0.0' in text

        # leave stops sourcing a peer (what came stays)
        assert await fed.leave(sides["west"].js, "west", ["east"]) == ["TREE"]
        assert len(_summaries(await _inputs(sides["west"]), "west", "east")) == 4
        assert await fed.join(sides["west"].js, "west", ["east"]) == ["USAGE_east", "TREE"]
    finally:
        for side in sides.values():
            await side.nc.close()
        await admin.close()


def test_the_leaf_link_carries_sourcing_only() -> None:
    """The hub user of a cluster's leaf link may not reach the peers' INPUTS or
    the hub's JetStream API beyond creating source consumers."""
    from apportion.services.natsconf import leaf_permissions

    send, receive = leaf_permissions("east", ["east", "west", "north"], "hub")
    assert "$JS.west.API.CONSUMER.CREATE.USAGE_west.>" in send
    assert not any("INPUTS" in s or "STREAM" in s or "tree.inputs" in s for s in send)
    assert not any("INPUTS" in s or "STREAM" in s for s in receive)


@pytest.mark.slow
async def test_a_partition_loses_nothing_and_counts_nothing_twice(topology: Topology) -> None:
    """Cut ``east`` off (its server reloaded without the leaf link), keep both
    sides writing, restart ``west``'s server on the way, rejoin: every summary
    and tree edit arrives in every cluster exactly once, in order per source."""
    t = topology
    admin = await _tree_admin(t)
    sides = {c: await _side(t, c) for c in CLUSTERS}
    try:
        for c, side in sides.items():
            await fed.join(side.js, c, [p for p in CLUSTERS if p != c])
        minute = 60_000
        for k in range(3):
            for side in sides.values():
                await side.batch(k * minute)
                await side.forwarder.forward_once()
        tree = [await _publish_tree(admin, "llm", 1)]
        await _check_arrived(sides, tree)

        # 1. cut east off: both sides keep deciding and forwarding
        t.relink("east", linked=False)
        await t.wait_leafs(1)
        for k in range(3, 8):
            for side in sides.values():
                await side.batch(k * minute)
                await side.forwarder.forward_once()
        tree.append(await _publish_tree(admin, "llm", 2))  # the tree edit east cannot see yet
        east = await _inputs(sides["east"])
        assert _tree_ids(east, "east") == tree[:1]

        # 2. west's server restarts during the partition (its store kept)
        await sides["west"].nc.close()
        t.servers["west"].stop()
        t.servers["west"].start()
        west = await _side(t, "west")
        west.starts, west._batches = sides["west"].starts, sides["west"]._batches
        sides["west"] = west
        await t.wait_leafs(1)
        for k in range(8, 10):
            for side in sides.values():
                await side.batch(k * minute)
                await side.forwarder.forward_once()

        # 3. rejoin: everything arrives, once, in order
        t.relink("east", linked=True)
        await t.wait_leafs(2)
        for side in sides.values():
            await side.batch(10 * minute)
            await side.forwarder.forward_once()
        tree.append(await _publish_tree(admin, "llm", 3))
        await _check_arrived(sides, tree)
        for side in sides.values():
            assert side.starts == [k * minute for k in range(11)]
    finally:
        for side in sides.values():
            await side.nc.close()
        await admin.close()


async def _decisions(side: Side) -> list[dict[str, Any]]:
    """Every decision of the side's DECISIONS, in order."""
    return [d for _, batch in await _messages(side, "DECISIONS") for d in batch["decisions"]]


def _charged(reports: list[dict[str, Any]], path: str) -> int:
    """GPU-ms the ``UsageReported`` decisions ``reports`` charge to ``path`` and the
    nodes under it (the root ``""``: everything)."""
    return sum(
        gpu_ms
        for r in reports
        for leaf, gpu_ms in r["charges"]
        if path in ("", leaf) or leaf.startswith(f"{path}/")
    )


@pytest.mark.slow
async def test_two_schedulers_count_each_others_usage_once_through_a_partition(
    topology: Topology,
) -> None:
    """Issue 29's partition test, end to end: ``east`` and ``west`` each run a
    scheduler with its usage forwarder (``runner.run_scheduler``) under a policy
    naming both, with 10 s summaries; one budget tree (teams ``a`` and ``b``)
    made on the hub; work on ``east`` only, run by the executor emulator.
    ``west`` counts ``east``'s usage (``a`` ranks below idle ``b``). ``east`` is
    cut off for three whole summary intervals and more while both go on
    deciding, then rejoined: every ``UsageReported`` of each cluster is folded by the other
    exactly once (none refused, the peer's totals equal the reported sums, the
    intervals heard one span), and each cluster's audit reproduces every
    decision batch its scheduler wrote."""
    from apportion.core.ordering import FairShareView
    from apportion.core.rules.federation import MIN_SUMMARY_MS, heard_until, interval_end
    from apportion.core.state import State
    from apportion.core.usage import PeerSeries
    from apportion.schemas.events import NodeRegistered, PolicySet
    from apportion.services.executor import Executor
    from apportion.services.runner import run_scheduler
    from apportion.services.scheduler import Scheduler, wall_ms
    from services_helpers import audit_live, eventually, submit

    t = topology
    admin = await _tree_admin(t)
    sides = {c: await _side(t, c) for c in CLUSTERS}
    ops = {c: await connect(t.url_as(c, "operator"), name=f"op-{c}") for c in CLUSTERS}
    exe = await connect(t.url_as("east", "executor"), name="executor-east")
    oplog = {c: JetStreamLog(nc.jetstream(timeout=5.0), c) for c, nc in ops.items()}
    schedulers = {c: Scheduler(JetStreamLog(sides[c].js, c), name=c) for c in CLUSTERS}
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    def state(c: str) -> State:
        """What ``c``'s scheduler holds now (an empty state while it recovers)."""
        return schedulers[c].state or State()

    def ended(*workloads: str) -> bool:
        return all(state("east").status_of(w) == "succeeded" for w in workloads)

    def reported(c: str) -> int:
        return state(c).reported_until_ms or 0

    def heard(c: str, source: str) -> int:
        return heard_until(state(c), source) or 0

    def a_below_b() -> bool:
        view = FairShareView(state("west"))
        a, b = view.charged.get("a", 0), view.charged.get("b", 0)
        return a > 0 and b == 0 and view.rank("a") > view.rank("b")

    async def run_on_east(*names: str, duration_ms: int) -> None:
        await oplog["east"].publish_inputs(
            [
                submit(n, owner="a", gpus=8, min_runtime_ms=2_000, duration_ms=duration_ms)
                for n in names
            ]
        )

    try:
        for c, side in sides.items():
            await fed.join(side.js, c, [p for p in CLUSTERS if p != c])
        tasks = [asyncio.create_task(run_scheduler(s, stop)) for s in schedulers.values()]
        executor = Executor(JetStreamLog(exe.jetstream(timeout=5.0), "east"))
        tasks.append(asyncio.create_task(executor.run(stop)))
        for path in ("", "a", "b"):  # one tree, made once on the hub
            await _publish_tree(admin, path, 1, owner="ops", actor="ops")
        for c in CLUSTERS:
            await eventually(
                lambda c=c: {"a", "b"} <= set(state(c).budget.nodes),
                timeout=WAIT_S,
                what=f"the tree in {c}",
            )
            hosts: list[Any] = [
                NodeRegistered(
                    id=f"node-{c}{i}", at_ms=0, node=f"{c}{i}", gpus=8, gpu_type="h100", actor="ops"
                )
                for i in range(2)
            ]
            policy = PolicySet(
                id=f"policy-{c}",
                at_ms=0,
                actor="ops",
                cluster=c,
                peers=CLUSTERS,
                usage_summary_ms=MIN_SUMMARY_MS,
            )
            await oplog[c].publish_inputs([*hosts, policy])

        # 1. a runs on east; west counts it there: a ranks below b, which used nothing
        await run_on_east("a1", "a2", duration_ms=6_000)
        await eventually(a_below_b, timeout=WAIT_S, what="west counting a's usage on east")
        west = state("west")
        assert FairShareView(west).charged["a"] == west.budget.nodes["a"].peer_charged(
            west.now_ms, west.policy.lookback_ms
        )

        # 2. east cut off for three whole intervals and more; both go on deciding
        t.relink("east", linked=False)
        await t.wait_leafs(1)
        cut = {c: reported(c) for c in CLUSTERS}
        rejoin_ms = interval_end(wall_ms(), MIN_SUMMARY_MS) + 3 * MIN_SUMMARY_MS
        await run_on_east("a3", "a4", "a5", duration_ms=5_000)
        await eventually(
            lambda: (
                ended("a1", "a2", "a3", "a4", "a5")
                and all(reported(c) >= rejoin_ms for c in CLUSTERS)
            ),
            timeout=WAIT_S,
            what="a1-a5 run on east, three intervals after the cut reported on each side",
        )
        # each side ranks on the other's usage as last heard: nothing crossed the cut
        assert heard("west", "east") <= cut["east"] < reported("east")
        assert heard("east", "west") <= cut["west"] < reported("west")
        assert a_below_b()

        # 3. rejoined: what each side reported meanwhile reaches the other, once
        t.relink("east", linked=True)
        await t.wait_leafs(2)
        reports: dict[str, list[dict[str, Any]]] = {}
        for c, peer in (("east", "west"), ("west", "east")):
            reports[c] = [d for d in await _decisions(sides[c]) if d["kind"] == fed.REPORT_KIND]
            until = reports[c][-1]["end_ms"]
            await eventually(
                lambda c=c, peer=peer, until=until: heard(peer, c) >= until,
                timeout=WAIT_S,
                what=f"{peer} hearing {c} up to {until}",
            )
        for c, peer in (("east", "west"), ("west", "east")):
            mine, s = reports[c], state(peer)
            until = mine[-1]["end_ms"]
            # every interval in turn, none skipped; the peer holds them as one span
            assert [r["start_ms"] for r in mine[1:]] == [r["end_ms"] for r in mine[:-1]], c
            assert [span[0] for span in s.peer_intervals[c]] == [mine[0]["start_ms"]], c
            # and counts exactly what was reported, for every node of the tree
            for path in ("", "a", "b"):
                series = s.budget.nodes[path].peer
                counted = series.cumulative(until) if isinstance(series, PeerSeries) else 0
                assert counted == _charged(mine, path), (c, peer, path)
            # each summary stored once in the peer's INPUTS, in order, none refused
            got = await _inputs(sides[peer])
            starts = _summaries(got, peer, c)
            assert starts[: len(mine)] == [r["start_ms"] for r in mine], (c, peer)
            assert len(set(starts)) == len(starts), (c, peer)
            ids = {b["id"] for subj, b in got if subj == fed.summary_subject(peer, c)}
            refused = [d for d in await _decisions(sides[peer]) if d["kind"] == "InputRejected"]
            assert not [d for d in refused if d["ref"] in ids], refused
        # west counted what east charged itself over the reported span, some of it
        # while the link was down
        mine, own = reports["east"], state("east").budget.nodes["a"].series
        assert _charged(mine, "a") == own.cumulative(mine[-1]["end_ms"]) - own.cumulative(
            mine[0]["start_ms"]
        )
        assert _charged([r for r in mine if r["start_ms"] >= cut["east"]], "a") > 0
        assert _charged(mine, "b") == _charged(reports["west"], "") == 0

        # 4. each cluster's history audits: every decision batch reproduced
        stop.set()
        async with asyncio.timeout(WAIT_S):
            await asyncio.gather(*tasks)
        audits = await asyncio.gather(
            *(asyncio.to_thread(audit_live, t.url_as(c, "auditor"), c) for c in CLUSTERS)
        )
        for c, out in zip(CLUSTERS, audits, strict=True):
            assert out.returncode == 0 and "all reproduced" in out.stdout, (
                c,
                out.stdout,
                out.stderr,
            )
    finally:
        stop.set()
        async with asyncio.timeout(WAIT_S):
            await asyncio.gather(*tasks, return_exceptions=True)
        for nc in (admin, exe, *ops.values(), *(s.nc for s in sides.values())):
            await nc.close()


async def test_a_running_forwarder_starts_when_its_cluster_joins(topology: Topology) -> None:
    """The forwarder runs beside the scheduler from the start (runner.run_scheduler);
    it idles until the cluster joins, forwards only while its scheduler leads, and
    nothing needs a restart."""
    t = topology
    sides = {c: await _side(t, c) for c in CLUSTERS}
    stop = asyncio.Event()
    leading = asyncio.Event()
    east = sides["east"]
    forwarder = fed.UsageForwarder(east.nc, "east", leading=leading, poll_s=0.05)
    running = asyncio.create_task(forwarder.run(stop))
    try:
        await east.batch(0)
        leading.set()
        await fed.join(sides["west"].js, "west", ["east"], tree=False)
        await fed.join(east.js, "east", ["west"], tree=False)
        got = await _until(sides["west"], lambda g: _summaries(g, "west", "east") == [0])
        assert _summaries(got, "west", "east") == [0]
        leading.clear()  # another scheduler leads now: this one forwards nothing
        await east.batch(60_000)
        await asyncio.sleep(0.3)
        assert forwarder.forwarded == 1
        leading.set()
        got = await _until(sides["west"], lambda g: len(_summaries(g, "west", "east")) == 2)
        assert _summaries(got, "west", "east") == [0, 60_000]
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)
        for side in sides.values():
            await side.nc.close()


def test_the_cli_joins_a_cluster_and_edits_the_tree_once(tmp_path: Path) -> None:
    """``apportion federation join|status|leave`` as a cluster's scheduler,
    ``tree-setup|tree-set`` as the hub's tree admin; errors are one line."""
    import time

    from click.testing import CliRunner

    from apportion.cli import main

    t = Topology(tmp_path, CLUSTERS)
    t.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while t.leafs() != len(CLUSTERS):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        run = CliRunner().invoke
        hub = ["--hub", t.hub.url_as(fed.TREE_ADMIN)]
        assert run(main, ["federation", "tree-setup", *hub]).exit_code == 0
        for c in CLUSTERS:
            nats = ["--nats", t.servers[c].url_as("scheduler"), "--cluster", c]
            asyncio.run(_setup_streams(t, c))
            peer = next(p for p in CLUSTERS if p != c)
            r = run(main, ["federation", "join", *nats, "--peer", peer])
            assert r.exit_code == 0, r.output
            assert r.output.strip() == f"cluster {c}: INPUTS_{c} sources USAGE_{peer}, TREE"
        r = run(
            main,
            ["federation", "tree-set", "llm", "--weight", "2", "--owner", "alice"]
            + ["--actor", "admin", "--id", "edit-1", *hub],
        )
        assert r.exit_code == 0 and "TREE sequence 1" in r.output, r.output
        r = run(
            main,
            ["federation", "tree-set", "llm", "--weight", "2", "--owner", "alice"]
            + ["--actor", "admin", "--id", "edit-1", *hub],
        )
        assert "(already stored)" in r.output  # a retry is stored once
        east = ["--nats", t.servers["east"].url_as("scheduler"), "--cluster", "east"]
        r = run(main, ["federation", "status", *east])
        assert r.exit_code == 0 and r.output.splitlines()[0].startswith("USAGE_west"), r.output
        r = run(main, ["federation", "leave", *east, "--all-peers"])
        assert r.output.strip() == "cluster east: INPUTS_east sources TREE"
        # as a user without the JetStream API: one line, no traceback
        r = run(
            main,
            ["federation", "status", "--nats", t.servers["east"].url_as("gateway")]
            + ["--cluster", "east"],
            env={"APPORTION_TIMEOUT": "1"},
        )
        assert r.exit_code == 2 and "Traceback" not in r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
    finally:
        t.stop()


async def _setup_streams(t: Topology, c: str) -> None:
    nc = await connect(t.servers[c].url_as("scheduler"), name=f"setup-{c}")
    try:
        await JetStreamLog(nc.jetstream(), c).setup()
    finally:
        await nc.close()


def test_nats_config_writes_valid_files_for_the_hub_and_a_member(tmp_path: Path) -> None:
    """``apportion nats-config --hub a,b`` and ``--hub-url URL``: files nats-server
    takes (``-t``); a cluster may not be named like the hub's domain."""
    import subprocess
    import sys

    def config(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "apportion", "nats-config", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    hub = config("--hub", "east,west", "--store-dir", str(tmp_path / "hub"))
    member = config(
        "--hub-url", "nats://leaf-demo:pw@127.0.0.1:7422", "--store-dir", str(tmp_path / "m")
    )
    for out in (hub, member):
        assert out.returncode == 0, out.stderr
    assert 'user: "leaf-east"' in hub.stdout and 'domain: "hub"' in hub.stdout
    assert 'domain: "demo"' in member.stdout and 'account: "APPORTION"' in member.stdout
    bad = config("--hub", "east,hub")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    binary = nats_server_binary()
    if binary is not None:
        for name, out in (("hub", hub), ("member", member)):
            conf = tmp_path / f"{name}.conf"
            conf.write_text(out.stdout)
            check = subprocess.run([binary, "-t", "-c", str(conf)], capture_output=True, text=True)
            assert check.returncode == 0, check.stderr + check.stdout


async def test_a_gateway_with_the_hub_edits_the_budget_once_for_every_cluster(
    topology: Topology,
) -> None:
    """``serve gateway --hub``: ``POST /v1/budget`` on one cluster's gateway is
    checked against its tree and published once, on the hub; every joined
    cluster's INPUTS takes it, and the gateway's own view folds it."""
    import aiohttp
    from services_helpers import Roles, eventually, gateway_on

    t = topology
    admin = await _tree_admin(t)
    sides = {c: await _side(t, c) for c in CLUSTERS}
    for c, side in sides.items():
        await fed.join(side.js, c, [p for p in CLUSTERS if p != c])
    east = t.servers["east"]
    op = await connect(east.url_as("operator"), name="op")
    gw = await connect(east.url_as("gateway"), name="gw")
    hub_gw = await connect(t.hub.url_as(fed.TREE_GATEWAY), name="hub-gw")
    roles = Roles(*(JetStreamLog(nc.jetstream(), "east") for nc in (sides["east"].nc, op, gw)))
    try:
        async with gateway_on(roles, None, tree=hub_gw.jetstream(timeout=5.0)) as gateway:
            async with aiohttp.ClientSession() as http:
                edit = {
                    "set": [{"path": "llm/c", "weight": 2, "owner": "carol"}],
                    "actor": "alice",
                }
                async with http.post(f"{gateway.url}/v1/budget", json=edit) as r:
                    assert r.status == 202, await r.text()
                    assert (await r.json())["on"] == "tree"
                refused = {
                    "set": [{"path": "vision/x", "weight": 1, "owner": "x"}],
                    "actor": "alice",
                }
                async with http.post(f"{gateway.url}/v1/budget", json=refused) as r:
                    assert r.status == 403, await r.text()  # checked before it reaches the tree
            await eventually(lambda: "llm/c" in gateway.state.budget.nodes, what="folded")

        def edits(got: list[tuple[str, dict[str, Any]]], c: str) -> list[tuple[str, str]]:
            subject = f"apportion.{c}.inputs.BudgetSet.tree"
            return [(b["path"], b["actor"]) for s, b in got if s == subject and b["path"] != ""]

        for c, side in sides.items():
            got = await _until(side, lambda g, c=c: ("llm/c", "alice") in edits(g, c))
            assert edits(got, c).count(("llm/c", "alice")) == 1, c
            assert ("vision/x", "alice") not in edits(got, c)
    finally:
        for nc in (op, gw, hub_gw, admin, *(s.nc for s in sides.values())):
            await nc.close()


@pytest.mark.slow
async def test_a_cluster_of_three_servers_goes_on_sourcing_when_its_leader_dies(
    tmp_path: Path,
) -> None:
    """``east`` is three servers (one domain, a leaf link each, INPUTS and
    USAGE with three replicas); killing the server that leads ``INPUTS_east``
    leaves the sources running on the new leader: what ``west`` and the tree
    publish meanwhile arrives once, and so does what ``east`` forwards after."""
    t = Topology(tmp_path, CLUSTERS, sizes={"east": 3})
    t.start()
    sides: dict[str, Side] = {}
    admin = None
    try:
        await t.wait_leafs(4)
        admin = await _tree_admin(t)
        sides = {c: await _side(t, c) for c in CLUSTERS}
        for c, side in sides.items():
            peer = next(p for p in CLUSTERS if p != c)
            await fed.join(side.js, c, [peer], replicas=t.sizes[c], timeout_s=WAIT_S)
        for k in range(3):
            for side in sides.values():
                await side.batch(k * 60_000)
                await side.forwarder.forward_once()
        tree = [await _publish_tree(admin, "llm", 1)]
        await _check_arrived(sides, tree)

        leader = (await sides["east"].js.stream_info("INPUTS_east")).cluster.leader
        t.members["east"][int(leader.rsplit("-", 1)[1])].stop()
        for k in range(3, 6):
            await sides["west"].batch(k * 60_000)
            await sides["west"].forwarder.forward_once()
        tree.append(await _publish_tree(admin, "llm", 2))
        east = sides["east"]  # its requests time out after 5 s, and are asked again
        await east.batch_retrying(3 * 60_000)
        async with asyncio.timeout(WAIT_S):
            while await _forwarded(east) == 0:
                await asyncio.sleep(0.2)
        await _check_arrived(sides, tree)
    finally:
        for nc in [*(s.nc for s in sides.values()), *([admin] if admin else [])]:
            await nc.close()
        t.stop()
