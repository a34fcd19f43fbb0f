"""One CUDA-graph capture recipe shared by the LLM's graphs and token2wav's.

Each owner (:class:`~cosyvoice_runtime.llm.cuda_graph.DecodeRunner`,
:class:`~cosyvoice_runtime.llm.prefill_graph.PrefillRunner`, the flow's and the vocoder's
graph wrappers) captures on a capture stream of its
own. PyTorch keys cuBLAS workspaces by (handle, stream) and a captured GEMM keeps the
workspace address of its capture stream; ``torch.cuda.graph`` defaults to one process-wide
capture stream, so without this the LLM graphs and the flow graphs would share one workspace
and race on it when the LLM thread and the token2wav thread replay them at the same time.
That hung both replays for good once batch-16 flow graphs ran beside batch-16 decode graphs
(the hang and its stacks: bench/results/2026-12-03-h200-throughput-flowgraphs);
see also pytorch/pytorch#193402 on graphs of one capture stream sharing workspace state.
"""
from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

_captured = 0  # graphs captured in this process, by every owner
_missed = 0  # calls that ran eagerly on CUDA with graphs on, by every owner


def captured_total() -> int:
    """Graphs captured in this process so far. A replica reports it: growth after start-up means
    shapes first met under traffic, each captured then."""
    return _captured


def missed_total() -> int:
    """Calls that ran eagerly on CUDA although their owner's graphs are on (a shape beyond the
    captured buckets, or one not captured yet). A replica reports it: such a call launches each of
    its kernels from the host, under the GIL, where a replay launches one graph."""
    return _missed


def capture(fn: Callable[[], object], stream: torch.cuda.Stream, pool=None,
            warm: Callable[[], object] | None = None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm ``fn`` up on ``stream`` and capture it there; returns ``(graph, fn's output)``.

    ``warm``: the warm-up instead of ``fn`` (the same work on scratch buffers: an owner whose
    static buffers a replica is using while it captures, :mod:`cosyvoice_runtime.graph_schedule`).

    The warm-up runs on the capture stream itself so that the cuBLAS/cuDNN handles, plans and
    workspace a capture uses exist before the capture starts (a capture cannot allocate them).
    ``thread_local``: other threads may keep using the GPU while one captures.

    NOTE: not ``torch.cuda.graph(...)``: its ``__enter__`` synchronizes the whole device and
    empties the caching allocator and the pinned host cache. A graph captured at start-up loses
    nothing without that; one captured under traffic (a vocoder length first met then) would stall
    every stream of the replica, and the emptied cache would make the next allocations cudaMalloc
    again (a device-wide synchronization each).
    """
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream), torch.inference_mode():
        (warm or fn)()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.inference_mode():
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    global _captured
    _captured += 1
    return graph, out


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes the graphs of every owner are captured for: 1, 2, 4, ... below
    ``max_batch``, then ``max_batch``; a batch is padded to the next one."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """The smallest of the ascending ``buckets`` that holds ``n`` (a shape padded up to it)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class FairLock:
    """A lock handed to its waiters in the order they came (a ``threading.Lock`` is not: its
    holder, releasing and at once acquiring again, usually wins). An owner's captures after ready
    (:mod:`cosyvoice_runtime.graph_schedule`) take its lock one graph after another; with a plain
    lock a serving replay could wait through many of them (a fresh H100 replica's first request
    waited 5 s behind 56, 2026-12-07). With this one a replay waits for the capture in progress only."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._waiters: collections.deque[threading.Lock] = collections.deque()
        self._held = False

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def acquire(self) -> None:
        with self._mutex:
            if not self._held:
                self._held = True
                return
            turn = threading.Lock()
            turn.acquire()
            self._waiters.append(turn)
        turn.acquire()  # release() hands the lock over by releasing this: it is held on return

    def release(self) -> None:
        with self._mutex:
            if not self._held:
                raise RuntimeError("release of an unheld FairLock")
            if self._waiters:
                self._waiters.popleft().release()  # the next waiter holds it now
            else:
                self._held = False

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class GraphOwner:
    """What every graph owner keeps (the LLM's decode and prefill runners, the token2wav
    owners): graphs by shape key (``_buckets``), its capture stream, the one memory pool its
    graphs share, the lock its replays and captures take where several threads replay (the
    token2wav owners; the LLM runners run on the engine thread only), and counters of replays
    and eager calls."""

    # What the log line of a miss suggests (an owner whose buckets another setting bounds says so)
    miss_hint = "longer prompts or text pieces than synthesizer.flow_graph_max_s covers?"

    def __init__(self) -> None:
        self._buckets: dict = {}
        self._pool = None
        self._capture_stream: torch.cuda.Stream | None = None
        self._lock = FairLock()
        self.replays = 0
        self.eager_calls = 0
        self.use_graphs = False  # the owners set it
        # graph_schedule: a shape whose graph is not captured yet runs eagerly (the background
        # thread captures it) instead of being captured on the serving thread
        self.deferred = False
        self.background_safe = True  # whether capture_key may run beside serving (graph_schedule)

    def _ran_eagerly(self, on_cuda: bool) -> None:
        """Count a call that ran without a graph; on CUDA with graphs on it is also a miss (:func:`missed_total`)."""
        self.eager_calls += 1
        if self.use_graphs and on_cuda:
            global _missed
            _missed += 1
            if _missed & (_missed - 1) == 0:  # 1, 2, 4, ...: seen in the log, bounded volume
                logger.warning("%d calls ran eagerly on the GPU so far (this one: %s), shapes beyond the captured CUDA "
                               "graphs: %s", _missed, type(self).__name__, self.miss_hint)

    @property
    def num_graphs(self) -> int:
        return len(self._buckets)

    def graph_keys(self) -> list[tuple]:
        """The keys of every graph captured at start-up (:mod:`cosyvoice_runtime.graph_schedule`)."""
        return []

    def capture(self) -> int:
        """Capture every start-up graph now (``graph_keys``); how many graphs exist."""
        for key in self.graph_keys():
            self.capture_key(key)
        return self.num_graphs

    def capture_key(self, key: tuple) -> None:
        """Capture one start-up graph (``graph_keys``), under the replay lock: a replay of this
        owner waits for it, other owners' work goes on."""
        with self._lock:
            self._get(key)

    def _pending(self, key: tuple) -> bool:
        """Whether ``key``'s graph is left to the background capture (the call runs eagerly)."""
        return self.deferred and key not in self._buckets

    def _get(self, key: tuple):
        raise NotImplementedError

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy`` of a model with graphs enabled) captures its own graphs: the
        captured ones replay into the original's buffers."""
        state = self.__dict__.copy()
        state.update(_buckets={}, _pool=None, _capture_stream=None, _lock=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = FairLock()

    def _capture(self, fn: Callable[[], object], device: torch.device,
                 warm: Callable[[], object] | None = None) -> tuple[torch.cuda.CUDAGraph, object]:
        """:func:`capture` on this owner's stream (created on first use) into its pool."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(device)
        graph, out = capture(fn, self._capture_stream, self._pool, warm)
        if self._pool is None:
            self._pool = graph.pool()
        return graph, out
