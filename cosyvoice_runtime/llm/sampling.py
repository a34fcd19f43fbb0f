"""Token sampling for the speech LM (pure functions, spec §3.5-§3.6).

Every function takes log-probabilities ``logp`` of shape (V,) over the speech vocabulary and
returns one id as a Python int. Randomness comes only from the ``torch.Generator`` passed in
(one per request, seeded from the request), never from the global RNG.

Repetition-aware sampling (RAS) makes exactly the random draws of the official
``ras_sampling``: one ``multinomial(1, replacement=True)`` over the K kept nucleus
probabilities, and on a repetition a second one over the softmax of the full (masked)
distribution. With ``official_rng=True`` the kept set is also found with the official
float32 sequential running sum, so a generator seeded like ``torch.manual_seed(seed)``
reproduces the official tokens exactly; the default finds it with a device cumsum (the same
set except at float ties with ``top_p``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch

from cosyvoice_runtime.config import LLMSpec

Method = Literal["ras", "greedy", "top_k_top_p"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; defaults are the yaml's RAS values."""

    method: Method = "ras"
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    temperature: float = 1.0  # top_k_top_p only; RAS has none (T = 1)
    seed: int | None = None
    official_rng: bool = False

    @classmethod
    def from_spec(cls, spec: LLMSpec, **overrides) -> SamplingParams:
        base = cls(top_p=spec.top_p, top_k=spec.top_k, win_size=spec.win_size, tau_r=spec.tau_r)
        return replace(base, **overrides)

    def __post_init__(self) -> None:
        if self.method not in ("ras", "greedy", "top_k_top_p"):
            raise ValueError(f"unknown sampling method {self.method!r}")
        if not 0.0 < self.top_p <= 1.0 or self.top_k < 1 or self.temperature <= 0.0:
            raise ValueError(f"bad sampling params top_p={self.top_p} top_k={self.top_k} T={self.temperature}")


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private generator; unseeded requests draw a seed from the OS."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


# -- masks ---------------------------------------------------------------------------------
def min_len_mask_ids(spec: LLMSpec, official_quirks: bool = False) -> tuple[int, ...]:
    """Ids forbidden while fewer than ``min_len`` tokens were generated.

    Default: every stop id (the whole control range, the correct rule for both families).
    ``official_quirks``: only index S, which is eos for CV2 but sos for CV3 (spec §9.3 #2).
    """
    return (spec.official_min_len_masked_id,) if official_quirks else spec.stop_ids


def mask_ids_(logp: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """Set ``logp[..., ids] = -inf`` in place; returns ``logp``."""
    if len(ids):
        logp[..., list(ids)] = -float("inf")
    return logp


# -- samplers ------------------------------------------------------------------------------
def greedy(logp: torch.Tensor) -> int:
    return int(torch.argmax(logp))


def nucleus_keep_count(sorted_probs: torch.Tensor, top_p: float, top_k: int, official_rng: bool = False) -> int:
    """How many of the descending ``sorted_probs`` the §3.6 walk keeps.

    Entry i is kept while the sum of the entries before it is < ``top_p`` and i < ``top_k``
    (the entry that crosses ``top_p`` is included).
    """
    head = sorted_probs[:top_k]
    if official_rng:
        # The official walk accumulates a float32 running sum one entry at a time and compares
        # it with float32(top_p); reproduce that bit for bit on the host.
        limit = np.float32(top_p)
        acc = np.float32(0.0)
        kept = 0
        for p in head.detach().float().cpu().numpy():
            if not acc < limit:
                break
            acc = np.float32(acc + p)
            kept += 1
        return kept
    before = torch.cumsum(head, dim=0) - head
    return int((before < top_p).sum())


def nucleus_sample(logp: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator | None,
                   official_rng: bool = False) -> int:
    """Top-p/top-k draw with probability proportional to the kept (unrenormalised) probs."""
    probs = logp.softmax(dim=0)
    sorted_probs, sorted_ids = probs.sort(descending=True, stable=True)
    kept = nucleus_keep_count(sorted_probs, top_p, top_k, official_rng)
    pick = torch.multinomial(sorted_probs[:kept], 1, replacement=True, generator=generator)
    return int(sorted_ids[pick])


def random_sample(logp: torch.Tensor, generator: torch.Generator | None) -> int:
    """A draw from the whole distribution (RAS fallback)."""
    return int(torch.multinomial(logp.softmax(dim=0), 1, replacement=True, generator=generator))


def ras_sample(logp: torch.Tensor, history: Sequence[int], generator: torch.Generator | None, *,
               top_p: float = 0.8, top_k: int = 25, win_size: int = 10, tau_r: float = 0.1,
               official_rng: bool = False) -> int:
    """Repetition-aware sampling (VALL-E 2), as the official ``ras_sampling`` of 2026-02.

    Args:
        logp: (V,) log-probabilities (already min-length masked).
        history: previously generated ids of this request (prompt speech not included).

    Returns:
        The nucleus pick, unless it occurs in the last ``win_size`` generated ids at least
        ``win_size * tau_r`` times; then a fresh draw from the full distribution with that
        pick masked out.
    """
    pick = nucleus_sample(logp, top_p, top_k, generator, official_rng)
    repeats = sum(1 for t in history[-win_size:] if t == pick)
    if repeats >= win_size * tau_r:
        masked = logp.clone()
        masked[pick] = -float("inf")
        pick = random_sample(masked, generator)
    return pick


def top_k_top_p_sample(logp: torch.Tensor, generator: torch.Generator | None, *, top_k: int = 25,
                       top_p: float = 1.0, temperature: float = 1.0) -> int:
    """Plain temperature + top-k + top-p sampling over renormalised probabilities."""
    scaled = logp / temperature
    k = min(top_k, scaled.shape[-1])
    values, ids = scaled.topk(k)
    probs = values.softmax(dim=0)
    before = torch.cumsum(probs, dim=0) - probs
    probs = torch.where(before < top_p, probs, torch.zeros_like(probs))
    pick = torch.multinomial(probs, 1, replacement=True, generator=generator)
    return int(ids[pick])


def sample(logp: torch.Tensor, params: SamplingParams, history: Sequence[int],
           generator: torch.Generator | None) -> int:
    """Dispatch on ``params.method``; ``logp`` is (V,) and already masked."""
    if params.method == "greedy":
        return greedy(logp)
    if params.method == "top_k_top_p":
        return top_k_top_p_sample(logp, generator, top_k=params.top_k, top_p=params.top_p,
                                  temperature=params.temperature)
    return ras_sample(logp, history, generator, top_p=params.top_p, top_k=params.top_k,
                      win_size=params.win_size, tau_r=params.tau_r, official_rng=params.official_rng)
