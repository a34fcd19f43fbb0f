"""Python's cyclic garbage collector in a replica: the start-up heap frozen, every pause counted.

Why: a collection of the oldest generation walks every object the collector tracks, and it runs
on whichever thread happened to allocate, holding the GIL, so every thread of the replica stops
for it: the event loop, the LLM engine's thread and the token2wav driver that launches the GPU's
next pass (the GPU idles meanwhile). A replica holds the model's modules, parameters and graphs
as Python objects, so a full collection walks a large heap (its pause with the full-size
CosyVoice2 loaded, before and after :func:`freeze_startup_heap`: docs/serving.md, ``gc_freeze``).
Under load more objects outlive the young generations (more requests in flight), so full
collections come more often: a tail that grows with load while the median stays, the shape the
Serve-level token2wav stage showed (docs/tuning.md §1, "The serving layer against the runtime").

Objects frozen here are never collected by the cyclic collector even if they later become
unreachable cycles; they are the start-up objects (model, runtime, graphs), alive as long as the
replica. Reference counting frees everything else as before.
"""
from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

from deployments import constants
from deployments.observability import Durations

GENERATIONS = (0, 1, 2)
SLOW_PAUSE_S = 0.01  # a pause past this shows in the capacity reports (bench/capacity.py)


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now out of the collector's reach (``gc.freeze``);
    returns how many objects are frozen. Call when a replica has loaded, warmed up and captured."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Durations of the collector's pauses by generation (``gc.callbacks``; one per process).

    Args:
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._started: dict[int, float] = {}  # thread id -> start of its collection in progress
        # no lock anywhere here: the callback runs inside a collection (see Durations)
        self.pauses = {g: Durations(constants.GC_PAUSE_BUCKETS_S, SLOW_PAUSE_S) for g in GENERATIONS}

    def callback(self, phase: str, info: dict) -> None:
        """``gc.callbacks`` entry: ``phase`` is "start" or "stop"; ``info["generation"]``."""
        now, tid = self.clock(), threading.get_ident()
        if phase == "start":
            self._started[tid] = now
            return
        started = self._started.pop(tid, None)
        if started is not None:
            self.pauses[info["generation"]].add(now - started)

    def snapshot(self) -> dict:
        """``{"by_generation": {gen: Durations.snapshot()}, "slow", "frozen"}`` (JSON-able: replicas
        send it through their stats)."""
        by_gen = {str(g): d.snapshot() for g, d in self.pauses.items()}
        return {"by_generation": by_gen, "slow": sum(d["slow"] for d in by_gen.values()),
                "frozen": gc.get_freeze_count()}


_PAUSES = GcPauses()
_installed = threading.Lock()


def watched() -> GcPauses:
    """This process's pause record, its callback installed on first use."""
    with _installed:
        if _PAUSES.callback not in gc.callbacks:
            gc.callbacks.append(_PAUSES.callback)
    return _PAUSES


def settle_replica(freeze: bool) -> GcPauses:
    """End of a replica's start: freeze the start-up heap if configured, and watch the pauses."""
    if freeze:
        freeze_startup_heap()
    return watched()
