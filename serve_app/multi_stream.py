"""Several text-to-speech contexts on one WebSocket, in ElevenLabs' multi-stream-input messages
(what LiveKit Agents' and Pipecat's ElevenLabs plugins speak; docs/serving.md).

``WS /v1/text-to-speech/{voice_id}/multi-stream-input?output_format=pcm_24000``:

* client -> server, each with an optional ``context_id`` (absent: the context ``"default"``):
  ``{"text": "...", "context_id": "a", "voice_settings": {...}}`` (a context's first message opens
  it; ``voice_settings.speed`` is read there), ``{"text": "...", "flush": true}`` or
  ``{"context_id": "a", "flush": true}`` (speak everything sent so far), ``{"text": ""}`` (a
  keep-alive, with or without a context), ``{"context_id": "a", "close_context": true}``,
  ``{"close_socket": true}``;
* server -> client: ``{"audio": "<base64>", "isFinal": false, "alignment": {...},
  "normalizedAlignment": {...}, "contextId": "a"}`` (as stream-input's), then ``{"isFinal": true, "contextId": "a"}``
  when a context ends; errors as ``{"error", "message", "code", "request_id"}`` (with
  ``contextId`` when one context failed: the others go on).

Each context is one bistream speaker of serve_app/stream_input.py (its own LLM sequences, turns
and encoder); contexts run side by side. ``close_context`` is barge-in: what the context was told
to flush before is still spoken (then ``isFinal``), text sent after the last flush is dropped, and
a context with nothing flushed stops at once: its synthesis call is cancelled, which aborts its
sequence and frees its decode slot, and ``isFinal`` follows. ``close_socket`` closes every context
that way, then the socket (1000).

Bounded as stream-input: one admission turn per socket, ``MAX_SESSION_CHARS`` of text per
socket, ``MAX_CONTEXTS`` open contexts (ElevenLabs' own limit) and twice that speaking (closed
ones finishing their flushed text included), and the inactivity timeout
(query ``inactivity_timeout``, default 20 s; larger values are cut to 180 s, since LiveKit asks
for 300): it closes an idle socket, but not while a context still speaks flushed text. Flushed
text whose audio stalls for the ingress's ``stream_idle_timeout_s`` (serve_app/progress.py) ends
its context with an ``audio_timeout`` error message (``code`` 1011, with its ``contextId``).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from cosyvoice_runtime.frontend.voice_id import VOICE_ID_RULE, is_voice_id
from deployments.protocol import CosyVoiceError, InvalidInputError, OverloadedError
from serve_app.elevenlabs import DEFAULT_OUTPUT_FORMAT, OutputFormat, parse_output_format
from serve_app.errors import classify, elevenlabs_ws_error, message_of
from serve_app.pronunciation import spec_of_message
from serve_app.stream_input import (
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_TRY_AGAIN,
    FLUSH,
    MAX_SESSION_CHARS,
    InactivityTimeout,
    StreamInputSession,
    inactivity_timeout,
    speed_of,
)

logger = logging.getLogger(__name__)

ROUTE = "/v1/text-to-speech/{voice_id}/multi-stream-input"
MAX_CONTEXTS = 5
MAX_CONTEXT_ID_CHARS = 128
DEFAULT_CONTEXT = "default"


def route(ingress: Any) -> WebSocketRoute:
    """The route, served by ``ingress`` (a ``serve_app.ingress.TTSIngress``, not imported: a cycle)
    as its stream-input sessions are: voice aliases, in-flight count."""
    async def endpoint(websocket: WebSocket) -> None:
        await ingress.stream_input(websocket, MultiStreamSession)

    return WebSocketRoute(ROUTE, endpoint)


class _Context(StreamInputSession):
    """One context: a bistream speaker whose messages carry its context id."""

    def __init__(self, session: MultiStreamSession, context_id: str, n: int, speed: float) -> None:
        super().__init__(session.ws, session.frontend, session.synth, session.voice_id, session.on_served)
        self.session, self.context_id, self.speed = session, context_id, speed
        self.progress = session.progress  # the ingress's audio-progress timeout (serve_app/progress.py)
        self.rid = f"{session.rid}-c{n}"
        self.flushes_queued = 0  # FLUSH items in the queue, not yet read by the speaker
        self.flushing = False  # the speaker is speaking the rest of a flushed turn
        self.task: asyncio.Task | None = None

    @property
    def busy(self) -> bool:
        """Flushed text is still to be spoken (the inactivity timeout waits for it)."""
        return self.flushing or self.flushes_queued > 0

    async def _next_fragment(self, turn):
        self.flushing = False  # the item before this one is done
        item = await super()._next_fragment(turn)
        if item is FLUSH:
            self.flushes_queued -= 1
            self.flushing = True
        return item

    def feed(self, text: str, flush: bool) -> None:
        if text:
            self.segments.put_nowait(text)
        if flush:
            self.flushes_queued += 1
            self.segments.put_nowait(FLUSH)

    def close(self) -> bool:
        """End the context: True when flushed text is still to be spoken (the speaker ends after
        it, text queued after the last flush is dropped); False when nothing was flushed (the
        caller cancels the speaker)."""
        if not self.busy:
            return False
        items = []
        while not self.segments.empty():
            items.append(self.segments.get_nowait())
        last_flush = max((i for i, x in enumerate(items) if x is FLUSH), default=-1)
        for x in items[:last_flush + 1]:
            self.segments.put_nowait(x)
        self.segments.put_nowait(None)
        return True

    async def _send_audio(self, data: bytes, alignment: dict | None = None, normalized: dict | None = None) -> None:
        if data:
            await self.session.send({"audio": base64.b64encode(data).decode(), "isFinal": False,
                                     "normalizedAlignment": normalized, "alignment": alignment,
                                     "contextId": self.context_id})


class MultiStreamSession(StreamInputSession):
    """One socket: its messages routed to contexts, each speaking in its own task."""

    def __init__(self, ws: WebSocket, frontend: Any, synth: Any, voice_id: str,
                 on_served: Callable[[float], None] | None = None) -> None:
        super().__init__(ws, frontend, synth, voice_id, on_served)
        self.contexts: dict[str, _Context] = {}  # open contexts by id
        self.closing: set[_Context] = set()  # closed ones still speaking what was flushed
        self.opened = 0
        self._send_lock = asyncio.Lock()  # one message at a time from the context tasks

    async def send(self, message: dict) -> None:
        async with self._send_lock:
            await self.ws.send_json(message)

    async def run(self) -> None:
        ws = self.ws
        await ws.accept()
        try:
            fmt = parse_output_format(ws.query_params.get("output_format", DEFAULT_OUTPUT_FORMAT))
            timeout = inactivity_timeout(ws.query_params.get("inactivity_timeout"), clamp=True)
            if not is_voice_id(self.voice_id):
                raise InvalidInputError(f"invalid voice_id {self.voice_id!r}: use {VOICE_ID_RULE}")
            while True:
                try:
                    msg = await self._receive(timeout)
                except InactivityTimeout:
                    if self.closing or any(ctx.busy for ctx in self.contexts.values()):
                        continue
                    raise
                if msg.get("close_socket"):
                    for cid in list(self.contexts):
                        await self.close_context(cid)
                    await asyncio.gather(*(ctx.task for ctx in list(self.closing)), return_exceptions=True)
                    await ws.close(CLOSE_NORMAL)
                    return
                await self._route(msg, fmt)
        except WebSocketDisconnect:
            logger.info("multi-stream-input %s: client closed the socket", self.rid)
        except Exception as exc:  # noqa: BLE001 - answered on the socket in the one error shape
            await self._fail(exc)
        finally:
            for ctx in [*self.contexts.values(), *self.closing]:  # cancels their synthesis: slots are freed
                await _cancel(ctx)

    async def _route(self, msg: dict, fmt: OutputFormat) -> None:
        cid = msg.get("context_id", DEFAULT_CONTEXT)
        if not isinstance(cid, str) or not 0 < len(cid) <= MAX_CONTEXT_ID_CHARS:
            raise InvalidInputError(f"context_id must be a string of 1 to {MAX_CONTEXT_ID_CHARS} characters")
        if msg.get("close_context"):
            await self.close_context(cid)
            return
        text, flush = msg.get("text", ""), bool(msg.get("flush"))
        if not isinstance(text, str):
            raise InvalidInputError("'text' must be a string")
        ctx = self.contexts.get(cid)
        if ctx is None:
            if not text and not flush:
                return  # a keep-alive
            if len(self.contexts) >= MAX_CONTEXTS or len(self.contexts) + len(self.closing) >= 2 * MAX_CONTEXTS:
                await self.send(elevenlabs_ws_error(self.rid, f"at most {MAX_CONTEXTS} open contexts per socket: "
                                                    "close one first", "invalid_request_error",
                                                    "max_active_conversations", CLOSE_POLICY, cid))
                return
            spec = spec_of_message(msg)  # this context's aliases (malformed ones fail the socket, as bad JSON does)
            ctx = self.contexts[cid] = _Context(self, cid, self.opened, speed_of(msg))
            ctx.pronunciation = spec
            self.opened += 1
            ctx.task = asyncio.create_task(self._speak(ctx, fmt))
        self.chars += len(text)
        if self.chars > MAX_SESSION_CHARS:
            raise InvalidInputError(f"more than {MAX_SESSION_CHARS} characters of text in one session")
        ctx.feed(text, flush)

    async def close_context(self, cid: str) -> None:
        """Barge-in (module docstring); ``isFinal`` is sent either way. Unknown ids are ignored."""
        ctx = self.contexts.pop(cid, None)
        if ctx is None:
            return
        if ctx.close():  # its speaker sends isFinal when done; the id may name a new context meanwhile
            self.closing.add(ctx)
            return
        await _cancel(ctx)
        await self.send({"isFinal": True, "contextId": cid})

    async def _speak(self, ctx: _Context, fmt: OutputFormat) -> None:
        try:
            await ctx._bistream_all(fmt)
            await self.send({"isFinal": True, "contextId": ctx.context_id})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - this context failed; the others go on
            with contextlib.suppress(Exception):  # the client may be gone
                await self.send(self._error(exc, ctx.rid, ctx.context_id))
        finally:
            _forget(ctx)

    def _error(self, exc: BaseException, rid: str, context_id: str | None = None) -> dict:
        status, type_, code, _ = classify(exc)
        close = CLOSE_TRY_AGAIN if isinstance(exc, OverloadedError) else CLOSE_POLICY if status < 500 else CLOSE_INTERNAL
        if status >= 500 and not isinstance(exc, CosyVoiceError):
            logger.error("multi-stream-input %s failed: %s", rid, type(exc).__name__, exc_info=exc)
            return elevenlabs_ws_error(rid, f"internal error (request id {rid})", "server_error", None, close,
                                       context_id)
        return elevenlabs_ws_error(rid, message_of(exc), type_, code, close, context_id)

    async def _fail(self, exc: BaseException) -> None:
        body = self._error(exc, self.rid)
        with contextlib.suppress(Exception):  # the client may be gone already
            await self.send(body)
            await self.ws.close(body["code"])


async def _cancel(ctx: _Context) -> None:
    """Stop a context's speaker now: its synthesis call is cancelled (the sequence is aborted)."""
    if ctx.task is not None and not ctx.task.done():
        ctx.task.cancel()
        with contextlib.suppress(BaseException):
            await ctx.task
    _forget(ctx)


def _forget(ctx: _Context) -> None:
    session = ctx.session
    session.closing.discard(ctx)
    if session.contexts.get(ctx.context_id) is ctx:
        del session.contexts[ctx.context_id]


