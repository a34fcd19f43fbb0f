"""What a synthesizer replica does to start: its runtime factory, its text inbox, and the record of
its cold start (process start -> ready, the phases, the CUDA graphs captured before ready and in
the background after; ``/health?detail=1`` and the replica's stats show it)."""
from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import psutil
from ray import serve

from deployments.execution_plan import ExecutionPlan
from deployments.model_source import ModelSource
from deployments.runtime_protocol import SynthesisRuntime
from deployments.synthesizer_config import SynthesizerConfig
from deployments.text_inbox import ActorInbox, InboxClient, LocalInbox

# (config with the mode resolved, model source, the replica's plan) -> the runtime that runs the plan
RuntimeFactory = Callable[[SynthesizerConfig, ModelSource, ExecutionPlan], SynthesisRuntime]


def import_factory(path: str) -> RuntimeFactory:
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"runtime_factory must be 'module:callable', got {path!r}")
    return getattr(importlib.import_module(module), attr)


def default_runtime_factory(cfg: SynthesizerConfig, source: ModelSource, plan: ExecutionPlan) -> SynthesisRuntime:
    from deployments.assembler import load_synthesis_runtime  # torch and the model code: only where it loads

    return load_synthesis_runtime(cfg, str(source.resolve()), plan)


def default_inbox() -> InboxClient:
    """The text inbox actor inside a Serve replica, one in this process outside (tests)."""
    try:
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - outside a replica (unit tests, in-process apps)
        return LocalInbox()
    return ActorInbox.start()


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
