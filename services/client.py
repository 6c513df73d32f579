"""The gateway's client: :class:`GatewayClient` talks HTTP to the gateway (the CLI
uses it; standard library only). Services that publish inputs straight onto the
log (executors, health monitors) use :class:`apportion.services.bus.EventLog`
with the events of :mod:`apportion.core.commands`.

:class:`GatewayClient` sends a bearer token (``Authorization: Bearer ...``): the
one given, else the first of ``$APPORTION_TOKEN``, ``$APPORTION_TOKEN_FILE``,
``~/.config/apportion/token`` and ``.apportion/credentials/admin.token`` (see
:func:`apportion.services.auth.client_token`). A gateway answers 401 without one.

Every event id is deterministic where a retry must not duplicate
(``submit-<workload>``, ``cancel-<workload>``, ``finished-<workload>-<attempt>``),
so a publish retried after a lost acknowledgement is stored once.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from .auth import TOKEN_ENV, TOKEN_FILE_ENV, client_token
from .bus import TIMEOUT_ENV, client_timeout_s

DEFAULT_URL = "http://127.0.0.1:8642"
URL_ENV = "APPORTION_URL"


NOT_AUTHENTICATED_HINT = (
    f"set {TOKEN_ENV} or {TOKEN_FILE_ENV}, or pass --token-file FILE "
    "(apportion up prints where its tokens are; apportion auth issue makes one)"
)


class GatewayError(Exception):
    """The gateway answered 4xx/5xx (``reason`` is its ``error``) or could not be reached.

    ``status`` is ``None`` when no answer came (``sent``: the request may have
    reached the gateway, as when it timed out); ``retried`` says an earlier
    attempt of the same request got no acknowledgement (504), so it may be stored."""

    def __init__(self, reason: str, status: int | None = None, sent: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.sent = sent
        self.retried = False


def new_workload_id() -> str:
    """A fresh workload id, made by the client so that a retried submit is stored once."""
    return f"w-{uuid.uuid4().hex[:12]}"


RETRY_PAUSE_S = 0.5


class GatewayClient:
    """Blocking HTTP client for the gateway. URL: argument, else ``$APPORTION_URL``, else :data:`DEFAULT_URL`.

    Every call ends within ``timeout`` seconds (argument, else ``$APPORTION_TIMEOUT``,
    else 10). A submit or cancel that the gateway answers 504 (NATS did not
    acknowledge the publish) is sent again, with the same workload id, until it
    is acknowledged or the time is up; a submit without an id gets one here.

    ``token`` is the bearer token to send; ``None`` looks for one as
    :func:`~apportion.services.auth.client_token` does (``token_file`` first),
    and a token file that cannot be read raises ``ValueError``. With no token at
    all, requests go without one (fine for a gateway run with ``--no-auth``).
    A 401 is a :class:`GatewayError` with ``status`` 401 whose reason says how
    to give a token."""

    def __init__(
        self,
        url: str | None = None,
        timeout: float | None = None,
        token: str | None = None,
        token_file: str | Path | None = None,
    ) -> None:
        self.url = (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        self.timeout = client_timeout_s() if timeout is None else timeout
        if token is None:
            token, self.token_source = client_token(token_file)
        else:
            self.token_source = "the token given"
        self.token = token

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _once(self, method: str, path: str, data: bytes | None, timeout: float) -> Any:
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers=self._headers()
        )
        late = (
            f"no answer from the gateway at {self.url} within {self.timeout:g} s "
            f"({TIMEOUT_ENV}=SECONDS or --timeout waits longer)"
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            try:
                reason = json.loads(exc.read()).get("error") or exc.reason
            except (ValueError, AttributeError, OSError):
                reason = str(exc.reason)
            if exc.code == 401:
                reason = self._unauthenticated(str(reason))
            raise GatewayError(str(reason), exc.code) from None
        except (TimeoutError, ConnectionResetError, http.client.HTTPException):
            raise GatewayError(late, sent=True) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise GatewayError(late, sent=True) from None
            raise GatewayError(
                f"cannot reach the gateway at {self.url} ({reason}); is `apportion up` running? "
                f"(set {URL_ENV} or --url)"
            ) from None
        try:
            return json.loads(raw or b"null")
        except ValueError:
            raise GatewayError(
                f"{self.url} did not answer JSON; is it an apportion gateway? (set {URL_ENV} or --url)"
            ) from None

    def _unauthenticated(self, reason: str) -> str:
        """One line for a 401: the gateway's reason, what was sent, how to fix it."""
        reason = reason.removeprefix("not authenticated: ")
        sent = f"sent the token from {self.token_source}" if self.token else "sent no token"
        return f"not authenticated: {reason} ({sent}); {NOT_AUTHENTICATED_HINT}"

    def _call(self, method: str, path: str, body: Any = None, retry: bool = False) -> Any:
        """One request; with ``retry``, sent again after a 504 while time is left."""
        data = json.dumps(body).encode() if body is not None else None
        deadline = time.monotonic() + self.timeout
        retried = False
        while True:
            try:
                return self._once(method, path, data, max(0.1, deadline - time.monotonic()))
            except GatewayError as exc:
                exc.retried = retried
                if not (retry and exc.status == 504):
                    raise
                if time.monotonic() + RETRY_PAUSE_S >= deadline:
                    raise
            retried = True
            time.sleep(RETRY_PAUSE_S)

    def submit(self, **fields: Any) -> dict[str, Any]:
        """Submit; ``fields["id"]`` is made here when not given (see :func:`new_workload_id`).

        If a retry after a 504 finds the id taken, the earlier attempt was stored:
        the answer is then ``{"workload": id, "seq": None, "duplicate": True}``."""
        body = {k: v for k, v in fields.items() if v is not None}
        body.setdefault("id", new_workload_id())
        try:
            return self._call("POST", "/v1/workloads", body, retry=True)
        except GatewayError as exc:
            if exc.retried and exc.status == 409 and "already exists" in exc.reason:
                return {"workload": body["id"], "seq": None, "duplicate": True}
            raise

    def cancel(self, workload: str, actor: str = "") -> dict[str, Any]:
        """Cancel; a retry after a 504 that finds it cancelled means the earlier attempt was stored."""
        path = f"/v1/workloads/{urllib.parse.quote(workload, safe='')}/cancel"
        try:
            return self._call("POST", path, {"actor": actor}, retry=True)
        except GatewayError as exc:
            if exc.retried and exc.status == 409 and "as cancelled" in exc.reason:
                return {"workload": workload, "seq": None, "duplicate": True}
            raise

    def hold(self, workload: str, actor: str = "", release: bool = False) -> dict[str, Any]:
        """Hold (``release``: release) a workload. A retry after a 504 that finds it
        already held (released) means the earlier attempt was stored."""
        what = "release" if release else "hold"
        path = f"/v1/workloads/{urllib.parse.quote(workload, safe='')}/{what}"
        try:
            return self._call("POST", path, {"actor": actor}, retry=True)
        except GatewayError as exc:
            done = "not held" if release else "already held"
            if exc.retried and exc.status == 409 and done in exc.reason:
                return {"workload": workload, "seq": None, "duplicate": True}
            raise

    def workload(self, workload: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/workloads/{urllib.parse.quote(workload, safe='')}")

    def _query(self, path: str, query: dict[str, str | int | None]) -> Any:
        """``GET path`` with the query parameters given (``None``: left out)."""
        params = {k: str(v) for k, v in query.items() if v is not None}
        suffix = "?" + urllib.parse.urlencode(params) if params else ""
        return self._call("GET", path + suffix)

    def queue(self, **query: str | None) -> dict[str, Any]:
        """``GET /v1/queue`` with the filters given (``user``, ``team``, ``state``,
        ``gpu_type``; ``None``: left out)."""
        return self._query("/v1/queue", dict(query))

    def share(self) -> dict[str, Any]:
        return self._call("GET", "/v1/share")

    def explain(self, workload: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/explain/{urllib.parse.quote(workload, safe='')}")

    def jobs(self, **query: str | int | None) -> dict[str, Any]:
        """``GET /v1/jobs`` with the query parameters given (``None``: left out)."""
        return self._query("/v1/jobs", query)

    def report(self, **query: str | None) -> dict[str, Any]:
        """``GET /v1/report`` (``since``, ``until``, ``by``, ``team``; ``None``: left out)."""
        return self._query("/v1/report", dict(query))

    def nodes(self, state: str | None = None) -> dict[str, Any]:
        """``GET /v1/nodes`` (``state``: only hosts in that health state)."""
        suffix = "?" + urllib.parse.urlencode({"state": state}) if state is not None else ""
        return self._call("GET", "/v1/nodes" + suffix)

    def node_health(
        self, node: str, state: str, reason: str = "", actor: str = ""
    ) -> dict[str, Any]:
        """Drain (``draining``), undrain (``healthy``) or take down (``down``) ``node``.
        Retried after a 504; a retry that finds the host already in ``state`` means the
        earlier attempt was stored (``{"node", "state", "seq": None, "duplicate": True}``)."""
        path = f"/v1/nodes/{urllib.parse.quote(node, safe='')}/health"
        body: dict[str, Any] = {"state": state}
        if reason:
            body["reason"] = reason
        if actor:
            body["actor"] = actor
        try:
            return self._call("POST", path, body, retry=True)
        except GatewayError as exc:
            if exc.retried and exc.status == 409 and "(no change)" in exc.reason:
                return {"node": node, "state": state, "seq": None, "duplicate": True}
            raise

    def logs(
        self,
        workload: str,
        attempt: int | None = None,
        node: str | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        """``GET /v1/logs/{id}``: an attempt's output from byte ``offset`` on."""
        params = {"attempt": attempt, "node": node, "from": offset or None}
        query = {k: str(v) for k, v in params.items() if v is not None}
        suffix = "?" + urllib.parse.urlencode(query) if query else ""
        return self._call("GET", f"/v1/logs/{urllib.parse.quote(workload, safe='')}" + suffix)

    def budget(self) -> dict[str, Any]:
        return self._call("GET", "/v1/budget")

    def budget_apply(
        self, actor: str, set_: list[dict[str, Any]], remove: list[str]
    ) -> dict[str, Any]:
        return self._call("POST", "/v1/budget", {"actor": actor, "set": set_, "remove": remove})

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")
