"""What an incremental flow stream keeps between its jobs: :class:`FlowCache`, and the voice
prompts' kept prefixes, :class:`PromptPrefixes` (the passes that read and write them:
:mod:`cosyvoice_runtime.flow.incremental`).

Memory decides the cached layout. In bf16 CosyVoice2 holds 560 KiB per cached frame per stream
(56 blocks x 256 channels x 2 rows x 10 steps x 2 bytes): 48 streams of 20 s answers after a
3.5 s prompt (~1180 frames each) hold ~31 GiB; CosyVoice3's DiT (22 blocks x 1024 channels)
880 KiB per frame.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from cosyvoice_runtime.flow.cached_pass import Layout

CACHE_GROWTH = 256  # cached frames are allocated in steps of this many (one copy per growth)
# The open streams' caches together (~0.4 GiB per 10 s CosyVoice2 answer after a 3.5 s prompt in
# bf16); the serving config's default (token2wav.flow_cache_bytes) is the same
DEFAULT_FLOW_CACHE_BYTES = 16 * 1024**3


def grown_capacity(frames: int) -> int:
    """The capacity a cache holding ``frames`` frames is allocated with."""
    return math.ceil(frames / CACHE_GROWTH) * CACHE_GROWTH


@dataclass(eq=False)
class FlowCache:
    """Per-request incremental flow state: the estimator state of frames ``[0, frames)``.

    Attributes:
        attn: per ODE step, the normed input of every transformer block, (blocks, 2, capacity, C):
            both CFG rows; frames past ``frames`` are scratch (the running job writes its kept frames there).
        convs: per ODE step, the last input frames of every causal convolution, (2, channels, hist).

    A running job never changes what frames ``[0, frames)`` read, and :meth:`commit` reassigns
    the fields, so a shallow copy taken before a job is a complete checkpoint of it.
    """

    frames: int = 0
    attn: list[torch.Tensor] = field(default_factory=list)
    convs: list[torch.Tensor] = field(default_factory=list)

    def nbytes(self) -> int:
        """Bytes the cached tensors hold (capacity included)."""
        return sum(t.numel() * t.element_size() for t in (*self.attn, *self.convs))

    @property
    def capacity(self) -> int:
        """Frames the cached tensors have room for."""
        return self.attn[0].shape[2] if self.attn else 0

    def reserve(self, frames: int, n_steps: int, layout: Layout, like: torch.Tensor) -> None:
        """Room for ``frames`` cached frames at each of ``n_steps`` steps (new tensors, old frames copied)."""
        if frames <= self.capacity:
            return
        # One allocation and one grouped copy for all steps: growing is on the token2wav thread
        # between passes, where ten fills and ten copies were twenty launches under the GIL.
        grown = list(like.new_zeros(n_steps, layout.n_blocks, 2, grown_capacity(frames), layout.dim).unbind(0))
        if self.attn:
            torch._foreach_copy_([t[:, :, :self.frames] for t in grown], [t[:, :, :self.frames] for t in self.attn])
        self.attn = grown

    def prefix(self, frames: int, convs: list[torch.Tensor]) -> FlowCache:
        """A new cache of this one's first ``frames`` frames (its own tensors, exactly that long) with
        the convolution history ``convs`` recorded at that frame (:attr:`IncrementalRow.mark_convs`)."""
        return FlowCache(frames=frames, attn=[t[:, :, :frames].clone() for t in self.attn], convs=list(convs))

    def shared(self) -> FlowCache:
        """A cache starting from this one without copying it: the new owner writes only past
        ``frames``, which :meth:`reserve` moves to new tensors first (this one holds exactly ``frames``)."""
        return FlowCache(frames=self.frames, attn=list(self.attn), convs=list(self.convs))


class PromptPrefixes:
    """Per-voice flow caches of the prompt's whole attention chunks, least recently used out past
    ``max_bytes``.

    Why it is exact: a voice prompt taken as a non-final job (its last look-ahead tokens as
    context) ends at ``B`` = the last attention-chunk boundary at or before ``2 (Lp - lookahead)``
    frames; every estimator state of frames ``[0, B)`` depends only on the prompt (tokens, mel,
    speaker vector), the fixed noise and the time grid, so it is the same in every request with
    that prompt. A request's first job then solves ``[B, T)`` instead of ``[0, T)``: ~150 of the
    ~200 frames of a first chunk after a 3.5 s prompt, ~30 % of a 6 s answer's estimator frames.

    Thread-safe: a request looks its voice up on the replica's event loop (``Token2Wav.prefix_job``)
    while the token2wav thread reads and fills the cache. ``count=False`` lookups are a stream's
    second look at a voice it was already counted for (hits and misses count streams, not lookups).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._caches: dict[bytes, FlowCache] = {}  # insertion order = use order
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.primed = 0  # prefixes solved by a job of their own (Token2Wav.prefix_job)

    def get(self, key: bytes, count: bool = True) -> FlowCache | None:
        with self._lock:
            cache = self._caches.pop(key, None)
            if cache is not None:
                self._caches[key] = cache
            if count:
                self.hits += cache is not None
                self.misses += cache is None
            return cache

    def put(self, key: bytes, cache: FlowCache) -> None:
        if cache.nbytes() > self.max_bytes:
            return
        with self._lock:
            self._caches.pop(key, None)
            self._caches[key] = cache
            while self._nbytes() > self.max_bytes:
                del self._caches[next(iter(self._caches))]

    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        return sum(c.nbytes() for c in self._caches.values())

    def __len__(self) -> int:
        return len(self._caches)
