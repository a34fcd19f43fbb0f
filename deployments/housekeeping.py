"""Memory housekeeping of a synthesizer replica: glibc arenas capped, freed memory given back
to the OS (host heap) and the allocator (a fragmented CUDA cache) once the replica is idle."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.gpu_stats import release_fragmented_cache

MALLOC_ARENA_MAX = "2"  # glibc arenas per synthesizer replica (see cap_malloc_arenas)
IDLE_TRIM_DELAY_S = 1.0  # after this long without a request, freed heap goes back to the OS


def cap_malloc_arenas(opts: dict[str, Any]) -> dict[str, Any]:
    """``MALLOC_ARENA_MAX`` in the replica's env (deployment options ``opts``, changed in place).

    NOTE: glibc malloc gives threads that allocate concurrently (event loop, compute thread,
    Ray's threads) arenas of their own, up to 8 per core, and keeps freed chunks in each, so
    the replica's RSS ratchets up with every new peak of transient tensors. With 2 arenas the
    tiny model's RSS levelled off after its first requests where by default it kept rising
    (bench/leak_probe.py; the readings: docs/tuning.md §3). Serve merges these env_vars with the
    application's runtime_env.
    """
    env = opts["ray_actor_options"].setdefault("runtime_env", {}).setdefault("env_vars", {})
    env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENA_MAX)
    return opts


def release_free_heap() -> bool:
    """glibc ``malloc_trim(0)``: return freed heap pages to the OS (False where there is no glibc).

    Blocking, and the longer the more there is to return: :class:`IdleTrim` calls it only when the
    replica is idle.
    """
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


class IdleTrim:
    """Once no request has run for IDLE_TRIM_DELAY_S, give freed memory back (on the compute thread).

    NOTE: even with two glibc arenas the heap keeps the freed chunks of the last peak of
    transient tensors; returning them when idle keeps an idle replica's RSS near its working set
    (the soak's after-run check measures it so). Under load nothing is trimmed.

    Args:
        device: the replica's device (its CUDA cache is emptied when measured fragmented).
        run: runs a blocking callable where the replica's compute runs (``ComputeExecutor.run``).
        idle: whether no request is in progress now.
    """

    def __init__(self, device: str, run: Callable[[Callable[[], None]], Awaitable[None]],
                 idle: Callable[[], bool]) -> None:
        self._device = device
        self._run = run
        self._idle = idle
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None
        self.heap_trims = 0
        self.cuda_cache_releases = 0  # empty_cache calls, each after a measured fragmentation

    def cancel(self) -> None:
        """A request started: call off a pending trim."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def arm(self) -> None:
        """The last request ended: trim after IDLE_TRIM_DELAY_S unless one starts meanwhile."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a generator finalised outside the loop
            return
        self.timer = loop.call_later(IDLE_TRIM_DELAY_S, self.fire)

    def fire(self) -> None:
        """The timer's callback (on the event loop): trim unless a request came meanwhile."""
        self.timer = None
        if self._idle() and (self.task is None or self.task.done()):
            self.heap_trims += 1
            self.task = asyncio.get_running_loop().create_task(self._run(self.release))

    def release(self) -> None:
        """Idle only: freed host heap back to the OS; the CUDA cache emptied if measured fragmented."""
        release_free_heap()
        cuda = release_fragmented_cache(self._device)
        if cuda is not None and cuda["released"]:
            self.cuda_cache_releases += 1
