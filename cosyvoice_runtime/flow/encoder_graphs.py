"""The CosyVoice2 token encoder (embedding .. ``encoder_proj``) as CUDA graphs per padded bucket.

With the CFM solve replayed as one graph (:mod:`cosyvoice_runtime.flow.graphs`), the conformer
encoder was ~600 small ops launched from Python per flow call (counted with the profiler on
the full-size spec). Same recipe as the solve: the batch is padded to its bucket with
empty rows, the output tokens to the next multiple of ``token_step``; the input holds that many
plus the look-ahead context. Padding changes nothing on valid frames (keys past an item's
length are hidden and the upsampling conv is causal; :meth:`~cosyvoice_runtime.flow.encoder.
UpsampleConformerEncoder.forward` keeps ``n_keep`` positions), and ``token_step`` is the solve's
``frame_step / token_mel_ratio`` so the encoder output lands in the solve bucket it would have
used anyway.

One memory pool for the encoder graphs (the token2wav lane calls the flow from one thread; the
lock guards the static buffers); the output is copied out before the next replay.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cosyvoice_runtime import graph_capture
from cosyvoice_runtime.graph_capture import batch_buckets, bucket_for

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    graph: torch.cuda.CUDAGraph | None
    ids: torch.Tensor  # (B, K + lookahead) long
    valid: torch.Tensor  # (B, K + lookahead) bool
    lengths: torch.Tensor  # (B,) long
    streaming: torch.Tensor  # (B,) bool
    out: torch.Tensor | None = None  # (B, ratio * K, 80)


class GraphedEncoder(graph_capture.GraphOwner):
    """CUDA-graph replays of ``flow.encode_ids`` over (batch, output tokens) buckets.

    Args:
        flow: the CosyVoice2 :class:`~cosyvoice_runtime.flow.flow.Flow`.
        max_batch: largest batch of jobs a graph serves.
        max_tokens: largest output length in tokens a graph serves (longer calls run eagerly).
        token_step: output-token padding granularity.
        use_graphs: False runs the same padded buckets eagerly (CPU tests of the padding).
    """

    def __init__(self, flow, max_batch: int = 16, max_tokens: int = 512, token_step: int = 32,
                 use_graphs: bool = True) -> None:
        super().__init__()
        self.flow = flow
        self.lookahead = flow.spec.pre_lookahead_len
        self.batch_buckets = batch_buckets(max_batch)
        self.token_step = token_step
        self.max_tokens = math.ceil(max_tokens / token_step) * token_step
        self.use_graphs = use_graphs

    def bucket_of(self, batch: int, n_keep: int) -> tuple[int, int] | None:
        if batch > self.batch_buckets[-1] or n_keep > self.max_tokens:
            return None
        return bucket_for(self.batch_buckets, batch), math.ceil(n_keep / self.token_step) * self.token_step

    def capture(self, batch_sizes: Sequence[int] | None = None, tokens: Sequence[int] | None = None) -> int:
        """Capture these buckets now (default: all); returns how many graphs exist."""
        for b in batch_sizes or self.batch_buckets:
            for k in tokens or range(self.token_step, self.max_tokens + 1, self.token_step):
                key = self.bucket_of(b, k)
                if key is not None:
                    with self._lock:
                        self._get(key)
        return len(self._buckets)

    def graph_keys(self) -> list[tuple]:
        return [(b, k) for b in self.batch_buckets for k in range(self.token_step, self.max_tokens + 1, self.token_step)]

    def __call__(self, ids: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor,
                 streaming: bool | torch.Tensor, n_keep: int) -> torch.Tensor:
        """``flow.encode_ids`` of these inputs: (B, ratio * K, 80) with K >= n_keep."""
        b, t_in = ids.shape
        key = self.bucket_of(b, n_keep)
        if (key is None or (self.use_graphs and ids.device.type != "cuda") or t_in > key[1] + self.lookahead
                or self._pending(key)):
            self._ran_eagerly(ids.device.type == "cuda")
            return self.flow.encode_ids(ids, valid, lengths, streaming, n_keep)
        with self._lock:
            bucket = self._get(key)
            bucket.ids.zero_()
            bucket.valid.zero_()
            bucket.lengths.zero_()
            bucket.ids[:b, :t_in] = ids
            bucket.valid[:b, :t_in] = valid
            bucket.lengths[:b] = lengths
            bucket.streaming.fill_(False)
            bucket.streaming[:b] = streaming if isinstance(streaming, torch.Tensor) else bool(streaming)
            if bucket.graph is None:
                bucket.out = self._run(bucket)
            else:
                bucket.graph.replay()
            self.replays += 1
            return bucket.out[:b].clone()

    def _run(self, bucket: _Bucket) -> torch.Tensor:
        return self.flow.encode_ids(bucket.ids, bucket.valid, bucket.lengths, bucket.streaming,
                                    bucket.ids.shape[1] - self.lookahead)

    def _get(self, key: tuple[int, int]) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is not None:
            return bucket
        b, k = key
        dev = self.flow.input_embedding.weight.device
        t_in = k + self.lookahead
        bucket = _Bucket(graph=None, ids=torch.zeros(b, t_in, dtype=torch.long, device=dev),
                         valid=torch.zeros(b, t_in, dtype=torch.bool, device=dev),
                         lengths=torch.zeros(b, dtype=torch.long, device=dev),
                         streaming=torch.zeros(b, dtype=torch.bool, device=dev))
        if self.use_graphs:
            bucket.valid[:, :1] = True  # a non-empty warm-up input
            bucket.lengths.fill_(1)
            bucket.graph, bucket.out = self._capture(lambda: self._run(bucket), dev)
            bucket.valid.zero_()
            bucket.lengths.zero_()
            logger.debug("captured encoder graph b=%d tokens=%d", b, k)
        self._buckets[key] = bucket
        return bucket
