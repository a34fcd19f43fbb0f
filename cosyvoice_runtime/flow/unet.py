"""CosyVoice2 estimator: causal 1-D U-Net with transformer blocks (``CausalConditionalDecoder``, §4.6).

Inputs ``x, mu, cond (B, 80, T)``, ``mask (B, 1, T)``, ``t (B,)``, ``spks (B, 80)``. All
convolutions are causal (left padding), so right padding never leaks into valid frames.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_runtime.config import UNetSpec
from cosyvoice_runtime.flow.masks import attention_mask, to_bias
from cosyvoice_runtime.fused import fused_linear


def sinusoidal_embedding(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """(B,) -> (B, dim): ``[sin(scale·t·f_i), cos(scale·t·f_i)]``, f_i = exp(-i·ln(1e4)/(dim/2-1))."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    arg = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((arg.sin(), arg.cos()), dim=-1)


class CausalConv1d(nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class _Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    """``Mish(LayerNorm_channels(CausalConv_k3(x·mask)))·mask`` (keys block.0 conv, block.2 norm)."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(CausalConv1d(dim, dim_out, 3), _Transpose(), nn.LayerNorm(dim_out), _Transpose(),
                                   nn.Mish())

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.block(x * mask) * mask


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.mlp(temb).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)


class SelfAttention(nn.Module):
    """Diffusers ``Attention`` without cross-attention: q/k/v without bias, additive mask bias."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self._fused: dict = {}  # q/k/v as one weight (cosyvoice_runtime.fused; checkpoint keys unchanged)
        self._fused_kv: dict = {}  # k/v alone, for the incremental pass (flow/incremental_walk.py)

    def kv(self, x: torch.Tensor) -> torch.Tensor:
        """``cat([to_k(x), to_v(x)], -1)`` as one GEMM (the incremental pass's cached frames)."""
        return fused_linear(x, (self.to_k, self.to_v), self._fused_kv)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C); bias: (B, T, T) additive -> (B, T, C)."""
        b, t, _ = x.shape
        qkv = fused_linear(x, (self.to_q, self.to_k, self.to_v), self._fused)
        q, k, v = qkv.view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None])
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


class _GELUProj(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class _FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.net = nn.ModuleList([_GELUProj(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class TransformerBlock(nn.Module):
    """Pre-norm ``x + Attn(LN1(x))``, ``x + FF(LN3(x))`` (diffusers ``BasicTransformerBlock``)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = _FeedForward(dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), bias)
        return x + self.ff(self.norm3(x))


class _TimeMLP(nn.Module):
    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class CausalUNet(nn.Module):
    """The estimator: ``forward(x, mask, mu, t, spks, cond, streaming) -> (B, 80, T)``."""

    def __init__(self, spec: UNetSpec) -> None:
        super().__init__()
        self.spec = spec
        ch = spec.channels[0]
        tdim = spec.time_embed_dim
        self.time_mlp = _TimeMLP(spec.in_channels, tdim)

        def stage(c_in: int, last_conv: bool) -> nn.ModuleList:
            blocks = [TransformerBlock(ch, spec.num_heads, spec.attention_head_dim) for _ in range(spec.n_blocks)]
            parts = [CausalResnetBlock1D(c_in, ch, tdim), nn.ModuleList(blocks)]
            if last_conv:
                parts.append(CausalConv1d(ch, ch, 3))
            return nn.ModuleList(parts)

        if len(spec.channels) != 1:
            raise ValueError("only the released single-stage U-Net (channels=[C]) is supported")
        self.down_blocks = nn.ModuleList([stage(spec.in_channels, True)])
        self.mid_blocks = nn.ModuleList(stage(ch, False) for _ in range(spec.num_mid_blocks))
        self.up_blocks = nn.ModuleList([stage(2 * ch, True)])
        self.final_block = CausalBlock1D(ch, ch)
        self.final_proj = nn.Conv1d(ch, spec.out_channels, 1)

    def _attend(self, x: torch.Tensor, blocks: nn.ModuleList, bias: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)
        for block in blocks:
            h = block(h, bias)
        return h.transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        temb = self.time_mlp(sinusoidal_embedding(t, self.spec.in_channels).to(t.dtype))
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.shape[-1]), cond], dim=1)
        bias = to_bias(attention_mask(mask, self.spec.static_chunk_size, streaming), h.dtype)
        resnet, blocks, down = self.down_blocks[0]
        h = self._attend(resnet(h, mask, temb), blocks, bias)
        skip = h
        h = down(h * mask)
        for resnet, blocks in self.mid_blocks:
            h = self._attend(resnet(h, mask, temb), blocks, bias)
        resnet, blocks, up = self.up_blocks[0]
        h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)
        h = up(self._attend(resnet(h, mask, temb), blocks, bias) * mask)
        h = self.final_block(h, mask)
        return self.final_proj(h * mask) * mask
