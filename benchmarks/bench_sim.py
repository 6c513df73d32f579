"""Simulator benchmark: wall time and simulated days per wall second.

Full: 30-day ai2 (both policies) and Philly Oct-Nov 2017 at full and 0.25
capacity (budget policy). Quick: 2-day ai2 and one Philly week at 0.25.
Each line: ``name  policy  days  workloads  wall_s  sim_days_per_s``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

PHILLY = next(
    (
        p
        for p in (
            Path(__file__).resolve().parents[2] / "shared/traces/philly_pollux_jobs.csv",
            Path("/work/shared/traces/philly_pollux_jobs.csv"),
        )
        if p.exists()
    ),
    Path("shared/traces/philly_pollux_jobs.csv"),
)
"""The full Philly job file, in the shared ``traces/`` folder beside the checkout."""


def _run(name: str, events, rows, health, policy: str, days: float) -> None:
    from apportion.replay.kpi import compute_kpis
    from apportion.replay.simulator import simulate

    t0 = time.perf_counter()
    sim = simulate(events, rows, health, policy=policy, days=days)
    kpis = compute_kpis(sim.con, sim.start_ms, sim.end_ms, sim.wall_s)
    wall = time.perf_counter() - t0
    print(
        f"{name:24s} {policy:8s} {days:5.1f} d {len(rows):7,d} workloads  wall {wall:7.1f} s  "
        f"{days / wall:7.2f} sim-days/s  occupancy {kpis['occupancy']}  delivery {kpis['delivery_ratio']}",
        flush=True,
    )


def _observer_cost(events, rows, health, days: float) -> None:
    """The same simulation with no observer (the fold and the cycles alone) and with
    the DuckDB projection observing: what writing the tables costs, in CPU seconds."""
    from apportion.replay.simulator import run_simulation, simulate

    cpu: dict[str, float] = {}
    for name, run in (("no observer", run_simulation), ("projection", simulate)):
        t0 = time.process_time()
        run(events, rows, health, policy="budget", days=days)
        cpu[name] = time.process_time() - t0
    print(
        f"ai2 {days:g}d observers        no observer {cpu['no observer']:6.1f} cpu s  "
        f"projection {cpu['projection']:6.1f} cpu s  "
        f"(projection costs {cpu['projection'] / cpu['no observer'] - 1:+.0%})",
        flush=True,
    )


def main(quick: bool) -> None:
    from apportion.replay.cluster_file import load_cluster
    from apportion.replay.importers import import_philly
    from apportion.replay.scenarios import ai2, write_scenario
    from apportion.replay.trace import read_health, read_trace

    days = 2 if quick else 30
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_scenario(ai2(days=days, seed=1), Path(tmp) / "ai2")
        events = load_cluster(paths["cluster"]).events
        rows, _ = read_trace(paths["trace"])
        health, _ = read_health(paths["health"])
        for policy in ("budget", "priority"):
            _run(f"ai2 {days}d", events, rows, health, policy, days)
        _observer_cost(events, rows, health, days)
        if not PHILLY.exists():
            print("philly: trace not available, skipped")
            return
        window = ("2017-10-01", "2017-10-08") if quick else ("2017-10-01", "2017-12-01")
        for scale in (0.25,) if quick else (1.0, 0.25):
            out = Path(tmp) / f"philly{scale}"
            import_philly(PHILLY, out, date_from=window[0], date_to=window[1], capacity_scale=scale)
            events = load_cluster(out / "cluster.toml").events
            rows, _ = read_trace(out / "trace.csv")
            pdays = 7 if quick else 61
            _run(f"philly x{scale}", events, rows, [], "budget", pdays)


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
