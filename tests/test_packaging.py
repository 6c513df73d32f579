"""The wheel carries the dashboard's pages and assets, declared as package data (not
found by setuptools' manifest scan, which warns that data folders look like packages
missing from ``packages``)."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DATA_DIRS = ("dashboard_static", "dashboard_templates")


def _data_files() -> list[str]:
    """Every file of the dashboard's data folders, as ``services/...`` paths."""
    return sorted(
        str(p.relative_to(ROOT))
        for d in DATA_DIRS
        for p in (ROOT / "services" / d).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def test_package_data_is_declared_not_scanned():
    tool = PYPROJECT["tool"]["setuptools"]
    assert tool["include-package-data"] is False
    globs = tool["package-data"]["apportion.services"]
    files = _data_files()
    assert files, "no dashboard files found"
    for f in files:
        rel = f.removeprefix("services/")
        matched = any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs)
        assert matched, f"{f} is not matched by [tool.setuptools.package-data] {globs}"


@pytest.mark.slow
def test_wheel_builds_without_the_packages_warning_and_has_the_dashboard(tmp_path):
    """Builds a wheel (pip, isolated build with setuptools from the index) from a copy."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("apportion", "schemas", "core", "replay", "services"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "whl"
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "-w", str(out), "--no-deps", "-v"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    log = p.stdout + p.stderr
    assert "absent from the `packages` configuration" not in log
    assert "Package would be ignored" not in log
    (wheel,) = out.glob("apportion-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in _data_files():
        assert "apportion/" + f in names, f"{f} missing from {wheel.name}"
