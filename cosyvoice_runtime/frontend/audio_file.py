"""Header-first, bounded decoding of uploaded audio files (numpy + libsndfile; no torch).

An upload is hostile until its header says otherwise: a 10 MiB Opus or FLAC file can declare
hours of audio, a WAV header any channel count or sample rate. :func:`read_audio` opens the file
(libsndfile parses only the header), refuses containers, rates, channel counts and durations
beyond :class:`AudioLimits` before decoding a sample, then decodes block by block, mixing each
block to mono, and stops one frame past the duration limit: a header that lies about its length
(or a stream that does not know it, such as a FLAC written without seeking back) costs at most
``max_seconds`` of mono float32 plus one block, whatever the file says.

Every failure is an :class:`InvalidAudioError` (or :class:`PromptTooLongError` for durations) with
a message meant for the client. The ingress imports this module without loading torch.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from cosyvoice_runtime.frontend.errors import InvalidAudioError, PromptTooLongError

# Containers accepted for prompt audio (libsndfile names): the documented WAV, FLAC, OGG
# (Vorbis/Opus) and MP3, plus the WAV variants. libsndfile parses twenty-odd more (PAF, MAT5,
# SD2...) whose parsers see little use; they are refused before their data is read.
CONTAINERS = frozenset({"WAV", "WAVEX", "RF64", "FLAC", "OGG", "MP3"})
# libsndfile reports SF_COUNT_MAX frames when a stream's header does not state its length.
UNKNOWN_FRAMES = 1 << 62
BLOCK_FRAMES = 1 << 15  # frames decoded per read: at most 32768 x channels float32 in flight
UNKNOWN_LENGTH_BLOCK_FRAMES = 1 << 10


@dataclass(frozen=True, slots=True)
class AudioLimits:
    """What an uploaded prompt may be. Rates outside the range are refused as absurd."""

    max_seconds: float = 30.0
    min_rate_hz: int = 8_000
    max_rate_hz: int = 192_000
    max_channels: int = 8


@dataclass(frozen=True, slots=True)
class AudioHeader:
    """What the file's header states (``frames`` is None when the header does not know)."""

    container: str
    subtype: str
    sample_rate: int
    channels: int
    frames: int | None

    @property
    def seconds(self) -> float | None:
        return None if self.frames is None else self.frames / self.sample_rate


def _open(data: bytes):
    import soundfile as sf

    try:
        return sf.SoundFile(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - libsndfile's errors are not a stable type across versions
        raise InvalidAudioError("prompt audio could not be decoded (WAV, FLAC, OGG or MP3 expected): "
                                f"{_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    """libsndfile's own explanation, without the ``<_io.BytesIO object at 0x...>`` noise."""
    text = str(exc)
    return text.split(": ", 1)[1] if text.startswith("Error opening <") and ": " in text else text


def check_header(f, limits: AudioLimits) -> AudioHeader:
    """Validate an open ``soundfile.SoundFile`` against ``limits`` from its header alone."""
    header = AudioHeader(container=str(f.format), subtype=str(f.subtype), sample_rate=int(f.samplerate),
                         channels=int(f.channels), frames=int(f.frames) if 0 <= f.frames < UNKNOWN_FRAMES else None)
    if header.container not in CONTAINERS:
        raise InvalidAudioError(f"prompt audio container {header.container} is not accepted; "
                                "use WAV, FLAC, OGG (Vorbis/Opus) or MP3")
    if not limits.min_rate_hz <= header.sample_rate <= limits.max_rate_hz:
        raise InvalidAudioError(f"prompt audio is sampled at {header.sample_rate} Hz; accepted: "
                                f"{limits.min_rate_hz}-{limits.max_rate_hz} Hz")
    if not 1 <= header.channels <= limits.max_channels:
        raise InvalidAudioError(f"prompt audio has {header.channels} channels; at most {limits.max_channels} accepted")
    if header.frames == 0:
        raise InvalidAudioError("prompt audio has no samples")
    if header.seconds is not None and header.seconds > limits.max_seconds:
        raise PromptTooLongError(header.seconds, limits.max_seconds)
    return header


def read_header(data: bytes, limits: AudioLimits = AudioLimits()) -> AudioHeader:
    """The checked header of an audio file given as bytes (nothing is decoded)."""
    with _open(_as_bytes(data)) as f:
        return check_header(f, limits)


def _as_bytes(data) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise InvalidAudioError("prompt audio is empty")
    return bytes(data)


def read_audio(data: bytes, limits: AudioLimits = AudioLimits()) -> tuple[np.ndarray, int]:
    """Decode an audio file given as bytes to mono float32, within ``limits``.

    Returns:
        ``(samples (N,) float32, sample_rate)``, ``0 < N <= max_seconds * sample_rate``.

    Raises:
        InvalidAudioError: not audio, refused container/rate/channels, no samples, NaN/Inf.
        PromptTooLongError: longer than ``limits.max_seconds`` (by header or by decoding).
    """
    with _open(_as_bytes(data)) as f:
        header = check_header(f, limits)
        max_frames = math.floor(limits.max_seconds * header.sample_rate)
        # NOTE: libsndfile fails a whole read that crosses the end of a stream of unknown length
        # (a FLAC whose STREAMINFO says 0 samples), so such streams are read in small blocks and
        # an error after some audio is their end; at most one small block is lost.
        step = BLOCK_FRAMES if header.frames is not None else UNKNOWN_LENGTH_BLOCK_FRAMES
        blocks, total = [], 0
        try:
            while total <= max_frames:
                block = f.read(min(step, max_frames + 1 - total), dtype="float32", always_2d=True)
                if block.shape[0] == 0:
                    break
                blocks.append(block.mean(axis=1) if header.channels > 1 else block[:, 0].copy())
                total += block.shape[0]
        except Exception as exc:  # noqa: BLE001 - corrupt data past the header, any libsndfile error
            if header.frames is not None or total == 0:
                raise InvalidAudioError(f"prompt audio is corrupt: {_reason(exc)}") from None
    if total > max_frames:
        raise PromptTooLongError(total / header.sample_rate, limits.max_seconds)
    if total == 0:
        raise InvalidAudioError("prompt audio has no samples")
    samples = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
    if not np.isfinite(samples).all():
        raise InvalidAudioError("prompt audio contains NaN or infinite samples")
    return samples, header.sample_rate
