"""Streaming vocoder glue (``hift.streaming``) against the per-call tensors of ``token2wav_stream``.

The mel of every vocoder call (``hift{i}_mel``) and, for CV2, the recorded source
(``hift{i}_source``) are fed through :func:`vocode_chunk`; the emitted chunks must equal the
official ``out{i}`` at the case's ``out*`` tolerance, and the caches must hold what the official
code prepends to the next call.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.hift.streaming import VocoderStream, crossfade, crossfade_window, speed_resample, vocode_chunk
from tests.runtime.parity.common import assert_matches, load_cases
from tests.runtime.parity.hift_cases import load_hift

STREAM_CASES = [c for c in load_cases() if c.name == "token2wav_stream"]


def _out_tol_key(case) -> str:
    return next(k for k in case.meta["tolerance"] if k.startswith("out"))


@pytest.mark.parametrize("case", STREAM_CASES, ids=[c.family for c in STREAM_CASES])
def test_stream_chunks_match_official(case):
    spec, hift = load_hift(case.model_dir)
    state = VocoderStream.create(spec)
    calls = case.params["hift_calls"]
    tol = _out_tol_key(case)
    prev_frames = 0
    for i, call in enumerate(calls):
        mel = case.t(f"hift{i}_mel")
        final = bool(call.get("finalize", i == len(calls) - 1))
        if spec.hift.causal:
            chunk, override = mel[:, :, prev_frames:], None
            prev_frames = mel.shape[2]
        else:
            cached = 0 if state.mel_cache is None else state.mel_cache.shape[2]
            if cached:  # what the official call prepended is exactly our cached mel
                np.testing.assert_array_equal(state.mel_cache.numpy(), mel[:, :, :cached].numpy())
                assert state.source_cache.shape[2] == call["cache_source_len"]
                np.testing.assert_array_equal(state.source_cache.numpy(),
                                              case.t(f"hift{i - 1}_source")[:, :, -call["cache_source_len"]:].numpy())
            chunk, override = mel[:, :, cached:], case.t(f"hift{i}_source")
        out = vocode_chunk(hift, state, chunk, finalize=final, source_override=override)
        assert out.shape[1] == case.params["chunk_lens"][i]
        assert_matches(case, f"out{i}", out, tol_key=tol)
    assert state.finished


@pytest.mark.parametrize("case", [c for c in STREAM_CASES if c.params.get("hift_seed_base") is not None],
                         ids=lambda c: c.family)
def test_cv2_seeded_generator_reproduces_recorded_sources(case):
    """Per-call generators seeded like the fixture reproduce the official random sources."""
    spec, hift = load_hift(case.model_dir)
    state = VocoderStream.create(spec)
    calls = case.params["hift_calls"]
    for i, call in enumerate(calls):
        mel = case.t(f"hift{i}_mel")
        cached = 0 if state.mel_cache is None else state.mel_cache.shape[2]
        gen = torch.Generator().manual_seed(int(call["seed"]))
        out = vocode_chunk(hift, state, mel[:, :, cached:], finalize=i == len(calls) - 1, generator=gen)
        assert_matches(case, f"out{i}", out, tol_key=_out_tol_key(case))
        if i < len(calls) - 1:
            ref = case.t(f"hift{i}_source")[:, :, -state.source_cache_len:]
            assert float((state.source_cache - ref).abs().max()) < 1e-4


def test_crossfade_is_the_official_hamming_overlap():
    n = 3840
    w = crossfade_window(n)
    assert w.shape == (2 * n,) and w.dtype == torch.float64
    np.testing.assert_array_equal(w.numpy(), np.hamming(2 * n))
    new = torch.ones(1, 2 * n)
    prev = torch.full((1, n), 2.0)
    out = crossfade(new, prev, w)
    expect = np.hamming(2 * n)[:n] + 2.0 * np.hamming(2 * n)[n:]
    np.testing.assert_allclose(out[0, :n].numpy(), expect, rtol=1e-6)
    assert torch.equal(out[:, n:], new[:, n:])
    # The halves sum to ~1.08 in the middle of the overlap (the documented quirk).
    assert 1.07 < float(w[n // 2] + w[n + n // 2]) < 1.09


def test_cache_sizes_come_from_the_spec():
    case = next(c for c in STREAM_CASES if c.family == "cosyvoice2")
    spec, _ = load_hift(case.model_dir)
    state = VocoderStream.create(spec)
    assert state.mel_cache_len == spec.stream.mel_cache_len
    assert state.source_cache_len == spec.stream.mel_cache_len * spec.hift.samples_per_frame == 3840


def test_speed_resample_length_and_streaming_rejection():
    mel = torch.randn(1, 80, 101)
    assert speed_resample(mel, 1.5).shape == (1, 80, int(101 / 1.5))
    assert speed_resample(mel, 0.7).shape == (1, 80, int(101 / 0.7))
    assert speed_resample(mel, 1.0) is mel
    case = STREAM_CASES[0]
    spec, hift = load_hift(case.model_dir)
    with pytest.raises(InvalidInputError):
        vocode_chunk(hift, VocoderStream.create(spec), mel[:, :, :60], finalize=False, speed=1.5)


def test_request_generator_is_not_the_global_rng():
    case = next(c for c in STREAM_CASES if c.family == "cosyvoice2")
    spec, hift = load_hift(case.model_dir)
    mel = case.t("hift0_mel")
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    a = vocode_chunk(hift, VocoderStream.create(spec, seed=5), mel, finalize=True)
    assert torch.equal(torch.random.get_rng_state(), before), "the global RNG was consumed"
    b = vocode_chunk(hift, VocoderStream.create(spec, seed=5), mel, finalize=True)
    c = vocode_chunk(hift, VocoderStream.create(spec, seed=6), mel, finalize=True)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def _case(family: str, name: str):
    return next(c for c in load_cases() if c.family == family and c.name == name)


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_nonstream_and_speed_cases(family):
    """One finalize call: token2wav_nonstream, and token2wav_speed (its flow mel is nonstream's)."""
    nonstream, speed_case = _case(family, "token2wav_nonstream"), _case(family, "token2wav_speed")
    spec, hift = load_hift(nonstream.model_dir)
    for case in (nonstream, speed_case):
        speed = float(case.params["speed"])
        flow_mel = nonstream.t("flow0_mel")
        resampled = speed_resample(flow_mel, speed)
        assert_matches(case, "hift0_mel", resampled, tol_key="flow*_mel")
        seed = case.params.get("hift_seed_base")
        gen = None if seed is None else torch.Generator().manual_seed(int(seed))
        out = vocode_chunk(hift, VocoderStream.create(spec), flow_mel, finalize=True, generator=gen, speed=speed)
        assert out.shape[1] == case.params["chunk_lens"][0]
        assert_matches(case, "out0", out, tol_key=_out_tol_key(case))
