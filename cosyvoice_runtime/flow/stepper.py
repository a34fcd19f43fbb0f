"""The CFM solve one Euler step at a time, over rows that may be at different steps (issue 14).

A flow job is ten estimator passes. Solved whole
(:class:`~cosyvoice_runtime.flow.graphs.GraphedSolver`), a batch holds the GPU for all ten: a new
stream's first chunk that arrives just after a batch with a late chunk of a 20 s CosyVoice2
utterance started (a solve over the whole sequence, docs/tuning.md §1) waits for all of it, and
that wait was most of the first-audio tail under load. Here each job is a :class:`SolveRow` (its
encoder output, condition, speaker vector and ODE state ``x``) and the caller runs passes over
whichever rows it picks (:func:`~cosyvoice_runtime.stream_schedule.pick_rows`: the most urgent
first), so a first chunk joins at the next pass and finishes ten short passes later while long
jobs with audio to spare wait. Rows at different steps share a pass: the estimator takes a time
per row, and each row's ``(t, dt)`` are the whole solve's
(:func:`~cosyvoice_runtime.flow.cfm.step_schedule`).

Exactness: a row gets what :meth:`CFMSolver.forward` gives it in a batch (same noise by
absolute frame, same step times, same Euler update; padded frames hold the noise as there);
batch composition changes only GEMM rounding, as for any batch.

Graphs: one CUDA graph per (batch, frames) bucket holds one pass; rows are copied into its
static buffers each pass and their state copied back out.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cosyvoice_runtime.flow.cfm import CFMSolver, euler_update
from cosyvoice_runtime.flow.graphs import DEFAULT_FRAME_STEP, SolverBuckets


@dataclass(eq=False)
class SolveRow:
    """One job's solve in progress. ``tag`` is the caller's (the job)."""

    kind = "recompute"  # what a pass may mix (stream_schedule.pick_rows)
    mu: torch.Tensor  # (80, T) encoder output, compute dtype
    cond: torch.Tensor  # (80, T) prompt mel then zeros
    spks: torch.Tensor  # (80,) projected speaker vector
    streaming: bool
    x: torch.Tensor  # (80, T) the ODE state, compute dtype
    tag: object = None
    step: int = 0
    oversize: bool = False  # no bucket holds it: passes of its own (Token2Wav.start_solves)

    @property
    def frames(self) -> int:
        return int(self.x.shape[-1])


@dataclass
class _Bucket:
    graph: torch.cuda.CUDAGraph | None
    x: torch.Tensor  # (B, 80, T)
    mu: torch.Tensor
    mask: torch.Tensor  # (B, 1, T)
    spks: torch.Tensor  # (B, 80)
    cond: torch.Tensor
    streaming: torch.Tensor  # (B,) bool
    t: torch.Tensor  # (B,)
    dt: torch.Tensor  # (B,)
    noise: torch.Tensor  # (B, 80, T): what padded rows and frames hold, as in the whole solve
    out: torch.Tensor | None = None


class FlowStepper(SolverBuckets):
    """Passes of ``solver`` over :class:`SolveRow` batches, graphed per padded bucket.

    Arguments: :class:`~cosyvoice_runtime.flow.graphs.SolverBuckets`; ``use_graphs=False`` runs
    the padded buckets eagerly (CPU); shapes above the largest bucket run eagerly unpadded.
    """

    def __init__(self, solver: CFMSolver, max_batch: int = 16, max_frames: int = 1024,
                 frame_step: int = DEFAULT_FRAME_STEP, use_graphs: bool = True) -> None:
        super().__init__(solver, max_batch, max_frames, frame_step, use_graphs)
        self.passes = 0

    def new_row(self, mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor, streaming: bool,
                tag: object = None) -> SolveRow:
        """A row at step 0: ``x`` is the fixed noise of frames ``[0, T)``."""
        x = self.solver.noise(mu.shape[-1], spks)[0].clone()
        return SolveRow(mu=mu, cond=cond, spks=spks, streaming=streaming, x=x, tag=tag)

    @torch.inference_mode()
    def advance(self, rows: Sequence[SolveRow]) -> None:
        """One Euler pass over ``rows`` (distinct, none finished): each row's ``x`` and ``step`` advance."""
        if not rows:
            return
        if any(r.step >= self.n_steps for r in rows):
            raise ValueError("a finished row cannot take another pass")
        if len({id(r) for r in rows}) != len(rows):
            raise ValueError("a row may appear once per pass")
        b, t_len = len(rows), max(r.frames for r in rows)
        key = self.bucket_of(b, t_len)
        with self._lock:
            if key is None or self._pending(key):  # too large for any bucket (or not captured yet): eagerly
                bucket = self._new_bucket(b, t_len)
            else:
                bucket = self._get(key)
            self._load(bucket, rows)
            self._execute(bucket)
            for i, row in enumerate(rows):
                row.x = bucket.out[i, :, :row.frames].clone()
                row.step += 1
            self.passes += 1

    # -- internals -------------------------------------------------------------------------
    def _load(self, bucket: _Bucket, rows: Sequence[SolveRow]) -> None:
        t_steps, dts = self.schedule()
        bucket.x.copy_(bucket.noise)
        for buf in (bucket.mu, bucket.mask, bucket.cond, bucket.spks, bucket.t, bucket.dt):
            buf.zero_()
        bucket.streaming.fill_(False)
        # device-to-device copies and fills only: a host tensor here would be a pageable copy,
        # which waits for the stream's queued work every pass
        for i, r in enumerate(rows):
            n = r.frames
            bucket.x[i, :, :n] = r.x
            bucket.mu[i, :, :n] = r.mu
            bucket.cond[i, :, :n] = r.cond
            bucket.mask[i, :, :n] = 1
            bucket.spks[i] = r.spks
            bucket.t[i:i + 1] = t_steps[r.step:r.step + 1]
            bucket.dt[i:i + 1] = dts[r.step:r.step + 1]
            if r.streaming:  # a slice: assigning to the 0-d element copies a host scalar (a wait)
                bucket.streaming[i:i + 1] = True

    def _run(self, bucket: _Bucket) -> torch.Tensor:
        """One guided pass over the bucket's rows, as :meth:`CFMSolver.forward` runs each step."""
        b = bucket.x.shape[0]
        zeros = torch.zeros_like(bucket.mu)
        x_in = torch.cat([bucket.x, bucket.x])
        mask_in = torch.cat([bucket.mask, bucket.mask])
        mu_in = torch.cat([bucket.mu, zeros])
        cond_in = torch.cat([bucket.cond, zeros])
        spks_in = torch.cat([bucket.spks, torch.zeros_like(bucket.spks)])
        t_in = torch.cat([bucket.t, bucket.t])
        v = self.solver.estimator(x_in, mask_in, mu_in, t_in, spks_in, cond_in, bucket.streaming.repeat(2))
        return euler_update(bucket.x, v, bucket.dt.view(b, 1, 1), bucket.mask, self.solver.spec.inference_cfg_rate)

    def _new_bucket(self, b: int, t_len: int) -> _Bucket:
        dev, dtype = self.device, self.dtype
        n_mels = self.solver.spec.output_size
        noise = self.solver.noise(t_len, torch.empty(0, device=dev, dtype=dtype)).expand(b, -1, -1).contiguous()

        def z(*shape):
            return torch.zeros(*shape, device=dev, dtype=dtype)

        return _Bucket(graph=None, x=z(b, n_mels, t_len), mu=z(b, n_mels, t_len), mask=z(b, 1, t_len),
                       spks=z(b, n_mels), cond=z(b, n_mels, t_len),
                       streaming=torch.zeros(b, dtype=torch.bool, device=dev), t=z(b), dt=z(b), noise=noise)

    def _get(self, key: tuple[int, int]) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is not None:
            return bucket
        bucket = self._new_bucket(*key)
        if self.use_graphs and bucket.x.device.type == "cuda":
            bucket.mask[:, :, :1] = 1  # a non-empty warm-up input
            bucket.graph, bucket.out = self._capture(lambda: self._run(bucket), bucket.x.device)
            bucket.mask.zero_()
        self._buckets[key] = bucket
        return bucket
