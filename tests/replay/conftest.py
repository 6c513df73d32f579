"""Helpers for the replay tests."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLICE = REPO / "tests" / "data" / "philly"
"""A real slice of the Philly trace, committed (see its README)."""
SHARED_TRACES = [REPO.parent / "shared" / "traces", Path("/work/shared/traces")]
"""Where the full public traces are: ``shared/traces`` beside the checkout."""


@pytest.fixture
def philly_dir() -> Path:
    """The committed slice: header and first 399 rows of the Philly job file."""
    return SLICE


@pytest.fixture
def shared_traces() -> Path:
    """The full public traces beside the checkout (CI and sessions have them)."""
    for path in SHARED_TRACES:
        if (path / "SHA256SUMS").exists():
            return path
    pytest.skip("the shared traces folder is not beside this checkout")
