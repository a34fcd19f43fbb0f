"""Pure ASGI middleware of the ingress app (no ``BaseHTTPMiddleware``: it would interfere with
streaming and disconnect propagation).

Order, outermost first (``TTSIngress.__serve_build_asgi_app__``):

1. :class:`TrailingSlash` rewrites ``/v1/voices/`` to ``/v1/voices`` (Starlette's own
   ``redirect_slashes`` is turned off: no route ever answers with a redirect);
2. :class:`RequestAccounting` fixes the request id and counts responses by route and status;
3. :class:`AdmissionControl` bounds the requests this replica works on and the ones waiting for
   that, answering the JSON 429 beyond; ``/health`` and ``/metrics`` are never held back. A
   WebSocket session holds one turn for its life and never waits for one; refused, it gets the JSON
   error as a message and close code 1013 (try again later).
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys

from starlette.requests import ClientDisconnect, HTTPConnection, Request

from serve_app.errors import elevenlabs_ws_error, error_body, error_response, request_id_of
from serve_app.metrics import IngressMetrics

logger = logging.getLogger(__name__)

ROUTES = ("/v1/audio/speech", "/v1/tts", "/v1/voices", "/v1/text-to-speech", "/health", "/metrics")
UNGATED = frozenset({"/health", "/metrics"})  # probes must answer while the replica is saturated
WS_TRY_AGAIN_LATER = 1013  # WebSocket close code: server overloaded, try again later


def route_path(scope) -> str:
    """The path below the app's mount point (Serve puts the route prefix in ``root_path``)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


class TrailingSlash:
    """``/v1/voices/`` is served as ``/v1/voices`` (and ``/health/`` as ``/health``).

    Only slashes that are literally in the request line are stripped (counted on ``raw_path``),
    so an encoded one (``/v1/voices/%2F``) stays part of the path and gets the JSON 404.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope = self._strip(scope)
        await self.app(scope, receive, send)

    @staticmethod
    def _strip(scope):
        path = scope.get("path", "")
        if len(route_path(scope)) <= 1 or not path.endswith("/"):
            return scope
        raw = scope.get("raw_path")
        if raw is not None:
            n = len(raw) - len(raw.rstrip(b"/"))
        else:
            n = len(path) - len(path.rstrip("/"))
        n = min(n, len(route_path(scope)) - 1)  # never strip the mount point's own "/"
        if n <= 0:
            return scope
        scope = dict(scope)
        scope["path"] = path[:-n]
        if raw is not None:
            scope["raw_path"] = raw[:-n]
        return scope


def _cancelled() -> bool:
    """The exception being handled means the client went away (a cancellation), not a failure."""
    return isinstance(sys.exc_info()[1], (asyncio.CancelledError, ClientDisconnect))


class RequestAccounting:
    """Fixes the request id once per request and counts responses by route and status.

    A response counts under the status it was sent with only once it is complete. A stream that
    breaks after its headers counts as ``500`` when the server failed it (an exception after
    ``http.response.start``, e.g. a replica fault mid-stream) and as ``499`` when the client went
    away first (nginx's "client closed request"), never as the ``200`` its headers said.
    """

    def __init__(self, app, metrics: IngressMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id_of(Request(scope))  # fixed once per request, read by routes and error handlers
        path = route_path(scope)
        route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")
        status = {"code": 500, "started": False, "complete": False}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                status["complete"] = True
            await send(message)

        failed = True
        try:
            await self.app(scope, receive, send_wrapper)
            failed = False
        finally:
            code = status["code"]
            if status["started"] and not status["complete"]:  # broken after its headers
                code = 500 if failed and not _cancelled() else 499
            self.metrics.requests.labels(route, str(code)).inc()
            if code >= 400:
                self.metrics.errors.labels(route, "client" if code < 500 else "server").inc()


class AdmissionControl:
    """At most ``max_running`` requests in progress and ``max_waiting`` waiting for a turn (FIFO);
    beyond that the JSON 429 with ``Retry-After`` at once.

    NOTE: this is the ingress's backpressure, not Serve's. Serve rejects a full ingress queue in
    its proxy, before any of our code runs, with a plain-text 429; the ingress deployment's Serve
    limits are therefore set above these (``TTSIngress.deployment_options``), so the proxy only
    ever hands requests to this replica and this class answers the overload. A request in
    progress holds its turn until its response (a whole audio stream) is sent or the client goes.
    """

    def __init__(self, app, max_running: int, max_waiting: int, retry_after_s: int) -> None:
        self.app = app
        self.max_running, self.max_waiting, self.retry_after_s = max_running, max_waiting, retry_after_s
        self.running = self.waiting = self.rejected = 0
        self._turns: asyncio.Semaphore | None = None  # created on the serving loop, at first use

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or route_path(scope) in UNGATED:
            await self.app(scope, receive, send)
            return
        if self._turns is None:
            self._turns = asyncio.Semaphore(self.max_running)
        turns = self._turns
        # A WebSocket session never waits for a turn (its client would hang in the handshake).
        if turns.locked() and (self.waiting >= self.max_waiting or scope["type"] == "websocket"):
            self.rejected += 1
            rid = request_id_of(HTTPConnection(scope))
            message = (f"server is at capacity ({self.max_running} requests in progress, {self.waiting} waiting); "
                       f"retry after {self.retry_after_s} s")
            path = route_path(scope)
            if scope["type"] == "websocket":
                body = (elevenlabs_ws_error(rid, message, "overloaded_error", "queue_full", WS_TRY_AGAIN_LATER)
                        if path.endswith("/multi-stream-input") else
                        error_body(rid, message, "overloaded_error", "queue_full"))
                await _refuse_websocket(receive, send, body)
                return
            response = error_response(rid, 429, message, "overloaded_error", "queue_full",
                                      {"Retry-After": str(self.retry_after_s)}, path=path)
            await response(scope, receive, send)
            return
        self.waiting += 1
        try:
            await turns.acquire()  # returns at once while a turn is free
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.running -= 1
            turns.release()


async def _refuse_websocket(receive, send, body: dict) -> None:
    """Accept, send the error shape as a text message, close with 1013 (a refusal before the
    accept would reach the client only as a bare HTTP 403)."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": json.dumps(body)})
    await send({"type": "websocket.close", "code": WS_TRY_AGAIN_LATER, "reason": "server is at capacity"})
