"""The layers import only downwards: schemas <- core <- replay <- services <- cli.

Every module of every layer is parsed (nothing is imported); an import of a
higher layer, or of a library a layer must not know, fails with its file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("schemas", "core", "replay", "services", "apportion")
"""Folder names, lowest first; ``apportion/`` holds the command line."""
PACKAGE_OF = {"schemas": "schemas", "core": "core", "replay": "replay", "services": "services"}
FORBIDDEN_LIBRARIES = {
    "schemas": ("nats", "duckdb", "aiohttp", "asyncio", "structlog", "click"),
    "core": ("nats", "duckdb", "aiohttp", "asyncio", "structlog", "click"),
    "replay": ("nats", "aiohttp", "asyncio", "structlog"),
}


def _layer_of_import(name: str) -> str | None:
    """The layer an absolute import names (``apportion.core.cycle`` -> ``core``)."""
    parts = name.split(".")
    if parts[0] != "apportion":
        return None
    if len(parts) > 1 and parts[1] in PACKAGE_OF:
        return parts[1]
    return "apportion"


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _modules(layer: str) -> list[Path]:
    return sorted((ROOT / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_no_layer_above_it(layer: str) -> None:
    rank = LAYERS.index(layer)
    wrong = []
    for path in _modules(layer):
        for line, name in _imports(path):
            target = _layer_of_import(name)
            if target is not None and LAYERS.index(target) > rank:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: imports {name} ({target})")
            for lib in FORBIDDEN_LIBRARIES.get(layer, ()):
                if name == lib or name.startswith(lib + "."):
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The parser finds ``import`` and ``from ... import`` of a higher layer."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom apportion.services.bus import connect\n")
    found = [(line, _layer_of_import(name)) for line, name in _imports(bad)]
    assert (2, "services") in found and (1, None) in found
