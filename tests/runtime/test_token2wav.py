"""Token2Wav: per-request schedule, and batched == unbatched audio (parity tiny models)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.model import load_model
from cosyvoice_runtime.stream_schedule import (
    final_chunk_frames,
    first_chunk_frames,
    first_hop,
    prompt_token_pad,
    streaming_lengths,
)
from cosyvoice_runtime.token2wav import Token2Wav
from cosyvoice_runtime.voice_prompt import VoicePrompt
from tests.runtime.parity.common import parity_dir


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def model(request):
    return load_model(parity_dir() / request.param / "model")


def _prompt(model, n_prompt: int, seed: int) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    return VoicePrompt(family=model.spec.family, text_tokens=np.zeros(0, np.int32),
                       speech_tokens=torch.randint(0, 6561, (n_prompt,), generator=g, dtype=torch.int32).numpy(),
                       mel=torch.randn(2 * n_prompt, 80, generator=g).numpy(),
                       embedding=torch.randn(192, generator=g).numpy())


def test_prompt_pad_aligns_first_chunk():
    assert prompt_token_pad(20, 25) == 5 and prompt_token_pad(75, 25) == 0 and prompt_token_pad(80, 25) == 20


def test_hop_is_per_request_not_shared(model):
    """The official hop grows on the shared model; here every new stream starts at token_hop_len."""
    t2w = Token2Wav(model.spec, model.flow, model.hift)
    tokens = list(range(100, 300))
    first = []
    for _ in range(3):
        state = t2w.new_stream(_prompt(model, 25, 0), stream=True, generator=torch.Generator().manual_seed(0))
        job = t2w.next_job(state, tokens, llm_done=False)
        first.append(job.tokens.shape[1])
        t2w.run(job)
        assert state.hop_len == 2 * model.spec.stream.token_hop_len
    assert first == [model.spec.stream.token_hop_len + model.spec.flow.pre_lookahead_len] * 3


def test_batched_equals_unbatched(model):
    """Three requests at different points of their streams, solved in one batch, give the audio
    each gets alone (CV2 vocoder randomness is per request: seeded generators)."""
    t2w = Token2Wav(model.spec, model.flow, model.hift)
    g = torch.Generator().manual_seed(3)
    specs = [(20, 60, True), (25, 90, True), (15, 40, False)]  # (prompt tokens, tokens, stream)
    toks = [torch.randint(0, 6561, (n,), generator=g).tolist() for _, n, _ in specs]

    def run(batched: bool):
        states = [t2w.new_stream(_prompt(model, p, i), stream=s, generator=torch.Generator().manual_seed(i))
                  for i, (p, _, s) in enumerate(specs)]
        audio = [[] for _ in specs]
        while True:
            jobs = [(i, j) for i, st in enumerate(states) if (j := t2w.next_job(st, toks[i], llm_done=True))]
            if not jobs:
                break
            outs = t2w.run_batch([j for _, j in jobs]) if batched else [t2w.run(j) for _, j in jobs]
            for (i, _), a in zip(jobs, outs):
                audio[i].append(a)
        return [torch.cat(a) for a in audio]

    single, batch = run(False), run(True)
    for a, b in zip(single, batch):
        assert a.shape == b.shape
        # Padding changes matmul shapes and so float32 rounding: the parity tolerance of a flow mel
        # (5e-4) is the bound; measured max error here is ~1e-4.
        assert torch.allclose(a, b, atol=5e-4), float((a - b).abs().max())


def test_speed_rejected_for_streaming(model):
    t2w = Token2Wav(model.spec, model.flow, model.hift)
    with pytest.raises(InvalidInputError):
        t2w.new_stream(_prompt(model, 20, 0), stream=True, speed=1.5)
    with pytest.raises(InvalidInputError):
        t2w.new_stream(_prompt(model, 20, 0), stream=False, speed=5.0)


def test_first_hop_rule():
    # official: hop + pad
    assert first_hop(87, 25) == 38 and first_hop(75, 25) == 25
    # early: the first attention-chunk boundary at or past min_first_hop tokens
    assert first_hop(87, 25, 1) == 13 and first_hop(87, 25, 13) == 13 and first_hop(87, 25, 14) == 38
    assert first_hop(75, 25, 10) == 25 and first_hop(74, 25, 0) == 1


# the default first hop's case under slow (~14 s): the raised one (~10 s) keeps the check in the default run
@pytest.mark.parametrize("min_first_hop", [pytest.param(None, marks=pytest.mark.slow), 10])
def test_vocoder_lengths_of_a_stream_are_the_captured_ones(min_first_hop):
    """The CV2 vocoder graphs captured at start (first-chunk lengths, cache + 2 x hop, last-chunk
    lengths) are the lengths a real stream feeds the vocoder, whatever the utterance length."""
    model = load_model(parity_dir() / "cosyvoice2" / "model")
    st, ratio = model.spec.stream, model.spec.flow.token_mel_ratio
    later = streaming_lengths(st.mel_cache_len, st.token_hop_len, st.token_max_hop_len, st.stream_scale_factor, ratio)
    first = first_chunk_frames(st.token_hop_len, ratio, min_first_hop)
    final = final_chunk_frames(st.mel_cache_len, st.token_max_hop_len, model.spec.flow.pre_lookahead_len, ratio)
    assert len(first) == st.token_hop_len
    t2w = Token2Wav(model.spec, model.flow, model.hift, min_first_hop=min_first_hop)
    seen: list[int] = []
    decode = model.hift.decode
    model.hift.decode = lambda mel, source: (seen.append(mel.shape[2]), decode(mel, source))[1]
    try:
        for n_prompt, n_tokens in ((7, 420), (25, 397), (31, 311), (25, 12), (7, 3)):
            seen.clear()
            state = t2w.new_stream(_prompt(model, n_prompt, 0), stream=True, generator=torch.Generator().manual_seed(0))
            tokens = list(range(100, 100 + n_tokens))
            while (job := t2w.next_job(state, tokens, llm_done=True)) is not None:
                t2w.run(job)
            assert seen[-1] in final, (n_prompt, n_tokens, seen)
            if n_tokens > 300:
                assert len(seen) >= 5 and seen[0] in first
                assert set(seen[1:-1]) <= set(later) and later[-1] in seen, seen
    finally:
        del model.hift.decode


def _stream_mels(t2w, prompt, tokens):
    state = t2w.new_stream(prompt, stream=True, generator=torch.Generator().manual_seed(0))
    mels, hops = [], []
    while (job := t2w.next_job(state, tokens, llm_done=True)) is not None:
        mel = t2w.flow_mel(job)
        hops.append(job.hop)
        mels.append(mel)
        t2w.vocode(job, mel)
    return torch.cat(mels, dim=2), hops


def test_early_first_chunk_keeps_the_mel(model):
    """A first chunk cut at an earlier attention-chunk boundary gives the same mel frames as the
    official schedule: emitted frames never see a later chunk, so only the timing changes."""
    official = Token2Wav(model.spec, model.flow, model.hift)
    early = Token2Wav(model.spec, model.flow, model.hift, min_first_hop=1)
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 6561, (140,), generator=g).tolist()
    hop = model.spec.stream.token_hop_len
    prompt = _prompt(model, 2 * hop - 7, 4)  # pad = 7 tokens
    want, official_hops = _stream_mels(official, prompt, tokens)
    got, early_hops = _stream_mels(early, prompt, tokens)
    assert official_hops[0] == hop + 7 and early_hops[:2] == [7, hop]  # the second hop is not yet scaled
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=5e-4, rtol=5e-4)


@pytest.mark.parametrize("cv2_flow, max_batch, fail_call, fail_batch", [
    ("recompute", 16, 1, 3),  # the one vocoder call of the batch
    ("incremental", 16, 1, 2),  # CV2: the (non-final) call had advanced the flow cache too (CV3 ignores it)
    ("recompute", 1, 2, 3),  # two groups of one: the second fails after the first was done
])
def test_a_token2wav_failure_leaves_the_streams_as_they_were(model, monkeypatch, cv2_flow, max_batch, fail_call,
                                                             fail_batch):
    """Two streams batched; at one chunk a vocoder call advances its states and then
    raises (as an OOM part-way would): the retry of the whole batch gives, sample for sample, the
    audio of a run that never failed (overlap caches, flow cache, random source and schedule of
    every stream were put back)."""
    from cosyvoice_runtime import token2wav as t2w_mod

    t2w = Token2Wav(model.spec, model.flow, model.hift, cv2_flow=cv2_flow)
    tokens = [list(range(100, 220)), list(range(300, 390))]
    real = t2w_mod.vocode_batch

    def run(fail_at: int | None):
        states = [t2w.new_stream(_prompt(model, 20 + i, i), stream=True, generator=torch.Generator().manual_seed(i))
                  for i in range(2)]
        audio, batches, failed = [[], []], 0, False
        while not all(st.finished for st in states):
            jobs = [(k, t2w.next_job(st, tokens[k], llm_done=True)) for k, st in enumerate(states)]
            jobs = [(k, j) for k, j in jobs if j is not None]
            batches += 1
            if batches == fail_at and not failed:
                calls = []

                def half_done(*args, calls=calls, **kwargs):
                    out = real(*args, **kwargs)  # the states advanced ...
                    calls.append(1)
                    if len(calls) == fail_call:
                        raise RuntimeError("CUDA out of memory (injected)")  # ... then the call fails
                    return out
                monkeypatch.setattr(t2w_mod, "vocode_batch", half_done)
                with pytest.raises(RuntimeError, match="injected"):
                    t2w.run_batch([j for _, j in jobs], max_batch=max_batch)
                monkeypatch.setattr(t2w_mod, "vocode_batch", real)
                failed = True
            for (k, _), a in zip(jobs, t2w.run_batch([j for _, j in jobs], max_batch=max_batch)):
                audio[k].append(a)
        return [torch.cat(a) for a in audio], failed

    clean, _ = run(None)
    retried, failed = run(fail_batch)
    assert failed
    for a, b in zip(clean, retried):
        assert a.shape == b.shape and a.numel() > 0
        assert torch.equal(a, b)


def test_streams_of_one_voice_share_its_device_prompt_and_give_the_same_audio(model, monkeypatch):
    """new_stream copies a voice prompt to the device once (three pageable copies per request
    were ~1 ms on the event loop, H100 2026-12-05): a second stream of the same content shares
    the tensors, another voice gets its own, the least recently used voice leaves past the
    bound; the shared prompt leaves each stream's audio as a fresh copy gives it."""
    import cosyvoice_runtime.token2wav as t2w_mod

    monkeypatch.setattr(t2w_mod, "PROMPT_VOICES", 2)
    t2w = Token2Wav(model.spec, model.flow, model.hift)
    tokens = torch.randint(0, 6561, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    a1, a2 = _prompt(model, 20, 1), _prompt(model, 20, 1)  # equal content, distinct objects
    s1 = t2w.new_stream(a1, stream=False, generator=torch.Generator().manual_seed(0))
    s2 = t2w.new_stream(a2, stream=False, generator=torch.Generator().manual_seed(0))
    assert s1.prompt_feat is s2.prompt_feat and s1.prompt_tokens is s2.prompt_tokens and s1.prompt_key == s2.prompt_key
    assert torch.equal(s1.prompt_feat[0].float(), torch.from_numpy(a1.mel).to(s1.prompt_feat.dtype).float())
    b = t2w.new_stream(_prompt(model, 20, 2), stream=False)
    assert b.prompt_feat is not s1.prompt_feat and len(t2w._prompts) == 2
    t2w.new_stream(_prompt(model, 20, 3), stream=False)  # a third voice: the least recently used (a) leaves
    s3 = t2w.new_stream(a1, stream=False, generator=torch.Generator().manual_seed(0))
    assert s3.prompt_feat is not s1.prompt_feat and len(t2w._prompts) == 2
    # the same audio from the shared tensors (s1, after s2 used them) and from a fresh copy (s3)
    out1 = t2w.run(t2w.next_job(s2, tokens, llm_done=True))
    out1 = t2w.run(t2w.next_job(s1, tokens, llm_done=True))
    out3 = t2w.run(t2w.next_job(s3, tokens, llm_done=True))
    assert np.array_equal(out1, out3)
