"""The gateway: an HTTP JSON API in front of the event log (aiohttp).

It keeps its own folded state (a :class:`~apportion.services.canonical.Follower`
of the canonical history), validates requests with the same schemas and
``core.state.submission_error`` the fold uses, answers 4xx with
``{"error": reason}``, and publishes inputs with ``Nats-Msg-Id``. Its state
trails the scheduler by one cycle, so a request validated here may still be
rejected by the scheduler (an ``InputRejected`` decision) when two requests race.

| method | path | body / answer |
|---|---|---|
| POST | ``/v1/workloads`` | submit: ``{"owner","gpus","min_runtime_ms",...}`` -> 202 ``{"workload","seq","duplicate"}`` |
| POST | ``/v1/workloads/{id}/cancel`` | -> 202 |
| GET | ``/v1/workloads/{id}`` | the workload's status |
| GET | ``/v1/queue`` | pending in order with position and sort-key ratios; running |
| GET | ``/v1/share`` | budget tree with usage against allocation (``sshare``) |
| GET | ``/v1/explain/{id}`` | why pending / preempted / ended |
| GET | ``/v1/budget`` | the budget tree |
| POST | ``/v1/budget`` | ``{"actor","set":[{"path","weight","owner"}],"remove":[paths]}`` |
| GET | ``/v1/status`` | positions of the gateway's view |
| GET | ``/openapi.json`` | this API as OpenAPI 3.1 |
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec
from aiohttp import web
from apportion.core.state import State, apply, submission_error
from apportion.schemas.events import (
    ANY_GPU_TYPE,
    BudgetRemoved,
    BudgetSet,
    WorkloadCancelled,
    WorkloadSubmitted,
)

from . import logs
from .bus import EventLog
from .canonical import Follower
from .views import History, budget_tree, explain, queue_view, workload_json


class SubmitRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    owner: str
    gpus: int
    min_runtime_ms: int
    id: str | None = None
    duration_ms: int | None = None
    priority: int = 0
    resumable: bool = True
    gpu_type: str = ANY_GPU_TYPE
    submitted_by: str = ""


class CancelRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    actor: str = ""


class BudgetNodeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    path: str
    weight: int
    owner: str


class BudgetRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    actor: str
    set: list[BudgetNodeRequest] = msgspec.field(default_factory=list)
    remove: list[str] = msgspec.field(default_factory=list)


def _error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status)


async def _body(request: web.Request, type_: Any) -> Any:
    data = await request.read()
    try:
        return msgspec.json.decode(data or b"{}", type=type_)
    except msgspec.ValidationError as exc:
        raise web.HTTPBadRequest(
            text=msgspec.json.encode({"error": f"invalid request: {exc}"}).decode(),
            content_type="application/json",
        ) from None
    except msgspec.DecodeError as exc:
        raise web.HTTPBadRequest(
            text=msgspec.json.encode({"error": f"request body is not JSON: {exc}"}).decode(),
            content_type="application/json",
        ) from None


class Gateway:
    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.follower = Follower(log)
        self.history = History()
        self.logger = logs.get("gateway", cluster=log.subjects.cluster)
        self.url: str | None = None
        self.ready = asyncio.Event()
        self.app = web.Application()
        r = self.app.router
        r.add_post("/v1/workloads", self.submit)
        r.add_get("/v1/workloads/{id}", self.get_workload)
        r.add_post("/v1/workloads/{id}/cancel", self.cancel)
        r.add_get("/v1/queue", self.queue)
        r.add_get("/v1/share", self.share)
        r.add_get("/v1/explain/{id}", self.explain)
        r.add_get("/v1/budget", self.get_budget)
        r.add_post("/v1/budget", self.post_budget)
        r.add_get("/v1/status", self.status)
        r.add_get("/openapi.json", self.openapi)

    @property
    def state(self) -> State:
        return self.follower.state

    async def follow(self, stop: asyncio.Event) -> None:
        """Keep the view up to date until ``stop``."""
        try:
            while not stop.is_set():
                items = await self.follower.poll(0.2)
                self.history.record(items)
        finally:
            await self.follower.close()

    async def serve(self, stop: asyncio.Event, host: str = "127.0.0.1", port: int = 0) -> None:
        """Serve HTTP and follow the log until ``stop``; sets :attr:`url` once listening."""
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        server = site._server  # noqa: SLF001 - aiohttp exposes the bound port only here
        sockets = getattr(server, "sockets", None)  # an asyncio.Server once started
        bound = sockets[0].getsockname()[1] if sockets else port
        self.url = f"http://{host}:{bound}"
        self.ready.set()
        self.logger.info("listening", url=self.url)
        try:
            await self.follow(stop)
        finally:
            await runner.cleanup()

    # -- handlers -------------------------------------------------------
    async def submit(self, request: web.Request) -> web.Response:
        body: SubmitRequest = await _body(request, SubmitRequest)
        workload = body.id or f"w-{uuid.uuid4().hex[:12]}"
        event = WorkloadSubmitted(
            id=f"submit-{workload}",
            at_ms=self.state.now_ms,
            workload=workload,
            owner=body.owner,
            gpus=body.gpus,
            min_runtime_ms=body.min_runtime_ms,
            gpu_type=body.gpu_type,
            resumable=body.resumable,
            priority=body.priority,
            submitted_by=body.submitted_by,
            duration_ms=body.duration_ms,
        )
        problem = submission_error(self.state, event)
        if problem:
            return _error(409 if "already exists" in problem else 400, problem)
        ack = await self.log.publish_input(event)
        self.logger.info("submitted", workload=workload, seq=ack.seq, duplicate=ack.duplicate)
        return web.json_response(
            {"workload": workload, "seq": ack.seq, "duplicate": ack.duplicate}, status=202
        )

    async def cancel(self, request: web.Request) -> web.Response:
        workload = request.match_info["id"]
        body: CancelRequest = await _body(request, CancelRequest)
        status = self.state.status_of(workload)
        if status is None:
            return _error(404, f"unknown workload {workload!r}")
        if workload not in self.state.workloads:
            return _error(409, f"workload {workload!r} already ended as {status}")
        ack = await self.log.publish_input(
            WorkloadCancelled(
                id=f"cancel-{workload}",
                at_ms=self.state.now_ms,
                workload=workload,
                actor=body.actor,
            )
        )
        return web.json_response(
            {"workload": workload, "seq": ack.seq, "duplicate": ack.duplicate}, status=202
        )

    async def get_workload(self, request: web.Request) -> web.Response:
        workload = request.match_info["id"]
        w = self.state.workloads.get(workload)
        if w is not None:
            return web.json_response(workload_json(w))
        status = self.state.ended.get(workload) or (
            "rejected" if workload in self.history.rejected else None
        )
        if status is None:
            return _error(404, f"unknown workload {workload!r}")
        return web.json_response({"workload": workload, "status": status})

    async def queue(self, request: web.Request) -> web.Response:
        return web.json_response(queue_view(self.state))

    async def share(self, request: web.Request) -> web.Response:
        return web.json_response(budget_tree(self.state, detail=True))

    async def explain(self, request: web.Request) -> web.Response:
        workload = request.match_info["id"]
        out = explain(self.state, self.history, workload)
        if out is None:
            return _error(404, f"unknown workload {workload!r}")
        return web.json_response(out)

    async def get_budget(self, request: web.Request) -> web.Response:
        return web.json_response(budget_tree(self.state))

    async def post_budget(self, request: web.Request) -> web.Response:
        body: BudgetRequest = await _body(request, BudgetRequest)
        trial = self.state.copy()
        events: list[Any] = []
        for n in body.set:
            events.append(
                BudgetSet(
                    id=f"budget-{uuid.uuid4().hex}",
                    at_ms=trial.now_ms,
                    path=n.path,
                    weight=n.weight,
                    owner=n.owner,
                    actor=body.actor,
                )
            )
        for path in body.remove:
            events.append(
                BudgetRemoved(
                    id=f"budget-{uuid.uuid4().hex}", at_ms=trial.now_ms, path=path, actor=body.actor
                )
            )
        if not events:
            return _error(400, "nothing to change: give 'set' and/or 'remove'")
        for e in events:
            apply(trial, e)
            if trial.rejections:
                return _error(
                    403 if "does not own" in trial.rejections[-1][1] else 400,
                    trial.rejections[-1][1],
                )
        acks = await self.log.publish_inputs(events)
        return web.json_response({"published": len(acks), "last_seq": acks[-1].seq}, status=202)

    async def status(self, request: web.Request) -> web.Response:
        r = self.follower.reader
        return web.json_response(
            {
                "cluster": self.log.subjects.cluster,
                "input_seq": self.state.input_seq,
                "batches": r.batches_done,
                "now_ms": self.state.now_ms,
                "nodes": len(self.state.nodes),
                "pending": len(self.state.pending),
                "running": len(self.state.running),
            }
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 for the gateway; request schemas come from the msgspec Structs."""
    (submit, cancel, budget), components = msgspec.json.schema_components(
        [SubmitRequest, CancelRequest, BudgetRequest], ref_template="#/components/schemas/{name}"
    )
    err = {
        "description": "error",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    components["Error"] = {
        "type": "object",
        "properties": {"error": {"type": "string"}},
        "required": ["error"],
    }
    ok = {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}
    accepted = {
        "description": "published to INPUTS",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
    wid = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]

    def body(schema: dict[str, Any]) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": schema}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "apportion gateway", "version": "1"},
        "paths": {
            "/v1/workloads": {
                "post": {
                    "summary": "Submit a workload",
                    "requestBody": body(submit),
                    "responses": {"202": accepted, "400": err, "409": err},
                }
            },
            "/v1/workloads/{id}": {
                "get": {
                    "summary": "A workload's status",
                    "parameters": wid,
                    "responses": {"200": ok, "404": err},
                }
            },
            "/v1/workloads/{id}/cancel": {
                "post": {
                    "summary": "Cancel a workload",
                    "parameters": wid,
                    "requestBody": body(cancel),
                    "responses": {"202": accepted, "404": err, "409": err},
                }
            },
            "/v1/queue": {
                "get": {
                    "summary": "Pending workloads in order, with sort-key ratios; running ones",
                    "responses": {"200": ok},
                }
            },
            "/v1/share": {
                "get": {
                    "summary": "Budget tree with usage against allocation (like sshare)",
                    "responses": {"200": ok},
                }
            },
            "/v1/explain/{id}": {
                "get": {
                    "summary": "Why a workload is pending, running, preempted or ended",
                    "parameters": wid,
                    "responses": {"200": ok, "404": err},
                }
            },
            "/v1/budget": {
                "get": {"summary": "The budget tree", "responses": {"200": ok}},
                "post": {
                    "summary": "Set and remove budget nodes",
                    "requestBody": body(budget),
                    "responses": {"202": accepted, "400": err, "403": err},
                },
            },
            "/v1/status": {
                "get": {"summary": "Positions of the gateway's view", "responses": {"200": ok}}
            },
        },
        "components": {"schemas": components},
    }
