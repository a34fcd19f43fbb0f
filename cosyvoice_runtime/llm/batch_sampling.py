"""Batched on-device token selection (spec §3.5-§3.6) with counter-based randomness.

One call samples a whole decode batch: RAS, greedy and top-k/top-p rows side by side, each
with its own parameters, with tensor ops only (no host sync, no per-row launches), so the same
function runs eagerly and inside a CUDA graph.

Randomness is counter-based instead of a ``torch.Generator`` per request: the uniform of draw
``d`` (0 = nucleus, 1 = RAS fallback) at sampler step ``s`` of a request with seed ``seed`` is
SplitMix64 output ``2 * s + d`` of the stream seeded with ``seed``, truncated to 24 bits. It is
computed on the host (numpy, vectorised over the batch) and shipped with the other per-row
inputs, and a draw is the inverse CDF of that uniform over the row's (unnormalised) weights.
A request's tokens therefore depend only on its seed and its logits, never on which other
requests share the batch or where its row is. These draws are NOT the official RNG stream: the
official-RNG-exact path (``SamplingParams.official_rng=True``) stays per row in
:mod:`cosyvoice_runtime.llm.sampling`.

Per-row inputs travel as ONE int64 matrix (``pack_rows``), floats as their float32 bit patterns,
so that a decode step needs one host-to-device copy::

    col  0 method (GREEDY / RAS / TOP_K_TOP_P)   5 top_p (f32 bits)
         1 top_k                                 6 temperature (f32 bits)
         2 win_size                              7 uniform of the nucleus draw (f32 bits)
         3 repeats that trigger the fallback     8 uniform of the fallback draw (f32 bits)
         4 1 = mask the min-length ids           9.. last ``width`` emitted ids, right-aligned, -1 pad
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from cosyvoice_runtime.llm.sampling import SamplingParams

GREEDY, RAS, TOP_K_TOP_P = 0, 1, 2
NONFINITE = -1  # the id chosen for a row whose logits hold NaN/Inf (its sample is meaningless)
_METHOD_CODE = {"greedy": GREEDY, "ras": RAS, "top_k_top_p": TOP_K_TOP_P}
C_METHOD, C_TOPK, C_WIN, C_REPMIN, C_MINLEN, C_TOPP, C_TEMP, C_U0, C_U1, C_HIST = range(10)
NUM_FIXED_COLS = C_HIST

# SplitMix64 (Steele, Lea, Flood 2014) constants.
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_UNIFORM_BITS = 24  # exactly representable in float32, and u < 1 always


def num_cols(width: int) -> int:
    """Columns of a packed row with ``width`` history entries."""
    return NUM_FIXED_COLS + width


def random_seed() -> int:
    """A fresh 64-bit seed for an unseeded request."""
    return secrets.randbits(64)


def counter_uniforms(seeds: Sequence[int] | np.ndarray, counters: Sequence[int] | np.ndarray) -> np.ndarray:
    """Uniforms in [0, 1) as float32: SplitMix64 output number ``counter`` of each row's ``seed``."""
    with np.errstate(over="ignore"):
        seed = np.asarray(seeds, dtype=np.uint64)
        z = seed + (np.asarray(counters, dtype=np.uint64) + np.uint64(1)) * _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(64 - _UNIFORM_BITS)).astype(np.float32) * np.float32(2.0 ** -_UNIFORM_BITS)


def _f32_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float32).view(np.int32))


@lru_cache(maxsize=256)
def _param_cols(params: SamplingParams) -> tuple[int, ...]:
    """Columns 0-3 and 5-6 of a row (everything but the per-step entries)."""
    # r >= win * tau_r  <=>  r >= ceil(win * tau_r) for integer r (computed in float64 like the
    # single-row rule).
    rep_min = math.ceil(params.win_size * params.tau_r)
    temperature = params.temperature if params.method == "top_k_top_p" else 1.0  # RAS has none
    return (_METHOD_CODE[params.method], params.top_k, params.win_size, rep_min,
            _f32_bits(params.top_p), _f32_bits(temperature))


def pack_rows(params: Sequence[SamplingParams], histories: Sequence[Sequence[int]], steps: Sequence[int],
              seeds: Sequence[int], mask_min_len: Sequence[bool], width: int,
              out: np.ndarray | None = None) -> np.ndarray:
    """Per-row sampler inputs as one (B, ``num_cols(width)``) int64 matrix (layout above).

    Args:
        params: each row's settings; ``win_size`` must be <= ``width`` for RAS rows.
        histories: each row's emitted ids so far (only the last ``width`` are used).
        steps: sampler calls so far per row (the draw counter).
        seeds: 64-bit seed per row.
        mask_min_len: rows whose min-length ids are masked this step.
        out: optional (B, num_cols) int64 array to fill (e.g. a view of pinned memory).
    """
    rows = []
    for p, hist, masked in zip(params, histories, mask_min_len):
        c = _param_cols(p)
        if p.method == "ras" and p.win_size > width:
            raise ValueError(f"win_size {p.win_size} exceeds the history width {width}")
        tail = list(hist[-width:]) if width else []
        rows.append([c[0], c[1], c[2], c[3], int(masked), c[4], c[5], 0, 0] + [-1] * (width - len(tail)) + tail)
    arr = np.array(rows, dtype=np.int64).reshape(len(rows), num_cols(width))
    counters = 2 * np.asarray(steps, dtype=np.uint64)
    arr[:, C_U0] = counter_uniforms(seeds, counters).view(np.int32)
    arr[:, C_U1] = counter_uniforms(seeds, counters + np.uint64(1)).view(np.int32)
    if out is None:
        return arr
    out[...] = arr
    return out


def stop_mask(ids, vocab: int, device) -> torch.Tensor:
    """(V,) bool: the ids :func:`mask_min_len` hides from rows below their min length."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[list(ids)] = True
    return mask


def mask_min_len(logp: torch.Tensor, rows: torch.Tensor, stop_mask: torch.Tensor) -> torch.Tensor:
    """-inf at the ``stop_mask`` (V,) ids of the rows flagged in column ``C_MINLEN``."""
    return logp.masked_fill((rows[:, C_MINLEN] != 0)[:, None] & stop_mask[None], -float("inf"))


def kept_mask(sorted_probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The §3.6 kept set of each row, vectorised.

    Args:
        sorted_probs: (B, V) probabilities, descending per row.
        top_p: (B,) float32; top_k: (B,) long.

    Returns:
        (B, V) bool: entry i is kept iff i < top_k and the sum of the entries before it is
        < top_p (the entry that crosses top_p is kept), as ``sampling.nucleus_keep_count``.
    """
    rank = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    before = sorted_probs.cumsum(-1) - sorted_probs
    return (rank[None] < top_k[:, None]) & (before < top_p[:, None])


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, V) non-negative weights, (B,) uniforms in [0, 1) -> (B,) long index with weight > 0.

    Index i is chosen with probability weights[i] / sum(weights) (a draw like
    ``multinomial(weights, 1)``, from the given uniform). A row with no positive weight (all zero,
    or NaN) gets 0: the index is gathered inside a CUDA graph, where one out of range is a
    device-side assert that kills the replica (H100 2026-12-07: -1 from such a row); the caller
    discards that row (:func:`choose_ids`).
    """
    cdf = weights.cumsum(-1)
    target = u * cdf[:, -1]
    idx = (cdf <= target[:, None]).sum(-1)
    # Rounding can put the target at the very top: clamp to the last entry that can be drawn.
    rank = torch.arange(weights.shape[-1], device=weights.device)
    last = torch.where(weights > 0, rank[None], -1).amax(-1).clamp(min=0)
    return torch.minimum(idx, last)


def sample_rows(logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One id per row from masked log-probabilities, by each row's method.

    Args:
        logp: (B, V) float32 log-probabilities (min-length mask already applied).
        rows: (B, num_cols(width)) int64 from :func:`pack_rows`, on ``logp``'s device.

    Returns:
        (B,) long ids (on the device; no host sync).
    """
    method, top_k, win, rep_min = rows[:, C_METHOD], rows[:, C_TOPK], rows[:, C_WIN], rows[:, C_REPMIN]
    floats = rows[:, C_TOPP:C_HIST].to(torch.int32).view(torch.float32)
    top_p, temperature, u_nucleus, u_fallback = floats.unbind(-1)
    hist = rows[:, C_HIST:]

    # RAS has no temperature; its rows carry 1.0, and x / 1.0 is exact.
    probs = (logp / temperature[:, None]).softmax(-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
    kept = kept_mask(sorted_probs, top_p, top_k)
    # top_k_top_p applies top_p to the probabilities renormalised over the top-k head.
    head = torch.where(torch.arange(probs.shape[-1], device=probs.device)[None] < top_k[:, None], sorted_probs, 0.0)
    kept_tk = kept_mask(head / head.sum(-1, keepdim=True), top_p, top_k)
    kept = torch.where((method == TOP_K_TOP_P)[:, None], kept_tk, kept)
    rank = inverse_cdf(torch.where(kept, sorted_probs, 0.0), u_nucleus)
    pick = sorted_ids.gather(1, rank[:, None])[:, 0]

    # RAS repetition check over the last win_size emitted ids (padding -1 never matches).
    width = hist.shape[-1]
    cols = torch.arange(width, device=hist.device)
    recent = (cols[None] >= width - win[:, None]) & (hist == pick[:, None])
    fallback = (method == RAS) & (recent.sum(-1) >= rep_min)
    redraw = inverse_cdf(logp.scatter(1, pick[:, None], -float("inf")).softmax(-1), u_fallback)
    pick = torch.where(fallback, redraw, pick)
    return torch.where(method == GREEDY, logp.argmax(-1), pick)


def choose_ids(logits: torch.Tensor, rows: torch.Tensor, stop_mask: torch.Tensor) -> torch.Tensor:
    """The tail of a static step (decode or prefill): (B, V) logits -> (B,) ids, :data:`NONFINITE`
    for a row whose logits are not finite. Tensor ops only: it runs inside a CUDA graph.

    Rows with NaN/Inf logits are marked in the step's one copy to the host (checked after the
    step, they cost a reduction and a second sync every step) and sampled
    from flat log-probabilities meanwhile: NaN ones pick an index out of range, which on a GPU is a
    device-side assert that kills the replica, not just the request.
    """
    finite = torch.isfinite(logits).all(-1)
    logp = torch.where(finite[:, None], logits.float().log_softmax(-1), 0.0)
    return torch.where(finite, sample_rows(mask_min_len(logp, rows, stop_mask), rows), NONFINITE)
