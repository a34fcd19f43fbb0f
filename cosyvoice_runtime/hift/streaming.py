"""Per-request streaming vocoder glue: explicit state + pure functions (spec §5.5, §5.6).

A request owns one :class:`VocoderStream`; :func:`vocode_chunk` turns the mel of each token2wav
call into the audio samples to emit and updates the state. Nothing is stored on the (shared)
vocoder module.

* CV2 (non-causal HiFT), "overlap with caches": the last ``mel_cache_len`` mel frames, the last
  ``mel_cache_len · samples_per_frame`` source samples and as many output samples are cached; the
  next call prepends the cached mel, overwrites the start of its source with the cached source and
  cross-fades its first samples with the cached output (``np.hamming`` of twice that length, whose
  halves sum to ≈ 1.08 [quirk]); non-final calls withhold their last cached-length samples.
* CV3 (causal HiFT), "full recompute" (the reference): the accumulated mel is re-vocoded every call
  with the chunk's ``finalize`` flag and only samples beyond those already emitted are returned.
  ``strategy="incremental"`` gives the same samples in O(n) (:mod:`cosyvoice_runtime.hift.incremental`).
* Speed change (non-streaming only): linear interpolation of the mel to ``int(T / speed)`` frames.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.hift.incremental import incremental_vocode

STRATEGIES = ("recompute", "incremental")


@dataclass
class VocoderStream:
    """Vocoder state of one request.

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
    calls: int = 0
    finished: bool = False
    incremental: object | None = field(default=None, repr=False)  # IncrementalState (CV3)

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

    @property
    def has_history(self) -> bool:
        return self.calls > 0

    def request_generator(self, device: torch.device) -> torch.Generator:
        """The request's generator (never the global RNG), created on ``device`` on first use."""
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            if self.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.seed)
        return self.generator


def crossfade_window(fade_len: int, device: torch.device | None = None) -> torch.Tensor:
    """``np.hamming(2 · fade_len)`` (symmetric) as float64: first half fades in, second fades out."""
    return torch.from_numpy(np.hamming(2 * fade_len)).to(device)


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


def _check_speed(state: VocoderStream, finalize: bool, speed: float) -> None:
    if speed != 1.0 and (state.has_history or not finalize):
        raise InvalidInputError("speed != 1 is only supported for non-streaming synthesis")


def cv2_prepare(state: VocoderStream, mel: torch.Tensor, speed: float = 1.0) -> torch.Tensor:
    """CV2: the vocoder input of a call, ``cached mel ++ new mel`` (speed-resampled if asked)."""
    if state.mel_cache is not None:
        mel = torch.cat([state.mel_cache.to(mel), mel], dim=2)
    return speed_resample(mel, speed)


def cv2_source(hift, state: VocoderStream, f0: torch.Tensor, generator: torch.Generator | None,
               source_override: torch.Tensor | None) -> torch.Tensor:
    """CV2: the call's source (1, 1, 480·T): recorded override, or drawn + cache overwrite."""
    if source_override is not None:
        return source_override.to(f0)
    gen = generator if generator is not None else state.request_generator(f0.device)
    source = hift.source(f0, generator=gen)
    if state.source_cache is not None:
        n = state.source_cache.shape[2]
        source = source.clone()
        source[:, :, :n] = state.source_cache
    return source


def cv2_finish(state: VocoderStream, mel_in: torch.Tensor, speech: torch.Tensor, source: torch.Tensor,
               finalize: bool) -> torch.Tensor:
    """CV2: cross-fade with the previous tail, update the caches, return the samples to emit."""
    n = state.source_cache_len
    if state.speech_cache is not None:
        speech = crossfade(speech, state.speech_cache, crossfade_window(n, speech.device))
    if finalize:
        state.mel_cache = state.source_cache = state.speech_cache = None
        return speech
    state.mel_cache = mel_in[:, :, -state.mel_cache_len:]
    state.source_cache = source[:, :, -n:]
    state.speech_cache = speech[:, -n:]
    return speech[:, :-n]


def _vocode_cv2(hift, state: VocoderStream, mel: torch.Tensor, finalize: bool,
                generator: torch.Generator | None, source_override: torch.Tensor | None, speed: float) -> torch.Tensor:
    mel_in = cv2_prepare(state, mel, speed)
    source = cv2_source(hift, state, hift.f0(mel_in), generator, source_override)
    return cv2_finish(state, mel_in, hift.decode(mel_in, source), source, finalize)


def cv3_accumulate(state: VocoderStream, mel: torch.Tensor) -> torch.Tensor:
    """CV3: append the new frames to the request's mel; returns the accumulated (1, 80, T)."""
    state.mel = mel if state.mel is None else torch.cat([state.mel, mel.to(state.mel)], dim=2)
    return state.mel


def cv3_emit(hift, state: VocoderStream, speech: torch.Tensor, frames: int, finalize: bool) -> torch.Tensor:
    """CV3: the new samples of a finalize-style run ``speech`` over ``frames`` accumulated frames.

    A non-final official call returns the first ``480·(frames - lag)`` samples of the finalize run
    over the same frames (spec §5.4), so batched/incremental callers run finalize and cut here.
    """
    end = frames * state.samples_per_frame if finalize else max(0, frames - hift.lag_frames) * state.samples_per_frame
    out = speech[:, state.speech_offset:end]
    state.speech_offset += out.shape[1]
    return out


def _vocode_cv3(hift, state: VocoderStream, mel: torch.Tensor, finalize: bool, speed: float) -> torch.Tensor:
    cv3_accumulate(state, mel)
    if state.strategy == "incremental" and speed == 1.0:  # a speed change is one unstreamed call: a full pass anyway
        return incremental_vocode(hift, state, finalize)
    full = speed_resample(state.mel, speed)
    if not finalize and full.shape[2] <= hift.lag_frames:
        return full.new_zeros(full.shape[0], 0)  # not enough look-ahead yet: nothing to emit
    speech, _ = hift.inference(full, finalize=finalize)
    out = speech[:, state.speech_offset:]
    state.speech_offset += out.shape[1]
    return out


@torch.inference_mode()
def vocode_chunk(hift, state: VocoderStream, mel_chunk: torch.Tensor, finalize: bool,
                 generator: torch.Generator | None = None, source_override: torch.Tensor | None = None,
                 speed: float = 1.0) -> torch.Tensor:
    """Vocode one token2wav chunk of a request and return the samples to emit now.

    Args:
        hift: the family's vocoder (``HiFTGenerator`` / ``CausalHiFTGenerator``).
        state: the request's :class:`VocoderStream` (updated in place).
        mel_chunk: (1, 80, t) new mel frames of this call.
        finalize: last call of the request (CV2: nothing withheld; CV3: no look-ahead).
        generator: CV2 RNG for this call (default: the request's own generator).
        source_override: CV2 only, (1, 1, 480·(cached + t)) source to use instead of a freshly
            drawn one (parity replays of recorded sources; no cache overwrite is applied).
        speed: non-streaming speed factor (only on a single finalize call).

    Returns:
        (1, n) float32 samples on the mel's device.
    """
    if state.finished:
        raise RuntimeError("vocoder stream already finalized")
    _check_speed(state, finalize, speed)
    if state.causal:
        if source_override is not None:
            raise ValueError("source_override is only meaningful for the CV2 vocoder")
        out = _vocode_cv3(hift, state, mel_chunk, finalize, speed)
    else:
        out = _vocode_cv2(hift, state, mel_chunk, finalize, generator, source_override, speed)
    state.calls += 1
    state.finished = finalize
    return out
