"""Both runtimes, the agent's processes and the emulator's timers, are driven by
the same reconcile (core/reconcile.py through services/executor_port.py): from
one history they hold the same runs, and when the history ends one, both let
it go."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from apportion.core import reconcile as pure
from apportion.schemas.events import WorkloadCancelled
from apportion.services import agent_runs, executor_port, logs
from apportion.services.agent_process import ProcessRuntime
from apportion.services.bus import MemoryLog
from apportion.services.canonical import Follower
from apportion.services.executor import SimulatedRuntime
from apportion.services.metrics import ExecutorMetrics
from apportion.services.scheduler import Scheduler
from services_helpers import small_cluster, submit


async def _decide(log: MemoryLog, scheduler: Scheduler) -> None:
    await scheduler.recover()
    await scheduler.cycle()


async def _follow(log: MemoryLog, follower: Follower, ledger: pure.Ledger) -> None:
    while follower.reader.batches_done < await log.last_batch_seq():
        for item, rejected in await follower.poll_folded(0.05):
            ledger(item, follower.state, rejected)


async def test_the_process_and_the_simulated_runtime_follow_one_reconcile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str | None, pure.Plan]] = []

    def spy(*args, **kw):
        plan = pure.reconcile(*args, **kw)
        calls.append((kw["host"], plan))
        return plan

    monkeypatch.setattr(executor_port, "reconcile", spy)
    launched: list[tuple[str, int, dict[str, str]]] = []
    signals: list[tuple[str, int]] = []
    monkeypatch.setattr(
        agent_runs,
        "launch",
        lambda run, argv, env, cwd, fence=None: launched.append((run.workload, run.rank, env)),
    )
    monkeypatch.setattr(agent_runs, "check", lambda run: None)  # no supervisor: never exits
    monkeypatch.setattr(agent_runs, "send", lambda run, sig: signals.append((run.workload, sig)))

    log = MemoryLog()
    await log.publish_inputs(small_cluster(nodes=3))
    await log.publish_inputs(
        [submit("w1", gpus=4, duration_ms=3_600_000), submit("g", gpus=16, owner="llm/b")]
    )
    scheduler = Scheduler(log)
    await _decide(log, scheduler)
    follower, ledger = Follower(log), pure.Ledger()
    await _follow(log, follower, ledger)
    state = follower.state
    assert set(state.running) == {"w1", "g"}
    hosts = sorted(state.nodes)

    ended: list[tuple[str, int]] = []
    sim = SimulatedRuntime(
        state,
        clock=lambda: state.now_ms,
        speedup=1.0,
        metrics=ExecutorMetrics(),
        logger=logs.get("test"),
        on_end=ended.append,
    )
    procs = {
        h: ProcessRuntime(
            node=h,
            gpus=8,
            root=tmp_path / h,
            checkpoint_root=tmp_path / "ckpt",
            addr=f"10.0.0.{i}",
            peers={x: f"10.0.0.{j}" for j, x in enumerate(hosts)},
            logger=logs.get("test"),
            clock=lambda: state.now_ms,
        )
        for i, h in enumerate(hosts)
    }
    ledgers = {h: pure.Ledger([h]) for h in hosts}

    async def reconcile_all() -> None:
        """Each agent keeps a ledger of its own host (the same history); then the
        emulator and every agent run the one reconcile."""
        for h in hosts:
            f = Follower(log)
            await _follow(log, f, ledgers[h])
            await f.close()
        await executor_port.reconcile_once(sim, state, ledger, state.now_ms)
        for h in hosts:
            await executor_port.reconcile_once(procs[h], state, ledgers[h], state.now_ms)

    await reconcile_all()
    assert [host for host, _ in calls] == [None, *hosts]
    # the emulator holds each run once; the agents hold one rank of it per host
    assert {k for k, _ in sim.held()} == {("w1", 1), ("g", 1)}
    by_rank = {(r.workload, r.rank, h) for h in hosts for r in procs[h].runs.values()}
    for wid in ("w1", "g"):
        w = state.running[wid]
        assert {(x, rank, h) for x, rank, h in by_rank if x == wid} == {
            (wid, rank, s.node) for rank, s in enumerate(w.placement)
        }
        assert sim.runs[(wid, 1)].run.node == w.placement[0].node  # its first host
    assert sorted((w, r) for w, r, _ in launched) == sorted(
        (r.workload, r.rank) for p in procs.values() for r in p.runs.values()
    )
    g0 = next(env for w, r, env in launched if w == "g" and r == 0)
    assert g0["WORLD_SIZE"] == "2" and g0["MASTER_ADDR"] == procs[g0["APPORTION_NODE"]].addr
    assert sim.timers == 1  # w1 has a duration, g runs until stopped

    # the history ends w1: both runtimes let it go, by the same plan
    calls.clear()
    await log.publish_input(WorkloadCancelled(id="cancel-w1", at_ms=0, workload="w1", actor="ops"))
    await _decide(log, scheduler)
    await _follow(log, follower, ledger)
    await reconcile_all()
    w1_host = next(h for h in hosts if ("w1", 1) in procs[h].runs)
    gone = {host: plan.gone for host, plan in calls}
    assert gone[None] == gone[w1_host] == (("w1", 1),)
    assert {k for k, _ in sim.held()} == {("g", 1)} and sim.timers == 0
    # no notice in the policy: SIGTERM and SIGKILL at once
    assert signals == [("w1", signal.SIGTERM), ("w1", signal.SIGKILL)]
    stop = next(s for host, plan in calls if host == w1_host for s in plan.stop)
    assert stop.ended and stop.reason == "ended"
    assert procs[w1_host].runs[("w1", 1)].killed
    assert not any(plan.start for _, plan in calls)
    await follower.close()
