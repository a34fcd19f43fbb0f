"""Batched vocoding of several requests (``hift.batch``) equals the per-request calls."""
from __future__ import annotations

import functools

import pytest
import torch

from cosyvoice_runtime.hift.batch import causal_decode_batch, vocode_batch
from cosyvoice_runtime.hift.streaming import VocoderStream, vocode_chunk
from tests.runtime.parity.common import load_cases
from tests.runtime.parity.hift_cases import load_hift


@functools.lru_cache(maxsize=1)
def _cases() -> dict:  # loaded on use: test_hift_graphs imports this module on the GPU machine, which has no fixtures
    return {c.family: c for c in load_cases() if c.name == "token2wav_stream"}


TOL = 1e-4


def _mels(family):
    """Three realistic mels of different lengths from the fixture (1, 80, T)."""
    case = _cases()[family]
    calls = case.params["hift_calls"]
    last = case.t(f"hift{len(calls) - 1}_mel") if family == "cosyvoice3" else case.t("flow2_mel")
    return case, [last, last[:, :, 7:120].contiguous(), torch.flip(last, dims=[2])[:, :, :97].contiguous()]


def _split(mel, sizes):
    out, start = [], 0
    for s in sizes:
        out.append(mel[:, :, start:start + s])
        start += s
    out.append(mel[:, :, start:])
    return out


def test_cv3_batched_decode_equals_unbatched():
    case, mels = _mels("cosyvoice3")
    _, hift = load_hift(case.model_dir)
    batched = causal_decode_batch(hift, mels)
    for mel, got in zip(mels, batched):
        ref, _ = hift.inference(mel, finalize=True)
        assert got.shape == ref.shape
        assert float((got - ref).abs().max()) < TOL


@pytest.mark.parametrize("family", ["cosyvoice3", "cosyvoice2"])
def test_streamed_batches_equal_per_request_streams(family):
    case, mels = _mels(family)
    spec, hift = load_hift(case.model_dir)
    schedules = [_split(mels[0], [60, 50]), _split(mels[1], [30, 40]), _split(mels[2], [60, 20])]
    ref_states = [VocoderStream.create(spec, seed=10 + i) for i in range(3)]
    bat_states = [VocoderStream.create(spec, seed=10 + i) for i in range(3)]
    n_calls = len(schedules[0])
    for c in range(n_calls):
        final = c == n_calls - 1
        chunks = [s[c] for s in schedules]
        refs = [vocode_chunk(hift, st, ch, finalize=final) for st, ch in zip(ref_states, chunks)]
        gots = vocode_batch(hift, bat_states, chunks, [final] * 3)
        for r, g in zip(refs, gots):
            assert g.shape == r.shape
            if r.numel():
                assert float((g - r).abs().max()) < TOL
    assert all(st.finished for st in bat_states)
    assert [st.calls for st in bat_states] == [n_calls] * 3


def test_cv3_mixed_final_and_streaming_items():
    case, mels = _mels("cosyvoice3")
    spec, hift = load_hift(case.model_dir)
    a_ref, b_ref = VocoderStream.create(spec), VocoderStream.create(spec)
    a, b = VocoderStream.create(spec), VocoderStream.create(spec)
    ra = vocode_chunk(hift, a_ref, mels[0], finalize=False)
    rb = vocode_chunk(hift, b_ref, mels[2], finalize=True)
    ga, gb = vocode_batch(hift, [a, b], [mels[0], mels[2]], [False, True])
    assert ga.shape == ra.shape == (1, 480 * (mels[0].shape[2] - hift.lag_frames))
    assert gb.shape == rb.shape == (1, 480 * mels[2].shape[2])
    assert float((ga - ra).abs().max()) < TOL and float((gb - rb).abs().max()) < TOL


def test_cv3_incremental_stream_equals_full_recompute():
    from cosyvoice_runtime.hift.incremental import left_context_frames

    case, mels = _mels("cosyvoice3")
    spec, hift = load_hift(case.model_dir)
    assert 30 <= left_context_frames(spec.hift) <= 40
    long_mel = torch.cat([mels[0], mels[2], mels[1]], dim=2)  # 380 frames
    sizes = [20, 5, 30, 17, 60, 11, 90, 50]  # includes chunks shorter than the 8-frame lag
    chunks = _split(long_mel, sizes)
    ref, inc = VocoderStream.create(spec), VocoderStream.create(spec, strategy="incremental")
    ref_out, inc_out = [], []
    for i, ch in enumerate(chunks):
        final = i == len(chunks) - 1
        ref_out.append(vocode_chunk(hift, ref, ch, finalize=final))
        inc_out.append(vocode_chunk(hift, inc, ch, finalize=final))
        assert inc_out[-1].shape == ref_out[-1].shape
    a, b = torch.cat(ref_out, dim=1), torch.cat(inc_out, dim=1)
    assert a.shape[1] == 480 * long_mel.shape[2]
    assert float((a - b).abs().max()) < TOL


def test_cv3_batched_incremental_streams_equal_per_request_recompute():
    """Three incremental streams vocoded together (different lengths and schedules, chunks below
    the lag, a stream that ends early) equal each request's reference full recompute."""
    case, mels = _mels("cosyvoice3")
    spec, hift = load_hift(case.model_dir)
    long_mel = torch.cat([mels[0], mels[2], mels[1]], dim=2)  # 380 frames
    schedules = [_split(long_mel, [20, 5, 30, 17, 60, 11, 90]), _split(mels[1], [3, 30, 40, 1, 12, 6, 10]),
                 _split(mels[2], [60, 20])]
    ref = [VocoderStream.create(spec) for _ in schedules]
    inc = [VocoderStream.create(spec, strategy="incremental") for _ in schedules]
    ref_out, inc_out = [[] for _ in schedules], [[] for _ in schedules]
    for c in range(max(len(s) for s in schedules)):
        live = [k for k, s in enumerate(schedules) if c < len(s)]
        final = [c == len(schedules[k]) - 1 for k in live]
        for k, fin in zip(live, final):
            ref_out[k].append(vocode_chunk(hift, ref[k], schedules[k][c], finalize=fin))
        got = vocode_batch(hift, [inc[k] for k in live], [schedules[k][c] for k in live], final)
        for k, g in zip(live, got):
            assert g.shape == ref_out[k][-1].shape, (c, k)
            inc_out[k].append(g)
    for k, mel in enumerate([long_mel, mels[1], mels[2]]):
        a, b = torch.cat(ref_out[k], dim=1), torch.cat(inc_out[k], dim=1)
        assert a.shape[1] == 480 * mel.shape[2] and float((a - b).abs().max()) < TOL, k
    assert all(st.finished for st in inc)


def test_cv3_a_batch_may_mix_strategies():
    case, mels = _mels("cosyvoice3")
    spec, hift = load_hift(case.model_dir)
    pairs = [(VocoderStream.create(spec), VocoderStream.create(spec)),
             (VocoderStream.create(spec), VocoderStream.create(spec, strategy="incremental"))]
    for fin in (False, True):
        chunks = [mels[0][:, :, :60], mels[2][:, :, :60]] if not fin else [mels[0][:, :, 60:], mels[2][:, :, 60:]]
        refs = [vocode_chunk(hift, r, ch, finalize=fin) for (r, _), ch in zip(pairs, chunks)]
        gots = vocode_batch(hift, [b for _, b in pairs], chunks, [fin, fin])
        for r, g in zip(refs, gots):
            assert g.shape == r.shape and float((g - r).abs().max()) < TOL
