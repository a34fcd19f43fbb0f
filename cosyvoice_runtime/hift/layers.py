"""Building blocks of the HiFT vocoders: Snake, (causal) convolutions, residual blocks.

Parameter names follow the official ``cosyvoice.hifigan`` modules so that ``hift.pt`` loads
strictly: weight-normalised convolutions carry ``parametrizations.weight.original0/1`` (g / v)
until :func:`fold_weight_norm` replaces them by plain ``weight`` tensors for inference.

All tensors are channel-major ``(B, C, T)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

# Snake divides by alpha; the official code guards the division with this epsilon.
SNAKE_EPS = 1e-9


def wn(module: nn.Module) -> nn.Module:
    """Weight-normalise ``module.weight`` over dim 0 (the official ``weight_norm`` default)."""
    return weight_norm(module)


def fold_weight_norm(module: nn.Module) -> int:
    """Replace every weight-norm parametrization below ``module`` by its folded weight.

    Returns:
        the number of folded tensors (0 when already folded).
    """
    folded = 0
    for sub in module.modules():
        if parametrize.is_parametrized(sub, "weight"):
            parametrize.remove_parametrizations(sub, "weight", leave_parametrized=True)
            folded += 1
    return folded


def causal_padding(kernel_size: int, dilation: int = 1) -> int:
    """Context frames of the official ``CausalConv1d``: ``(k - 1) * d`` for odd k, 3 for k = 4."""
    return (kernel_size * dilation - dilation) // 2 * 2 + (kernel_size + 1) % 2


class Snake(nn.Module):
    """``x + 1/(alpha + eps) * sin^2(alpha * x)`` with a learned per-channel ``alpha`` (linear scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.unsqueeze(0).unsqueeze(-1)
        return x + (1.0 / (alpha + SNAKE_EPS)) * torch.pow(torch.sin(x * alpha), 2)


class CausalConv1d(nn.Conv1d):
    """Stride-1 convolution padded on one side only.

    ``side='left'``: causal (``causal_padding`` zeros before the input). ``side='right'``:
    looks ``causal_padding`` frames ahead; the look-ahead is zeros unless ``context`` (the frames
    that follow ``x``) is given, in which case the output has exactly ``x``'s length.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 side: str = "left") -> None:
        super().__init__(in_channels, out_channels, kernel_size, 1, padding=0, dilation=dilation)
        if side not in ("left", "right"):
            raise ValueError(f"side must be 'left' or 'right', got {side}")
        self.side = side
        self.causal_padding = causal_padding(kernel_size, dilation)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """(B, C_in, T) [+ (B, C_in, causal_padding)] -> (B, C_out, T)."""
        if context is None:
            pad = (self.causal_padding, 0) if self.side == "left" else (0, self.causal_padding)
            x = F.pad(x, pad)
        elif self.side == "left":
            x = torch.cat([context, x], dim=2)
        else:
            x = torch.cat([x, context], dim=2)
        return super().forward(x)


class CausalConv1dUpsample(nn.Conv1d):
    """Nearest-neighbour ×``stride`` followed by a causal convolution (CV3 ``ups.*``)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size, 1, padding=0)
        self.stride_up = stride
        self.causal_padding = kernel_size - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, T) -> (B, C_out, T * stride)."""
        x = F.interpolate(x, scale_factor=float(self.stride_up), mode="nearest")
        return super().forward(F.pad(x, (self.causal_padding, 0)))


class CausalConv1dDownsample(nn.Conv1d):
    """Strided convolution with ``stride - 1`` zeros of left padding (CV3 ``source_downs.*``)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding=0)
        self.causal_padding = stride - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.causal_padding, 0)))


class ResBlock(nn.Module):
    """Three Snake -> dilated conv -> Snake -> conv residual units (HiFi-GAN MRF block).

    Non-causal convs use 'same' padding; causal ones are left-padded (``CausalResBlock``).
    """

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], causal: bool) -> None:
        super().__init__()

        def conv(dilation: int) -> nn.Module:
            if causal:
                return wn(CausalConv1d(channels, channels, kernel_size, dilation=dilation, side="left"))
            pad = (kernel_size * dilation - dilation) // 2
            return wn(nn.Conv1d(channels, channels, kernel_size, 1, dilation=dilation, padding=pad))

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C, T)."""
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + c2(a2(c1(a1(x))))
        return x
