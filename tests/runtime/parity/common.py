"""Discovery of parity fixture cases and tolerance-aware comparison.

The fixture directory is ``$COSYVOICE_PARITY_DIR`` (default ``../shared/parity`` next to the
repository). Every case listed in its ``index.json`` becomes one test; a case without a
registered checker fails instead of being skipped.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[3]


def parity_dir() -> Path:
    return Path(os.environ.get("COSYVOICE_PARITY_DIR", REPO_ROOT.parent / "shared" / "parity")).resolve()


@dataclass
class ParityCase:
    family: str  # "cosyvoice2" | "cosyvoice3"
    name: str  # e.g. "llm_greedy"
    component: str
    set_dir: Path  # <parity>/<family dir>
    model_dir: Path  # <parity>/<family dir>/model
    meta: dict  # the case json
    hparams: dict

    @property
    def id(self) -> str:
        return f"{self.family}/{self.name}"

    @functools.cached_property
    def tensors(self) -> dict[str, np.ndarray]:
        from safetensors.numpy import load_file

        return load_file(str(self.set_dir / "cases" / self.meta["file"]))

    def t(self, name: str) -> torch.Tensor:
        """A stored tensor as a torch tensor (int32 ids stay int32)."""
        return torch.from_numpy(self.tensors[name].copy())

    @property
    def params(self) -> dict:
        return self.meta.get("params", {})


def load_cases() -> list[ParityCase]:
    root = parity_dir()
    index = json.loads((root / "index.json").read_text())
    cases = []
    for family, model in index["models"].items():
        set_dir = root / model["dir"]
        hparams = json.loads((root / model["hparams"]).read_text()) if model.get("hparams") else {}
        for entry in model["cases"]:
            case_file = set_dir / entry["file"]
            meta = json.loads(case_file.with_suffix(".json").read_text())
            meta.setdefault("file", case_file.name)
            cases.append(
                ParityCase(
                    family=family,
                    name=entry["case"],
                    component=entry.get("component", meta.get("component", "")),
                    set_dir=set_dir,
                    model_dir=set_dir / "model",
                    meta=meta,
                    hparams=hparams,
                )
            )
    return cases


CheckFn = Callable[[ParityCase], None]
CHECKERS: dict[str, CheckFn] = {}


def checker(*names: str) -> Callable[[CheckFn], CheckFn]:
    """Register a function as the checker of the named cases (for every model family)."""

    def register(fn: CheckFn) -> CheckFn:
        for n in names:
            assert n not in CHECKERS, f"two checkers for case {n}"
            CHECKERS[n] = fn
        return fn

    return register


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def tolerance(case: ParityCase, key: str, default: str | None = None) -> dict | str:
    tol = case.meta.get("tolerance", {})
    if key in tol:
        return tol[key]
    if default is not None and default in tol:
        return tol[default]
    raise KeyError(f"{case.id}: no tolerance for '{key}' in the case file")


def assert_matches(case: ParityCase, name: str, actual, expected=None, tol_key: str | None = None) -> None:
    """Compare ``actual`` with the stored tensor ``name`` at the tolerance the case states.

    Args:
        name: tensor name in the case file (also the tolerance key unless ``tol_key``).
        expected: override for the reference (defaults to ``case.tensors[name]``).
        tol_key: tolerance entry to use; ``"exact"`` or a dict with atol and optional rtol.
    """
    ref = case.tensors[name] if expected is None else _to_numpy(expected)
    got = _to_numpy(actual)
    tol = tolerance(case, tol_key or name)
    assert got.shape == ref.shape, f"{case.id} {name}: shape {got.shape} != reference {ref.shape}"
    if tol == "exact":
        if not np.array_equal(got.astype(np.int64) if ref.dtype.kind in "iu" else got, ref):
            diff = np.flatnonzero(got.reshape(-1) != ref.reshape(-1))
            raise AssertionError(
                f"{case.id} {name}: {diff.size} of {ref.size} entries differ, first at {diff[:5]}: "
                f"got {got.reshape(-1)[diff[:5]]} expected {ref.reshape(-1)[diff[:5]]}"
            )
        return
    atol = float(tol.get("atol", 0.0))
    rtol = float(tol.get("rtol", 0.0))
    got64 = got.astype(np.float64)
    ref64 = ref.astype(np.float64)
    err = np.abs(got64 - ref64)
    bound = atol + rtol * np.abs(ref64)
    bad = err > bound
    if bad.any() or not np.isfinite(got64).all():
        idx = np.unravel_index(int(np.argmax(err - bound)), err.shape)
        raise AssertionError(
            f"{case.id} {name}: max abs err {err.max():.3e} (atol {atol:g}, rtol {rtol:g}); "
            f"{int(bad.sum())} of {err.size} out of tolerance; worst at {idx}: got {got64[idx]:.6g} "
            f"expected {ref64[idx]:.6g}"
        )
