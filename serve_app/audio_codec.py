"""In-memory audio encoders, whole-utterance and incremental (for chunked streaming), and the
tempo change used for speeds beyond what the model does itself.

Formats (OpenAI's set): ``pcm`` (raw s16le mono), ``wav`` (16-bit PCM), and through PyAV (FFmpeg's
libraries; a maintained binding) ``mp3`` (LAME, MPEG audio frames), ``opus`` (libopus in Ogg),
``aac`` (FFmpeg's AAC in ADTS frames) and ``flac``. Every format streams: a streamed body is the
concatenation of what :class:`StreamEncoder` returns, and it is one valid file:

* WAV: a header with "unknown" sizes (ray-serve-notes §5.8), then PCM;
* MP3 / AAC-ADTS: self-delimiting frames (no Xing/LAME header, which needs a seek back);
* Ogg Opus: pages of at most ``OGG_PAGE_DURATION_US`` so audio leaves as it is made;
* FLAC: STREAMINFO with total samples 0 ("unknown", allowed by the FLAC format), then frames.
  FFmpeg, libFLAC and browsers read it; libsndfile's ``sf.read`` of the whole body needs the length
  (read it block-wise, or ask for ``stream: false``).

Whole responses (``encode_audio``) are written to a seekable buffer, so FLAC gets its exact
STREAMINFO and MP3 its Xing header. Nothing touches the filesystem (house style §2.5 rule 22).

Every encoder call is blocking CPU work (milliseconds per second of audio, docs/serving.md;
opening an encoder too): servers run them with :func:`run_encoder`, in a bounded pool of worker
threads, not on their event loop.
"""
from __future__ import annotations

import asyncio
import functools
import io
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import TypeVar

import av
import numpy as np

from cosyvoice_runtime.frontend.audio_file import AudioLimits, read_audio
from cosyvoice_runtime.frontend.errors import InvalidAudioError, PromptTooLongError
from deployments.protocol import InvalidInputError, PayloadTooLargeError

MEDIA_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}
# Telephony formats of the ElevenLabs-compatible routes (raw G.711 bytes, one per sample, at 8 kHz).
G711_MEDIA_TYPES = {"ulaw": "audio/basic", "alaw": "audio/x-alaw-basic"}
# format -> (FFmpeg muxer, encoder, muxer options, default bit rate; None: the encoder's own)
_AV_FORMATS: dict[str, tuple[str, str, dict[str, str], int | None]] = {
    "mp3": ("mp3", "libmp3lame", {}, 64_000),
    "opus": ("ogg", "libopus", {}, 32_000),
    "aac": ("adts", "aac", {}, 64_000),
    "flac": ("flac", "flac", {}, None),
}
OGG_PAGE_DURATION_US = 20_000  # the Ogg muxer holds a 1 s page by default: audio would leave late
# "Unknown length" marker for streamed WAV headers (what ffmpeg and browsers accept).
_WAV_UNKNOWN_SIZE = 0xFFFFFFFF
MIN_TEMPO, MAX_TEMPO = 0.5, 2.0  # one atempo stage keeps its quality within this range
# Worker threads of the encoder pool of one process (an ingress replica). Each stream has at most
# one call in the pool at a time (the next chunk is fed after the last one's bytes are back), so
# chunk order holds and a stream waits behind at most the calls already queued.
ENCODE_THREADS = 4
_ENCODE_POOL = ThreadPoolExecutor(max_workers=ENCODE_THREADS, thread_name_prefix="audio-encode")
_T = TypeVar("_T")


async def run_encoder(fn: Callable[..., _T], *args, **kwargs) -> _T:
    """``fn(*args, **kwargs)`` (an encoder call: open, encode a chunk, finish) in the process's
    encoder pool, so that the event loop keeps serving other requests meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(_ENCODE_POOL, functools.partial(fn, *args, **kwargs))


class UnsupportedFormatError(InvalidInputError):
    """The requested response format is not available."""


def _encoder_available(fmt: str) -> bool:
    try:
        av.codec.Codec(_AV_FORMATS[fmt][1], "w")
    except Exception:  # noqa: BLE001 - a PyAV build without this encoder
        return False
    return True


def supported_formats(stream: bool = True) -> list[str]:
    """Formats this process can produce (the same for streamed and whole responses)."""
    return [fmt for fmt in MEDIA_TYPES if fmt not in _AV_FORMATS or _encoder_available(fmt)]


def check_format(fmt: str, stream: bool = True) -> None:
    """Raises UnsupportedFormatError (a 400) listing what is supported."""
    allowed = supported_formats(stream)
    if fmt not in allowed:
        raise UnsupportedFormatError(f"response_format '{fmt}' is not supported; supported: {', '.join(allowed)}")


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


def _frame(samples: np.ndarray, sample_rate: int, pts: int | None = None) -> av.AudioFrame:
    x = np.ascontiguousarray(np.asarray(samples, dtype=np.float32).reshape(1, -1))
    frame = av.AudioFrame.from_ndarray(x, format="flt", layout="mono")
    frame.sample_rate = sample_rate
    if pts is not None:
        frame.pts, frame.time_base = pts, Fraction(1, sample_rate)
    return frame


class _Resampler:
    """Streaming rate change (libswresample) of float32 mono; identity when the rates agree."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate, self.out_rate = in_rate, out_rate
        self._rs = av.AudioResampler(format="flt", layout="mono", rate=out_rate) if in_rate != out_rate else None

    def _run(self, frame: av.AudioFrame | None) -> np.ndarray:
        frames = self._rs.resample(frame)
        if not frames:
            return np.zeros(0, np.float32)
        return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32, copy=False)

    def process(self, samples: np.ndarray) -> np.ndarray:
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._rs is None or x.size == 0:
            return x
        return self._run(_frame(x, self.in_rate))

    def finish(self) -> np.ndarray:
        return np.zeros(0, np.float32) if self._rs is None else self._run(None)


class StreamEncoder(ABC):
    """Incremental encoder: ``encode`` each chunk as it arrives, then ``finish`` once.

    Attributes:
        sample_rate: rate of the samples given to ``encode``.
        out_rate: rate of the encoded audio.
    """

    media_type: str

    def __init__(self, sample_rate: int, out_rate: int | None = None) -> None:
        self.sample_rate = sample_rate
        self.out_rate = out_rate or sample_rate

    @abstractmethod
    def encode(self, samples: np.ndarray) -> bytes: ...

    def finish(self) -> bytes:
        return b""


class PcmStreamEncoder(StreamEncoder):
    media_type = MEDIA_TYPES["pcm"]

    def __init__(self, sample_rate: int, out_rate: int | None = None) -> None:
        super().__init__(sample_rate, out_rate)
        self._resampler = _Resampler(sample_rate, self.out_rate)

    def encode(self, samples: np.ndarray) -> bytes:
        return to_int16(self._resampler.process(samples)).tobytes()

    def finish(self) -> bytes:
        return to_int16(self._resampler.finish()).tobytes()


class WavStreamEncoder(PcmStreamEncoder):
    """Header with unknown sizes in the first chunk, raw PCM after it."""

    media_type = MEDIA_TYPES["wav"]

    def __init__(self, sample_rate: int, out_rate: int | None = None) -> None:
        super().__init__(sample_rate, out_rate)
        self._header_sent = False

    def _with_header(self, body: bytes) -> bytes:
        if self._header_sent:
            return body
        self._header_sent = True
        return wav_header(self.out_rate, None) + body

    def encode(self, samples: np.ndarray) -> bytes:
        return self._with_header(super().encode(samples))

    def finish(self) -> bytes:
        # A zero-sample response still has to be a parseable WAV.
        return self._with_header(super().finish())


class _Sink:
    """Write-only file for PyAV: without ``seek`` the muxer treats the output as a stream."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


def _pick_rate(codec: av.codec.Codec, rate: int) -> int:
    """``rate`` if the encoder takes it, else the next higher rate it takes (or its highest)."""
    rates = sorted(codec.audio_rates or ())
    if not rates or rate in rates:
        return rate
    return next((r for r in rates if r >= rate), rates[-1])


class AvStreamEncoder(StreamEncoder):
    """A PyAV encoder + muxer writing to :class:`_Sink` (streaming) or a BytesIO (whole file)."""

    def __init__(self, sample_rate: int, fmt: str, out_rate: int | None = None, bit_rate: int | None = None,
                 seekable: bool = False) -> None:
        check_format(fmt)
        muxer, codec_name, options, default_bit_rate = _AV_FORMATS[fmt]
        codec = av.codec.Codec(codec_name, "w")
        super().__init__(sample_rate, _pick_rate(codec, out_rate or sample_rate))
        self.media_type = MEDIA_TYPES[fmt]
        self._out = io.BytesIO() if seekable else _Sink()
        options = {**options, "flush_packets": "1"}
        if muxer == "ogg":
            options["page_duration"] = str(OGG_PAGE_DURATION_US)
        self._container = av.open(self._out, "w", format=muxer, options=options)
        self._stream = self._container.add_stream(codec_name, rate=self.out_rate, layout="mono")
        if bit_rate or default_bit_rate:
            self._stream.codec_context.bit_rate = bit_rate or default_bit_rate
        # libswresample first: the encoder's own conversion only changes the sample format.
        self._resampler = _Resampler(sample_rate, self.out_rate)
        self._pts = 0
        self._closed = False

    def _mux(self, samples: np.ndarray | None) -> None:
        if samples is None:
            packets = self._stream.encode(None)
        elif samples.size == 0:
            return
        else:
            packets = self._stream.encode(_frame(samples, self.out_rate, self._pts))
            self._pts += samples.size
        self._container.mux(packets)

    def _take(self) -> bytes:
        return self._out.take() if isinstance(self._out, _Sink) else b""

    def encode(self, samples: np.ndarray) -> bytes:
        self._mux(self._resampler.process(samples))
        return self._take()

    def finish(self) -> bytes:
        if self._closed:
            return b""
        self._closed = True
        self._mux(self._resampler.finish())
        self._mux(None)
        self._container.close()
        return self._take() if isinstance(self._out, _Sink) else self._out.getvalue()


def g711_encode(pcm: np.ndarray, law: str) -> bytes:
    """int16 samples -> G.711 bytes (ITU-T G.711 segment encoding: ``"ulaw"`` or ``"alaw"``)."""
    x = np.asarray(pcm, dtype=np.int32)
    if law == "ulaw":
        mag = np.minimum(np.abs(x), 32635) + 0x84  # bias: the first segment starts at 132
        exponent = np.floor(np.log2(mag)).astype(np.int32) - 7  # 0..7
        mantissa = (mag >> (exponent + 3)) & 0x0F
        code = ((x < 0).astype(np.int32) << 7) | (exponent << 4) | mantissa
        return (~code & 0xFF).astype(np.uint8).tobytes()
    mag = np.minimum(np.abs(x), 32767)
    exponent = np.where(mag < 256, 0, np.floor(np.log2(np.maximum(mag, 1))).astype(np.int32) - 7)
    mantissa = np.where(exponent == 0, mag >> 4, mag >> (exponent + 3)) & 0x0F
    code = ((x >= 0).astype(np.int32) << 7) | (exponent << 4) | mantissa  # A-law: the sign bit set = positive
    return (code ^ 0x55).astype(np.uint8).tobytes()


class G711StreamEncoder(PcmStreamEncoder):
    """Raw mu-law / A-law bytes (``ulaw_8000`` / ``alaw_8000``): PCM resampled, then companded."""

    def __init__(self, sample_rate: int, law: str, out_rate: int | None = None) -> None:
        super().__init__(sample_rate, out_rate)
        self.law = law
        self.media_type = G711_MEDIA_TYPES[law]

    def encode(self, samples: np.ndarray) -> bytes:
        return g711_encode(to_int16(self._resampler.process(samples)), self.law)

    def finish(self) -> bytes:
        return g711_encode(to_int16(self._resampler.finish()), self.law)


def make_stream_encoder(fmt: str, sample_rate: int, out_rate: int | None = None,
                        bit_rate: int | None = None) -> StreamEncoder:
    """An incremental encoder of float32 mono at ``sample_rate`` into ``fmt`` at ``out_rate``
    (default: the same; an encoder that does not take that rate gets its next higher one)."""
    if fmt in G711_MEDIA_TYPES:
        return G711StreamEncoder(sample_rate, fmt, out_rate)
    check_format(fmt, stream=True)
    if fmt == "pcm":
        return PcmStreamEncoder(sample_rate, out_rate)
    if fmt == "wav":
        return WavStreamEncoder(sample_rate, out_rate)
    return AvStreamEncoder(sample_rate, fmt, out_rate, bit_rate)


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str, out_rate: int | None = None) -> bytes:
    """Whole-utterance encoding (exact sizes in headers)."""
    check_format(fmt, stream=False)
    if fmt in ("pcm", "wav"):
        enc = PcmStreamEncoder(sample_rate, out_rate)
        pcm = enc.encode(samples) + enc.finish()
        return pcm if fmt == "pcm" else wav_header(enc.out_rate, len(pcm) // 2) + pcm
    enc = AvStreamEncoder(sample_rate, fmt, out_rate, seekable=True)
    enc.encode(samples)
    return enc.finish()


class TempoStretcher:
    """Streaming tempo change without a pitch change (FFmpeg's ``atempo``, WSOLA), for the part of
    a requested speed that the model does not produce itself.

    ``factor`` > 1 is faster (shorter audio). Factors outside [MIN_TEMPO, MAX_TEMPO] run as a chain
    of stages within it, as FFmpeg recommends for quality.
    """

    def __init__(self, sample_rate: int, factor: float) -> None:
        if not factor > 0:
            raise InvalidInputError(f"tempo factor must be positive, got {factor}")
        self.sample_rate, self.factor = sample_rate, factor
        stages = []
        rest = factor
        while rest > MAX_TEMPO or rest < MIN_TEMPO:
            step = MAX_TEMPO if rest > MAX_TEMPO else MIN_TEMPO
            stages.append(step)
            rest /= step
        stages.append(rest)
        self._graph = av.filter.Graph()
        self._src = self._graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono",
                                            time_base=Fraction(1, sample_rate))
        node = self._src
        for step in stages:
            nxt = self._graph.add("atempo", f"{step:.6f}")
            node.link_to(nxt)
            node = nxt
        self._sink = self._graph.add("abuffersink")
        node.link_to(self._sink)
        self._graph.configure()
        self._pts = 0

    def _drain(self) -> np.ndarray:
        out = []
        while True:
            try:
                frame = self._sink.pull()
            except (av.BlockingIOError, av.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1))
        return np.concatenate(out).astype(np.float32, copy=False) if out else np.zeros(0, np.float32)

    def process(self, samples: np.ndarray) -> np.ndarray:
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if x.size:
            self._src.push(_frame(x, self.sample_rate, self._pts))
            self._pts += x.size
        return self._drain()

    def finish(self) -> np.ndarray:
        self._src.push(None)
        return self._drain()


def decode_upload(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Decode an uploaded audio file (wav/flac/ogg/mp3) to float32 mono, header first and bounded.

    The header (container, rate, channels, declared length) is checked before any sample is
    decoded, and decoding stops one frame past ``max_seconds`` whatever the header claims
    (:func:`cosyvoice_runtime.frontend.audio_file.read_audio`). Blocking: call it off the event loop.

    Args:
        data: the file's bytes.
        max_seconds: longest accepted audio (``None``: :class:`AudioLimits`' default).

    Raises:
        InvalidInputError: unreadable, empty, not audio, refused container/rate/channels (400).
        PayloadTooLargeError: longer than ``max_seconds`` (413).
    """
    limits = AudioLimits() if max_seconds is None else AudioLimits(max_seconds=max_seconds)
    try:
        return read_audio(data, limits)
    except PromptTooLongError as exc:
        raise PayloadTooLargeError(str(exc)) from None
    except InvalidAudioError as exc:
        raise InvalidInputError(str(exc)) from None
