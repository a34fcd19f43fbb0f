"""Spectral features of the frontend, written from the algorithms' definitions (no librosa/whisper).

* :func:`prompt_mel` -- Matcha ``mel_spectrogram`` (spec §2.7): prompt mel at 24 kHz, 50 Hz.
* :func:`whisper_log_mel` -- Whisper log-mel, 128 bins (spec §2.5): speech-tokenizer input.
* :func:`kaldi_fbank` -- Kaldi-compatible fbank, 80 bins, dither 0 (spec §2.6): CAM++ input.

Filter banks are computed in float64 and cached; the transforms run in the input's dtype/device.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from cosyvoice_runtime.config import MelSpec

# Whisper front (fixed by the speech tokenizers' training).
WHISPER_SR = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160
WHISPER_N_MELS = 128
WHISPER_DYNAMIC_RANGE = 8.0  # log10 units kept below the utterance maximum
# Kaldi fbank defaults as used for CAM++.
KALDI_FRAME_MS = 25.0
KALDI_SHIFT_MS = 10.0
KALDI_PREEMPH = 0.97
KALDI_LOW_FREQ = 20.0
KALDI_POVEY_POWER = 0.85
MATCHA_LOG_FLOOR = 1e-5
MATCHA_MAG_EPS = 1e-9


# -- mel scales ---------------------------------------------------------------------------------
def _hz_to_slaney_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's Auditory Toolbox scale: linear below 1 kHz, logarithmic above (librosa htk=False)."""
    f = np.asarray(f, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    mel = f / f_sp
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-300) / min_log_hz) / logstep, mel)


def _slaney_mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


@lru_cache(maxsize=8)
def slaney_mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """Triangular filters on the Slaney mel scale with area ("slaney") normalisation.

    Returns float64 ``(n_mels, 1 + n_fft // 2)``; the same definition as librosa's default
    ``filters.mel`` (which Matcha and Whisper's ``mel_filters.npz`` use).
    """
    fmax = sr / 2.0 if fmax is None else float(fmax)
    fft_freqs = np.linspace(0.0, sr / 2.0, 1 + n_fft // 2)
    mel_pts = np.linspace(_hz_to_slaney_mel(fmin), _hz_to_slaney_mel(fmax), n_mels + 2)
    hz_pts = _slaney_mel_to_hz(mel_pts)
    fdiff = np.diff(hz_pts)
    ramps = hz_pts[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    enorm = 2.0 / (hz_pts[2:n_mels + 2] - hz_pts[:n_mels])  # equal area per filter
    return weights * enorm[:, None]


def _kaldi_mel(f):
    return 1127.0 * np.log(1.0 + np.asarray(f, dtype=np.float64) / 700.0)


@lru_cache(maxsize=4)
def kaldi_mel_banks(n_mels: int, padded_window: int, sr: int, low_freq: float, high_freq: float) -> np.ndarray:
    """Kaldi ``MelBanks``: triangles on the HTK mel scale over FFT bins, ``(n_mels, padded//2 + 1)``.

    The Nyquist bin gets weight 0 (Kaldi builds ``padded/2`` bins and the power spectrum has one more).
    """
    n_bins = padded_window // 2
    bin_hz = sr / padded_window
    mel_low, mel_high = _kaldi_mel(low_freq), _kaldi_mel(high_freq)
    delta = (mel_high - mel_low) / (n_mels + 1)
    b = np.arange(n_mels, dtype=np.float64)[:, None]
    left, center, right = mel_low + b * delta, mel_low + (b + 1) * delta, mel_low + (b + 2) * delta
    mel = _kaldi_mel(bin_hz * np.arange(n_bins, dtype=np.float64))[None, :]
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = np.maximum(0.0, np.minimum(up, down))
    return np.pad(banks, ((0, 0), (0, 1)))


def _filters(arr: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(arr).to(device=like.device, dtype=like.dtype)


# -- transforms ---------------------------------------------------------------------------------
def prompt_mel(wav: torch.Tensor, mel: MelSpec) -> torch.Tensor:
    """Matcha mel of a 24 kHz waveform ``(B, N)`` -> ``(B, num_mels, floor(N / hop))``.

    Reflect-pad ``(n_fft - hop) / 2`` both sides, STFT without centring, magnitude
    ``sqrt(|X|^2 + 1e-9)``, Slaney mel filters, ``log(max(x, 1e-5))``.
    """
    pad = (mel.n_fft - mel.hop_size) // 2
    y = torch.nn.functional.pad(wav[:, None], (pad, pad), mode="reflect")[:, 0]
    window = torch.hann_window(mel.win_size, periodic=True, device=wav.device, dtype=wav.dtype)
    spec = torch.stft(y, mel.n_fft, hop_length=mel.hop_size, win_length=mel.win_size, window=window,
                      center=False, normalized=False, onesided=True, return_complex=True)
    mag = torch.sqrt(spec.real ** 2 + spec.imag ** 2 + MATCHA_MAG_EPS)
    basis = _filters(slaney_mel_filters(mel.sampling_rate, mel.n_fft, mel.num_mels, float(mel.fmin),
                                        None if mel.fmax is None else float(mel.fmax)).astype(np.float32), wav)
    return torch.log(torch.clamp(basis @ mag, min=MATCHA_LOG_FLOOR))


def whisper_log_mel(wav16: torch.Tensor, n_mels: int = WHISPER_N_MELS) -> torch.Tensor:
    """Whisper log-mel of a 16 kHz waveform ``(B, N)`` -> ``(B, n_mels, floor(N / 160))``.

    Centred STFT (reflect pad 200), periodic Hann 400, power spectrum, last frame dropped,
    ``log10(max(x, 1e-10))`` clipped at (utterance max - 8), then ``(x + 4) / 4``.
    """
    window = torch.hann_window(WHISPER_N_FFT, periodic=True, device=wav16.device, dtype=wav16.dtype)
    spec = torch.stft(wav16, WHISPER_N_FFT, WHISPER_HOP, window=window, center=True, pad_mode="reflect",
                      return_complex=True)
    power = spec[..., :-1].abs() ** 2
    basis = _filters(slaney_mel_filters(WHISPER_SR, WHISPER_N_FFT, n_mels).astype(np.float32), wav16)
    log_spec = torch.clamp(basis @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - WHISPER_DYNAMIC_RANGE)
    return (log_spec + 4.0) / 4.0


def kaldi_fbank(wav16: torch.Tensor, n_mels: int = 80, sample_rate: int = WHISPER_SR) -> torch.Tensor:
    """Kaldi fbank of a mono waveform ``(N,)`` -> ``(T_f, n_mels)``, ``T_f = 1 + (N - 400) // 160``.

    snip_edges, no dither, DC removal, pre-emphasis 0.97, Povey window, zero-pad to a power of
    two, power spectrum, HTK-mel triangles from 20 Hz to Nyquist, natural log floored at float eps.
    """
    frame = int(sample_rate * KALDI_FRAME_MS / 1000)
    shift = int(sample_rate * KALDI_SHIFT_MS / 1000)
    if wav16.shape[-1] < frame:
        return wav16.new_zeros((0, n_mels))
    frames = wav16.unfold(-1, frame, shift)  # (T_f, frame)
    frames = frames - frames.mean(dim=-1, keepdim=True)
    prev = torch.cat([frames[:, :1], frames[:, :-1]], dim=-1)  # Kaldi: x[0] uses itself
    frames = frames - KALDI_PREEMPH * prev
    window = torch.hann_window(frame, periodic=False, device=wav16.device, dtype=wav16.dtype) ** KALDI_POVEY_POWER
    padded = 1 << (frame - 1).bit_length()
    spec = torch.fft.rfft(frames * window, n=padded)
    power = spec.real ** 2 + spec.imag ** 2
    banks = _filters(kaldi_mel_banks(n_mels, padded, sample_rate, KALDI_LOW_FREQ, sample_rate / 2).astype(np.float32),
                     wav16)
    energies = power @ banks.T
    return torch.clamp(energies, min=torch.finfo(wav16.dtype).eps).log()
