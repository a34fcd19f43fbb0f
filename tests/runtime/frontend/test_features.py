"""Whisper log-mel, Kaldi fbank and the prompt mel against independent float64 loop references."""
from __future__ import annotations

import math

import numpy as np
import torch

from cosyvoice_runtime.config import MelSpec
from cosyvoice_runtime.frontend import features
from tests.runtime.frontend.conftest import tone


def _slaney_mel(f):
    return f / (200 / 3) if f < 1000 else 15 + math.log(f / 1000) / (math.log(6.4) / 27)


def _slaney_hz(m):
    return m * (200 / 3) if m < 15 else 1000 * math.exp((m - 15) * math.log(6.4) / 27)


def _loop_filters(sr, n_fft, n_mels, fmax):
    edges = [_slaney_hz(_slaney_mel(0) + k * (_slaney_mel(fmax) - _slaney_mel(0)) / (n_mels + 1)) for k in range(n_mels + 2)]
    w = np.zeros((n_mels, n_fft // 2 + 1))
    for m in range(n_mels):
        lo, c, hi = edges[m], edges[m + 1], edges[m + 2]
        for k in range(n_fft // 2 + 1):
            f = k * sr / n_fft
            if lo < f < hi:
                w[m, k] = ((f - lo) / (c - lo) if f <= c else (hi - f) / (hi - c)) * 2 / (hi - lo)
    return w


def test_slaney_filters_match_loop_definition_and_have_unit_area():
    ours = features.slaney_mel_filters(16000, 400, 128)
    assert ours.shape == (128, 201)
    assert np.abs(ours - _loop_filters(16000, 400, 128, 8000)).max() < 1e-9
    df = 16000 / 400
    wide = ours[100:]  # filters spanning several bins integrate to ~1 (area normalisation)
    assert np.allclose(wide.sum(axis=1) * df, 1.0, atol=0.05)


def test_whisper_log_mel_against_loop_reference():
    sr = 16000
    x = tone(0.7, sr, freqs=(300.0, 2500.0)) + 0.01 * np.random.default_rng(0).standard_normal(int(0.7 * sr)).astype(np.float32)
    ours = features.whisper_log_mel(torch.from_numpy(x)[None])[0].numpy()
    n_frames = len(x) // 160
    assert ours.shape == (128, n_frames)
    xp = np.pad(x.astype(np.float64), 200, mode="reflect")
    win = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 400)  # periodic Hann
    fil = _loop_filters(sr, 400, 128, 8000)
    ref = np.stack([fil @ np.abs(np.fft.rfft(xp[i * 160:i * 160 + 400] * win)) ** 2 for i in range(n_frames)], 1)
    ref = np.log10(np.maximum(ref, 1e-10))
    ref = (np.maximum(ref, ref.max() - 8) + 4) / 4
    assert np.abs(ours - ref).max() < 2e-4
    assert ours.min() >= (ours.max() - 2.0) - 1e-6  # dynamic range clip: 8 log10 units / 4


def _kaldi_mel(f):
    return 1127 * math.log(1 + f / 700)


def test_kaldi_fbank_against_loop_reference():
    sr = 16000
    x = tone(0.5, sr, freqs=(440.0, 1800.0)) + 0.02 * np.random.default_rng(1).standard_normal(8000).astype(np.float32)
    ours = features.kaldi_fbank(torch.from_numpy(x)).numpy()
    n = 1 + (len(x) - 400) // 160
    assert ours.shape == (n, 80)
    povey = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 399)) ** 0.85
    lo, hi = _kaldi_mel(20), _kaldi_mel(8000)
    d = (hi - lo) / 81
    ref = np.zeros((n, 80))
    for t in range(n):
        fr = x[t * 160:t * 160 + 400].astype(np.float64)
        fr = fr - fr.mean()
        fr = fr - 0.97 * np.concatenate([fr[:1], fr[:-1]])
        p = np.abs(np.fft.rfft(fr * povey, 512)) ** 2
        for m in range(80):
            acc = 0.0
            for k in range(256):
                mel = _kaldi_mel(k * sr / 512)
                l, c, r = lo + m * d, lo + (m + 1) * d, lo + (m + 2) * d
                if l < mel < r:
                    acc += p[k] * ((mel - l) / (c - l) if mel <= c else (r - mel) / (r - c))
            ref[t, m] = math.log(max(acc, np.finfo(np.float32).eps))
    assert np.abs(ours - ref).max() < 2e-3


def test_kaldi_fbank_tone_peaks_in_the_right_bin_and_short_input():
    x = torch.from_numpy(tone(0.3, 16000, freqs=(1000.0,), amps=(0.5,)))
    fb = features.kaldi_fbank(x)
    centers = [700 * (math.exp((_kaldi_mel(20) + (m + 1) * (_kaldi_mel(8000) - _kaldi_mel(20)) / 81) / 1127) - 1)
               for m in range(80)]
    expected = int(np.argmin([abs(c - 1000) for c in centers]))
    assert abs(int(fb.mean(0).argmax()) - expected) <= 1
    assert features.kaldi_fbank(torch.zeros(399)).shape == (0, 80)


def test_prompt_mel_frames_and_fmax():
    x = torch.from_numpy(tone(1.0, 24000, freqs=(10000.0,), amps=(0.5,)))[None]
    cv2 = MelSpec(1920, 80, 24000, 480, 1920, 0, 8000)
    cv3 = MelSpec(1920, 80, 24000, 480, 1920, 0, None)
    m2, m3 = features.prompt_mel(x, cv2), features.prompt_mel(x, cv3)
    assert m2.shape == m3.shape == (1, 80, 24000 // 480)
    # a 10 kHz tone is invisible below fmax 8 kHz (log floor) and strong in the CV3 mel
    inner = slice(2, -2)  # edge frames see the reflect-padding discontinuity
    assert float(m2[..., inner].max()) < -8 and float(m3[..., inner].max()) > -2
