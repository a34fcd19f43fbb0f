"""CosyVoice2 estimator: causal 1-D U-Net with transformer blocks (``CausalConditionalDecoder``, §4.6).

Inputs ``x, mu, cond (B, 80, T)``, ``mask (B, 1, T)``, ``t (B,)``, ``spks (B, 80)``. All
convolutions are causal (left padding), so right padding never leaks into valid frames.

Each module has its full ``forward`` and, where the incremental flow needs one, a cache-aware
``forward_cached`` over new frames only (the cached state: :class:`~cosyvoice_runtime.flow.cached_pass.Pass`).
That forward keeps its activations channels-last, (2B, n, C), as the transformer blocks take
them: the LayerNorms over channels then read contiguous rows, the convolutions are GEMMs
(``Pass.conv_gemm``), the 1x1 convolutions plain linear layers, and no block copies its input into
or out of a transposed layout. With the frame buffer and the time table: 926 kernels a pass
instead of 1,173, and a pass at batch 1 is the launches of its kernels in sequence (the kernel
profiles of the two layouts: bench/results/INDEX.md, "Kernel and first-audio profiles").
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_runtime.config import UNetSpec
from cosyvoice_runtime.flow.cached_pass import Layout, Pass, make_layout
from cosyvoice_runtime.flow.masks import attention_mask, to_bias
from cosyvoice_runtime.fused import fused_linear
from cosyvoice_runtime.kernels import add_layer_norm


def sinusoidal_embedding(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """(B,) -> (B, dim): ``[sin(scale·t·f_i), cos(scale·t·f_i)]``, f_i = exp(-i·ln(1e4)/(dim/2-1))."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    arg = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((arg.sin(), arg.cos()), dim=-1)


def pointwise(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """A 1x1 convolution of channels-last frames (.., T, C)."""
    return F.linear(x, conv.weight[:, :, 0], conv.bias)


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

    def forward_cached(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        """New channels-last frames x (2B, n, C) behind their rows' cached history."""
        conv, _, norm, _, mish = self.block
        return mish(norm(p.conv_gemm(conv, x)))


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

    def forward_cached(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        """New channels-last frames (2B, n, C); the time projection is the pass's time table line."""
        h = self.block1.forward_cached(x, p) + p.timed(self.mlp[1])[:, None, :]
        return self.block2.forward_cached(h, p) + pointwise(self.res_conv, x)


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
        self._fused_kv: dict = {}  # k/v alone, for the incremental pass (TransformerBlock.forward_cached)

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

    def forward_cached(self, h: torch.Tensor, normed: torch.Tensor, bias: torch.Tensor, p: Pass,
                       following: TransformerBlock | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block over new frames h (2B, n, C), given their normed input (already in the
        block's cache slot); keys and values are its cached frames' and theirs. Returns the
        block's output and, when a ``following`` block comes, that output normed for it (and in
        its slot): each LayerNorm taken with the residual add before it (:func:`add_layer_norm`,
        one kernel for the three with the pass's ``fused_norms``)."""
        attn = self.attn1
        b, n, _ = h.shape
        q = attn.to_q(normed).view(b, n, attn.heads, attn.head_dim).transpose(1, 2)
        kv = attn.kv(p.block_frames(self))
        k, v = kv.view(b, -1, 2, attn.heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None])
        h, normed = add_layer_norm(h, attn.to_out[0](out.transpose(1, 2).reshape(b, n, -1)), self.norm3,
                                   fused=p.fused_norms)
        ff = self.ff(normed)
        if following is None:
            return h + ff, None
        return add_layer_norm(h, ff, following.norm1, slot=p.block_slot(following, n), fused=p.fused_norms)


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

    # -- the incremental flow's cache-aware forward (cosyvoice_runtime.flow.incremental) --------
    def _resnets(self) -> list[CausalResnetBlock1D]:
        """The resnets in forward order (down, mid, up)."""
        return [self.down_blocks[0][0], *(mid[0] for mid in self.mid_blocks), self.up_blocks[0][0]]

    def cached_layout(self) -> Layout:
        """Where a pass's cached state sits: the causal convolutions in forward order, the transformer blocks."""
        convs: list[nn.Conv1d] = []
        blocks: list[TransformerBlock] = []

        def stage(resnet: CausalResnetBlock1D, tblocks: nn.ModuleList) -> None:
            convs.extend([resnet.block1.block[0], resnet.block2.block[0]])
            blocks.extend(tblocks)

        resnet, tblocks, down = self.down_blocks[0]
        stage(resnet, tblocks)
        convs.append(down)
        for resnet, tblocks in self.mid_blocks:
            stage(resnet, tblocks)
        resnet, tblocks, up = self.up_blocks[0]
        stage(resnet, tblocks)
        convs += [up, self.final_block.block[0]]
        return make_layout(convs, blocks, self.spec.channels[0], self.spec.static_chunk_size, self.time_layers())

    def time_layers(self) -> list[nn.Linear]:
        """The layers whose output depends on the ODE time alone, in :meth:`time_table` order:
        each resnet's time projection."""
        return [resnet.mlp[1] for resnet in self._resnets()]

    def time_weights(self) -> list[torch.Tensor]:
        """Every parameter :meth:`time_table` reads."""
        return [*self.time_mlp.parameters(), *(w for layer in self.time_layers() for w in layer.parameters())]

    def time_table(self, t: torch.Tensor) -> torch.Tensor:
        """(steps, columns) the :meth:`time_layers` outputs at each ODE time ``t`` (steps,), side by
        side (``Layout.time_offset``). They depend on the time alone, the same ten values in every
        pass of every request: read from this table, a pass launches ~40 kernels fewer (sinusoid,
        time MLP, 14 resnet projections)."""
        # a resnet's mlp is Mish, then its projection
        act = F.mish(self.time_mlp(sinusoidal_embedding(t, self.spec.in_channels).to(t.dtype)))
        return torch.cat([layer(act) for layer in self.time_layers()], dim=-1)

    def _attend_cached(self, x: torch.Tensor, blocks: nn.ModuleList, bias: torch.Tensor, p: Pass) -> torch.Tensor:
        """A stage's transformer blocks over new frames; the first LayerNorm's output also goes
        into the first block's cache slot."""
        _, normed = add_layer_norm(x, None, blocks[0].norm1, slot=p.block_slot(blocks[0], x.shape[1]),
                                   fused=p.fused_norms)
        for i, block in enumerate(blocks):
            x, normed = block.forward_cached(x, normed, bias, p, blocks[i + 1] if i + 1 < len(blocks) else None)
        return x

    def forward_cached(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                       bias: torch.Tensor, p: Pass) -> torch.Tensor:
        """:meth:`forward` (streaming) of new frames x, mu, cond (2B, 80, n) -> (2B, 80, n) over the
        pass's cached state ``p``; ``bias``: its ``pass_bias``; the ODE time enters through
        ``p.time_rows`` (:meth:`time_table`)."""
        h = torch.cat([x.transpose(1, 2), mu.transpose(1, 2), spks[:, None, :].expand(-1, x.shape[-1], -1),
                       cond.transpose(1, 2)], dim=-1)
        p.load_history()
        resnet, blocks, down = self.down_blocks[0]
        h = self._attend_cached(resnet.forward_cached(h, p), blocks, bias, p)
        skip = h
        h = p.conv_gemm(down, h)
        for resnet, blocks in self.mid_blocks:
            h = self._attend_cached(resnet.forward_cached(h, p), blocks, bias, p)
        resnet, blocks, up = self.up_blocks[0]
        h = torch.cat([h, skip], dim=-1)
        h = p.conv_gemm(up, self._attend_cached(resnet.forward_cached(h, p), blocks, bias, p))
        h = self.final_block.forward_cached(h, p)
        p.store_history()
        return pointwise(self.final_proj, h).transpose(1, 2)
