"""The one place where blocking model compute leaves the replica's event loop.

Every forward pass of a synthesizer replica (LLM steps, flow + HiFT batches) goes through one
:class:`ComputeExecutor`: a single worker thread by default, so GPU work is serialised in
submission order and the asyncio loop stays free to accept requests, stream chunks and notice
disconnects (house style §2.5 rule 19). It also measures how busy the device was, which is the
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


class ComputeExecutor:
    """Runs blocking callables off the event loop and tracks the busy fraction.

    Args:
        num_threads: worker threads (1 = strictly serial device use).
        window_s: length of the window over which :meth:`busy_fraction` is measured.
    """

    def __init__(self, num_threads: int = 1, window_s: float = 10.0, name: str = "compute") -> None:
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix=name)
        self._window_s = window_s
        self._intervals: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()  # intervals are appended from worker threads

    async def run(self, fn: Callable[..., T], *args) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._timed, fn, args)

    def _timed(self, fn: Callable[..., T], args: tuple) -> T:
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._intervals.append((start, time.monotonic()))

    def busy_fraction(self, now: float | None = None) -> float:
        """Fraction of the last ``window_s`` seconds during which a call was running (0..1)."""
        now = time.monotonic() if now is None else now
        lo = now - self._window_s
        with self._lock:
            while self._intervals and self._intervals[0][1] < lo:
                self._intervals.popleft()
            busy = sum(min(end, now) - max(start, lo) for start, end in self._intervals if end > lo)
        return max(0.0, min(1.0, busy / self._window_s))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
