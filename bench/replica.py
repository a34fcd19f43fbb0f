"""A synthesizer replica in this process, built only by the product, and the arms of an A/B.

The benchmarks that measure a replica (``bench/gpu_bench.py``, ``bench/capacity.py --level
synth``) construct :class:`~deployments.synthesizer.Synthesizer` itself: its execution plan is
resolved (``deployments/execution_plan.py``) and its runtime assembled
(``deployments/assembler.py``) exactly as in a Serve replica, and its engine loop and token2wav
driver serve the requests. A benchmark has no second way to build one, so what it measures is
what a deployment with the same config runs.

An arm is a name and overrides of the synthesizer's config: ``NAME`` (the base config as it is)
or ``NAME:KEY=VALUE[,KEY=VALUE...]`` with keys dotted into
:class:`~deployments.synthesizer_config.SynthesizerConfig` (``token2wav.cv2_flow=recompute``)
and values read as YAML (``null``, ``false``, ``0.5``, ``bfloat16``). The merged config is
validated: a key the config does not have is an error, never a silent default.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deployments import constants
from deployments.synthesizer_config import SynthesizerConfig

GRAPHS_WAIT_S = 300.0  # the most a run waits for its replica's background CUDA graph capture


@dataclass(frozen=True)
class Arm:
    """One configuration of a benchmark: ``overrides`` of the base synthesizer config."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Arm:
        """``NAME`` or ``NAME:KEY=VALUE[,KEY=VALUE...]`` (module docstring)."""
        name, _, rest = text.partition(":")
        if not name.strip():
            raise ValueError(f"arm {text!r}: a name comes first (NAME or NAME:KEY=VALUE,...)")
        overrides: dict[str, Any] = {}
        for pair in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = pair.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"arm {text!r}: {pair!r} is not KEY=VALUE")
            _set(overrides, key.strip(), yaml.safe_load(value) if value.strip() else None)
        return cls(name.strip(), overrides)

    def describe(self) -> str:
        """The overrides as given (``-`` for none), for reports."""
        flat = _flatten(self.overrides)
        return ", ".join(f"{k}={v}" for k, v in flat.items()) or "-"

    def config(self, base: SynthesizerConfig, fixed: dict[str, Any] | None = None) -> SynthesizerConfig:
        """``base`` with the tool's ``fixed`` settings (a benchmark's workload needs), then this
        arm's overrides on top, validated as a replica's config is."""
        merged = _merge(_merge(base.model_dump(exclude_unset=True), fixed or {}), self.overrides)
        try:
            return SynthesizerConfig.model_validate(merged)
        except ValueError as exc:
            raise ValueError(f"arm {self.name!r}: {exc}") from None


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ValueError(f"{dotted}: {part} is a value, not a section")  # noqa: TRY004 - the arm text is wrong
    tree[leaf] = value


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else copy.deepcopy(value)
    return out


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def random_model_dir(family: str, size: str) -> Path:
    """The random-weight model directory of ``family`` (``cosyvoice_runtime.tiny_model``),
    written once under the cache root: ``tiny`` is the one a ``tiny_family`` replica serves,
    ``full`` the official hyper-parameters (~2 GB of checkpoints: a GPU replica's real cost)."""
    from cosyvoice_runtime.tiny_model import write_tiny_model

    path = constants.tiny_model_dir(family) if size == "tiny" else constants.home_dir() / f"random-full-{family}"
    return write_tiny_model(path, family=family, size=size)  # an existing directory is kept


def wait_for_graphs(synth, timeout_s: float = GRAPHS_WAIT_S) -> None:
    """Until the replica's background CUDA graph capture has ended (``graphs_before_ready:
    first``): a benchmark measures the steady state, not shapes still running eagerly."""
    graphs = synth.runtime.graph_schedule
    if graphs is not None and not graphs.done.wait(timeout_s):
        raise RuntimeError(f"the background CUDA graph capture did not finish in {timeout_s:.0f} s")


def require_stepped(synth, tool: str) -> None:
    """The batch scheduler's ``@serve.batch`` batches only inside Serve (ray-serve-notes §5.1):
    in this process it would run one chunk job per batch, which is not what it serves."""
    if synth.stepped is None:
        raise ValueError(f"{tool} needs token2wav.scheduler steps (the CUDA default); the batch scheduler's "
                         "@serve.batch runs only inside Serve: measure it over HTTP (bench/capacity.py --level serve)")
