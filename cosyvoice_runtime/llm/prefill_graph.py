"""Prompts of new requests as padded forwards from static buffers, one CUDA graph per shape.

A prefill launched eagerly is ~600 small kernels (24 layers) whatever its length, bound by CPU
launch overhead: 20-30 ms per new request on an H200 (capacity traces of 2026-12-04), and every
running stream's next decode step waits behind it, so each arrival stalls all the others.
:class:`PrefillRunner` runs the whole prefill - the 24 layers writing keys/values at positions
0..T-1 of each row's slot, the final norm, the ``llm_decoder`` logits of each row's last
position - from static buffers, captured per (batch bucket, length bucket) and replayed.

Only prompts of empty slots take this path (a new request; a bistream row extending a slot that
already holds positions stays eager): with no older positions, attention is causal over the
row's own padded prompt, so the graph needs no key window or mask input. Rows are right-padded
to the length bucket (causal attention keeps every valid position blind to the padding after
it; the padded keys past a row's end are overwritten by its next tokens), the batch to the
batch bucket with rows that write into the engine's scratch slot.

Without CUDA (or ``use_graphs=False``) the same computation runs eagerly, which is how the CPU
tests check it against the engine's eager prefill.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from cosyvoice_runtime import graph_capture
from cosyvoice_runtime.graph_capture import bucket_for
from cosyvoice_runtime.llm.kv_cache import KVCache

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 4  # prompts per replay; more admitted in one step take further replays
LENGTH_STEP = 64  # length buckets: every 64 positions to 512, then every 128 (padding is cheap, graphs are not free)
LARGEST_LENGTH = 1024


def default_length_buckets(max_len: int, largest: int = LARGEST_LENGTH) -> list[int]:
    """64, 128, ..., 512, 640, ..., ``largest``, capped at the cache's ``max_len``."""
    out, n = [], LENGTH_STEP
    while n <= min(largest, max_len):
        out.append(n)
        n += LENGTH_STEP if n < 512 else 2 * LENGTH_STEP
    return out or [max_len]


class PrefillRunner(graph_capture.GraphOwner):
    """Prefill of empty KV slots from static buffers; CUDA-graph replay on CUDA.

    Args:
        model: :class:`~cosyvoice_runtime.llm.model.SpeechLM` (eval, on the cache's device).
        cache: the engine's KV cache; ``pad_slot`` is a slot the scheduler never hands out.
        max_batch: prompts per forward.
        length_buckets: padded prompt lengths (default :func:`default_length_buckets`); a
            longer prompt is not this runner's (:meth:`fits`).
        use_graphs: capture CUDA graphs (default: iff the cache is on CUDA).
    """

    def __init__(self, model, cache: KVCache, pad_slot: int, *, max_batch: int = DEFAULT_MAX_BATCH,
                 length_buckets: Sequence[int] | None = None, use_graphs: bool | None = None) -> None:
        super().__init__()  # graphs by bucket, their capture stream and memory pool
        if not 0 <= pad_slot < cache.num_slots:
            raise ValueError(f"pad_slot {pad_slot} is not a slot of a {cache.num_slots}-slot cache")
        self.model, self.cache, self.pad_slot = model, cache, pad_slot
        self.batch_buckets = graph_capture.batch_buckets(max_batch)
        self.length_buckets = sorted(length_buckets or default_length_buckets(cache.max_len))
        if self.length_buckets[-1] > cache.max_len:
            raise ValueError(f"length bucket {self.length_buckets[-1]} exceeds max_len {cache.max_len}")
        dev = cache.device
        self.use_graphs = dev.type == "cuda" if use_graphs is None else use_graphs
        width = model.spec.llm_input_size
        self._x = torch.zeros(max_batch, self.length_buckets[-1], width, dtype=cache.dtype, device=dev)
        self._slots = torch.full((max_batch,), pad_slot, dtype=torch.long, device=dev)
        self._last = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self._logits = torch.zeros(max_batch, model.llm_decoder.out_features, dtype=cache.dtype, device=dev)
        self.forwards = 0  # groups run (replayed or eager)

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    def fits(self, lengths: Sequence[int]) -> bool:
        """Whether prompts of these lengths are this runner's (no longer than the largest bucket)."""
        return max(lengths) <= self.length_buckets[-1]

    def run(self, inputs: Sequence[torch.Tensor], slots: Sequence[int]) -> torch.Tensor:
        """Write each (T_i, H) prompt into its empty slot; returns (n, V) logits of each row's
        last position (a fresh tensor) and sets the slots' lengths."""
        if any(self.cache.lengths[s] for s in slots):
            raise ValueError("PrefillRunner only fills empty slots")
        out = [self._run_group(inputs[i:i + self.max_batch], slots[i:i + self.max_batch])
               for i in range(0, len(inputs), self.max_batch)]
        return torch.cat(out)

    def _run_group(self, inputs: Sequence[torch.Tensor], slots: Sequence[int]) -> torch.Tensor:
        n = len(inputs)
        lengths = [int(x.shape[0]) for x in inputs]
        b, t = bucket_for(self.batch_buckets, n), bucket_for(self.length_buckets, max(lengths))
        graph = self._graph(b, t) if self.use_graphs else None  # a first capture writes the inputs
        for i, x in enumerate(inputs):
            self._x[i, :lengths[i]].copy_(x)
            self._x[i, lengths[i]:t].zero_()  # stale values could hold non-finite data that 0 x NaN would spread
        index = torch.tensor([list(slots) + [self.pad_slot] * (b - n), [k - 1 for k in lengths] + [0] * (b - n)],
                             dtype=torch.long).to(self._slots.device)
        self._slots[:b].copy_(index[0])
        self._last[:b].copy_(index[1])
        if graph is not None:
            graph.replay()
        else:
            self._body(b, t)
        self.forwards += 1
        for s, k in zip(slots, lengths):
            self.cache.lengths[s] = k
        return self._logits[:n].clone()  # the buffer is the next replay's output

    def _body(self, b: int, t: int) -> None:
        """The captured computation: ``_x[:b, :t]``, ``_slots[:b]``, ``_last[:b]`` -> ``_logits[:b]``."""
        hidden = self.model.backbone.prefill_static(self._x[:b, :t], self.cache, self._slots[:b])
        last = hidden[torch.arange(b, device=hidden.device), self._last[:b]]
        self._logits[:b].copy_(self.model.logits(last))

    # -- graphs ----------------------------------------------------------------------------
    def capture(self) -> int:
        """Capture every (batch, length) bucket now (startup); returns how many exist."""
        if self.use_graphs:
            for b in self.batch_buckets:
                for t in self.length_buckets:
                    self._graph(b, t)
        return self.num_graphs

    def _graph(self, b: int, t: int) -> torch.cuda.CUDAGraph:
        graph = self._buckets.get((b, t))
        if graph is not None:
            return graph
        # Every row points at the scratch slot, so the warm-up run writes nothing that matters.
        self._slots.fill_(self.pad_slot)
        self._last.zero_()
        graph, _ = self._capture(lambda: self._body(b, t), self.cache.device)
        self._buckets[(b, t)] = graph
        logger.debug("captured prefill graph batch=%d length=%d", b, t)
        return graph
