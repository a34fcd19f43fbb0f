"""Prompts of new requests as padded forwards from static buffers, one CUDA graph per shape.

A prefill launched eagerly is hundreds of small kernels (24 layers) whatever its length, bound by
CPU launch overhead, and every running stream's next decode step waits behind it, so each arrival
stalls all the others (docs/tuning.md §1).
:class:`PrefillRunner` runs the whole prefill - the 24 layers writing keys/values at positions
0..T-1 of each row's slot, the final norm, the ``llm_decoder`` logits of each row's last
position and its first token (the decode step's sampler) - from static buffers, captured per
(batch bucket, length bucket) and replayed.

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
from cosyvoice_runtime.llm import batch_sampling as bs
from cosyvoice_runtime.llm.cuda_graph import (
    DEFAULT_HISTORY_WIDTH,
    in_step_sampler_serves,
    pack_sampler_rows,
    pad_sampler_row,
)
from cosyvoice_runtime.llm.generate import DecodeState
from cosyvoice_runtime.llm.kv_cache import KVCache

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 4  # prompts per replay; more admitted in one step take further replays
LENGTH_STEP = 64  # length buckets: every 64 positions to 512, then every 128 (padding is cheap, graphs are not free)
LARGEST_LENGTH = 1024
_PREFILL_COLS = 2  # slot, last prompt position; the sampler's columns follow


def default_length_buckets(max_len: int, largest: int = LARGEST_LENGTH) -> list[int]:
    """64, 128, ..., 512, 640, ..., ``largest``, capped at the cache's ``max_len``."""
    out, n = [], LENGTH_STEP
    while n <= min(largest, max_len):
        out.append(n)
        n += LENGTH_STEP if n < 512 else 2 * LENGTH_STEP
    return out or [max_len]


class PrefillRunner(graph_capture.GraphOwner):
    """Prefill of empty KV slots from static buffers, each row's first token chosen in the same
    replay (the decode step's sampler, :func:`~cosyvoice_runtime.llm.batch_sampling.choose_ids`);
    CUDA-graph replay on CUDA.

    Why the sampler is inside: chosen eagerly after the replay, a first token took dozens of small
    launches and two pageable copies with their syncs (seen in a profiler trace; at one stream
    without the profiler no gain showed: docs/tuning.md §1), on the step thread that every running
    stream's next decode step waits behind.

    Args:
        model: :class:`~cosyvoice_runtime.llm.model.SpeechLM` (eval, on the cache's device).
        cache: the engine's KV cache; ``pad_slot`` is a slot the scheduler never hands out.
        stop_mask_ids: ids masked for rows still below their min length.
        max_batch: prompts per forward.
        length_buckets: padded prompt lengths (default :func:`default_length_buckets`); a
            longer prompt is not this runner's (:meth:`fits`).
        history_width: the sampler's RAS window (as the decode step's).
        use_graphs: capture CUDA graphs (default: iff the cache is on CUDA).
    """

    def __init__(self, model, cache: KVCache, pad_slot: int, stop_mask_ids: Sequence[int], *,
                 max_batch: int = DEFAULT_MAX_BATCH, length_buckets: Sequence[int] | None = None,
                 history_width: int = DEFAULT_HISTORY_WIDTH, use_graphs: bool | None = None) -> None:
        super().__init__()  # graphs by bucket, their capture stream and memory pool
        if not 0 <= pad_slot < cache.num_slots:
            raise ValueError(f"pad_slot {pad_slot} is not a slot of a {cache.num_slots}-slot cache")
        self.model, self.cache, self.pad_slot = model, cache, pad_slot
        self.history_width = history_width
        self.batch_buckets = graph_capture.batch_buckets(max_batch)
        self.length_buckets = sorted(length_buckets or default_length_buckets(cache.max_len))
        if self.length_buckets[-1] > cache.max_len:
            raise ValueError(f"length bucket {self.length_buckets[-1]} exceeds max_len {cache.max_len}")
        dev = cache.device
        self.use_graphs = dev.type == "cuda" if use_graphs is None else use_graphs
        width = model.spec.llm_input_size
        vocab = model.llm_decoder.out_features
        self._x = torch.zeros(max_batch, self.length_buckets[-1], width, dtype=cache.dtype, device=dev)
        # Per row, one int64 line: slot, index of the last prompt position, the sampler's columns;
        # one copy from pinned memory per forward.
        cols = _PREFILL_COLS + bs.num_cols(history_width)
        self._host = torch.zeros(max_batch, cols, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._host_np = self._host.numpy()
        self._pad_row = torch.tensor([pad_slot, 0] + pad_sampler_row(history_width), dtype=torch.long)
        self._rows = self._pad_row.to(dev).expand(max_batch, -1).contiguous()  # padding until packed (cuda_graph.py)
        self._logits = torch.zeros(max_batch, vocab, dtype=cache.dtype, device=dev)
        self._ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self._stop_mask = bs.stop_mask(stop_mask_ids, vocab, dev)
        self.forwards = 0  # groups run (replayed or eager)

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    def fits(self, lengths: Sequence[int]) -> bool:
        """Whether prompts of these lengths are this runner's (no longer than the largest bucket)."""
        return max(lengths) <= self.length_buckets[-1]

    def can_sample(self, params) -> bool:
        """Whether the in-replay sampler serves these params (else the caller samples from the logits)."""
        return in_step_sampler_serves(params, self.history_width)

    def run(self, inputs: Sequence[torch.Tensor], slots: Sequence[int],
            states: Sequence[DecodeState]) -> tuple[list[int], torch.Tensor]:
        """Write each (T_i, H) prompt into its empty slot and set the slots' lengths.

        Returns:
            ids: each row's first token as its ``state`` samples it (:data:`NONFINITE` for a row
            whose logits are not finite; a placeholder for rows ``can_sample`` rejects);
            logits: (n, V) of each row's last position (a fresh tensor).
        """
        if any(self.cache.lengths[s] for s in slots):
            raise ValueError("PrefillRunner only fills empty slots")
        ids, logits = [], []
        for i in range(0, len(inputs), self.max_batch):
            group = slice(i, i + self.max_batch)
            got, out = self._run_group(inputs[group], slots[group], states[group])
            ids += got
            logits.append(out)
        return ids, logits[0] if len(logits) == 1 else torch.cat(logits)  # each group's is a fresh tensor

    def _run_group(self, inputs: Sequence[torch.Tensor], slots: Sequence[int],
                   states: Sequence[DecodeState]) -> tuple[list[int], torch.Tensor]:
        n = len(inputs)
        lengths = [int(x.shape[0]) for x in inputs]
        b, t = bucket_for(self.batch_buckets, n), bucket_for(self.length_buckets, max(lengths))
        graph = None
        if self.use_graphs and self._pending((b, t)):  # graph_schedule captures it in the background
            self._ran_eagerly(True)
        elif self.use_graphs:
            graph = self._graph(b, t)
        for i, x in enumerate(inputs):
            self._x[i, :lengths[i]].copy_(x)
            self._x[i, lengths[i]:t].zero_()  # stale values could hold non-finite data that 0 x NaN would spread
        host = self._host_np
        host[n:b] = self._pad_row.numpy()
        host[:n, 0], host[:n, 1] = slots, [k - 1 for k in lengths]
        pack_sampler_rows(states, self.history_width, host[:n, _PREFILL_COLS:])
        self._rows[:b].copy_(self._host[:b], non_blocking=True)
        if graph is not None:
            graph.replay()
        else:
            self._body(b, t)
        self.forwards += 1
        logits = self._logits[:n].clone()  # the buffer is the next replay's output
        ids = self._ids[:n].tolist()  # the forward's one host sync (the pinned rows are free again after it)
        for s, k in zip(slots, lengths):
            self.cache.lengths[s] = k
        return ids, logits

    def _body(self, b: int, t: int, buffers: tuple | None = None) -> None:
        """The captured computation: ``_x[:b, :t]``, ``_rows[:b]`` -> ``_logits[:b]``, ``_ids[:b]``
        (``buffers``: other (x, rows, logits, ids) instead, a warm-up's scratch)."""
        x, rows, logits_out, ids_out = buffers or (self._x, self._rows, self._logits, self._ids)
        rows = rows[:b]
        hidden = self.model.backbone.prefill_static(x[:b, :t], self.cache, rows[:, 0])
        logits = self.model.logits(hidden[torch.arange(b, device=hidden.device), rows[:, 1]])
        logits_out[:b].copy_(logits)
        ids_out[:b].copy_(bs.choose_ids(logits, rows[:, _PREFILL_COLS:], self._stop_mask))

    # -- graphs ----------------------------------------------------------------------------
    def graph_keys(self) -> list[tuple]:
        return [(b, t) for b in self.batch_buckets for t in self.length_buckets] if self.use_graphs else []

    def capture_key(self, key: tuple) -> None:
        self._graph(*key)

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
        # The warm-up runs on scratch buffers, every row at the scratch slot: it writes nothing that
        # matters, also from the background capture thread while the engine thread prefills
        # (graph_schedule; the captured work itself does not run).
        dev = self._rows.device
        scratch = (torch.zeros_like(self._x[:b, :t]), self._pad_row.to(dev).expand(b, -1).contiguous(),
                   torch.zeros_like(self._logits[:b]), torch.zeros_like(self._ids[:b]))
        graph, _ = self._capture(lambda: self._body(b, t), self.cache.device, warm=lambda: self._body(b, t, scratch))
        self._buckets[(b, t)] = graph
        logger.debug("captured prefill graph batch=%d length=%d", b, t)
        return graph
