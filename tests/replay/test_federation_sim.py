"""Several clusters simulated in lockstep (replay/federation.py): usage reported on
one cluster ranks a team on the others, nothing counted twice or lost, a
partition delays summaries without changing what they count, and every
cluster's history replays to the same state."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from apportion.core.fold import fold
from apportion.core.history import decide_batch, fold_item
from apportion.core.rules.federation import heard_until
from apportion.core.state import State
from apportion.core.usage import PeerSeries
from apportion.replay.cluster_file import (
    Partition,
    federation_from_dict,
    load_cluster,
    load_federation,
)
from apportion.replay.errors import InputFileError
from apportion.replay.federation import (
    arrival_ms,
    run_federation,
    simulate_federation,
    tree_kpis,
)
from apportion.replay.trace import TraceRow
from apportion.schemas.events import DAY_MS, HOUR_MS, BudgetSet, UsageSummary
from apportion.schemas.history import BatchItem
from hypothesis import given, settings
from hypothesis import strategies as st


def doc(**federation: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "clusters": [
            {
                "name": "east",
                "pool": [{"prefix": "e", "count": 4, "gpus_per_node": 8, "gpu_type": "h100"}],
            },
            {
                "name": "west",
                "pool": [{"prefix": "w", "count": 2, "gpus_per_node": 8, "gpu_type": "b200"}],
            },
        ],
        "policy": {"lookback": "7d"},
        "budget": {
            "owner": "ops",
            "a": {"weight": 1, "owner": "an"},
            "b": {"weight": 1, "owner": "bo"},
        },
    }
    d["budget"]["a"]["x"] = {"weight": 1, "owner": "ax"}
    d["budget"]["b"]["y"] = {"weight": 1, "owner": "by"}
    if federation:
        d["federation"] = federation
    return d


def row(
    id: str, owner: str, submit_h: float, gpus: int, hours: float, cluster: str = ""
) -> TraceRow:
    return TraceRow(
        id=id,
        submit_ms=int(submit_h * HOUR_MS),
        owner=owner,
        gpus=gpus,
        duration_ms=int(hours * HOUR_MS),
        min_runtime_ms=HOUR_MS,
        cluster=cluster,
    )


def trace() -> list[TraceRow]:
    """Team a runs a day on east; then a and b each want all of west at once."""
    rows = [row(f"a{i}", "a/x", 0, 8, 24, "east") for i in range(4)]
    rows += [row("a-west", "a/x", 25, 16, 2, "west"), row("b-west", "b/y", 25, 16, 2, "west")]
    return rows


def test_usage_on_one_cluster_ranks_the_team_on_another() -> None:
    assert _first_placed(peers=True) == "b-west"
    assert _first_placed(peers=False) == "a-west"  # without summaries: a tie, "a" first


def _first_placed(peers: bool) -> str:
    spec = federation_from_dict(doc())
    if not peers:  # the same clusters, each on its own
        for c in spec.clusters:
            c.events[-1] = msgspec.structs.replace(c.events[-1], peers=())  # type: ignore[arg-type]
    placed: list[str] = []

    def watch(item: Any, state: State, rejected: str | None) -> None:
        batch = getattr(item, "batch", None)
        for d in batch.decisions if batch is not None else ():
            if (
                getattr(d, "workload", "").endswith("-west")
                and type(d).__name__ == "WorkloadPlaced"
            ):
                placed.append(d.workload)

    run_federation(spec, trace(), days=2, observers={"west": watch})
    return placed[0]


def busy() -> list[TraceRow]:
    return [row(f"r{i}", "b/y" if i % 2 else "a/x", i / 3, 8, 3) for i in range(40)]


def assert_exact(result: Any, after_ms: int) -> None:
    """Each cluster counts, of the other's usage, exactly the other's own charges up
    to the end of the intervals it heard, which are contiguous from the start."""
    for me, peer in (("east", "west"), ("west", "east")):
        mine, theirs = result.results[me].state, result.results[peer].state
        heard = heard_until(mine, peer)
        assert heard is not None and heard > after_ms
        assert mine.peer_intervals[peer] == [(0, heard)]  # contiguous: nothing missed
        for path in ("", "a", "a/x", "b", "b/y"):
            got = mine.budget.nodes[path].peer
            counted = got.cumulative(heard) if isinstance(got, PeerSeries) else 0
            assert counted == theirs.budget.nodes[path].series.cumulative(heard), (me, path)


def test_nothing_is_counted_twice_or_lost() -> None:
    result = run_federation(federation_from_dict(doc()), trace() + busy(), days=2)
    assert_exact(result, DAY_MS)


def test_a_partition_delays_summaries_and_changes_no_count() -> None:
    spec = federation_from_dict(doc(partition=[{"cluster": "west", "from": "6h", "until": "10h"}]))
    assert spec.partitions == [
        Partition(cluster="west", from_ms=6 * HOUR_MS, until_ms=10 * HOUR_MS)
    ]
    arrived: list[int] = []

    def watch(item: Any, state: State, rejected: str | None) -> None:
        if isinstance(getattr(item, "event", None), UsageSummary):
            assert rejected is None
            arrived.append(item.event.at_ms)

    result = run_federation(spec, busy(), days=1, observers={"east": watch})
    assert not [t for t in arrived if 6 * HOUR_MS + 5_000 < t < 10 * HOUR_MS]
    assert arrived.count(10 * HOUR_MS) == 4 * 12  # held for four hours, then all at once
    assert_exact(result, 20 * HOUR_MS)
    assert arrival_ms(7 * HOUR_MS, 5_000, spec.partitions) == 10 * HOUR_MS
    assert arrival_ms(5 * HOUR_MS, 5_000, spec.partitions) == 5 * HOUR_MS + 5_000


def test_each_cluster_history_replays_and_the_kpis_cover_the_tree() -> None:
    spec = federation_from_dict(doc())
    rows = trace() + busy()
    logs: dict[str, list[Any]] = {"east": [], "west": []}
    sinks = {n: (lambda item, state, rejected, n=n: logs[n].append(item)) for n in logs}
    result, tree = simulate_federation(spec, rows, days=2, sinks=sinks)
    for name, items in logs.items():
        state = State()
        for item in items:
            fold_item(state, item)
        assert state.digest() == result.results[name].state.digest()
    whole = tree_kpis(result, tree, 0)
    per = whole["clusters"]
    assert whole["workloads"] == sum(k["workloads"] for k in per.values()) == len(rows)
    assert set(whole["team_delivery"]) == {"a", "b"}
    assert whole["rows_routed"]["east"] + whole["rows_routed"]["west"] == len(rows)
    assert isinstance(whole["double_served_teams"], list)


def test_a_file_of_several_clusters_names_every_peer() -> None:
    spec = federation_from_dict(doc())
    assert spec.names == ["east", "west"] and spec.delay_ms == 5_000
    for c in spec.clusters:
        policy = c.events[-1]
        assert policy.cluster == c.name and policy.peers == ("east", "west")  # type: ignore[union-attr]
        assert fold(c.events).policy.reports_usage


def test_a_row_naming_no_cluster_of_the_file_is_an_error() -> None:
    with pytest.raises(ValueError, match="names cluster 'north'"):
        run_federation(federation_from_dict(doc()), [row("x", "a/x", 0, 8, 1, "north")], days=1)


def test_simulate_leaves_out_a_row_naming_no_cluster_of_the_file(tmp_path) -> None:
    """From files, such a row is a problem of its line, like a malformed one: reported,
    left out, and the other rows run (exit 0)."""
    from click.testing import CliRunner

    from apportion.cli import main

    (tmp_path / "c.toml").write_text(
        "".join(
            f'[[clusters]]\nname = "{name}"\n[[clusters.pool]]\nprefix = "{name[0]}"\n'
            f'count = 2\ngpus_per_node = 8\ngpu_type = "h100"\n'
            for name in ("east", "west")
        )
        + '[budget]\nowner = "ops"\n[budget.a]\nweight = 1\nowner = "an"\n'
        + '[budget.a.x]\nweight = 1\nowner = "ax"\n'
    )
    (tmp_path / "t.csv").write_text(
        "id,submit,owner,gpus,duration,min_runtime,resumable,priority,gpu_type,cluster\n"
        "ok,0,a/x,8,3600,600,true,0,any,\n"
        "lost,10,a/x,8,3600,600,true,0,any,north\n"
    )
    r = CliRunner().invoke(
        main,
        ["simulate", "--cluster", str(tmp_path / "c.toml"), "--trace", str(tmp_path / "t.csv")]
        + ["-q", "--json"],
    )
    assert r.exit_code == 0, r.output
    assert "t.csv:3: row 'lost' names cluster 'north'; the cluster file has 'east', 'west'" in (
        r.stderr
    )
    assert msgspec.json.decode(r.stdout.splitlines()[-1])["workloads"] == 1


def test_explain_says_how_much_of_a_team_s_usage_was_on_other_clusters() -> None:
    from apportion.services.views import explain, replay_history

    items: list[Any] = []
    sinks = {"west": lambda item, state, rejected: items.append(item)}
    run_federation(
        federation_from_dict(doc()),
        trace(),
        days=26 / 24,
        observers=sinks,  # type: ignore[arg-type]
    )
    state, history = replay_history(items)
    out = explain(state, history, "a-west")
    assert out is not None and out["status"] == "pending", out
    text = " ".join(out["reasons"])
    assert "of it on other clusters" in text, text


FILE = """
[[clusters]]
name = "east"
[[clusters.pool]]
prefix = "n"
count = 2
gpus_per_node = 8
gpu_type = "h100"

[[clusters]]
name = "west"
[[clusters.pool]]
prefix = "n"
start = {start}
count = 1
gpus_per_node = 8
gpu_type = "b200"

[policy]
usage_summary = "1m"

[federation]
delay = "2s"

[budget]
owner = "ops"
[budget.a]
weight = 1
owner = "an"
"""


def test_a_cluster_file_of_several_clusters(tmp_path: Any) -> None:
    path = tmp_path / "fed.toml"
    path.write_text(FILE.format(start=2))
    spec = load_federation(path)
    assert spec.delay_ms == 2_000 and [len(c.nodes) for c in spec.clusters] == [2, 1]
    assert spec.clusters[1].events[-1].usage_summary_ms == 60_000  # type: ignore[union-attr]
    path.write_text(FILE.format(start=1))
    with pytest.raises(InputFileError, match="'n001' is in both 'east' and 'west'"):
        load_federation(path)
    with pytest.raises(
        InputFileError,
        match="read as a federation by simulate and outcomes.*give each its own file",
    ):
        load_cluster(path)
    bad = {**doc(partition=[{"cluster": "north", "from": "1h", "until": "2h"}])}
    with pytest.raises(InputFileError, match="no cluster 'north'"):
        federation_from_dict(bad)


def test_every_cluster_redecides_its_history_bit_for_bit_across_a_partition() -> None:
    """Each cluster's history alone is exact: refolded, every batch is the one its
    cycle makes again (summaries arrived late after the link healed included)."""
    spec = federation_from_dict(doc(partition=[{"cluster": "east", "from": "3h", "until": "9h"}]))
    logs: dict[str, list[Any]] = {"east": [], "west": []}
    sinks = {n: (lambda item, state, rejected, n=n: logs[n].append(item)) for n in logs}
    run_federation(spec, trace() + busy(), days=1.5, observers=sinks)  # type: ignore[arg-type]
    for items in logs.values():
        state = State()
        batches = 0
        for item in items:
            if isinstance(item, BatchItem):
                again, _ = decide_batch(state)
                assert again.decisions == item.batch.decisions
                batches += 1
            fold_item(state, item)
        assert batches > 100


@settings(max_examples=12, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a/x", "b/y"]),
            st.integers(0, 20),  # submit hour
            st.sampled_from([1, 4, 8, 16]),
            st.integers(1, 6),  # hours
            st.sampled_from(["", "east", "west"]),
        ),
        min_size=1,
        max_size=25,
    ),
    st.integers(0, 20),
)
def test_random_traces_count_each_cluster_exactly_once(
    jobs: list[tuple[str, int, int, int, str]], cut_h: int
) -> None:
    """Whatever runs where, and with a partition of either cluster, each cluster
    counts exactly the other's own charges, contiguous, none twice."""
    rows = [
        row(f"j{i}", owner, h, gpus, hours, cluster if gpus <= 16 else "")
        for i, (owner, h, gpus, hours, cluster) in enumerate(jobs)
    ]
    part = [{"cluster": "west", "from": f"{cut_h}h", "until": f"{cut_h + 3}h"}]
    result = run_federation(federation_from_dict(doc(partition=part)), rows, days=1.25)
    assert_exact(result, cut_h * HOUR_MS)


def test_a_budget_edit_reaches_every_cluster_history() -> None:
    edit = BudgetSet(id="edit", at_ms=HOUR_MS, path="a/z", weight=2, owner="az", actor="ops")
    result = run_federation(federation_from_dict(doc()), trace(), days=0.5, timed_inputs=[edit])
    for r in result.results.values():
        assert r.state.budget.nodes["a/z"].weight == 2
