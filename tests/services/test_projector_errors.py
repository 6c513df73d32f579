"""An event the projection cannot apply never stops the live projector (issue 25:
one ``KeyError`` in the projection became a restart loop with a stale file).

On a real nats-server, with a real scheduler: a projection file whose rows
disagree with its history (a pending workload's row is gone, as a projection
that misread a history would have it) is resumed; the workload's placement
cannot be projected. The projector logs it with its position and the error,
counts it, records it in ``projection_errors``, and goes on: it reaches the end
of the streams, later events are projected, and the file is still the exact
history (its events fold to the projector's state).
"""

from __future__ import annotations

from pathlib import Path

from apportion.core.history import fold_history
from apportion.replay.eventlog import read_duckdb
from apportion.schemas.events import WorkloadFinished
from apportion.services.bus import JetStreamLog
from apportion.services.projector import Projector, open_projection
from apportion.services.scheduler import Scheduler
from services_helpers import eventually, small_cluster, submit
from structlog.testing import capture_logs
from test_services import running

LINE = "could not project an event; recorded in projection_errors, going on"


async def test_an_event_the_projection_cannot_apply_is_recorded_and_the_projector_goes_on(
    jlog: JetStreamLog,
    tmp_path: Path,
    oplog: JetStreamLog,
    projlog: JetStreamLog,
) -> None:
    path = tmp_path / "live.duckdb"
    await oplog.publish_inputs(
        [*small_cluster(nodes=1), submit("w1", gpus=8), submit("w2", gpus=8)]
    )
    last = await jlog.last_input_seq()
    first = Projector(projlog, open_projection(path))
    async with running(Scheduler(jlog), first):
        await eventually(lambda: first.position[0] >= last, what="projector caught up")
    assert first.state.status_of("w1") == "running" and first.state.status_of("w2") == "pending"
    con = first.projection.con
    con.execute("DELETE FROM workloads WHERE workload = 'w2'")  # the rows disagree with history
    con.close()

    # w1 ends: the scheduler places w2, which the projection no longer knows; then w3 waits
    await oplog.publish_inputs(
        [
            WorkloadFinished(id="done-w1", at_ms=0, workload="w1", actor="ops"),
            submit("w3", gpus=8),
        ]
    )
    last = await jlog.last_input_seq()
    projector = Projector(projlog, open_projection(path))
    with capture_logs() as captured:
        async with running(Scheduler(jlog), projector):  # re-raises if the projector died
            await eventually(
                lambda: (
                    projector.position[0] >= last and projector.state.status_of("w2") == "running"
                ),
                what="projector past the event it could not apply",
            )
    assert projector.state.status_of("w3") == "pending"

    faults = [c for c in captured if c["event"] == LINE]
    assert len(faults) == 1
    fault = faults[0]
    assert fault["log_level"] == "error" and fault["service"] == "projector"
    assert (fault["kind"], fault["workload"], fault["error"]) == (
        "WorkloadPlaced",
        "w2",
        "KeyError: 'w2'",
    )
    assert fault["pos"] > 0 and fault["input_seq"] >= last - 1
    assert b"apportion_projector_errors_total 1.0" in projector.metrics.render()

    con = projector.projection.con
    assert con.execute(
        "SELECT pos, input_seq, batch, kind, workload, error FROM projection_errors"
    ).fetchall() == [
        (fault["pos"], fault["input_seq"], fault["batch"], "WorkloadPlaced", "w2", "KeyError: 'w2'")
    ]
    # its batch is based on the input the fault names; the event keeps its events row
    assert con.execute(
        "SELECT basis FROM batches WHERE batch = ?", [fault["batch"]]
    ).fetchall() == [(fault["input_seq"],)]
    assert con.execute(
        "SELECT kind, workload FROM events WHERE pos = ?", [fault["pos"]]
    ).fetchall() == [("WorkloadPlaced", "w2")]
    assert con.execute(
        "SELECT workload, status FROM workloads WHERE workload IN ('w1', 'w3') ORDER BY workload"
    ).fetchall() == [("w1", "succeeded"), ("w3", "pending")]
    con.close()
    # the file is still the whole history, exactly
    assert fold_history(read_duckdb(path)).digest() == projector.state.digest()
