"""Incremental O(n) streaming for the CV3 causal vocoder (same samples as the full recompute).

The reference re-vocodes the whole accumulated mel on every chunk (O(n²)). Everything in the
causal vocoder is local with a bounded left receptive field except the sine phase, a cumulative
sum over all frames. So per chunk we

1. keep the cumulative per-frame phase (float64, like the CPU reference's cumsum accumulator) of
   every frame whose f0 is final (more than ``f0_look_right`` frames before the end);
2. vocode, in finalize mode, only a window starting :func:`left_context_frames` frames before the
   first sample still to emit (f0 gets its own causal context before that), with the window's
   source built from the saved phase offset and the fixed noise at absolute sample indices;
3. emit the window's samples from the first not-yet-emitted frame up to ``T - lag`` (non-final)
   or ``T`` (final) — the spec §5.4 equivalence of non-final and finalize runs.

Everything the window start perturbs (source STFT reflect padding, zero left padding of the causal
convs, the left reflection pad, iSTFT start) lies inside the discarded left context.

The window arithmetic and the phase state live here; the strategy that runs them over a batch of
streams is ``cv3_incremental`` in :mod:`cosyvoice_runtime.hift.streaming`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cosyvoice_runtime.config import HiftSpec
from cosyvoice_runtime.hift.generator import CONV_POST_KERNEL

CONTEXT_MARGIN_FRAMES = 2


def _mrf_span(kernel: int, dilations: tuple[int, ...]) -> int:
    """Left receptive field (samples at the block's rate) of one causal ResBlock."""
    return sum((kernel - 1) * d + (kernel - 1) for d in dilations)


def left_context_frames(spec: HiftSpec) -> int:
    """Upper bound (mel frames) of the causal generator body's left receptive field.

    Sums every layer's span (parallel branches summed too, so it is an upper bound), each at its
    own rate: stage i runs at ``prod(upsample_rates[:i+1])`` positions per mel frame, the source
    STFT and ``conv_post`` at ``prod(upsample_rates)`` frames per mel frame.
    """
    total = 0.0
    rate = 1
    stft_rate = math.prod(spec.upsample_rates)
    down_kernels = []
    cum = 1
    for r in [1] + list(spec.upsample_rates[::-1][:-1]):
        cum *= r
        down_kernels.append(2 * cum if cum > 1 else 1)
    down_kernels = down_kernels[::-1]
    for i, (u, k) in enumerate(zip(spec.upsample_rates, spec.upsample_kernel_sizes)):
        rate *= u
        mrf = max(_mrf_span(kk, tuple(d)) for kk, d in zip(spec.resblock_kernel_sizes, spec.resblock_dilation_sizes))
        src = _mrf_span(spec.source_resblock_kernel_sizes[i], tuple(spec.source_resblock_dilation_sizes[i]))
        total += (k - 1 + mrf + src + 1) / rate + down_kernels[i] / stft_rate
    n_fft_frames = spec.istft_n_fft // spec.istft_hop
    total += (CONV_POST_KERNEL - 1 + 2 * n_fft_frames) / stft_rate  # conv_post + STFT + iSTFT spans
    return math.ceil(total) + CONTEXT_MARGIN_FRAMES


@dataclass
class IncrementalState:
    """What an incremental CV3 stream keeps between calls beyond its mel: the cumulative frame
    phase (1, n_final_frames, H) float64 of the frames whose f0 is final. Replaced, never written
    in place, so a shallow copy of the stream is a checkpoint."""

    cum: torch.Tensor


@dataclass(frozen=True)
class Window:
    """What one call vocodes (mel frame indices of the request's accumulated mel)."""

    start: int  # first frame whose samples are still to emit
    end: int  # samples are emitted up to this frame now
    a: int  # first frame of the vocoded window (left context included)
    fa: int  # first frame the f0 predictor sees (its own causal context before ``a``)
    total: int  # accumulated frames


def plan_window(hift, total: int, emitted: int, finalize: bool) -> Window | None:
    """The window of a call over ``total`` accumulated frames of which ``emitted`` frames' samples
    are out, or None when there is nothing to emit yet."""
    end = total if finalize else total - hift.lag_frames
    if end <= emitted:
        return None
    a = max(0, emitted - left_context_frames(hift.spec))
    return Window(start=emitted, end=end, a=a, fa=max(0, a - hift.f0_predictor.left_context), total=total)


def window_source(hift, phase: IncrementalState | None, win: Window, f0: torch.Tensor,
                  finalize: bool) -> tuple[torch.Tensor, IncrementalState]:
    """The window's excitation (1, 1, 480·(total - a)) from its f0 (1, total - a), continuing the
    saved ``phase`` (None on the first call); and the phase with the frames whose f0 is now final."""
    src = hift.m_source
    rad = src.frame_rad(f0)
    cum_before = rad.new_zeros(1, 0, rad.shape[2], dtype=torch.float64) if phase is None else phase.cum
    a = win.a
    offset = cum_before[:, a - 1] if a > 0 else rad.new_zeros(1, rad.shape[2], dtype=torch.float64)
    cum = torch.cumsum(rad.double(), dim=1) + offset.unsqueeze(1)
    committed = cum_before.shape[1]
    final_f0 = win.total if finalize else win.total - hift.f0_look_right
    if final_f0 > committed:
        cum_before = torch.cat([cum_before, cum[:, committed - a: final_f0 - a]], dim=1)
    hift.ensure_noise()
    spf = hift.samples_per_frame
    noise = src.buffer_noise(spf * a, spf * (win.total - a))
    return src.merge(f0, src.upsample_phase(cum.to(rad.dtype)), noise), IncrementalState(cum=cum_before)


def window_samples(hift, win: Window, speech: torch.Tensor) -> torch.Tensor:
    """The samples of frames [start, end) out of the window's (1, 480·(total - a)) speech."""
    spf = hift.samples_per_frame
    return speech[:, spf * (win.start - win.a): spf * (win.end - win.a)]
