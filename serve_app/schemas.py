"""HTTP request/response models (pydantic). Unknown fields are rejected with a 400."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.frontend import VOICE_ID_PATTERN
from deployments.protocol import SynthesisMode

# Formats OpenAI defines; the ones we cannot produce are answered with a 400 that lists ours.
OpenAIFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class SpeechRequest(_Strict):
    """``POST /v1/audio/speech`` (OpenAI-compatible).

    ``voice`` names a registered voice. ``instructions`` (as in OpenAI's newer TTS models) switches
    to CosyVoice's instruct mode with that voice. ``stream`` (an extension; OpenAI streams every
    response) selects chunked transfer of audio as it is produced.
    """

    model: str = Field(min_length=1, max_length=128)
    input: str = Field(min_length=1)
    voice: str = Field(pattern=VOICE_ID_PATTERN)
    response_format: OpenAIFormat = "mp3"
    speed: float = Field(1.0, ge=0.5, le=2.0)
    stream: bool = False
    stream_format: Literal["audio"] = "audio"
    instructions: str | None = Field(None, max_length=1000)
    seed: int | None = Field(None, ge=0, lt=2**63)


class NativeSynthesisFields(_Strict):
    """``POST /v1/tts`` fields (JSON body, or form fields next to a ``prompt_audio`` file)."""

    text: str = Field(min_length=1)
    mode: SynthesisMode = SynthesisMode.VOICE
    voice_id: str | None = Field(None, pattern=VOICE_ID_PATTERN)
    prompt_text: str | None = Field(None, max_length=2000)
    instruct_text: str | None = Field(None, max_length=1000)
    response_format: OpenAIFormat = "wav"
    speed: float = Field(1.0, ge=0.5, le=2.0)
    stream: bool = False
    seed: int | None = Field(None, ge=0, lt=2**63)


class VoiceFields(_Strict):
    """``POST /v1/voices`` form fields (next to the ``audio`` file)."""

    voice_id: str = Field(pattern=VOICE_ID_PATTERN)
    prompt_text: str = Field(min_length=1, max_length=2000)
    overwrite: bool = False


class VoiceOut(_Strict):
    voice_id: str
    prompt_text: str
    family: str
    num_prompt_tokens: int
