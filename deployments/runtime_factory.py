"""How a synthesizer replica builds its runtime: the default loader, or a factory named in the
config (``module:callable``; tests name their fakes)."""
from __future__ import annotations

import importlib
from collections.abc import Callable

from deployments.execution_plan import ExecutionPlan
from deployments.model_source import ModelSource
from deployments.runtime_protocol import SynthesisRuntime
from deployments.synthesizer_config import SynthesizerConfig

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
