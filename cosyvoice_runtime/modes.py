"""Execution modes of a loaded model: ``pytorch``, ``torchscript`` (compiled) and ``trt``.

* ``pytorch``: eager; the LLM and the flow in the serving dtype (fp32 / fp16 / bf16), the
  vocoder always fp32 (its sine source is a phase accumulation, spec §9.2).
* ``torchscript``: as pytorch, plus ``torch.compile`` of the flow estimator (dynamic T and
  batch), the CosyVoice2 token encoder and the vocoder's conv body; CUDA replicas capture their
  token2wav graphs over the compiled modules. The name is the issue's; the spec (§7.2) recommends
  compiling our own modules over TorchScript artefacts tied to one torch version. Whether
  ``torch.jit.script`` would be faster has NOT been measured (no GPU here): compile is what
  this module implements.
* ``trt``: as pytorch, with the flow estimator replaced by a
  :class:`~cosyvoice_runtime.trt.engine.TrtEstimator` over prebuilt plans.

Which mode a replica runs is decided once, at start-up (:func:`resolve_mode`): the config
value wins; the node's environment value applies when the config leaves it unset; else
``pytorch``. :func:`preflight` fails fast (before any weights load) where a mode cannot run.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from cosyvoice_runtime.errors import ModelLoadError

if TYPE_CHECKING:  # torch is imported by the functions that need it: the config/ingress side stays light
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

MODES = ("pytorch", "torchscript", "trt")
DEFAULT_MODE = "pytorch"
# Where a resolved mode came from (logged, and shown in /health).
SOURCE_CONFIG, SOURCE_ENV, SOURCE_DEFAULT = "config", "env", "default"


def validate_mode(value: str, where: str = "mode") -> str:
    """``value`` normalised (case, blanks), or ValueError naming the valid modes."""
    name = str(value).strip().lower()
    if name not in MODES:
        raise ValueError(f"{where}: unknown execution mode {value!r}; expected one of {', '.join(MODES)}")
    return name


def resolve_mode(config_mode: str | None, env_mode: str | None) -> tuple[str, str]:
    """(mode, source): the config wins; the environment applies when the config is None."""
    if config_mode is not None:
        return validate_mode(config_mode, "config mode"), SOURCE_CONFIG
    if env_mode is not None and str(env_mode).strip():
        return validate_mode(env_mode, "environment mode"), SOURCE_ENV
    return DEFAULT_MODE, SOURCE_DEFAULT


def preflight(mode: str, trt_plan_dir: str | None = None) -> None:
    """Fail at start-up, before the weights load, where ``mode`` cannot run on this node.

    Raises:
        ModelLoadError: trt without TensorRT installed, or without an existing plan directory.
    """
    if mode != "trt":
        return
    from cosyvoice_runtime.trt.engine import BUILD_HINT, tensorrt_version

    tensorrt_version()  # raises the "install the [trt] extra" message
    if not trt_plan_dir:
        raise ModelLoadError("trt_plan_dir", f"mode 'trt' needs trt_plan_dir (plans are built offline); {BUILD_HINT}")
    if not Path(trt_plan_dir).expanduser().is_dir():
        raise ModelLoadError(trt_plan_dir, f"TensorRT plan directory does not exist; {BUILD_HINT}")


def cast_model(model, dtype: torch.dtype) -> None:
    """LLM and flow to ``dtype``; the vocoder stays float32."""
    import torch

    model.llm.to(dtype)
    model.flow.to(dtype)
    model.hift.to(torch.float32)


def compile_model(model, backend: str = "inductor") -> list[str]:
    """``torch.compile`` the flow estimator, the CosyVoice2 token encoder and the vocoder body;
    returns what was compiled.

    ``dynamic=True``: the estimator sees a new T on every streamed call and a new batch with
    every batch size, which would otherwise recompile per shape. The vocoder's source
    (random phase, fp32 accumulation) and iSTFT stay eager. On a CUDA replica the token2wav
    graphs are captured over the compiled modules afterwards (compiled and graphed: fused
    kernels without launch overhead; per stage with static shapes: docs/tuning.md §2, execution
    mode).
    """
    import torch

    solver = model.flow.decoder
    solver.estimator = torch.compile(solver.estimator, dynamic=True, backend=backend)
    done = ["flow.decoder.estimator"]
    encoder = getattr(model.flow, "encoder", None)
    if encoder is not None:  # CosyVoice2 (CosyVoice3 has no token encoder)
        model.flow.encoder = torch.compile(encoder, dynamic=True, backend=backend)
        done.append("flow.encoder")
    body = getattr(model.hift, "body", None)
    if callable(body):
        # An instance attribute shadows the method; the module's forward and other methods call it.
        model.hift.body = torch.compile(body, dynamic=True, backend=backend)
        done.append("hift.body")
    return done


def apply_mode(model, mode: str, dtype: torch.dtype | None = None, *, trt_estimator: nn.Module | None = None,
               compile_backend: str = "inductor") -> dict:
    """Prepare a loaded :class:`~cosyvoice_runtime.model.CosyVoiceModel` for ``mode`` in place.

    Args:
        trt_estimator: the TensorRT estimator (mode ``trt``), from
            :func:`cosyvoice_runtime.trt.engine.load_trt_estimator`.
        compile_backend: ``torch.compile`` backend of mode ``torchscript`` (tests use ``eager``).

    Returns:
        what was done: mode, dtype, compiled module names, estimator type.
    """
    import torch

    mode = validate_mode(mode)
    dtype = dtype or torch.float32
    cast_model(model, dtype)
    report = {"mode": mode, "dtype": str(dtype).removeprefix("torch."), "compiled": []}
    if mode == "torchscript":
        report["compiled"] = compile_model(model, backend=compile_backend)
    elif mode == "trt":
        if trt_estimator is None:
            raise ValueError("mode 'trt' needs the TensorRT estimator (load_trt_estimator)")
        model.flow.decoder.estimator = trt_estimator
    report["estimator"] = type(model.flow.decoder.estimator).__name__
    logger.info("execution mode %s: %s", mode, report)
    return report
