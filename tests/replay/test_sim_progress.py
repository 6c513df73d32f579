"""``apportion simulate`` without a terminal (CI logs, ``make run > file``): plain
progress lines on stderr instead of a bar that never draws; the header's days agree
with the table's ``simulated days`` (the warm-up named apart)."""

from __future__ import annotations

from apportion.replay.run import load_inputs
from click.testing import CliRunner

from apportion.cli import main
from apportion.cli_sim import PLAIN_PROGRESS_LINES, _plain_progress

DAY = 86_400_000


def test_simulate_without_a_terminal_prints_a_line_per_day():
    r = CliRunner().invoke(main, ["simulate", "--scenario", "debug", "--days", "2"])
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("simulating budget:")]
    assert [ln.split(",")[0] for ln in lines] == [
        "simulating budget: day 1/2 (50%)",
        "simulating budget: done",
    ]
    assert lines[-1].startswith("simulating budget: done, 2 days in ")
    # the header and the table agree (debug has no warm-up)
    assert "apportion simulate: scenario debug, seed 1, 2 days\n" in r.stdout
    assert "warm-up" not in r.stdout
    days_row = next(ln for ln in r.stdout.splitlines() if ln.startswith("simulated days"))
    assert days_row.split()[-1] == "2.00"


def test_quiet_prints_no_progress():
    r = CliRunner().invoke(main, ["simulate", "--scenario", "debug", "--days", "1", "-q"])
    assert r.exit_code == 0, r.output
    assert "simulating" not in r.stderr


def test_header_counts_the_measured_days_and_the_warm_up_apart():
    inp = load_inputs(None, None, None, seed=1, days=3, scenario="family")
    assert inp.warmup_days == 2
    assert inp.horizon_days() == 5  # what is simulated
    assert inp.label == "scenario family, seed 1, 3 days (+2 warm-up)"
    one = load_inputs(None, None, None, seed=1, days=1, scenario="family")
    assert one.label == "scenario family, seed 1, 1 day (+2 warm-up)"


def test_long_runs_print_every_few_days(capsys):
    progress, done = _plain_progress("priority", 200)
    for hour in range(200 * 24 + 1):  # as the simulator calls it: about once an hour
        progress(hour * 3_600_000)
    done()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) <= PLAIN_PROGRESS_LINES + 1
    assert lines[0].startswith("simulating priority: day 5/200 (2%)")
    assert lines[1].startswith("simulating priority: day 10/200 (5%)")
    assert lines[-1].startswith("simulating priority: done, 200 days in ")
    days = [int(ln.split()[3].split("/")[0]) for ln in lines[:-1]]
    assert days == list(range(5, 200, 5))


def test_a_day_is_printed_once_even_when_called_often(capsys):
    progress, _ = _plain_progress("budget", 3)
    for ms in (0, DAY - 1, DAY, DAY + 1, DAY + 3_600_000, 2 * DAY, 3 * DAY):
        progress(ms)
    assert [ln.split(",")[0] for ln in capsys.readouterr().err.splitlines()] == [
        "simulating budget: day 1/3 (33%)",
        "simulating budget: day 2/3 (66%)",
    ]
