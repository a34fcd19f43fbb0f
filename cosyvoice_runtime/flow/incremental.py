"""Incremental flow for streaming: solve only the frames past a cached boundary, batched over
requests and one Euler pass at a time (issue 14). Both families: CosyVoice2's U-Net and
CosyVoice3's DiT (each pass is the estimator's own cache-aware ``forward_cached``, over the state
of :mod:`cosyvoice_runtime.flow.cached_pass`).

The official streaming schedule (spec §6.1) recomputes the prompt and every earlier token on each
flow call, so a late chunk of a long utterance costs a solve over the whole sequence. With chunk
attention masks the frames before an attention-chunk boundary never see a frame after it, and
everything else in the estimator is per frame or causal:

* the U-Net (:class:`~cosyvoice_runtime.flow.unet.CausalUNet`) has only causal k=3 convolutions,
  per-frame LayerNorm / Mish / 1x1 convolutions / feed-forwards, and self-attention where a query
  sees the keys of its own and earlier 50-frame chunks (:func:`~cosyvoice_runtime.flow.masks.chunk_mask`);
  the DiT (:class:`~cosyvoice_runtime.flow.dit.DiT`) has per-frame projections, norms and
  feed-forwards, a causal k=31 convolutional position embedding, rotary angles by absolute
  position and the same chunk-masked attention;
* the CFM solver uses the fixed noise indexed by absolute frame, one time grid for all frames,
  per-frame Euler updates and per-frame classifier-free guidance;
* the encoder's output ``mu`` (and ``cond``) of frames before a boundary does not change when
  tokens are appended (chunk masks and a causal look-ahead whose tokens are real tokens in later calls).

So every estimator activation of a frame before the boundary, at every ODE step and in both CFG
rows, is the same in the next call. :class:`FlowCache` keeps what later frames read of them, per
ODE step: the normed input of every attention block (keys and values are recomputed from it,
one GEMM per block: a quarter of the memory of keeping them) and the last input frames of every
causal convolution. A job is an :class:`IncrementalRow` that solves frames ``[P, T)`` against
the cache of ``[0, P)``; when it finishes, a non-final job's cache advances to the last
attention-chunk boundary at or before ``T`` (frames past it are computed again next call, as they
may see frames that do not exist yet).

Batched and stepped like the recomputed flow (:mod:`cosyvoice_runtime.flow.stepper`): one pass
runs rows of several requests, each at its own ODE step, with its own cached length ``P`` and
new length ``n``, padded to a (batch, new frames, cached frames) bucket. Padding changes no valid
frame: new frames are right-padded (the convolutions are causal), padded and foreign keys are
masked per row, a padded query sees only its row's first new frame (finite, never read). On
CUDA each bucket is one graph; the row caches are copied into one staging buffer shared by all
buckets (one copy per row and pass) and the kept frames copied back out.

What a stream keeps between its jobs (:class:`~cosyvoice_runtime.flow.flow_cache.FlowCache`) and the
voice prompts' kept prefixes are :mod:`cosyvoice_runtime.flow.flow_cache`'s.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from cosyvoice_runtime.flow.cached_pass import Layout, Pass, pass_bias, plain_estimator
from cosyvoice_runtime.flow.cfm import CFMSolver, euler_update
from cosyvoice_runtime.flow.flow_cache import FlowCache
from cosyvoice_runtime.flow.graphs import SolverGraphs
from cosyvoice_runtime.fused import weight_key
from cosyvoice_runtime.graph_capture import batch_buckets, bucket_for
from cosyvoice_runtime.host_copy import to_device

NEW_FRAME_STEP = 64  # padding granularity of a pass's new frames
CACHED_FRAME_STEP = 256  # of its cached frames (they cost one K/V GEMM and attention columns only)
MAX_NEW_FRAMES = 512  # largest new-frame bucket: a first job with a prompt of up to ~9 s


@dataclass(eq=False)
class IncrementalRow:
    """One job's incremental solve in progress: new frames ``[P, P + n)`` over ``cache`` (P = its frames).
    ``tag`` is the caller's (the job)."""

    kind = "incremental"  # what a pass may mix (stream_schedule.pick_rows)
    mu: torch.Tensor  # (80, n) encoder output of the new frames, compute dtype
    cond: torch.Tensor  # (80, n)
    spks: torch.Tensor  # (80,)
    x: torch.Tensor  # (80, n) the ODE state
    cache: FlowCache
    keep: int  # new frames the cache takes when the job is done (0 for a final job)
    tag: object = None
    step: int = 0
    new_convs: list[torch.Tensor] = field(default_factory=list)  # per step done: the convs' next history
    # also record the state after this many new frames (a voice's prompt prefix, PromptPrefixes):
    # their block inputs go into the cache's scratch, the convolution history at it into mark_convs
    mark: int = 0
    mark_convs: list[torch.Tensor] = field(default_factory=list)
    oversize: bool = False  # no captured bucket holds it: passes of its own (Token2Wav.start_solves)

    @property
    def frames(self) -> int:
        return int(self.x.shape[-1])

    @property
    def start(self) -> int:
        return self.cache.frames

    @property
    def stored(self) -> int:
        """New frames whose block inputs this job writes into its cache."""
        return max(self.keep, self.mark)

    def commit(self) -> None:
        """After the last pass: the cache now holds ``P + keep`` frames."""
        self.cache.convs = list(self.new_convs)
        self.cache.frames += self.keep


@dataclass
class _Bucket:
    """Static buffers of one (batch, new frames, cached frames) pass."""

    graph: torch.cuda.CUDAGraph | None
    x: torch.Tensor  # (B, 80, N)
    mu: torch.Tensor
    cond: torch.Tensor
    spks: torch.Tensor  # (B, 80)
    dt: torch.Tensor  # (B,)
    step: torch.Tensor  # (B,) long: each row's ODE step (its line of the time table)
    p_len: torch.Tensor  # (B,) long
    n_len: torch.Tensor  # (B,) long
    hist_idx: torch.Tensor  # (2B, 1, 2 hist) long: which input frames are the history at the kept end and the mark
    hist_in: torch.Tensor  # (2B, channels, hist)
    hist_out: torch.Tensor  # (2B, channels, 2 hist)
    # (blocks, 2B, P + N, C): each block's normed inputs, the P cached frames then the N new ones, in
    # one buffer so that a block attends over it as it is (a concatenation per block copied every
    # cached frame on every pass)
    attn: torch.Tensor
    # (2B, hist + N, channels) the convolutions' channels-last inputs behind their history (a
    # view of one staging buffer shared by the buckets, as attn)
    conv_frames: torch.Tensor
    out: torch.Tensor | None = None  # (B, 80, N): x after the pass

    @property
    def cached(self) -> int:
        return self.attn.shape[2] - self.x.shape[2]

    @property
    def attn_in(self) -> torch.Tensor | None:
        """(blocks, 2B, P, C) the cached frames' part of :attr:`attn`; None for P = 0."""
        return self.attn[:, :, :self.cached] if self.cached else None

    @property
    def attn_out(self) -> torch.Tensor:
        """(blocks, 2B, N, C) the new frames' part of :attr:`attn`."""
        return self.attn[:, :, self.cached:]


def estimator_pass(estimator: nn.Module, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                   bias: torch.Tensor, p: Pass) -> torch.Tensor:
    """One pass: the estimator's cache-aware forward (``forward_cached`` of the U-Net or the DiT)."""
    return estimator.forward_cached(x, mu, spks, cond, bias, p)


def layout_of(estimator: nn.Module) -> Layout:
    """Where the estimator's pass keeps its cached state (``cached_layout()`` of the U-Net or the DiT)."""
    if not hasattr(estimator, "forward_cached"):
        raise TypeError(f"no incremental pass for {type(estimator).__name__}")
    return estimator.cached_layout()


def _compiled_walk(backend: str):
    """:func:`estimator_pass` through ``torch.compile`` with dynamic shapes and without duck sizing.

    Duck sizing gives equal sizes one symbol (a bucket's cached and new frames both 256, its
    cached frames and the keys of another), and each such coincidence among the ~430 buckets was
    a recompile: 4 compiled walks for 27 tiny buckets, each an inductor build of minutes on the
    real model, and a replica did not start within minutes (docs/tuning.md, ``flow_compile``). Without it the walk
    compiles 2 (CosyVoice2) or 4 (CosyVoice3) times over every bucket: a batch of one, and
    nothing cached, are specialised (``tests/runtime/test_compiled_graphs.py``).
    """
    compiled = torch.compile(estimator_pass, dynamic=True, backend=backend)

    def walk(*args):
        with fx_config.patch(use_duck_shape=False):  # read while tracing: a replay never gets here
            return compiled(*args)
    return walk


class IncrementalStepper(SolverGraphs):
    """Passes of the incremental solve over :class:`IncrementalRow` batches.

    Args:
        solver: the flow's CFM solver (a CosyVoice2 U-Net or CosyVoice3 DiT estimator).
        max_batch, max_cached, max_new: largest batch, cached and new lengths served by a padded
            bucket (and a graph); larger passes run eagerly at their exact size.
        padded: pad to buckets (what graphs need); False runs every pass at its exact size (CPU).
        use_graphs: capture each bucket as a CUDA graph (CUDA only).
        compile_backend: ``torch.compile`` the pass (the estimator's ``forward_cached``) with this
            backend (``dynamic``: one compiled pass serves the buckets' shapes; three on the CPU tiny model).
            A pass launches its kernels one by one inside its graph, hundreds of them, which bound
            its time at small batches (kernel profiles: docs/tuning.md §1): fused kernels are
            fewer. None: eager.
        fused_norms: the U-Net pass's residual adds, LayerNorms and cache-slot writes as one
            Triton kernel each where one can run (:func:`~cosyvoice_runtime.kernels.add_layer_norm`:
            154 kernels fewer a pass; the pass time it saves on a GPU: docs/tuning.md, ``fused_norms``).
    """

    def __init__(self, solver: CFMSolver, max_batch: int = 16, max_cached: int = 1024,
                 max_new: int = MAX_NEW_FRAMES, padded: bool = False, use_graphs: bool = False,
                 compile_backend: str | None = None, fused_norms: bool = False) -> None:
        super().__init__(solver, use_graphs)
        self.estimator = plain_estimator(solver.estimator)
        self.layout = layout_of(self.estimator)
        self.compiled = compile_backend is not None
        self.background_safe = not self.compiled  # torch.compile traces on one thread: all before ready
        self.fused_norms = fused_norms
        self._walk = _compiled_walk(compile_backend) if self.compiled else estimator_pass
        self.padded = padded or use_graphs
        self.batch_buckets = batch_buckets(max_batch)
        self.max_cached = math.ceil(max_cached / CACHED_FRAME_STEP) * CACHED_FRAME_STEP
        self.max_new = math.ceil(max_new / NEW_FRAME_STEP) * NEW_FRAME_STEP
        self.passes = 0
        self._staging: torch.Tensor | None = None  # the flat attn of all buckets
        self._conv_staging: torch.Tensor | None = None  # the flat conv_frames of all buckets
        self._hist_range = torch.arange(self.layout.hist, device=self.device)
        # the causal zero padding at frame 0 of a row with nothing cached
        self._no_history = torch.zeros(2, self.layout.conv_channels, self.layout.hist, device=self.device,
                                       dtype=self.dtype)
        # what depends on the ODE time alone, per step (the estimator's time_table): one buffer that
        # captured graphs read, filled again in place when a weight it was made from changes
        self._time_table: torch.Tensor | None = None
        self._time_key: tuple | None = None
        # the parameters it is made from, listed once: walking the estimator's modules for them
        # on every pass took the driver's host time (and the GIL) on every pass
        self._time_weights = self.estimator.time_weights()

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy`` of a flow with this stepper) names its own estimator's modules:
        the layout is keyed by module identity, and the copied one named the original's (a pass of
        the copy raised KeyError)."""
        super().__setstate__(state)
        self.layout = layout_of(self.estimator)

    @property
    def frame_bytes(self) -> int:
        """Bytes one cached frame takes in a request's cache (every ODE step, both CFG rows)."""
        item = torch.empty(0, dtype=self.dtype).element_size()
        return self.n_steps * self.layout.n_blocks * 2 * self.layout.dim * item

    def new_row(self, mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor, cache: FlowCache, keep: int,
                tag: object = None, mark: int = 0) -> IncrementalRow:
        """A row at step 0 for new frames mu, cond (80, n) after the cache's frames; ``x`` is the
        fixed noise at those absolute frames. Reserves the cache's room for the stored frames."""
        n = mu.shape[-1]
        if not (0 <= keep <= n and 0 <= mark <= n):
            raise ValueError(f"a job keeps and marks 0..{n} of its new frames, not {keep} / {mark}")
        if n < 1:
            raise ValueError("an incremental job needs at least one new frame")
        cache.reserve(cache.frames + max(keep, mark), self.n_steps, self.layout, mu)
        x = self.solver.noise(n, spks, offset=cache.frames)[0].clone()
        return IncrementalRow(mu=mu, cond=cond, spks=spks, x=x, cache=cache, keep=keep, tag=tag, mark=mark)

    def solve(self, rows: Sequence[IncrementalRow]) -> None:
        """Every remaining pass of these rows, together."""
        while rows := [r for r in rows if r.step < self.n_steps]:
            self.advance(rows)

    def bucket_of(self, batch: int, new: int, cached: int) -> tuple[int, int, int] | None:
        """The (batch, new, cached) bucket serving a pass, or None for an exact-size one."""
        if not self.padded or batch > self.batch_buckets[-1] or new > self.max_new or cached > self.max_cached:
            return None
        return (bucket_for(self.batch_buckets, batch), math.ceil(new / NEW_FRAME_STEP) * NEW_FRAME_STEP,
                math.ceil(cached / CACHED_FRAME_STEP) * CACHED_FRAME_STEP)

    def graph_keys(self) -> list[tuple]:
        return [(b, new, cached) for b in self.batch_buckets
                for new in range(NEW_FRAME_STEP, self.max_new + 1, NEW_FRAME_STEP)
                for cached in range(0, self.max_cached + 1, CACHED_FRAME_STEP)]

    @torch.inference_mode()
    def advance(self, rows: Sequence[IncrementalRow]) -> None:
        """One Euler pass over ``rows`` (distinct, none finished): each row's ``x``, ``step`` and
        next convolution history advance, its kept frames' block inputs go into its cache."""
        if not rows:
            return
        if any(r.step >= self.n_steps for r in rows):
            raise ValueError("a finished row cannot take another pass")
        if len({id(r.cache) for r in rows}) != len(rows):
            raise ValueError("a request's jobs are sequential: one row per cache in a pass")
        shape = (len(rows), max(r.frames for r in rows), max(r.start for r in rows))
        key = self.bucket_of(*shape)
        with self._lock:
            self._refresh_time_table()
            pending = key is None or self._pending(key)  # too large for any bucket, or not captured yet: eagerly
            bucket = self._new_bucket(*shape) if pending else self._get(key)
            self._load(bucket, rows)
            self._execute(bucket)
            self._store(bucket, rows)
            self.passes += 1

    # -- internals -------------------------------------------------------------------------
    # _load and _store run on the token2wav driver thread once per pass. A tensor statement per
    # row and field made ~850 dispatcher calls for a pass of 16 rows (~53 per row, counted on the
    # CPU), each statement's Python part (index parsing, views) under the GIL: host work
    # of the order of the pass on the GPU, and GIL time the replica's other threads (the
    # engine's, Serve's) wait for. So each field is one call for all rows (the per-row loops run
    # in C++); per row only the views a list of copies needs.
    def _load(self, bucket: _Bucket, rows: Sequence[IncrementalRow]) -> None:
        dts = self.schedule()[1]
        k, b, hist = len(rows), bucket.x.shape[0], self.layout.hist
        channels = self.layout.conv_channels
        # start, frames, step, keep, mark per row: one host -> device copy, never a wait on the GPU
        ints = to_device(torch.tensor([[r.start, r.frames, r.step, r.keep, r.mark] for r in rows]), self.device)
        p_len, n_len, step, keep, mark = ints.unbind(1)
        bucket.p_len.zero_()
        bucket.n_len.zero_()
        bucket.p_len[:k] = p_len
        bucket.n_len[:k] = n_len
        bucket.dt[:k] = dts[step]
        bucket.step[:k] = step
        # padded frames and rows keep finite values (zeros, or what earlier passes left): masked or causal-after
        for name in ("x", "mu", "cond"):
            frames = torch.nn.utils.rnn.pad_sequence([getattr(r, name).T for r in rows], batch_first=True)
            getattr(bucket, name)[:k, :, :frames.shape[1]] = frames.transpose(1, 2)
        bucket.spks[:k] = torch.stack([r.spks for r in rows])
        # the two CFG halves of row i are rows i and b + i of the doubled tensors
        hist_idx = bucket.hist_idx.view(2, b, 2 * hist)
        hist_idx.zero_()
        hist_idx[:, :k, :hist] = self._hist_range + keep[:, None]
        hist_idx[:, :k, hist:] = self._hist_range + mark[:, None]
        bucket.hist_in.view(2, b, channels, hist)[:, :k] = torch.stack(
            [r.cache.convs[r.step] if r.start else self._no_history for r in rows], dim=1)
        cached = [(i, r) for i, r in enumerate(rows) if r.start]
        if cached:
            attn_in = bucket.attn_in.view(bucket.attn_in.shape[0], 2, b, *bucket.attn_in.shape[2:])
            torch._foreach_copy_([attn_in[:, :, i, :r.start] for i, r in cached],
                                 [r.cache.attn[r.step][:, :, :r.start] for _, r in cached])

    def _store(self, bucket: _Bucket, rows: Sequence[IncrementalRow]) -> None:
        k, b, hist = len(rows), bucket.x.shape[0], self.layout.hist
        out = bucket.out[:k].clone()
        hist_out = bucket.hist_out.view(2, b, *bucket.hist_out.shape[1:])[:, :k].clone()
        stored = [(i, r) for i, r in enumerate(rows) if r.stored]
        if stored:
            attn_out = bucket.attn_out.view(bucket.attn_out.shape[0], 2, b, *bucket.attn_out.shape[2:])
            torch._foreach_copy_([r.cache.attn[r.step][:, :, r.start:r.start + r.stored] for _, r in stored],
                                 [attn_out[:, :, i, :r.stored] for i, r in stored])
        for i, r in enumerate(rows):
            r.x = out[i, :, :r.frames]
            # clones: a stream's cache keeps these for its whole life, not the whole pass's tensor
            r.new_convs.append(hist_out[:, i, :, :hist].clone())
            if r.mark:
                r.mark_convs.append(hist_out[:, i, :, hist:].clone())
            r.step += 1

    def _run(self, bucket: _Bucket) -> torch.Tensor:
        b, _, new = bucket.x.shape
        zeros = torch.zeros_like(bucket.mu)
        bias = pass_bias(bucket.p_len, bucket.n_len, bucket.cached, new, self.layout.chunk, bucket.x.dtype)
        if self._time_table is None:  # a first pass: a capture's warm-up (outside the capture), or tests
            self._refresh_time_table()
        time_rows = self._time_table[bucket.step].repeat(2, 1)
        p = Pass(self.layout, bucket.hist_in, bucket.hist_out, bucket.hist_idx, bucket.attn, bucket.p_len, time_rows,
                 bucket.conv_frames, self.fused_norms)
        x_in = torch.cat([bucket.x, bucket.x])
        v = self._walk(self.estimator, x_in, torch.cat([bucket.mu, zeros]),
                       torch.cat([bucket.spks, torch.zeros_like(bucket.spks)]), torch.cat([bucket.cond, zeros]), bias, p)
        return euler_update(bucket.x, v, bucket.dt.view(b, 1, 1), 1.0, self.solver.spec.inference_cfg_rate)

    def _refresh_time_table(self) -> None:
        """The estimator's ``time_table``, made on the first pass and made again into the same
        buffer when a weight it reads was replaced or changed in place (a checkpoint loaded after
        the stepper was made)."""
        key = tuple(weight_key(w) for w in self._time_weights)
        if key == self._time_key:
            return
        with torch.inference_mode():
            table = self.estimator.time_table(self.schedule()[0])
            if self._time_table is None:
                self._time_table = table
            else:
                self._time_table.copy_(table)
        self._time_key = key

    def _staged(self, b: int, new: int, cached: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A bucket's ``attn`` and ``conv_frames``: views of staging buffers shared by every bucket
        (passes run one at a time under the lock), sized for the largest bucket on first use."""
        nb, dim, hist, channels = self.layout.n_blocks, self.layout.dim, self.layout.hist, self.layout.conv_channels
        rows = 2 * self.batch_buckets[-1]
        if self._staging is None:
            self._staging = self._zeros(rows * nb * dim * (self.max_cached + self.max_new))
            self._conv_staging = self._zeros(rows * (hist + self.max_new) * channels)
        attn = self._staging[:nb * 2 * b * (cached + new) * dim].view(nb, 2 * b, cached + new, dim)
        return attn, self._conv_staging[:2 * b * (hist + new) * channels].view(2 * b, hist + new, channels)

    def _zeros(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(*shape, device=self.device, dtype=dtype or self.dtype)

    def _new_bucket(self, b: int, new: int, cached: int, staged: bool = False) -> _Bucket:
        n_mels, nb, dim = self.solver.spec.output_size, self.layout.n_blocks, self.layout.dim
        channels, hist = self.layout.conv_channels, self.layout.hist
        if staged:
            attn, conv_frames = self._staged(b, new, cached)
        else:
            attn = self._zeros(nb, 2 * b, cached + new, dim)
            conv_frames = self._zeros(2 * b, hist + new, channels)
        z, long = self._zeros, torch.long
        return _Bucket(graph=None, x=z(b, n_mels, new), mu=z(b, n_mels, new), cond=z(b, n_mels, new),
                       spks=z(b, n_mels), dt=z(b), step=z(b, dtype=long), p_len=z(b, dtype=long),
                       n_len=z(b, dtype=long), hist_idx=z(2 * b, 1, 2 * hist, dtype=long),
                       hist_in=z(2 * b, channels, hist), hist_out=z(2 * b, channels, 2 * hist), attn=attn,
                       conv_frames=conv_frames)

    def _get(self, key: tuple[int, int, int]) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is not None:
            return bucket
        bucket = self._new_bucket(*key, staged=True)
        if self.use_graphs and bucket.x.device.type == "cuda":
            bucket.n_len.fill_(1)  # a non-empty warm-up input
            bucket.graph, bucket.out = self._capture(lambda: self._run(bucket), bucket.x.device)
        self._buckets[key] = bucket
        return bucket
