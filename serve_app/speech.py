"""What the OpenAI speech contract adds on top of synthesis: speed split, voice and model names,
and the response body (encoded audio, or Server-Sent Events) built from model audio chunks.

Speed: the model changes speed itself within [``MODEL_MIN_SPEED``, ``MODEL_MAX_SPEED``] (the
mel spectrogram is resampled in time before the vocoder, so pitch is kept; only without chunked
token2wav, so a request with a speed other than 1 gets its audio sentence by sentence). What lies
beyond that range (OpenAI allows 0.25-4.0) is a tempo change of the model's output (FFmpeg's
``atempo``, WSOLA: duration changes, pitch does not): speed 4.0 = model 2.0 x tempo 2.0.
"""
from __future__ import annotations

import base64
import json

import numpy as np

from serve_app.audio_codec import TempoStretcher, encode_audio, make_stream_encoder

# OpenAI's built-in voice names (the SDK's list); by default each is an alias of the default voice.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse",
                 "marin", "cedar")
DEFAULT_VOICE = "default"  # registered from the model directory's prompt when it has one (the tiny model does)
# Accepted `model` values by default: OpenAI's TTS model names and our families.
DEFAULT_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15", "cosyvoice2",
                       "cosyvoice3")
MODEL_MIN_SPEED, MODEL_MAX_SPEED = 0.5, 2.0  # the runtime's own speed range (cosyvoice_runtime.token2wav)
# Both families' speech tokens run at 25 Hz (ModelSpec.token_frame_rate); the ingress sees only
# audio, so SSE usage counts output tokens from the model's audio duration.
SPEECH_TOKENS_PER_S = 25
SSE_MEDIA_TYPE = "text/event-stream"
# A whole-file (unstreamed) response's audio seconds, known before its headers leave; a streamed
# body's come in its SSE ``speech.audio.done`` event (``audio_seconds``), the WebSocket's final
# message (``audioSeconds``) and, for every call, the ingress's tts_served_audio_seconds histogram.
AUDIO_SECONDS_HEADER = "X-Audio-Seconds"


def split_speed(speed: float) -> tuple[float, float]:
    """(the model's speed, the tempo factor applied to its output); their product is ``speed``."""
    native = min(max(speed, MODEL_MIN_SPEED), MODEL_MAX_SPEED)
    return native, speed / native


def sse_event(payload: dict) -> bytes:
    """One Server-Sent Event carrying a JSON object (OpenAI sends ``data:`` lines only)."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def usage(input_tokens: int, model_samples: int, sample_rate: int) -> dict[str, int]:
    """OpenAI's usage object: text tokens in, speech tokens out (from the model's audio length)."""
    output_tokens = round(model_samples / sample_rate * SPEECH_TOKENS_PER_S) if sample_rate else 0
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}


def served_seconds(model_samples: int, sample_rate: int, tempo: float = 1.0) -> float:
    """Seconds a client plays of ``model_samples`` of model audio after a tempo change of ``tempo``."""
    return model_samples / sample_rate / tempo if sample_rate else 0.0


class AudioOut:
    """Model audio chunks -> response body pieces: tempo change, incremental encoder, SSE framing.

    ``feed`` each chunk's samples as it arrives and send what it returns; ``close`` once at the
    end (the encoder's tail and, for SSE, the ``speech.audio.done`` event). The concatenated
    audio (of the body, or of the SSE deltas) is one valid file of ``fmt``.
    """

    def __init__(self, fmt: str, sample_rate: int, tempo: float = 1.0, sse: bool = False, input_tokens: int = 0,
                 out_rate: int | None = None, bit_rate: int | None = None) -> None:
        self.fmt, self.sample_rate, self.sse, self.input_tokens, self.tempo = fmt, sample_rate, sse, input_tokens, tempo
        self.encoder = make_stream_encoder(fmt, sample_rate, out_rate=out_rate, bit_rate=bit_rate)
        self.stretch = TempoStretcher(sample_rate, tempo) if tempo != 1.0 else None
        self.model_samples = 0  # before the tempo change (usage, RTF)
        self.media_type = SSE_MEDIA_TYPE if sse else self.encoder.media_type

    @property
    def served_s(self) -> float:
        """Seconds of audio fed so far, as the client plays it (after the tempo change)."""
        return served_seconds(self.model_samples, self.sample_rate, self.tempo)

    def _wrap(self, data: bytes) -> bytes:
        if not data or not self.sse:
            return data
        return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

    def feed(self, samples: np.ndarray) -> bytes:
        self.model_samples += len(samples)
        x = self.stretch.process(samples) if self.stretch is not None else samples
        return self._wrap(self.encoder.encode(x))

    def close(self) -> bytes:
        tail = self.encoder.encode(self.stretch.finish()) if self.stretch is not None else b""
        out = self._wrap(tail + self.encoder.finish())
        if self.sse:
            out += sse_event({"type": "speech.audio.done", "audio_seconds": round(self.served_s, 3),
                              "usage": usage(self.input_tokens, self.model_samples, self.sample_rate)})
        return out


def encode_whole(samples: np.ndarray, sample_rate: int, fmt: str, tempo: float = 1.0) -> bytes:
    """A buffered response body: the whole utterance, tempo-changed if asked, exact headers."""
    if tempo != 1.0:
        stretch = TempoStretcher(sample_rate, tempo)
        samples = np.concatenate([stretch.process(samples), stretch.finish()])
    return encode_audio(samples, sample_rate, fmt)
