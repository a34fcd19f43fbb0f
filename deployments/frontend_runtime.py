"""The production :class:`~deployments.runtime_protocol.FrontendRuntime`.

A thin adapter over ``cosyvoice_runtime.frontend``: :class:`Frontend` (wetext normaliser +
splitter with the English piece length measured in Qwen2 tokens, tokenizer, ONNX prompt encoder)
and :class:`VoiceRegistry` (one record + safetensors blob per voice, written atomically). Prompts
are the runtime's ``VoicePrompt`` end to end; this adapter maps the store's errors to the serving
ones.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from deployments import constants
from deployments.protocol import (
    PayloadTooLargeError,
    VoiceExistsError,
    VoiceNotFoundError,
    VoicePrompt,
    VoiceStoreUnavailableError,
)

logger = logging.getLogger(__name__)


class RuntimeFrontend:
    """Text + prompt processing of one model directory (CPU), voices in ``cfg.voices_dir``."""

    def __init__(self, cfg, model_dir: str) -> None:
        from cosyvoice_runtime.frontend.frontend import Frontend, FrontendLimits
        from cosyvoice_runtime.frontend.prompt import PromptLimits
        from cosyvoice_runtime.frontend.voices import VoiceRegistry
        from cosyvoice_runtime.yaml_config import read_model_spec

        spec = read_model_spec(Path(model_dir))
        self.family = spec.family
        self.sample_rate = spec.sample_rate
        voices_dir = Path(cfg.voices_dir) if cfg.voices_dir else constants.default_voices_dir() / spec.family
        limits = FrontendLimits(prompt=PromptLimits(min_seconds=cfg.min_prompt_audio_s,
                                                    max_seconds=cfg.max_prompt_audio_s))
        registry = VoiceRegistry(voices_dir, max_voices=cfg.max_voices, max_bytes=cfg.max_voice_store_bytes,
                                 cache_max_bytes=cfg.voice_cache_bytes)
        self.frontend = Frontend(spec, registry=registry, limits=limits)
        self.registry = self.frontend.registry
        problem = self.registry.check_writable()
        if problem is not None:
            # Synthesis with the stored voices still works; registration and deletion answer 503
            # and /health says `degraded` (voice_store_writable: false) until it is fixed.
            logger.error("voice store %s is not writable (%s): POST/DELETE /v1/voices will fail; fix its "
                         "permissions or mount, or set frontend.voices_dir", voices_dir, problem)
            return
        self.registry.gc(min_age_s=cfg.voice_gc_min_age_s)  # orphans of writers that crashed before their commit
        self._register_default_voice(Path(model_dir))

    def _register_default_voice(self, model_dir: Path) -> None:
        """The tiny demo model ships a synthetic prompt: serve it as voice ``default`` so the
        printed curl example works on a fresh machine without recording anything."""
        from cosyvoice_runtime.tiny_model import DEFAULT_VOICE_TEXT, DEFAULT_VOICE_WAV

        wav, text = model_dir / DEFAULT_VOICE_WAV, model_dir / DEFAULT_VOICE_TEXT
        if wav.is_file() and text.is_file() and not self.registry.exists("default"):
            self.frontend.register_voice(wav.read_bytes(), text.read_text(encoding="utf-8").strip(),
                                         voice_id="default")

    def split(self, text: str) -> list[str]:
        return list(self.frontend.normalizer.iter_segments(text))

    def tokenize(self, text: str) -> np.ndarray:
        return self.frontend.tokens(text)

    def prompt_from_audio(self, audio: np.ndarray, sample_rate: int, prompt_text: str) -> VoicePrompt:
        return self.frontend.prompt_from_samples(audio, sample_rate, prompt_text)

    def save_voice(self, voice_id: str, prompt: VoicePrompt, overwrite: bool = True) -> None:
        from cosyvoice_runtime.frontend import errors

        try:
            self.registry.put(voice_id, prompt, overwrite=overwrite)
        except errors.VoiceExistsError as exc:
            raise VoiceExistsError(str(exc)) from None
        except errors.VoiceStoreFullError as exc:
            raise PayloadTooLargeError(str(exc)) from None
        except errors.VoiceStoreUnwritableError as exc:
            raise VoiceStoreUnavailableError(str(exc)) from None

    def load_voice(self, voice_id: str) -> VoicePrompt:
        return self.registry.get(voice_id, family=self.family)

    def list_voices(self) -> list[str]:
        return self.registry.list()

    def delete_voice(self, voice_id: str) -> None:
        from cosyvoice_runtime.frontend import errors

        try:
            deleted = self.registry.delete(voice_id)
        except errors.VoiceStoreUnwritableError as exc:
            raise VoiceStoreUnavailableError(str(exc)) from None
        if not deleted:
            raise VoiceNotFoundError(f"voice '{voice_id}' not found")

    def voice_store_status(self) -> tuple[str, str | None]:
        return str(self.registry.root), self.registry.check_writable()
