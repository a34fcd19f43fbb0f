"""The cached state of one incremental estimator pass, both families (:mod:`cosyvoice_runtime.flow.incremental`).

A pass runs an estimator's cache-aware forward (``forward_cached`` of CosyVoice2's
:class:`~cosyvoice_runtime.flow.unet.CausalUNet` or CosyVoice3's :class:`~cosyvoice_runtime.flow.dit.DiT`,
beside its full ``forward``, block by block) over the new frames of several rows at once (both
CFG halves: rows ``i`` and ``B + i``), reading what earlier frames left through a :class:`Pass`:

* each causal convolution reads its row's last ``hist`` input frames before the new ones
  (U-Net: k=3, 2 frames; DiT position embedding: k=31, 30 frames) and records the ``hist``
  frames before the row's kept end and before its mark;
* each attention block reads its row's cached normed inputs (keys and values are recomputed from
  them, one GEMM) and records its new frames' normed inputs;
* keys are the row's cached frames then its new ones; :func:`pass_bias` masks padding and later
  chunks per row. The DiT's rotary angles are taken at each frame's absolute position;
* what depends on the ODE time alone comes from the estimator's ``time_table``, one line per row.

Every estimator activation of a valid new frame is then the full forward's, up to GEMM rounding.
Where the state sits is the estimator's :class:`Layout` (``cached_layout()``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from cosyvoice_runtime.flow.masks import to_bias
from cosyvoice_runtime.fused import causal_conv_gemm


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


def make_layout(convs: list[nn.Conv1d], blocks: list[nn.Module], dim: int, chunk: int,
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
        time_rows: (2B, columns) each row's line of the estimator's ``time_table`` (what depends
            on its ODE time alone).
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
        """(2B, out features) the output of one of the estimator's ``time_layers()`` for the rows' ODE times."""
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


def plain_estimator(estimator: nn.Module) -> nn.Module:
    """The estimator module itself where mode torchscript wrapped it in ``torch.compile``: the
    incremental pass runs its cache-aware forward (and compiles that instead, ``IncrementalStepper``).
    The wrapper is no ``CausalUNet`` or ``DiT``, so the flow took it for a TensorRT engine and
    solved every streamed chunk by recomputing, without a word."""
    return getattr(estimator, "_orig_mod", estimator)
