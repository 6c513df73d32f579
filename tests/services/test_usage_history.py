"""Allocation usage over time (services/usage_history.py): the hourly accumulator the
gateway keeps for owed vs delivered, against a small history computed by hand, against
the KPIs' own SQL (replay/kpi.py) on the same history, and through the JSON API."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import msgspec
import pytest
from apportion.core.history import decide_batch, fold_history, fold_item
from apportion.core.state import State
from apportion.schemas.events import (
    ClockTicked,
    NodeHealthChanged,
    WorkloadCancelled,
    WorkloadFinished,
)
from apportion.schemas.history import BatchItem, HistoryItem, input_item
from apportion.services.usage_history import (
    UsageHistory,
    hours_in,
    owed_delivered,
    usage_over_time,
)
from services_helpers import Roles, small_cluster, submit

if TYPE_CHECKING:
    from conftest import Credentials

H = 3_600_000
M = 60_000
T0 = 1_800_000_000_000  # on an hour boundary (UTC)
GPU_H = H  # one GPU-hour in GPU-ms


class Run:
    """Inputs folded one at a time, each followed by the cycle the scheduler would run;
    every item kept, as the gateway's follower hands them on."""

    def __init__(self) -> None:
        self.state = State()
        self.items: list[HistoryItem] = []
        self.batches = 0

    def feed(self, event: Any, at: int) -> None:
        item = input_item(self.state.input_seq + 1, msgspec.structs.replace(event, at_ms=at))
        fold_item(self.state, item)
        self.items.append(item)
        batch, _ = decide_batch(self.state)
        self.batches += 1
        b = BatchItem(seq=self.batches, batch=batch)
        fold_item(self.state, b)
        self.items.append(b)


def agent(state: State, wid: str) -> str:
    return f"agent:{state.running[wid].placement[0].node}"


def two_teams() -> Run:
    """llm (weight 3: llm/a, llm/b) and vision (weight 1, a leaf under the root) on two
    8-GPU nodes. Hour 0: A (llm/a, 8 GPUs) runs from :30, V (vision, 4) from :30 until
    its node goes down at :45 (requeued; no room). Hour 1: A ends at 1:30 (a run
    across the hour boundary), V runs from 1:30. Hour 2: the node is back at 2:00, V is
    cancelled at 2:15. Refused inputs (a bad submission, a cancel by someone without
    the authority) change nothing."""
    r = Run()
    for e in small_cluster():
        r.feed(e, T0)
    r.feed(submit("A", owner="llm/a", gpus=8, min_runtime_ms=H), T0 + 30 * M)
    r.feed(submit("V", owner="vision", gpus=4, min_runtime_ms=H), T0 + 30 * M)
    assert set(r.state.running) == {"A", "V"}
    a_node = r.state.running["A"].placement[0].node
    v_node = r.state.running["V"].placement[0].node
    assert a_node != v_node
    r.feed(submit("X", owner="nope", gpus=4), T0 + 40 * M)  # refused: no such owner
    r.feed(
        NodeHealthChanged(id="down", at_ms=0, node=v_node, state="down", actor="ops"), T0 + 45 * M
    )
    assert r.state.workloads["V"].status == "pending"  # requeued, no room on A's node
    r.feed(WorkloadCancelled(id="c-A", at_ms=0, workload="A", actor="mallory"), T0 + 50 * M)
    assert "A" in r.state.running  # mallory may not cancel it
    r.feed(ClockTicked(id="tick-1", at_ms=0), T0 + 70 * M)
    r.feed(
        WorkloadFinished(id="fin-A", at_ms=0, workload="A", attempt=1, actor=agent(r.state, "A")),
        T0 + 90 * M,
    )
    assert r.state.running["V"].placement[0].node == a_node
    r.feed(
        NodeHealthChanged(id="up", at_ms=0, node=v_node, state="healthy", actor="ops"), T0 + 2 * H
    )
    r.feed(WorkloadCancelled(id="c-V", at_ms=0, workload="V", actor="ops"), T0 + 2 * H + 15 * M)
    assert not r.state.workloads
    return r


# by hand, in GPU-hours: healthy capacity per hour, then per node
# (share = global share x healthy, demand, owed, used, delivered)
HEALTHY = [16 * 0.75 + 8 * 0.25, 8.0, 16.0]  # the node is down 0:45 to 2:00
EXPECTED = {
    # llm (share 3/4): A's 8 GPUs from 0:30 to 1:30, half in each hour
    "llm": [(10.5, 4, 4, 4, 4), (6, 4, 4, 4, 4), (12, 0, 0, 0, 0)],
    "llm/a": [(5.25, 4, 4, 4, 4), (3, 4, 3, 4, 3), (6, 0, 0, 0, 0)],
    "llm/b": [(5.25, 0, 0, 0, 0), (3, 0, 0, 0, 0), (6, 0, 0, 0, 0)],
    # vision (share 1/4): hour 0 demands 2 (below its share 3.5: owed is capped at 2)
    # and runs 1 (0:30 to 0:45); hour 1 demands 4 (over its share 2), runs 2 (from 1:30)
    "vision": [(3.5, 2, 2, 1, 1), (2, 4, 2, 2, 2), (4, 1, 1, 1, 1)],
}


def rows(node: dict[str, Any]) -> list[tuple[float, ...]]:
    keys = ("share_gpu_ms", "demand_gpu_ms", "owed_gpu_ms", "used_gpu_ms", "delivered_gpu_ms")
    return [tuple(h[k] / GPU_H for k in keys) for h in node["hours"]]


def test_owed_and_delivered_by_hand() -> None:
    r = two_teams()
    usage = UsageHistory()
    usage.record(r.items)
    out = usage_over_time(usage, r.state.budget, T0 + 3 * H, hours=3)
    assert out["start_ms"] == T0 and out["hours"] == 3
    assert [ms / GPU_H for ms in out["healthy_gpu_ms"]] == HEALTHY
    teams = {t["path"]: t for t in out["teams"]}
    assert list(teams) == ["llm", "vision"]
    assert rows(teams["llm"]) == EXPECTED["llm"]
    users = {u["path"]: u for u in teams["llm"]["users"]}
    assert rows(users["llm/a"]) == EXPECTED["llm/a"]
    assert rows(users["llm/b"]) == EXPECTED["llm/b"]
    assert rows(teams["vision"]) == EXPECTED["vision"]
    assert teams["vision"]["users"] == []  # a leaf under the root is its own team
    # totals over the window
    assert teams["llm"]["owed_gpu_h"] == 8 and teams["llm"]["delivered_gpu_h"] == 8
    assert teams["llm"]["delivery_ratio"] == 1.0
    v = teams["vision"]
    assert (v["owed_gpu_h"], v["delivered_gpu_h"], v["used_gpu_h"]) == (5, 4, 4)
    assert v["delivery_ratio"] == 0.8
    assert users["llm/a"]["delivery_ratio"] == 7 / 7  # owed 4 + 3, delivered 4 + 3
    assert users["llm/b"]["delivery_ratio"] is None  # never owed anything
    # exact integers inside; only a share that is a fraction of a GPU-ms is a float
    assert all(isinstance(h["demand_gpu_ms"], int) for h in teams["llm"]["hours"])
    # one team only
    only = usage_over_time(usage, r.state.budget, T0 + 3 * H, team="vision", hours=3)
    assert [t["path"] for t in only["teams"]] == ["vision"]
    with pytest.raises(KeyError):
        usage_over_time(usage, r.state.budget, T0 + 3 * H, team="llm/a")


def test_open_rates_count_up_to_now_and_reading_changes_nothing() -> None:
    r = Run()
    for e in small_cluster():
        r.feed(e, T0)
    r.feed(submit("A", owner="llm/a", gpus=8, min_runtime_ms=H), T0 + 30 * M)
    usage = UsageHistory()
    usage.record(r.items)
    for _ in range(2):  # the same answer twice: reading credits nothing
        hourly = usage.hourly(T0 + 90 * M, hours=2)
        assert hourly.healthy == [16 * H, 16 * 30 * M]
        assert hourly.demand["llm/a"] == [8 * 30 * M, 8 * 30 * M]
        assert hourly.used["llm/a"] == [8 * 30 * M, 8 * 30 * M]
    assert not usage.hours  # nothing credited yet: every rate is still open


def test_fed_in_any_slices_the_same() -> None:
    """The gateway's follower hands on items in chunks (a cycle's inputs may come
    before its batch in the next poll): the result does not depend on the cut."""
    r = two_teams()
    whole = UsageHistory()
    whole.record(r.items)
    for size in (1, 2, 3, 7):
        sliced = UsageHistory()
        for i in range(0, len(r.items), size):
            sliced.record(r.items[i : i + size])
        a = whole.hourly(T0 + 3 * H, 3)
        b = sliced.hourly(T0 + 3 * H, 3)
        assert (a.healthy, a.demand, a.used) == (b.healthy, b.demand, b.used)


def test_a_repeated_id_refuses_the_later_input() -> None:
    r = Run()
    for e in small_cluster():
        r.feed(e, T0)
    r.feed(submit("A", owner="llm/a", gpus=4, min_runtime_ms=H), T0)
    r.feed(submit("A", owner="llm/b", gpus=8, min_runtime_ms=H), T0 + M)  # refused: id in use
    usage = UsageHistory()
    usage.record(r.items)
    hourly = usage.hourly(T0 + H, 1)
    assert hourly.demand == {"llm/a": [4 * H]} and "llm/b" not in hourly.used


def test_only_the_window_is_kept() -> None:
    r = Run()
    for e in small_cluster():
        r.feed(e, T0)
    r.feed(submit("w0", owner="llm/a", gpus=8, min_runtime_ms=H), T0)
    usage = UsageHistory()
    usage.record(r.items)
    days = 20
    for d in range(1, days + 1):
        r.items.clear()
        # each day a run ends and the next starts, so the rates are credited each day
        r.feed(
            WorkloadFinished(
                id=f"f{d}", at_ms=0, workload=f"w{d - 1}", actor=agent(r.state, f"w{d - 1}")
            ),
            T0 + d * 24 * H + 10 * M,
        )
        r.feed(submit(f"w{d}", owner="llm/a", gpus=8, min_runtime_ms=H), T0 + d * 24 * H + 10 * M)
        usage.record(r.items)
    kept = hours_in(usage.window_ms) + 1
    assert len(usage.hours) <= kept
    assert min(usage.hours) >= usage.clock // H - kept
    week = usage.hourly(usage.clock)
    assert week.n == 7 * 24
    assert sum(week.used["llm/a"]) == 8 * (7 * 24 - 1) * H + 8 * 10 * M  # busy all along


def test_owed_delivered_is_the_kpis_rule() -> None:
    from apportion.replay.kpi import TeamHour

    for share, demand, ran in ((10.5, 4, 4), (2, 4, 2), (3.5, 2, 1), (6, 0, 3)):
        owed, delivered = owed_delivered(Fraction(share), demand, ran)
        th = TeamHour("t", 0, share, demand, ran)
        assert owed == th.owed_ms and delivered == min(th.ran_ms, th.owed_ms)


def test_the_same_numbers_as_the_kpi_sql() -> None:
    """The projection's tables and replay/kpi.py's delivery query give the same hourly
    share, demand and run GPU-time per team for the same history."""
    duckdb = pytest.importorskip("duckdb")
    from apportion.replay.kpi import _VIEWS, KPI_SQL, _q
    from apportion.replay.projection import Projection

    r = two_teams()
    con = duckdb.connect()
    projection = Projection(con)
    state = fold_history(r.items, observer=projection)
    projection.commit(state)
    start, end = T0, T0 + 3 * H
    con.execute(_VIEWS.replace("$start", str(start)).replace("$end", str(end)))
    sql = {
        (team, h): (share, demand, ran)
        for team, h, share, demand, ran in _q(con, KPI_SQL["delivery"], start, end)
    }
    usage = UsageHistory()
    usage.record(r.items)
    out = usage_over_time(usage, state.budget, end, hours=3)
    for t in out["teams"]:
        for h, row in enumerate(t["hours"]):
            share, demand, ran = sql[(t["path"], h)]
            assert row["share_gpu_ms"] == pytest.approx(share)
            assert row["demand_gpu_ms"] == demand
            assert row["used_gpu_ms"] == ran


def test_follows_the_fold_through_a_simulation() -> None:
    """A simulated day and a half (preemptions, a node down and back, a drain): after
    every cycle the accumulator's rates are the state's, and its hours are the KPI
    SQL's over the projection of the same run."""
    pytest.importorskip("duckdb")
    from apportion.core.history import Observer
    from apportion.replay.kpi import _VIEWS, KPI_SQL, _q
    from apportion.replay.run import load_inputs
    from apportion.replay.simulator import simulate
    from apportion.replay.trace import HealthRow

    inp = load_inputs(None, None, None, seed=1, days=2, scenario="debug")
    nodes = sorted(e.node for e in inp.cluster_events if hasattr(e, "gpus"))
    health = [
        HealthRow(at_ms=3 * H + 7 * M, node=nodes[0], state="down"),
        HealthRow(at_ms=5 * H + 30 * M, node=nodes[0], state="healthy"),
        HealthRow(at_ms=9 * H + 1 * M, node=nodes[1], state="draining"),
        HealthRow(at_ms=20 * H, node=nodes[1], state="healthy"),
        HealthRow(at_ms=26 * H + 59 * M, node=nodes[2], state="down"),
    ]
    usage = UsageHistory()
    held: list[HistoryItem] = []
    checked = [0]

    def check(item: HistoryItem, state: State, rejected: str | None) -> None:
        held.append(item)
        if not isinstance(item, BatchItem) or item.batch.continued:
            return
        usage.record(held)
        held.clear()
        checked[0] += 1
        assert usage.clock == state.now_ms
        healthy = sum(n.gpus for n in state.nodes.values() if n.health == "healthy")
        assert usage.healthy[0] == healthy
        demand: dict[str, int] = {}
        used: dict[str, int] = {}
        for w in state.workloads.values():
            if w.allocated:
                demand[w.owner] = demand.get(w.owner, 0) + w.gpus
                if w.status == "running":
                    used[w.owner] = used.get(w.owner, 0) + w.gpus
        assert {k: r for k, (r, _) in usage.demand.items() if r} == demand
        assert {k: r for k, (r, _) in usage.used.items() if r} == used

    sink: Observer = check
    end = 36 * H
    result = simulate(inp.cluster_events, inp.trace, health, end_ms=end, sink=sink)
    assert checked[0] > 100
    con = result.con
    assert con is not None
    assert con.execute("SELECT COUNT(*) FROM runs WHERE end_reason = 'preempted'").fetchone()[0]
    con.execute(_VIEWS.replace("$start", "0").replace("$end", str(end)))
    sql = {
        (team, h): (share, demand, ran)
        for team, h, share, demand, ran in _q(con, KPI_SQL["delivery"], 0, end)
    }
    out = usage_over_time(usage, result.state.budget, end, hours=36)
    assert out["start_ms"] == 0 and {t["path"] for t in out["teams"]} == {"train", "dev"}
    for t in out["teams"]:
        for h, row in enumerate(t["hours"]):
            share, demand, ran = sql[(t["path"], h)]
            assert row["share_gpu_ms"] == pytest.approx(share), (t["path"], h)
            assert row["demand_gpu_ms"] == demand, (t["path"], h)
            assert row["used_gpu_ms"] == ran, (t["path"], h)


# -- through the gateway -------------------------------------------------------------


@pytest.mark.nats
async def test_the_api_and_the_usage_page(roles: Roles, creds: Credentials) -> None:
    import aiohttp
    from services_helpers import eventually, gateway_on

    async with (
        gateway_on(roles, creds.authenticator) as gw,
        aiohttp.ClientSession() as http,
    ):
        await roles.op.publish_inputs(
            [
                submit("A", owner="llm/a", gpus=8, min_runtime_ms=H),
                submit("B", owner="llm/b", gpus=4, min_runtime_ms=0),  # free: not counted
            ]
        )
        await eventually(lambda: {"A", "B"} <= set(gw.state.running), what="placed")
        url = f"{gw.url}/v1/usage/history"
        async with http.get(url) as r:  # the API's bearer token, as everywhere under /v1
            assert r.status == 401
        async with http.get(url, params={"team": "llm"}, headers=creds.headers("alice")) as r:
            assert r.status == 200
            body = await r.json()
        assert body["hours"] == 7 * 24 and body["hour_ms"] == H
        assert [t["path"] for t in body["teams"]] == ["llm"]
        (llm,) = body["teams"]
        assert [u["path"] for u in llm["users"]] == ["llm/a", "llm/b"]
        now = llm["hours"][-1]
        assert now["start_ms"] <= body["now_ms"] < now["start_ms"] + H
        assert body["healthy_gpu_ms"][-1] > 0
        assert now["used_gpu_ms"] > 0 and now["demand_gpu_ms"] >= now["used_gpu_ms"]
        assert now["owed_gpu_ms"] == min(now["share_gpu_ms"], now["demand_gpu_ms"])
        assert now["delivered_gpu_ms"] == min(now["used_gpu_ms"], now["owed_gpu_ms"])
        b = llm["users"][1]["hours"][-1]
        assert b["used_gpu_ms"] == 0 and b["demand_gpu_ms"] == 0  # unallocated work
        assert llm["global_share"] == 0.75
        async with http.get(url, params={"hours": "2"}, headers=creds.headers("ops")) as r:
            body = await r.json()
            assert r.status == 200 and body["hours"] == 2
            assert [t["path"] for t in body["teams"]] == ["llm", "vision"]
        async with http.get(url, params={"team": "nope"}, headers=creds.headers("ops")) as r:
            assert r.status == 404 and "nope" in (await r.json())["error"]
        async with http.get(url, params={"hours": "0"}, headers=creds.headers("ops")) as r:
            assert r.status == 400
        async with http.get(f"{gw.url}/openapi.json") as r:
            assert "/v1/usage/history" in (await r.json())["paths"]
    # the page: one chart per team on the usage page
    async with (
        gateway_on(roles, None) as gw,
        aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s,
    ):
        async with s.post(f"{gw.url}/ui/login", data={"token": "ops"}) as r:
            assert r.status == 200
        async with s.get(f"{gw.url}/ui/usage?hours=24") as r:
            text = await r.text()
        assert 'id="usage-history-llm"' in text and 'id="usage-history-vision"' in text
        # a new cluster: the charts span the hour of data, not the day asked for
        # (two hours if the test runs across the top of an hour)
        assert re.search(r"last [12] h", text) and "not the 1 d window" in text
