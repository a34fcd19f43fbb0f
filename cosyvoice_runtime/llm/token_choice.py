"""A request's next token chosen on the host from a step's logits, a row with NaN/Inf failing alone.

The engine (:mod:`cosyvoice_runtime.llm.engine`) chooses here what the graphed step's in-step
sampler does not: every token of the eager step, and the rows of the static step whose sampling
that sampler does not serve (a custom sampler, the official RNG, a wide repetition window). A row
whose logits hold NaN or Inf gets no token (its request fails alone, finish reason
:data:`NONFINITE_LOGITS`): sampling it would raise for the whole batch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.llm.batch_sampling import NONFINITE
from cosyvoice_runtime.llm.generate import default_sample_fn, select_tokens

NONFINITE_LOGITS = "nonfinite_logits"  # finish reason of a request whose logits held NaN/Inf (it fails alone)


def nonfinite_rows(logits: torch.Tensor) -> set[int]:
    """Rows of (B, V) logits holding NaN or Inf (one reduction and one small device sync per step)."""
    bad = ~torch.isfinite(logits).all(dim=-1)
    return set(bad.nonzero().flatten().tolist()) if bool(bad.any()) else set()


def select_finite(spec: ModelSpec, reqs: Sequence, logits: torch.Tensor, official_quirks: bool) -> list[int | None]:
    """Sampled tokens of the rows with finite logits; None for a row with NaN/Inf.

    ``reqs``: the rows' requests, each with its ``state`` (``DecodeState``) and ``sample_fn``."""
    bad = nonfinite_rows(logits)
    good = [i for i in range(len(reqs)) if i not in bad]
    picked = select_tokens(spec, logits[good] if bad else logits, [reqs[i].state for i in good],
                           [reqs[i].sample_fn for i in good], official_quirks) if good else []
    tokens: list[int | None] = [None] * len(reqs)
    for i, tok in zip(good, picked):
        tokens[i] = tok
    return tokens


def settle(spec: ModelSpec, reqs: Sequence, ids: Sequence[int], logits: torch.Tensor,
           can_sample: Callable[..., bool], official_quirks: bool) -> list[int | None]:
    """Tokens from a static step's in-graph choice ``ids``: None for a row marked :data:`NONFINITE`
    (that request fails), and the rows its sampler does not serve (``can_sample`` of their
    sampling settings is False, or a custom ``sample_fn``) sampled here from their logits."""
    tokens: list[int | None] = [None if tok == NONFINITE else tok for tok in ids]
    rest = [i for i, r in enumerate(reqs) if tokens[i] is not None and (r.sample_fn is not default_sample_fn
            or not can_sample(r.state.params))]
    if rest:
        picked = select_tokens(spec, logits[rest], [reqs[i].state for i in rest],
                               [reqs[i].sample_fn for i in rest], official_quirks)
        for i, tok in zip(rest, picked):
            tokens[i] = tok
    return tokens
