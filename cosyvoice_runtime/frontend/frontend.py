"""The CPU frontend of one model directory: text -> token segments, prompt -> features, voices.

Pure Python/numpy/onnxruntime; the serving deployment wraps an instance of :class:`Frontend`.
Every user-facing failure is a typed :class:`~cosyvoice_runtime.errors.InvalidInputError`.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.frontend.audio import Waveform, decode_audio, to_waveform
from cosyvoice_runtime.frontend.errors import EmptyTextError, InvalidInputError, TextTooLongError
from cosyvoice_runtime.frontend.normalize import TextNormalizer
from cosyvoice_runtime.frontend.prompt import PromptEncoder, PromptLimits
from cosyvoice_runtime.frontend.tokenizer import TextTokenizer
from cosyvoice_runtime.frontend.voices import VoiceRegistry, check_voice_id, content_voice_id
from cosyvoice_runtime.voice_prompt import VoicePrompt
from cosyvoice_runtime.yaml_config import read_model_spec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FrontendLimits:
    max_text_chars: int = 50_000
    max_prompt_text_chars: int = 1_000
    prompt: PromptLimits = field(default_factory=PromptLimits)


@dataclass(frozen=True, slots=True)
class TextSegment:
    """One synthesis unit: the normalised text and its token ids, int32 ``(Lx,)``."""

    text: str
    tokens: np.ndarray


def check_text(text: object, max_chars: int, what: str = "text") -> str:
    """Validate a request text (type, not blank, length) before any work is done."""
    if not isinstance(text, str):
        raise InvalidInputError(f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise EmptyTextError(f"{what} is empty")
    if len(text) > max_chars:
        raise TextTooLongError(len(text), max_chars)
    return text


class Frontend:
    """Text and prompt frontend.

    Args:
        spec: the model's :class:`ModelSpec` (family, file names, mel parameters, token/mel ratio).
        registry: voice store (``None``: voices unavailable).
        use_wetext: run the wetext grammars in text normalisation.
        load_prompt_models: build the ONNX sessions (text-only replicas can skip them).
    """

    def __init__(self, spec: ModelSpec, registry: VoiceRegistry | None = None, limits: FrontendLimits = FrontendLimits(),
                 use_wetext: bool = True, load_prompt_models: bool = True, use_gpu: bool = False) -> None:
        root = Path(spec.model_dir)
        self.spec = spec
        self.family = spec.family
        self.limits = limits
        self.tokenizer = TextTokenizer(root / spec.files["tokenizer"], spec.family)
        self.normalizer = TextNormalizer(use_wetext=use_wetext, en_length=self.tokenizer.count)
        self.encoder = (PromptEncoder(spec.family, root / spec.files["campplus"], root / spec.files["speech_tokenizer"],
                                      spec.mel, spec.token_mel_ratio, limits.prompt, use_gpu=use_gpu)
                        if load_prompt_models else None)
        self.registry = registry

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, voices_dir: str | Path | None = None, **kwargs) -> Frontend:
        registry = VoiceRegistry(voices_dir) if voices_dir is not None else None
        return cls(read_model_spec(model_dir), registry=registry, **kwargs)

    # -- text -------------------------------------------------------------------------------
    def text_segments(self, text: str, text_frontend: bool = True) -> Iterator[TextSegment]:
        """Validate, normalise, split and tokenise; yields segments as they become final."""
        check_text(text, self.limits.max_text_chars)
        produced = False
        for piece in self.normalizer.iter_segments(text, text_frontend=text_frontend):
            produced = True
            yield TextSegment(piece, self.tokens(piece))
        if not produced:
            raise EmptyTextError("text has nothing to speak (only punctuation or symbols)")

    def prompt_text_tokens(self, prompt_text: str, text_frontend: bool = True) -> tuple[str, np.ndarray]:
        """Prompt transcript: normalised without splitting (zero_shot), then tokenised."""
        check_text(prompt_text, self.limits.max_prompt_text_chars, "prompt text")
        text = self.normalizer.normalize(prompt_text, split=False, text_frontend=text_frontend)
        return text, self.tokens(text)

    def tokens(self, text: str) -> np.ndarray:
        """Verbatim tokenisation (instruct texts are not normalised)."""
        return np.asarray(self.tokenizer.encode(text), dtype=np.int32)

    # -- prompts ----------------------------------------------------------------------------
    def _encoder(self) -> PromptEncoder:
        if self.encoder is None:
            raise InvalidInputError("this frontend was built without prompt models")
        return self.encoder

    def prompt(self, audio: bytes | Waveform, prompt_text: str = "") -> VoicePrompt:
        """Prompt audio (file bytes or a :class:`Waveform`) + transcript -> aligned features."""
        if isinstance(audio, (bytes, bytearray, memoryview)):
            audio = decode_audio(audio, self.limits.prompt.audio_limits())  # header checked before decoding
        wav = audio
        if not isinstance(wav, Waveform):
            raise InvalidInputError("prompt audio must be file bytes or a Waveform")
        text, text_tokens = self.prompt_text_tokens(prompt_text) if prompt_text.strip() else ("", np.zeros(0, np.int32))
        speech_tokens, mel, embedding = self._encoder().encode(wav)
        return VoicePrompt(family=self.family, text=text, text_tokens=text_tokens, speech_tokens=speech_tokens,
                           mel=mel, embedding=embedding)

    def prompt_from_samples(self, samples, sample_rate: int, prompt_text: str = "") -> VoicePrompt:
        return self.prompt(to_waveform(samples, sample_rate), prompt_text)

    # -- voices -----------------------------------------------------------------------------
    def _registry(self) -> VoiceRegistry:
        if self.registry is None:
            raise InvalidInputError("no voice registry is configured")
        return self.registry

    def register_voice(self, audio: bytes, prompt_text: str, voice_id: str | None = None) -> tuple[str, bool]:
        """Register (prompt audio bytes, transcript) once; returns ``(voice_id, created)``.

        Without an explicit id the id is a hash of (family, transcript, audio bytes): registering
        the same voice again returns the same id and does no work (``created=False``).
        """
        registry = self._registry()
        if not isinstance(audio, (bytes, bytearray, memoryview)):
            raise InvalidInputError("prompt audio must be file bytes")
        check_text(prompt_text, self.limits.max_prompt_text_chars, "prompt text")
        content_id = content_voice_id(self.family, prompt_text, bytes(audio))
        vid = check_voice_id(voice_id) if voice_id is not None else content_id
        if registry.exists(vid):
            existing = registry.get(vid)
            if existing.family == self.family and existing.meta.get("content_id") == content_id:
                return vid, False
        features = self.prompt(bytes(audio), prompt_text)
        features.meta = {"content_id": content_id}
        return vid, registry.put(vid, features)

    def voice(self, voice_id: str) -> VoicePrompt:
        """A registered voice of this model family (:class:`VoiceNotFoundError` if unknown)."""
        return self._registry().get(check_voice_id(voice_id), family=self.family)
