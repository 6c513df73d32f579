"""Digests of the decisions of a fixed set of simulations: a refactoring that
claims "decisions unchanged" must print the same lines before and after.

    .venv/bin/python scripts/decision_digests.py            # the quick set (~1-2 min)
    .venv/bin/python scripts/decision_digests.py --full     # adds ai2 30 days and a 4x family day
    .venv/bin/python scripts/decision_digests.py --check scripts/decision_digests.txt

Each line is ``NAME SHA256 DECISIONS BATCHES``. The digest covers every
decision batch's ``basis``, ``next_wakeup_ms`` and decisions, in history
order, encoded as JSON. Two fields that only *label* a batch are left out so
that the digests compare the scheduler's choices across the versions that
added them: the batch's ``logic`` (which version of the logic made it) and a
rejection's ``code`` (the stable reason code beside the message).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any

import msgspec
from apportion.core.state import State
from apportion.replay.run import load_inputs
from apportion.replay.simulator import run_simulation
from apportion.schemas.history import BatchItem, HistoryItem

_LABELS = ("logic", "code")

QUICK: tuple[tuple[str, str, int, int, tuple[str, ...], str], ...] = (
    # name, scenario, seed, days, knobs, policy
    ("debug-3d-budget", "debug", 1, 3, (), "budget"),
    ("debug-3d-priority", "debug", 1, 3, (), "priority"),
    ("ai2-5d-budget", "ai2", 1, 3, (), "budget"),
    ("family-load1.5-s1-2d", "family", 1, 2, ("load=1.5",), "budget"),
    ("family-load4-s2-2d", "family", 2, 2, ("load=4",), "budget"),
    (
        "family-load4-margin-s3-2d",
        "family",
        3,
        2,
        ("load=4", "margin=0.05", "margin_wait=0"),
        "budget",
    ),
    ("family-load4-margin-wait-s3-2d", "family", 3, 2, ("load=4", "margin=0.05"), "budget"),
    ("family-gpus128-s4-3d", "family", 4, 3, ("gpus=128", "drain_rate=0.1"), "budget"),
)
FULL = (
    ("ai2-32d-budget", "ai2", 1, 30, (), "budget"),
    ("ai2-32d-priority", "ai2", 1, 30, (), "priority"),
    (
        "family-4x-s1-1d",
        "family",
        1,
        1,
        ("gpus=4096", "programs=12", "teams=32", "users=3"),
        "budget",
    ),
)


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in _LABELS}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


class Hasher:
    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.decisions = 0
        self.batches = 0

    def __call__(self, item: HistoryItem, _state: State, _rejected: str | None) -> None:
        if not isinstance(item, BatchItem):
            return
        self.batches += 1
        self.decisions += len(item.batch.decisions)
        self.h.update(msgspec.json.encode(_strip(msgspec.to_builtins(item.batch))))
        self.h.update(b"\n")


def digest(
    name: str, scenario: str, seed: int, days: int, knobs: tuple[str, ...], policy: str
) -> str:
    inp = load_inputs(None, None, None, seed, days, scenario, list(knobs))
    hasher = Hasher()
    run_simulation(
        inp.cluster_events, inp.trace, inp.health, policy, inp.days or 1, observer=hasher
    )
    return f"{name} {hasher.h.hexdigest()} {hasher.decisions} {hasher.batches}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="also the long runs")
    ap.add_argument("--check", type=Path, help="compare with the lines of this file")
    args = ap.parse_args()
    runs = QUICK + (FULL if args.full else ())
    lines = []
    for run in runs:
        line = digest(*run)
        print(line, flush=True)
        lines.append(line)
    if args.check is None:
        return 0
    expected = {ln.split()[0]: ln for ln in args.check.read_text().splitlines() if ln.strip()}
    bad = [ln for ln in lines if ln.split()[0] in expected and expected[ln.split()[0]] != ln]
    for ln in bad:
        print(f"DIFFERS: {ln}\n   was: {expected[ln.split()[0]]}", file=sys.stderr)
    print("digests: " + ("all equal" if not bad else f"{len(bad)} differ"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
