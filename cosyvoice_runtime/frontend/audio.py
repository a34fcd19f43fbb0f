"""Prompt audio: decode bytes, validate, mono-mix, resample (spec §2.4).

Decoding uses libsndfile (``soundfile``): WAV, FLAC, OGG/Vorbis/Opus and, with libsndfile >= 1.1,
MP3, header first and bounded (:mod:`cosyvoice_runtime.frontend.audio_file`). Every failure
becomes an :class:`InvalidAudioError` with a message meant for the client.

The resampler is torchaudio's ``Resample`` algorithm with its defaults (Hann-windowed sinc,
``lowpass_filter_width=6``, ``rolloff=0.99``), reimplemented in torch because torchaudio is not a
dependency: a polyphase filter bank of ``new`` phases applied with a strided ``conv1d``, where
``orig/new`` is the gcd-reduced rate ratio. Its table holds ``new * (2 * width + orig)`` taps and
each output sample costs ``2 * width + orig`` multiplies, so an odd rate (44101 Hz -> 16 kHz does
not reduce) would ask for gigabytes. The table is used only while it stays within
:data:`MAX_KERNEL_TAPS` (every common rate: 22.05, 44.1, 48, 96 kHz...); other ratios go through
libsoxr (``soxr``, maintained, linear cost in the length for any ratio).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from cosyvoice_runtime.frontend.audio_file import AudioLimits, read_audio
from cosyvoice_runtime.frontend.errors import InvalidAudioError

LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99
MAX_KERNEL_TAPS = 1 << 20  # largest polyphase table built (8 MiB of float64); larger ratios use soxr
KERNEL_CACHE = 8


@dataclass(frozen=True, slots=True)
class Waveform:
    """Mono float32 samples in [-1, 1] (numpy ``(N,)``) at ``sample_rate`` Hz."""

    samples: np.ndarray
    sample_rate: int

    @property
    def seconds(self) -> float:
        return self.samples.shape[0] / self.sample_rate


def decode_audio(data: bytes, limits: AudioLimits | None = None) -> Waveform:
    """Decode an audio file given as bytes and mix it down to mono (header checked first)."""
    samples, rate = read_audio(data, limits or AudioLimits())
    return Waveform(samples, rate)


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


def _half_width(orig: int, new: int) -> int:
    return math.ceil(LOWPASS_FILTER_WIDTH * orig / (min(orig, new) * ROLLOFF))


def kernel_taps(orig: int, new: int) -> int:
    """Size of the polyphase table for the reduced ratio ``orig/new``."""
    return new * (2 * _half_width(orig, new) + orig)


# NOTE: the cache holds at most KERNEL_CACHE tables of at most MAX_KERNEL_TAPS float64 each
# (8 MiB), 64 MiB in all, whatever rates arrive.
@lru_cache(maxsize=KERNEL_CACHE)
def _sinc_kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """Polyphase kernel ``(new, 1, 2*width + orig)`` (float64) and the half-width, reduced rates."""
    if kernel_taps(orig, new) > MAX_KERNEL_TAPS:
        raise ValueError(f"polyphase table for {orig}/{new} exceeds {MAX_KERNEL_TAPS} taps")
    base = min(orig, new) * ROLLOFF  # cutoff relative to the lower rate, slightly below Nyquist
    width = _half_width(orig, new)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx
    t = (t * base).clamp(-LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
    window = torch.cos(t * math.pi / LOWPASS_FILTER_WIDTH / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)
    return sinc * window * (base / orig), width


def resample(x: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """Resample ``x (..., N)`` -> ``(..., ceil(N * new / orig))``.

    Hann-windowed sinc (torchaudio's algorithm) when the reduced ratio's table fits
    :data:`MAX_KERNEL_TAPS`, else libsoxr; memory and time are linear in ``N`` either way.
    """
    if orig_rate == new_rate:
        return x
    if not all(isinstance(r, numbers.Integral) and r > 0 for r in (orig_rate, new_rate)):
        raise InvalidAudioError(f"sample rates must be positive integers, got {orig_rate!r} -> {new_rate!r}")
    orig_rate, new_rate = int(orig_rate), int(new_rate)
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    if kernel_taps(orig, new) > MAX_KERNEL_TAPS:
        return _soxr_resample(x, orig_rate, new_rate)
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


def _soxr_resample(x: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """libsoxr at high quality, trimmed or zero-padded to the sinc path's output length."""
    import soxr

    shape = x.shape
    flat = x.reshape(-1, shape[-1]).detach().cpu().numpy().astype(np.float32, copy=False)
    target = math.ceil(new_rate * shape[-1] / orig_rate)
    out = np.zeros((flat.shape[0], target), dtype=np.float32)
    for i, row in enumerate(flat):
        y = soxr.resample(row, orig_rate, new_rate, quality="HQ")
        out[i, : min(target, y.shape[0])] = y[:target]
    return torch.from_numpy(out).to(device=x.device, dtype=x.dtype).reshape(*shape[:-1], target)
