"""One estimator pass over new frames only, both families (:mod:`cosyvoice_runtime.flow.incremental`).

A pass runs the estimator (CosyVoice2's :class:`~cosyvoice_runtime.flow.unet.CausalUNet` or
CosyVoice3's :class:`~cosyvoice_runtime.flow.dit.DiT`) over the new frames of several rows at
once (both CFG halves: rows ``i`` and ``B + i``), reading what earlier frames left:

* each causal convolution reads its row's last ``hist`` input frames before the new ones
  (U-Net: k=3, 2 frames; DiT position embedding: k=31, 30 frames) and records the ``hist``
  frames before the row's kept end and before its mark;
* each attention block reads its row's cached normed inputs (keys and values are recomputed from
  them, one GEMM) and records its new frames' normed inputs;
* keys are the row's cached frames then its new ones; :func:`pass_bias` masks padding and later
  chunks per row. The DiT's rotary angles are taken at each frame's absolute position.

Every estimator activation of a valid new frame is then the full forward's, up to GEMM rounding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_runtime.flow.dit import DiT, DiTBlock, gated, modulate, rotary_tables, rotate_
from cosyvoice_runtime.flow.masks import to_bias
from cosyvoice_runtime.flow.unet import (
    CausalBlock1D,
    CausalResnetBlock1D,
    CausalUNet,
    TransformerBlock,
    sinusoidal_embedding,
)
from cosyvoice_runtime.fused import causal_conv_gemm
from cosyvoice_runtime.kernels import add_layer_norm


@dataclass(frozen=True)
class Layout:
    """Where an estimator's cached state sits: causal convolutions by channel offset in one
    (rows, channels, hist) tensor, attention blocks by index in one (blocks, rows, frames, dim) tensor."""

    conv_offset: dict  # id(conv) -> first channel
    conv_channels: int
    hist: int  # input frames a convolution reads before the new ones (kernel - 1)
    block_index: dict  # id(block) -> index
    dim: int
    chunk: int  # attention chunk in mel frames
    time_offset: dict = field(default_factory=dict)  # id(layer) -> first column of its output in the time table

    @property
    def n_blocks(self) -> int:
        return len(self.block_index)


def _make_layout(convs: list[nn.Conv1d], blocks: list[nn.Module], dim: int, chunk: int,
                 time_layers: list[nn.Linear]) -> Layout:
    hist = {c.kernel_size[0] - 1 for c in convs}
    if len(hist) != 1 or any(c.padding != (0,) and c.padding != 0 for c in convs):
        raise ValueError("the incremental flow expects unpadded causal convolutions of one kernel size")
    offsets, total = {}, 0
    for conv in convs:
        offsets[id(conv)] = total
        total += conv.in_channels
    columns, column = {}, 0
    for layer in time_layers:
        columns[id(layer)] = column
        column += layer.out_features
    return Layout(offsets, total, hist.pop(), {id(b): i for i, b in enumerate(blocks)}, dim, chunk, columns)


def layout_of(estimator: nn.Module) -> Layout:
    """The cached-state layout of a U-Net or DiT estimator."""
    if isinstance(estimator, DiT):
        pos = estimator.input_embed.conv_pos_embed
        return _make_layout([pos.conv1[0], pos.conv2[0]], list(estimator.transformer_blocks), estimator.spec.dim,
                            estimator.spec.static_chunk_size, time_layers(estimator))
    if not isinstance(estimator, CausalUNet):
        raise TypeError(f"no incremental pass for {type(estimator).__name__}")
    convs: list[nn.Conv1d] = []
    blocks: list[TransformerBlock] = []

    def stage(resnet: CausalResnetBlock1D, tblocks: nn.ModuleList) -> None:
        convs.extend([resnet.block1.block[0], resnet.block2.block[0]])
        blocks.extend(tblocks)

    resnet, tblocks, down = estimator.down_blocks[0]
    stage(resnet, tblocks)
    convs.append(down)
    for resnet, tblocks in estimator.mid_blocks:
        stage(resnet, tblocks)
    resnet, tblocks, up = estimator.up_blocks[0]
    stage(resnet, tblocks)
    convs += [up, estimator.final_block.block[0]]
    return _make_layout(convs, blocks, estimator.spec.channels[0], estimator.spec.static_chunk_size,
                        time_layers(estimator))


def pass_bias(p_len: torch.Tensor, n_len: torch.Tensor, cached: int, new: int, chunk: int,
              dtype: torch.dtype) -> torch.Tensor:
    """(2B, new, cached + new) additive attention bias of a pass (both CFG halves).

    Keys are laid out as the row's cached frames (the first ``p_len`` of ``cached`` valid) then its
    new frames (the first ``n_len`` of ``new`` valid). A valid query at absolute frame ``P + q``
    sees every cached frame and the new frames before the end of its attention chunk; a padded
    query sees only its row's first new frame (finite, never read).
    """
    dev = p_len.device
    q = torch.arange(new, device=dev)
    pos = p_len[:, None] + q[None, :]  # (B, new) absolute frame of query / new key j
    limit = (pos // chunk + 1) * chunk
    new_ok = (q[None, None, :] < n_len[:, None, None]) & (pos[:, None, :] < limit[:, :, None])
    cached_ok = (torch.arange(cached, device=dev)[None, :] < p_len[:, None])[:, None, :].expand(-1, new, -1)
    allowed = torch.cat([cached_ok, new_ok], dim=-1)
    padded_query = (q[None, :] >= n_len[:, None])[:, :, None]
    # A comparison, not `first_new[cached] = True`: item assignment copies a host scalar, which a
    # CUDA graph capture refuses.
    first_new = torch.arange(cached + new, device=dev) == cached
    allowed = torch.where(padded_query, first_new, allowed)
    return to_bias(allowed, dtype).repeat(2, 1, 1)


class Pass:
    """The cached state one pass reads and writes (static buffers of a bucket).

    Args:
        hist_in: (2B, channels, hist) each row's convolution history; hist_out: (2B, channels,
            2 hist), filled with the history at the row's kept end, then at its mark.
        hist_idx: (2B, 1, 2 hist) long: the frames of ``[history, new]`` that history is.
        attn: (blocks, 2B, cached + new, dim) normed block inputs: the cached frames', then the new
            frames' (filled by the pass); how many are new is the pass's input length.
        p_len: (B,) long cached frames per row (the DiT's rotary positions start there).
        time_rows: (2B, columns) each row's line of the :func:`time_table` (what depends on its ODE time alone).
        conv_frames: (2B, hist + new, channels) the channels-last convolution inputs, every
            convolution's by its channel offset, behind the rows' history (:meth:`conv_gemm`).
        fused_norms: the U-Net's residual adds, LayerNorms and cache-slot writes as one Triton
            kernel each (:func:`~cosyvoice_runtime.kernels.add_layer_norm`) where it can run.
    """

    def __init__(self, layout: Layout, hist_in: torch.Tensor, hist_out: torch.Tensor, hist_idx: torch.Tensor,
                 attn: torch.Tensor, p_len: torch.Tensor, time_rows: torch.Tensor, conv_frames: torch.Tensor,
                 fused_norms: bool = False) -> None:
        self.layout, self.hist_in, self.hist_out, self.hist_idx = layout, hist_in, hist_out, hist_idx
        self.attn, self.p_len, self.time_rows, self.conv_frames = attn, p_len, time_rows, conv_frames
        self.fused_norms = fused_norms

    # The convolutions (the U-Net's 31, the DiT's two) read and record their history through
    # :attr:`conv_frames`: one copy in and one gather out for all of them, where each
    # convolution's own concatenation, gather and write were three kernels.
    def load_history(self) -> None:
        """Before the first convolution: every row's history in front of the new frames."""
        self.conv_frames[:, :self.layout.hist] = self.hist_in.transpose(1, 2)

    def conv_gemm(self, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        """A causal convolution of channels-last new frames x (2B, n, C) -> (2B, n, C_out) behind
        the history :meth:`load_history` put in the frame buffer, as GEMMs
        (:func:`~cosyvoice_runtime.fused.causal_conv_gemm`); its history is left for :meth:`store_history`."""
        c, hist = x.shape[-1], self.layout.hist
        off = self.layout.conv_offset[id(conv)]
        full = self.conv_frames[:, :, off:off + c]
        full[:, hist:] = x
        return causal_conv_gemm(full, conv)

    def store_history(self) -> None:
        """After the last convolution: the history at each row's kept end and mark."""
        idx = self.hist_idx.view(-1, 2 * self.layout.hist, 1).expand(-1, -1, self.conv_frames.shape[-1])
        self.hist_out.copy_(self.conv_frames.gather(1, idx).transpose(1, 2))

    def timed(self, layer: nn.Linear) -> torch.Tensor:
        """(2B, out features) a :func:`time_layers` layer's output for the rows' ODE times."""
        off = self.layout.time_offset[id(layer)]
        return self.time_rows[:, off:off + layer.out_features]

    def block_slot(self, block: nn.Module, n: int) -> torch.Tensor:
        """(2B, n, D) where a block's new frames' normed inputs go, behind its cached ones."""
        return self.attn[self.layout.block_index[id(block)], :, -n:]

    def block_frames(self, block: nn.Module) -> torch.Tensor:
        """(2B, cached + n, D) a block's normed inputs, cached then new (its keys and values)."""
        return self.attn[self.layout.block_index[id(block)]]

    def block_input(self, block: nn.Module, normed: torch.Tensor) -> torch.Tensor:
        """Record the new frames' normed input (2B, n, D) of an attention block behind its cached
        ones; all of them, cached then new (a view: nothing copied but the new frames)."""
        self.block_slot(block, normed.shape[1]).copy_(normed)
        return self.block_frames(block)


def _unet_attention(block: TransformerBlock, h: torch.Tensor, normed: torch.Tensor, bias: torch.Tensor, p: Pass,
                    following: TransformerBlock | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A transformer block over new frames h (2B, n, C), given their normed input (already in the
    block's cache slot). Returns the block's output and, when a ``following`` block comes, that
    output normed for it (and in its slot)."""
    attn = block.attn1
    b, n, _ = h.shape
    q = attn.to_q(normed).view(b, n, attn.heads, attn.head_dim).transpose(1, 2)
    kv = attn.kv(p.block_frames(block))
    k, v = kv.view(b, -1, 2, attn.heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None])
    h, normed = add_layer_norm(h, attn.to_out[0](out.transpose(1, 2).reshape(b, n, -1)), block.norm3,
                               fused=p.fused_norms)
    ff = block.ff(normed)
    if following is None:
        return h + ff, None
    return add_layer_norm(h, ff, following.norm1, slot=p.block_slot(following, n), fused=p.fused_norms)


# The U-Net walk keeps its activations channels-last, (2B, n, C), as the transformer blocks take
# them: the LayerNorms over channels then read contiguous rows, the convolutions are GEMMs
# (Pass.conv_gemm), the 1x1 convolutions plain linear layers, and no block copies its input into
# or out of a transposed layout. With the frame buffer and the time table: 926 kernels a pass
# instead of 1,173, and a pass at batch 1 is the launches of its kernels in sequence (the kernel
# profiles of the old and new walk: bench/results/INDEX.md, "Kernel and first-audio profiles").
def _block(block: CausalBlock1D, x: torch.Tensor, p: Pass) -> torch.Tensor:
    conv, _, norm, _, mish = block.block
    return mish(norm(p.conv_gemm(conv, x)))


def _pointwise(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """A 1x1 convolution of channels-last frames."""
    return F.linear(x, conv.weight[:, :, 0], conv.bias)


def _resnet(resnet: CausalResnetBlock1D, x: torch.Tensor, p: Pass) -> torch.Tensor:
    h = _block(resnet.block1, x, p) + p.timed(resnet.mlp[1])[:, None, :]
    return _block(resnet.block2, h, p) + _pointwise(resnet.res_conv, x)


def _attend(x: torch.Tensor, blocks: nn.ModuleList, bias: torch.Tensor, p: Pass) -> torch.Tensor:
    """A stage's transformer blocks. Each LayerNorm is taken with the residual add before it and
    its output also written into the block's cache slot (:func:`add_layer_norm`: one kernel for
    the three with ``fused_norms``, where they were three)."""
    _, normed = add_layer_norm(x, None, blocks[0].norm1, slot=p.block_slot(blocks[0], x.shape[1]),
                               fused=p.fused_norms)
    for i, block in enumerate(blocks):
        x, normed = _unet_attention(block, x, normed, bias, p, blocks[i + 1] if i + 1 < len(blocks) else None)
    return x


def time_layers(estimator: nn.Module) -> list[nn.Linear]:
    """The layers whose output depends on the ODE time alone, in :func:`time_table` order: each
    U-Net resnet's time projection; each DiT block's modulation, then the output norm's."""
    if isinstance(estimator, DiT):
        return [*(block.attn_norm.linear for block in estimator.transformer_blocks), estimator.norm_out.linear]
    return [resnet.mlp[1] for resnet in _resnets(estimator)]


def time_weights(estimator: nn.Module) -> list[torch.Tensor]:
    """Every parameter :func:`time_table` reads."""
    embed = estimator.time_embed if isinstance(estimator, DiT) else estimator.time_mlp
    return [*embed.parameters(), *(p for layer in time_layers(estimator) for p in layer.parameters())]


def time_table(estimator: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """(steps, columns) the :func:`time_layers` outputs at each ODE time ``t`` (steps,), side by
    side (:attr:`Layout.time_offset`). They depend on the time alone, the same ten values in every
    pass of every request: read from this table, a pass launches ~40 (U-Net: sinusoid, time MLP,
    14 resnet projections) or ~50 (DiT: 22 block modulations) kernels fewer. The DiT's scale
    columns hold ``1 + scale`` (:func:`_plus_one_scales`)."""
    if isinstance(estimator, DiT):
        act = F.silu(estimator.time_embed(t))
        outs = [_plus_one_scales(estimator, layer, layer(act)) for layer in time_layers(estimator)]
    else:  # a resnet's mlp is Mish then its projection
        act = F.mish(estimator.time_mlp(sinusoidal_embedding(t, estimator.spec.in_channels).to(t.dtype)))
        outs = [layer(act) for layer in time_layers(estimator)]
    return torch.cat(outs, dim=-1)


def _plus_one_scales(dit: DiT, layer: nn.Linear, out: torch.Tensor) -> torch.Tensor:
    """A DiT modulation's output with 1 added to its scale columns: the block multiplies its
    normed input by ``1 + scale``, the same sum in every pass (two adds a block and one at the
    output, 45 kernels of a pass, made once here in the model's dtype, so the products are
    the whole forward's bit for bit)."""
    final = layer is dit.norm_out.linear  # [scale, shift]; a block's [shift, scale, gate] x 2
    parts = list(out.chunk(2 if final else 6, dim=-1))
    for i in (0,) if final else (1, 4):
        parts[i] = 1 + parts[i]
    return torch.cat(parts, dim=-1)


def _resnets(unet: CausalUNet) -> list[CausalResnetBlock1D]:
    """The U-Net's resnets in walk order (down, mid, up)."""
    return [unet.down_blocks[0][0], *(mid[0] for mid in unet.mid_blocks), unet.up_blocks[0][0]]


def unet_pass(unet: CausalUNet, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
              cond: torch.Tensor, bias: torch.Tensor, p: Pass) -> torch.Tensor:
    """:meth:`CausalUNet.forward` (streaming) of new frames x, mu, cond (2B, 80, n) -> (2B, 80, n);
    the ODE time enters through ``p.time_rows`` (:func:`time_table`)."""
    h = torch.cat([x.transpose(1, 2), mu.transpose(1, 2), spks[:, None, :].expand(-1, x.shape[-1], -1),
                   cond.transpose(1, 2)], dim=-1)
    p.load_history()
    resnet, blocks, down = unet.down_blocks[0]
    h = _attend(_resnet(resnet, h, p), blocks, bias, p)
    skip = h
    h = p.conv_gemm(down, h)
    for resnet, blocks in unet.mid_blocks:
        h = _attend(_resnet(resnet, h, p), blocks, bias, p)
    resnet, blocks, up = unet.up_blocks[0]
    h = torch.cat([h, skip], dim=-1)
    h = p.conv_gemm(up, _attend(_resnet(resnet, h, p), blocks, bias, p))
    h = _block(unet.final_block, h, p)
    p.store_history()
    return _pointwise(unet.final_proj, h).transpose(1, 2)


def _dit_block(block: DiTBlock, h: torch.Tensor, bias: torch.Tensor, rot_q: tuple[torch.Tensor, torch.Tensor],
               rot_k: tuple[torch.Tensor, torch.Tensor], p: Pass) -> torch.Tensor:
    # (1 + scale) comes from the table as one column block (time_table)
    shift_a, scale1_a, gate_a, shift_f, scale1_f, gate_f = p.timed(block.attn_norm.linear).chunk(6, dim=1)
    normed = modulate(block.attn_norm.norm(h), scale1_a, shift_a)
    normed_all = p.block_input(block, normed)
    attn = block.attn
    b, n, _ = normed.shape
    q = rotate_(attn.to_q(normed), *rot_q)
    k, v = attn.kv(normed_all).chunk(2, dim=-1)
    rotate_(k, *rot_k)

    def heads(y: torch.Tensor) -> torch.Tensor:
        return y.reshape(b, y.shape[1], attn.heads, -1).transpose(1, 2)

    out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=bias[:, None])
    h = gated(h, gate_a, attn.to_out[0](out.transpose(1, 2).reshape(b, n, -1)))
    return gated(h, gate_f, block.ff(modulate(block.ff_norm(h), scale1_f, shift_f)))


def _angles(dit: DiT, positions: torch.Tensor) -> torch.Tensor:
    """Rotary angles (rows, T, dim_head) at absolute positions (rows, T), as RotaryEmbedding gives them."""
    inv_freq = dit.rotary_embed.inv_freq
    freqs = positions.to(inv_freq.dtype)[..., None] * inv_freq
    return torch.stack((freqs, freqs), dim=-1).flatten(-2)


def dit_pass(dit: DiT, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
             cond: torch.Tensor, bias: torch.Tensor, p: Pass) -> torch.Tensor:
    """:meth:`DiT.forward` (streaming) of new frames x, mu, cond (2B, 80, n) -> (2B, 80, n); the
    ODE time enters through ``p.time_rows`` (:func:`time_table`)."""
    emb = dit.input_embed
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
    rot_q, rot_k = rotary_tables(_angles(dit, q_pos)), rotary_tables(_angles(dit, k_pos))
    for block in dit.transformer_blocks:
        h = _dit_block(block, h, bias, rot_q, rot_k, p)
    scale1, shift = p.timed(dit.norm_out.linear).chunk(2, dim=1)
    h = modulate(dit.norm_out.norm(h), scale1, shift)
    return dit.proj_out(h).transpose(1, 2)


def plain_estimator(estimator: nn.Module) -> nn.Module:
    """The estimator module itself where mode torchscript wrapped it in ``torch.compile``: the
    incremental pass walks its blocks (and compiles the walk instead, :class:`IncrementalStepper`).
    The wrapper is no ``CausalUNet`` or ``DiT``, so the flow took it for a TensorRT engine and
    solved every streamed chunk by recomputing, without a word."""
    return getattr(estimator, "_orig_mod", estimator)


def estimator_pass(estimator: nn.Module, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
                   cond: torch.Tensor, bias: torch.Tensor, p: Pass) -> torch.Tensor:
    """The pass of either family's estimator (see :func:`unet_pass`, :func:`dit_pass`)."""
    walk = dit_pass if isinstance(estimator, DiT) else unet_pass
    return walk(estimator, x, mu, spks, cond, bias, p)
