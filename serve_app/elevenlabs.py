"""What the ElevenLabs-compatible routes share: output formats and the request body (the
character alignment sent with their audio is serve_app/alignment.py).

Output formats (the ``output_format`` query parameter, ElevenLabs' names): ``pcm_<rate>`` and
``wav_<rate>`` (8000, 16000, 22050, 24000, 32000, 44100, 48000), ``mp3_<rate>_<kbps>`` (22050,
24000, 44100), ``opus_48000_<kbps>`` (Ogg Opus), ``ulaw_8000`` and ``alaw_8000`` (raw G.711).

Alignment (``/with-timestamps``, ``/stream/with-timestamps``, the WebSocket routes) is made in
serve_app/alignment.py from the model's text-to-speech-token correspondence.
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
