"""Prompt audio: decode bytes, validate, mono-mix, resample (spec §2.4).

Decoding uses libsndfile (``soundfile``): WAV, FLAC, OGG/Vorbis/Opus and, with libsndfile >= 1.1,
MP3. Every failure becomes an :class:`InvalidAudioError` with a message meant for the client.

The resampler is torchaudio's ``Resample`` algorithm with its defaults (Hann-windowed sinc,
``lowpass_filter_width=6``, ``rolloff=0.99``), reimplemented in torch because torchaudio is not a
dependency: a polyphase filter bank of ``new`` phases applied with a strided ``conv1d``.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from cosyvoice_runtime.frontend.errors import InvalidAudioError

LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99


@dataclass(frozen=True, slots=True)
class Waveform:
    """Mono float32 samples in [-1, 1] (numpy ``(N,)``) at ``sample_rate`` Hz."""

    samples: np.ndarray
    sample_rate: int

    @property
    def seconds(self) -> float:
        return self.samples.shape[0] / self.sample_rate


def decode_audio(data: bytes) -> Waveform:
    """Decode an audio file given as bytes and mix it down to mono."""
    import soundfile as sf

    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise InvalidAudioError("prompt audio is empty")
    try:
        samples, rate = sf.read(io.BytesIO(bytes(data)), dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile's errors are not a stable type across versions
        raise InvalidAudioError(f"prompt audio could not be decoded (WAV, FLAC, OGG or MP3 expected): {exc}") from None
    return to_waveform(samples, rate)


def to_waveform(samples, sample_rate: int) -> Waveform:
    """Validate raw samples ``(N,)`` or ``(N, channels)`` and mix to mono float32."""
    try:
        rate = int(sample_rate)
    except (TypeError, ValueError):
        raise InvalidAudioError(f"sample rate must be a positive integer, got {sample_rate!r}") from None
    if rate <= 0:
        raise InvalidAudioError(f"sample rate must be a positive integer, got {sample_rate!r}")
    x = np.asarray(samples)
    if x.dtype.kind not in "fiu" or x.size == 0:
        raise InvalidAudioError("prompt audio has no samples")
    if x.ndim not in (1, 2):
        raise InvalidAudioError(f"samples must be (N,) or (N, channels), got shape {x.shape}")
    if x.dtype.kind in "iu":  # integer PCM -> [-1, 1]
        x = x.astype(np.float32) / float(np.iinfo(x.dtype).max)
    if x.ndim == 2:
        x = x.astype(np.float32).mean(axis=1)  # average channels (reference mono mix)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise InvalidAudioError("prompt audio contains NaN or infinite samples")
    return Waveform(x, rate)


@lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """Polyphase kernel ``(new, 1, 2*width + orig)`` (float64) and the half-width, reduced rates."""
    base = min(orig, new) * ROLLOFF  # cutoff relative to the lower rate, slightly below Nyquist
    width = math.ceil(LOWPASS_FILTER_WIDTH * orig / base)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx
    t = (t * base).clamp(-LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
    window = torch.cos(t * math.pi / LOWPASS_FILTER_WIDTH / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)
    return sinc * window * (base / orig), width


def resample(x: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """Resample ``x (..., N)`` -> ``(..., ceil(N * new / orig))`` with a Hann-windowed sinc."""
    if orig_rate == new_rate:
        return x
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernel, width = _sinc_kernel(orig, new)
    kernel = kernel.to(device=x.device, dtype=x.dtype)
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    n = flat.shape[-1]
    padded = torch.nn.functional.pad(flat, (width, width + orig))
    out = torch.nn.functional.conv1d(padded[:, None], kernel, stride=orig)  # (B, new, frames)
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)
    target = math.ceil(new * n / orig)
    return out[:, :target].reshape(*shape[:-1], target)
