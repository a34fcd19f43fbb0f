"""ElevenLabs-compatible text-to-speech over HTTP (what the official SDKs, LiveKit Agents and
Pipecat call; docs/serving.md, docs/voice-agents.md):

* ``POST /v1/text-to-speech/{voice_id}``: the whole audio file;
* ``POST /v1/text-to-speech/{voice_id}/stream``: the same audio, sent as it is made;
* ``POST /v1/text-to-speech/{voice_id}/with-timestamps``: JSON ``{"audio_base64", "alignment",
  "normalized_alignment"}``;
* ``POST /v1/text-to-speech/{voice_id}/stream/with-timestamps``: newline-delimited JSON, one such
  object per audio chunk.

Query ``output_format`` (serve_app/elevenlabs.py); body ``text``, ``voice_settings.speed``,
``seed``; ``model_id``, ``language_code``, ``previous_text`` / ``next_text`` and the other
optional fields are accepted and do not change the audio (CosyVoice detects the language itself
and has no cross-request context). Keys: ``xi-api-key`` or ``Authorization: Bearer`` (synthesis
scope); errors in ElevenLabs' shape (serve_app/errors.py).

With timestamps, each chunk carries the characters it starts to say (serve_app/alignment.py,
from the model's text-to-speech-token correspondence); a chunk leaves when the next one is made
(whether it ends its sentence piece must be known): at most one chunk later than on ``/stream``.
Times are seconds from the start of the response's audio.

A stream whose synthesizer replica dies is continued on another (``TTSIngress.open_stream``,
serve_app/failover.py; docs/serving.md, Failover mid-stream): the client gets the unbroken run's
audio, and an alignment still monotonic with every character once. Where it cannot be continued:
ElevenLabs' 503 before the headers, else an aborted body. The same stream ends when its audio
stalls for ``stream_idle_timeout_s`` (serve_app/progress.py): ElevenLabs' 504 ``audio_timeout``
before the headers (the whole-file routes: at any point), else an aborted body.
"""
from __future__ import annotations

import base64
import json
import logging
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cosyvoice_runtime.frontend.voice_id import VOICE_ID_RULE, is_voice_id
from deployments.protocol import AudioChunk, InvalidInputError, SynthesisMode, SynthesisRequest
from serve_app.alignment import CharSpans, PieceAligner, joined
from serve_app.audio_codec import run_encoder
from serve_app.auth import voice_access
from serve_app.elevenlabs import (
    DEFAULT_OUTPUT_FORMAT,
    OutputFormat,
    TextToSpeechBody,
    parse_output_format,
)
from serve_app.errors import request_id_of
from serve_app.handles import admitted, cancel_stream
from serve_app.request_body import read_json
from serve_app.speech import AudioOut, split_speed

logger = logging.getLogger(__name__)

BASE = "/v1/text-to-speech/{voice_id}"
NDJSON_MEDIA_TYPE = "application/x-ndjson"
MAX_LOGGED_FIELDS = 20


def routes(ingress: Any) -> list[Route]:
    """The routes, served by ``ingress`` (a ``serve_app.ingress.TTSIngress``: its handles, config,
    metrics and voice aliases; not imported here, which would make an import cycle)."""
    api = ElevenLabsHttp(ingress)
    return [
        Route(BASE, api.convert, methods=["POST"]),
        Route(BASE + "/stream", api.stream, methods=["POST"]),
        Route(BASE + "/with-timestamps", api.convert_with_timestamps, methods=["POST"]),
        Route(BASE + "/stream/with-timestamps", api.stream_with_timestamps, methods=["POST"]),
    ]


class _Call:
    """One synthesis call: its stream of chunks (the first fetched), encoder and aligner."""

    def __init__(self, gen: Any, first: AudioChunk | None, out: AudioOut | None, aligner: PieceAligner,
                 tempo: float) -> None:
        self.gen, self.first, self.out, self.aligner, self.tempo = gen, first, out, aligner, tempo
        self.seconds = 0.0  # of output audio so far

    async def chunks(self) -> AsyncIterator[tuple[AudioChunk, bool]]:
        """(chunk, whether it ends its piece): each chunk once the next one (or the end) is known."""
        prev = self.first
        if prev is None:
            return
        async for chunk in self.gen:
            yield prev, chunk.piece != prev.piece
            prev = chunk
        yield prev, True

    async def feed(self, chunk: AudioChunk, ends_piece: bool) -> tuple[bytes, CharSpans | None, CharSpans | None]:
        data = await run_encoder(self.out.feed, chunk.samples)
        start, self.seconds = self.seconds, self.seconds + len(chunk.samples) / chunk.sample_rate / self.tempo
        original, normalized = self.aligner.piece_chunk(chunk.piece, chunk.text_marks, start, self.seconds, ends_piece)
        return data, original or None, normalized or None

    async def close(self) -> tuple[bytes, CharSpans | None, CharSpans | None]:
        """The encoder's tail, and the characters no chunk released (pieces without audio)."""
        tail = await run_encoder(self.out.close) if self.out is not None else b""
        original, normalized = self.aligner.finish(self.seconds)
        return tail, original or None, normalized or None


class ElevenLabsHttp:
    def __init__(self, ingress: Any) -> None:
        self.ingress = ingress

    async def convert(self, request: Request) -> Response:
        call = await self._start(request, streamed=False)
        parts = []
        try:
            async for chunk, ends in call.chunks():
                parts.append((await call.feed(chunk, ends))[0])
            parts.append((await call.close())[0])
        finally:
            self._end(call)
        return Response(_whole(b"".join(parts), call.out.fmt), media_type=call.out.media_type)

    async def convert_with_timestamps(self, request: Request) -> Response:
        call = await self._start(request, streamed=False)
        audio, originals, normalized = [], [], []
        try:
            async for chunk, ends in call.chunks():
                data, original, norm = await call.feed(chunk, ends)
                audio.append(data)
                if original is not None:
                    originals.append(original)
                    normalized.append(norm)
            tail, rest, rest_normalized = await call.close()
        finally:
            self._end(call)
        originals += [rest] if rest is not None else []
        normalized += [rest_normalized] if rest_normalized is not None else []
        body = {"audio_base64": base64.b64encode(b"".join(audio) + tail).decode(),
                "alignment": joined(originals).http() if originals else None,
                "normalized_alignment": joined(normalized).http() if normalized else None}
        return JSONResponse(body)

    async def stream(self, request: Request) -> Response:
        call = await self._start(request, streamed=True)

        async def body():
            try:
                async for chunk, ends in call.chunks():
                    if data := (await call.feed(chunk, ends))[0]:
                        yield data
                if tail := (await call.close())[0]:
                    yield tail
            finally:
                self._end(call)

        return StreamingResponse(body(), media_type=call.out.media_type)

    async def stream_with_timestamps(self, request: Request) -> Response:
        call = await self._start(request, streamed=True)

        async def body():
            try:
                async for chunk, ends in call.chunks():
                    data, original, normalized = await call.feed(chunk, ends)
                    if data or original is not None:
                        yield _line(data, original, normalized)
                tail, rest, rest_normalized = await call.close()
                if tail or rest is not None:
                    yield _line(tail, rest, rest_normalized)
            finally:
                self._end(call)

        return StreamingResponse(body(), media_type=NDJSON_MEDIA_TYPE)

    # ------------------------------------------------------------------ common
    async def _start(self, request: Request, streamed: bool) -> _Call:
        """Parse, prepare, fetch the first chunk and open the encoder (errors become 4xx/5xx before
        any header is sent). The caller must ``_end`` the call it gets."""
        ingress = self.ingress
        voice = ingress.resolve_voice(request.path_params["voice_id"])
        if not is_voice_id(voice):
            raise InvalidInputError(f"invalid voice_id {voice!r}: use {VOICE_ID_RULE}")
        fmt = parse_output_format(request.query_params.get("output_format", DEFAULT_OUTPUT_FORMAT))
        body = TextToSpeechBody.model_validate(await read_json(request, ingress.cfg.max_upload_bytes))
        rid = request_id_of(request)
        if body.unknown_fields:
            logger.info("request %s: ignored fields %s", rid, ", ".join(n[:64] for n in body.unknown_fields[:MAX_LOGGED_FIELDS]))
        ingress._check_text(body.text)
        native, tempo = split_speed(body.speed)
        req = SynthesisRequest(request_id=rid, text=body.text, mode=SynthesisMode.VOICE, voice_id=voice, speed=native,
                               stream=streamed and native == 1.0, seed=body.seed, access=voice_access(request),
                               pronunciation=body.pronunciation())
        started = time.perf_counter()
        ingress.metrics.in_flight.inc()
        try:
            prepared = await admitted(ingress.frontend.prepare.remote(req))
            gen = ingress.open_stream(prepared)  # continued if its replica dies, ended if its audio stalls
            try:
                try:
                    first = await admitted(gen.__anext__())
                except StopAsyncIteration:
                    first = None
                if first is not None:
                    ingress.metrics.ttfa.observe(time.perf_counter() - started)
                out = await _encoder(fmt, first, tempo)
            except BaseException:
                cancel_stream(gen)
                raise
        except BaseException:
            ingress.metrics.in_flight.dec()
            raise
        aligner = PieceAligner(body.text, [(p.text, len(p.text_ids)) for p in prepared.pieces])
        return _Call(gen, first, out, aligner, tempo)

    def _end(self, call: _Call) -> None:
        cancel_stream(call.gen)  # a client gone mid-stream: the synthesizer aborts the sequence
        self.ingress.metrics.in_flight.dec()


async def _encoder(fmt: OutputFormat, first: AudioChunk | None, tempo: float) -> AudioOut:
    rate = first.sample_rate if first is not None else fmt.rate
    return await run_encoder(AudioOut, fmt.fmt, rate, tempo=tempo, out_rate=fmt.rate, bit_rate=fmt.bit_rate)


def _line(data: bytes, original: CharSpans | None, normalized: CharSpans | None) -> bytes:
    obj = {"audio_base64": base64.b64encode(data).decode(), "alignment": original.http() if original else None,
           "normalized_alignment": normalized.http() if normalized else None}
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _whole(data: bytes, fmt: str) -> bytes:
    """A whole WAV file gets its real sizes (the streaming header says "unknown")."""
    if fmt != "wav" or len(data) < 44:
        return data
    return data[:4] + struct.pack("<I", len(data) - 8) + data[8:40] + struct.pack("<I", len(data) - 44) + data[44:]
