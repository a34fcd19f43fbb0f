"""Prompt processing: audio -> (speech tokens, speaker embedding, prompt mel), spec §2.4-2.8.

The frontend puts them in a :class:`~cosyvoice_runtime.voice_prompt.VoicePrompt`.

``onnxruntime`` is imported lazily (only when a :class:`PromptEncoder` is built), so text-only
replicas never load it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cosyvoice_runtime.config import MelSpec
from cosyvoice_runtime.frontend import features
from cosyvoice_runtime.frontend.audio import Waveform, resample
from cosyvoice_runtime.frontend.audio_file import AudioLimits
from cosyvoice_runtime.frontend.errors import InvalidAudioError, PromptTooLongError, PromptTooShortError
from cosyvoice_runtime.frontend.special_tokens import Family

logger = logging.getLogger(__name__)

TOKENIZER_SR = features.WHISPER_SR  # speech tokenizer and CAM++ run at 16 kHz


@dataclass(frozen=True, slots=True)
class PromptLimits:
    min_seconds: float = 1.0  # below this a prompt carries no usable voice
    max_seconds: float = 30.0  # reference assertion of the speech tokenizer
    min_source_rate: int = TOKENIZER_SR  # reference assertion: no upsampling of the prompt
    max_source_rate: int = 192_000  # above this a rate is absurd for a voice prompt
    max_channels: int = 8  # of an uploaded file, before the mono mix

    def audio_limits(self) -> AudioLimits:
        """The same bounds for decoding a prompt file (checked on its header, before decoding)."""
        return AudioLimits(max_seconds=self.max_seconds, min_rate_hz=self.min_source_rate,
                           max_rate_hz=self.max_source_rate, max_channels=self.max_channels)


def align_prompt(mel: np.ndarray, tokens: np.ndarray, ratio: int) -> tuple[np.ndarray, np.ndarray]:
    """The 1:``ratio`` token/mel rule (§2.8): ``L = min(T_m // ratio, Ls)``; keep ``ratio*L`` frames, ``L`` tokens."""
    n = min(mel.shape[0] // ratio, tokens.shape[0])
    return mel[: ratio * n], tokens[:n]


def _session(path: Path, use_gpu: bool):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if use_gpu and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(path), sess_options=opts, providers=providers)


class PromptEncoder:
    """CAM++ + speech tokenizer ONNX sessions and the prompt mel of one model family.

    Args:
        campplus_path / speech_tokenizer_path: the model directory's ONNX files.
        mel: the model's ``feat_extractor`` parameters (``ModelSpec.mel``).
        token_mel_ratio: mel frames per speech token (2).
        use_gpu: run the speech tokenizer on CUDA when available (CAM++ stays on CPU, as in the reference).
    """

    def __init__(self, family: Family, campplus_path: str | Path, speech_tokenizer_path: str | Path,
                 mel: MelSpec, token_mel_ratio: int, limits: PromptLimits = PromptLimits(),
                 use_gpu: bool = False) -> None:
        self.family = family
        self.mel_spec = mel
        self.ratio = token_mel_ratio
        self.limits = limits
        self._campplus = _session(Path(campplus_path), use_gpu=False)
        self._tokenizer = _session(Path(speech_tokenizer_path), use_gpu=use_gpu)

    def check(self, wav: Waveform) -> None:
        lim = self.limits
        # NOTE: the rate is checked before anything is resampled: resampling work and memory
        # scale with it, and callers of the handle API choose it freely.
        if wav.sample_rate < lim.min_source_rate:
            raise InvalidAudioError(f"prompt audio is sampled at {wav.sample_rate} Hz, at least "
                                    f"{lim.min_source_rate} Hz is needed")
        if wav.sample_rate > lim.max_source_rate:
            raise InvalidAudioError(f"prompt audio is sampled at {wav.sample_rate} Hz, at most "
                                    f"{lim.max_source_rate} Hz is accepted")
        if wav.seconds < lim.min_seconds:
            raise PromptTooShortError(wav.seconds, lim.min_seconds)
        if wav.seconds > lim.max_seconds:
            raise PromptTooLongError(wav.seconds, lim.max_seconds)
        if not np.any(wav.samples):
            raise InvalidAudioError("prompt audio is silent (all samples are zero)")

    def speech_tokens(self, wav16: torch.Tensor) -> np.ndarray:
        """16 kHz ``(N,)`` -> int32 ``(Ls,)`` ids (inputs looked up by position, as the reference)."""
        feat = features.whisper_log_mel(wav16[None]).numpy()
        inputs = self._tokenizer.get_inputs()
        out = self._tokenizer.run(None, {inputs[0].name: feat,
                                         inputs[1].name: np.array([feat.shape[2]], dtype=np.int32)})[0]
        return np.asarray(out).reshape(-1).astype(np.int32)

    def speaker_embedding(self, wav16: torch.Tensor) -> np.ndarray:
        """16 kHz ``(N,)`` -> float32 ``(192,)``: fbank minus its per-bin mean, then CAM++."""
        feat = features.kaldi_fbank(wav16)
        feat = feat - feat.mean(dim=0, keepdim=True)
        name = self._campplus.get_inputs()[0].name
        return np.asarray(self._campplus.run(None, {name: feat[None].numpy()})[0]).reshape(-1).astype(np.float32)

    def prompt_mel(self, wav24: torch.Tensor) -> np.ndarray:
        """24 kHz ``(N,)`` -> float32 ``(floor(N / 480), 80)`` time-major."""
        return features.prompt_mel(wav24[None], self.mel_spec)[0].T.contiguous().numpy()

    def encode(self, wav: Waveform) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Validated waveform -> aligned ``(speech_tokens, mel, embedding)``.

        Both the 16 kHz and the 24 kHz copy are resampled from the original rate (§2.4).
        """
        self.check(wav)
        x = torch.from_numpy(wav.samples)
        wav16 = resample(x, wav.sample_rate, TOKENIZER_SR)
        wav24 = resample(x, wav.sample_rate, self.mel_spec.sampling_rate)
        tokens = self.speech_tokens(wav16)
        embedding = self.speaker_embedding(wav16)
        mel, tokens = align_prompt(self.prompt_mel(wav24), tokens, self.ratio)
        if tokens.shape[0] == 0:
            raise PromptTooShortError(wav.seconds, self.limits.min_seconds)
        return tokens, np.ascontiguousarray(mel), embedding
