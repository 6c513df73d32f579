"""Fixtures for core tests; the builders live in ``core_builders`` (importable by name)."""

from __future__ import annotations

import pytest
from core_builders import Scenario


@pytest.fixture
def scenario() -> Scenario:
    return Scenario()
