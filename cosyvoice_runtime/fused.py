"""Several linear layers over the same input as one GEMM, and a causal convolution as one GEMM,
without changing checkpoint keys.

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


def weight_key(t: torch.Tensor | None) -> tuple:
    """What tells a weight apart from its replacement or an in-place update of it (for tensors
    derived from weights and kept: a concatenation here, the flow's time table)."""
    return (None,) if t is None else (t.data_ptr(), t._version, t.dtype, t.device)


def fused_linear(x: torch.Tensor, layers: tuple[nn.Linear, ...], cache: dict) -> torch.Tensor:
    """``cat([layer(x) for layer in layers], -1)`` as one ``F.linear`` (all biased or none).

    Under ``torch.compile`` (mode torchscript) the plain form is traced instead: the cache key
    reads storage pointers, which would break the compiled graph, and inductor fuses on its own.
    """
    if torch.compiler.is_compiling():
        return torch.cat([layer(x) for layer in layers], dim=-1)
    key = tuple(k for layer in layers for k in (*weight_key(layer.weight), *weight_key(layer.bias)))
    if cache.get("key") != key:
        with torch.no_grad():
            bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
            cache.clear()
            cache.update(key=key, weight=torch.cat([layer.weight for layer in layers]), bias=bias)
    return F.linear(x, cache["weight"], cache["bias"])


def causal_conv_gemm(full: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """A causal ``conv`` (stride 1, no padding, no dilation) over channels-last frames.

    ``full`` (B, k - 1 + n, C), any strides: each row's k - 1 history frames, then its n new ones
    -> (B, n, C_out). The k-frame windows, gathered by one copy (they overlap), against the
    weight (C_out, C·k) as it is stored: two kernels where cuDNN's channels-first convolution of
    the same frames took four, two of them layout transforms of the input and the weight on every
    call. A grouped convolution is one batched GEMM over its groups (four kernels): cuDNN ran
    CosyVoice3's two 16-group position convolutions as 16 convolutions each (the incremental flow
    pass's kernels before and after: docs/tuning.md §1).
    """
    k, groups = conv.kernel_size[0], conv.groups
    windows = full.unfold(1, k, 1)  # (B, n, C, k), overlapping views
    if groups == 1:
        return F.linear(windows.flatten(2), conv.weight.flatten(1), conv.bias)
    b, n, c, _ = windows.shape
    # a channel's k taps stay together, so each group's C/g·k columns are contiguous
    per_group = windows.reshape(b * n, groups, c // groups * k).transpose(0, 1)  # (g, B·n, C/g·k)
    weight = conv.weight.view(groups, -1, c // groups * k).transpose(1, 2)  # (g, C/g·k, C_out/g)
    out = torch.bmm(per_group, weight).transpose(0, 1).reshape(b, n, -1)
    return out if conv.bias is None else out + conv.bias
