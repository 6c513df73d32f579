from __future__ import annotations

from .builders import HOUR
from .fragmentation import fragmentation_scenario


def test_a_256_gpu_job_gets_placed_among_small_jobs_only_with_reservations():
    with_reservations = fragmentation_scenario(reservations=True, hours=6)
    without = fragmentation_scenario(reservations=False, hours=6)
    assert (
        with_reservations is not None and with_reservations <= HOUR
    )  # small jobs are protected 30 min
    assert without is None or without > 2 * with_reservations
