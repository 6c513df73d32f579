"""The audit of a cycle published in parts: reproduced from a log file and from a
projection; a part dropped, altered or mislabelled is a divergence."""

from __future__ import annotations

from pathlib import Path

import duckdb
import msgspec
from apportion.core.history import decide_batch, fold_item, split_batch
from apportion.core.state import State
from apportion.replay.audit import audit
from apportion.replay.eventlog import Header, open_log, write_log
from apportion.replay.projection import Projection
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    Input,
    NodeRegistered,
    WorkloadSubmitted,
)
from apportion.schemas.history import BatchItem, HistoryItem, input_item

LIMIT = 16_000


def busy_history() -> list[HistoryItem]:
    """4 x 8 GPUs; 24 submissions that fit, 150 to an unknown owner with 400-character ids."""
    events: list[Input] = [
        BudgetSet(id="b0", at_ms=0, path="", weight=1, owner="ops", actor="ops"),
        BudgetSet(id="b1", at_ms=0, path="a", weight=1, owner="lead", actor="ops"),
    ]
    events += [
        NodeRegistered(id=f"n{i}", at_ms=0, node=f"n{i}", gpus=8, gpu_type="h100") for i in range(4)
    ]
    events += [
        WorkloadSubmitted(
            id=f"s{i}", at_ms=5, workload=f"w{i}", owner="a", gpus=1, min_runtime_ms=60
        )
        for i in range(24)
    ]
    events += [
        WorkloadSubmitted(
            id=f"bad-{i}-{'x' * 400}",
            at_ms=6,
            workload=f"b{i}",
            owner="nope",
            gpus=1,
            min_runtime_ms=0,
        )
        for i in range(150)
    ]
    return [input_item(i + 1, e) for i, e in enumerate(events)]


def split_history() -> tuple[list[HistoryItem], str]:
    """The busy cluster, its first cycle in parts, a tick, a cycle in one batch; and the digest."""
    state = State()
    items: list[HistoryItem] = []
    seq = 0

    def add(item: HistoryItem) -> None:
        fold_item(state, item)
        items.append(item)

    def cycle() -> None:
        nonlocal seq
        batch, _ = decide_batch(state)
        for part in split_batch(batch, state.decisions_folded, LIMIT):
            seq += 1
            add(BatchItem(seq=seq, batch=part))

    for item in busy_history():
        add(item)
    cycle()
    add(input_item(state.input_seq + 1, ClockTicked(id="t1", at_ms=10_000)))
    cycle()
    return items, state.digest()


def _write(path: Path, items: list[HistoryItem], digest: str) -> Path:
    write_log(path, Header(source="test"), items, digest)
    return path


def test_a_cycle_in_parts_is_reproduced_from_a_log_file_and_a_projection(tmp_path: Path) -> None:
    items, digest = split_history()
    parts = [i for i in items if isinstance(i, BatchItem) and i.batch.is_part]
    assert len(parts) >= 5 and parts[0].batch.basis == parts[-1].batch.basis
    result = audit(open_log(_write(tmp_path / "parts.jsonl", items, digest)))
    assert result.ok, result.verdict()
    assert result.batches == len(parts) + 1 and result.digest == digest

    con = duckdb.connect(str(tmp_path / "parts.duckdb"))
    projection, state = Projection(con), State()
    for item in items:
        projection(item, state, fold_item(state, item))
    projection.commit(state)
    con.close()
    back = list(open_log(tmp_path / "parts.duckdb"))
    assert [i.batch for i in back if isinstance(i, BatchItem)] == [
        i.batch for i in items if isinstance(i, BatchItem)
    ]
    assert audit(open_log(tmp_path / "parts.duckdb")).ok


def _lines(items: list[HistoryItem], digest: str, tmp_path: Path) -> list[dict]:
    path = _write(tmp_path / "base.jsonl", items, digest)
    return [msgspec.json.decode(line) for line in path.read_bytes().splitlines()]


def _audit_lines(lines: list[dict], path: Path):
    path.write_bytes(b"".join(msgspec.json.encode(x) + b"\n" for x in lines))
    return audit(open_log(path))


def test_a_part_dropped_altered_or_mislabelled_diverges(tmp_path: Path) -> None:
    items, digest = split_history()
    base = _lines(items, digest, tmp_path)
    at = [i for i, x in enumerate(base) if "batch" in x and "more" in x["batch"]]

    dropped = [x for i, x in enumerate(base) if i != at[1]]
    dropped[-1]["end"]["batches"] -= 1
    div = _audit_lines(dropped, tmp_path / "dropped.jsonl").divergence
    assert div is not None and div.batch == 2

    altered = _lines(items, digest, tmp_path)
    altered[at[2]]["batch"]["decisions"][0]["reason"] = "made up"
    div = _audit_lines(altered, tmp_path / "altered.jsonl").divergence
    assert div is not None and (div.batch, div.what) == (3, "decision 1")

    relabelled = _lines(items, digest, tmp_path)
    del relabelled[at[0]]["batch"]["more"]  # the first part claims to be the last
    result = _audit_lines(relabelled, tmp_path / "relabelled.jsonl")
    assert result.divergence is not None and result.divergence.what == "part"


def test_a_cycle_cut_short_by_an_input_diverges(tmp_path: Path) -> None:
    items, digest = split_history()
    lines = _lines(items, digest, tmp_path)
    at = [i for i, x in enumerate(lines) if "batch" in x and "more" in x["batch"]]
    last = next(i for i in range(at[-1] + 1, len(lines)) if "batch" in lines[i])
    # the parts after the first are gone: the tick follows a part that said "more"
    cut = [x for i, x in enumerate(lines) if i not in at[1:] and i != last]
    cut[-1]["end"]["batches"] = sum(1 for x in cut if "batch" in x)
    div = _audit_lines(cut, tmp_path / "cut.jsonl").divergence
    assert div is not None and div.what == "part" and div.recorded.startswith("input ")
