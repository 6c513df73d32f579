"""The named fragmentation scenario: a 256-GPU job in a cluster kept busy by small jobs.

48 nodes x 8 GPUs. Teams ``small1`` and ``small2`` submit three small jobs a
minute between them (1, 2, 4 or 8 GPUs, 30 min minimum runtime, 40-50 min
long): more than the cluster holds, so every GPU that frees up is taken at
once. At 1 h, team ``train`` (no usage, so it outranks both small teams
clearly) submits a 256-GPU job (32 whole nodes, 2 h minimum runtime).

Without reservations the big job needs 32 nodes whose every job is past its
protection at the same moment, which small jobs placed on freed GPUs keep from
happening. With reservations the cycle holds the 32 nodes that become
preemptible earliest and lets small jobs use them only if they will be
preemptible by then, so the big job starts when the reservation does.
"""

from __future__ import annotations

from apportion.core.cycle import step
from apportion.schemas.events import WorkloadPlaced, WorkloadSubmitted

from .builders import HOUR, MIN, Cluster, drive

BIG = "train-256"


def fragmentation_scenario(reservations: bool, hours: int = 8) -> int | None:
    """Wait of the 256-GPU job in ms, or ``None`` if it never started within ``hours``."""
    cluster = (
        Cluster()
        .team("train", 1)
        .team("small1", 1)
        .team("small2", 1)
        .nodes(48)
        .policy(reservations=reservations)
    )
    state = cluster.state()
    step(state)
    inputs = []
    durations: dict[str, int] = {}
    sizes = (1, 2, 4, 8, 2, 1, 4)
    k = 0
    for minute in range(hours * 60):
        for j in range(3):
            wid = f"s{k}"
            team = "small1" if k % 2 == 0 else "small2"
            inputs.append(
                WorkloadSubmitted(
                    id=f"sub-{wid}",
                    at_ms=minute * MIN + j * 1000,
                    workload=wid,
                    owner=team,
                    gpus=sizes[k % len(sizes)],
                    min_runtime_ms=30 * MIN,
                    submitted_by="root",
                )
            )
            durations[wid] = (40 + (k * 7) % 11) * MIN
            k += 1
    inputs.append(
        WorkloadSubmitted(
            id="sub-big",
            at_ms=HOUR,
            workload=BIG,
            owner="train",
            gpus=256,
            min_runtime_ms=2 * HOUR,
            submitted_by="root",
        )
    )
    durations[BIG] = 4 * HOUR
    log = drive(state, inputs, durations, until_ms=hours * HOUR)
    for at, d in log:
        if isinstance(d, WorkloadPlaced) and d.workload == BIG:
            return at - HOUR
    return None
