"""The one place where blocking model compute leaves the replica's event loop.

Every forward pass of a synthesizer replica (LLM steps, flow + HiFT batches) goes through one
:class:`ComputeExecutor`, so the asyncio loop stays free to accept requests, stream chunks and
notice disconnects (house style §2.5 rule 19). Work runs on named *lanes*, each its own worker
thread(s): with one lane GPU work is serialised in submission order; a synthesizer on a GPU uses
a second lane for token2wav so that a flow batch does not wait for a decode step, or a decode
step for a flow batch (the runtime adapters give each lane its own CUDA stream). The executor
also measures how busy the device was (the union of all lanes' busy intervals), which is the
utilisation figure reported when no NVML reading is available (CPU replicas, tests).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


MAIN = "main"


class ComputeExecutor:
    """Runs blocking callables off the event loop and tracks the busy fraction.

    Args:
        num_threads: worker threads of the main lane (1 = strictly serial use of that lane).
        window_s: length of the window over which :meth:`busy_fraction` is measured.
        lanes: extra lanes, one thread each (``run(..., lane=name)``).
    """

    def __init__(self, num_threads: int = 1, window_s: float = 10.0, name: str = "compute",
                 lanes: tuple[str, ...] = ()) -> None:
        self._pools = {MAIN: ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix=name)}
        for lane in lanes:
            self._pools[lane] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-{lane}")
        self._window_s = window_s
        self._intervals: deque[tuple[float, float]] = deque()
        self._by_call: dict[str, float] = {}  # seconds per callable's name (decode steps vs token2wav)
        self._lock = threading.Lock()  # intervals are appended from worker threads

    @property
    def lanes(self) -> tuple[str, ...]:
        return tuple(self._pools)

    async def run(self, fn: Callable[..., T], *args, lane: str = MAIN) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pools[lane], self._timed, fn, args)

    def call(self, fn: Callable[..., T], *args, lane: str | None = MAIN) -> T:
        """:meth:`run` for a caller that is a thread of its own, not the event loop (the engine
        loop's step thread): blocks that thread until ``fn`` has run on ``lane``; ``lane=None``
        runs it on the calling thread itself (timed like a lane's work)."""
        if lane is None:
            return self._timed(fn, args)
        return self._pools[lane].submit(self._timed, fn, args).result()

    def _timed(self, fn: Callable[..., T], args: tuple) -> T:
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            end = time.monotonic()
            name = getattr(fn, "__name__", type(fn).__name__)
            with self._lock:
                self._intervals.append((start, end))
                self._by_call[name] = self._by_call.get(name, 0.0) + end - start

    def seconds_by_call(self) -> dict[str, float]:
        """Seconds spent so far in each kind of call, by the callable's name (all lanes)."""
        with self._lock:
            return dict(self._by_call)

    def open_entries(self) -> dict[str, int]:
        """Busy intervals held for :meth:`busy_fraction` (trimmed to its window when it is read)."""
        with self._lock:
            return {"compute_intervals": len(self._intervals)}

    def busy_fraction(self, now: float | None = None) -> float:
        """Fraction of the last ``window_s`` seconds during which any lane was running a call (0..1)."""
        now = time.monotonic() if now is None else now
        lo = now - self._window_s
        with self._lock:
            while self._intervals and self._intervals[0][1] < lo:
                self._intervals.popleft()
            spans = sorted((max(start, lo), min(end, now)) for start, end in self._intervals if end > lo)
        busy, reach = 0.0, lo  # overlapping intervals of two lanes count once
        for start, end in spans:
            if end > reach:
                busy += end - max(start, reach)
                reach = end
        return max(0.0, min(1.0, busy / self._window_s))

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
