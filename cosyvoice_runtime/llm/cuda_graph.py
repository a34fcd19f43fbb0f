"""Bucketed decode step with static buffers, captured as one CUDA graph per shape.

A decode step of the engine is hundreds of small kernels (24 layers) plus sampling; launched one
by one from Python it is bound by CPU launch overhead (graphed, it takes a fraction of its eager
time: docs/tuning.md §1). :class:`DecodeRunner` runs the whole step - embedding of the fed ids,
the 24 layers with the KV write at per-row positions, attention over a fixed key window with a
per-row length mask, final norm, ``llm_decoder`` logits, log-softmax, min-length mask and the
batched sampler of :mod:`~cosyvoice_runtime.llm.batch_sampling` - from static device buffers, so
that on CUDA it is captured once per (batch bucket, key window) and replayed: one host-to-device
copy of the packed per-row inputs, one graph launch, one device-to-host copy of the chosen ids
(the step's only sync).

Shapes are bucketed: the batch is padded to the next batch bucket (padding rows write into a
scratch KV slot at position 0 and are ignored), and the attended key window is the next key
bucket (powers of two from ``MIN_KEY_WINDOW``, capped at the cache's ``max_len``) above the
longest position of the batch. Why key buckets and not one graph over the slot's whole
``max_len``: decoding is memory-bound, and the attention reads (and the slot gather copies)
``B x window`` keys and values per layer; at batch 64 and ``max_len`` 2048 a full window
moves ~5 GB per step (bf16), several times the 0.7 GB of weights, while a power-of-two bucket
at most doubles the keys actually needed. The cost is more graphs (batch buckets x key
buckets, ~35), each small; they share one memory pool.

Without CUDA (or with ``use_graphs=False``) the same computation runs eagerly, which is how
the CPU tests check it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cosyvoice_runtime import graph_capture
from cosyvoice_runtime.graph_capture import bucket_for
from cosyvoice_runtime.llm import batch_sampling as bs
from cosyvoice_runtime.llm.generate import DecodeState, pack_states
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.sampling import SamplingParams

logger = logging.getLogger(__name__)

MIN_KEY_WINDOW = 128
DEFAULT_HISTORY_WIDTH = 16  # >= the yaml's win_size (10); rows with a larger window sample eagerly
# fed id, slot, position, carry (the row of the step before whose chosen id, still on the GPU, is
# fed instead: ``feed_on_device``; -1 = the fed id given); the sampler's columns follow
_DECODE_COLS = 4


def default_key_buckets(max_len: int) -> list[int]:
    """``MIN_KEY_WINDOW``, doubling, capped at (and ending with) ``max_len``."""
    out, w = [], MIN_KEY_WINDOW
    while w < max_len:
        out.append(w)
        w *= 2
    return out + [max_len]


class DecodeRunner(graph_capture.GraphOwner):
    """One engine decode step from static buffers; CUDA-graph replay on CUDA.

    Args:
        model: :class:`~cosyvoice_runtime.llm.model.SpeechLM` (eval, on the cache's device).
        cache: the engine's KV cache; ``pad_slot`` is a slot the scheduler never hands out.
        max_batch_size: largest decode batch.
        stop_mask_ids: ids masked for rows still below their min length.
        history_width: emitted ids kept per row for the RAS repetition check.
        use_graphs: capture CUDA graphs (default: iff the cache is on CUDA).
        feed_on_device: the step may take a row's fed id from the step before's choice on the
            GPU (:meth:`launch` with ``carry``), so the engine queues a step before it has read
            the previous one's ids (``LLMEngine`` ``run_ahead``); its graphs gather that id first.
    """

    def __init__(self, model, cache: KVCache, max_batch_size: int, pad_slot: int, stop_mask_ids: Sequence[int], *,
                 history_width: int = DEFAULT_HISTORY_WIDTH, batch_buckets: Sequence[int] | None = None,
                 key_buckets: Sequence[int] | None = None, use_graphs: bool | None = None,
                 compile_backend: str | None = None, feed_on_device: bool = False) -> None:
        super().__init__()  # graphs by bucket, their capture stream and memory pool
        if not 0 <= pad_slot < cache.num_slots:
            raise ValueError(f"pad_slot {pad_slot} is not a slot of a {cache.num_slots}-slot cache")
        self.model, self.cache, self.pad_slot = model, cache, pad_slot
        # compile_backend: the model part of the step through torch.compile (dynamic batch and
        # window: one build, not one per bucket), captured like the eager step; the fused kernels
        # cut the kernels per step (mode torchscript).
        self._decode = model.decode_static
        if compile_backend is not None:
            self._decode = torch.compile(model.decode_static, dynamic=True, backend=compile_backend)
        self.history_width = history_width
        self.feed_on_device = feed_on_device
        self.batch_buckets = sorted(batch_buckets or graph_capture.batch_buckets(max_batch_size))
        self.key_buckets = sorted(key_buckets or default_key_buckets(cache.max_len))
        if self.batch_buckets[-1] < max_batch_size or self.key_buckets[-1] > cache.max_len:
            raise ValueError(f"buckets {self.batch_buckets} / {self.key_buckets} do not fit batch {max_batch_size} "
                             f"and max_len {cache.max_len}")
        dev = cache.device
        self.use_graphs = dev.type == "cuda" if use_graphs is None else use_graphs
        self.background_safe = compile_backend is None  # a torch.compile'd step is traced on one thread
        rows, cols = self.batch_buckets[-1], _DECODE_COLS + bs.num_cols(history_width)
        # Packed rows, pinned, in two buffers used in turn: a step launched ahead (launch()) may
        # not have copied its rows to the device yet when the next one is packed; the one after
        # that is packed once the first step's ids were read, so its copy has run.
        self._host = [torch.zeros(rows, cols, dtype=torch.long, pin_memory=dev.type == "cuda") for _ in range(2)]
        self._next_pack = 0
        vocab = model.llm_decoder.out_features
        self._logits = torch.zeros(rows, vocab, dtype=cache.dtype, device=dev)
        self._ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self._stop_mask = bs.stop_mask(stop_mask_ids, vocab, dev)
        # Padding row: scratch slot, position 0 (key 0 is visible, so its softmax is finite), greedy.
        self._pad_row = torch.tensor([0, pad_slot, 0, -1] + pad_sampler_row(history_width), dtype=torch.long)
        # Padding rows until the first step packs real ones: a compiled step warms up on these
        # buffers, and zero rows (slot 0, temperature 0) sampled NaN there (H100 2026-12-07).
        self._rows = self._pad_row.to(dev).expand(rows, -1).contiguous()
        # launch(): two pinned host copies of the chosen ids, so one step's copy is queued while
        # the one before it is read
        self._host_ids = [torch.zeros(rows, dtype=torch.long, pin_memory=dev.type == "cuda") for _ in range(2)]
        self._next_ids = 0

    # -- the step --------------------------------------------------------------------------
    def can_sample(self, params) -> bool:
        """Whether the in-step sampler serves these params (else the caller samples from the logits)."""
        return in_step_sampler_serves(params, self.history_width)

    def step(self, tokens: Sequence[int], slots: Sequence[int], states: Sequence) -> tuple[list[int], torch.Tensor]:
        """Feed one id per running slot, advance the slots, choose the next ids.

        Args:
            tokens: the last emitted id of each row.
            slots: each row's KV slot.
            states: each row's :class:`~cosyvoice_runtime.llm.generate.DecodeState` (sampler
                inputs; rows whose params ``can_sample`` rejects get a placeholder id).

        Returns:
            ids: the chosen id per row, ``batch_sampling.NONFINITE`` for a row whose logits are not finite;
            logits: (B, V) view of a static buffer, overwritten by the next step (clone to keep).
        """
        n = len(slots)
        self._run(tokens, slots, states, None)
        ids = self._ids[:n].tolist()  # the step's one host sync
        self.cache.advance(list(slots), 1)
        return ids, self._logits[:n]

    def launch(self, tokens: Sequence[int], slots: Sequence[int], states: Sequence,
               carry: Sequence[int]) -> Launched:
        """:meth:`step` without waiting for it (``feed_on_device`` runners): the step is queued and
        its ids copied to the host behind it; :meth:`collect` waits for them.

        Args:
            carry: per row, the row of the step launched before this one whose chosen id it
                feeds (its sampler history gets that id too, and its ``states`` are one step
                behind: their step count and min-length mask are taken one step on); -1: the
                fed id is ``tokens``'s and the state is current.
        """
        if not self.feed_on_device:
            raise RuntimeError("launch() needs a runner made with feed_on_device")
        n = len(slots)
        self._run(tokens, slots, states, carry)
        self.cache.advance(list(slots), 1)
        host = self._host_ids[self._next_ids]
        self._next_ids ^= 1
        host[:n].copy_(self._ids[:n], non_blocking=True)
        done = None
        if self.cache.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Launched(n, host, done)

    @staticmethod
    def collect(launched: Launched) -> list[int]:
        """The ids chosen by a launched step (waits for that step only)."""
        if launched.done is not None:
            launched.done.synchronize()
        return launched.host[:launched.n].tolist()

    def _run(self, tokens: Sequence[int], slots: Sequence[int], states: Sequence, carry: Sequence[int] | None) -> None:
        """Pack the rows (one host -> device copy) and run the step: the graph of its bucket, or eagerly."""
        n = len(slots)
        positions = [self.cache.lengths[s] for s in slots]
        self.cache.check_room(list(slots), 1)
        b = bucket_for(self.batch_buckets, n)
        window = bucket_for(self.key_buckets, max(positions) + 1)
        graph = None
        if self.use_graphs and self._pending((b, window)):  # graph_schedule captures it in the background
            self._ran_eagerly(True)
        elif self.use_graphs:
            graph = self._graph(b, window)
        packed = self._host[self._next_pack]
        self._next_pack ^= 1
        host = packed.numpy()
        host[n:b] = self._pad_row.numpy()
        host[:n, 0], host[:n, 1], host[:n, 2] = tokens, slots, positions
        host[:n, 3] = -1 if carry is None else carry
        ahead = None if carry is None else [c >= 0 for c in carry]
        pack_sampler_rows(states, self.history_width, host[:n, _DECODE_COLS:], ahead)
        self._rows[:b].copy_(packed[:b], non_blocking=True)
        if graph is not None:
            graph.replay()
        else:
            self._body(b, window)

    def _body(self, b: int, window: int, buffers: tuple | None = None) -> None:
        """The captured computation: static inputs ``_rows[:b]`` -> ``_logits[:b]``, ``_ids[:b]``
        (``buffers``: other (rows, logits, ids) instead, a warm-up's scratch)."""
        rows, logits_out, ids_out = buffers or (self._rows, self._logits, self._ids)
        rows = rows[:b]
        fed, sampler_rows = rows[:, 0], rows[:, _DECODE_COLS:]
        if self.feed_on_device:
            fed, sampler_rows = self._carried(rows, ids_out)
        logits = self._decode(fed, self.cache, rows[:, 1], rows[:, 2], window)
        logits_out[:b].copy_(logits)
        ids_out[:b].copy_(bs.choose_ids(logits, sampler_rows, self._stop_mask))

    def _carried(self, rows: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fed ids and sampler rows where a row continues the step before: that step's choice (in
        ``_ids``, read here before this step overwrites it) is fed and is the newest history
        entry. A row the step before ended (a stop id, or NONFINITE) is wasted work the engine
        drops: its id is only kept inside the embedding's range."""
        carried = rows[:, 3] >= 0
        previous = ids.index_select(0, rows[:, 3].clamp(min=0))
        fed = torch.where(carried, previous, rows[:, 0]).clamp(min=0)
        sampler = rows[:, _DECODE_COLS:]
        if self.history_width:
            hist = sampler[:, bs.C_HIST:]
            hist = torch.where(carried[:, None], torch.cat([hist[:, 1:], fed[:, None]], dim=1), hist)
            sampler = torch.cat([sampler[:, :bs.C_HIST], hist], dim=1)
        return fed, sampler

    # -- graphs ----------------------------------------------------------------------------
    def graph_keys(self) -> list[tuple]:
        return [(b, w) for b in self.batch_buckets for w in self.key_buckets] if self.use_graphs else []

    def capture_key(self, key: tuple) -> None:
        self._graph(*key)

    def capture(self, batch_sizes: Sequence[int] | None = None, windows: Sequence[int] | None = None) -> int:
        """Capture the graphs of these buckets now (default: all); returns how many exist."""
        if self.use_graphs:
            for b in batch_sizes or self.batch_buckets:
                for w in windows or self.key_buckets:
                    self._graph(bucket_for(self.batch_buckets, b), bucket_for(self.key_buckets, w))
        return self.num_graphs

    def _graph(self, b: int, window: int) -> torch.cuda.CUDAGraph:
        graph = self._buckets.get((b, window))
        if graph is not None:
            return graph
        # The warm-up runs on scratch buffers, every row at the scratch slot: it writes nothing that
        # matters, also from the background capture thread while the engine thread steps
        # (graph_schedule; the captured work itself does not run). A compiled step warms up on the
        # buffers it is captured with: its graphs are all captured before ready, on one thread, and
        # torch.compile traced on the scratch tensors traced again inside the capture, which failed
        # (the GPU tests of bench/results/2026-12-07-h100-cold-start).
        warm = None
        if self.background_safe:
            dev = self._rows.device
            scratch = (self._pad_row.to(dev).expand(b, -1).contiguous(), torch.zeros_like(self._logits[:b]),
                       torch.zeros_like(self._ids[:b]))
            warm = lambda: self._body(b, window, scratch)
        graph, _ = self._capture(lambda: self._body(b, window), self.cache.device, warm=warm)
        self._buckets[(b, window)] = graph
        logger.debug("captured decode graph batch=%d window=%d", b, window)
        return graph


@dataclass
class Launched:
    """A step queued by :meth:`DecodeRunner.launch`: its ``n`` ids land in ``host`` once ``done``
    (a CUDA event; None off CUDA, where the step has run already)."""

    n: int
    host: torch.Tensor
    done: torch.cuda.Event | None


# Sampler inputs of a row the in-step sampler does not serve (a greedy placeholder).
_PAD_PARAMS = SamplingParams(method="greedy", top_k=1, win_size=0, tau_r=0.0)
_PadState = DecodeState(min_len=0, max_len=1, params=_PAD_PARAMS, rng_seed=0)


def in_step_sampler_serves(params: SamplingParams, history_width: int) -> bool:
    """Whether a static step's sampler (:func:`~cosyvoice_runtime.llm.batch_sampling.choose_ids`)
    serves these params: not the official RNG stream, and a RAS window it can see."""
    return not params.official_rng and (params.method != "ras" or params.win_size <= history_width)


def pad_sampler_row(history_width: int) -> list[int]:
    """The sampler columns of a padding row (greedy)."""
    return bs.pack_rows([_PAD_PARAMS], [[]], [0], [0], [False], history_width)[0].tolist()


def pack_sampler_rows(states: Sequence[DecodeState], history_width: int, out,
                      ahead: Sequence[bool] | None = None) -> None:
    """Each row's sampler inputs into ``out`` (rows the in-step sampler does not serve get a
    greedy placeholder: their caller samples them from the logits). ``ahead``: rows whose state is
    one step behind (their last id is still on the GPU): step count and min-length mask one on."""
    served = [st if in_step_sampler_serves(st.params, history_width) else _PadState for st in states]
    pack_states(served, history_width, out=out, ahead=ahead)
