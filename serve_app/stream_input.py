"""Text-in streaming over WebSocket, in ElevenLabs' stream-input message shapes.

``WS /v1/text-to-speech/{voice_id}/stream-input?output_format=pcm_24000`` (docs/serving.md):

* client -> server: a first message ``{"text": " ", "voice_settings": {...}, ...}``, then
  ``{"text": "<piece>"}`` messages (``"flush": true`` forces out what is buffered), and
  ``{"text": ""}`` to end;
* server -> client: ``{"audio": "<base64>", "isFinal": false, "normalizedAlignment": {...},
  "alignment": {...}}`` messages (serve_app/alignment.py: the characters each message's audio
  starts to say, from the model's text-to-speech-token correspondence; ``alignment`` those sent,
  ``normalizedAlignment`` those read, after the session's pronunciation aliases), then
  ``{"isFinal": true, "audioSeconds": <float>}`` (the seconds of audio the session was sent) and
  a normal close (1000).

Two modes (query ``mode``), both into ONE encoder, so the concatenated audio is one valid stream
of the output format:

* ``bistream`` (default; CosyVoice2 and CosyVoice3, spec §3.8): one LLM sequence reads the text
  while it speaks, text and speech tokens interleaved (5 text : 15 speech). Text is NOT
  normalised (as the official bistream frontend) and is tokenised piece by piece, each piece cut
  just before a whitespace (:class:`WordCutter`: a word split over messages, or typed key by key,
  is tokenised whole, as in the whole text, since Qwen2's pre-tokenizer starts a word's tokens at
  the space before it); the ids go to the synthesizer replica running the sequence through its
  text inbox (``deployments/text_inbox.py``); audio starts once the prompt's speech is paired with text
  (about 5 text tokens per 15 prompt speech tokens, less the prompt's own text) and a first chunk
  of speech tokens exists, not at a sentence end, and prosody runs on across sentences. A turn
  (one sequence) ends at ``flush`` (its text is complete: the model speaks the rest and stops;
  text after it starts a new turn), at the end, or at the first sentence end past
  ``TURN_SOFT_IDS`` text tokens (``TURN_MAX_IDS`` wherever), so a turn fits a KV slot.
* ``sentence``: a sentence is sent to synthesis as soon as its end mark (and the character after
  it) has arrived, or when the buffer passes ``MAX_SEGMENT_CHARS`` (cut at a soft break with the
  runtime's splitter helpers), or on ``flush`` / the end; segments are normalised and
  synthesised one after another while more text arrives.

Bounded: one admission turn per session (AdmissionControl), ``MAX_SESSION_CHARS`` of text per
session, an inactivity timeout (query ``inactivity_timeout``, default 20 s, at most 180 s, as
ElevenLabs) on the client's messages, and the ingress's audio-progress timeout on the
synthesizer's (``stream_idle_timeout_s``, serve_app/progress.py: a sentence-mode segment's audio
at once, a bistream turn's from the end of its text). A closed socket cancels the synthesis in
flight (its decode slot is freed). Errors are sent as the JSON error shape, then the socket is
closed (1008 bad input, 1013 overload, 1011 internal: a stalled synthesizer, ``audio_timeout``).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from cosyvoice_runtime.frontend.split import CLOSING_QUOTES, EN_SENTENCE_END, ZH_SENTENCE_END, cut_to_length
from cosyvoice_runtime.frontend.voice_id import VOICE_ID_RULE, is_voice_id
from deployments.protocol import AudioChunk, CosyVoiceError, InvalidInputError, OverloadedError, SynthesisRequest
from serve_app.alignment import Aligner, CharSpans, PieceAligner, TextIn, joined
from serve_app.audio_codec import run_encoder
from serve_app.auth import voice_access
from serve_app.elevenlabs import DEFAULT_OUTPUT_FORMAT, OutputFormat, parse_output_format
from serve_app.errors import classify, error_body, message_of, request_id_of
from serve_app.failover import DEFAULT_RETRIES, FailoverStream, lost_as_error, seed_param
from serve_app.handles import admitted, cancel_stream
from serve_app.progress import DEFAULT_IDLE_S, AudioProgress
from serve_app.pronunciation import session_aliases, spec_of_message
from serve_app.schemas import MAX_SPEED, MIN_SPEED
from serve_app.speech import AudioOut, served_seconds, split_speed

logger = logging.getLogger(__name__)

ROUTE = "/v1/text-to-speech/{voice_id}/stream-input"
MODES = ("bistream", "sentence")
# Text tokens of a bistream turn (module docstring). About 8.5 positions per English text token
# (itself, 3 interleaved speech tokens, the rest after the text): 160 tokens + a 400-position prompt
# fit the default 2048-position KV slot.
TURN_SOFT_IDS, TURN_MAX_IDS = 100, 160
FLUSH = object()  # end of a bistream turn
MAX_HELD_CHARS = 8  # text without any whitespace (CJK) is sent in runs of this many characters
MAX_SEGMENT_CHARS = 250  # a run without a sentence end is cut (at a soft break) past this many characters
MAX_SESSION_CHARS = 100_000
DEFAULT_INACTIVITY_S, MAX_INACTIVITY_S = 20.0, 180.0
SENTENCE_END = EN_SENTENCE_END | ZH_SENTENCE_END | frozenset("。？！")
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_INTERNAL, CLOSE_TRY_AGAIN = 1000, 1008, 1011, 1013


class InactivityTimeout(InvalidInputError):
    """No client message within the session's inactivity timeout."""


class SentenceBuffer:
    """Text arriving in pieces -> segments ready for synthesis (whole sentences, or long runs cut)."""

    def __init__(self, max_chars: int = MAX_SEGMENT_CHARS) -> None:
        self.max_chars = max_chars
        self._buf = ""

    def feed(self, text: str) -> list[str]:
        self._buf += text
        out = []
        while True:
            cut = self._sentence_end()
            if cut is None:
                break
            out.append(self._buf[:cut])
            self._buf = self._buf[cut:]
        while len(self._buf) > self.max_chars:
            head, self._buf = cut_to_length(self._buf, self.max_chars, len)
            out.append(head)
        return [s for s in (x.strip() for x in out) if s]

    def flush(self) -> list[str]:
        rest, self._buf = self._buf.strip(), ""
        return [rest] if rest else []

    def _sentence_end(self) -> int | None:
        """Index just past the first complete sentence: its mark (and closing quotes) followed by
        whitespace; the character after the mark must have arrived ("3.14" is not an end)."""
        buf = self._buf
        for i, c in enumerate(buf):
            if c not in SENTENCE_END:
                continue
            j = i + 1
            while j < len(buf) and buf[j] in CLOSING_QUOTES:
                j += 1
            if j < len(buf) and (buf[j].isspace() or c in "。？！"):
                return j
        return None


class WordCutter:
    """Bistream text -> pieces to tokenise: everything before the last whitespace, the rest held
    (a partial word) until more text, a flush or the end; a run without whitespace is sent once
    it passes ``MAX_HELD_CHARS``."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, text: str) -> str:
        buf = self._held + text
        cut = max(buf.rfind(c) for c in " \t\n\r\u3000")
        if cut <= 0:
            cut = len(buf) if len(buf) > MAX_HELD_CHARS else 0
        piece, self._held = buf[:cut], buf[cut:]
        return piece

    def flush(self) -> str:
        piece, self._held = self._held, ""
        return piece


class StreamInputSession:
    """One WebSocket session: receive text, synthesise segments in order, send audio messages."""

    failover_retries = DEFAULT_RETRIES  # of a sentence-mode segment (serve_app/failover.py); the ingress sets it
    progress = AudioProgress(DEFAULT_IDLE_S)  # the synthesizer's streams' timeout; the ingress sets its own

    def __init__(self, ws: WebSocket, frontend: Any, synth: Any, voice_id: str,
                 on_served: Callable[[float], None] | None = None) -> None:
        self.ws, self.frontend, self.synth, self.voice_id = ws, frontend, synth, voice_id
        self.on_served = on_served  # audio seconds of each synthesis call (segment or turn) once it is sent
        self.access = voice_access(ws)  # the key's own and the shared voices (serve_app/auth.py)
        self.rid = request_id_of(ws)
        self.segments: asyncio.Queue = asyncio.Queue()  # sentence: segments; bistream: fragments, FLUSH; None: end
        self.out: AudioOut | None = None
        self.made_s = self.sent_s = 0.0  # seconds of audio encoded / in the messages sent
        self._aligned: list[tuple[CharSpans, CharSpans]] = []  # (original, normalised) not yet sent
        self.speed = 1.0
        self.chars = 0
        self.pronunciation = None  # the aliases of the first message (serve_app/pronunciation.py)

    async def run(self) -> None:
        ws = self.ws
        await ws.accept()
        worker: asyncio.Task | None = None
        try:
            fmt = parse_output_format(ws.query_params.get("output_format", DEFAULT_OUTPUT_FORMAT))
            timeout = inactivity_timeout(ws.query_params.get("inactivity_timeout"))
            mode = ws.query_params.get("mode", MODES[0])
            if mode not in MODES:
                raise InvalidInputError(f"mode must be one of {', '.join(MODES)}")
            if not is_voice_id(self.voice_id):
                raise InvalidInputError(f"invalid voice_id {self.voice_id!r}: use {VOICE_ID_RULE}")
            first = await self._receive(timeout)
            self.speed, self.pronunciation = speed_of(first), spec_of_message(first)
            bistream = mode == "bistream"
            worker = asyncio.create_task(self._bistream_all(fmt) if bistream else self._synthesize_all(fmt))
            buffer = SentenceBuffer()
            msg = first
            while True:
                text = msg.get("text")
                if not isinstance(text, str):
                    raise InvalidInputError("every message needs a 'text' string")
                if text == "" and msg is not first:
                    break
                self._count(text)
                if bistream:
                    self.segments.put_nowait(text)
                    if msg.get("flush"):
                        self.segments.put_nowait(FLUSH)
                else:
                    ready = buffer.feed(text)
                    if msg.get("flush"):
                        ready += buffer.flush()
                    for seg in ready:
                        self.segments.put_nowait(seg)
                msg = await self._receive(timeout, worker)
            for seg in buffer.flush():
                self.segments.put_nowait(seg)
            self.segments.put_nowait(None)
            await worker
            await ws.send_json({"isFinal": True, "audioSeconds": round(self.out.served_s if self.out else 0.0, 3)})
            await ws.close(CLOSE_NORMAL)
        except WebSocketDisconnect:
            logger.info("stream-input %s: client closed the socket", self.rid)
        except Exception as exc:  # noqa: BLE001 - answered on the socket in the one error shape
            await self._fail(exc)
        finally:
            if worker is not None and not worker.done():
                worker.cancel()  # cancels the handle stream in flight: the decode slot is freed
                with contextlib.suppress(BaseException):
                    await worker

    async def _receive(self, timeout: float, worker: asyncio.Task | None = None) -> dict:
        """The next client message; a failed synthesis ends the wait with its error."""
        recv = asyncio.ensure_future(self.ws.receive())
        waits = {recv} if worker is None else {recv, worker}
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if recv not in done:
            recv.cancel()
            with contextlib.suppress(BaseException):
                await recv
            if worker is not None and worker in done:
                worker.result()  # raises the synthesis error (it cannot end otherwise before the text)
            raise InactivityTimeout(f"no message for {timeout:g} s (inactivity_timeout)")
        message = recv.result()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
        try:
            msg = json.loads(message.get("text") or message.get("bytes") or b"")
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise InvalidInputError("messages must be JSON text") from None
        if not isinstance(msg, dict):
            raise InvalidInputError("messages must be JSON objects")
        return msg

    def _count(self, text: str) -> None:
        self.chars += len(text)
        if self.chars > MAX_SESSION_CHARS:
            raise InvalidInputError(f"more than {MAX_SESSION_CHARS} characters of text in one session")

    async def _synthesize_all(self, fmt: OutputFormat) -> None:
        native, tempo = split_speed(self.speed)
        n, seed = 0, seed_param(self.ws.query_params.get("seed"))  # every segment's (a reproducible session)
        while (segment := await self.segments.get()) is not None:
            req = SynthesisRequest(request_id=f"{self.rid}-{n}", text=segment, voice_id=self.voice_id, speed=native,
                                   stream=native == 1.0, access=self.access, pronunciation=self.pronunciation,
                                   seed=seed)
            n += 1
            prepared = await admitted(self.frontend.prepare.remote(req))
            # continued if its replica dies; ended if its audio stalls
            gen = self.progress.watch(FailoverStream(self.synth, prepared, self.failover_retries))
            await self._play(gen, fmt, tempo, PieceAligner(segment, [(p.text, len(p.text_ids)) for p in prepared.pieces]))
        await self._close_audio()

    async def _bistream_all(self, fmt: OutputFormat) -> None:
        """Bistream turns one after another: a turn starts at its first non-blank piece, each
        piece's ids go to its sequence, and it ends at flush / the end / the turn bound."""
        native, tempo = split_speed(self.speed)
        text = TextIn(WordCutter(), await session_aliases(self, MAX_SESSION_CHARS))
        turn: _Turn | None = None
        n = 0
        try:
            while True:
                item = await self._next_fragment(turn)
                ends = item is None or item is FLUSH
                # a turn starts at text (ElevenLabs' first " " is no text)
                piece, sent, spans = text.piece(None if ends else item, new_turn=turn is None)
                if piece:
                    if turn is None:
                        turn = await self._start_turn(f"{self.rid}-{n}", native, fmt, tempo)
                        n += 1
                    ids = (await self.frontend.tokenize_fragment.remote(piece)).tolist()
                    await turn.push(ids, piece, sent, spans)
                    if turn.ids >= TURN_MAX_IDS or (turn.ids >= TURN_SOFT_IDS and _ends_sentence(piece)):
                        await turn.finish()
                        turn = None
                if ends and turn is not None:
                    await turn.finish()
                    turn = None
                if item is None:
                    break
        finally:
            if turn is not None and not turn.audio.done():
                turn.audio.cancel()  # cancels the handle stream: its decode slot is freed
        await self._close_audio()

    async def _start_turn(self, request_id: str, speed: float, fmt: OutputFormat, tempo: float) -> _Turn:
        """A bistream sequence for the voice: its ticket, and a task sending its audio."""
        req = SynthesisRequest(request_id=request_id, text="", voice_id=self.voice_id, speed=speed, stream=True,
                               access=self.access, seed=seed_param(self.ws.query_params.get("seed")))
        prepared = await admitted(self.frontend.prepare_bistream.remote(req))
        gen = self.synth.options(stream=True).synthesize_bistream.remote(prepared)
        try:
            ticket = await admitted(self.progress.next(gen))  # owed at once
        except BaseException:
            cancel_stream(gen)
            raise
        aligner = Aligner("", "")  # the turn's text as pushed (read as sent, but for aliases) and as sent
        aligner.sequence([])
        owed = asyncio.Event()  # its audio is owed once its text is complete (module docstring)
        audio = asyncio.create_task(self._play(self.progress.watch(gen, owed), fmt, tempo, aligner))
        return _Turn(ticket, audio, aligner, owed)

    async def _next_fragment(self, turn: _Turn | None):
        """The next queued item; a turn whose synthesis failed meanwhile raises its error now."""
        if turn is None:
            return await self.segments.get()
        get = asyncio.ensure_future(self.segments.get())
        done, _ = await asyncio.wait({get, turn.audio}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        turn.audio.result()  # raises the synthesis error
        raise InvalidInputError("the speech of this turn ended before its text did (it outgrew the model's "
                                "context): send flush more often")

    async def _play(self, gen, fmt: OutputFormat, tempo: float, aligner: Aligner) -> None:
        """Encode and send one synthesis call's audio (skipping a bistream call's ticket), each
        message with the characters its audio starts to say (serve_app/alignment.py)."""
        samples, rate = 0, 0
        try:
            async for chunk in lost_as_error(gen):  # a bistream sequence is not continued
                if not isinstance(chunk, AudioChunk):
                    continue
                samples, rate = samples + len(chunk.samples), chunk.sample_rate
                if self.out is None:  # encoder calls run in the encoder pool, off the event loop
                    self.out = await run_encoder(AudioOut, fmt.fmt, chunk.sample_rate, tempo=tempo,
                                                 out_rate=fmt.rate, bit_rate=fmt.bit_rate)
                data = await run_encoder(self.out.feed, chunk.samples)
                start, self.made_s = self.made_s, self.made_s + len(chunk.samples) / chunk.sample_rate / tempo
                if isinstance(aligner, PieceAligner):
                    self._aligned.append(aligner.piece_chunk(chunk.piece, chunk.text_marks, start, self.made_s,
                                                             chunk.is_last))
                else:
                    self._aligned.append(aligner.chunk(chunk.text_marks, start, self.made_s, chunk.is_last))
                if data:
                    await self._send_audio(data, *self._take_alignment())
            self._aligned.append(aligner.finish(self.made_s))  # text that made no audio (a turn cut short)
            if self.on_served is not None:
                self.on_served(served_seconds(samples, rate, tempo))
        finally:
            cancel_stream(gen)

    def _take_alignment(self) -> tuple[dict | None, dict | None]:
        """(alignment, normalizedAlignment) of the audio since the last message, times from its start
        (an encoder that returned no bytes for a chunk: that chunk's characters ride with this one)."""
        original = joined([o for o, _ in self._aligned])
        normalized = joined([n for _, n in self._aligned])
        origin, self.sent_s, self._aligned = self.sent_s, self.made_s, []
        return (original.ws(origin) if original else None), (normalized.ws(origin) if normalized else None)

    async def _close_audio(self) -> None:
        if self.out is not None:
            await self._send_audio(await run_encoder(self.out.close), *self._take_alignment())

    async def _send_audio(self, data: bytes, alignment: dict | None = None, normalized: dict | None = None) -> None:
        if data:
            await self.ws.send_json({"audio": base64.b64encode(data).decode(), "isFinal": False,
                                     "normalizedAlignment": normalized, "alignment": alignment})

    async def _fail(self, exc: BaseException) -> None:
        status, type_, code, _ = classify(exc)
        if status >= 500 and not isinstance(exc, CosyVoiceError):
            logger.error("stream-input %s failed: %s", self.rid, type(exc).__name__, exc_info=exc)
            body = error_body(self.rid, f"internal error (request id {self.rid})", "server_error")
        else:
            body = error_body(self.rid, message_of(exc), type_, code)
        close = CLOSE_TRY_AGAIN if isinstance(exc, OverloadedError) else CLOSE_POLICY if status < 500 else CLOSE_INTERNAL
        with contextlib.suppress(Exception):  # the client may be gone already
            await self.ws.send_json(body)
            await self.ws.close(close)


@dataclass
class _Turn:
    """One bistream sequence of a session: where its text goes, and the task sending its audio."""

    ticket: Any  # deployments.text_inbox.BistreamTicket
    audio: asyncio.Task
    aligner: Aligner  # the text pushed, with its tokens (read by the audio task)
    owed: asyncio.Event  # set at the end of its text: from then on its audio has the progress timeout
    ids: int = 0

    async def push(self, ids: list[int], piece: str, sent: str, spans: list[tuple[int, int]]) -> None:
        """``piece``'s ids to the sequence; ``sent``: the characters sent it completes, ``spans``
        where each is said in the turn's text (serve_app/alignment.py ``TextIn``)."""
        if self.audio.done():
            self.audio.result()  # a failed synthesis raises its own error, not "session closed"
        # NOTE: the aligner knows the tokens before the model can read them (the audio task may mark
        # them while the push below awaits); a piece without ids: its text joins the next one's
        self.aligner.push(piece, len(ids), sent, spans)
        if ids:
            await self.ticket.push(ids)
            self.ids += len(ids)

    async def finish(self) -> None:
        """End of this turn's text; returns once its audio has been sent."""
        if not self.audio.done():
            await self.ticket.push([], end=True)
        self.owed.set()  # the model needs nothing more from the client to speak the rest
        await self.audio


def _ends_sentence(fragment: str) -> bool:
    text = fragment.rstrip().rstrip("".join(CLOSING_QUOTES))
    return bool(text) and text[-1] in SENTENCE_END


def inactivity_timeout(value: str | None, clamp: bool = False) -> float:
    """The query's ``inactivity_timeout`` (seconds): past ``MAX_INACTIVITY_S`` an error, or with
    ``clamp`` cut to it (multi-stream-input: LiveKit asks for 300 s)."""
    if value is None:
        return DEFAULT_INACTIVITY_S
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidInputError("inactivity_timeout must be a number of seconds") from None
    if not seconds > 0 or (seconds > MAX_INACTIVITY_S and not clamp):
        raise InvalidInputError(f"inactivity_timeout must be within (0, {MAX_INACTIVITY_S:g}] s")
    return min(seconds, MAX_INACTIVITY_S)


def speed_of(first: dict) -> float:
    """``voice_settings.speed`` of the first message (ElevenLabs' place for it), OpenAI's range."""
    settings = first.get("voice_settings") or {}
    speed = settings.get("speed", 1.0) if isinstance(settings, dict) else 1.0
    if not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise InvalidInputError(f"voice_settings.speed must be within [{MIN_SPEED}, {MAX_SPEED}]")
    return float(speed)
