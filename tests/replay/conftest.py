"""Helpers for the replay tests."""

from __future__ import annotations

from pathlib import Path

import pytest

TRACES = Path("/work/shared/traces")


@pytest.fixture
def philly_dir() -> Path:
    if not (TRACES / "philly_pollux_jobs.csv").exists():
        pytest.skip("public traces not available")
    return TRACES
