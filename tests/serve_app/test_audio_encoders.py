"""PyAV encoders: every format streams as one valid file, whole files have exact headers,
rate changes, and the tempo stretcher used for speeds beyond the model's own range."""
from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soundfile as sf

from deployments.protocol import InvalidInputError
from serve_app.audio_codec import TempoStretcher, encode_audio, make_stream_encoder, to_int16

SR = 24000
# Decoded length may exceed the input by encoder delay + padding to whole frames.
SLACK = {"mp3": 2 * 1152, "aac": 2 * 1024, "opus": 960, "flac": 0}


def _tone(n: int, sr: int = SR, hz: float = 440.0) -> np.ndarray:
    return (0.4 * np.sin(2 * np.pi * hz * np.arange(n) / sr)).astype(np.float32)


def _decode(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.audio[0]
        y = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(stream)])  # mono
        scale = 32768.0 if y.dtype == np.int16 else 1.0
        return y.astype(np.float32) / scale, stream.rate


def _dominant_hz(y: np.ndarray, sr: int) -> float:
    spec = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    return float(np.argmax(spec) * sr / len(y))


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
def test_streamed_body_is_one_valid_file_that_arrives_as_it_is_made(fmt):
    x = _tone(2 * SR)
    enc = make_stream_encoder(fmt, SR)
    parts = [enc.encode(c) for c in np.array_split(x, 10)]
    tail = enc.finish()
    # bytes leave with the chunks, not only at the end
    assert sum(len(p) for p in parts[:5]) > 0 and sum(len(p) > 0 for p in parts) >= 5
    y, sr = _decode(b"".join(parts) + tail)
    assert sr == (48000 if fmt == "opus" else SR)  # Ogg Opus always decodes at 48 kHz
    expected = len(x) * sr // SR
    assert expected - sr // 100 <= len(y) <= expected + SLACK[fmt] * sr // SR
    assert abs(_dominant_hz(y, sr) - 440) < 5
    if fmt == "flac":  # lossless after the s16 conversion
        np.testing.assert_allclose(y, to_int16(x) / 32768.0, atol=2 / 32768)  # s16 rounding


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav"])
def test_whole_file_has_exact_headers(fmt):
    x = _tone(SR + 123)
    data = encode_audio(x, SR, fmt)
    if fmt in ("flac", "wav"):
        info = sf.info(io.BytesIO(data))
        assert (info.frames, info.samplerate) == (len(x), SR)  # exact STREAMINFO / RIFF sizes
    y, sr = _decode(data)
    expected = len(x) * sr // SR
    assert expected - sr // 100 <= len(y) <= expected + SLACK.get(fmt, 0) * sr // SR


@pytest.mark.parametrize("fmt, out_rate, bit_rate", [("pcm", 16000, None), ("wav", 16000, None),
                                                     ("mp3", 44100, 128_000)])
def test_output_rate_and_bit_rate(fmt, out_rate, bit_rate):
    x = _tone(2 * SR, hz=1000)
    enc = make_stream_encoder(fmt, SR, out_rate=out_rate, bit_rate=bit_rate)
    data = b"".join(enc.encode(c) for c in np.array_split(x, 4)) + enc.finish()
    assert enc.out_rate == out_rate
    if fmt == "pcm":
        y, sr = np.frombuffer(data, "<i2").astype(np.float32) / 32768, out_rate
    else:
        y, sr = _decode(data)
    assert sr == out_rate and abs(len(y) - 2 * out_rate) < out_rate // 20
    assert abs(_dominant_hz(y, sr) - 1000) < 5
    if bit_rate:
        assert abs(len(data) * 8 / 2.0 - bit_rate) < 0.15 * bit_rate  # CBR: bytes per second


def test_encoder_takes_its_next_rate_when_the_model_rate_is_not_one_of_its_own():
    enc = make_stream_encoder("opus", 22050)  # libopus: 8/12/16/24/48 kHz
    assert enc.out_rate == 24000
    data = enc.encode(_tone(22050, sr=22050)) + enc.finish()
    y, sr = _decode(data)
    assert abs(len(y) - sr) < sr // 20


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.6, 2.0, 4.0])
def test_tempo_stretcher_changes_duration_not_pitch(factor):
    x = _tone(3 * SR)
    st = TempoStretcher(SR, factor)
    y = np.concatenate([st.process(c) for c in np.array_split(x, 9)] + [st.finish()])
    assert abs(len(y) - len(x) / factor) < 0.02 * len(x) / factor
    assert abs(_dominant_hz(y, SR) - 440) < 5


def test_tempo_stretcher_streams_and_rejects_nonsense():
    st = TempoStretcher(SR, 2.0)
    outs = [st.process(c) for c in np.array_split(_tone(2 * SR), 8)]
    assert sum(o.size > 0 for o in outs) >= 6  # output with the input, not only at the end
    with pytest.raises(InvalidInputError):
        TempoStretcher(SR, 0.0)
