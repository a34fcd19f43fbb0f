"""The production :class:`~deployments.runtime_adapter.FrontendRuntime`.

Text: ``cosyvoice_runtime.frontend`` normaliser + splitter (English piece length measured in
Qwen2 tokens, as the reference) and tokenizer. Prompts: ``PromptEncoder`` (speech tokenizer,
CAM++, prompt mel, aligned). Voices: :class:`VoiceStore`, one directory per voice.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from deployments import constants
from deployments.protocol import InvalidInputError, VoiceNotFoundError, VoicePrompt

logger = logging.getLogger(__name__)


class VoiceStore:
    """Voices on disk: ``<root>/<voice_id>/{meta.json, features.npz}``, written atomically.

    A shared filesystem makes every frontend replica see every voice (configs/production.yaml).
    Voice ids are validated by the caller (``deployments.frontend.check_voice_id``).
    """

    FORMAT = 1

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def save(self, voice_id: str, prompt: VoicePrompt) -> None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{voice_id}.", dir=self.root))
        try:
            np.savez(tmp / "features.npz", prompt_text_ids=prompt.prompt_text_ids, speech_tokens=prompt.speech_tokens,
                     mel=prompt.mel, embedding=prompt.embedding)
            meta = {"format": self.FORMAT, "family": prompt.family, "prompt_text": prompt.prompt_text,
                    "created_at": time.time()}
            (tmp / "meta.json").write_text(json.dumps(meta))
            target = self.root / voice_id
            if target.exists():  # overwrite: move the old one aside first, then swap in
                old = self.root / f".{voice_id}.old.{os.getpid()}"
                target.rename(old)
                tmp.rename(target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def load(self, voice_id: str) -> VoicePrompt:
        path = self.root / voice_id
        try:
            meta = json.loads((path / "meta.json").read_text())
            with np.load(path / "features.npz") as f:
                arrays = {k: f[k] for k in f.files}
        except FileNotFoundError:
            raise VoiceNotFoundError(f"voice '{voice_id}' not found") from None
        return VoicePrompt(family=meta["family"], prompt_text=meta.get("prompt_text", ""),
                           prompt_text_ids=arrays["prompt_text_ids"], speech_tokens=arrays["speech_tokens"],
                           mel=arrays["mel"], embedding=arrays["embedding"])

    def list(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if not p.name.startswith(".") and (p / "meta.json").exists())

    def delete(self, voice_id: str) -> None:
        path = self.root / voice_id
        if not (path / "meta.json").exists():
            raise VoiceNotFoundError(f"voice '{voice_id}' not found")
        shutil.rmtree(path)


class RuntimeFrontend:
    """Text + prompt processing of one model directory (CPU)."""

    def __init__(self, cfg, model_dir: str) -> None:
        from cosyvoice_runtime.config import ModelSpec
        from cosyvoice_runtime.frontend.normalize import TextNormalizer
        from cosyvoice_runtime.frontend.prompt import PromptEncoder, PromptLimits
        from cosyvoice_runtime.frontend.tokenizer import TextTokenizer

        root = Path(model_dir)
        spec = ModelSpec.from_model_dir(root)
        self.family = spec.family
        self.sample_rate = spec.sample_rate
        self.tokenizer = TextTokenizer(root / spec.files["tokenizer"], spec.family)
        self.normalizer = TextNormalizer(en_length=self.tokenizer.count)
        self.encoder = PromptEncoder(
            spec.family, root / spec.files["campplus"], root / spec.files["speech_tokenizer"], spec.mel,
            spec.token_mel_ratio, PromptLimits(min_seconds=cfg.min_prompt_audio_s, max_seconds=cfg.max_prompt_audio_s),
        )
        self.voices = VoiceStore(cfg.voices_dir or constants.default_voices_dir() / spec.family)

    def split(self, text: str) -> list[str]:
        return list(self.normalizer.normalize(text, split=True))

    def tokenize(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text), dtype=np.int32)

    def prompt_from_audio(self, audio: np.ndarray, sample_rate: int, prompt_text: str) -> VoicePrompt:
        from cosyvoice_runtime.frontend.audio import to_waveform

        wav = to_waveform(audio, sample_rate)
        tokens, mel, embedding = self.encoder.encode(wav)
        text = self.normalizer.normalize(prompt_text, split=False) if prompt_text else ""
        if not isinstance(text, str):
            raise InvalidInputError("prompt text must be a string")
        return VoicePrompt(family=self.family, prompt_text=prompt_text, prompt_text_ids=self.tokenize(text),
                           speech_tokens=tokens, mel=mel, embedding=embedding)

    def save_voice(self, voice_id: str, prompt: VoicePrompt) -> None:
        self.voices.save(voice_id, prompt)

    def load_voice(self, voice_id: str) -> VoicePrompt:
        return self.voices.load(voice_id)

    def list_voices(self) -> list[str]:
        return self.voices.list()

    def delete_voice(self, voice_id: str) -> None:
        self.voices.delete(voice_id)
