"""``fastcosy synth``: text -> WAV file, through a running service (``--url``) or locally.

Long text is cut into segments at sentence ends (``--segment-chars`` each at most, so every
request stays under the service's input limits); a progress bar counts segments. The audio of
all segments is written, as it arrives, into one 16-bit WAV file.

* ``--url``: ``POST /v1/tts`` per segment with ``stream: true`` (JSON with a registered
  ``--voice``; multipart with ``--prompt-wav`` for zero-shot), read with httpx streaming.
* local: the same frontend the service uses (``deployments.frontend.TextFrontend``) prepares
  each segment, and the single-process reference pipeline (``cosyvoice_runtime.pipeline``)
  synthesises it; no Ray involved.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import struct
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np

from fastcosy_cli.common import CliError, out

logger = logging.getLogger(__name__)

DEFAULT_SEGMENT_CHARS = 400
_SENTENCE_END = re.compile(r"(?<=[.!?;。！？；…])\s*|\n\s*\n")
_SOFT_BREAK = re.compile(r"(?<=[,，、:：])\s*|\s+")
_HTTP_TIMEOUT_S = 300.0


# ----------------------------------------------------------------------------- segmentation
def split_segments(text: str, max_chars: int = DEFAULT_SEGMENT_CHARS) -> list[str]:
    """Sentences packed greedily into segments of at most ``max_chars`` characters.

    A sentence longer than ``max_chars`` is cut at commas/spaces, and a run without any break
    (e.g. long CJK text without punctuation) is cut hard.
    """
    if max_chars < 1:
        raise ValueError("max_chars must be positive")
    sentences = [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]
    pieces: list[str] = []
    for s in sentences:
        if len(s) <= max_chars:
            pieces.append(s)
            continue
        for part in (p for p in _SOFT_BREAK.split(s) if p):
            while len(part) > max_chars:
                pieces.append(part[:max_chars])
                part = part[max_chars:]
            pieces.append(part)
    segments: list[str] = []
    for piece in pieces:
        # Join with a space only between scripts that use spaces.
        sep = " " if segments and (segments[-1][-1:].isascii() or piece[:1].isascii()) else ""
        if segments and len(segments[-1]) + len(sep) + len(piece) <= max_chars:
            segments[-1] += sep + piece
        else:
            segments.append(piece)
    return segments


# ------------------------------------------------------------------------- WAV stream reader
class WavStreamReader:
    """Incremental RIFF/WAVE reader for 16-bit PCM: feed bytes, get int16 samples.

    Works with the streaming header (sizes 0xFFFFFFFF) and with complete files.
    """

    def __init__(self) -> None:
        self._buf = b""
        self.sample_rate: int | None = None
        self.channels = 1
        self._in_data = False
        self._odd = b""

    def feed(self, data: bytes) -> np.ndarray:
        if self._in_data:
            return self._samples(data)
        self._buf += data
        if len(self._buf) < 12:
            return np.zeros(0, dtype=np.int16)
        if self._buf[:4] != b"RIFF" or self._buf[8:12] != b"WAVE":
            raise CliError("the service did not answer with a WAV stream")
        pos = 12
        while pos + 8 <= len(self._buf):
            chunk, size = self._buf[pos:pos + 4], struct.unpack("<I", self._buf[pos + 4:pos + 8])[0]
            if chunk == b"data":
                self._in_data = True
                rest, self._buf = self._buf[pos + 8:], b""
                return self._samples(rest)
            if pos + 8 + size > len(self._buf):
                return np.zeros(0, dtype=np.int16)  # wait for the rest of this chunk
            if chunk == b"fmt ":
                fmt, channels, rate, _, _, bits = struct.unpack("<HHIIHH", self._buf[pos + 8:pos + 24])
                if fmt != 1 or bits != 16:
                    raise CliError(f"unsupported WAV encoding (format {fmt}, {bits} bit)")
                self.sample_rate, self.channels = rate, channels
            pos += 8 + size + (size & 1)
        return np.zeros(0, dtype=np.int16)

    def _samples(self, data: bytes) -> np.ndarray:
        data = self._odd + data
        cut = len(data) - len(data) % 2
        self._odd = data[cut:]
        return np.frombuffer(data[:cut], dtype="<i2")


class WavSink:
    """One output WAV file, written to a temporary file beside it and renamed at the end.

    The temporary file is created by :meth:`open` (before any synthesis, so an unwritable
    output fails in a second, not after minutes of work); the WAV header is written at the
    first audio, when the sample rate is known. An existing output is replaced only by
    :meth:`commit`; a failed or interrupted run leaves it untouched and no partial file behind.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sample_rate: int | None = None
        self.samples = 0
        self._file = None
        self._tmp: Path | None = None

    def open(self) -> None:
        """Check the output can be written: create its folder and the temporary file.

        Raises:
            CliError: the output is a directory, or its folder cannot be created or written.
        """
        if self.path.is_dir():
            raise CliError(f"output {self.path} is a directory; give a file name (e.g. {self.path / 'speech.wav'})")
        parent = self.path.parent
        blocker = next((d for d in (parent, *parent.parents) if d.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise CliError(f"cannot write {self.path}: {blocker} is a file, not a folder")
        try:
            parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".partial", dir=parent)
        except OSError as exc:
            raise CliError(f"cannot write {self.path}: {exc.strerror or exc} ({exc.filename or parent})") from None
        os.close(fd)
        self._tmp = Path(tmp)

    def write(self, samples: np.ndarray, sample_rate: int) -> None:
        import soundfile as sf

        if self._tmp is None:
            self.open()
        if self._file is None:
            self._file = sf.SoundFile(str(self._tmp), "w", samplerate=sample_rate, channels=1, format="WAV",
                                      subtype="PCM_16")
            self.sample_rate = sample_rate
        elif sample_rate != self.sample_rate:
            raise CliError(f"sample rate changed mid-stream ({self.sample_rate} -> {sample_rate})")
        if samples.size:
            try:
                self._file.write(samples)
            except (OSError, RuntimeError) as exc:  # soundfile reports a full disk as a RuntimeError
                raise CliError(f"cannot write {self.path}: {exc}") from None
            self.samples += int(samples.size)

    def commit(self) -> None:
        """Close the WAV and move it to :attr:`path`."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tmp is not None:
            try:
                os.replace(self._tmp, self.path)
            except OSError as exc:
                raise CliError(f"cannot write {self.path}: {exc.strerror or exc}") from None
            self._tmp = None

    def discard(self) -> None:
        """Close and delete the temporary file (after a failure); the output is not touched."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None

    @property
    def duration_s(self) -> float:
        return self.samples / self.sample_rate if self.sample_rate else 0.0


# ------------------------------------------------------------------------------ remote path
def _error_text(resp) -> str:
    try:
        err = resp.json().get("error", {})
        return f"HTTP {resp.status_code}: {err.get('message') or resp.text}"
    except (ValueError, AttributeError):  # not JSON, or not our error shape
        return f"HTTP {resp.status_code}: {resp.text[:500]}"


def synth_remote(args: argparse.Namespace, segments: list[str], sink: WavSink, progress, client=None) -> None:
    """Stream every segment from ``args.url`` into ``sink``."""
    import httpx

    url = args.url.rstrip("/") + "/v1/tts"
    try:
        prompt = Path(args.prompt_wav).read_bytes() if args.prompt_wav else None
    except OSError as exc:
        raise CliError(f"cannot read --prompt-wav {args.prompt_wav}: {exc.strerror or exc}") from None
    own = client is None
    client = client or httpx.Client(timeout=httpx.Timeout(_HTTP_TIMEOUT_S, connect=10.0))
    try:
        for seg in segments:
            fields = {"text": seg, "mode": args.mode, "response_format": "wav", "stream": True, "speed": args.speed}
            for key, value in (("voice_id", args.voice), ("prompt_text", args.prompt_text),
                               ("instruct_text", args.instruct), ("seed", args.seed)):
                if value is not None:
                    fields[key] = value
            if prompt is not None:
                form = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in fields.items()}
                request = client.build_request("POST", url, data=form,
                                               files={"prompt_audio": (Path(args.prompt_wav).name, prompt)})
            else:
                request = client.build_request("POST", url, json=fields)
            try:
                resp = client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise CliError(f"cannot reach {args.url}: {exc}") from None
            try:
                if resp.status_code != 200:
                    resp.read()
                    raise CliError(_error_text(resp))
                reader = WavStreamReader()
                try:
                    for data in resp.iter_bytes():
                        samples = reader.feed(data)
                        if samples.size:
                            sink.write(samples, reader.sample_rate)
                except httpx.HTTPError as exc:
                    raise CliError(f"the connection to {args.url} broke mid-stream: {exc}") from None
            finally:
                resp.close()
            progress.update(1)
            progress.set_postfix(audio_s=f"{sink.duration_s:.1f}")
    finally:
        if own:
            client.close()


# ------------------------------------------------------------------------------- local path
def _local_session(args: argparse.Namespace):
    """(TextFrontend, Pipeline) over the model the arguments name."""
    from deployments.frontend import FrontendConfig, TextFrontend
    from deployments.model_source import ModelSource

    model_dir, family, voices_dir = args.model_dir, "cosyvoice2", None
    if args.config:
        from fastcosy_cli.common import load_serve_config

        cfg = load_serve_config(args.config).args
        model_dir = model_dir or cfg.synthesizer.model_dir or cfg.frontend.model_dir or cfg.model_dir
        family, voices_dir = cfg.tiny_family, cfg.frontend.voices_dir
    source = ModelSource(model_dir, family)
    resolved = source.resolve()
    try:
        frontend = TextFrontend(FrontendConfig(model_dir=str(resolved), voices_dir=voices_dir), source)
    except (ImportError, AttributeError) as exc:
        raise CliError(f"local synthesis needs the frontend runtime, which this installation lacks ({exc}); "
                       "synthesise through a running service with --url") from None
    import torch

    from cosyvoice_runtime.model import load_model
    from cosyvoice_runtime.pipeline import Pipeline

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return frontend, Pipeline(load_model(resolved, device=device)), device


def synth_local(args: argparse.Namespace, segments: list[str], sink: WavSink, progress) -> None:
    import torch

    from deployments.protocol import SynthesisMode, SynthesisRequest

    frontend, pipeline, device = _local_session(args)
    audio = sr = None
    if args.prompt_wav:
        import soundfile as sf

        try:
            audio, sr = sf.read(args.prompt_wav, dtype="float32", always_2d=True)
        except (OSError, RuntimeError) as exc:  # soundfile.LibsndfileError is a RuntimeError
            raise CliError(f"cannot read --prompt-wav {args.prompt_wav}: {exc}") from None
        audio = audio.mean(axis=1)
    for seg in segments:
        req = SynthesisRequest(request_id=uuid.uuid4().hex, text=seg, mode=SynthesisMode(args.mode),
                               voice_id=args.voice, prompt_text=args.prompt_text, prompt_audio=audio,
                               prompt_sample_rate=sr, instruct_text=args.instruct, speed=args.speed, seed=args.seed)
        prepared = asyncio.run(frontend.prepare(req))
        for piece in prepared.pieces:
            ids = torch.as_tensor(np.asarray(piece.text_ids, dtype=np.int64), device=device)
            for chunk in pipeline.tts(ids, prepared.prompt, llm_prompt_text_ids=prepared.llm_prompt_text_ids,
                                      llm_use_prompt_speech=prepared.llm_use_prompt_speech, stream=False,
                                      speed=args.speed, seed=args.seed):
                from serve_app.audio_codec import to_int16

                sink.write(to_int16(chunk.detach().float().cpu().numpy()), pipeline.spec.sample_rate)
        progress.update(1)
        progress.set_postfix(audio_s=f"{sink.duration_s:.1f}")


# ---------------------------------------------------------------------------------- command
def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="text to a WAV file, locally or through a running service (--url)")
    p.add_argument("text", nargs="?", help="text to speak; '-' or omitted with --text-file reads a file/stdin")
    p.add_argument("--text-file", help="read the text from this file")
    p.add_argument("-o", "--output", required=True, help="WAV file to write")
    p.add_argument("--url", help="base URL of a running service (http://127.0.0.1:8000); default: local pipeline")
    p.add_argument("--mode", default=None, choices=["voice", "zero_shot", "cross_lingual", "instruct"],
                   help="default: voice with --voice, zero_shot with --prompt-wav")
    p.add_argument("--voice", help="registered voice id")
    p.add_argument("--prompt-wav", help="prompt recording for zero-shot / cross-lingual (>= 16 kHz, <= 30 s)")
    p.add_argument("--prompt-text", help="transcript of --prompt-wav (zero-shot)")
    p.add_argument("--instruct", help="instruction text (instruct mode)")
    p.add_argument("--speed", type=float, default=1.0, help="speaking rate (default 1.0)")
    p.add_argument("--seed", type=int, help="sampling seed, for repeatable output")
    p.add_argument("--segment-chars", type=int, default=DEFAULT_SEGMENT_CHARS,
                   help=f"longest text segment synthesised in one request (default {DEFAULT_SEGMENT_CHARS}); "
                   "the progress bar counts segments")
    p.add_argument("--config", help="local: serve config whose model_dir / voices_dir to use")
    p.add_argument("--model-dir", help="local: model directory (default: config, $FAST_COSY_MODEL_DIR, tiny model)")
    p.add_argument("--device", help="local: cpu | cuda | cuda:N (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def read_text(args: argparse.Namespace) -> str:
    if args.text_file:
        try:
            return Path(args.text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"cannot read --text-file {args.text_file}: {getattr(exc, 'strerror', None) or exc}") from None
    if args.text in (None, "-"):
        if sys.stdin is None or sys.stdin.isatty():
            raise CliError("give the text as an argument, with --text-file, or on stdin")
        return sys.stdin.read()
    return args.text


def _check_inputs(args: argparse.Namespace) -> None:
    """Fail in a second on inputs that would otherwise fail after the model has loaded."""
    if args.voice and args.prompt_wav:
        raise CliError("give either --voice or --prompt-wav, not both")
    if not (args.voice or args.prompt_wav):
        raise CliError("name a registered --voice, or give --prompt-wav (and --prompt-text for zero-shot)")
    if args.segment_chars < 1:
        raise CliError("--segment-chars must be at least 1")
    if args.prompt_wav and not Path(args.prompt_wav).is_file():
        raise CliError(f"--prompt-wav {args.prompt_wav} does not exist")
    if not args.url and args.model_dir and not Path(args.model_dir).expanduser().is_dir():
        raise CliError(f"model directory {args.model_dir} does not exist (write a tiny test model with "
                       f"fastcosy make-tiny-model --out {args.model_dir}, or point --model-dir at a downloaded "
                       "CosyVoice2/3 directory)")


def run(args: argparse.Namespace, client=None) -> int:
    from tqdm import tqdm

    from cosyvoice_runtime.errors import CosyVoiceError

    _check_inputs(args)
    args.mode = args.mode or ("voice" if args.voice else "zero_shot")
    segments = split_segments(read_text(args), args.segment_chars)
    if not segments:
        raise CliError("the text is empty")
    sink = WavSink(Path(args.output))
    sink.open()
    progress = tqdm(total=len(segments), unit="segment", disable=args.no_progress, file=sys.stderr)
    try:
        if args.url:
            synth_remote(args, segments, sink, progress, client=client)
        else:
            synth_local(args, segments, sink, progress)
        if not sink.samples:
            raise CliError("no audio was produced")
        sink.commit()
    except CosyVoiceError as exc:  # the runtime's deliberate errors: model files, voices, input
        progress.leave = False  # erase the bar: the error is the last line
        sink.discard()
        raise CliError(str(exc)) from None
    except BaseException:
        progress.leave = False
        sink.discard()
        raise
    finally:
        progress.close()
    out(f"wrote {sink.path}: {sink.duration_s:.2f} s at {sink.sample_rate} Hz from {len(segments)} segment(s)")
    return 0
