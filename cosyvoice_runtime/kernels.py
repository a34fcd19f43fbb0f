"""Hand-written GPU kernels (Triton) for launch-bound passes, each beside the PyTorch composite
it replaces, which serves wherever the kernel cannot (no CUDA, no Triton, switched off).

A graphed incremental flow pass at one stream is the launches of its hundreds of kernels in
sequence, and so is an LLM decode step (kernel profiles: docs/tuning.md §1), so a kernel fewer is
time saved whatever its work.
:func:`add_layer_norm` is three of them in one: a residual add, the LayerNorm of its result, and
the copy of that into the attention block's cache slot; :func:`add_rms_norm` the add and the
RMSNorm of a decoder layer.

Triton is optional: CUDA builds of torch bring it, the CPU wheel does not. The kernel's numbers
are checked against the composite under Triton's interpreter on the CPU where Triton is
installed (``tests/runtime/test_kernels.py``) and on the GPU by the gpu-marked test; its speed
only on the GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # optional: see the module docstring
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

AVAILABLE = triton is not None


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: nn.LayerNorm, slot: torch.Tensor | None = None,
                   fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + delta`` (or ``x`` when ``delta`` is None) and ``normed = norm(s)``, which is also
    written into ``slot`` when given (a (B, T, D) view with unit stride over D: a cache slot).

    x, delta: (B, T, D) contiguous. With ``fused`` on a CUDA tensor (or under Triton's interpreter)
    and Triton installed: one kernel, statistics in float32 over ``s`` as stored (rounded to the
    input dtype, as the composite's add leaves it), so it differs from the composite only in the
    order of the reduction. Returns ``(s, normed)``, both contiguous.
    """
    if fused and AVAILABLE and _can_launch(x):
        return _fused(x, delta, norm, slot)
    s = x if delta is None else x + delta
    normed = F.layer_norm(s, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    if slot is not None:
        slot.copy_(normed)
    return s, normed


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + delta`` and ``rms_norm(s) * weight`` (statistics and the gain in float32, one
    rounding, as ``F.rms_norm``); one kernel under the conditions of :func:`add_layer_norm`.
    x, delta: (..., D). Returns ``(s, normed)``."""
    if fused and AVAILABLE and _can_launch(x):
        x, delta = x.contiguous(), delta.contiguous()  # a prefill graph's input is a slice of its buffer
        d = x.shape[-1]
        s, normed = torch.empty_like(x), torch.empty_like(x)
        _add_ln_kernel[(x.numel() // d,)](x, delta, s, normed, normed, weight, weight, 1, 0, 0, d, eps,
                                          BLOCK=triton.next_power_of_2(d), HAS_DELTA=True, HAS_SLOT=False, RMS=True)
        return s, normed
    s = x + delta
    return s, F.rms_norm(s, weight.shape, weight, eps)


def _can_launch(x: torch.Tensor) -> bool:
    """On CUDA, or anywhere under Triton's interpreter (TRITON_INTERPRET=1: the CPU tests)."""
    knobs = getattr(triton, "knobs", None)
    return x.is_cuda or bool(knobs is not None and knobs.runtime.interpret)


def _fused(x: torch.Tensor, delta: torch.Tensor | None, norm: nn.LayerNorm,
           slot: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, d = x.shape
    if not x.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        raise ValueError("add_layer_norm: x and delta must be contiguous (B, T, D)")
    if norm.weight is None or norm.bias is None or norm.normalized_shape != (d,):
        raise ValueError("add_layer_norm: a LayerNorm over the last dimension with weight and bias")
    if slot is not None and (slot.shape != x.shape or slot.stride(2) != 1):
        raise ValueError(f"add_layer_norm: the slot must be {tuple(x.shape)} with unit stride over D")
    s = x if delta is None else torch.empty_like(x)
    normed = torch.empty_like(x)
    out = normed if slot is None else slot
    _add_ln_kernel[(b * t,)](
        x, x if delta is None else delta, s, normed, out, norm.weight, norm.bias, t, out.stride(0), out.stride(1),
        d, norm.eps, BLOCK=triton.next_power_of_2(d), HAS_DELTA=delta is not None, HAS_SLOT=slot is not None,
        RMS=False)
    return s, normed


if AVAILABLE:
    @triton.jit
    def _add_ln_kernel(x_ptr, delta_ptr, s_ptr, y_ptr, slot_ptr, w_ptr, b_ptr, rows_per_batch, slot_stride_b,
                       slot_stride_t, n_cols, eps, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
                       HAS_SLOT: tl.constexpr, RMS: tl.constexpr):
        """One row per program: s = x + delta (stored, rounded to its dtype), y = LayerNorm(s)
        (with ``RMS``: RMSNorm, no centring and no bias), and y again into the slot at the row's
        (batch, frame) strides."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        v = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            v = (v.to(tl.float32) + tl.load(delta_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32))
            v = v.to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + row * n_cols + cols, v, mask=mask)
        v = v.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if RMS:
            y = v * tl.rsqrt(tl.sum(v * v, axis=0) / n_cols + eps) * w
        else:
            centred = tl.where(mask, v - tl.sum(v, axis=0) / n_cols, 0.0)
            rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
            y = centred * rstd * w + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * n_cols + cols, y, mask=mask)
        if HAS_SLOT:
            frame = row % rows_per_batch
            batch = row // rows_per_batch
            tl.store(slot_ptr + batch * slot_stride_b + frame * slot_stride_t + cols, y, mask=mask)
