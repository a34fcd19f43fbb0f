"""Several linear layers over the same input as one GEMM, without changing checkpoint keys.

Launch-bound steps (an LLM decode step, one estimator call of the flow) spend their time per
kernel, not per FLOP: q, k and v projections as one matrix product are two launches fewer. The
modules keep their own (official) parameters; the concatenation is cached in a plain dict of the
caller, keyed by each parameter's storage, version and dtype, so it follows a checkpoint loaded
later, an in-place update or a ``.to()``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _key(t: torch.Tensor | None) -> tuple:
    return (None,) if t is None else (t.data_ptr(), t._version, t.dtype, t.device)


def fused_linear(x: torch.Tensor, layers: tuple[nn.Linear, ...], cache: dict) -> torch.Tensor:
    """``cat([layer(x) for layer in layers], -1)`` as one ``F.linear`` (all biased or none).

    Under ``torch.compile`` (mode torchscript) the plain form is traced instead: the cache key
    reads storage pointers, which would break the compiled graph, and inductor fuses on its own.
    """
    if torch.compiler.is_compiling():
        return torch.cat([layer(x) for layer in layers], dim=-1)
    key = tuple(k for layer in layers for k in (*_key(layer.weight), *_key(layer.bias)))
    if cache.get("key") != key:
        with torch.no_grad():
            bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
            cache.clear()
            cache.update(key=key, weight=torch.cat([layer.weight for layer in layers]), bias=bias)
    return F.linear(x, cache["weight"], cache["bias"])
