"""Attention masks shared by the flow encoder and estimators (boolean, True = may attend)."""
from __future__ import annotations

import torch


def chunk_mask(size: int, chunk: int, device: torch.device) -> torch.Tensor:
    """(T, T) block-causal mask: position i sees j iff j < (i // chunk + 1) * chunk.

    Chunks are counted from position 0 of the whole sequence (prompt included).
    """
    limit = (torch.arange(size, device=device) // chunk + 1) * chunk
    return torch.arange(size, device=device)[None, :] < limit[:, None]


def attention_mask(pad_mask: torch.Tensor, chunk: int, streaming: torch.Tensor | bool = True) -> torch.Tensor:
    """(B, T, T) mask from a (B, 1, T) padding mask: padding keys hidden, plus chunks if > 0.

    ``streaming`` (bool or (B,) bool) selects per row whether the chunk mask applies, so
    streaming and final/offline items can share one batch.

    Rows that would see no key at all (a padded query in a chunk of padding) are made all-true,
    as the official helper does, so softmax never sees an empty row.
    """
    keys = pad_mask.bool()
    t = keys.shape[-1]
    m = keys.expand(-1, t, -1)
    if chunk > 0:
        chunked = m & chunk_mask(t, chunk, keys.device)[None]
        if isinstance(streaming, torch.Tensor):
            m = torch.where(streaming.to(keys.device).view(-1, 1, 1), chunked, m)
        elif streaming:
            m = chunked
    empty = ~m.any(dim=-1, keepdim=True)
    return m | empty


def to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask -> additive bias ``(1 - m) * -1e10`` in ``dtype`` (-inf in fp16)."""
    return (1.0 - mask.to(dtype)) * -1.0e10
