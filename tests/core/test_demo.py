"""``apportion demo`` prints real output of the core."""

from __future__ import annotations

from apportion.core import queue_order
from click.testing import CliRunner

from apportion.cli import main
from apportion.demo import build


def test_demo_history_folds_to_the_expected_queue() -> None:
    state = build()
    assert [w.id for w in queue_order(state)] == [
        "carol-lora",
        "bob-eval",
        "bob-pt-2",
        "alice-debug",
        "alice-pt-1",
        "dan-det-3",
        "dan-notebook",
    ]
    h = 3_600_000
    assert [state.usage(p) for p in ("llm/pretrain/alice", "llm/pretrain/bob", "vision")] == [
        384 * h,
        56 * h,
        224 * h,
    ]
    assert len(state.rejections) == 3


def test_demo_command_prints_queue_and_usage() -> None:
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 0, result.output
    for words in ("budget tree", "queue order", "carol-lora", "rejected inputs", "state digest"):
        assert words in result.output
