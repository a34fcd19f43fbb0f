"""In-memory audio encoders, whole-utterance and incremental (for chunked streaming).

Formats: ``pcm`` (raw s16le mono), ``wav`` (16-bit PCM), and the ones libsndfile (through
``soundfile``, a maintained binding) can write: ``flac``, ``mp3`` (LAME inside libsndfile) and
``opus`` (Ogg Opus). Streaming needs an append-only byte stream: PCM, WAV (header with
"unknown" sizes, ray-serve-notes §5.8) and Ogg Opus (pages are only appended). libsndfile's FLAC
and MP3 writers seek back at close to fix STREAMINFO / the Xing frame count, and the early header
they emit is wrong (measured: a streamed FLAC decodes as 2^63 frames, a streamed MP3 as 1/4 of
its length), so those two are offered for non-streaming responses only.

Nothing touches the filesystem (house style §2.5 rule 22).
"""
from __future__ import annotations

import io
import struct
from abc import ABC, abstractmethod

import numpy as np

from deployments.protocol import InvalidInputError

MEDIA_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
}
# format -> (soundfile container, subtype) for the libsndfile-backed ones.
_SOUNDFILE_FORMATS = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}
_APPEND_ONLY = {"pcm", "wav", "opus"}
# "Unknown length" marker for streamed WAV headers (what ffmpeg and browsers accept).
_WAV_UNKNOWN_SIZE = 0xFFFFFFFF


class UnsupportedFormatError(InvalidInputError):
    """The requested response format is not available (for this mode)."""


def _soundfile_can(fmt: str) -> bool:
    try:
        import soundfile as sf
    except ImportError:  # pragma: no cover - soundfile is a base dependency
        return False
    container, subtype = _SOUNDFILE_FORMATS[fmt]
    return container in sf.available_formats() and subtype in sf.available_subtypes(container)


def supported_formats(stream: bool) -> list[str]:
    """Formats this process can produce, for streaming or whole responses."""
    out = []
    for fmt in MEDIA_TYPES:
        if fmt in _SOUNDFILE_FORMATS and not _soundfile_can(fmt):
            continue
        if stream and fmt not in _APPEND_ONLY:
            continue
        out.append(fmt)
    return out


def check_format(fmt: str, stream: bool) -> None:
    """Raises UnsupportedFormatError (a 400) listing what is supported."""
    allowed = supported_formats(stream)
    if fmt not in allowed:
        how = "streaming" if stream else "non-streaming"
        raise UnsupportedFormatError(f"response_format '{fmt}' is not supported for {how} responses; "
                                     f"supported: {', '.join(allowed)}")


def to_int16(samples: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16 (clipped), little-endian."""
    x = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return (x * 32767.0).astype("<i2")


def wav_header(sample_rate: int, num_samples: int | None, channels: int = 1, bits: int = 16) -> bytes:
    """A 44-byte RIFF/WAVE PCM header; ``num_samples=None`` writes the streaming sizes."""
    block = channels * bits // 8
    if num_samples is None:
        riff_size = data_size = _WAV_UNKNOWN_SIZE
    else:
        data_size = num_samples * block
        riff_size = 36 + data_size
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, bits)
            + b"data" + struct.pack("<I", data_size))


class StreamEncoder(ABC):
    """Incremental encoder: ``encode`` each chunk as it arrives, then ``finish`` once."""

    media_type: str

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate

    @abstractmethod
    def encode(self, samples: np.ndarray) -> bytes: ...

    def finish(self) -> bytes:
        return b""


class PcmStreamEncoder(StreamEncoder):
    media_type = MEDIA_TYPES["pcm"]

    def encode(self, samples: np.ndarray) -> bytes:
        return to_int16(samples).tobytes()


class WavStreamEncoder(PcmStreamEncoder):
    """Header with unknown sizes in the first chunk, raw PCM after it."""

    media_type = MEDIA_TYPES["wav"]

    def __init__(self, sample_rate: int) -> None:
        super().__init__(sample_rate)
        self._header_sent = False

    def encode(self, samples: np.ndarray) -> bytes:
        body = super().encode(samples)
        if self._header_sent:
            return body
        self._header_sent = True
        return wav_header(self.sample_rate, None) + body

    def finish(self) -> bytes:
        # A zero-sample response still has to be a parseable WAV.
        return b"" if self._header_sent else wav_header(self.sample_rate, None)


class SoundFileStreamEncoder(StreamEncoder):
    """libsndfile writer on a BytesIO; only bytes appended since the last call are emitted."""

    def __init__(self, sample_rate: int, fmt: str) -> None:
        import soundfile as sf

        super().__init__(sample_rate)
        if fmt not in _APPEND_ONLY:
            raise UnsupportedFormatError(f"'{fmt}' cannot be streamed")
        container, subtype = _SOUNDFILE_FORMATS[fmt]
        self.media_type = MEDIA_TYPES[fmt]
        self._buf = io.BytesIO()
        self._file = sf.SoundFile(self._buf, "w", samplerate=sample_rate, channels=1, format=container, subtype=subtype)
        self._emitted = 0

    def _drain(self) -> bytes:
        view = self._buf.getbuffer()
        out = bytes(view[self._emitted:])
        self._emitted = len(view)
        del view
        return out

    def encode(self, samples: np.ndarray) -> bytes:
        self._file.write(np.asarray(samples, dtype=np.float32).reshape(-1))
        return self._drain()

    def finish(self) -> bytes:
        self._file.close()
        return self._drain()


def make_stream_encoder(fmt: str, sample_rate: int) -> StreamEncoder:
    check_format(fmt, stream=True)
    if fmt == "pcm":
        return PcmStreamEncoder(sample_rate)
    if fmt == "wav":
        return WavStreamEncoder(sample_rate)
    return SoundFileStreamEncoder(sample_rate, fmt)


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Whole-utterance encoding (exact sizes in headers)."""
    check_format(fmt, stream=False)
    if fmt == "pcm":
        return to_int16(samples).tobytes()
    if fmt == "wav":
        pcm = to_int16(samples)
        return wav_header(sample_rate, len(pcm)) + pcm.tobytes()
    import soundfile as sf

    container, subtype = _SOUNDFILE_FORMATS[fmt]
    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples, dtype=np.float32).reshape(-1), sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


def decode_upload(data: bytes) -> tuple[np.ndarray, int]:
    """Decode an uploaded audio file (wav/flac/ogg/mp3) to float32 mono.

    Raises:
        InvalidInputError: unreadable, empty or not audio.
    """
    import soundfile as sf

    try:
        audio, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile raises its own error type for any malformed file
        raise InvalidInputError(f"prompt audio is not a readable audio file ({type(exc).__name__})") from None
    if audio.shape[0] == 0:
        raise InvalidInputError("prompt audio is empty")
    return audio.mean(axis=1), int(sr)
