"""Offline ``explain`` / ``jobs`` of a simulation's log: times relative to the log's
own time (never the wall clock) and simulated time as ``day D HH:MM``, not 1970 dates."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from apportion.services.views import is_simulated, iso, sim_time, simulated_clock
from click.testing import CliRunner

from apportion.cli import main

DAY = 86_400_000


@pytest.fixture(scope="module")
def sim_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    log = tmp_path_factory.mktemp("sim") / "sim.jsonl"
    out = CliRunner().invoke(
        main, ["simulate", "--scenario", "debug", "--days", "1", "--log", str(log), "-q"]
    )
    assert out.exit_code == 0, out.output
    return log


def _some_workload(log: Path) -> str:
    for line in log.read_text().splitlines():
        item = json.loads(line)
        if item.get("input", {}).get("kind") == "WorkloadSubmitted":
            return str(item["input"]["workload"])
    raise AssertionError("no submission in the log")


def test_sim_time_words() -> None:
    assert sim_time(0) == "day 0 00:00"
    assert sim_time(3 * DAY + 14 * 3_600_000 + 5 * 60_000 + 59_000) == "day 3 14:05"
    assert is_simulated(30 * DAY) and not is_simulated(1_780_000_000_000)
    with simulated_clock():
        assert iso(DAY) == "day 1 00:00"
    assert iso(DAY) == "1970-01-02T00:00:00Z"  # outside, ISO as before


def test_offline_explain_of_a_simulation(sim_log: Path) -> None:
    wid = _some_workload(sim_log)
    out = CliRunner().invoke(main, ["explain", "--log", str(sim_log), wid])
    assert out.exit_code == 0, out.output
    assert "1970" not in out.output
    assert re.search(r"day 0 \d\d:\d\d", out.output), out.output
    # relative to the log's end (day 1 at the latest), not to the wall clock
    assert not re.search(r"\b\d{2,} d\b", out.output), out.output
    # --at takes the same form, and JSON keeps epoch ms
    out = CliRunner().invoke(
        main, ["explain", "--log", str(sim_log), wid, "--at", "day 0 12:00", "--json"]
    )
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["now_ms"] == 12 * 3_600_000
    assert not any("1970" in r for r in data["reasons"])
    bad = CliRunner().invoke(main, ["explain", "--log", str(sim_log), wid, "--at", "day 1 25:00"])
    assert bad.exit_code != 0 and "HH:MM" in bad.output


def test_offline_jobs_of_a_simulation(sim_log: Path) -> None:
    out = CliRunner().invoke(main, ["jobs", "--log", str(sim_log), "--limit", "3"])
    assert out.exit_code == 0, out.output
    assert "1970" not in out.output and " day 0 " in out.output
