"""The fencing bounds (core/rules/fence.py): derived from the heartbeat timeout alone,
so the rule ``H >= F + N + M`` holds for every value; the cluster file refuses a
timeout too short to fence."""

from __future__ import annotations

import pytest
from apportion.core.rules.fence import (
    DEFAULT_HEARTBEAT_TIMEOUT_MS,
    MIN_HEARTBEAT_TIMEOUT_MS,
    effective_timeout_ms,
    fence_bounds,
    heartbeat_timeout_problem,
    watches_every_host,
)
from apportion.replay.cluster_file import cluster_from_dict
from apportion.replay.errors import InputFileError


def test_the_documented_figures() -> None:
    assert fence_bounds(0) == (300_000, 255_000, 30_000, 15_000)
    assert fence_bounds(300_000) == fence_bounds(0)
    assert fence_bounds(6_000) == (6_000, 3_400, 600, 2_000)
    assert fence_bounds(120_000) == (120_000, 102_000, 12_000, 6_000)
    assert fence_bounds(3_600_000) == (3_600_000, 3_390_000, 30_000, 180_000)


@pytest.mark.parametrize("h", [0, 1, 1_500, 4_999, 5_000, 6_000, 59_999, 300_000, 10**9])
def test_the_rule_holds_for_every_timeout(h: int) -> None:
    b = fence_bounds(h)
    assert b.heartbeat_timeout_ms == b.fence_after_ms + b.notice_ms + b.margin_ms
    assert b.margin_ms >= 2_000 and b.fence_after_ms >= 2_500 and b.notice_ms >= 0
    assert b.heartbeat_timeout_ms >= MIN_HEARTBEAT_TIMEOUT_MS


def test_the_default_watches_only_hosts_that_heartbeat() -> None:
    assert effective_timeout_ms(0) == DEFAULT_HEARTBEAT_TIMEOUT_MS
    assert not watches_every_host(0)
    assert watches_every_host(60_000) and effective_timeout_ms(60_000) == 60_000
    assert effective_timeout_ms(1_500) == MIN_HEARTBEAT_TIMEOUT_MS  # an old history's value


def test_a_timeout_too_short_to_fence_is_refused() -> None:
    assert heartbeat_timeout_problem(0) == "" and heartbeat_timeout_problem(5_000) == ""
    assert "at least 5 s" in heartbeat_timeout_problem(4_000)
    doc: dict[str, object] = {
        "cluster": {
            "name": "c",
            "pool": [{"prefix": "h", "count": 1, "gpus_per_node": 8, "gpu_type": "h100"}],
        },
        "budget": {"owner": "ops", "a": {"weight": 1, "owner": "ops"}},
        "policy": {"heartbeat_timeout": "3s"},
    }
    with pytest.raises(InputFileError, match=r"policy\.heartbeat_timeout.*self-fence"):
        cluster_from_dict(doc)
    doc["policy"] = {"heartbeat_timeout": "6s"}
    (policy,) = [e for e in cluster_from_dict(doc).events if type(e).__name__ == "PolicySet"]
    assert policy.heartbeat_timeout_ms == 6_000
