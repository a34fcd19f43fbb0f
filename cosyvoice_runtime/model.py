"""Loading an official model directory into our modules.

``load_model(dir)`` reads the yaml into a :class:`ModelSpec`, builds the three modules from
it, loads ``llm.pt`` / ``flow.pt`` / ``hift.pt`` strictly (every key, every shape), folds the
vocoder's weight norm and moves everything to the requested device and dtype.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.weights import load_checkpoint
from cosyvoice_runtime.yaml_config import read_model_spec

logger = logging.getLogger(__name__)

# hift.pt from a HiFi-GAN training checkpoint carries the generator under this prefix.
HIFT_KEY_PREFIX = "generator."


@dataclass
class CosyVoiceModel:
    """The three networks of one model directory, ready for inference."""

    spec: ModelSpec
    llm: nn.Module
    flow: nn.Module
    hift: nn.Module

    @property
    def device(self) -> torch.device:
        return next(self.flow.parameters()).device


def build_modules(spec: ModelSpec, device: str | torch.device = "cpu") -> dict[str, nn.Module]:
    """Construct (randomly initialised) llm / flow / hift modules for ``spec``."""
    from cosyvoice_runtime.flow.flow import build_flow
    from cosyvoice_runtime.hift.generator import build_hift
    from cosyvoice_runtime.llm.model import build_llm

    with torch.device(device):
        return {"llm": build_llm(spec.llm), "flow": build_flow(spec.flow), "hift": build_hift(spec.hift, spec.flow)}


# The layer classes whose random initialisation a load skips (their parameters are all overwritten)
_INITIALISED = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)


@contextlib.contextmanager
def skipped_init() -> Iterator[None]:
    """Build modules without the layers' random initialisation (``reset_parameters`` of linear,
    convolution and embedding layers does nothing meanwhile).

    Why: :func:`load_model` overwrites every parameter (the load is strict), so the random values
    are thrown away, and drawing them was most of the load (the build with and without them:
    docs/tuning.md "Cold start"). Explicit ``nn.init`` calls (the
    official noise buffers' RNG replay, :mod:`cosyvoice_runtime.hift.noise`) and seeded draws
    still run; the global RNG is left where it was, so a caller's random stream is unchanged.
    Not thread-safe (it swaps class attributes): a replica loads one model at a time.
    """
    saved = {cls: cls.__dict__["reset_parameters"] for cls in _INITIALISED}
    try:
        with torch.random.fork_rng(devices=[]):
            for cls in saved:
                cls.reset_parameters = _no_reset
            yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def _no_reset(self) -> None:
    """``reset_parameters`` while :func:`skipped_init`: the parameters keep their uninitialised memory."""


def _fold_weight_norm(module: nn.Module) -> None:
    fold = getattr(module, "remove_weight_norm", None)
    if callable(fold):
        fold()


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> CosyVoiceModel:
    """Load an official CosyVoice2 / CosyVoice3 directory.

    Raises:
        ModelLoadError: a file is missing, truncated or does not match the architecture; the
            message names the file and the problem.
    """
    started = time.perf_counter()
    spec = read_model_spec(model_dir)
    root = Path(model_dir)
    with skipped_init():  # every parameter is loaded next
        modules = build_modules(spec)
    for name, module in modules.items():
        strip = HIFT_KEY_PREFIX if name == "hift" else None
        load_checkpoint(module, root / spec.files[name], strip_prefix=strip)
    _fold_weight_norm(modules["hift"])
    for name, module in modules.items():
        # The vocoder stays float32: its sine source is a phase accumulation (spec §9.2).
        target_dtype = torch.float32 if name == "hift" else dtype
        modules[name] = module.to(device=device, dtype=target_dtype).eval().requires_grad_(False)
    logger.info("loaded %s from %s in %.1f s", spec.family, root, time.perf_counter() - started)
    return CosyVoiceModel(spec=spec, **modules)
