"""Incremental CosyVoice2 flow (``Token2Wav(cv2_flow="incremental")``): the streamed audio of every
chunk equals the full recompute's within float noise, the official streamed mel is reproduced, and
the estimator solves each frame once instead of the whole prefix on every call.

Exactness is checked with the flow in float64: its float32 output (what the vocoder gets) and so
every audio sample are then bit-identical to the recompute's. In float32 the two differ by matmul
rounding only (mel <= ~2e-6, measured), which the random-weight tiny vocoder amplifies to ~1.4e-4 in
the audio: the same bound as batched against unbatched jobs (tests/runtime/test_token2wav.py).
"""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

from cosyvoice_runtime.flow.flow import FlowItem
from cosyvoice_runtime.flow.flow_cache import FlowCache
from cosyvoice_runtime.flow.graph_setup import enable_flow_graphs
from cosyvoice_runtime.model import load_model
from cosyvoice_runtime.token2wav import Token2Wav
from cosyvoice_runtime.voice_prompt import VoicePrompt
from tests.runtime.parity.common import assert_matches, load_cases, parity_dir
from tests.runtime.parity.token2wav_cases import flow_prompt


@functools.lru_cache(maxsize=2)
def _model(family: str):
    return load_model(parity_dir() / family / "model")


@pytest.fixture(scope="module")
def cv2():
    return _model("cosyvoice2")


@pytest.fixture(scope="module")
def flow64(cv2):
    """The tiny CosyVoice2 flow in float64 (a copy; the vocoder stays float32)."""
    return copy.deepcopy(cv2.flow).double()


def _prompt(n_prompt: int, seed: int) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    return VoicePrompt(family="cosyvoice2", text_tokens=np.zeros(0, np.int32),
                       speech_tokens=torch.randint(0, 6561, (n_prompt,), generator=g, dtype=torch.int32).numpy(),
                       mel=torch.randn(2 * n_prompt, 80, generator=g).numpy(), embedding=torch.randn(192, generator=g).numpy())


def _item(prompt: VoicePrompt, tokens: torch.Tensor, finalize: bool) -> FlowItem:
    """A streamed flow call of ``tokens`` (1, n) with the prompt as batch-of-one tensors."""
    return FlowItem(tokens, torch.from_numpy(prompt.speech_tokens)[None], torch.from_numpy(prompt.mel)[None],
                    torch.from_numpy(prompt.embedding)[None], streaming=True, finalize=finalize)


def incremental_mel(flow, item: FlowItem, cache: FlowCache) -> torch.Tensor:
    """One job solved alone over ``cache`` (which then advances): its frames from the cache's end on."""
    row = flow.start_incremental_rows([item], [cache], [None])[0]
    flow.incremental.solve([row])
    row.commit()
    return row.x[None].float()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(100 + seed)).tolist()


def _stream(t2w: Token2Wav, prompt: VoicePrompt, tokens: list[int]):
    """Every chunk of a streamed utterance (vocoder randomness seeded per request) and its state."""
    state = t2w.new_stream(prompt, stream=True, generator=torch.Generator().manual_seed(7))
    chunks = []
    while (job := t2w.next_job(state, tokens, llm_done=True)) is not None:
        chunks.append(t2w.run(job))
    return chunks, state


# (prompt tokens, generated tokens, min_first_hop, official final full attention)
SCHEDULES = [
    pytest.param(25, 40, None, False, id="short-prompt-multiple-of-chunk"),
    pytest.param(20, 200, None, False, id="long-prompt-not-multiple"),
    pytest.param(40, 180, 5, False, id="early-first-chunk"),
    pytest.param(50, 260, 30, False, id="early-first-chunk-aligned-prompt"),
    pytest.param(33, 150, None, True, id="official-final-full-attention"),
    pytest.param(20, 34, None, False, id="one-chunk-then-final"),
]


@pytest.mark.parametrize("n_prompt,n_tokens,min_first_hop,full_final", SCHEDULES)
def test_streamed_audio_equals_recompute(cv2, flow64, n_prompt, n_tokens, min_first_hop, full_final):
    """float64 flow: every chunk's samples bit-identical to the recompute's."""
    prompt, tokens = _prompt(n_prompt, n_tokens), _tokens(n_tokens, n_prompt)
    ref_t2w, inc_t2w = (Token2Wav(cv2.spec, flow64, cv2.hift, official_final_full_attention=full_final,
                                  min_first_hop=min_first_hop, cv2_flow=mode) for mode in ("recompute", "incremental"))
    ref, ref_state = _stream(ref_t2w, prompt, tokens)
    inc, inc_state = _stream(inc_t2w, prompt, tokens)
    assert len(ref) == len(inc) >= 2
    for i, (a, b) in enumerate(zip(ref, inc)):
        assert torch.equal(a, b), f"chunk {i}: max error {float((a - b).abs().max()) if a.shape == b.shape else a.shape}"
    assert inc_state.flow_cache is None and inc_state.finished  # freed by the last call
    assert inc_state.flow_frames < ref_state.flow_frames


def test_float32_mel_and_audio_within_float_noise(cv2):
    """float32 (the CPU runtime's dtype): every streamed mel within 1e-5, every chunk within 5e-4."""
    prompt, tokens = _prompt(20, 5), _tokens(230, 5)
    out = {}
    for mode in ("recompute", "incremental"):
        t2w = Token2Wav(cv2.spec, cv2.flow, cv2.hift, cv2_flow=mode)
        state = t2w.new_stream(prompt, stream=True, generator=torch.Generator().manual_seed(7))
        out[mode] = []
        while (job := t2w.next_job(state, tokens, llm_done=True)) is not None:
            mel = t2w.flow_mel(job)
            out[mode].append((mel, t2w.vocode(job, mel)))
    assert len(out["recompute"]) == len(out["incremental"]) == 4
    for i, ((mel_a, a), (mel_b, b)) in enumerate(zip(out["recompute"], out["incremental"])):
        assert mel_a.shape == mel_b.shape and a.shape == b.shape, f"chunk {i}"
        assert torch.allclose(mel_a, mel_b, atol=1e-5), f"chunk {i}: mel error {float((mel_a - mel_b).abs().max())}"
        assert torch.allclose(a, b, atol=5e-4), f"chunk {i}: audio error {float((a - b).abs().max())}"


def test_every_frame_solved_once_for_a_10s_utterance(cv2):
    """10 s of speech (250 tokens) after a 3 s prompt (75 tokens): the recompute solves the prefix on
    every call (200 + 300 + 500 + 650 frames), the incremental flow each frame once (650)."""
    prompt, tokens = _prompt(75, 1), _tokens(250, 1)
    counts = {}
    for mode in ("recompute", "incremental"):
        _, state = _stream(Token2Wav(cv2.spec, cv2.flow, cv2.hift, cv2_flow=mode), prompt, tokens)
        counts[mode] = state.flow_frames
    total = 2 * (75 + 250)
    assert counts == {"recompute": 200 + 300 + 500 + total, "incremental": total}
    assert counts["incremental"] / counts["recompute"] < 0.4


def test_run_batch_mixes_incremental_and_unstreamed_jobs(cv2):
    """A batch of streamed (incremental, one at a time) and unstreamed (recomputed) jobs gives each
    request its audio from a run alone."""
    t2w = Token2Wav(cv2.spec, cv2.flow, cv2.hift, cv2_flow="incremental")
    specs = [(20, 120, True), (25, 90, True), (15, 40, False)]
    toks = [_tokens(n, i) for i, (_, n, _) in enumerate(specs)]

    def run(batched: bool):
        states = [t2w.new_stream(_prompt(p, i), stream=s, generator=torch.Generator().manual_seed(i))
                  for i, (p, _, s) in enumerate(specs)]
        audio = [[] for _ in specs]
        while jobs := [(i, j) for i, st in enumerate(states) if (j := t2w.next_job(st, toks[i], llm_done=True))]:
            outs = t2w.run_batch([j for _, j in jobs]) if batched else [t2w.run(j) for _, j in jobs]
            for (i, _), a in zip(jobs, outs):
                audio[i].append(a)
        return [torch.cat(a) for a in audio]

    for a, b in zip(run(False), run(True)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=5e-4), float((a - b).abs().max())


def test_cache_ends_on_chunk_boundaries_and_holds_what_the_layout_says(cv2):
    """The cache ends at the last attention-chunk boundary of each non-final call; it holds, per
    ODE step, every transformer block's normed input of both CFG rows (grown in whole
    CACHE_GROWTH steps) and two input frames of every k=3 convolution."""
    prompt, tokens = _prompt(20, 2), torch.tensor([_tokens(120, 2)], dtype=torch.int32)
    cache = FlowCache()
    unet = cv2.flow.estimator
    n_blocks = sum(len(blocks) for _, blocks, *_ in (*unet.down_blocks, *unet.mid_blocks, *unet.up_blocks))
    conv_channels = sum(m.in_channels for m in unet.modules()
                        if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] == 3)
    for end, final in ((30, False), (80, False), (120, True)):
        n = end if final else end + cv2.spec.flow.pre_lookahead_len
        ref = cv2.flow.inference_batch([_item(prompt, tokens[:, :n], final)])[0]
        start = cache.frames
        mel = incremental_mel(cv2.flow, _item(prompt, tokens[:, :n], final), cache)
        lo = max(start, 40)  # ref starts after the 40 prompt frames, mel at the cache's end
        assert torch.allclose(mel[:, :, lo - start:], ref[:, :, lo - 40:], atol=1e-5)
        if not final:
            assert cache.frames == 2 * (20 + end) and cache.frames % cv2.spec.flow.unet.static_chunk_size == 0
    steps, dim, cap = cv2.spec.flow.n_timesteps, unet.spec.channels[0], 256
    assert cache.nbytes() == steps * 4 * (n_blocks * 2 * cap * dim + 2 * conv_channels * 2)


def test_unaligned_end_caches_only_up_to_the_chunk_boundary(cv2):
    """A job ending inside an attention chunk keeps only whole chunks: the next call recomputes the
    partial chunk (its frames would otherwise have missed keys of their own chunk)."""
    prompt, tokens = _prompt(20, 3), torch.tensor([_tokens(80, 3)], dtype=torch.int32)
    cache = FlowCache()
    la = cv2.spec.flow.pre_lookahead_len
    first = _item(prompt, tokens[:, :18 + la], finalize=False)
    incremental_mel(cv2.flow, first, cache)
    assert cache.frames == 50  # 2 * (20 + 18) = 76 frames solved, one whole 50-frame chunk kept
    final = _item(prompt, tokens, finalize=True)
    inc = incremental_mel(cv2.flow, final, cache)
    ref = cv2.flow.inference_batch([final])[0]  # frames from the prompt end (40) on; inc from 50 on
    assert inc.shape[-1] == 2 * (20 + 80) - 50 and torch.allclose(inc, ref[:, :, 10:], atol=1e-5)


def test_time_table_follows_weights_changed_in_place(flow64):
    """The pass reads the resnets' time shifts from a table made once (IncrementalStepper): a
    time-MLP weight changed in place after the first pass (a checkpoint loaded later) is in the
    next pass, which still equals the whole solve. The flow is a deep copy of one with a stepper
    (as bench/random_model.py's casts are): the copied stepper works on the copy's modules."""
    flow64.incremental_stepper()  # the copy below copies a stepper too: its layout must name the copy's modules
    flow = copy.deepcopy(flow64)
    prompt, tokens = _prompt(20, 4), torch.tensor([_tokens(40, 4)], dtype=torch.int32)
    item = _item(prompt, tokens, finalize=True)
    incremental_mel(flow, item, FlowCache())
    with torch.no_grad():
        flow.decoder.estimator.time_mlp.linear_2.weight.mul_(3.0)
        flow.decoder.estimator.mid_blocks[0][0].mlp[1].bias.add_(0.5)
    inc = incremental_mel(flow, item, FlowCache())[:, :, 40:]  # nothing cached: from the prompt's start
    ref = flow.inference_batch([item])[0]
    assert inc.shape == ref.shape and torch.allclose(inc, ref, atol=1e-9)


def test_switch_is_validated_and_cosyvoice3_ignores_it():
    cv3 = _model("cosyvoice3")
    with pytest.raises(ValueError):
        Token2Wav(cv3.spec, cv3.flow, cv3.hift, cv2_flow="fast")
    prompt, tokens = _prompt(20, 4), _tokens(60, 4)
    ref, _ = _stream(Token2Wav(cv3.spec, cv3.flow, cv3.hift), prompt, tokens)
    inc, state = _stream(Token2Wav(cv3.spec, cv3.flow, cv3.hift, cv2_flow="incremental"), prompt, tokens)
    assert all(torch.equal(a, b) for a, b in zip(ref, inc)) and len(ref) == len(inc)
    assert state.flow_cache is None


def test_official_streamed_mel_reproduced_incrementally():
    """The official CosyVoice2 streamed case: each streamed call's mel from the incremental flow
    (the second call solves only its new frames) equals the reference within the case tolerance."""
    cases = [c for c in load_cases() if c.family == "cosyvoice2" and c.name == "token2wav_stream"]
    assert cases, "the parity fixture has no streamed CosyVoice2 token2wav case"
    case = cases[0]
    model = _model("cosyvoice2")
    t2w = Token2Wav(model.spec, model.flow, model.hift, official_final_full_attention=True, cv2_flow="incremental")
    prompt = flow_prompt(case)
    state = t2w.new_stream(prompt, stream=True)
    tokens = case.t("source_speech_token")[0].tolist()
    calls = 0
    while (job := t2w.next_job(state, tokens, llm_done=True)) is not None:
        mel = t2w.flow_mel(job)
        ref = case.t(f"flow{calls}_mel")[:, :, state.token_offset * model.spec.flow.token_mel_ratio:]
        assert_matches(case, f"flow{calls}_mel", mel, expected=ref, tol_key="flow*_mel")
        if not job.finalize:
            assert state.flow_cache.frames == prompt.mel.shape[0] + 2 * (state.token_offset + job.hop)
        t2w.vocode(job, mel)
        calls += 1
    assert calls == len(case.params["flow_calls"]) == 3


def test_incremental_jobs_next_to_the_graphed_recompute(cv2):
    """With the flow's graphs enabled (padded buckets; run eagerly on the CPU) the incremental jobs
    still solve eagerly (the encoder goes through its graphed buckets) and match the graphed recompute."""
    flow = copy.deepcopy(cv2.flow)
    enable_flow_graphs(flow, max_batch=2, max_frames=512, use_graphs=False)
    prompt, tokens = _prompt(20, 6), _tokens(120, 6)
    ref, _ = _stream(Token2Wav(cv2.spec, flow, cv2.hift, min_first_hop=10), prompt, tokens)
    inc, state = _stream(Token2Wav(cv2.spec, flow, cv2.hift, min_first_hop=10, cv2_flow="incremental"), prompt, tokens)
    assert len(ref) == len(inc) >= 3
    for i, (a, b) in enumerate(zip(ref, inc)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=5e-4), f"chunk {i}"
    assert state.flow_frames == 2 * (20 + 120)
