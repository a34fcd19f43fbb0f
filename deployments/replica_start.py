"""The record of a synthesizer replica's cold start (process start -> ready, the phases, the CUDA
graphs captured before ready and in the background after; ``/health?detail=1`` and the replica's
stats show it)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psutil

from deployments.runtime_protocol import SynthesisRuntime


class ColdStart:
    """The phases of a replica's start, in seconds since its constructor began (``mark``), and
    since its process started (what an autoscaler waits: a Ray worker is a fresh process)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._started = clock()
        self._last = self._started
        self.phases: dict[str, float] = {}
        self.process_age_at_ready_s: float | None = None

    def mark(self, phase: str) -> float:
        """The phase that ends now; returns the seconds since the constructor began."""
        now = self._clock()
        self.phases[phase] = round(now - self._last, 2)
        self._last = now
        return now - self._started

    def ready(self) -> float:
        """Ready now; returns the seconds since the constructor began."""
        self.process_age_at_ready_s = round(time.time() - psutil.Process().create_time(), 2)
        return self.mark("settle")

    def snapshot(self, runtime: SynthesisRuntime) -> dict[str, Any]:
        """The phases, the process's age at ready and the CUDA graphs' progress (captured n of m,
        the background capture pending, running, done, failed or stopped)."""
        schedule = runtime.graph_schedule
        return {"phases_s": dict(self.phases), "constructor_s": round(sum(self.phases.values()), 2),
                "process_age_at_ready_s": self.process_age_at_ready_s,
                "model_load_s": runtime.details.get("model_load_s"),  # of the runtime phase
                "cuda_graphs": schedule.snapshot() if schedule is not None else None}
