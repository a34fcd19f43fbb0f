"""Finalize-mode decoding of several CV3 mels of different lengths in one batch (spec §6.2 D).

The mels are right-padded with zeros to the longest. Every layer of the causal vocoder is causal
except the two look-ahead convs, whose zero padding past an item's end is exactly what the item's
own finalize run sees, so the batched f0, source and body equal the per-item ones on each item's
valid frames. The two places that look at an item's *end* are done per item: the centred STFT of
the source (reflect padding at the end) and the iSTFT (overlap-add envelope at the end).

The streaming strategies that use these (``cv3_recompute`` over whole accumulated mels,
``cv3_incremental`` over windows) are in :mod:`cosyvoice_runtime.hift.streaming`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def pad_mels(mels: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """[(1, C, T_i)] -> (B, C, max T) zero right-padded, and the lengths."""
    lengths = [int(m.shape[2]) for m in mels]
    out = mels[0].new_zeros(len(mels), mels[0].shape[1], max(lengths))
    for i, m in enumerate(mels):
        out[i, :, : lengths[i]] = m[0]
    return out, lengths


def decode_padded(hift, mel: torch.Tensor, lengths: Sequence[int],
                  sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CV3 finalize-mode decode of right-padded mels (B, 80, max T) with each item's own source
    (1, 1, 480·T_i): [(1, 480·T_i)]. Body batched; source STFT and iSTFT per item (their ends)."""
    frames_per_mel = hift.samples_per_frame // hift.hop
    n_frames = frames_per_mel * mel.shape[2] + 1
    stft = [F.pad(hift.source_stft(src), (0, n_frames - frames_per_mel * t - 1))
            for src, t in zip(sources, lengths)]
    stft = torch.cat(stft, dim=0)
    # the CUDA graphs of the body per padded bucket where a replica turned them on (causal_graphs)
    graphed = hift.graphed_body
    head = graphed(mel, stft) if graphed is not None else hift.body(hift.conv_pre(mel), stft)
    limit = hift.spec.audio_limit
    return [torch.clamp(hift.istft(head[i:i + 1, :, : frames_per_mel * t + 1]), -limit, limit)
            for i, t in enumerate(lengths)]


@torch.inference_mode()
def causal_decode_batch(hift, mels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CV3 finalize-mode vocoding of several mels at once.

    Args:
        hift: a ``CausalHiFTGenerator``.
        mels: (1, 80, T_i) each.

    Returns:
        [(1, 480·T_i)] equal (within float noise) to ``hift.inference(mel_i, finalize=True)[0]``.
    """
    spf = hift.samples_per_frame
    mel, lengths = pad_mels(mels)
    source = hift.source(hift.f0(mel, finalize=True))  # (B, 1, 480·T)
    return decode_padded(hift, mel, lengths, [source[i:i + 1, :, : spf * t] for i, t in enumerate(lengths)])
