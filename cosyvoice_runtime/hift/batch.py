"""Batched vocoding of several requests' chunks in one call (spec §6.2 D).

CV3 (causal): the items' accumulated mels are right-padded with zeros to the longest. Every layer
is causal except the two look-ahead convs, whose zero padding past an item's end is exactly what
the item's own finalize run sees, so the batched f0, source and body equal the per-item ones on
each item's valid frames. The two places that look at an item's *end* are done per item: the
centred STFT of the source (reflect padding at the end) and the iSTFT (overlap-add envelope at
the end). Non-final items are cut to ``480·(T - lag)`` samples (spec §5.4 equivalence).

CV2 (non-causal): padding would change the last tens of frames of a shorter item, so items are
grouped by input length and each group is one exact batch; the random source stays per item
(each request's own generator, cache overwrite and optional recorded source).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cosyvoice_runtime.hift.streaming import (
    VocoderStream,
    cv2_finish,
    cv2_prepare,
    cv2_source,
    cv3_accumulate,
    cv3_emit,
)


def pad_mels(mels: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """[(1, C, T_i)] -> (B, C, max T) zero right-padded, and the lengths."""
    lengths = [int(m.shape[2]) for m in mels]
    out = mels[0].new_zeros(len(mels), mels[0].shape[1], max(lengths))
    for i, m in enumerate(mels):
        out[i, :, : lengths[i]] = m[0]
    return out, lengths


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
    frames_per_mel = spf // hift.hop
    mel, lengths = pad_mels(mels)
    source = hift.source(hift.f0(mel, finalize=True))  # (B, 1, 480·T)
    n_frames = frames_per_mel * mel.shape[2] + 1
    stft = [F.pad(hift.source_stft(source[i:i + 1, :, : spf * t]), (0, n_frames - frames_per_mel * t - 1))
            for i, t in enumerate(lengths)]
    head = hift.body(hift.conv_pre(mel), torch.cat(stft, dim=0))
    limit = hift.spec.audio_limit
    return [torch.clamp(hift.istft(head[i:i + 1, :, : frames_per_mel * t + 1]), -limit, limit)
            for i, t in enumerate(lengths)]


@torch.inference_mode()
def vocode_batch(hift, states: Sequence[VocoderStream], mel_chunks: Sequence[torch.Tensor],
                 finalize: Sequence[bool], generators: Sequence[torch.Generator | None] | None = None,
                 source_overrides: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """Batched :func:`~cosyvoice_runtime.hift.streaming.vocode_chunk` over several requests.

    Each item is one request's chunk (states must be distinct); returns each item's samples to
    emit, (1, n_i), exactly as the unbatched calls would (CV3 "recompute" strategy semantics).
    """
    n = len(states)
    if not (len(mel_chunks) == len(finalize) == n) or len({id(s) for s in states}) != n:
        raise ValueError("one mel chunk and finalize flag per distinct request state")
    generators = generators or [None] * n
    source_overrides = source_overrides or [None] * n
    for st in states:
        if st.finished:
            raise RuntimeError("vocoder stream already finalized")
        if st.causal and st.strategy != "recompute":
            raise ValueError("batched vocoding implements the 'recompute' strategy only")
    outs: list[torch.Tensor | None] = [None] * n
    if states[0].causal:
        full = [cv3_accumulate(st, m) for st, m in zip(states, mel_chunks)]
        run = [i for i in range(n) if finalize[i] or full[i].shape[2] > hift.lag_frames]
        speech = causal_decode_batch(hift, [full[i] for i in run]) if run else []
        for i, sp in zip(run, speech):
            outs[i] = cv3_emit(hift, states[i], sp, full[i].shape[2], finalize[i])
        for i in range(n):
            if outs[i] is None:
                outs[i] = full[i].new_zeros(1, 0)
    else:
        inputs = [cv2_prepare(st, m) for st, m in zip(states, mel_chunks)]
        groups: dict[int, list[int]] = defaultdict(list)
        for i, x in enumerate(inputs):
            groups[int(x.shape[2])].append(i)
        for idx in groups.values():
            mel = torch.cat([inputs[i] for i in idx], dim=0)
            f0 = hift.f0(mel)
            sources = [cv2_source(hift, states[i], f0[k:k + 1], generators[i], source_overrides[i])
                       for k, i in enumerate(idx)]
            speech = hift.decode(mel, torch.cat(sources, dim=0))
            for k, i in enumerate(idx):
                outs[i] = cv2_finish(states[i], inputs[i], speech[k:k + 1], sources[k], finalize[i])
    for st, fin in zip(states, finalize):
        st.calls += 1
        st.finished = fin
    return outs
