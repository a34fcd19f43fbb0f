"""CosyVoice2 token encoder (``UpsampleConformerEncoder``, spec §4.2) and the pre-look-ahead layer.

Shapes: ``B`` batch, ``T`` tokens, ``D`` model width (512 released). Layers use the official
parameter names (``encoder.embed.out.0``, ``encoder.encoders.{i}.self_attn.linear_q`` ...).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_runtime.config import ConformerEncoderSpec
from cosyvoice_runtime.flow.masks import attention_mask
from cosyvoice_runtime.fused import fused_linear


class PreLookaheadLayer(nn.Module):
    """Each position sees itself and the next ``lookahead`` inputs (CV2 encoder and CV3 flow).

    Conv1d(k = lookahead + 1) over the input right-extended by the context (or zeros when
    finalizing), LeakyReLU, causal Conv1d(k=3), residual.
    """

    def __init__(self, in_channels: int, channels: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(in_channels, channels, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, kernel_size=3)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, C); context: (B, lookahead, C) or None -> (B, T, C)."""
        h = x.transpose(1, 2)
        if context is None or context.shape[1] == 0:
            h = F.pad(h, (0, self.lookahead))
        else:
            if context.shape[1] != self.lookahead:
                raise ValueError(f"look-ahead context must be {self.lookahead} frames, got {context.shape[1]}")
            h = torch.cat([h, context.transpose(1, 2)], dim=2)
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


def rel_positions(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(1, 2T-1, D) ESPnet relative sinusoids for distances +(T-1) ... 0 ... -(T-1)."""
    pos = torch.arange(0, length, dtype=torch.float32, device=device).unsqueeze(1)
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / dim))
    pe_pos = torch.zeros(length, dim, device=device)
    pe_neg = torch.zeros(length, dim, device=device)
    pe_pos[:, 0::2], pe_pos[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    pe_neg[:, 0::2], pe_neg[:, 1::2] = torch.sin(-1 * pos * div), torch.cos(-1 * pos * div)
    pe = torch.cat([torch.flip(pe_pos, [0]), pe_neg[1:]], dim=0)
    return pe.unsqueeze(0).to(dtype)


class LinearEmbed(nn.Module):
    """Linear -> LayerNorm(1e-5) -> x sqrt(D) (``LinearNoSubsampling`` + rel-pos encoding)."""

    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.xscale = math.sqrt(odim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class RelPositionAttention(nn.Module):
    """Transformer-XL style multi-head attention with learned position biases u, v."""

    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.h, self.d_k = heads, dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d_k))
        self._fused: dict = {}  # q/k/v as one weight (cosyvoice_runtime.fused; checkpoint keys unchanged)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: (B, T, D); mask: (B, T, T) bool; pos: (1, 2T-1, D) -> (B, T, D)."""
        b, t, _ = x.shape
        qkv = fused_linear(x, (self.linear_q, self.linear_k, self.linear_v), self._fused).view(b, t, 3, self.h, self.d_k)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
        p = self.linear_pos(pos).view(1, -1, self.h, self.d_k).transpose(1, 2)  # (1, H, 2T-1, dk)
        ac = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        bd = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))  # (B, H, T, 2T-1)
        # score(i, j) uses the row of distance i - j, which sits at column (T-1) - (i - j).
        idx = (t - 1) - torch.arange(t, device=x.device)[:, None] + torch.arange(t, device=x.device)[None, :]
        bd = torch.gather(bd, -1, idx.expand(b, self.h, t, t))
        scores = (ac + bd) / math.sqrt(self.d_k)
        keep = mask[:, None]
        attn = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).masked_fill(~keep, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, -1)
        return self.linear_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm self-attention + feed-forward (no macaron, no conv module), LayerNorm eps 1e-12."""

    def __init__(self, spec: ConformerEncoderSpec) -> None:
        super().__init__()
        d = spec.output_size
        self.self_attn = RelPositionAttention(spec.attention_heads, d)
        self.feed_forward = FeedForward(d, spec.linear_units)
        self.norm_mha = nn.LayerNorm(d, eps=1e-12)
        self.norm_ff = nn.LayerNorm(d, eps=1e-12)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos)
        return x + self.feed_forward(self.norm_ff(x))


class Upsample1D(nn.Module):
    """Nearest x stride, left pad 2*stride, Conv1d(k = 2*stride + 1): causal upsampling."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, kernel_size=stride * 2 + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C, stride * T)."""
        h = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(h, (self.stride * 2, 0)))


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, spec: ConformerEncoderSpec) -> None:
        super().__init__()
        d = spec.output_size
        self.spec = spec
        self.embed = LinearEmbed(spec.input_size, d)
        self.pre_lookahead_layer = PreLookaheadLayer(d, d, spec.pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerLayer(spec) for _ in range(spec.num_blocks))
        self.up_layer = Upsample1D(d, spec.upsample_stride)
        self.up_embed = LinearEmbed(d, d)
        self.up_encoders = nn.ModuleList(ConformerLayer(spec) for _ in range(spec.num_up_blocks))
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def forward(self, xs: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor,
                streaming: bool | torch.Tensor = False, n_keep: int | None = None) -> torch.Tensor:
        """Right-padded token embeddings -> frame features (spec §4.2, batching §6.2 C).

        Args:
            xs: (B, T_in, D_in) token embeddings.
            valid: (B, T_in) bool, True on the positions an item has: its tokens, followed (for a
                non-final streaming call) by its look-ahead context tokens.
            lengths: (B,) tokens that produce output (context tokens excluded).
            streaming: block-causal chunk attention (chunk C tokens, then 2C frames); one flag or
                a (B,) bool tensor.
            n_keep: token positions kept after the look-ahead layer, at least ``max(lengths)``
                (default: that, read back from the device). Positions past an item's length are
                padding whatever their number (hidden keys, causal upsampling), so a CUDA graph
                keeps a fixed number.

        Returns:
            (B, stride * n_keep, D); item i is valid for ``stride * lengths[i]`` frames.
        """
        spec = self.spec
        h = self.embed(xs)
        # NOTE: zero inputs map to non-zero vectors after embed; re-zero padded positions so the
        # look-ahead conv of an item's last position sees zeros (or its context tokens), exactly
        # as a lone sequence would.
        h = h * valid.unsqueeze(-1).to(h.dtype)
        # Context positions only feed the look-ahead conv; from here on they are padding.
        h = self.pre_lookahead_layer(h)[:, : int(lengths.max()) if n_keep is None else n_keep]
        pad_mask = (torch.arange(h.shape[1], device=h.device)[None, :] < lengths[:, None])[:, None]
        pos = rel_positions(h.shape[1], h.shape[2], h.device, h.dtype)
        mask = attention_mask(pad_mask, spec.static_chunk_size, streaming)
        for layer in self.encoders:
            h = layer(h, mask, pos)
        h = self.up_layer(h.transpose(1, 2)).transpose(1, 2)
        up_pad = pad_mask.repeat_interleave(spec.upsample_stride, dim=2)
        h = self.up_embed(h)
        pos = rel_positions(h.shape[1], h.shape[2], h.device, h.dtype)
        mask = attention_mask(up_pad, spec.static_chunk_size * spec.upsample_stride, streaming)
        for layer in self.up_encoders:
            h = layer(h, mask, pos)
        return self.after_norm(h)
