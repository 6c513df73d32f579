"""The executor port: what a runtime implements so that the one reconcile drives it.

The reconcile itself is pure (:mod:`apportion.core.reconcile`: the desired runs
per host from the folded history, and the plan against what a runtime holds).
A **runtime** is where runs actually run:

- :class:`~apportion.services.agent_process.ProcessRuntime`: real processes on
  one host (``apportion agent``), one rank per run placed there;
- :class:`~apportion.services.executor.SimulatedRuntime`: timers that end each
  run after its ``duration_ms`` (the executor emulator), every run once, as
  its first host;
- a later Slurm or Kubernetes runtime: job steps or pods.

:func:`reconcile_once` is the step every executor takes, as often as it likes
(the agent every 0.2 s, the emulator after each decision batch): probe the
runtime, ask the reconcile for the plan, stop what must stop, start what must
start. Reporting the end of a run goes through
:func:`apportion.core.reconcile.end_report` (whether) and :func:`finished`
(the event): one report per attempt, with the same id from every host.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Protocol

from apportion.core.reconcile import (
    DesiredRun,
    Ledger,
    Plan,
    RunKey,
    Stop,
    finished_id,
    outcome_of,
    reconcile,
)
from apportion.core.rules.authority import agent_of
from apportion.core.state import State
from apportion.schemas.events import WorkloadFinished


class Runtime(Protocol):
    """Where an executor's runs run (see the module doc)."""

    host: str | None
    """The host it runs (its rank of each run there), or ``None``: every run
    once, as the run's first host."""
    adopts_under_notice: bool
    """It may take over a run already under notice that it never started (its
    runs are a function of the history); a process runtime may not."""

    def held(self) -> Iterable[tuple[RunKey, bool]]:
        """``(run, ended)`` for each run it holds."""
        ...

    def done(self) -> Container[RunKey]:
        """Runs it must never start again (reported, or claimed before)."""
        ...

    def probe(self) -> None:
        """Learn which of its live runs ended (and how)."""
        ...

    async def launch(self, run: DesiredRun) -> bool:
        """Start ``run`` (``False``: not now, e.g. its GPUs are still held; asked again)."""
        ...

    async def stop(self, stop: Stop) -> None:
        """Give a live run its notice (again: idempotent; an earlier deadline wins)."""
        ...

    def gone(self, key: RunKey) -> None:
        """``key`` is no longer current (it was ended, preempted or requeued)."""
        ...


async def reconcile_once(runtime: Runtime, state: State, ledger: Ledger, now_ms: int) -> Plan:
    """One round of the reconcile on ``runtime``; returns the plan it carried out."""
    runtime.probe()
    plan = reconcile(
        state,
        ledger,
        host=runtime.host,
        held=list(runtime.held()),
        done=runtime.done(),
        now_ms=now_ms,
        adopts_under_notice=runtime.adopts_under_notice,
    )
    for stop in plan.stop:
        await runtime.stop(stop)
    for key in plan.gone:
        runtime.gone(key)
    for run in plan.start:
        await runtime.launch(run)
    return plan


def finished(
    key: RunKey,
    host: str,
    at_ms: int,
    exit_code: int | None = None,
    lost: bool = False,
    *,
    with_exit: bool = True,
) -> WorkloadFinished:
    """The end report of run ``key`` from ``host``'s executor (``agent:<host>``);
    ``with_exit=False``: without an outcome or exit code (the emulator's)."""
    if not with_exit:
        return WorkloadFinished(
            id=finished_id(key), at_ms=at_ms, workload=key[0], attempt=key[1], actor=agent_of(host)
        )
    return WorkloadFinished(
        id=finished_id(key),
        at_ms=at_ms,
        workload=key[0],
        attempt=key[1],
        outcome=outcome_of(exit_code, lost),
        actor=agent_of(host),
        exit_code=max(-255, min(255, exit_code)) if exit_code is not None else None,
    )
