"""Strict loading of the official checkpoints (``llm.pt``, ``flow.pt``, ``hift.pt``).

Our modules use the official parameter names, so the key map is the identity except for
two documented rewrites: a leading ``generator.`` is stripped from HiFT keys (training
checkpoints), and legacy weight-norm pairs ``<name>.weight_g`` / ``<name>.weight_v`` are renamed
to the parametrization form ``<name>.parametrizations.weight.original0`` / ``original1``.
Anything missing, unexpected or of the wrong shape is an error naming the file; nothing is
ever loaded partially.
"""
from __future__ import annotations

import logging
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from cosyvoice_runtime.errors import ModelLoadError

logger = logging.getLogger(__name__)

_MAX_LISTED = 8


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """``torch.load(path, weights_only=True)`` with errors that name the file.

    Raises:
        ModelLoadError: the file is missing, truncated, not a torch checkpoint, or not a flat
            mapping of names to tensors.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(path, "file is missing")
    try:
        obj = _load(path)
    except (RuntimeError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, OSError) as exc:
        raise ModelLoadError(
            path, f"cannot be read as a torch checkpoint (truncated or corrupt?): {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(obj, Mapping):
        raise ModelLoadError(path, f"expected a state dict (mapping of name -> tensor), found {type(obj).__name__}")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ModelLoadError(path, f"entries that are not tensors: {bad[:_MAX_LISTED]}")
    return dict(obj)


def _load(path: Path):
    """The checkpoint's tensors mapped from the file, not read into memory first: the strict load
    copies them into the parameters once (read, then copied, the full-size CosyVoice2's 3.1 GB took
    3.2-4.5 s on the 2-core VM, mapped 0.5-1.0 s). A legacy (pre-zip) checkpoint cannot be mapped: read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "_use_new_zipfile_serialization" not in str(exc):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def official_to_ours(state: Mapping[str, torch.Tensor], strip_prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Apply the two documented key rewrites (prefix strip, legacy weight-norm names)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if strip_prefix:
            key = key.replace(strip_prefix, "")
        if key.endswith(".weight_g"):
            key = key[: -len(".weight_g")] + ".parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len(".weight_v")] + ".parametrizations.weight.original1"
        out[key] = value
    return out


def _listing(keys: list[str]) -> str:
    more = f" (+{len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else ""
    return ", ".join(keys[:_MAX_LISTED]) + more


def load_strict(module: nn.Module, state: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Load ``state`` into ``module``; every key must exist with the same shape, both ways.

    Raises:
        ModelLoadError: with the lists of missing keys, unexpected keys and shape mismatches.
    """
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = sorted(
        f"{k} {tuple(state[k].shape)} != expected {tuple(expected[k].shape)}"
        for k in set(expected) & set(state)
        if tuple(state[k].shape) != tuple(expected[k].shape)
    )
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if mismatched:
        problems.append(f"wrong shapes: {_listing(mismatched)}")
    if problems:
        raise ModelLoadError(path, "does not match the model architecture; " + "; ".join(problems))
    float_dtypes = {k: v.dtype for k, v in expected.items() if v.is_floating_point()}
    converted = {
        k: (v.to(float_dtypes[k]) if k in float_dtypes and v.dtype != float_dtypes[k] else v) for k, v in state.items()
    }
    module.load_state_dict(converted, strict=True)


def load_checkpoint(module: nn.Module, path: str | Path, strip_prefix: str | None = None) -> None:
    """Read an official ``.pt`` file and load it strictly into ``module``."""
    state = official_to_ours(read_state_dict(path), strip_prefix=strip_prefix)
    load_strict(module, state, path)
    logger.info("loaded %d tensors from %s", len(state), path)


def ours_to_official(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict to write for the official layout (used by the tiny-model writer)."""
    return {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}
