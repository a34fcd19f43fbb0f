"""Batched vocoding of several requests' chunks in one call (spec §6.2 D).

CV3 (causal): the items' accumulated mels are right-padded with zeros to the longest. Every layer
is causal except the two look-ahead convs, whose zero padding past an item's end is exactly what
the item's own finalize run sees, so the batched f0, source and body equal the per-item ones on
each item's valid frames. The two places that look at an item's *end* are done per item: the
centred STFT of the source (reflect padding at the end) and the iSTFT (overlap-add envelope at
the end). Non-final items are cut to ``480·(T - lag)`` samples (spec §5.4 equivalence). Streams
in the "incremental" strategy batch the same way over their windows (new frames + bounded left
context).

CV2 (non-causal): padding would change the last tens of frames of a shorter item, so items are
grouped by input length and each group is one exact batch; the random source stays per item
(each request's own generator, cache overwrite and optional recorded source).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cosyvoice_runtime.hift.incremental import emit, plan_window, window_source
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


def decode_padded(hift, mel: torch.Tensor, lengths: Sequence[int],
                  sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CV3 finalize-mode decode of right-padded mels (B, 80, max T) with each item's own source
    (1, 1, 480·T_i): [(1, 480·T_i)]. Body batched; source STFT and iSTFT per item (their ends)."""
    frames_per_mel = hift.samples_per_frame // hift.hop
    n_frames = frames_per_mel * mel.shape[2] + 1
    stft = [F.pad(hift.source_stft(src), (0, n_frames - frames_per_mel * t - 1))
            for src, t in zip(sources, lengths)]
    head = hift.body(hift.conv_pre(mel), torch.cat(stft, dim=0))
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


@torch.inference_mode()
def incremental_decode_batch(hift, states: Sequence[VocoderStream], finalize: Sequence[bool]) -> list[torch.Tensor]:
    """:func:`~cosyvoice_runtime.hift.incremental.incremental_vocode` of several CV3 streams
    (mels already accumulated) in one f0 batch and one body batch. Each item's window starts at
    its own frame and is right-padded; as in :func:`causal_decode_batch` the zero padding past an
    item's end is what its own finalize-mode window sees."""
    wins = [plan_window(hift, st, fin) for st, fin in zip(states, finalize)]
    run = [i for i, w in enumerate(wins) if w is not None]
    outs = [st.mel.new_zeros(1, 0) for st in states]
    if not run:
        return outs
    f0_in, _ = pad_mels([states[i].mel[:, :, wins[i].fa:] for i in run])
    f0 = hift.f0(f0_in, finalize=True).float()
    sources = []
    for k, i in enumerate(run):
        w = wins[i]  # the f0 rows start at w.fa; the window's source starts at w.a
        sources.append(window_source(hift, states[i], w, f0[k:k + 1, w.a - w.fa: w.total - w.fa], finalize[i]))
    mel, lengths = pad_mels([states[i].mel[:, :, wins[i].a:] for i in run])
    for i, speech in zip(run, decode_padded(hift, mel, lengths, sources)):
        outs[i] = emit(states[i], wins[i], speech)
    return outs


@torch.inference_mode()
def vocode_batch(hift, states: Sequence[VocoderStream], mel_chunks: Sequence[torch.Tensor],
                 finalize: Sequence[bool], generators: Sequence[torch.Generator | None] | None = None,
                 source_overrides: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """Batched :func:`~cosyvoice_runtime.hift.streaming.vocode_chunk` over several requests.

    Each item is one request's chunk (states must be distinct); returns each item's samples to
    emit, (1, n_i), exactly as the unbatched calls would (CV3: per item its stream's strategy).
    """
    n = len(states)
    if not (len(mel_chunks) == len(finalize) == n) or len({id(s) for s in states}) != n:
        raise ValueError("one mel chunk and finalize flag per distinct request state")
    generators = generators or [None] * n
    source_overrides = source_overrides or [None] * n
    for st in states:
        if st.finished:
            raise RuntimeError("vocoder stream already finalized")
    outs: list[torch.Tensor | None] = [None] * n
    if states[0].causal:
        full = [cv3_accumulate(st, m) for st, m in zip(states, mel_chunks)]
        inc = [i for i in range(n) if states[i].strategy == "incremental"]
        for i, out in zip(inc, incremental_decode_batch(hift, [states[i] for i in inc], [finalize[i] for i in inc])):
            outs[i] = out
        run = [i for i in range(n) if states[i].strategy == "recompute"
               and (finalize[i] or full[i].shape[2] > hift.lag_frames)]
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
