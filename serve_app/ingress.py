"""HTTP ingress deployment: Starlette routes over the frontend and synthesizer handles.

Routes (docs/serving.md has examples):

* ``POST /v1/audio/speech``  OpenAI-compatible speech: streamed by default in every format, SSE,
  speed 0.25-4.0, voice aliases (serve_app/speech.py); ``instructions`` -> instruct
* ``WS /v1/text-to-speech/{voice_id}/stream-input``  text in pieces, audio out (serve_app/stream_input.py)
* ``WS /v1/text-to-speech/{voice_id}/multi-stream-input``  contexts on one socket (serve_app/multi_stream.py)
* ``POST /v1/text-to-speech/{voice_id}[/stream][/with-timestamps]``  ElevenLabs-compatible
  (serve_app/elevenlabs_http.py)
* ``POST /v1/tts``           native: zero-shot (multipart prompt upload), voice, cross-lingual, instruct
* ``POST /v1/voices`` (multipart), ``GET /v1/voices``, ``GET/DELETE /v1/voices/{voice_id}``
* ``/v1/pronunciation-dictionaries...``: ElevenLabs-shaped dictionary CRUD (serve_app/pronunciation.py)
* ``GET /health`` (cached status; ``?detail=1`` the live probe, serve_app/health.py), ``GET /metrics``
* ``GET /playground`` (and ``/``): the browser playground and its files (serve_app/playground.py)

Only this package knows HTTP, status codes and containers; the deployments get typed messages.
Limits answered with the JSON error shape: bodies past ``max_upload_bytes`` (413, before the rest
is read), more than ``max_ongoing_requests`` in progress plus ``max_queued_requests`` waiting in
this replica (429, :class:`~serve_app.middleware.AdmissionControl`); ``/v1/voices/`` is served
as ``/v1/voices`` (no redirects).
Streaming responses fetch the first chunk before sending headers, so errors found while
preparing (unknown voice, bad prompt) still get their 4xx; after that, a client disconnect
cancels the handle generator, which aborts the sequence in the synthesizer replica. Whole
(unstreamed) responses read the same stream and join it here (:meth:`TTSIngress.synthesize_whole`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, field_validator
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from cosyvoice_runtime.frontend.voice_id import VOICE_ID_RULE, is_voice_id
from deployments.options import DeploymentKnobs
from deployments.protocol import (
    AudioChunk,
    PayloadTooLargeError,
    SynthesisMode,
    SynthesisRequest,
    SynthesisResult,
    VoiceInfo,
)
from deployments.python_gc import settle_replica
from serve_app import elevenlabs_http, multi_stream, playground, pronunciation
from serve_app.audio_codec import MEDIA_TYPES, check_format, decode_upload, run_encoder
from serve_app.auth import AuthConfig, auth_middleware, voice_access
from serve_app.errors import ApiError, error_body, install_exception_handlers, request_id_of
from serve_app.failover import DEFAULT_RETRIES, FailoverStream, StreamLostError
from serve_app.handles import admitted as _admitted
from serve_app.handles import cancel_stream as _cancel
from serve_app.health import HealthMonitor, wants_detail
from serve_app.metrics import CONTENT_TYPE, IngressMetrics
from serve_app.middleware import AdmissionControl, RequestAccounting, TrailingSlash
from serve_app.progress import DEFAULT_IDLE_S, AudioProgress, NoAudioError, WatchedStream
from serve_app.request_body import read_form, read_json
from serve_app.schemas import NativeSynthesisFields, SpeechRequest, VoiceFields, VoiceOut
from serve_app.speech import (
    AUDIO_SECONDS_HEADER,
    DEFAULT_MODEL_NAMES,
    DEFAULT_VOICE,
    OPENAI_VOICES,
    AudioOut,
    encode_whole,
    served_seconds,
    split_speed,
    sse_event,
)
from serve_app.stage_timing import NOT_STAGES, first_audio_stages, server_timing
from serve_app.stream_input import ROUTE as STREAM_INPUT_ROUTE
from serve_app.stream_input import StreamInputSession

logger = logging.getLogger(__name__)


# Serve's concurrency limit of an ingress replica, as a multiple of what the app admits or queues
# (the excess is room for the app's own fast 429s and for /health and /metrics, which are never held).
SERVE_HEADROOM = 2
MAX_LOGGED_FIELDS = 20  # unknown request fields named in the log, at most
EMPTY_STREAM_RATE = 24000  # rate named in the header of a stream that has no audio at all


class IngressConfig(DeploymentKnobs):
    """HTTP ingress replica: request limits."""

    max_input_chars: PositiveInt = 4096  # OpenAI's limit for `input`
    max_upload_bytes: PositiveInt = 10 * 1024 * 1024
    # Accepted `model` values of /v1/audio/speech (400 for others); empty = any.
    model_names: list[str] = Field(default_factory=lambda: list(DEFAULT_MODEL_NAMES))
    # Voice names resolved to registered voices before synthesis (OpenAI's built-in names -> "default").
    voice_aliases: dict[str, str] = Field(default_factory=lambda: dict.fromkeys(OPENAI_VOICES, DEFAULT_VOICE))
    health_timeout_s: float = Field(5.0, gt=0)
    # Continuations of a stream on another synthesizer replica when the one serving it dies
    # (serve_app/failover.py); 0: the stream ends with an error instead.
    stream_failover_retries: NonNegativeInt = DEFAULT_RETRIES
    # Longest wait for a synthesizer stream's next audio chunk, the first included, on every route,
    # whole answers too (HTTP 504 before the headers, a whole answer's at any point; after them an
    # SSE error event or an aborted body; WebSocket close 1011; a text-in turn's wait counts from the
    # end of its text). No limit on a request's total time (serve_app/progress.py, docs/serving.md).
    stream_idle_timeout_s: PositiveFloat = DEFAULT_IDLE_S
    # Pause between the background probes behind GET /health (its answer is at most this old).
    health_refresh_s: float = Field(5.0, gt=0)
    # Longest prompt upload decoded (413 from the file's header above it); None: frontend.max_prompt_audio_s.
    max_prompt_audio_s: PositiveFloat | None = None
    auth: AuthConfig = Field(default_factory=AuthConfig)  # API keys, open endpoints, CORS (serve_app/auth.py)


    @field_validator("voice_aliases")
    @classmethod
    def _aliases_name_voice_ids(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [f"{k}: {t}" for k, t in v.items() if not (is_voice_id(k) and is_voice_id(t))]
        if bad:
            raise ValueError(f"voice_aliases entries must be voice ids ({VOICE_ID_RULE}): {', '.join(bad)}")
        return v


def _voice_out(info: VoiceInfo) -> dict:
    return VoiceOut(voice_id=info.voice_id, prompt_text=info.prompt_text, family=info.family,
                    num_prompt_tokens=info.num_prompt_tokens).model_dump()


class TTSIngress:
    """Constructed by ``serve_app.app.build_app`` (wrapped with ``serve.ingress()``)."""

    def __init__(self, cfg: IngressConfig, frontend: Any, synthesizer: Any) -> None:
        self.cfg = cfg
        self.frontend = frontend
        self.synth = synthesizer
        self.metrics = IngressMetrics(gc_pauses=settle_replica(cfg.gc_freeze))
        self.progress = AudioProgress(cfg.stream_idle_timeout_s)  # every stream's (serve_app/progress.py)
        # One background task keeps /health's status (started here when Serve constructs the
        # replica on its loop, else by the first /health).
        self.health_monitor = HealthMonitor(synthesizer, frontend, cfg.health_timeout_s, cfg.health_refresh_s)
        self.health_monitor.start()

    # Serve calls this on the replica after __init__ (late-bound ASGI app).
    def __serve_build_asgi_app__(self) -> Starlette:
        routes = [
            Route("/v1/audio/speech", self.openai_speech, methods=["POST"]),
            Route("/v1/tts", self.native_tts, methods=["POST"]),
            Route("/v1/voices", self.register_voice, methods=["POST"]),
            Route("/v1/voices", self.list_voices, methods=["GET"]),
            Route("/v1/voices/{voice_id}", self.get_voice, methods=["GET"]),
            Route("/v1/voices/{voice_id}", self.delete_voice, methods=["DELETE"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            WebSocketRoute(STREAM_INPUT_ROUTE, self.stream_input),
            multi_stream.route(self),
            *elevenlabs_http.routes(self),
            *pronunciation.routes(self),
            *playground.routes(self.health_monitor.runtime_detail),
        ]
        cfg = self.cfg
        app = Starlette(routes=routes, middleware=[
            Middleware(TrailingSlash),
            Middleware(RequestAccounting, metrics=self.metrics),
            *auth_middleware(cfg.auth),  # before admission: a request without a valid key takes no slot
            Middleware(AdmissionControl, max_running=cfg.max_ongoing_requests, max_waiting=cfg.max_queued_requests,
                       retry_after_s=cfg.retry_after_s),
        ])
        app.router.redirect_slashes = False  # TrailingSlash serves "/v1/voices/"; nothing answers 307
        install_exception_handlers(app, cfg.retry_after_s)
        return app

    # ---------------------------------------------------------------- synthesis routes
    async def openai_speech(self, request: Request) -> Response:
        body = SpeechRequest.model_validate(await read_json(request, self.cfg.max_upload_bytes))
        rid = request_id_of(request)
        if body.unknown_fields:  # OpenAI ignores fields it does not know; so do we, visibly
            names = [name[:64] for name in body.unknown_fields[:MAX_LOGGED_FIELDS]]
            logger.info("request %s: ignored unknown fields %s", rid, ", ".join(names))
        if self.cfg.model_names and body.model not in self.cfg.model_names:
            raise ApiError(400, f"unknown model '{body.model}'; available: {', '.join(self.cfg.model_names)}",
                           code="model_not_found", param="model")
        self._check_text(body.input)
        check_format(body.response_format)
        instructions = (body.instructions or "").strip() or None
        mode = SynthesisMode.INSTRUCT if instructions else SynthesisMode.VOICE
        native_speed, tempo = split_speed(body.speed)
        sse = body.stream_format == "sse"
        streamed = body.stream or sse
        req = SynthesisRequest(request_id=rid, text=body.input, mode=mode, voice_id=self.resolve_voice(body.voice_id),
                               instruct_text=instructions, speed=native_speed,
                               stream=streamed and native_speed == 1.0, seed=body.seed, access=voice_access(request),
                               pronunciation=body.pronunciation())
        return await self._synthesize(req, body.response_format, streamed, tempo, sse)

    async def stream_input(self, websocket: WebSocket, session_cls: type = StreamInputSession) -> None:
        """Text in pieces, audio out as it is made (ElevenLabs' stream-input; serve_app/stream_input.py,
        or with ``session_cls`` its multi-stream-input, serve_app/multi_stream.py)."""
        voice = self.resolve_voice(websocket.path_params["voice_id"])
        self.metrics.in_flight.inc()
        try:
            session = session_cls(websocket, self.frontend, self.synth, voice, on_served=self.metrics.served.observe)
            session.failover_retries, session.progress = self.cfg.stream_failover_retries, self.progress
            await session.run()
        finally:
            self.metrics.in_flight.dec()

    def resolve_voice(self, voice_id: str) -> str:
        """A voice name as given by a client -> the registered voice id (``voice_aliases``)."""
        return self.cfg.voice_aliases.get(voice_id, voice_id)

    async def native_tts(self, request: Request) -> Response:
        audio = sr = None
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            fields, files = await read_form(request, self.cfg.max_upload_bytes, file_fields=("prompt_audio",))
            body = NativeSynthesisFields.model_validate(fields)
            if "prompt_audio" in files:
                audio, sr = await asyncio.to_thread(decode_upload, files["prompt_audio"], self.cfg.max_prompt_audio_s)
        else:
            body = NativeSynthesisFields.model_validate(await read_json(request, self.cfg.max_upload_bytes))
        self._check_text(body.text)
        check_format(body.response_format)
        native_speed, tempo = split_speed(body.speed)
        req = SynthesisRequest(request_id=request_id_of(request), text=body.text, mode=body.mode,
                               voice_id=body.voice_id, prompt_text=body.prompt_text, prompt_audio=audio,
                               prompt_sample_rate=sr, instruct_text=body.instruct_text, speed=native_speed,
                               stream=body.stream and native_speed == 1.0, seed=body.seed,
                               access=voice_access(request), pronunciation=body.pronunciation())
        return await self._synthesize(req, body.response_format, body.stream, tempo)

    async def _synthesize(self, req: SynthesisRequest, fmt: str, streamed: bool, tempo: float = 1.0,
                          sse: bool = False) -> Response:
        """Prepare, then a buffered body (Content-Length) or a chunked one as audio is made.

        ``req.stream`` selects chunked token2wav in the synthesizer; a streamed body without it
        (a speed other than 1) still leaves sentence by sentence.
        """
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        handed_to_stream = False  # from then on _stream_body's finally owns the in-flight count
        try:
            prepared = await _admitted(self.frontend.prepare.remote(req))
            prepared_at = time.perf_counter()
            if not streamed:
                result = await self.synthesize_whole(prepared)  # a stall: 504 before any header
                # a minute of MP3 takes ~0.3 s to encode: off the event loop
                data = await asyncio.to_thread(encode_whole, result.samples, result.sample_rate, fmt, tempo)
                served = served_seconds(len(result.samples), result.sample_rate, tempo)
                self._observe(started, prepared_at + result.time_to_first_audio_s, len(result.samples),
                              result.sample_rate, served)
                return Response(data, media_type=MEDIA_TYPES[fmt], headers={AUDIO_SECONDS_HEADER: f"{served:.3f}"})
            gen = self.open_stream(prepared)
            try:
                first = await _admitted(gen.__anext__())  # no audio in time: 504 (serve_app/errors.py)
            except StopAsyncIteration:
                first = None
            except BaseException:
                _cancel(gen)
                raise
            stages = first_audio_stages(started, prepared_at, time.perf_counter(), first)
            for name, ms in stages.items():
                if name not in NOT_STAGES:
                    self.metrics.stages.labels(name).observe(ms / 1e3)
            sample_rate = first.sample_rate if first is not None else EMPTY_STREAM_RATE
            try:  # opening an encoder is blocking work too (serve_app/audio_codec.py)
                out = await run_encoder(AudioOut, fmt, sample_rate, tempo=tempo, sse=sse,
                                        input_tokens=sum(len(p.text_ids) for p in prepared.pieces))
            except BaseException:
                _cancel(gen)
                raise
            handed_to_stream = True
        finally:
            if not handed_to_stream:
                self.metrics.in_flight.dec()
        return StreamingResponse(self._stream_body(gen, first, out, started, req.request_id),
                                 media_type=out.media_type, headers={"Server-Timing": server_timing(stages)})

    async def _stream_body(self, gen, first, out: AudioOut, started: float, rid: str):
        # Encoding (and SSE's base64) runs in the encoder pool: an MP3/Opus/AAC chunk costs
        # milliseconds of CPU, which on the event loop would delay every other stream.
        first_at = None
        try:
            if first is not None:
                first_at = time.perf_counter()
                if data := await run_encoder(out.feed, first.samples):
                    yield data
                while True:
                    try:
                        chunk = await gen.__anext__()
                    except StopAsyncIteration:
                        break
                    except (NoAudioError, StreamLostError) as exc:
                        # After the headers no status can change: SSE says why in an error event,
                        # a plain audio body is aborted (the client sees an incomplete response).
                        logger.warning("request %s: %s; stream ended", rid, exc)
                        if not out.sse:
                            raise
                        code = "audio_timeout" if isinstance(exc, NoAudioError) else "replica_lost"
                        yield sse_event({"type": "error", **error_body(rid, f"{exc}; stream ended", "server_error",
                                                                      code)})
                        return
                    if data := await run_encoder(out.feed, chunk.samples):
                        yield data
            if tail := await run_encoder(out.close):
                yield tail
            self._observe(started, first_at, out.model_samples, out.sample_rate, out.served_s)
        finally:
            # Disconnect / error: cancel the handle call so the replica aborts the sequence.
            _cancel(gen)
            self.metrics.in_flight.dec()

    def open_stream(self, prepared) -> WatchedStream:
        """The synthesizer's stream of ``prepared``: every HTTP route's and the handle API's one way
        to call it, so each is continued on another replica when its replica dies (serve_app/failover.py)
        and ends with :class:`NoAudioError` when its audio stalls (serve_app/progress.py). A progress
        timeout, not a total one: the work of one request is bounded by the input limits
        (``max_input_chars``, the frontend's ``max_pieces``)."""
        return self.progress.watch(FailoverStream(self.synth, prepared, self.cfg.stream_failover_retries,
                                                  self._failed_over))

    async def synthesize_whole(self, prepared) -> SynthesisResult:
        """``prepared``'s whole audio, read from :meth:`open_stream` and joined here, so a whole
        request has the streams' progress timeout (a long answer that keeps making audio is never
        cut) and failover; its samples cross once, a chunk a sentence piece unless ``prepared.stream``."""
        started = time.perf_counter()
        gen = self.open_stream(prepared)
        parts, first_s, sample_rate = [], None, EMPTY_STREAM_RATE
        try:
            while True:
                try:
                    chunk = await _admitted(gen.__anext__())
                except StopAsyncIteration:
                    break
                if first_s is None:
                    first_s = time.perf_counter() - started
                parts.append(chunk.samples)
                sample_rate = chunk.sample_rate
        finally:  # ended, failed or abandoned by its caller: the synthesizer's sequence is aborted
            gen.cancel()
        samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return SynthesisResult(request_id=prepared.request_id, samples=samples, sample_rate=sample_rate,
                               num_chunks=len(parts), time_to_first_audio_s=first_s or 0.0,
                               compute_s=time.perf_counter() - started)

    def _failed_over(self, outcome: str) -> None:
        self.metrics.failovers.labels(outcome).inc()

    def _observe(self, started: float, first_at: float | None, samples: int, sample_rate: int,
                 served_s: float) -> None:
        self.metrics.served.observe(served_s)
        if first_at is not None:
            self.metrics.ttfa.observe(first_at - started)
        if samples:
            self.metrics.rtf.observe((time.perf_counter() - started) / (samples / sample_rate))

    def _check_text(self, text: str) -> None:
        if len(text) > self.cfg.max_input_chars:
            raise PayloadTooLargeError(f"input is {len(text)} characters; the limit is {self.cfg.max_input_chars}")

    # ---------------------------------------------------------------- voices
    async def register_voice(self, request: Request) -> Response:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(415, "voice registration needs multipart/form-data with an 'audio' file",
                           code="unsupported_media_type")
        fields, files = await read_form(request, self.cfg.max_upload_bytes, file_fields=("audio",))
        body = VoiceFields.model_validate(fields)
        if "audio" not in files:
            raise ApiError(400, "missing the 'audio' file field", code="invalid_input")
        audio, sr = await asyncio.to_thread(decode_upload, files["audio"], self.cfg.max_prompt_audio_s)
        info = await _admitted(
            self.frontend.register_voice.remote(body.voice_id, body.prompt_text, audio, sr, body.overwrite,
                                                voice_access(request)))
        return JSONResponse(_voice_out(info), status_code=201)

    async def list_voices(self, request: Request) -> Response:
        infos = await _admitted(self.frontend.list_voices.remote(voice_access(request)))
        # aliases: voice names a request may use for a registered voice (OpenAI's built-in names)
        return JSONResponse({"voices": [_voice_out(i) for i in infos], "aliases": self.cfg.voice_aliases})

    async def get_voice(self, request: Request) -> Response:
        info = await _admitted(self.frontend.get_voice.remote(request.path_params["voice_id"], voice_access(request)))
        return JSONResponse(_voice_out(info))

    async def delete_voice(self, request: Request) -> Response:
        voice_id = request.path_params["voice_id"]
        await _admitted(self.frontend.delete_voice.remote(voice_id, voice_access(request)))
        return JSONResponse({"voice_id": voice_id, "deleted": True})

    # ---------------------------------------------------------------- Python (handle) API
    async def synthesize(self, req: SynthesisRequest) -> SynthesisResult:
        """The whole utterance, for other Serve apps: ``await app_handle.synthesize.remote(req)``;
        audio that stalls for ``stream_idle_timeout_s`` raises :class:`~serve_app.progress.NoAudioError`."""
        prepared = await _admitted(self.frontend.prepare.remote(req))
        return await self.synthesize_whole(prepared)

    async def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """Streaming synthesis: ``async for chunk in app_handle.options(stream=True).stream.remote(req)``.

        Cancelling the caller's generator (or ``.cancel()`` on it) aborts the sequence; a stream
        without audio for ``stream_idle_timeout_s`` raises :class:`~serve_app.progress.NoAudioError`.
        """
        prepared = await _admitted(self.frontend.prepare.remote(req))
        gen = self.open_stream(prepared)
        try:
            async for chunk in gen:
                yield chunk
        finally:
            gen.cancel()

    async def voices(self) -> list[VoiceInfo]:
        """Registered voices (``await app_handle.voices.remote()``)."""
        return await _admitted(self.frontend.list_voices.remote())

    # ---------------------------------------------------------------- health / metrics
    async def health(self, request: Request) -> Response:
        """Cached status for anyone; the live probe with ``?detail=1`` (serve_app/health.py; the
        auth middleware asks a key for the detail)."""
        if wants_detail(request.scope.get("query_string", b"")):
            body, status = await self.health_monitor.detail()
        else:
            body, status = self.health_monitor.summary()
        return JSONResponse(body, status_code=status)

    async def metrics_endpoint(self, request: Request) -> Response:
        try:
            snapshot = await asyncio.wait_for(self.synth.stats.remote(), self.cfg.health_timeout_s)
        except Exception:  # noqa: BLE001 - metrics must render even when the synthesizer is down
            logger.warning("synthesizer stats unavailable for /metrics")
            snapshot = None
        return Response(self.metrics.render(snapshot), media_type=CONTENT_TYPE)

    @classmethod
    def deployment_options(cls, cfg: IngressConfig) -> dict[str, Any]:
        """Serve options of the ingress. ``max_ongoing_requests`` / ``max_queued_requests`` of the
        config are enforced by the app itself (:class:`~serve_app.middleware.AdmissionControl`,
        JSON 429); Serve's limits for this deployment sit above them, so that Serve's own
        plain-text 429 (from its proxy, before our code runs) needs a burst of more than
        ``SERVE_HEADROOM * (max_ongoing + max_queued) + max_queued`` requests at one replica."""
        opts = cfg.serve_options("TTSIngress")
        opts["max_ongoing_requests"] = SERVE_HEADROOM * (cfg.max_ongoing_requests + cfg.max_queued_requests)
        return opts

