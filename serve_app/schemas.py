"""HTTP request/response models (pydantic).

``POST /v1/audio/speech`` follows OpenAI: unknown fields are ignored (the ingress logs them).
Our own endpoints reject unknown fields with a 400.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from cosyvoice_runtime.frontend.voice_id import VOICE_ID_PATTERN
from deployments.protocol import SynthesisMode
from serve_app.pronunciation import PronunciationFields

# OpenAI's formats, all produced (serve_app.audio_codec).
OpenAIFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
# OpenAI's speed range. The model changes speed itself within [0.5, 2.0]; the rest is a tempo change
# of its output (serve_app.speech.split_speed).
MIN_SPEED, MAX_SPEED = 0.25, 4.0


VoiceId = Annotated[str, StringConstraints(pattern=VOICE_ID_PATTERN)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class VoiceRef(_Strict):
    """A voice given as an object (OpenAI's custom-voice form ``{"id": "voice_1234"}``)."""

    id: VoiceId


class SpeechRequest(PronunciationFields):
    """``POST /v1/audio/speech`` (OpenAI-compatible).

    ``voice`` names a registered voice or an alias of one (``ingress.voice_aliases``), as a string
    or ``{"id": ...}``. ``instructions`` switches to CosyVoice's instruct mode with that voice.
    The body streams as audio is made (as OpenAI's does); ``stream: false`` (our extension) asks
    for one buffered body with a Content-Length. ``stream_format: "sse"`` sends Server-Sent Events.
    ``pronunciation_rules`` / ``pronunciation_dictionary_locators`` (our extension): aliases applied
    before normalisation (serve_app/pronunciation.py).
    """

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str = Field(min_length=1, max_length=128)
    input: str = Field(min_length=1)
    voice: VoiceId | VoiceRef
    response_format: OpenAIFormat = "mp3"
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)
    stream: bool = True
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = Field(None, max_length=1000)
    seed: int | None = Field(None, ge=0, lt=2**63)

    @property
    def voice_id(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class NativeSynthesisFields(PronunciationFields, _Strict):
    """``POST /v1/tts`` fields (JSON body, or form fields next to a ``prompt_audio`` file; the
    pronunciation fields, being lists, in a JSON body only)."""

    text: str = Field(min_length=1)
    mode: SynthesisMode = SynthesisMode.VOICE
    voice_id: str | None = Field(None, pattern=VOICE_ID_PATTERN)
    prompt_text: str | None = Field(None, max_length=2000)
    instruct_text: str | None = Field(None, max_length=1000)
    response_format: OpenAIFormat = "wav"
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)
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
