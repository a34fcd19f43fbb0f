"""The CosyVoice3 causal vocoder's batched body (``conv_pre`` .. ``conv_post``) as CUDA graphs.

CosyVoice2's vocoder replays graphs (:mod:`cosyvoice_runtime.hift.graphs`); CosyVoice3's ran op by
op: every finishing batch of its incremental strategy launched the body's several hundred small
kernels (snake activations and dilated convs of its residual blocks) from the token2wav thread,
under the GIL, for every chunk of every stream. An eager CV2 vocoder call held that thread,
and every stream's next chunk behind it, under load (docs/tuning.md §1).

Why padded buckets work here when CV2 needs exact lengths: the body is causal. Every layer sees
only frames at or before its output, except the look-ahead convs, whose zero padding past an
item's end is what the item's own finalize run sees (:mod:`cosyvoice_runtime.hift.batch`). So
zero frames appended after the longest item of a right-padded batch change no item's valid
outputs, and one graph per (batch bucket, frames bucket) serves every window of
``cv3_incremental`` (the new frames plus a bounded left context: a few hundred frames at most).
The per-item source STFT and iSTFT (which look at an item's end) stay outside, as in
:func:`~cosyvoice_runtime.hift.batch.decode_padded`.

Graphs share one memory pool: replays run one at a time (lock) and the output is copied out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cosyvoice_runtime import graph_capture
from cosyvoice_runtime.graph_capture import batch_buckets, bucket_for
from cosyvoice_runtime.hift.incremental import left_context_frames

FRAME_STEP = 16  # mel frames per bucket step


@dataclass
class _Bucket:
    graph: torch.cuda.CUDAGraph | None
    mel: torch.Tensor  # (B, 80, T)
    stft: torch.Tensor  # (B, n_fft + 2, frames_per_mel·T + 1)
    out: torch.Tensor | None = None  # the body's output, same shape as stft


class GraphedCausalBody(graph_capture.GraphOwner):
    """``hift.body(hift.conv_pre(mel), stft)`` replayed per padded (batch, frames) bucket.

    Args:
        hift: a CV3 ``CausalHiFTGenerator`` (float32, as the runtime keeps every vocoder).
        max_batch: largest batch a graph serves.
        max_frames: longest mel a graph serves; longer calls run eagerly (graph misses).
        use_graphs: False runs the same padded buckets eagerly (CPU tests of the padding).
    """

    # Its buckets end at the longest incremental window; the recompute strategy (speed-changed
    # requests) re-vocodes the whole accumulated mel, past them after a few seconds.
    miss_hint = ("CosyVoice3 vocoder windows past the captured frames: speed-changed requests re-vocode the "
                 "whole mel (token2wav.cv3_vocoder: recompute)")

    def __init__(self, hift, max_batch: int = 16, max_frames: int = 320, use_graphs: bool = True) -> None:
        super().__init__()
        self.hift = hift
        self.batch_buckets = batch_buckets(max_batch)
        self.max_frames = math.ceil(max_frames / FRAME_STEP) * FRAME_STEP
        self.use_graphs = use_graphs
        self.frames_per_mel = hift.samples_per_frame // hift.hop  # source STFT frames per mel frame

    def bucket_of(self, batch: int, frames: int) -> tuple[int, int] | None:
        """The (batch, frames) bucket serving a call, or None when it is larger than any."""
        if batch > self.batch_buckets[-1] or frames > self.max_frames:
            return None
        return bucket_for(self.batch_buckets, batch), math.ceil(frames / FRAME_STEP) * FRAME_STEP

    def graph_keys(self) -> list[tuple]:
        return [(b, t) for b in self.batch_buckets for t in range(FRAME_STEP, self.max_frames + 1, FRAME_STEP)]

    def __call__(self, mel: torch.Tensor, stft: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, T) right-padded, stft (B, n_fft + 2, frames_per_mel·T + 1) -> the body's
        output (B, n_fft + 2, frames_per_mel·T + 1)."""
        b, _, t = mel.shape
        key = self.bucket_of(b, t)
        on_gpu = mel.device.type == "cuda"
        if key is None or (self.use_graphs and not on_gpu) or self._pending(key):
            self._ran_eagerly(on_gpu)
            return self._body(mel, stft)
        with self._lock:
            bucket = self._get(key)
            # zeros past every item's end: what its own finalize run sees (module docstring)
            bucket.mel.zero_()
            bucket.stft.zero_()
            bucket.mel[:b, :, :t].copy_(mel)
            bucket.stft[:b, :, :stft.shape[2]].copy_(stft)
            if bucket.graph is None:
                bucket.out = self._body(bucket.mel, bucket.stft)
            else:
                bucket.graph.replay()
            self.replays += 1
            return bucket.out[:b, :, :stft.shape[2]].clone()

    def _body(self, mel: torch.Tensor, stft: torch.Tensor) -> torch.Tensor:
        return self.hift.body(self.hift.conv_pre(mel), stft)

    def _get(self, key: tuple[int, int]) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is not None:
            return bucket
        b, t = key
        param = next(self.hift.parameters())
        bucket = _Bucket(graph=None,
                         mel=torch.zeros(b, self.hift.spec.in_channels, t, device=param.device, dtype=param.dtype),
                         stft=torch.zeros(b, self.hift.n_fft + 2, self.frames_per_mel * t + 1, device=param.device,
                                          dtype=param.dtype))
        if self.use_graphs and param.device.type == "cuda":
            bucket.graph, bucket.out = self._capture(lambda: self._body(bucket.mel, bucket.stft), param.device)
        self._buckets[key] = bucket
        return bucket


def streaming_window_frames(hift, spec) -> int:
    """The longest window ``cv3_incremental`` vocodes for a streamed request of ``spec`` (a
    ``ModelSpec``): the left context, the frames the previous call withheld (``lag_frames``) and
    the largest chunk (a full hop of the largest size plus the look-ahead, the last chunk's most)."""
    st, flow = spec.stream, spec.flow
    new = flow.token_mel_ratio * (st.token_max_hop_len + flow.pre_lookahead_len)
    return left_context_frames(hift.spec) + hift.lag_frames + new


def graph_causal_body(hift, max_batch: int, max_frames: int = 320, capture: bool = True,
                      use_graphs: bool = True) -> GraphedCausalBody:
    """Make a CV3 vocoder's batched decode (:func:`~cosyvoice_runtime.hift.batch.decode_padded`)
    run its body through :class:`GraphedCausalBody`, attached as ``hift.graphed_body`` (a plain
    attribute: the checkpoint keys are unchanged); with ``capture``, every bucket now. Windows of
    streamed requests fit (:func:`streaming_window_frames`); an unstreamed request's whole mel
    or a speed-changed one's recompute runs eagerly (counted as graph misses)."""
    graphed = GraphedCausalBody(hift, max_batch=max_batch, max_frames=max_frames, use_graphs=use_graphs)
    hift.graphed_body = graphed
    if capture:
        graphed.capture()
    return graphed
