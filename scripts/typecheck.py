"""Type-check the package with mypy, under the import names users see.

The distribution maps top-level folders to subpackages (``core/`` is
``apportion.core``), which a type checker cannot follow from the checkout. This
script lays a tree of links in ``build/typecheck`` (``apportion/`` holding the
CLI modules, and ``apportion/core`` -> ``core/`` and so on, whole folders, so new
modules appear by themselves) and runs mypy there with the settings in
``pyproject.toml`` (strict for ``apportion.schemas`` and ``apportion.core``).

    .venv/bin/python scripts/typecheck.py        # what ``make lint`` runs
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "typecheck"
SUBPACKAGES = ("schemas", "core", "replay", "services")


def lay_tree() -> Path:
    """``build/typecheck/apportion`` with a link for each module and mapped folder."""
    if TREE.exists():
        shutil.rmtree(TREE)
    pkg = TREE / "apportion"
    pkg.mkdir(parents=True)
    for path in sorted((ROOT / "apportion").iterdir()):
        if path.suffix in (".py", ".typed") or path.name == "data":
            os.symlink(path, pkg / path.name)
    for name in SUBPACKAGES:
        os.symlink(ROOT / name, pkg / name, target_is_directory=True)
    return TREE


def main() -> int:
    tree = lay_tree()
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        str(ROOT / "build" / "mypy_cache"),
        "-p",
        "apportion",
    ]
    return subprocess.call(cmd, cwd=tree)


if __name__ == "__main__":
    sys.exit(main())
