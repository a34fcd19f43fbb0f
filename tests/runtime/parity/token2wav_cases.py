"""Parity of the token2wav glue and the whole tts path (flow calls, vocoder glue, chunk schedule).

The case files record the official ``CosyVoice{2,3}Model.tts()`` control flow: which tokens each
flow call received, the mel it returned, the mel and source each vocoder call used, and every
yielded chunk. Stages are compared separately (the case's own advice): our flow output against
``flow{i}_mel``; then our vocoder glue, fed the reference mel of that call (and for CV2 the
recorded random source ``hift{i}_source``), against ``out{i}``.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from cosyvoice_runtime.llm.generate import DecodeState
from cosyvoice_runtime.model import CosyVoiceModel, load_model
from cosyvoice_runtime.pipeline import Pipeline
from cosyvoice_runtime.token2wav import Token2Wav
from cosyvoice_runtime.voice_prompt import VoicePrompt
from tests.runtime.parity.common import ParityCase, assert_matches, checker


@functools.lru_cache(maxsize=4)
def _model(model_dir: str) -> CosyVoiceModel:
    return load_model(model_dir)


def flow_prompt(case: ParityCase) -> VoicePrompt:
    """The case's voice as the flow sees it (prompt text ids where the case has them)."""
    ts = case.tensors
    text = ts["prompt_text"][0] if "prompt_text" in ts else np.zeros(0, np.int32)
    return VoicePrompt(family=case.family, text_tokens=text, speech_tokens=ts["flow_prompt_token"][0],
                       mel=ts["prompt_feat"][0], embedding=ts["flow_embedding"][0])


def _check_schedule_and_chunks(case: ParityCase, model: CosyVoiceModel, tokens: torch.Tensor) -> None:
    params = case.params
    t2w = Token2Wav(model.spec, model.flow, model.hift, official_final_full_attention=True)
    state = t2w.new_stream(flow_prompt(case), stream=bool(params["stream"]), speed=float(params["speed"]))
    flow_calls, hift_calls = params["flow_calls"], params["hift_calls"]
    seed_base = params.get("hift_seed_base")
    produced = []
    while (job := t2w.next_job(state, tokens[0].tolist(), llm_done=True)) is not None:
        i = len(produced)
        assert i < len(flow_calls), f"{case.id}: more flow calls than the official {len(flow_calls)}"
        call = flow_calls[i]
        assert job.tokens.shape[1] == call["n_tokens"], f"{case.id} call {i}: {job.tokens.shape[1]} tokens"
        assert job.finalize == call["finalize"], f"{case.id} call {i}: finalize {job.finalize}"
        ours = t2w.flow_mel(job)
        offset_frames = state.token_offset * model.spec.flow.token_mel_ratio
        if f"flow{i}_mel" in case.tensors:
            # flow{i}_mel is the whole generated part; the glue keeps frames from the token offset on
            ref_chunk = case.t(f"flow{i}_mel")[:, :, offset_frames:]
            assert_matches(case, f"flow{i}_mel", ours, expected=ref_chunk, tol_key="flow*_mel")
        else:
            ref_chunk = ours  # speed case: only the interpolated vocoder input is stored
        if f"hift{i}_source" in case.tensors:
            job.source_override = case.t(f"hift{i}_source")
        elif seed_base is not None:
            state.generator = torch.Generator().manual_seed(int(seed_base) + i)
            if float(params["speed"]) != 1.0:
                # no pre-interpolation mel is stored: check the interpolation, then vocode its reference
                interp = torch.nn.functional.interpolate(ours, size=case.tensors[f"hift{i}_mel"].shape[2], mode="linear")
                assert_matches(case, f"hift{i}_mel", interp, tol_key="flow*_mel")
        audio = t2w.vocode(job, ref_chunk)
        assert audio.numel() == params["chunk_lens"][i], f"{case.id} chunk {i}: {audio.numel()} samples"
        assert_matches(case, f"out{i}", audio[None], tol_key="out*")
        produced.append(audio)
    assert len(produced) == len(flow_calls) == params["n_chunks"], f"{case.id}: {len(produced)} chunks"
    assert len(hift_calls) == len(produced)


@checker("token2wav_nonstream", "token2wav_stream")
def check_token2wav(case: ParityCase) -> None:
    model = _model(str(case.model_dir))
    _check_schedule_and_chunks(case, model, case.t("source_speech_token"))


@checker("token2wav_speed")
def check_token2wav_speed(case: ParityCase) -> None:
    """speed != 1: the vocoder gets the mel interpolated to int(T / speed) frames."""
    model = _model(str(case.model_dir))
    params = case.params
    t2w = Token2Wav(model.spec, model.flow, model.hift, official_final_full_attention=True)
    state = t2w.new_stream(flow_prompt(case), stream=False, speed=float(params["speed"]))
    job = t2w.next_job(state, case.t("source_speech_token")[0].tolist(), llm_done=True)
    assert job is not None and job.finalize and job.tokens.shape[1] == params["flow_calls"][0]["n_tokens"]
    mel = t2w.flow_mel(job)
    interp = torch.nn.functional.interpolate(mel, size=int(mel.shape[2] / state.speed), mode="linear")
    assert_matches(case, "hift0_mel", interp, tol_key="flow*_mel")
    # vocoder on the reference interpolated mel with the fixture's seeded RNG (CV2) / deterministic (CV3)
    seed = params.get("hift_seed_base")
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    if model.spec.hift.causal:
        speech, _ = model.hift.inference(case.t("hift0_mel"), finalize=True)
    else:
        speech, _ = model.hift.inference(case.t("hift0_mel"), generator=generator)
    assert_matches(case, "out0", speech, tol_key="out*")
    # and the real glue produces a chunk of the official length
    state2 = t2w.new_stream(flow_prompt(case), stream=False, speed=float(params["speed"]))
    chunks = t2w.synthesize(state2.prompt, case.t("source_speech_token")[0].tolist(), speed=state2.speed,
                            generator=torch.Generator().manual_seed(0))
    assert [c.numel() for c in chunks] == params["chunk_lens"]


@checker("tts_llm_nonstream")
def check_tts_llm_nonstream(case: ParityCase) -> None:
    """LLM (test sampler: argmax over speech ids, eos after n tokens) + silent filter + token2wav."""
    model = _model(str(case.model_dir))
    params = case.params
    n_forced = int(params["llm_test_sampler_n_tokens"])
    spec = model.spec.llm

    def test_sampler(logp: torch.Tensor, state: DecodeState) -> int:
        if state.step >= n_forced:
            return spec.eos
        return int(torch.argmax(logp[: spec.speech_token_size]))

    pipe = Pipeline(model, official_quirks=True)
    # The case draws the LLM's prompt speech tokens apart from the flow's: the LLM stage gets a
    # voice of its own (zero-shot: it reads the transcript and these tokens).
    llm_voice = dataclasses.replace(flow_prompt(case), speech_tokens=case.tensors["llm_prompt_speech_token"][0])
    tokens = list(pipe.speech_tokens(case.t("text")[0], llm_voice, sample_fn=test_sampler))
    ref = case.tensors["tokens"].tolist()
    assert tokens == ref, f"{case.id}: LLM tokens {tokens} != reference {ref}"
    _check_schedule_and_chunks(case, model, torch.tensor([tokens], dtype=torch.int32))

