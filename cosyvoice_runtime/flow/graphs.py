"""The whole CFM solve (every Euler step, CFG included) as one CUDA graph per padded shape.

One estimator call of the full-size CosyVoice2 U-Net is over a thousand small kernels; launched
from Python it is bound by their launches whatever the batch, while the same call replayed as a
CUDA graph costs only its kernels' GPU time (eager against graphed: docs/tuning.md §1). A streamed
flow call runs ten of them, so the launch overhead was most of the flow's time and most of the
time to first audio.

:class:`GraphedSolver` is a drop-in for :class:`~cosyvoice_runtime.flow.cfm.CFMSolver` in
:meth:`~cosyvoice_runtime.flow.flow.Flow.inference_batch`: it pads the batch to the next batch
bucket and the frames to the next multiple of ``frame_step``, copies the inputs into the static
buffers of that bucket, replays its graph and returns the valid part. Padding changes nothing
on valid frames: padded frames have mask 0 (the U-Net's convolutions are causal and attention
hides padded keys; the DiT is masked the same way) and padded rows have an all-zero mask. The
initial noise of frame ``i`` is the fixed noise at ``i`` whatever the length, so a bucket's
noise buffer is written once at capture.

Graphs of all buckets share one memory pool: the solve is replayed from one thread at a time
(the caller's lock) and the output is copied out before the next replay. Without CUDA, or
for shapes above the largest bucket, or when intermediates are traced, the eager solver runs.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cosyvoice_runtime import graph_capture
from cosyvoice_runtime.flow.cfm import CFMSolver, step_schedule
from cosyvoice_runtime.graph_capture import batch_buckets, bucket_for

logger = logging.getLogger(__name__)

DEFAULT_FRAME_STEP = 64  # padding granularity of T (mel frames): at most 63 wasted frames per call


@dataclass
class _Bucket:
    """Static buffers of one (batch, frames) graph."""

    graph: torch.cuda.CUDAGraph | None
    mu: torch.Tensor  # (B, 80, T)
    mask: torch.Tensor  # (B, 1, T)
    spks: torch.Tensor  # (B, 80)
    cond: torch.Tensor  # (B, 80, T)
    streaming: torch.Tensor  # (B,) bool
    noise: torch.Tensor  # (B, 80, T)
    out: torch.Tensor | None = None  # (B, 80, T) float32, written by the replay


class SolverGraphs(graph_capture.GraphOwner):
    """What every owner of a CFM solver's graphs has: the solver, its device and dtype, and the
    per-step (t, dt) a solve run pass by pass reads (computed once)."""

    def __init__(self, solver: CFMSolver, use_graphs: bool) -> None:
        super().__init__()
        self.solver = solver
        self.use_graphs = use_graphs
        self._schedule: tuple[torch.Tensor, torch.Tensor] | None = None
        self._weight: tuple[object, torch.Tensor] | None = None  # (estimator, its first parameter)

    @property
    def device(self) -> torch.device:
        return self._first_weight().device

    @property
    def dtype(self) -> torch.dtype:
        return self._first_weight().dtype

    def _first_weight(self) -> torch.Tensor:
        """The estimator's first parameter, looked up again only when the solver's estimator is
        another module (a mode's compiled or TensorRT one): a pass reads the device and dtype ~14
        times, and each ``next(parameters())`` walked the module tree, host time on the driver's
        thread every pass. A parameter moved or cast in place (``Module.to``) is the same object,
        so it stays right."""
        estimator = self.solver.estimator
        if self._weight is None or self._weight[0] is not estimator:
            self._weight = (estimator, next(estimator.parameters()))
        return self._weight[1]

    @property
    def n_steps(self) -> int:
        return self.solver.spec.n_timesteps

    def schedule(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(t, dt) per step on the solver's device and dtype (computed once)."""
        if self._schedule is None:
            self._schedule = step_schedule(self.n_steps, self.solver.spec.t_scheduler, self.dtype, self.device)
        return self._schedule

    def _execute(self, bucket) -> None:
        """A loaded bucket's work: its graph replayed, or ``_run`` eagerly where it has none (into ``bucket.out``)."""
        if bucket.graph is None:
            bucket.out = self._run(bucket)
            self._ran_eagerly(self.device.type == "cuda")
        else:
            bucket.graph.replay()
            self.replays += 1


class SolverBuckets(SolverGraphs):
    """Graphs of a CFM solver's work per padded (batch, frames) bucket: the bucket rule and the
    start-up capture loop shared by the whole solve (:class:`GraphedSolver`) and the single pass
    (:class:`~cosyvoice_runtime.flow.stepper.FlowStepper`); subclasses build a bucket in ``_get``.

    Args:
        solver: the flow's CFM solver (its estimator must be capturable: no host syncs).
        max_batch: largest batch of jobs (before CFG doubling) served by a graph.
        max_frames: largest flow length in frames served by a graph (longer calls run eagerly).
        frame_step: frame padding granularity.
        use_graphs: False runs the same padded buckets eagerly (CPU tests of the padding).
        deferred: start with every shape left to a background capture (calls run eagerly until a
            graph schedule captures it; with none, for good).
    """

    def __init__(self, solver: CFMSolver, max_batch: int = 16, max_frames: int = 1024,
                 frame_step: int = DEFAULT_FRAME_STEP, use_graphs: bool = True, deferred: bool = False) -> None:
        super().__init__(solver, use_graphs)
        self.deferred = deferred
        self.batch_buckets = batch_buckets(max_batch)
        self.frame_step = frame_step
        self.max_frames = math.ceil(max_frames / frame_step) * frame_step

    def bucket_of(self, batch: int, frames: int) -> tuple[int, int] | None:
        """The (batch, frames) bucket serving a call, or None when it is too large for any."""
        if batch > self.batch_buckets[-1] or frames > self.max_frames:
            return None
        return bucket_for(self.batch_buckets, batch), math.ceil(frames / self.frame_step) * self.frame_step

    def frame_buckets(self) -> list[int]:
        return list(range(self.frame_step, self.max_frames + 1, self.frame_step))

    def graph_keys(self) -> list[tuple]:
        return [(b, t) for b in self.batch_buckets for t in self.frame_buckets()]

    def capture(self, batch_sizes: Sequence[int] | None = None, frames: Sequence[int] | None = None) -> int:
        """Capture these buckets now (default: all); returns how many graphs exist."""
        for b in batch_sizes or self.batch_buckets:
            for t in frames or self.frame_buckets():
                key = self.bucket_of(b, t)
                if key is not None:
                    with self._lock:
                        self._get(key)
        return len(self._buckets)

    def _get(self, key: tuple[int, int]):
        raise NotImplementedError


class GraphedSolver(SolverBuckets):
    """CUDA-graph replays of the whole solve over padded (batch, frames) buckets
    (arguments: :class:`SolverBuckets`)."""

    def __call__(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                 streaming: bool | torch.Tensor = False, noise: torch.Tensor | None = None,
                 trace: dict | None = None) -> torch.Tensor:
        b, _, t_len = mu.shape
        key = self.bucket_of(b, t_len)
        graphs = self.use_graphs and mu.device.type == "cuda"
        if (key is None or trace is not None or noise is not None or (self.use_graphs and not graphs)
                or self._pending(key)):
            self._ran_eagerly(graphs)
            return self.solver(mu, mask, spks, cond, streaming=streaming, noise=noise, trace=trace)
        with self._lock:
            bucket = self._get(key)
            self._load(bucket, mu, mask, spks, cond, streaming)
            if bucket.graph is None:
                bucket.out = self._run(bucket)
            else:
                bucket.graph.replay()
            self.replays += 1
            return bucket.out[:b, :, :t_len].clone()

    # -- internals -------------------------------------------------------------------------
    def _load(self, bucket: _Bucket, mu, mask, spks, cond, streaming) -> None:
        b, _, t_len = mu.shape
        for buf in (bucket.mu, bucket.mask, bucket.cond, bucket.spks):
            buf.zero_()
        bucket.mu[:b, :, :t_len] = mu
        bucket.mask[:b, :, :t_len] = mask
        bucket.cond[:b, :, :t_len] = cond
        bucket.spks[:b] = spks
        bucket.streaming.fill_(False)
        bucket.streaming[:b] = streaming if isinstance(streaming, torch.Tensor) else bool(streaming)

    def _run(self, bucket: _Bucket) -> torch.Tensor:
        return self.solver(bucket.mu, bucket.mask, bucket.spks, bucket.cond, streaming=bucket.streaming,
                           noise=bucket.noise)

    def _get(self, key: tuple[int, int]) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is not None:
            return bucket
        b, t_len = key
        dev, dtype = self.device, self.dtype
        n_mels = self.solver.spec.output_size
        noise = self.solver.noise(t_len, torch.empty(0, device=dev, dtype=dtype)).expand(b, -1, -1).contiguous()
        bucket = _Bucket(graph=None, mu=torch.zeros(b, n_mels, t_len, device=dev, dtype=dtype),
                         mask=torch.zeros(b, 1, t_len, device=dev, dtype=dtype),
                         spks=torch.zeros(b, n_mels, device=dev, dtype=dtype),
                         cond=torch.zeros(b, n_mels, t_len, device=dev, dtype=dtype),
                         streaming=torch.zeros(b, dtype=torch.bool, device=dev), noise=noise)
        if self.use_graphs:
            self._capture_bucket(bucket)
        self._buckets[key] = bucket
        return bucket

    def _capture_bucket(self, bucket: _Bucket) -> None:
        bucket.mask[:, :, :1] = 1  # a non-empty warm-up input
        bucket.graph, bucket.out = self._capture(lambda: self._run(bucket), bucket.mu.device)
        bucket.mask.zero_()
        logger.debug("captured flow graph %s", tuple(bucket.mu.shape))
