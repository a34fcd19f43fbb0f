"""The CV2 vocoder's deterministic part (conv_pre .. iSTFT) as CUDA graphs per exact input length.

After the flow solve became one graph replay (:mod:`cosyvoice_runtime.flow.graphs`), the vocoder
was the largest eager part of a token2wav call: about 500 small kernels (snake activations and
dilated convs of 12 residual blocks, the source STFT, the iSTFT) launched from Python on the
token2wav thread, which also holds the GIL the LLM thread needs between its decode steps.

Why exact lengths and not padded ones as in the flow: the CV2 vocoder is non-causal (centred
convolutions, ConvTranspose upsampling, reflect padding), so frames appended at the end change
the last tens of frames of an item. Batch rows are independent, so the batch is padded to a
bucket with zero rows. Streaming makes few lengths: every call after the first feeds
``mel_cache_len + 2 * hop`` frames with hop 25, 50 then 100 tokens (58, 108, 208 frames for the
released spec), and a first chunk has one of 25 lengths (its hop follows the prompt length
modulo 25), and a last chunk one of ~200 (the tokens left after the last hop), so those are
captured at start (``deployments.runtime_adapter.capture_graphs``); a batch of a captured length
whose own batch bucket is not captured replays the captured ones over its rows; other lengths
(unstreamed calls) are captured once seen ``capture_after`` times, up to ``max_graphs``; the rest
run eagerly.

The random source stays outside the graph (each request's own generator and cache overwrite, the
``cv2_overlap`` strategy of :mod:`cosyvoice_runtime.hift.streaming`); the graph takes mel and
source as inputs.
Graphs share one memory pool: replays run one at a time (lock) and the output is copied out.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from cosyvoice_runtime import graph_capture
from cosyvoice_runtime.graph_capture import batch_buckets
from cosyvoice_runtime.stream_schedule import final_chunk_frames, first_chunk_frames, streaming_lengths

logger = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    mel: torch.Tensor  # (B, 80, T)
    source: torch.Tensor  # (B, 1, 480 T)
    out: torch.Tensor | None = None  # (B, 480 T)


class GraphedDecode(graph_capture.GraphOwner):
    """Replays of ``hift.decode_eager`` for (batch bucket, exact frames, dtype) shapes.

    Args:
        hift: a CV2 ``HiFTGenerator``.
        max_batch: largest batch a graph serves (larger calls run eagerly).
        max_frames: longest input a graph serves.
        capture_after: a length not captured at start gets its graph on this many calls.
        max_graphs: graphs kept at most (each holds its static inputs; activations share the pool).
        use_graphs: False runs the same padded buckets eagerly (CPU tests of the padding).
    """

    def __init__(self, hift, max_batch: int = 16, max_frames: int = 512, capture_after: int = 2,
                 max_graphs: int = 512, use_graphs: bool = True) -> None:
        super().__init__()
        self.hift = hift
        self.batch_buckets = batch_buckets(max_batch)
        self.max_frames = max_frames
        self.capture_after = capture_after
        self.max_graphs = max_graphs
        self.use_graphs = use_graphs
        self._calls: Counter[tuple] = Counter()
        self.start_keys: list[tuple] = []  # what start-up captures (graph_streaming_vocoder), but the last chunks'
        self.last_chunk_keys: list[tuple] = []

    def graph_keys(self) -> list[tuple]:
        return self.start_keys

    def capture_key(self, key: tuple) -> None:
        with self._lock:
            if len(self._buckets) < self.max_graphs:
                self._get(key)

    def keys_for(self, frames: Iterable[int], batch_sizes: Sequence[int] | None = None,
                 dtype: torch.dtype | None = None) -> list[tuple]:
        """The keys of these lengths at these batch sizes (default: every bucket)."""
        dtype = dtype or next(self.hift.parameters()).dtype
        keys = (self.key_of(b, t, dtype, dtype) for t in frames for b in batch_sizes or self.batch_buckets)
        return list(dict.fromkeys(k for k in keys if k is not None))

    def key_of(self, batch: int, frames: int, mel_dtype: torch.dtype, source_dtype: torch.dtype) -> tuple | None:
        """The graph key serving a call: (batch bucket, frames, dtypes), or None if too large."""
        if batch > self.batch_buckets[-1] or frames > self.max_frames:
            return None
        return next(x for x in self.batch_buckets if x >= batch), int(frames), mel_dtype, source_dtype

    def capture(self, frames: Iterable[int], batch_sizes: Sequence[int] | None = None,
                dtype: torch.dtype | None = None) -> int:
        """Capture these lengths for every batch bucket now (replica start); how many graphs exist."""
        for key in self.keys_for(frames, batch_sizes, dtype):
            self.capture_key(key)
        return len(self._buckets)

    def __call__(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        key = self.key_of(mel.shape[0], mel.shape[2], mel.dtype, source.dtype)
        on_gpu = mel.device.type == "cuda"
        if key is None or (self.use_graphs and not on_gpu):
            self._ran_eagerly(on_gpu)
            return self.hift.decode_eager(mel, source)
        with self._lock:
            graph = self._buckets.get(key)
            if graph is None:
                if parts := self._captured_parts(mel.shape[0], key):
                    return torch.cat([self._replay(g, mel[i:i + n], source[i:i + n]) for g, i, n in parts])
                if self.deferred:  # the background capture may have it later; never capture on this thread meanwhile
                    self._ran_eagerly(on_gpu)
                    return self.hift.decode_eager(mel, source)
                self._calls[key] += 1
                if self._calls[key] < self.capture_after or len(self._buckets) >= self.max_graphs:
                    self._ran_eagerly(on_gpu)
                    return self.hift.decode_eager(mel, source)
                graph = self._get(key)
            return self._replay(graph, mel, source)

    def _replay(self, graph: _Graph, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``graph``'s decode of these rows (at most its batch; caller holds the lock)."""
        b = mel.shape[0]
        # Rows past b keep an earlier call's (finite) inputs: rows never mix, so they need
        # no clearing and their outputs are dropped.
        graph.mel[:b].copy_(mel)
        graph.source[:b].copy_(source)
        if graph.graph is None:
            graph.out = self.hift.decode_eager(graph.mel, graph.source)
        else:
            graph.graph.replay()
        self.replays += 1
        return graph.out[:b].clone()

    def _captured_parts(self, batch: int, key: tuple) -> list[tuple[_Graph, int, int]]:
        """(graph, first row, rows) covering ``batch`` rows with the graphs already captured for
        ``key``'s length, or [] when it has none: the smallest that holds the rows left, else the
        largest (3 rows over graphs of 2 and 1: 2 + 1). Batch rows are independent, so this is the
        batched decode. Why: start-up captures first-chunk lengths for batches of 1 and 2 and
        last-chunk lengths for 1; three first chunks or two last chunks of one length meeting in a
        pass would otherwise run eagerly (an eager last chunk held the token2wav thread under load:
        docs/tuning.md §1) or be captured under traffic, stalling the lane."""
        sizes = sorted(k[0] for k in self._buckets if k[1:] == key[1:])
        parts, start = [], 0
        while sizes and start < batch:
            left = batch - start
            size = next((s for s in sizes if s >= left), sizes[-1])
            n = min(size, left)
            parts.append((self._buckets[(size, *key[1:])], start, n))
            start += n
        return parts

    def _get(self, key: tuple) -> _Graph:
        graph = self._buckets.get(key)
        if graph is not None:
            return graph
        b, t, mel_dtype, source_dtype = key
        dev = next(self.hift.parameters()).device
        graph = _Graph(graph=None, mel=torch.zeros(b, self.hift.spec.in_channels, t, device=dev, dtype=mel_dtype),
                       source=torch.zeros(b, 1, self.hift.samples_per_frame * t, device=dev, dtype=source_dtype))
        if self.use_graphs:
            graph.graph, graph.out = self._capture(lambda: self.hift.decode_eager(graph.mel, graph.source), dev)
            logger.debug("captured vocoder graph b=%d t=%d", b, t)
        self._buckets[key] = graph
        return graph


def enable_graphs(hift, max_batch: int = 16, max_frames: int = 512, capture_frames: Sequence[int] = (),
                  use_graphs: bool = True, **kwargs) -> GraphedDecode:
    """Make a CV2 ``HiFTGenerator`` decode through CUDA graphs per (batch bucket, exact length).

    Attaches the wrapper as ``hift.graphed_decode`` (a plain attribute, not a submodule, so the
    checkpoint keys are unchanged), which ``hift.decode`` calls from now on.
    ``capture_frames``: lengths captured now, for every batch bucket (replica start-up);
    ``use_graphs=False`` runs the padded buckets eagerly (CPU tests). Other keyword arguments
    go to :class:`GraphedDecode`.
    """
    graphed = GraphedDecode(hift, max_batch=max_batch, max_frames=max_frames, use_graphs=use_graphs, **kwargs)
    hift.graphed_decode = graphed
    if capture_frames:
        graphed.capture(capture_frames)
    return graphed


def graph_streaming_vocoder(hift, spec, max_batch: int, max_frames: int = 512,
                            min_first_hop: int | None = None, capture: bool = True) -> GraphedDecode:
    """Turn on the CV2 vocoder graphs and capture the lengths streaming feeds it (replica start).

    Every call after the first (cache + 2 x hop) for every batch bucket; every first-chunk
    length (:func:`~cosyvoice_runtime.stream_schedule.first_chunk_frames`; ``min_first_hop`` as
    the stream's Token2Wav) for batches of 1 and 2, since first chunks rarely share a length;
    every last-chunk length (:func:`~cosyvoice_runtime.stream_schedule.final_chunk_frames`) for a
    batch of 1. A last chunk vocoded eagerly held the token2wav thread under load, and a first
    chunk queued behind it (docs/tuning.md §1).

    ``capture=False``: only the keys are listed (``start_keys``, ``last_chunk_keys``), for
    :mod:`cosyvoice_runtime.graph_schedule` to capture.
    """
    st, ratio = spec.stream, spec.flow.token_mel_ratio
    later = streaming_lengths(st.mel_cache_len, st.token_hop_len, st.token_max_hop_len, st.stream_scale_factor, ratio)
    graphed = enable_graphs(hift, max_batch=max_batch, max_frames=max_frames)
    keys = graphed.keys_for(later) + graphed.keys_for(first_chunk_frames(st.token_hop_len, ratio, min_first_hop), [1, 2])
    graphed.start_keys = list(dict.fromkeys(keys))
    final = final_chunk_frames(st.mel_cache_len, st.token_max_hop_len, spec.flow.pre_lookahead_len, ratio)
    graphed.last_chunk_keys = [k for k in graphed.keys_for(final, [1]) if k not in set(graphed.start_keys)]
    if capture:
        for key in graphed.start_keys + graphed.last_chunk_keys:
            graphed.capture_key(key)
    return graphed
