"""CosyVoice3 estimator: DiT with adaLN-zero, causal conv position embedding (spec §4.7).

Inputs as the U-Net: ``x, mu, cond (B, 80, T)``, ``mask (B, 1, T)``, ``t (B,)``, ``spks (B, 80)``.

NOTE [quirk, reproduced]: the rotary embedding (dim_head wide, interleaved pairs) is applied to
the (B, T, heads * dim_head) q/k projections *before* the head split, so only the first
dim_head channels — head 0 — are rotated. The released checkpoint was trained that way.

Beside its full ``forward``, the DiT has a cache-aware ``forward_cached`` over new frames only,
for the incremental flow (the cached state: :class:`~cosyvoice_runtime.flow.cached_pass.Pass`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_runtime.config import DiTSpec
from cosyvoice_runtime.flow.cached_pass import Layout, Pass, make_layout
from cosyvoice_runtime.flow.masks import attention_mask
from cosyvoice_runtime.flow.unet import sinusoidal_embedding
from cosyvoice_runtime.fused import fused_linear


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)  # persistent: part of flow.pt

    def forward(self, length: int) -> torch.Tensor:
        """(1, T, dim) angles, interleaved ``[f0, f0, f1, f1, ...]``, float32."""
        t = torch.arange(length, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        return torch.stack((freqs, freqs), dim=-1).flatten(-2).unsqueeze(0)


def rotary_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) of interleaved angles ``[f0, f0, f1, f1, ...]``: what :func:`rotate_`
    multiplies by, made once per forward for every block (the incremental pass made a cos and a
    sin per block and projection: 88 kernels of a CosyVoice3 pass, docs/tuning.md §1).
    The sin of each pair's first channel is negated: rotating the pair (x1, x2) to
    (-x2, x1) is then the swapped pair times it, exactly (a negation rounds nothing)."""
    sin = freqs[..., ::2].sin()
    return freqs.cos(), torch.stack((-sin, sin), dim=-1).flatten(-2)


def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of x (..., C) in place, in float32; returns x.

    Five kernels: the pair swap, two products that read x's dtype and compute in the tables'
    float32 (the upcast is exact), their sum, and its copy into x (rounded to x's dtype). Building
    the rotated tensor anew had taken seven (an upcast copy and a downcast one, and a
    concatenation of the whole q or k, since only head 0 turns: the quirk above): 308 kernels of a
    CosyVoice3 incremental pass, 44 rotations of seven (the pass's kernels before and after:
    docs/tuning.md §1). The sum goes in by slice assignment: the ONNX export's tracer dropped
    an ``out=`` sum (one kernel fewer) and a ``copy_`` into the view (tests/runtime/test_flow_onnx.py).
    x may be a view (q or k as a slice of one projection's output)."""
    rot = cos.shape[-1]
    head = x[..., :rot]
    swapped = head.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    x[..., :rot] = head * cos + swapped * signed_sin
    return x


def modulate(normed: torch.Tensor, scale1: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """adaLN: ``normed * (1 + scale) + shift`` per row (normed (B, T, D); scale1 = 1 + scale and
    shift (B, D)) as one kernel (``addcmul``: one rounding where the product and the sum had one
    each; the official code's two kernels agree within it)."""
    return torch.addcmul(shift[:, None], normed, scale1[:, None])


def gated(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """adaLN-zero's residual: ``x + gate * y`` per row (gate (B, D)) as one kernel, as :func:`modulate`."""
    return torch.addcmul(x, gate[:, None], y)


class CausalConvPositionEmbedding(nn.Module):
    def __init__(self, dim: int, kernel: int, groups: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, D), left-padded (causal)."""
        h = x.transpose(1, 2)
        h = self.conv1(F.pad(h, (self.kernel - 1, 0)))
        h = self.conv2(F.pad(h, (self.kernel - 1, 0)))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, spec: DiTSpec) -> None:
        super().__init__()
        self.proj = nn.Linear(spec.mel_dim * 2 + spec.mu_dim + spec.spk_dim, spec.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(spec.dim, spec.conv_pos_kernel, spec.conv_pos_groups)

    def forward(self, x, cond, mu, spks) -> torch.Tensor:
        """Time-major (B, T, 80) x/cond/mu, (B, 80) spks -> (B, T, D). Order: x, cond, mu, spks."""
        h = self.proj(torch.cat([x, cond, mu, spks[:, None].expand(-1, x.shape[1], -1)], dim=-1))
        return self.conv_pos_embed(h) + h


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.time_mlp(sinusoidal_embedding(t, self.freq_dim).to(t.dtype))


class _AdaNorm(nn.Module):
    """``Linear(SiLU(temb))`` -> n chunks; LayerNorm without affine, eps 1e-6."""

    def __init__(self, dim: int, chunks: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * chunks)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)


class Attention(nn.Module):
    def __init__(self, spec: DiTSpec) -> None:
        super().__init__()
        inner = spec.heads * spec.dim_head
        self.heads = spec.heads
        self.to_q = nn.Linear(spec.dim, inner)
        self.to_k = nn.Linear(spec.dim, inner)
        self.to_v = nn.Linear(spec.dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, spec.dim)])
        self._fused: dict = {}  # q/k/v as one weight (cosyvoice_runtime.fused; checkpoint keys unchanged)
        self._fused_kv: dict = {}  # k/v alone, for the incremental pass (DiTBlock.forward_cached)

    def kv(self, x: torch.Tensor) -> torch.Tensor:
        """``cat([to_k(x), to_v(x)], -1)`` as one GEMM (the incremental pass's cached frames)."""
        return fused_linear(x, (self.to_k, self.to_v), self._fused_kv)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x (B, T, D); mask (B, 1, T, T) bool; rotary: :func:`rotary_tables` of the positions."""
        b, t, _ = x.shape
        q, k, v = fused_linear(x, (self.to_q, self.to_k, self.to_v), self._fused).chunk(3, dim=-1)
        q, k = rotate_(q, *rotary), rotate_(k, *rotary)

        def heads(y):
            return y.view(b, t, self.heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask)
        out = self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))
        valid = mask[:, 0, -1, :].unsqueeze(-1)  # the last query row marks the real frames
        return out.masked_fill(~valid, 0.0)


class _GELUTanhFF(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        inner = dim * mult
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")), nn.Identity(),
                                nn.Linear(inner, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, spec: DiTSpec) -> None:
        super().__init__()
        self.attn_norm = _AdaNorm(spec.dim, 6)
        self.attn = Attention(spec)
        self.ff_norm = nn.LayerNorm(spec.dim, elementwise_affine=False, eps=1e-6)
        self.ff = _GELUTanhFF(spec.dim, spec.ff_mult)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, mask: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = self.attn_norm.linear(F.silu(temb)).chunk(6, dim=1)
        x = gated(x, gate_a, self.attn(modulate(self.attn_norm.norm(x), 1 + scale_a, shift_a), mask, rotary))
        return gated(x, gate_f, self.ff(modulate(self.ff_norm(x), 1 + scale_f, shift_f)))

    def forward_cached(self, h: torch.Tensor, bias: torch.Tensor, rot_q: tuple[torch.Tensor, torch.Tensor],
                       rot_k: tuple[torch.Tensor, torch.Tensor], p: Pass) -> torch.Tensor:
        """New frames h (2B, n, D); queries rotated at their positions (``rot_q``), keys (the
        cached frames', then theirs) at theirs (``rot_k``); its modulation is the pass's time
        table line, where (1 + scale) is one column block (``DiT.time_table``)."""
        shift_a, scale1_a, gate_a, shift_f, scale1_f, gate_f = p.timed(self.attn_norm.linear).chunk(6, dim=1)
        normed = modulate(self.attn_norm.norm(h), scale1_a, shift_a)
        normed_all = p.block_input(self, normed)
        attn = self.attn
        b, n, _ = normed.shape
        q = rotate_(attn.to_q(normed), *rot_q)
        k, v = attn.kv(normed_all).chunk(2, dim=-1)
        rotate_(k, *rot_k)

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, y.shape[1], attn.heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=bias[:, None])
        h = gated(h, gate_a, attn.to_out[0](out.transpose(1, 2).reshape(b, n, -1)))
        return gated(h, gate_f, self.ff(modulate(self.ff_norm(h), scale1_f, shift_f)))


class DiT(nn.Module):
    """The estimator: ``forward(x, mask, mu, t, spks, cond, streaming) -> (B, 80, T)``."""

    def __init__(self, spec: DiTSpec) -> None:
        super().__init__()
        self.spec = spec
        self.time_embed = TimestepEmbedding(spec.dim, spec.freq_embed_dim)
        self.input_embed = InputEmbedding(spec)
        self.rotary_embed = RotaryEmbedding(spec.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(spec) for _ in range(spec.depth))
        self.norm_out = _AdaNorm(spec.dim, 2)
        self.proj_out = nn.Linear(spec.dim, spec.out_channels)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        temb = self.time_embed(t)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
        rotary = rotary_tables(self.rotary_embed(h.shape[1]))
        attn = attention_mask(mask, self.spec.static_chunk_size, streaming)[:, None]
        for block in self.transformer_blocks:
            h = block(h, temb, attn, rotary)
        scale, shift = self.norm_out.linear(F.silu(temb)).chunk(2, dim=1)
        h = modulate(self.norm_out.norm(h), 1 + scale, shift)
        return self.proj_out(h).transpose(1, 2)

    # -- the incremental flow's cache-aware forward (cosyvoice_runtime.flow.incremental) --------
    def cached_layout(self) -> Layout:
        """Where a pass's cached state sits: the position embedding's two convolutions, the blocks."""
        pos = self.input_embed.conv_pos_embed
        return make_layout([pos.conv1[0], pos.conv2[0]], list(self.transformer_blocks), self.spec.dim,
                           self.spec.static_chunk_size, self.time_layers())

    def time_layers(self) -> list[nn.Linear]:
        """The layers whose output depends on the ODE time alone, in :meth:`time_table` order:
        each block's modulation, then the output norm's."""
        return [*(block.attn_norm.linear for block in self.transformer_blocks), self.norm_out.linear]

    def time_weights(self) -> list[torch.Tensor]:
        """Every parameter :meth:`time_table` reads."""
        return [*self.time_embed.parameters(), *(w for layer in self.time_layers() for w in layer.parameters())]

    def time_table(self, t: torch.Tensor) -> torch.Tensor:
        """(steps, columns) the :meth:`time_layers` outputs at each ODE time ``t`` (steps,), side by
        side (``Layout.time_offset``): the same ten values in every pass of every request, read
        from this table a pass launches ~50 kernels fewer (22 block modulations). The scale
        columns hold ``1 + scale`` (:meth:`_plus_one_scales`)."""
        act = F.silu(self.time_embed(t))
        return torch.cat([self._plus_one_scales(layer, layer(act)) for layer in self.time_layers()], dim=-1)

    def _plus_one_scales(self, layer: nn.Linear, out: torch.Tensor) -> torch.Tensor:
        """A modulation's output with 1 added to its scale columns: the block multiplies its
        normed input by ``1 + scale``, the same sum in every pass (two adds a block and one at the
        output, 45 kernels of a pass, made once here in the model's dtype, so the products are
        the whole forward's bit for bit)."""
        final = layer is self.norm_out.linear  # [scale, shift]; a block's [shift, scale, gate] x 2
        parts = list(out.chunk(2 if final else 6, dim=-1))
        for i in (0,) if final else (1, 4):
            parts[i] = 1 + parts[i]
        return torch.cat(parts, dim=-1)

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotary angles (rows, T, dim_head) at absolute positions (rows, T), as :class:`RotaryEmbedding` gives them."""
        inv_freq = self.rotary_embed.inv_freq
        freqs = positions.to(inv_freq.dtype)[..., None] * inv_freq
        return torch.stack((freqs, freqs), dim=-1).flatten(-2)

    def forward_cached(self, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                       bias: torch.Tensor, p: Pass) -> torch.Tensor:
        """:meth:`forward` (streaming) of new frames x, mu, cond (2B, 80, n) -> (2B, 80, n) over the
        pass's cached state ``p``; ``bias``: its ``pass_bias``; the ODE time enters through
        ``p.time_rows`` (:meth:`time_table`)."""
        emb = self.input_embed
        h = emb.proj(torch.cat([x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2),
                                spks[:, None].expand(-1, x.shape[-1], -1)], dim=-1))
        pos = emb.conv_pos_embed
        p.load_history()
        c = pos.conv1[1](p.conv_gemm(pos.conv1[0], h))
        h = pos.conv2[1](p.conv_gemm(pos.conv2[0], c)) + h
        p.store_history()
        n = x.shape[-1]
        cached = p.attn.shape[2] - x.shape[-1]
        p_len = p.p_len.repeat(2)
        q_pos = p_len[:, None] + torch.arange(n, device=x.device)[None, :]
        k_pos = torch.cat([torch.arange(cached, device=x.device)[None, :].expand(len(p_len), -1), q_pos], dim=1)
        rot_q, rot_k = rotary_tables(self._angles(q_pos)), rotary_tables(self._angles(k_pos))
        for block in self.transformer_blocks:
            h = block.forward_cached(h, bias, rot_q, rot_k, p)
        scale1, shift = p.timed(self.norm_out.linear).chunk(2, dim=1)
        h = modulate(self.norm_out.norm(h), scale1, shift)
        return self.proj_out(h).transpose(1, 2)
