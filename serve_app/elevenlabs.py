"""What the ElevenLabs-compatible routes share: output formats, the request body, and the
character alignment sent with their audio.

Output formats (the ``output_format`` query parameter, ElevenLabs' names): ``pcm_<rate>`` and
``wav_<rate>`` (8000, 16000, 22050, 24000, 32000, 44100, 48000), ``mp3_<rate>_<kbps>`` (22050,
24000, 44100), ``opus_48000_<kbps>`` (Ogg Opus), ``ulaw_8000`` and ``alaw_8000`` (raw G.711).

Alignment (``/with-timestamps``, ``/stream/with-timestamps``): the synthesizer reports which
sentence piece each audio chunk belongs to, so a piece's span of the audio is exact; within a
piece, its characters share the span in proportion to their count (each character the same
duration). ``normalized_alignment`` lists the characters of the normalised pieces (what the model
read, pieces joined by one space); ``alignment`` lists the characters the client sent, each mapped
to the same relative position of the normalised text (normalisation keeps the order of the text,
so a character lands in or near the piece that says it). Both are monotonic, cover every
character and end within the audio. The model's own text-token to speech-token correspondence
is not used yet (docs/serving.md).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.protocol import InvalidInputError
from serve_app.pronunciation import PronunciationFields
from serve_app.schemas import MAX_SPEED, MIN_SPEED

DEFAULT_OUTPUT_FORMAT = "mp3_44100_128"  # ElevenLabs' default
PCM_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
MP3_RATES = (22050, 24000, 44100)
OPUS_RATES = (48000,)
_FORMAT_RE = re.compile(r"^(pcm|wav|ulaw|alaw)_(\d+)$|^(mp3|opus)_(\d+)_(\d+)$")
MAX_CONTEXT_TEXT = 10_000  # previous_text / next_text: accepted (and not used) up to this length


@dataclass(frozen=True)
class OutputFormat:
    fmt: str  # audio_codec format
    rate: int
    bit_rate: int | None = None


def parse_output_format(value: str) -> OutputFormat:
    """ElevenLabs' ``output_format`` name -> our encoder settings (InvalidInputError otherwise)."""
    m = _FORMAT_RE.match(value)
    if m and m.group(1):
        kind, rate = m.group(1), int(m.group(2))
        if kind in ("pcm", "wav") and rate in PCM_RATES or kind in ("ulaw", "alaw") and rate == 8000:
            return OutputFormat(kind, rate)
    if m and m.group(3):
        kind, rate, kbps = m.group(3), int(m.group(4)), int(m.group(5))
        if rate in (MP3_RATES if kind == "mp3" else OPUS_RATES) and 8 <= kbps <= 320:
            return OutputFormat(kind, rate, kbps * 1000)
    rates = ", ".join(map(str, PCM_RATES))
    raise InvalidInputError(f"output_format '{value}' is not supported; use pcm_<rate> or wav_<rate> ({rates}), "
                            f"mp3_<rate>_<kbps> ({', '.join(map(str, MP3_RATES))}), opus_48000_<kbps>, "
                            "ulaw_8000 or alaw_8000")


class VoiceSettings(BaseModel):
    """``voice_settings``: only ``speed`` changes the audio; stability, similarity_boost, style,
    use_speaker_boost have no CosyVoice counterpart and are ignored."""

    model_config = ConfigDict(extra="allow")

    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)


class TextToSpeechBody(PronunciationFields):  # + pronunciation_dictionary_locators
    """Body of ``POST /v1/text-to-speech/{voice_id}`` (and its ``/stream``, ``/with-timestamps``
    variants). Unknown fields are ignored, as ElevenLabs' SDKs send many optional ones."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    text: str = Field(min_length=1)
    model_id: str | None = Field(None, max_length=128)
    language_code: str | None = Field(None, max_length=16)
    voice_settings: VoiceSettings | None = None
    seed: int | None = Field(None, ge=0, le=4_294_967_295)
    # Context for prosody across requests: CosyVoice has no such input; accepted and ignored.
    previous_text: str | None = Field(None, max_length=MAX_CONTEXT_TEXT)
    next_text: str | None = Field(None, max_length=MAX_CONTEXT_TEXT)

    @field_validator("voice_settings", mode="before")
    @classmethod
    def _none_settings(cls, v: Any) -> Any:
        return None if v == {} else v

    @property
    def speed(self) -> float:
        return self.voice_settings.speed if self.voice_settings else 1.0

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


@dataclass
class CharSpans:
    """Characters with start and end times in seconds (one alignment object)."""

    chars: list[str]
    starts: list[float]
    ends: list[float]

    def http(self) -> dict:
        return {"characters": self.chars, "character_start_times_seconds": [round(t, 3) for t in self.starts],
                "character_end_times_seconds": [round(t, 3) for t in self.ends]}


class PieceAligner:
    """Alignment of one request's text, released piece by piece as each piece's audio ends.

    ``pieces`` are the normalised sentence pieces in the order they are spoken; ``original`` is
    the text the client sent. ``piece_done(i, start_s, end_s)`` returns the (original,
    normalised) characters of piece ``i`` with their times; every character of ``original`` is
    returned by exactly one piece (characters mapped past the last piece go with the last one).
    """

    def __init__(self, original: str, pieces: list[str]) -> None:
        self.original = original
        self.pieces = [p for p in pieces]
        normalized_len = sum(len(p) for p in pieces) + max(len(pieces) - 1, 0)  # one space between pieces
        self._bounds: list[int] = []  # original characters before piece i's end
        pos = 0
        for i, piece in enumerate(pieces):
            pos += len(piece) + (1 if i < len(pieces) - 1 else 0)
            self._bounds.append(len(original) if i == len(pieces) - 1 or not normalized_len
                                else round(pos / normalized_len * len(original)))
        self._next_original = 0

    def piece_done(self, i: int, start_s: float, end_s: float) -> tuple[CharSpans, CharSpans]:
        piece = self.pieces[i] + (" " if i < len(self.pieces) - 1 else "")
        normalized = _spread(list(piece), start_s, end_s)
        lo, hi = self._next_original, max(self._bounds[i], self._next_original)
        self._next_original = hi
        return _spread(list(self.original[lo:hi]), start_s, end_s), normalized

    def rest(self, end_s: float) -> CharSpans | None:
        """Original characters no piece has returned (pieces without audio), at the end, or None."""
        lo, self._next_original = self._next_original, len(self.original)
        return _spread(list(self.original[lo:]), end_s, end_s) if lo < len(self.original) else None


def joined(spans: list[CharSpans]) -> CharSpans:
    return CharSpans([c for s in spans for c in s.chars], [t for s in spans for t in s.starts],
                     [t for s in spans for t in s.ends])


def _spread(chars: list[str], start_s: float, end_s: float) -> CharSpans:
    """``chars`` sharing [start_s, end_s] equally, in order."""
    n = len(chars)
    step = (end_s - start_s) / n if n else 0.0
    starts = [start_s + k * step for k in range(n)]
    ends = [min(start_s + (k + 1) * step, end_s) for k in range(n)]
    return CharSpans(chars, starts, ends)


# ----------------------------------------------------------------------------- WebSocket alignment
DEFAULT_CHARS_PER_S = 14.0  # about English read aloud; used when the voice's own rate is not known
MIN_CHARS_PER_S, MAX_CHARS_PER_S = 4.0, 40.0
SPEECH_TOKENS_PER_S = 25  # both families (prompt speech tokens -> prompt seconds)


def voice_chars_per_s(prompt_text: str, num_prompt_tokens: int) -> float:
    """The voice's speaking rate from its prompt: transcript characters per second of prompt speech."""
    seconds = num_prompt_tokens / SPEECH_TOKENS_PER_S
    if not prompt_text.strip() or seconds <= 0:
        return DEFAULT_CHARS_PER_S
    return min(max(len(prompt_text) / seconds, MIN_CHARS_PER_S), MAX_CHARS_PER_S)


class StreamAligner:
    """Alignment of the WebSocket routes for one synthesis call (a bistream turn, a sentence
    segment): its characters, in order, spread over its audio messages at the voice's speaking
    rate; the call's last chunk takes all that are left. Times are in ms from the start of the
    message's own audio (ElevenLabs' WebSocket convention), and a message's spans tile its audio.

    A bistream turn's text arrives while it speaks (``text`` grows); the rate only decides how
    many characters each message gets, so a message never runs ahead of the text received.
    Encoded formats may return no bytes for a chunk (MP3 frames): its alignment then rides with
    the next message that has audio, shifted by what went before.
    """

    def __init__(self, chars_per_s: float) -> None:
        self.rate = chars_per_s  # one aligner per stream of audio messages: a session, a context
        self.done = 0  # characters already aligned
        self._credit = 0.0  # characters the audio so far could have said, not yet given out
        self._pending: list[tuple[list[str], float]] = []  # (characters, seconds) not yet sent

    def new_call(self, chars_per_s: float | None = None) -> None:
        """The next synthesis call starts (its text is new); audio not yet sent stays pending."""
        self.done, self._credit = 0, 0.0
        if chars_per_s is not None:
            self.rate = chars_per_s

    def chunk(self, text: str, seconds: float, last: bool) -> None:
        left = len(text) - self.done
        self._credit += self.rate * seconds
        n = left if last else min(left, int(self._credit))
        self._credit = 0.0 if n == left else self._credit - n  # text ran out: no debt for later
        self._pending.append((list(text[self.done:self.done + n]), seconds))
        self.done += n

    def take(self) -> dict | None:
        """The alignment of everything chunked since the last take (None if no characters)."""
        chars, starts, durations = [], [], []
        offset_ms = 0.0
        for piece, seconds in self._pending:
            span_ms = seconds * 1000.0
            step = span_ms / len(piece) if piece else 0.0
            for k, c in enumerate(piece):
                start = round(offset_ms + k * step)
                chars.append(c)
                starts.append(start)
                durations.append(round(offset_ms + (k + 1) * step) - start)
            offset_ms += span_ms
        self._pending.clear()
        return {"chars": chars, "charStartTimesMs": starts, "charDurationsMs": durations} if chars else None
