"""The streaming vocoder: per-request state and one batched call (spec §5.5, §5.6, §6.2 D).

A request owns one :class:`VocoderStream`. :func:`vocode_batch` vocodes one chunk of each of
several requests (one :class:`VocoderCall` each) and returns the samples each may emit now; a
single request is a batch of one (:func:`vocode_chunk`), through the same code. Nothing is stored
on the (shared) vocoder module.

Each call is served by the strategy of its stream (:data:`_STRATEGIES`, all below), batched over
the calls of that strategy:

* ``cv2_overlap`` (CV2, non-causal HiFT): the last ``mel_cache_len`` mel frames, the last
  ``mel_cache_len · samples_per_frame`` source samples and as many output samples are cached; the
  next call prepends the cached mel, overwrites the start of its source with the cached source and
  cross-fades its first samples with the cached output (``np.hamming`` of twice that length, whose
  halves sum to ≈ 1.08 [quirk]); non-final calls withhold their last cached-length samples.
  Padding would change the last tens of frames of a shorter item, so calls are grouped by input
  length and each group is one exact batch; the random source stays per call (the request's own
  generator, cache overwrite and optional recorded source).
* ``cv3_recompute`` (CV3, causal HiFT; the reference): the accumulated mel is re-vocoded on every
  call and only the samples beyond those already emitted are returned. A non-final official call
  gives the first ``480·(T - lag)`` samples of the finalize run over the same frames (spec §5.4),
  so every call runs in finalize mode, right-padded in a batch
  (:func:`~cosyvoice_runtime.hift.batch.causal_decode_batch`), and is cut there.
* ``cv3_incremental``: the same samples in O(n): the new frames plus a bounded left context, with
  the sine phase carried over (:mod:`cosyvoice_runtime.hift.incremental`).

Speed change (non-streaming only, one finalize call): the mel is interpolated linearly to
``int(T / speed)`` frames before vocoding; a CV3 stream then takes the recompute path (one full
pass either way).
"""
from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.hift.batch import causal_decode_batch, decode_padded, pad_mels
from cosyvoice_runtime.hift.incremental import IncrementalState, plan_window, window_samples, window_source
from cosyvoice_runtime.host_copy import to_device

STRATEGIES = ("recompute", "incremental")  # of CV3 streams; CV2 streams always use their overlap caches


@dataclass
class VocoderStream:
    """Vocoder state of one request. Fields are reassigned, never written in place, so a shallow
    copy is a checkpoint (``cosyvoice_runtime.token2wav`` rolls a failed batch back with one).

    Attributes:
        causal: CV3 vocoder (accumulate + re-vocode) vs CV2 (caches + cross-fade).
        samples_per_frame: waveform samples per mel frame (480).
        mel_cache_len: CV2 overlap in mel frames (8).
        generator: the request's RNG for the CV2 source; created on first use if None.
        seed: seed of that generator when it is created here (None: nondeterministic).
        strategy: CV3 "recompute" (reference) or "incremental".
        mel_cache / source_cache / speech_cache: CV2 overlap caches (1, 80, 8), (1, 1, 3840), (1, 3840).
        mel: CV3 accumulated mel (1, 80, T).
        speech_offset: CV3 samples emitted so far.
        incremental: CV3 "incremental" phase state.
        calls: vocoder calls so far; finished: a finalize call happened.
    """

    causal: bool
    samples_per_frame: int
    mel_cache_len: int
    generator: torch.Generator | None = None
    seed: int | None = None
    strategy: str = "recompute"
    mel_cache: torch.Tensor | None = field(default=None, repr=False)
    source_cache: torch.Tensor | None = field(default=None, repr=False)
    speech_cache: torch.Tensor | None = field(default=None, repr=False)
    mel: torch.Tensor | None = field(default=None, repr=False)
    speech_offset: int = 0
    incremental: IncrementalState | None = field(default=None, repr=False)
    calls: int = 0
    finished: bool = False

    @classmethod
    def create(cls, spec: ModelSpec, generator: torch.Generator | None = None, seed: int | None = None,
               strategy: str = "recompute") -> VocoderStream:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy}")
        return cls(causal=spec.hift.causal, samples_per_frame=spec.hift.samples_per_frame,
                   mel_cache_len=spec.stream.mel_cache_len, generator=generator, seed=seed, strategy=strategy)

    @property
    def source_cache_len(self) -> int:
        """CV2 overlap in samples (8 · 480 = 3840)."""
        return self.mel_cache_len * self.samples_per_frame

    def request_generator(self, device: torch.device) -> torch.Generator:
        """The request's generator (never the global RNG), created on ``device`` on first use."""
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            if self.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.seed)
        return self.generator


@dataclass
class VocoderCall:
    """One request's chunk in a vocoder batch.

    Attributes:
        stream: the request's :class:`VocoderStream` (updated in place).
        mel: (1, 80, t) new mel frames of this call.
        finalize: last call of the request (CV2: nothing withheld; CV3: no look-ahead).
        generator: CV2 RNG for this call (default: the stream's own).
        source_override: CV2 only, (1, 1, 480·(cached + t)) source used instead of a drawn one
            (parity replays of recorded sources; no cache overwrite is applied).
        speed: non-streaming speed factor (only on a single finalize call).
    """

    stream: VocoderStream
    mel: torch.Tensor
    finalize: bool
    generator: torch.Generator | None = None
    source_override: torch.Tensor | None = field(default=None, repr=False)
    speed: float = 1.0

    @property
    def strategy(self) -> str:
        """The :data:`_STRATEGIES` entry that serves this call."""
        if not self.stream.causal:
            return "cv2_overlap"
        if self.stream.strategy == "incremental" and self.speed == 1.0:
            return "cv3_incremental"
        return "cv3_recompute"  # a speed change is one unstreamed call: a full pass anyway


@torch.inference_mode()
def vocode_batch(hift, calls: Sequence[VocoderCall]) -> list[torch.Tensor]:
    """Vocode one chunk of each of several requests (distinct streams).

    Args:
        hift: the family's vocoder (``HiFTGenerator`` / ``CausalHiFTGenerator``).
        calls: one per request.

    Returns:
        Each call's samples to emit now, (1, n_i) float32 on its mel's device: what the request
        gets when vocoded alone, up to float noise between batch rows.
    """
    if len({id(c.stream) for c in calls}) != len(calls):
        raise ValueError("one call per request stream")
    for c in calls:
        _check(c)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(calls):
        groups[c.strategy].append(i)
    outs: list[torch.Tensor | None] = [None] * len(calls)
    for name, idx in groups.items():
        for i, out in zip(idx, _STRATEGIES[name](hift, [calls[i] for i in idx])):
            outs[i] = out
    for c in calls:
        c.stream.calls += 1
        c.stream.finished = c.finalize
    return outs


def vocode_chunk(hift, stream: VocoderStream, mel: torch.Tensor, finalize: bool,
                 generator: torch.Generator | None = None, source_override: torch.Tensor | None = None,
                 speed: float = 1.0) -> torch.Tensor:
    """One request's chunk: :func:`vocode_batch` of one :class:`VocoderCall`. Returns (1, n)."""
    return vocode_batch(hift, [VocoderCall(stream, mel, finalize, generator, source_override, speed)])[0]


def _check(call: VocoderCall) -> None:
    st = call.stream
    if st.finished:
        raise RuntimeError("vocoder stream already finalized")
    if call.speed != 1.0 and (st.calls > 0 or not call.finalize):
        raise InvalidInputError("speed != 1 is only supported for non-streaming synthesis")
    if st.causal and call.source_override is not None:
        raise ValueError("source_override is only meaningful for the CV2 vocoder")


@functools.lru_cache(maxsize=8)
def crossfade_window(fade_len: int, device: torch.device | None = None) -> torch.Tensor:
    """``np.hamming(2 · fade_len)`` (symmetric) as float64: first half fades in, second fades out.
    Made once per device and never written: a copy per chunk from host memory would wait for the
    work queued on the stream (:mod:`cosyvoice_runtime.host_copy`), and so would this one-time copy
    if it were not queued through pinned memory (the first chunk that cross-fades makes it: the GPU
    sync-debug test caught it)."""
    window = torch.from_numpy(np.hamming(2 * fade_len))
    return window if device is None else to_device(window, device)


def crossfade(speech: torch.Tensor, previous_tail: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Official ``fade_in_out``: ``y[:n] = y[:n]·w[:n] + prev[-n:]·w[n:]`` with n = len(w) / 2.

    Computed in float64 like the official numpy-window product, then cast back.
    """
    n = window.shape[0] // 2
    out = speech.clone()
    head = speech[..., :n].double() * window[:n] + previous_tail[..., -n:].double() * window[n:]
    out[..., :n] = head.to(speech.dtype)
    return out


def speed_resample(mel: torch.Tensor, speed: float) -> torch.Tensor:
    """(B, 80, T) -> (B, 80, int(T / speed)) by linear interpolation (align-corners off)."""
    if speed == 1.0:
        return mel
    return F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")


# ----------------------------------------------------------------------------------- cv2_overlap
def _cv2_overlap(hift, calls: list[VocoderCall]) -> list[torch.Tensor]:
    inputs = [_cv2_input(c) for c in calls]
    by_length: dict[int, list[int]] = defaultdict(list)
    for k, x in enumerate(inputs):
        by_length[int(x.shape[2])].append(k)
    outs: list[torch.Tensor | None] = [None] * len(calls)
    for idx in by_length.values():
        mel = torch.cat([inputs[k] for k in idx], dim=0)
        f0 = hift.f0(mel)
        sources = [_cv2_source(hift, calls[k], f0[j:j + 1]) for j, k in enumerate(idx)]
        speech = hift.decode(mel, torch.cat(sources, dim=0))
        for j, k in enumerate(idx):
            outs[k] = _cv2_emit(calls[k], inputs[k], speech[j:j + 1], sources[j])
    return outs


def _cv2_input(call: VocoderCall) -> torch.Tensor:
    """The vocoder input of a call, ``cached mel ++ new mel`` (speed-resampled if asked)."""
    mel, cache = call.mel, call.stream.mel_cache
    if cache is not None:
        mel = torch.cat([cache.to(mel), mel], dim=2)
    return speed_resample(mel, call.speed)


def _cv2_source(hift, call: VocoderCall, f0: torch.Tensor) -> torch.Tensor:
    """The call's source (1, 1, 480·T): the recorded override, or drawn + cache overwrite."""
    if call.source_override is not None:
        return call.source_override.to(f0)
    st = call.stream
    gen = call.generator if call.generator is not None else st.request_generator(f0.device)
    source = hift.source(f0, generator=gen)
    if st.source_cache is not None:
        source = source.clone()
        source[:, :, :st.source_cache.shape[2]] = st.source_cache
    return source


def _cv2_emit(call: VocoderCall, mel_in: torch.Tensor, speech: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Cross-fade with the previous tail, update the caches, return the samples to emit."""
    st = call.stream
    n = st.source_cache_len
    if st.speech_cache is not None:
        speech = crossfade(speech, st.speech_cache, crossfade_window(n, speech.device))
    if call.finalize:
        st.mel_cache = st.source_cache = st.speech_cache = None
        return speech
    st.mel_cache = mel_in[:, :, -st.mel_cache_len:]
    st.source_cache = source[:, :, -n:]
    st.speech_cache = speech[:, -n:]
    return speech[:, :-n]


# -------------------------------------------------------------------- cv3_recompute / incremental
def _cv3_accumulate(call: VocoderCall) -> torch.Tensor:
    """Append the new frames to the request's mel; returns the accumulated (1, 80, T)."""
    st = call.stream
    st.mel = call.mel if st.mel is None else torch.cat([st.mel, call.mel.to(st.mel)], dim=2)
    return st.mel


def _cv3_emit(stream: VocoderStream, samples: torch.Tensor) -> torch.Tensor:
    stream.speech_offset += samples.shape[1]
    return samples


def _cv3_recompute(hift, calls: list[VocoderCall]) -> list[torch.Tensor]:
    fulls = [speed_resample(_cv3_accumulate(c), c.speed) for c in calls]
    outs = [full.new_zeros(1, 0) for full in fulls]
    # a non-final call over at most `lag` frames has no look-ahead yet: nothing to emit
    run = [k for k, (c, full) in enumerate(zip(calls, fulls)) if c.finalize or full.shape[2] > hift.lag_frames]
    if not run:
        return outs
    spf = hift.samples_per_frame
    for k, speech in zip(run, causal_decode_batch(hift, [fulls[k] for k in run])):
        st, frames = calls[k].stream, fulls[k].shape[2]
        end = frames if calls[k].finalize else frames - hift.lag_frames
        outs[k] = _cv3_emit(st, speech[:, st.speech_offset:end * spf])
    return outs


def _cv3_incremental(hift, calls: list[VocoderCall]) -> list[torch.Tensor]:
    fulls = [_cv3_accumulate(c) for c in calls]
    spf = hift.samples_per_frame
    wins = [plan_window(hift, full.shape[2], c.stream.speech_offset // spf, c.finalize) for c, full in zip(calls, fulls)]
    outs = [full.new_zeros(1, 0) for full in fulls]
    run = [k for k, w in enumerate(wins) if w is not None]
    if not run:
        return outs
    # one f0 batch, one body batch, each item's window right-padded (as in causal_decode_batch)
    f0_in, _ = pad_mels([fulls[k][:, :, wins[k].fa:] for k in run])
    f0 = hift.f0(f0_in, finalize=True).float()
    sources = []
    for j, k in enumerate(run):
        w, st = wins[k], calls[k].stream  # the f0 rows start at w.fa; the window's source at w.a
        source, st.incremental = window_source(hift, st.incremental, w, f0[j:j + 1, w.a - w.fa: w.total - w.fa],
                                               calls[k].finalize)
        sources.append(source)
    mel, lengths = pad_mels([fulls[k][:, :, wins[k].a:] for k in run])
    for k, speech in zip(run, decode_padded(hift, mel, lengths, sources)):
        outs[k] = _cv3_emit(calls[k].stream, window_samples(hift, wins[k], speech))
    return outs


_STRATEGIES: dict[str, Callable[..., list[torch.Tensor]]] = {
    "cv2_overlap": _cv2_overlap,
    "cv3_recompute": _cv3_recompute,
    "cv3_incremental": _cv3_incremental,
}
