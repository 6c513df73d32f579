"""Snapshots round-trip exactly; ``core/`` and ``schemas/`` import nothing impure."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from apportion.core import State, apply, fold
from apportion.schemas.events import HOUR_MS as H
from apportion.schemas.events import ClockTicked
from core_builders import Scenario

ROOT = Path(__file__).resolve().parents[2]


def busy() -> Scenario:
    s = Scenario().tree("a", "a/x", ("a/y", 2), "b").nodes("n", 3).node("h0", 4, "h100")
    s.submit("w1", "a/x", gpus=8).submit("w2", "a/y", gpus=4, min_runtime_ms=0).submit(
        "w3", "b", gpus=16
    )
    s.place("w1", "n0").place("w2", ("n1", 4)).at(H).tick().preempt("w2").health("n2", "draining")
    s.rejects().cancel("ghost").submit("w4", "b", gpus=2, gpu_type="h100", priority=3).place(
        "w4", "h0"
    )
    s.at(2 * H).finish("w1").policy(lookback_ms=24 * H)
    return s


def test_snapshot_round_trips_and_behaves_the_same() -> None:
    s = busy()
    restored = State.from_bytes(s.state.to_bytes())
    assert restored.digest() == s.state.digest()
    assert restored.snapshot() == s.state.snapshot()
    assert restored.pools == s.state.pools and restored.active_by_owner == s.state.active_by_owner
    # the same further events on both give the same states
    more = Scenario()
    more.n = s.n
    more.state = restored
    for t in (s, more):
        t.at(3 * H).tick().place("w2", ("n1", 4)).at(4 * H).finish("w4").preempt(
            "w2", requeued=False
        )
        t.submit("w5", "a/x", gpus=24).cancel("w3").remove("b")
    assert more.state.digest() == s.state.digest()
    assert [more.state.usage(p) for p in more.state.budget.nodes] == [
        s.state.usage(p) for p in s.state.budget.nodes
    ]


def test_copy_is_independent() -> None:
    s = busy()
    before = s.state.digest()
    clone = s.state.copy()
    apply(clone, ClockTicked(id="later", at_ms=s.state.now_ms + 1))
    assert s.state.digest() == before
    assert clone.digest() != before


def test_digest_is_stable_and_sensitive() -> None:
    a, b = busy(), busy()
    assert a.state.digest() == b.state.digest() == fold(a.events).digest()
    b.tick(b.state.now_ms + 1)
    assert a.state.digest() != b.state.digest()


# -- purity ---------------------------------------------------------------------------

FORBIDDEN = frozenset(
    [
        "time",
        "datetime",
        "random",
        "secrets",
        "uuid",
        "asyncio",
        "threading",
        "multiprocessing",
        "concurrent",
        "os",
        "sys",
        "io",
        "pathlib",
        "socket",
        "subprocess",
        "select",
        "signal",
        "shutil",
        "tempfile",
        "glob",
        "nats",
        "duckdb",
        "structlog",
        "aiohttp",
        "click",
    ]
)


def impure_imports(source: str) -> list[str]:
    """Top-level names of forbidden modules that ``source`` imports (also relative-free ``from x import``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            names = [
                a.value
                for a in node.args[:1]
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            ]
        else:
            continue
        found += [n for n in names if n.split(".")[0] in FORBIDDEN]
    return found


PURE_FILES = sorted((ROOT / "core").glob("**/*.py")) + sorted((ROOT / "schemas").glob("**/*.py"))


def test_pure_folders_exist() -> None:
    assert any(p.name == "state.py" for p in PURE_FILES) and any(
        p.name == "events.py" for p in PURE_FILES
    )


@pytest.mark.parametrize("path", PURE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_core_and_schemas_import_nothing_impure(path) -> None:
    assert impure_imports(path.read_text()) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import time", ["time"]),
        ("import os.path", ["os.path"]),
        ("from datetime import datetime", ["datetime"]),
        ("import random as r, json", ["random"]),
        ("def f():\n    import uuid\n", ["uuid"]),
        ("from nats.js import api", ["nats.js"]),
        ("__import__('subprocess')", ["subprocess"]),
        ("from . import time", []),  # a sibling module named time is not the stdlib
        ("import timeit_like, fractions, hashlib", []),
    ],
    ids=[
        "time",
        "os-path",
        "from-datetime",
        "alias",
        "nested",
        "from-submodule",
        "dunder-import",
        "relative",
        "clean",
    ],
)
def test_purity_checker_catches_violations(source, expected) -> None:
    assert impure_imports(source) == expected
