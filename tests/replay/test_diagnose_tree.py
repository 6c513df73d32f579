"""``diagnose`` of a federated run: hand-built histories of two clusters sharing
one budget tree, each with its expected split computed by hand.

Each cluster's history is a :class:`~test_diagnose.Run` whose policy names the
cluster and its peer. The whole tree's figures: a team is owed its global share
of both clusters' healthy GPUs (capped by its allocated demand on both), ran is
what it runs on both, and the shortfall is split over its pending allocated
workloads on both, the clusters taking turns by name (``east`` first), one
of the team's workloads each, every part explained on its own cluster by the
single-cluster rules (docs/simulator.md, "Several clusters: the whole tree").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from apportion.replay.diagnose import diagnose, diagnose_federation
from apportion.replay.eventlog import Header, open_log, write_log
from apportion.schemas.events import HOUR_MS
from click.testing import CliRunner
from test_diagnose import T1, Run, split

from apportion.cli import main

TEAMS = {"a": 1, "b": 1, "c": 1}


def cluster(name: str, prefix: str, nodes: int = 3, teams: dict[str, int] = TEAMS) -> Run:
    """A cluster of ``nodes`` x 8 h100 GPUs named ``name`` (nodes ``<prefix>1``...),
    peer of ``east`` and ``west``."""
    return Run(teams, nodes=nodes, node_prefix=prefix, cluster=name, peers=("east", "west"))


def tree_rows(east: Run, west: Run) -> tuple[dict[str, dict], dict[str, dict[str, dict]]]:
    """The whole tree's rows by team, and each cluster's own rows by team."""
    d = diagnose_federation([("east.jsonl", east.items), ("west.jsonl", west.items)])
    own = {c: {r["team"]: r for r in dd.rows()} for c, dd in d.clusters.items()}
    return {r["team"]: r for r in d.tree.rows()}, own


def served_on_west() -> tuple[Run, Run]:
    """a and b (weight 1) on east 2 x 8 and west 2 x 8 GPUs: each owed 16 of the
    tree's 32. At 0, b runs b0 and b1 (8 GPUs each, 4 h contracts) on east, a runs
    a2 and a3 on west; a1 (a, 8 GPUs) waits on east."""
    teams = {"a": 1, "b": 1}
    east, west = cluster("east", "n", 2, teams), cluster("west", "m", 2, teams)
    east.submit("b0", "b", 8, 4 * HOUR_MS).submit("b1", "b", 8, 4 * HOUR_MS)
    east.submit("a1", "a", 8, HOUR_MS)
    east.batch().place("b0", "n1").place("b1", "n2")
    west.submit("a2", "a", 8, 4 * HOUR_MS).submit("a3", "a", 8, 4 * HOUR_MS)
    west.batch().place("a2", "m1").place("a3", "m2")
    for run in (east, west):
        run.at(HOUR_MS).batch()
    return east, west


def test_a_team_short_on_one_cluster_and_served_on_the_other_is_not_short_over_the_tree():
    """Over the tree a is owed min(16, its demand 24) = 16 and runs 16 (on west):
    no shortfall, though a1 waits on east. On its own, east owes a 8 (half of its
    16 GPUs, capped by a1's 8) and runs none of a's: short 8 GPU-h, ``contracts``
    (b's runs were placed with a1, at equal standing), held by b."""
    tree, own = tree_rows(*served_on_west())
    assert tree["a"]["owed_gpu_h"] == pytest.approx(16.0)
    assert tree["a"]["delivered_gpu_h"] == pytest.approx(16.0)
    assert tree["a"]["shortfall_gpu_h"] == 0
    assert split(tree["a"]) == {}
    assert tree["b"]["shortfall_gpu_h"] == 0
    assert own["east"]["a"]["shortfall_gpu_h"] == pytest.approx(8.0)
    assert split(own["east"]["a"]) == {"contracts": pytest.approx(8.0)}
    assert own["east"]["a"]["holders"] == {"b": pytest.approx(8.0)}
    assert own["west"]["a"]["shortfall_gpu_h"] == 0


def short_on_both(west_nodes: int = 3) -> tuple[Run, Run]:
    """a, b, c (weight 1) on east 3 x 8 and west ``west_nodes`` x 8.

    east (as ``test_admission_placed_...``): at 0, a0 (a) on n1 and c1 (c) on n3,
    4 h contracts; at 1 min b1 (b, 8 GPUs) is pending when a2 (a, 8, 4 h) is
    placed on n2 for a, then less under-served than b on east: ``admission``.
    west: at 0, a3 (a) on m1, c4 and c5 (c) on m2 and m3, 4 h contracts (and with
    a fourth node, b's own b6 on m4); at 1 min b7 (b, 8 GPUs) waits: every run
    was placed before it was pending: ``contracts`` (cheapest node m1, held by a).
    """
    east, west = cluster("east", "n"), cluster("west", "m", west_nodes)
    east.submit("a0", "a", 8, 4 * HOUR_MS).submit("c1", "c", 8, 4 * HOUR_MS)
    east.batch().place("a0", "n1").place("c1", "n3")
    west.submit("a3", "a", 8, 4 * HOUR_MS).submit("c4", "c", 8, 4 * HOUR_MS)
    west.submit("c5", "c", 8, 4 * HOUR_MS)
    if west_nodes == 4:
        west.submit("b6", "b", 8, 4 * HOUR_MS)
    west.batch().place("a3", "m1").place("c4", "m2").place("c5", "m3")
    if west_nodes == 4:
        west.place("b6", "m4")
    east.at(T1).submit("b1", "b", 8, HOUR_MS).submit("a2", "a", 8, 4 * HOUR_MS)
    east.batch().place("a2", "n2")
    west.at(T1).submit("b7", "b", 8, HOUR_MS).batch()
    for run in (east, west):
        run.at(T1 + HOUR_MS).batch()
    return east, west


def test_a_team_short_on_both_clusters_splits_over_both():
    """The tree has 48 GPUs, 16 owed to each team. From 1 min, b's demand is b1 and
    b7 (16) and it runs nothing: short 16 GPUs for an hour. east's turn first: b1
    explains 8 (``admission``, held by a: a2), then west's: b7 explains 8
    (``contracts``, held by a: a3 on m1). a (demand 24) and c (24) run 24: not
    short. Each cluster on its own owes b 8 of its 24 GPUs: east short 8
    ``admission``, west short 8 ``contracts``."""
    tree, own = tree_rows(*short_on_both())
    b = tree["b"]
    assert b["owed_gpu_h"] == pytest.approx(16.0)
    assert b["shortfall_gpu_h"] == pytest.approx(16.0)
    assert split(b) == {"admission": pytest.approx(8.0), "contracts": pytest.approx(8.0)}
    assert b["holders"] == {"a": pytest.approx(16.0)}
    assert b["clusters"] == {"east": pytest.approx(8.0), "west": pytest.approx(8.0)}
    assert tree["a"]["shortfall_gpu_h"] == 0 and tree["c"]["shortfall_gpu_h"] == 0
    assert split(own["east"]["b"]) == {"admission": pytest.approx(8.0)}
    assert split(own["west"]["b"]) == {"contracts": pytest.approx(8.0)}


def test_the_clusters_take_turns_by_name_until_the_shortfall_is_used_up():
    """As above with a fourth west node running b's b6 (8 GPUs): the tree has 56
    GPUs, b is owed 56 / 3 (its demand 24 is more) and runs 8: short 32 / 3 GPUs.
    east's b1 explains its 8 (``admission``), west's b7 the rest, 8 / 3
    (``contracts``): 32 / 3 GPU-h over the hour. (Before 1 min b's demand was b6:
    owed 8 for a minute, and ran.)"""
    tree, own = tree_rows(*short_on_both(west_nodes=4))
    b = tree["b"]
    assert b["owed_gpu_h"] == pytest.approx(8 / 60 + 56 / 3, abs=0.05)
    assert b["shortfall_gpu_h"] == pytest.approx(32 / 3, abs=0.05)
    assert split(b) == {
        "admission": pytest.approx(8.0, abs=0.05),
        "contracts": pytest.approx(8 / 3, abs=0.05),
    }
    assert b["clusters"] == {
        "east": pytest.approx(8.0, abs=0.05),
        "west": pytest.approx(8 / 3, abs=0.05),
    }
    # west on its own owes b 32 / 3 (a third of 32 GPUs) and b runs 8 there
    assert own["west"]["b"]["shortfall_gpu_h"] == pytest.approx(8 / 3, abs=0.05)


def test_each_cluster_on_its_own_is_its_single_cluster_diagnosis():
    east, west = short_on_both()
    d = diagnose_federation([("e", east.items), ("w", west.items)])
    assert d.clusters["east"].rows() == diagnose(east.items).rows()
    assert d.clusters["west"].rows() == diagnose(west.items).rows()
    assert d.tree.clusters == ("east", "west") and d.labels == {"east": "e", "west": "w"}


def test_histories_not_of_one_federated_run_are_refused():
    east, west = short_on_both()
    with pytest.raises(ValueError, match="west.jsonl: cluster 'west' again"):
        diagnose_federation([("west.jsonl", west.items), ("west.jsonl", west.items)])
    alone = Run(TEAMS, cluster="north", peers=("north",))
    alone.batch()
    with pytest.raises(ValueError, match="does not count 'north' as a peer"):
        diagnose_federation([("e", east.items), ("n", alone.items)])
    single = Run(TEAMS)
    single.batch()
    with pytest.raises(ValueError, match="s: its policy names no cluster"):
        diagnose_federation([("e", east.items), ("s", single.items)])


def _write(tmp_path: Path, run: Run, name: str) -> str:
    path = tmp_path / f"run.{name}.jsonl"
    write_log(path, Header(source="test", cluster=name), run.items)
    return str(path)


def test_the_cli_prints_the_tree_and_each_cluster(tmp_path: Path):
    east, west = short_on_both()
    logs = [_write(tmp_path, east, "east"), _write(tmp_path, west, "west")]
    r = CliRunner().invoke(main, ["diagnose", *logs, "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    b = {row["team"]: row for row in got["tree"]["teams"]}["b"]
    assert b["causes"]["admission"] == pytest.approx(8.0)
    assert b["clusters"] == {"east": pytest.approx(8.0), "west": pytest.approx(8.0)}
    assert set(got["clusters"]) == {"east", "west"}
    # admission 8 of the owed: 48 GPU-h, and a's and c's 32 GPUs in the first minute
    assert got["tree"]["scheduler_controlled_share"] == pytest.approx(8 / (48 + 32 / 60), rel=0.01)
    r = CliRunner().invoke(main, ["diagnose", *logs])
    assert r.exit_code == 0, r.output
    assert "the whole tree (east, west)" in r.output
    assert "cluster west on its own" in r.output
    r = CliRunner().invoke(main, ["diagnose", logs[0], logs[0]])
    assert r.exit_code != 0
    assert r.output.strip().splitlines() == [
        f"apportion: {logs[0]}: cluster 'east' again (also {logs[0]})"
    ]


CLUSTERS = "".join(
    f'[[clusters]]\nname = "{name}"\n[[clusters.pool]]\nprefix = "{name[0]}"\n'
    f'count = 2\ngpus_per_node = 8\ngpu_type = "h100"\n'
    for name in ("east", "west")
) + "".join(
    f'[budget.{t}]\nweight = 1\nowner = "{t}o"\n[budget.{t}.u]\nweight = 1\nowner = "{t}u"\n'
    for t in ("a", "b")
)


def test_a_federated_simulation_writes_a_log_per_cluster_that_diagnose_reads(tmp_path: Path):
    """``simulate --log run.jsonl`` of two clusters writes ``run.east.jsonl`` and
    ``run.west.jsonl``; ``diagnose`` of both gives the tree's rows and each
    cluster's, which are that cluster's log diagnosed alone (``--out`` still takes
    one cluster: one line, exit 2)."""
    (tmp_path / "c.toml").write_text('[budget]\nowner = "ops"\n' + CLUSTERS)
    rows = [f"a{i},{i * 600},a/u,8,7200,3600,true,0,any," for i in range(8)]
    rows += [f"b{i},{i * 900},b/u,8,5400,1800,true,0,any," for i in range(8)]
    (tmp_path / "t.csv").write_text(
        "id,submit,owner,gpus,duration,min_runtime,resumable,priority,gpu_type,cluster\n"
        + "\n".join(rows)
        + "\n"
    )
    files = ["--cluster", str(tmp_path / "c.toml"), "--trace", str(tmp_path / "t.csv"), "-q"]
    r = CliRunner().invoke(
        main, ["simulate", *files, "--json", "--log", str(tmp_path / "run.jsonl")]
    )
    assert r.exit_code == 0, r.output
    kpis = json.loads(r.stdout.splitlines()[-1])
    logs = [str(tmp_path / f"run.{c}.jsonl") for c in ("east", "west")]
    assert all(Path(p).exists() for p in logs)
    r = CliRunner().invoke(main, ["diagnose", *logs, "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert [t["team"] for t in got["tree"]["teams"]] == ["a", "b"]
    assert sum(t["owed_gpu_h"] for t in got["tree"]["teams"]) > 0
    for c, path in zip(("east", "west"), logs, strict=True):
        assert got["clusters"][c]["teams"] == diagnose(open_log(path)).rows()
    assert kpis["workloads"] == 16
    r = CliRunner().invoke(main, ["simulate", *files, "--out", str(tmp_path / "x.duckdb")])
    assert r.exit_code == 2
    assert r.output.strip().startswith("apportion: --out and --plot take one cluster")


def test_a_team_takes_turns_with_its_own_workloads_not_with_other_teams():
    """a, b (weight 1) and c (weight 2) on east 3 x 8 and west 1 x 8 GPUs: a and b
    are owed 8 each, c 16. c runs every node (4 h contracts, placed at 0); at
    1 min a1 and b1 (8 GPUs each) wait on east, b2 on west. east's scheduling
    order tries a1 first (a and b stand equal; a by name). b is short 8: its own
    first workload on east, b1, explains it (``where`` east), though a1 took
    east's first place in its walk; b2 on west explains nothing. Both are
    ``contracts`` (c's runs were placed before they were pending), held by c."""
    teams = {"a": 1, "b": 1, "c": 2}
    east, west = cluster("east", "n", 3, teams), cluster("west", "m", 1, teams)
    for i, run in enumerate((east, west)):
        nodes = ["n1", "n2", "n3"] if i == 0 else ["m1"]
        for j, _ in enumerate(nodes):
            run.submit(f"c{i}{j}", "c", 8, 4 * HOUR_MS)
        run.batch()
        for j, node in enumerate(nodes):
            run.place(f"c{i}{j}", node)
    east.at(T1).submit("a1", "a", 8, HOUR_MS).submit("b1", "b", 8, HOUR_MS).batch()
    west.at(T1).submit("b2", "b", 8, HOUR_MS).batch()
    for run in (east, west):
        run.at(T1 + HOUR_MS).batch()
    tree, _ = tree_rows(east, west)
    assert tree["a"]["clusters"] == {"east": pytest.approx(8.0), "west": 0}
    assert tree["b"]["shortfall_gpu_h"] == pytest.approx(8.0)
    assert tree["b"]["clusters"] == {"east": pytest.approx(8.0), "west": 0}
    assert split(tree["b"]) == {"contracts": pytest.approx(8.0)}
    assert tree["b"]["holders"] == {"c": pytest.approx(8.0)}
