"""F0 predictors: mel (B, 80, T) -> f0 (B, T) in Hz (spec §5.1).

CV2 ``ConvRNNF0Predictor``: five weight-normalised k=3 'same' convs with ELU in between, then a
Linear to one class and ``abs``. CV3 ``CausalConvRNNF0Predictor``: the first conv (k=4) looks 3
frames ahead, the other four are causal; the official runtime evaluates it in float64 because its
output drives a cumulative phase (streamed chunks must agree to the last bit possible).

Keys: ``condnet.{0,2,4,6,8}`` (convs; ELUs at the odd indices) and ``classifier``.
"""
from __future__ import annotations

import torch
from torch import nn

from cosyvoice_runtime.hift.layers import CausalConv1d, wn

NUM_CONVS = 5
F0_KERNEL = 3
CAUSAL_FIRST_KERNEL = 4  # right-looking: causal_padding(4) == 3 frames of look-ahead


class F0Predictor(nn.Module):
    """Mel -> f0.

    Args:
        in_channels: mel bins.
        cond_channels: hidden width.
        causal: CV3 variant (look-ahead first conv, causal rest, float64 compute).
        compute_dtype: dtype of the causal forward pass (float64 as the reference; the module's
            parameters stay in their own dtype and are cast per call).
    """

    def __init__(self, in_channels: int, cond_channels: int, causal: bool,
                 compute_dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.causal = causal
        self.compute_dtype = compute_dtype if causal else None
        layers: list[nn.Module] = []
        for i in range(NUM_CONVS):
            cin = in_channels if i == 0 else cond_channels
            if not causal:
                conv = nn.Conv1d(cin, cond_channels, F0_KERNEL, padding=F0_KERNEL // 2)
            elif i == 0:
                conv = CausalConv1d(cin, cond_channels, CAUSAL_FIRST_KERNEL, side="right")
            else:
                conv = CausalConv1d(cin, cond_channels, F0_KERNEL, side="left")
            layers += [wn(conv), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    @property
    def look_right(self) -> int:
        """Frames of look-ahead of the first conv (0 for the non-causal predictor)."""
        return self.condnet[0].causal_padding if self.causal else 0

    @property
    def left_context(self) -> int:
        """Frames of left context the causal predictor reads (sum of the causal convs' padding)."""
        return sum(m.causal_padding for m in list(self.condnet)[1:] if isinstance(m, CausalConv1d))

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """(B, in_channels, T) -> (B, T) Hz, or (B, T - look_right) when not finalizing.

        ``finalize=False`` (causal only): the last ``look_right`` frames are used as look-ahead
        context, not predicted.
        """
        if not self.causal:
            return torch.abs(self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1))
        out_dtype = mel.dtype
        dt = self.compute_dtype
        x = mel.to(dt)
        first = self.condnet[0]
        w0, b0 = first.weight.to(dt), first.bias.to(dt)
        if finalize:  # zero look-ahead past the end; otherwise the last frames are the context
            x = torch.nn.functional.pad(x, (0, first.causal_padding))
        x = torch.nn.functional.conv1d(x, w0, b0)
        for layer in list(self.condnet)[1:]:
            if isinstance(layer, CausalConv1d):
                x = torch.nn.functional.pad(x, (layer.causal_padding, 0))
                x = torch.nn.functional.conv1d(x, layer.weight.to(dt), layer.bias.to(dt), dilation=layer.dilation)
            else:
                x = layer(x)
        y = torch.nn.functional.linear(x.transpose(1, 2), self.classifier.weight.to(dt), self.classifier.bias.to(dt))
        return torch.abs(y.squeeze(-1)).to(out_dtype)
