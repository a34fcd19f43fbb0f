"""Uploaded prompt files: the header is checked before decoding, decoding is bounded."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import soundfile as sf

from bench.fuzz_uploads import encode as encode_blocks  # blockwise writes: libvorbis crashes on one long write
from cosyvoice_runtime.frontend import audio_file
from cosyvoice_runtime.frontend.audio import decode_audio
from cosyvoice_runtime.frontend.audio_file import AudioLimits, read_audio, read_header
from cosyvoice_runtime.frontend.errors import InvalidAudioError, PromptTooLongError
from tests.runtime.frontend.conftest import tone


def wav_header(channels: int, rate: int, data_bytes: int, bits: int = 16) -> bytes:
    block = channels * bits // 8
    return (b"RIFF" + struct.pack("<I", (36 + data_bytes) & 0xFFFFFFFF) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, channels, rate, (rate * block) & 0xFFFFFFFF, block, bits)
            + b"data" + struct.pack("<I", data_bytes & 0xFFFFFFFF))


def flac_with_total_samples(data: bytes, total: int) -> bytes:
    """Rewrite STREAMINFO's 36-bit total-samples field (0 = unknown, as a streaming encoder leaves it)."""
    assert data[:4] == b"fLaC"
    out = bytearray(data)
    field = int.from_bytes(out[21:26], "big")
    out[21:26] = ((field & ~((1 << 36) - 1)) | total).to_bytes(5, "big")
    return bytes(out)


class ReadSpy:
    """Counts the frames libsndfile is asked to decode."""

    def __init__(self, monkeypatch):
        self.frames = 0
        real = sf.SoundFile.read

        def read(f, frames=-1, *args, **kwargs):
            out = real(f, frames, *args, **kwargs)
            self.frames += out.shape[0]
            return out

        monkeypatch.setattr(sf.SoundFile, "read", read)


SILENCE_10_MIN = np.zeros(16000 * 600, np.float32)


@pytest.mark.parametrize("fmt,subtype", [("FLAC", None), ("OGG", "OPUS"), ("OGG", "VORBIS"), ("MP3", None)])
def test_compression_bomb_is_refused_from_its_header_before_decoding(fmt, subtype, monkeypatch):
    if fmt not in sf.available_formats():
        pytest.skip(f"libsndfile without {fmt}")
    bomb = encode_blocks(SILENCE_10_MIN, 16000, fmt, subtype)  # kilobytes that decode to 10 minutes
    assert len(bomb) < 3_000_000
    spy = ReadSpy(monkeypatch)
    with pytest.raises(PromptTooLongError, match="600.00 s"):
        decode_audio(bomb)
    assert spy.frames == 0  # nothing was decoded


def test_a_header_that_does_not_know_its_length_is_decoded_only_up_to_the_limit(monkeypatch):
    unknown = flac_with_total_samples(encode_blocks(tone(60.0, 16000), 16000, "FLAC"), 0)
    assert read_header(unknown).frames is None
    spy = ReadSpy(monkeypatch)
    with pytest.raises(PromptTooLongError):
        read_audio(unknown, AudioLimits(max_seconds=5.0))
    assert spy.frames == 5 * 16000 + 1  # one frame past the limit, not 60 s
    # libsndfile cannot read across the end of such a stream: the last partial block is lost
    samples, sr = read_audio(flac_with_total_samples(encode_blocks(tone(2.0, 16000), 16000, "FLAC"), 0))
    assert sr == 16000 and 32000 - audio_file.UNKNOWN_LENGTH_BLOCK_FRAMES <= samples.shape[0] <= 32000
    assert np.allclose(samples, tone(2.0, 16000)[:samples.shape[0]], atol=1e-4)


def test_a_header_that_understates_its_length_yields_at_most_what_it_states():
    lying = flac_with_total_samples(encode_blocks(tone(60.0, 16000), 16000, "FLAC"), 16000)
    samples, _ = read_audio(lying)
    assert samples.shape == (16000,)


@pytest.mark.parametrize("data,match", [
    (wav_header(1000, 16000, 20000) + bytes(20000), "1000 channels"),
    (wav_header(9, 16000, 18 * 100) + bytes(18 * 100), "9 channels"),
    (wav_header(1, 1, 20) + bytes(20), "1 Hz"),
    (wav_header(1, 7999, 2000) + bytes(2000), "7999 Hz"),
    (wav_header(1, 192001, 2000) + bytes(2000), "192001 Hz"),
    (wav_header(1, 0xFFFFFFFF, 20) + bytes(20), "could not be decoded"),
    (wav_header(1, 16000, 0), "no samples"),
    (wav_header(1, 16000, 1 << 31) + bytes(100), None),  # declared 2 GiB, holds 50 frames: decoded as 50
])
def test_absurd_headers(data, match):
    if match is None:
        samples, sr = read_audio(data)
        assert samples.shape == (50,) and sr == 16000
        return
    with pytest.raises(InvalidAudioError, match=match):
        read_audio(data)


def test_containers_outside_the_documented_ones_are_refused():
    aiff = encode_blocks(tone(1.0, 16000), 16000, "AIFF", "PCM_16")
    with pytest.raises(InvalidAudioError, match="AIFF is not accepted"):
        read_audio(aiff)
    rf64 = encode_blocks(tone(1.0, 16000), 16000, "RF64", "PCM_16")
    assert read_audio(rf64)[0].shape == (16000,)


@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("FLAC", None), ("OGG", "OPUS"), ("OGG", "VORBIS"),
                                         ("MP3", None)])
def test_truncated_and_corrupted_files_are_a_typed_error_or_audio(fmt, subtype):
    good = encode_blocks(tone(2.0, 48000, channels=2), 48000, fmt, subtype)
    rng = np.random.default_rng(0)
    variants = [good[:n] for n in (4, 12, 44, 100, len(good) // 3, len(good) // 2, len(good) - 1)]
    for _ in range(20):
        b = bytearray(good)
        for pos in rng.integers(0, len(b), 8):
            b[pos] = int(rng.integers(0, 256))
        variants.append(bytes(b))
    for data in variants:
        try:
            samples, sr = read_audio(data)
        except InvalidAudioError:
            continue
        assert sr == 48000 and samples.dtype == np.float32 and 0 < samples.shape[0] <= 30 * 48000
        assert np.isfinite(samples).all()


def test_multichannel_is_mixed_block_by_block():
    x = tone(3.0, 16000, channels=8)
    samples, sr = read_audio(encode_blocks(x, 16000, "WAV", "FLOAT"))
    assert sr == 16000 and np.allclose(samples, x.mean(axis=1), atol=1e-6)
    assert audio_file.BLOCK_FRAMES < samples.shape[0]  # more than one block


def test_float_wav_with_nan_is_refused():
    x = tone(1.0, 16000)
    x[100] = np.nan
    with pytest.raises(InvalidAudioError, match="NaN"):
        read_audio(encode_blocks(x, 16000, "WAV", "FLOAT"))
