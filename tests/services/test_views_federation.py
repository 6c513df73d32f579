"""What people see on a cluster that shares its budget tree with others (issue 29):
``share`` (its JSON, the CLI's table), ``queue`` and ``explain``, ``/metrics`` and
the dashboard's usage page, from a folded state; and a single cluster's share
view as it was."""

from __future__ import annotations

import re
import shutil
import subprocess
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from apportion.core.fold import apply
from apportion.core.ordering import FairShareView
from apportion.core.state import State
from apportion.schemas.events import (
    HOUR_MS,
    MINUTE_MS,
    BudgetSet,
    ClockTicked,
    Event,
    LeafCharge,
    NodeRegistered,
    PolicySet,
    Slot,
    UsageSummary,
    WorkloadPlaced,
    WorkloadSubmitted,
)
from apportion.services.metrics import GatewayMetrics
from apportion.services.views import (
    History,
    budget_tree,
    explain,
    queue_view,
    share_pct,
)

S = 5 * MINUTE_MS
EAST_GPUS = 8
"""Team ``a`` runs 8 GPUs on east all the time."""


class Cluster:
    """A state folded from inputs and decisions written here, ids ``e1``, ``e2`` ..."""

    def __init__(self) -> None:
        self.state = State()
        self.n = 0

    def __call__(self, event: Event) -> Cluster:
        self.n += 1
        apply(self.state, msgspec.structs.replace(event, id=f"e{self.n}"))
        assert not self.state.rejections, self.state.rejections[-1]
        return self


def west(peers: tuple[str, ...] = ("east", "west")) -> Cluster:
    """Cluster ``west``: teams ``a`` (a/x) and ``b`` (b/y), weight 1 each, two 8-GPU
    hosts, a day's lookback; ``peers=()``: a single cluster."""
    c = Cluster()
    c(BudgetSet(id="", at_ms=0, path="", weight=1, owner="admin", actor=""))
    for path in ("a", "a/x", "b", "b/y"):
        c(BudgetSet(id="", at_ms=0, path=path, weight=1, owner=f"{path}-owner", actor="admin"))
    fed: dict[str, Any] = {"cluster": "west", "peers": peers} if peers else {}
    c(PolicySet(id="", at_ms=0, actor="admin", lookback_ms=24 * HOUR_MS, **fed))
    for i in range(2):
        c(NodeRegistered(id="", at_ms=0, node=f"w{i}", gpus=8, gpu_type="b200", actor="admin"))
    return c


def heard(c: Cluster, start: int, at: int) -> None:
    c(
        UsageSummary(
            id="",
            at_ms=at,
            source="east",
            start_ms=start,
            end_ms=start + S,
            charges=(LeafCharge("a/x", EAST_GPUS * S),),
            actor="federation:east",
        )
    )


def busy_here(c: Cluster, t: int) -> None:
    """At ``t``: ``b-run`` (8 GPUs, b/y) runs here; ``a-wait`` and ``b-wait`` (16 GPUs
    each) wait."""
    c(ClockTicked(id="", at_ms=t))
    for wid, owner, gpus in (("b-run", "b/y", 8), ("a-wait", "a/x", 16), ("b-wait", "b/y", 16)):
        c(
            WorkloadSubmitted(
                id="",
                at_ms=t,
                workload=wid,
                owner=owner,
                gpus=gpus,
                min_runtime_ms=HOUR_MS,
                submitted_by=f"{owner}-owner",
            )
        )
    c(
        WorkloadPlaced(
            id="",
            at_ms=t,
            workload="b-run",
            placement=(Slot("w0", 8),),
            allocated=True,
            protected_until_ms=t + HOUR_MS,
            attempt=1,
        )
    )


def federated() -> Cluster:
    """West heard an hour of a's usage on east, then a gap of one interval, then one
    more; b runs here."""
    c = west()
    for i in range(12):
        heard(c, i * S, (i + 1) * S)
    heard(c, 13 * S, 14 * S)
    busy_here(c, 14 * S)
    c(ClockTicked(id="", at_ms=15 * S))
    return c


def nodes(tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {tree["path"]: tree}
    for child in tree["children"]:
        out.update(nodes(child))
    return out


def test_share_splits_usage_here_and_on_other_clusters() -> None:
    state = federated().state
    tree = budget_tree(state, detail=True)
    by = nodes(tree)
    east = 13 * EAST_GPUS * S / HOUR_MS  # 13 intervals heard
    here = 8 * S / HOUR_MS  # b-run for one interval
    assert by["a"]["usage_peers_gpu_h"] == east and by["a"]["usage_here_gpu_h"] == 0
    assert by["b"]["usage_here_gpu_h"] == here and by["b"]["usage_peers_gpu_h"] == 0
    assert by[""]["usage_gpu_h"] == pytest.approx(east + here)
    # what ranks: charged everywhere plus b-run's committed rest of protection
    committed = 8 * (HOUR_MS - S) / HOUR_MS
    assert by["b"]["ranked_gpu_h"] == pytest.approx(here + committed)
    assert by[""]["ranked_gpu_h"] == pytest.approx(east + here + committed)
    # of its share of what the whole tree used: the two add to 200 (weights 1:1)
    total = east + here + committed
    assert abs(by["a"]["share_pct"] - 100 * east / (total / 2)) < 1e-9
    assert abs(by["a"]["share_pct"] + by["b"]["share_pct"] - 200) < 1e-9
    fed = tree["federation"]
    assert fed["cluster"] == "west" and fed["share_basis"] == "tree_usage"
    assert "whole tree" in fed["share_basis_text"]
    assert fed["peers"] == [
        {
            "cluster": "east",
            "heard_from_ms": 0,
            "heard_until_ms": 14 * S,
            "gaps": [[12 * S, 13 * S]],
        }
    ]
    # a leaf's share_pct in the queue is the same figure
    view = FairShareView(state)
    assert share_pct(state, view, "a") == by["a"]["share_pct"]


def test_a_peer_named_but_not_heard_from_is_listed() -> None:
    c = west(peers=("east", "north", "west"))
    heard(c, 0, S)
    peers = budget_tree(c.state, detail=True)["federation"]["peers"]
    assert [(p["cluster"], p["heard_until_ms"]) for p in peers] == [("east", S), ("north", None)]


def test_a_single_cluster_share_is_as_it_was() -> None:
    c = west(peers=())
    busy_here(c, 14 * S)
    c(ClockTicked(id="", at_ms=15 * S))
    state = c.state
    tree = budget_tree(state, detail=True)
    assert "federation" not in tree
    assert set(nodes(tree)["b"]) == {
        "path",
        "weight",
        "owner",
        "global_share",
        "usage_gpu_h",
        "committed_gpu_h",
        "share",
        "allocation_gpu_h",
        "effective_usage",
        "usage_vs_share",
        "ratio",
        "running_gpus",
        "pending_gpus",
        "children",
    }
    # of its share of this cluster's capacity over the window, as before
    view = FairShareView(state)
    allocation = 0.5 * 16 * state.policy.lookback_ms  # b/y: all of b's half
    assert share_pct(state, view, "b/y") == 100.0 * view.usage["b/y"] / allocation
    q = queue_view(state)
    assert all("other_clusters" not in r for r in q["pending"])
    out = explain(state, History(), "a-wait")
    assert out is not None and "other_clusters" not in out
    text = " ".join(out["reasons"])
    assert "other clusters" not in text and "of what the tree used" not in text


def test_queue_and_explain_say_when_other_clusters_rank_a_team_low() -> None:
    state = federated().state
    q = queue_view(state)
    rows = {r["workload"]: r for r in q["pending"]}
    assert [r["workload"] for r in q["pending"]] == ["b-wait", "a-wait"]
    assert rows["a-wait"]["other_clusters"] == "a (8.67 GPU-h there)"
    assert "other_clusters" not in rows["b-wait"]  # b is ranked first anyway
    out = explain(state, History(), "a-wait")
    assert out is not None and out["other_clusters"] == "a (8.67 GPU-h there)"
    text = "\n".join(out["reasons"])
    assert "a used " in text and "% of its share of what the tree used" in text, text
    assert "8.67 GPU-h of it on other clusters" in text, text
    assert "ranked low by usage on other clusters: a (8.67 GPU-h there)" in text, text
    # b's explain names no other cluster: none of its usage is there
    b = explain(state, History(), "b-wait")
    assert b is not None and "other clusters" not in " ".join(b["reasons"])


def test_usage_elsewhere_that_does_not_change_the_rank_is_not_blamed() -> None:
    c = west()
    heard(c, 0, S)  # a little of a's usage on east: 0.67 GPU-h
    busy_here(c, S)
    c(ClockTicked(id="", at_ms=2 * S))
    rows = {r["workload"]: r for r in queue_view(c.state)["pending"]}
    assert [r["workload"] for r in queue_view(c.state)["pending"]] == ["a-wait", "b-wait"]
    assert "other_clusters" not in rows["a-wait"]


def sample(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    return None


def test_metrics_split_usage_by_scope_and_say_until_when_peers_were_heard() -> None:
    state = federated().state
    m = GatewayMetrics()
    m.update(state, None, now_ms=state.now_ms)
    text = m.render().decode()
    east_s = 13 * EAST_GPUS * S / 1000
    here_s = 8 * S / 1000
    assert sample(text, "apportion_budget_usage_gpu_seconds", path="a", scope="peers") == east_s
    assert sample(text, "apportion_budget_usage_gpu_seconds", path="a", scope="here") == 0
    assert sample(text, "apportion_budget_usage_gpu_seconds", path="b/y", scope="here") == here_s
    assert sample(text, "apportion_budget_usage_gpu_seconds", path="/", scope="peers") == east_s
    assert sample(text, "apportion_peer_heard_until_seconds", source="east") == 14 * S / 1000
    # the team's usage of share is of the tree's charged usage, not of west's GPUs
    ratio = sample(text, "apportion_team_usage_of_share_ratio", team="a")
    assert ratio is not None and abs(ratio - east_s / ((east_s + here_s) / 2)) < 1e-9


def test_a_single_cluster_has_no_federation_metrics() -> None:
    c = west(peers=())
    busy_here(c, S)
    m = GatewayMetrics()
    m.update(c.state, None, now_ms=c.state.now_ms)
    text = m.render().decode()
    assert "apportion_budget_usage_gpu_seconds{" not in text
    assert "apportion_peer_heard_until_seconds{" not in text
    allocation = 0.5 * 16 * c.state.policy.lookback_ms
    want = c.state.usage("b") / allocation
    assert sample(text, "apportion_team_usage_of_share_ratio", team="b") == want


def share_cli(state: State, monkeypatch: Any) -> str:
    """``apportion share``'s text for the gateway answer of ``state``."""
    import json

    from click.testing import CliRunner

    from apportion import cli, cli_live

    answer = json.loads(json.dumps(budget_tree(state, detail=True)))
    monkeypatch.setattr(cli_live, "_call", lambda *a, **k: answer)
    result = CliRunner().invoke(cli.main, ["share", "--url", "http://gateway"])
    assert result.exit_code == 0, result.output
    return result.output


def test_the_cli_table_of_a_federated_share(monkeypatch: Any) -> None:
    out = share_cli(federated().state, monkeypatch)
    assert out.splitlines()[0].split() == [
        "PATH",
        "WEIGHT",
        "SHARE",
        "HERE",
        "ELSEWHERE",
        "RANKED",
        "OF",
        "SHARE",
        "RUN",
        "GPUS",
        "PEND",
        "GPUS",
    ]
    a = next(line for line in out.splitlines() if line.startswith("  a "))
    assert a.split()[3:10] == ["0.0", "GPU-h", "8.7", "GPU-h", "8.7", "GPU-h", "104%"], out
    assert "OF SHARE: of its share of what the whole tree used on every cluster" in out
    assert re.search(r"east: usage counted until \S+ \(.*\); not heard of: ", out), out


def test_the_cli_table_of_a_single_cluster_is_as_it_was(monkeypatch: Any) -> None:
    c = west(peers=())
    busy_here(c, 14 * S)
    out = share_cli(c.state, monkeypatch)
    assert out.splitlines()[:3] == [
        "PATH                           WEIGHT   SHARE     ALLOCATION          USAGE "
        "USED/SHARE RUN GPUS PEND GPUS",
        "(root)                              1  100.0%    384.0 GPU-h      0.0 GPU-h "
        "        0%        8        32",
        "  a                                 1   50.0%    192.0 GPU-h      0.0 GPU-h "
        "        0%        0        16",
    ]
    assert "OF SHARE" not in out and "counted until" not in out


def test_the_dashboard_shows_the_other_clusters_column_when_there_are_peers() -> None:
    from apportion.services.dashboard_views import usage_html

    fed = usage_html(SimpleNamespace(state=federated().state, history=None))  # type: ignore[arg-type]
    assert "<th>here</th><th>other clusters</th>" in fed
    assert ">of share</th>" in fed and "east: usage counted until" in fed
    c = west(peers=())
    busy_here(c, S)
    one = usage_html(SimpleNamespace(state=c.state, history=None))  # type: ignore[arg-type]
    assert "other clusters" not in one and ">of share</th>" not in one


def test_the_dashboard_queue_says_when_other_clusters_rank_a_team_low() -> None:
    from apportion.services.dashboard_views import queue_html

    gw = SimpleNamespace(state=federated().state, history=None, auth=None, url=None)
    page = queue_html(gw)  # type: ignore[arg-type]
    assert "ranked low by usage on other clusters: a (8.67 GPU-h there)" in page


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (Debian: prometheus)")
def test_federated_metrics_pass_promtool() -> None:
    state = federated().state
    m = GatewayMetrics()
    m.update(state, None, now_ms=state.now_ms)
    p = subprocess.run(
        ["promtool", "check", "metrics"], input=m.render(), capture_output=True, timeout=60
    )
    assert p.returncode == 0 and not p.stdout and not p.stderr, (p.stdout + p.stderr).decode()
