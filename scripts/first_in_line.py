"""Where one team's hours go while it waits: a probe of every cycle of a simulation.

    .venv/bin/python scripts/first_in_line.py --set big_team=0.3 --set load=3.5 \
        --set margin=0.05 --days 5 --from 2

Runs the family scenario (or ``--scenario``) under the budget scheduler and, at
every cycle, notes whether the team runs at least ``--running`` allocated GPUs,
whether it has a gang (at least ``--gang`` GPUs) pending, whose workload is the
first blocked one (the team's or another's) and whether that workload got a
reservation (a start the contract can tell). Each cycle's state lasts until the
next cycle; the script prints the hours in each class from day ``--from`` on.

This is how docs/cycle.md ("Decisions written down") found that, under a
margin of 0.05, a big-share team spent 20 of 120 hours (days 2-7) first in line
with no reservation at all. The decisions are the scheduler's own: the probe only
reads each cycle's scratch.
"""

from __future__ import annotations

import argparse
from collections import Counter

from apportion.core.cycle import Cycle, CycleResult
from apportion.core.state import State, Workload
from apportion.replay.run import load_inputs
from apportion.replay.simulator import run_simulation
from apportion.schemas.events import DAY_MS, HOUR_MS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="family")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--days", type=int, default=5)
    ap.add_argument("--from", dest="from_day", type=float, default=2.0)
    ap.add_argument("--team", default="big/team", help="a budget path (its subtree counts)")
    ap.add_argument("--running", type=int, default=150, help="GPUs that count as running")
    ap.add_argument("--gang", type=int, default=64, help="GPUs that make a pending gang")
    a = ap.parse_args()
    inp = load_inputs(None, None, None, a.seed, a.days, a.scenario, a.set)
    prefix = a.team.rstrip("/") + "/"

    def ours(w: Workload) -> bool:
        return w.owner == a.team or w.owner.startswith(prefix)

    seen: list[tuple[int, str]] = []

    def decide(state: State) -> CycleResult:
        cycle = Cycle(state)
        reserver = cycle.reserver
        first: list[Workload] = []
        reserve = reserver.reserve

        def noting(c: Workload) -> None:
            first.append(c)
            reserve(c)

        reserver.reserve = noting  # type: ignore[method-assign]
        result = cycle.run(report_reservation=True)
        running = sum(w.gpus for w in state.running.values() if ours(w) and w.min_runtime_ms > 0)
        gang = any(ours(w) and w.gpus >= a.gang for w in state.pending.values())
        who = "none blocked" if not first else ("ours" if ours(first[0]) else "another team's")
        what = (
            ("running" if running >= a.running else "not running")
            + (", gang pending" if gang else "")
            + f" | first blocked: {who}"
            + (
                ", reserved"
                if result.reservation is not None
                else ", no reservation"
                if first
                else ""
            )
        )
        seen.append((state.now_ms, what))
        return result

    sim = run_simulation(
        inp.cluster_events, inp.trace, inp.health, "budget", inp.days, decide=decide
    )
    start = sim.start_ms + int(a.from_day * DAY_MS)
    hours: Counter[str] = Counter()
    for (t, what), (t_next, _) in zip(seen, [*seen[1:], (sim.end_ms, "")], strict=True):
        lo, hi = max(t, start), min(t_next, sim.end_ms)
        if hi > lo:
            hours[what] += (hi - lo) / HOUR_MS
    print(f"{inp.label}; team {a.team}, from day {a.from_day:g}")
    for what, h in hours.most_common():
        print(f"{h:7.1f} h  {what}")


if __name__ == "__main__":
    main()
