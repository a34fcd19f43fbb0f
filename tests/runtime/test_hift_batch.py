"""Batched vocoding of several requests (``hift.streaming.vocode_batch``).

A single request is a batch of one through the same code, so "batched equals unbatched" is checked
as a batch of N against N batches of one, and each against a reference outside our streaming glue:
the official vocoder call per chunk (CV3: ``hift.inference`` over the accumulated mel, non-final
calls in the official non-final mode) or the recorded fixtures (CV2, whose source is random).
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.hift.batch import causal_decode_batch
from cosyvoice_runtime.hift.causal_graphs import graph_causal_body
from cosyvoice_runtime.hift.incremental import left_context_frames
from cosyvoice_runtime.hift.streaming import VocoderCall, VocoderStream, vocode_batch, vocode_chunk
from tests.runtime.parity.common import assert_matches, load_cases
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


def batch(hift, streams, chunks, finals, **kwargs) -> list[torch.Tensor]:
    """One :func:`vocode_batch` call, a chunk per stream."""
    return vocode_batch(hift, [VocoderCall(st, ch, fin, **kwargs) for st, ch, fin in zip(streams, chunks, finals)])


def _official_cv3(hift, chunks) -> list[torch.Tensor]:
    """The official CV3 glue (spec §5.5): every call re-vocodes the accumulated mel with the chunk's
    finalize flag (non-final: the official non-final mode) and emits what is new."""
    out, mel, emitted = [], None, 0
    for i, ch in enumerate(chunks):
        mel = ch if mel is None else torch.cat([mel, ch], dim=2)
        final = i == len(chunks) - 1
        if not final and mel.shape[2] <= hift.lag_frames:
            out.append(mel.new_zeros(1, 0))
            continue
        speech, _ = hift.inference(mel, finalize=final)
        out.append(speech[:, emitted:])
        emitted = speech.shape[1]
    return out


def _close(got, want):
    assert got.shape == want.shape
    if want.numel():
        assert float((got - want).abs().max()) < TOL


def test_cv3_batched_decode_equals_unbatched():
    case, mels = _mels("cosyvoice3")
    _, hift = load_hift(case.model_dir)
    batched = causal_decode_batch(hift, mels)
    for mel, got in zip(mels, batched):
        ref, _ = hift.inference(mel, finalize=True)
        assert got.shape == ref.shape
        assert float((got - ref).abs().max()) < TOL


@pytest.mark.parametrize("family", ["cosyvoice3", "cosyvoice2"])
def test_a_batch_of_three_equals_three_batches_of_one(family):
    case, mels = _mels(family)
    spec, hift = load_hift(case.model_dir)
    schedules = [_split(mels[0], [60, 50]), _split(mels[1], [30, 40]), _split(mels[2], [60, 20])]
    one_states = [VocoderStream.create(spec, seed=10 + i) for i in range(3)]
    bat_states = [VocoderStream.create(spec, seed=10 + i) for i in range(3)]
    n_calls = len(schedules[0])
    ones = [[], [], []]
    for c in range(n_calls):
        final = c == n_calls - 1
        chunks = [s[c] for s in schedules]
        for k, (st, ch) in enumerate(zip(one_states, chunks)):
            ones[k].append(vocode_chunk(hift, st, ch, finalize=final))
        for k, got in enumerate(batch(hift, bat_states, chunks, [final] * 3)):
            _close(got, ones[k][-1])
    assert all(st.finished for st in bat_states)
    assert [st.calls for st in bat_states] == [n_calls] * 3
    if family == "cosyvoice3":  # and both are the official glue's audio
        for k, s in enumerate(schedules):
            for got, want in zip(ones[k], _official_cv3(hift, s)):
                _close(got, want)


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_the_fixture_stream_batched_with_others_matches_the_official_chunks(family):
    """The recorded stream, vocoded call by call in a batch with two other streams of the same chunk
    sizes (so CV2 groups them into one batch), gives the official chunks at the case tolerance."""
    case = _cases()[family]
    spec, hift = load_hift(case.model_dir)
    _, mels = _mels(family)
    calls = case.params["hift_calls"]
    tol = next(k for k in case.meta["tolerance"] if k.startswith("out"))
    long_mel = torch.cat([mels[0], mels[2], mels[1]], dim=2)
    streams = [VocoderStream.create(spec, seed=10 + i) for i in range(3)]
    prev, others_at = 0, 0
    for i in range(len(calls)):
        mel = case.t(f"hift{i}_mel")
        final = i == len(calls) - 1
        if spec.hift.causal:
            chunk, prev = mel[:, :, prev:], mel.shape[2]
        else:
            cached = 0 if streams[0].mel_cache is None else streams[0].mel_cache.shape[2]
            chunk = mel[:, :, cached:]
        n = chunk.shape[2]
        others = [m[:, :, others_at:others_at + n] for m in (long_mel, torch.flip(long_mel, dims=[2]))]
        others_at += n
        overrides = [None if spec.hift.causal else case.t(f"hift{i}_source"), None, None]
        got = vocode_batch(hift, [VocoderCall(st, ch, final, source_override=ov)
                                  for st, ch, ov in zip(streams, [chunk, *others], overrides)])
        assert got[0].shape[1] == case.params["chunk_lens"][i]
        assert_matches(case, f"out{i}", got[0], tol_key=tol)


def test_cv3_mixed_final_and_streaming_items():
    case, mels = _mels("cosyvoice3")
    spec, hift = load_hift(case.model_dir)
    a, b = VocoderStream.create(spec), VocoderStream.create(spec)
    ga, gb = batch(hift, [a, b], [mels[0], mels[2]], [False, True])
    ra, _ = hift.inference(mels[0], finalize=False)  # the official non-final call
    rb, _ = hift.inference(mels[2], finalize=True)
    assert ga.shape == ra.shape == (1, 480 * (mels[0].shape[2] - hift.lag_frames))
    assert gb.shape == rb.shape == (1, 480 * mels[2].shape[2])
    assert float((ga - ra).abs().max()) < TOL and float((gb - rb).abs().max()) < TOL


def test_cv3_incremental_stream_equals_the_official_recompute():
    case, mels = _mels("cosyvoice3")
    spec, hift = load_hift(case.model_dir)
    assert 30 <= left_context_frames(spec.hift) <= 40
    long_mel = torch.cat([mels[0], mels[2], mels[1]], dim=2)  # 380 frames
    sizes = [20, 5, 30, 17, 60, 11, 90, 50]  # includes chunks shorter than the 8-frame lag
    chunks = _split(long_mel, sizes)
    inc = VocoderStream.create(spec, strategy="incremental")
    inc_out = [vocode_chunk(hift, inc, ch, finalize=i == len(chunks) - 1) for i, ch in enumerate(chunks)]
    ref_out = _official_cv3(hift, chunks)
    for got, want in zip(inc_out, ref_out):
        assert got.shape == want.shape
    a, b = torch.cat(ref_out, dim=1), torch.cat(inc_out, dim=1)
    assert a.shape[1] == 480 * long_mel.shape[2]
    assert float((a - b).abs().max()) < TOL


@pytest.mark.parametrize("graphed_body", [False, True])
def test_cv3_batched_incremental_streams_equal_the_official_recompute(graphed_body):
    """Three incremental streams vocoded together (different lengths and schedules, chunks below
    the lag, a stream that ends early) equal each request's official full recompute; also with
    the body run over zero-padded (batch, frames) buckets as its CUDA graphs run it (eagerly here),
    windows past the largest bucket at their own size."""
    case, mels = _mels("cosyvoice3")
    spec, hift = load_hift(case.model_dir)
    if graphed_body:
        hift = copy.deepcopy(hift)
        body = graph_causal_body(hift, max_batch=2, max_frames=96, capture=False, use_graphs=False)
    long_mel = torch.cat([mels[0], mels[2], mels[1]], dim=2)  # 380 frames
    schedules = [_split(long_mel, [20, 5, 30, 17, 60, 11, 90]), _split(mels[1], [3, 30, 40, 1, 12, 6, 10]),
                 _split(mels[2], [60, 20])]
    inc = [VocoderStream.create(spec, strategy="incremental") for _ in schedules]
    ref_out = [_official_cv3(hift, s) for s in schedules]
    inc_out = [[] for _ in schedules]
    for c in range(max(len(s) for s in schedules)):
        live = [k for k, s in enumerate(schedules) if c < len(s)]
        final = [c == len(schedules[k]) - 1 for k in live]
        for k, g in zip(live, batch(hift, [inc[k] for k in live], [schedules[k][c] for k in live], final)):
            assert g.shape == ref_out[k][c].shape, (c, k)
            inc_out[k].append(g)
    for k, mel in enumerate([long_mel, mels[1], mels[2]]):
        a, b = torch.cat(ref_out[k], dim=1), torch.cat(inc_out[k], dim=1)
        assert a.shape[1] == 480 * mel.shape[2] and float((a - b).abs().max()) < TOL, k
    assert all(st.finished for st in inc)
    if graphed_body:  # three rows: past the 2-row buckets; one and two rows padded to 16-frame steps
        assert body.replays > 0 and body.eager_calls > 0
        assert set(body._buckets) <= {(b, t) for b in (1, 2) for t in range(16, 97, 16)} and body._buckets


def test_cv3_a_batch_may_mix_strategies():
    case, mels = _mels("cosyvoice3")
    spec, hift = load_hift(case.model_dir)
    pairs = [(VocoderStream.create(spec), VocoderStream.create(spec)),
             (VocoderStream.create(spec), VocoderStream.create(spec, strategy="incremental"))]
    for fin in (False, True):
        chunks = [mels[0][:, :, :60], mels[2][:, :, :60]] if not fin else [mels[0][:, :, 60:], mels[2][:, :, 60:]]
        refs = [vocode_chunk(hift, r, ch, finalize=fin) for (r, _), ch in zip(pairs, chunks)]
        gots = batch(hift, [b for _, b in pairs], chunks, [fin, fin])
        for r, g in zip(refs, gots):
            _close(g, r)


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_a_speed_change_rides_in_a_batch(family):
    """An unstreamed call with a speed change, batched with a streamed one, gives what it gives
    alone (CV3: the official inference of the interpolated mel), and only as a single final call."""
    case, mels = _mels(family)
    spec, hift = load_hift(case.model_dir)
    mel = mels[1]
    alone = vocode_chunk(hift, VocoderStream.create(spec, seed=3), mel, finalize=True, speed=1.5)
    assert alone.shape == (1, 480 * int(mel.shape[2] / 1.5))
    if spec.hift.causal:
        want, _ = hift.inference(torch.nn.functional.interpolate(mel, size=int(mel.shape[2] / 1.5), mode="linear"))
        _close(alone, want)
    fast = VocoderStream.create(spec, seed=3, strategy="incremental")
    calls = [VocoderCall(fast, mel, True, speed=1.5), VocoderCall(VocoderStream.create(spec, seed=4), mels[0], False)]
    _close(vocode_batch(hift, calls)[0], alone)
    with pytest.raises(InvalidInputError):
        batch(hift, [VocoderStream.create(spec)], [mel], [False], speed=1.5)
