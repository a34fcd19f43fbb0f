"""Audio encoders: whole and streamed output decodes back to the input."""
from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest
import soundfile as sf

from deployments.protocol import InvalidInputError
from serve_app.audio_codec import (
    UnsupportedFormatError,
    check_format,
    decode_upload,
    encode_audio,
    make_stream_encoder,
    supported_formats,
    to_int16,
)

SR = 24000


def _tone(n: int = SR) -> np.ndarray:
    t = np.arange(n, dtype=np.float32) / SR
    return (0.4 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def test_wav_whole_has_exact_sizes():
    x = _tone(12345)
    data = encode_audio(x, SR, "wav")
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (SR, 1, 2, 12345)
        pcm = np.frombuffer(w.readframes(12345), "<i2")
    np.testing.assert_array_equal(pcm, to_int16(x))


def test_pcm_is_s16le():
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0], np.float32)
    data = encode_audio(x, SR, "pcm")
    assert np.frombuffer(data, "<i2").tolist() == [0, 16383, -16383, 32767, -32767, 32767]


@pytest.mark.parametrize("fmt", ["wav", "pcm", "opus"])
def test_streamed_bytes_decode_to_the_concatenated_chunks(fmt):
    x = _tone(2 * SR)
    enc = make_stream_encoder(fmt, SR)
    out = b"".join(enc.encode(c) for c in np.array_split(x, 7)) + enc.finish()
    if fmt == "pcm":
        np.testing.assert_array_equal(np.frombuffer(out, "<i2"), to_int16(x))
        return
    if fmt == "wav":
        assert out[:4] == b"RIFF" and out[8:12] == b"WAVE"
        assert struct.unpack("<I", out[40:44])[0] == 0xFFFFFFFF  # streaming: unknown data size
        np.testing.assert_array_equal(np.frombuffer(out[44:], "<i2"), to_int16(x))
        return
    y, sr = sf.read(io.BytesIO(out), dtype="float32")
    assert sr == SR and abs(len(y) - len(x)) < SR // 50  # lossy codec, same duration
    assert 0.1 < np.sqrt(np.mean(y[SR // 10:] ** 2)) < 0.5


def test_empty_wav_stream_is_still_a_header():
    enc = make_stream_encoder("wav", SR)
    out = enc.finish()
    assert len(out) == 44 and out[:4] == b"RIFF"


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus"])
def test_whole_lossless_and_lossy_formats(fmt):
    if fmt not in supported_formats(stream=False):
        pytest.skip(f"libsndfile here cannot write {fmt}")
    x = _tone()
    y, sr = sf.read(io.BytesIO(encode_audio(x, SR, fmt)), dtype="float32")
    assert sr == SR and abs(len(y) - len(x)) < SR // 20
    if fmt == "flac":
        np.testing.assert_allclose(y, to_int16(x) / 32768.0, atol=1e-4)


def test_format_checks_list_what_is_supported():
    with pytest.raises(UnsupportedFormatError, match="supported: .*wav"):
        check_format("ogg_vorbis", stream=False)
    assert issubclass(UnsupportedFormatError, InvalidInputError)
    # every OpenAI format streams and is whole (PyAV encoders for the compressed ones)
    assert set(supported_formats(stream=True)) == set(supported_formats(stream=False)) == {
        "wav", "pcm", "flac", "mp3", "opus", "aac"}


def test_decode_upload():
    buf = io.BytesIO()
    sf.write(buf, np.stack([_tone(), _tone()], axis=1), 16000, format="WAV")
    audio, sr = decode_upload(buf.getvalue())
    assert sr == 16000 and audio.shape == (SR,) and audio.dtype == np.float32
    with pytest.raises(InvalidInputError, match="could not be decoded"):
        decode_upload(b"definitely not audio")
