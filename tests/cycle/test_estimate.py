"""Start-time estimates (core/estimate.py): pure, and equal to what the simulator does
when nothing new arrives."""

from __future__ import annotations

import random

from apportion.core.cycle import decide, step
from apportion.core.estimate import estimate_starts
from apportion.replay.simulator import run_simulation
from apportion.replay.trace import TraceRow
from apportion.schemas.events import WorkloadPlaced
from apportion.schemas.history import BatchItem, InputItem

from .builders import HOUR, MIN, Cluster, submit, tick


def test_pending_behind_a_protected_job_starts_at_the_protection_expiry():
    s = Cluster().team("a", 1).team("b", 1).nodes(1).state()
    submit(s, "p", "a", 8, 2 * HOUR)  # no duration: only its protection is known
    step(s)
    tick(s, 30 * MIN)
    submit(s, "q", "b", 8, HOUR)
    result = step(s)
    assert set(s.pending) == {"q"}
    digest = s.digest()
    est = estimate_starts(s, next_wakeup_ms=result.next_wakeup_ms)
    assert est.starts == {"q": 2 * HOUR}  # b outranks a once p's protection ends
    assert s.digest() == digest  # the state is not changed


def test_a_known_end_frees_the_gpus_and_unknown_ends_give_no_estimate():
    s = Cluster().team("a", 1).team("b", 1).nodes(1).state()
    submit(s, "p", "a", 8, 2 * HOUR, duration_ms=HOUR)
    submit(s, "q", "a", 8, 2 * HOUR)  # same team: may not preempt p; then runs without an end
    submit(s, "r", "a", 8, 2 * HOUR)
    step(s)
    est = estimate_starts(s, next_wakeup_ms=decide(s).next_wakeup_ms)
    assert est.ends == {"p": HOUR}
    assert est.starts == {"q": HOUR}  # ahead of r (ids); then q runs forever
    assert "r" not in est.starts and est.exhausted
    assert "not known" in est.why_unknown("r")


def test_a_state_no_cycle_has_seen_is_decided_first():
    s = Cluster().team("a", 1).nodes(1).state()
    submit(s, "x", "a", 4, HOUR)
    assert estimate_starts(s, decided=False).starts == {"x": 0}


def _simulate_and_estimate(seed: int):
    rng = random.Random(seed)
    setup = Cluster().team("a", 3).team("b", 2).team("c", 1)
    setup.nodes(3).nodes(1, gpu_type="a100", prefix="m")
    rows = []
    for i in range(30):
        gpus = rng.choice([1, 2, 4, 8, 8, 16])
        rows.append(
            TraceRow(
                id=f"w{i}",
                submit_ms=rng.randrange(0, 20 * MIN),
                owner=rng.choice("abc"),
                gpus=gpus,
                duration_ms=rng.randrange(5 * MIN, 3 * HOUR),
                min_runtime_ms=rng.choice([0, 10 * MIN, HOUR, 2 * HOUR]),
                gpu_type="a100" if gpus <= 8 and rng.random() < 0.2 else "any",
            )
        )
    last_submit = max(r.submit_ms for r in rows)
    estimate = {}
    first = {}
    seen = {"last_input_at": -1}

    def observer(item, state, _rejected):
        if isinstance(item, InputItem):
            seen["last_input_at"] = item.at_ms
            return
        for d in item.batch.decisions:
            if isinstance(d, WorkloadPlaced) and estimate:  # placed after the estimate
                first.setdefault(d.workload, d.at_ms)
        if (
            isinstance(item, BatchItem)
            and seen["last_input_at"] == last_submit
            and not estimate
            and state.input_seq >= len(setup.events) + len(rows)
        ):
            est = estimate_starts(
                state, next_wakeup_ms=item.batch.next_wakeup_ms, max_cycles=10_000
            )
            estimate.update(est.starts)
            estimate["__pending"] = sorted(state.pending)

    run_simulation(setup.events, rows, end_ms=30 * 24 * HOUR, observer=observer)
    return estimate, first


def test_estimates_equal_the_simulated_starts_when_nothing_new_arrives():
    checked = 0
    for seed in range(5):
        estimate, first = _simulate_and_estimate(seed)
        pending = estimate.pop("__pending")
        assert pending, "the trace should leave work waiting"
        for wid in pending:
            assert estimate.get(wid) == first.get(wid), (seed, wid)
            checked += 1
    assert checked > 10


def test_explain_is_readable_and_gpu_type_aware():
    from apportion.services.views import History, explain, queue_view

    s = Cluster().team("a", 1).team("b", 1).nodes(1).nodes(1, gpu_type="a100", prefix="m").state()
    submit(s, "h", "a", 8, 2 * HOUR, gpu_type="h100")  # protected H100 work
    submit(s, "m", "a", 8, 2 * HOUR, gpu_type="a100", duration_ms=HOUR)
    step(s)
    tick(s, 10 * MIN)
    submit(s, "x", "b", 8, HOUR, gpu_type="a100")
    step(s)
    out = explain(s, History(), "x", now_ms=20 * MIN)
    text = "\n".join(out["reasons"])
    assert "h (" not in text and "(h)" not in text  # not told about the protected H100 job
    assert "on a100 nodes it could use are protected" in text and "(m on m002" in text
    assert "1970-01-01T02:00:00Z (in 1 h 40 min)" in text  # m's protection, relative to now
    assert "waiting 10 min" in text  # measured to now, not to the last event
    assert "% of its share" in text and "GPU-h" in text and "e+" not in text
    assert out["estimated_start_ms"] == HOUR  # m's known end frees the a100 node
    q = queue_view(s, now_ms=20 * MIN)
    assert [r["estimated_start_ms"] for r in q["pending"]] == [HOUR]
    assert q["pending"][0]["wait_ms"] == 10 * MIN
    assert {r["workload"]: r["expected_end_ms"] for r in q["running"]} == {"h": None, "m": HOUR}
