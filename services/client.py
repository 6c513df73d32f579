"""Clients: :class:`EventClient` publishes input events straight onto the log
(for services: executors, health monitors, job front ends); :class:`GatewayClient`
talks HTTP to the gateway (the CLI uses it; standard library only).

Every event id is deterministic where a retry must not duplicate
(``submit-<workload>``, ``cancel-<workload>``, ``finished-<workload>-<attempt>``),
so a publish retried after a lost acknowledgement is stored once.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

from apportion.schemas.events import (
    ANY_GPU_TYPE,
    HealthState,
    NodeHealthChanged,
    NodeRegistered,
    Outcome,
    WorkloadCancelled,
    WorkloadFinished,
    WorkloadSubmitted,
)

from .bus import EventLog, PublishResult

DEFAULT_URL = "http://127.0.0.1:8642"
URL_ENV = "APPORTION_URL"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class EventClient:
    """Publish inputs directly (``at_ms`` is informative: the log's ingestion time is what counts)."""

    def __init__(self, log: EventLog) -> None:
        self.log = log

    async def submit(
        self,
        workload: str,
        owner: str,
        gpus: int,
        min_runtime_ms: int,
        *,
        duration_ms: int | None = None,
        priority: int = 0,
        resumable: bool = True,
        gpu_type: str = ANY_GPU_TYPE,
        submitted_by: str = "",
    ) -> PublishResult:
        return await self.log.publish_input(
            WorkloadSubmitted(
                id=f"submit-{workload}",
                at_ms=_now_ms(),
                workload=workload,
                owner=owner,
                gpus=gpus,
                min_runtime_ms=min_runtime_ms,
                duration_ms=duration_ms,
                priority=priority,
                resumable=resumable,
                gpu_type=gpu_type,
                submitted_by=submitted_by,
            )
        )

    async def cancel(self, workload: str, actor: str = "") -> PublishResult:
        return await self.log.publish_input(
            WorkloadCancelled(
                id=f"cancel-{workload}", at_ms=_now_ms(), workload=workload, actor=actor
            )
        )

    async def finished(
        self, workload: str, attempt: int | None, outcome: Outcome = "succeeded"
    ) -> PublishResult:
        return await self.log.publish_input(
            WorkloadFinished(
                id=f"finished-{workload}-{attempt}",
                at_ms=_now_ms(),
                workload=workload,
                attempt=attempt,
                outcome=outcome,
            )
        )

    async def node_registered(self, node: str, gpus: int, gpu_type: str) -> PublishResult:
        return await self.log.publish_input(
            NodeRegistered(
                id=f"node-{node}-{uuid.uuid4().hex[:8]}",
                at_ms=_now_ms(),
                node=node,
                gpus=gpus,
                gpu_type=gpu_type,
            )
        )

    async def node_health(self, node: str, state: HealthState) -> PublishResult:
        return await self.log.publish_input(
            NodeHealthChanged(
                id=f"health-{node}-{uuid.uuid4().hex[:8]}", at_ms=_now_ms(), node=node, state=state
            )
        )


class GatewayError(Exception):
    """The gateway answered 4xx/5xx (``reason`` is its ``error``) or could not be reached."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class GatewayClient:
    """Blocking HTTP client for the gateway. URL: argument, else ``$APPORTION_URL``, else :data:`DEFAULT_URL`."""

    def __init__(self, url: str | None = None, timeout: float = 10.0) -> None:
        self.url = (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                reason = json.loads(exc.read()).get("error") or exc.reason
            except (ValueError, AttributeError):
                reason = str(exc.reason)
            raise GatewayError(str(reason), exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise GatewayError(
                f"cannot reach the gateway at {self.url} ({reason}); is `apportion up` running? "
                f"(set {URL_ENV} or --url)"
            ) from None

    def submit(self, **fields: Any) -> dict[str, Any]:
        return self._call(
            "POST", "/v1/workloads", {k: v for k, v in fields.items() if v is not None}
        )

    def cancel(self, workload: str, actor: str = "") -> dict[str, Any]:
        return self._call("POST", f"/v1/workloads/{workload}/cancel", {"actor": actor})

    def workload(self, workload: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/workloads/{workload}")

    def queue(self) -> dict[str, Any]:
        return self._call("GET", "/v1/queue")

    def share(self) -> dict[str, Any]:
        return self._call("GET", "/v1/share")

    def explain(self, workload: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/explain/{workload}")

    def budget(self) -> dict[str, Any]:
        return self._call("GET", "/v1/budget")

    def budget_apply(
        self, actor: str, set_: list[dict[str, Any]], remove: list[str]
    ) -> dict[str, Any]:
        return self._call("POST", "/v1/budget", {"actor": actor, "set": set_, "remove": remove})

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")
