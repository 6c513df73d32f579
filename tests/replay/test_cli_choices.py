"""Options that are really choices are click choices: a bad value is click's usage
error (exit 2, an ``Error:`` line naming the option), never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from apportion.replay.scenarios import SCENARIOS
from click.testing import CliRunner

from apportion.cli import LOG_LEVEL, main
from apportion.cli_sim import SCENARIO_NAMES


def _usage_error(args: list[str], option: str) -> str:
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and f"'{option}'" in errors[0], r.stderr
    assert "Traceback" not in r.output
    return errors[0]


@pytest.mark.parametrize("command", [["up"], ["serve", "scheduler"]])
def test_log_level_is_a_choice(command):
    line = _usage_error([*command, "--log-level", "foo"], "--log-level")
    assert "'foo' is not one of 'debug', 'info', 'warning', 'error', 'critical'" in line


def test_log_level_choice_in_help_and_case_insensitive():
    r = CliRunner().invoke(main, ["up", "--help"])
    assert "[debug|info|warning|error|critical]" in r.output
    assert LOG_LEVEL.convert("DEBUG", None, None) == "debug"


def test_log_level_foo_in_a_real_process():
    """The installed command line, as a user runs it: no traceback before anything starts."""
    p = subprocess.run(
        [sys.executable, "-m", "apportion", "up", "--log-level", "foo"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert "Invalid value for '--log-level'" in p.stderr


def test_scenario_is_a_choice_of_the_bundled_ones():
    assert list(SCENARIOS) == SCENARIO_NAMES
    line = _usage_error(["simulate", "--scenario", "ai3"], "--scenario")
    assert "'ai3' is not one of 'ai2', 'debug', 'family'" in line
    _usage_error(["trace", "generate", "--scenario", "x", "--out-dir", "o"], "--scenario")


def test_import_dates_are_checked_by_click(tmp_path):
    f = tmp_path / "jobs.csv"
    f.write_text("timestamp,duration,num_gpus,cluster\n")
    line = _usage_error(
        [
            "trace",
            "import",
            "--format",
            "philly",
            str(f),
            "--out-dir",
            str(tmp_path),
            "--from",
            "2017-13-01",
        ],
        "--from",
    )
    assert "2017-13-01" in line
