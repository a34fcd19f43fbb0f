"""Prompt audio decoding, validation and the windowed-sinc resampler."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cosyvoice_runtime.frontend.audio import decode_audio, resample, to_waveform
from cosyvoice_runtime.frontend.errors import InvalidAudioError, InvalidInputError
from tests.runtime.frontend.conftest import encode, tone


@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("WAV", "FLOAT"), ("FLAC", None), ("OGG", "VORBIS"),
                                         ("MP3", None)])
def test_decode_formats_and_mono_mix(fmt, subtype):
    import soundfile as sf

    if fmt not in sf.available_formats():
        pytest.skip(f"libsndfile without {fmt}")
    sr = 24000
    stereo = tone(1.0, sr, channels=2)
    wav = decode_audio(encode(stereo, sr, fmt, subtype))
    assert wav.sample_rate == sr and wav.samples.dtype == np.float32 and wav.samples.ndim == 1
    ref = stereo.mean(axis=1)
    n = min(len(ref), len(wav.samples))
    assert abs(len(wav.samples) - len(ref)) <= 2048  # lossy codecs may pad
    if fmt in ("WAV", "FLAC"):
        assert np.abs(wav.samples[:n] - ref[:n]).max() < 1e-3
    else:  # lossy: same dominant pitch and level
        spec = np.abs(np.fft.rfft(wav.samples[:sr]))
        assert abs(np.argmax(spec) - 220) <= 2


@pytest.mark.parametrize("data", [b"", b"not audio at all", b"RIFF\x00\x00\x00\x00WAVEfmt ", bytes(1000)])
def test_not_audio_is_a_typed_error(data):
    with pytest.raises(InvalidAudioError):
        decode_audio(data)


def test_sample_validation():
    with pytest.raises(InvalidAudioError, match="sample rate"):
        to_waveform(np.zeros(100, np.float32), 0)
    with pytest.raises(InvalidAudioError, match="sample rate"):
        to_waveform(np.zeros(100, np.float32), "abc")
    x = np.ones(100, np.float32)
    x[5] = np.nan
    with pytest.raises(InvalidAudioError, match="NaN"):
        to_waveform(x, 16000)
    with pytest.raises(InvalidAudioError, match="no samples"):
        to_waveform(np.zeros(0, np.float32), 16000)
    with pytest.raises(InvalidAudioError):
        to_waveform(np.zeros((2, 2, 2), np.float32), 16000)
    assert issubclass(InvalidAudioError, InvalidInputError)
    pcm = to_waveform(np.array([[32767, 0], [-32767, 0]], np.int16), 16000)
    assert np.allclose(pcm.samples, [0.5, -0.5])


@pytest.mark.parametrize("orig,new", [(44100, 16000), (48000, 24000), (16000, 24000), (22050, 16000), (24000, 16000)])
def test_resample_length_and_frequency(orig, new):
    n = orig * 1 + 123
    t = torch.arange(n, dtype=torch.float64) / orig
    freq = 1000.0
    x = torch.sin(2 * math.pi * freq * t).float()
    y = resample(x, orig, new)
    assert y.shape == (math.ceil(n * new / orig),)
    # Compare with the ideal sine away from the edges (filter transients).
    ty = torch.arange(y.shape[0], dtype=torch.float64) / new
    ideal = torch.sin(2 * math.pi * freq * ty)
    mid = slice(200, y.shape[0] - 200)
    assert (y[mid].double() - ideal[mid]).abs().max() < 2e-3
    spec = torch.fft.rfft(y[: new].double()).abs()
    assert int(spec.argmax()) == int(freq)


def test_resample_removes_content_above_new_nyquist():
    orig, new = 48000, 16000
    t = torch.arange(orig, dtype=torch.float64) / orig
    x = torch.sin(2 * math.pi * 12000 * t).float()  # above 8 kHz: must be filtered, not aliased
    y = resample(x, orig, new)
    assert y[100:-100].abs().max() < 1e-2


def test_resample_identity_batch_and_dc():
    x = torch.randn(2, 1000)
    assert resample(x, 16000, 16000) is x
    y = resample(x, 48000, 16000)
    assert y.shape == (2, 334)
    assert torch.allclose(y[0], resample(x[0], 48000, 16000), atol=1e-6)
    dc = resample(torch.ones(4800), 48000, 24000)
    assert (dc[50:-50] - 1).abs().max() < 1e-3  # unity gain at DC


@pytest.mark.parametrize("orig,new", [(44101, 16000), (96001, 24000), (16001, 16000), (191999, 24000), (8000, 24000)])
def test_resample_odd_rates(orig, new):
    n = orig * 2 + 17
    t = torch.arange(n, dtype=torch.float64) / orig
    x = torch.sin(2 * math.pi * 1000.0 * t).float()
    y = resample(x, orig, new)
    assert y.shape == (math.ceil(n * new / orig),) and y.dtype == torch.float32
    ty = torch.arange(y.shape[0], dtype=torch.float64) / new
    mid = slice(400, y.shape[0] - 400)
    assert (y[mid].double() - torch.sin(2 * math.pi * 1000.0 * ty[mid])).abs().max() < 2e-3
    batch = resample(torch.stack([x, -x]), orig, new)
    assert batch.shape == (2, y.shape[0]) and torch.allclose(batch[0], y) and torch.allclose(batch[1], -y)


def test_common_rates_keep_the_reference_sinc_and_its_cache_is_bounded():
    from cosyvoice_runtime.frontend import audio

    for orig in (22050, 44100, 48000, 96000, 11025, 32000):
        for new in (16000, 24000):
            g = math.gcd(orig, new)
            assert audio.kernel_taps(orig // g, new // g) <= audio.MAX_KERNEL_TAPS  # the torchaudio algorithm
    resample(torch.randn(50000), 44101, 16000)
    info = audio._sinc_kernel.cache_info()
    assert info.maxsize == audio.KERNEL_CACHE
    assert audio.kernel_taps(44101, 16000) > audio.MAX_KERNEL_TAPS


_BOUNDED = """
import resource, sys, torch, psutil
sys.path.insert(0, {root!r})
from cosyvoice_runtime.frontend.audio import resample
limit = psutil.Process().memory_info().vms + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
for orig, new in ((44101, 16000), (96001, 24000), (44101, 24000)):
    y = resample(torch.zeros(orig * 30), orig, new)
    assert y.shape == (new * 30,), y.shape
print("ok")
"""


def test_odd_rates_resample_30_s_within_one_gib_of_address_space():
    """Before soxr, 44101 -> 16 kHz built a 5.6 GB filter table and 96001 -> 24 kHz an 18 GB one."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", _BOUNDED.format(root=root)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
