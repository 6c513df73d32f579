"""Write the golden logs of tests/golden/ (run once; the files are checked in).

    .venv/bin/python tests/golden/make_golden.py

- ``debug-budget-1d.jsonl``: ``apportion simulate --scenario debug --days 1`` (budget scheduler);
- ``debug-priority-1d.jsonl``: the same under the baseline priority policy;
- ``handmade.jsonl``: a small history built by hand and scheduled the way the
  live scheduler does (one cycle after each group of inputs, a ``ClockTicked``
  at each wake-up), exercising fair-share preemption, a reservation, a drain, a
  node going down, cancels, stale reports, an undecodable input and rejected
  inputs of several kinds.

Each ``NAME.jsonl`` gets ``NAME.digest``: the final state digest. Regenerating
must give the same bytes; if a deliberate change to the core alters them, the
audit test fails until the goldens are regenerated (and the change noted).
"""

from __future__ import annotations

import sys
from pathlib import Path

from apportion.core.cycle import decide
from apportion.core.history import decide_batch, fold_item
from apportion.core.state import State
from apportion.replay.cluster_file import cluster_from_dict
from apportion.replay.eventlog import Header, LogWriter
from apportion.replay.run import load_inputs
from apportion.replay.simulator import simulate
from apportion.schemas.events import (
    BudgetSet,
    ClockTicked,
    Input,
    NodeHealthChanged,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadSubmitted,
)
from apportion.schemas.history import BatchItem, InputItem, input_item

HERE = Path(__file__).resolve().parent
M = 60_000
H = 60 * M


def make_debug(policy: str, out: Path) -> str:
    """Exactly what ``apportion simulate --scenario debug --days 1 --policy POLICY --log OUT`` writes."""
    inp = load_inputs(None, None, None, 1, 1, "debug")
    w = LogWriter(out, Header(policy=policy, source="simulate"))
    result = simulate(inp.cluster_events, inp.trace, inp.health, policy=policy, days=1, sink=w)
    digest = result.state.digest()
    w.close(digest)
    return digest


def handmade_inputs() -> list[list[Input | InputItem]]:
    """Groups of inputs; the scheduler runs one cycle after each group."""
    cluster = cluster_from_dict(
        {
            "cluster": {
                "name": "hand",
                "pool": [{"prefix": "n", "count": 4, "gpus_per_node": 8, "gpu_type": "h100"}],
            },
            "policy": {"max_min_runtime": "4h", "preemption_margin": 0.05},
            "budget": {
                "owner": "ops",
                "a": {"weight": 1, "owner": "lead-a", "u1": {"weight": 1, "owner": "u1"}},
                "b": {"weight": 1, "owner": "lead-b", "u2": {"weight": 1, "owner": "u2"}},
            },
        }
    ).events

    def sub(wid, t, owner, gpus, min_rt, **kw):
        kw.setdefault("submitted_by", owner.rsplit("/", 1)[-1])  # the leaf's owner
        return WorkloadSubmitted(
            id=f"sub/{wid}",
            at_ms=t,
            workload=wid,
            owner=owner,
            gpus=gpus,
            min_runtime_ms=min_rt,
            **kw,
        )

    return [
        list(cluster),
        # team a fills the cluster: protected for 30 min, then preemptible
        [
            sub("a1", 1 * M, "a/u1", 16, 30 * M),
            sub("a2", 1 * M, "a/u1", 16, 30 * M, resumable=False),
        ],
        # free work queues behind; team b asks for 8 GPUs (must wait for a's protection)
        [sub("free1", 2 * M, "a/u1", 8, 0)],
        [sub("b1", 3 * M, "b/u2", 8, 2 * H)],
        # bad input: unknown owner, not a valid gang, over the min-runtime cap, budget edit by a non-owner
        [
            sub("bad-owner", 4 * M, "c/x", 8, H),
            sub("bad-gang", 4 * M, "b/u2", 12, H),
            sub("bad-cap", 4 * M, "b/u2", 8, 5 * H),
            BudgetSet(id="budget/steal", at_ms=4 * M, path="b", weight=9, owner="u1", actor="u1"),
            # no authority: a cancel of another team's work, a host speaking for another
            WorkloadCancelled(id="cancel/steal", at_ms=4 * M, workload="b1", actor="u1"),
            NodeHealthChanged(
                id="health/spoof", at_ms=4 * M, node="n001", state="down", actor="agent:n004"
            ),
            sub("bad-submitter", 4 * M, "b/u2", 8, H, submitted_by="u1"),
        ],
        # an undecodable input (as a live INPUTS stream can hold)
        [
            InputItem(
                seq=0, at_ms=5 * M, ref="seq:malformed", rejection="malformed input: invalid JSON"
            )
        ],
        # a whole-cluster job for b: cannot be placed, gets a reservation; a short free job may still run
        [sub("b-big", 6 * M, "b/u2", 32, H)],
        # a cancel of pending work, a stale finish of work that never ran
        [
            WorkloadCancelled(id="cancel/free1", at_ms=10 * M, workload="free1", actor="u1"),
            WorkloadFinished(id="fin/ghost", at_ms=10 * M, workload="ghost", actor="ops"),
        ],
        [sub("a3", 40 * M, "a/u1", 8, 15 * M)],
        # a drain, then a node down
        [
            NodeHealthChanged(
                id="health/n003/draining", at_ms=50 * M, node="n003", state="draining", actor="ops"
            )
        ],
        # free work on the now empty n002, lost when the node goes down (requeued), later preempted
        [sub("free3", 52 * M, "a/u1", 8, 0)],
        [
            NodeHealthChanged(
                id="health/n002/down", at_ms=70 * M, node="n002", state="down", actor="agent:n002"
            )
        ],
        [
            WorkloadFinished(
                id="fin/b1", at_ms=2 * H + 31 * M, workload="b1", attempt=1, actor="ops"
            ),
            WorkloadFinished(id="fin/b1-again", at_ms=2 * H + 31 * M, workload="b1", actor="ops"),
        ],
        [
            NodeHealthChanged(
                id="health/n002/healthy", at_ms=3 * H, node="n002", state="healthy", actor="ops"
            ),
            NodeHealthChanged(
                id="health/n003/healthy", at_ms=3 * H, node="n003", state="healthy", actor="ops"
            ),
            NodeHealthChanged(
                id="health/n009/down", at_ms=3 * H, node="n009", state="down", actor="ops"
            ),
        ],
        [sub("free2", 3 * H + M, "b/u2", 4, 0), sub("b2", 3 * H + 2 * M, "b/u2", 8, 20 * M)],
    ]


def make_handmade(out: Path, end_ms: int = 6 * H) -> tuple[str, dict[str, int]]:
    """Schedule the groups like the live scheduler; return the digest and what happened."""
    state = State()
    w = LogWriter(out, Header(policy="budget", source="handmade", cluster="hand"))
    seen: dict[str, int] = {}

    batches = 0

    def fold(ev) -> None:
        seq = state.input_seq + 1
        if isinstance(ev, InputItem):  # an undecodable input, numbered here
            item = InputItem(seq=seq, at_ms=ev.at_ms, ref=ev.ref, rejection=ev.rejection)
        else:
            item = input_item(seq, ev)
        fold_item(state, item)
        w.add(item)

    def cycle() -> int | None:
        nonlocal batches
        result = decide(state, report_reservation=True)
        if result.reservation is not None:
            seen["reservation"] = seen.get("reservation", 0) + 1
        batch, plain = decide_batch(state)
        assert plain.decisions == result.decisions and plain.next_wakeup_ms == result.next_wakeup_ms
        batches += 1
        fold_item(state, BatchItem(seq=batches, batch=batch))
        for d in batch.decisions:
            key = type(d).__name__ + (
                f":{d.reason}"
                if hasattr(d, "reason") and type(d).__name__ != "InputRejected"
                else ""
            )
            seen[key] = seen.get(key, 0) + 1
        w.add(BatchItem(seq=batches, batch=batch))
        return batch.next_wakeup_ms

    groups = handmade_inputs()
    wake: int | None = None
    for group in groups:
        t = group[0].at_ms
        while wake is not None and state.now_ms < wake < t:
            fold(ClockTicked(id=f"tick-{state.input_seq}-{wake}", at_ms=wake))
            wake = cycle()
        for ev in group:
            fold(ev)
        wake = cycle()
    while wake is not None and state.now_ms < wake < end_ms:
        fold(ClockTicked(id=f"tick-{state.input_seq}-{wake}", at_ms=wake))
        wake = cycle()
    fold(ClockTicked(id=f"tick-{state.input_seq}-{end_ms}", at_ms=end_ms))
    wake = cycle()
    digest = state.digest()
    w.close(digest)
    return digest, seen


def main() -> None:
    for name, make in (
        ("debug-budget-1d", lambda p: make_debug("budget", p)),
        ("debug-priority-1d", lambda p: make_debug("priority", p)),
        ("handmade", lambda p: make_handmade(p)[0]),
    ):
        path = HERE / f"{name}.jsonl"
        digest = make(path)
        (HERE / f"{name}.digest").write_text(digest + "\n")
        print(
            f"wrote {path.name} ({sum(1 for _ in path.open())} lines), digest {digest[:16]}",
            file=sys.stderr,
        )
    _, seen = make_handmade(HERE / "handmade.jsonl")
    print("handmade:", dict(sorted(seen.items())), file=sys.stderr)
    wanted = (
        "InputRejected",
        "NodeDrained",
        "WorkloadPlaced",
        "WorkloadPreempted:drain",
        "WorkloadPreempted:fairshare",
        "WorkloadPreempted:node_down",
        "WorkloadPreempted:unallocated",
        "reservation",
    )
    missing = [k for k in wanted if not seen.get(k)]
    if missing:
        raise SystemExit(
            f"handmade history no longer exercises {missing}: adjust handmade_inputs()"
        )


if __name__ == "__main__":
    main()
