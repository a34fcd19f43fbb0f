"""Parity checkers of the speech LLM: llm_greedy, llm_free_greedy, llm_ras_sampling_seeded, llm_bistream.

Every length, seed and sampler rule is read from the case json; the official behaviours the
fixtures pin down (min-length masking of index S only, bistream re-feed) are reproduced with
``official_quirks=True``.
"""
from __future__ import annotations

import functools
import itertools
from pathlib import Path

import numpy as np
import torch

from cosyvoice_runtime.llm.bistream import BistreamState, bistream_decode
from cosyvoice_runtime.llm.generate import DecodeState, decode, decode_all
from cosyvoice_runtime.llm.inputs import build_lm_input
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.model import build_llm
from cosyvoice_runtime.llm.sampling import SamplingParams, make_generator
from cosyvoice_runtime.weights import load_checkpoint
from cosyvoice_runtime.yaml_config import read_model_spec
from tests.runtime.parity.common import ParityCase, assert_matches, checker


@functools.lru_cache(maxsize=4)
def load_llm(model_dir: Path):
    spec = read_model_spec(model_dir)
    model = build_llm(spec.llm)
    load_checkpoint(model, Path(model_dir) / spec.files["llm"])
    return model.eval().requires_grad_(False)


def _stop_ids(param) -> list[int]:
    """``stop_token_ids`` is a list (CV2) or a {range_start, range_stop_exclusive} dict (CV3)."""
    if isinstance(param, dict):
        return list(range(param["range_start"], param["range_stop_exclusive"]))
    return list(param)


def _inputs(case: ParityCase, model):
    return build_lm_input(model, case.t("text"), case.t("prompt_text"), case.t("prompt_speech_token"))


def _check_limits(case: ParityCase, inp) -> None:
    p = case.params
    if "min_len" in p:
        assert inp.min_len == p["min_len"], f"{case.id}: min_len {inp.min_len} != {p['min_len']}"
    if "max_len" in p:
        assert inp.max_len == p["max_len"], f"{case.id}: max_len {inp.max_len} != {p['max_len']}"


@checker("llm_greedy")
def check_llm_greedy(case: ParityCase) -> None:
    model = load_llm(case.model_dir)
    p = case.params
    inp = _inputs(case, model)
    assert_matches(case, "lm_input", inp.embeds[None])
    _check_limits(case, inp)
    assert inp.embeds.shape[0] == p.get("lm_input_len", inp.embeds.shape[0])
    banned = torch.tensor(_stop_ids(p["stop_token_ids"]))

    def argmax_non_stop(logp: torch.Tensor, state) -> int:
        logp = logp.clone()
        logp[banned] = -float("inf")
        return int(logp.argmax())

    hidden, logits = [], []
    state = DecodeState(min_len=inp.min_len, max_len=inp.max_len)
    cache = KVCache.for_model(model, 1, inp.embeds.shape[0] + p["n_decode"] + 1)
    steps = decode(model, cache, inp.embeds, state, argmax_non_stop, official_quirks=True,
                   on_step=lambda i, h, lg, tok: (hidden.append(h), logits.append(lg)))
    tokens = list(itertools.islice(steps, p["n_decode"]))
    assert_matches(case, "tokens", np.array(tokens, dtype=np.int64))
    assert_matches(case, "step_hidden", torch.stack(hidden))
    assert_matches(case, "step_logits", torch.stack(logits))
    with torch.inference_mode():
        full = torch.cat([inp.embeds, model.embed_speech(torch.tensor(tokens[:-1]))])
        assert_matches(case, "tf_hidden", model(full[None]))


@checker("llm_free_greedy")
def check_llm_free_greedy(case: ParityCase) -> None:
    model = load_llm(case.model_dir)
    p = case.params
    inp = _inputs(case, model)
    _check_limits(case, inp)
    choices: list[int] = []

    def argmax_full(logp: torch.Tensor, state) -> int:
        choices.append(int(logp.argmax()))
        return choices[-1]

    state = DecodeState(min_len=inp.min_len, max_len=inp.max_len)
    tokens = decode_all(model, inp.embeds, state, argmax_full, official_quirks=True)
    assert_matches(case, "tokens", np.array(tokens, dtype=np.int64))
    assert_matches(case, "sampler_choices", np.array(choices, dtype=np.int64), tol_key="tokens")
    assert len(tokens) == p["n_tokens"], f"{case.id}: {len(tokens)} tokens != {p['n_tokens']}"
    stopped = state.finish_reason == "stop"
    assert stopped == p["stopped_by_stop_token"], f"{case.id}: finish reason {state.finish_reason}"
    assert state.stop_token == p["stop_token"], f"{case.id}: stop token {state.stop_token} != {p['stop_token']}"


@checker("llm_ras_sampling_seeded")
def check_llm_ras_sampling_seeded(case: ParityCase) -> None:
    model = load_llm(case.model_dir)
    p = case.params
    inp = _inputs(case, model)
    params = SamplingParams.from_spec(model.spec, top_p=p["top_p"], top_k=p["top_k"], win_size=p["win_size"],
                                      tau_r=p["tau_r"], seed=p["seed"], official_rng=True)
    # torch.manual_seed(seed) seeds the CPU default generator exactly like a fresh seeded one.
    state = DecodeState(min_len=inp.min_len, max_len=inp.max_len, params=params,
                        generator=make_generator(p["seed"], "cpu"))
    cache = KVCache.for_model(model, 1, inp.embeds.shape[0] + p["n_tokens"] + 1)
    tokens = list(itertools.islice(decode(model, cache, inp.embeds, state, official_quirks=True), p["n_tokens"]))
    ref = case.tensors["tokens"].tolist()
    # The json's tolerance is prose ("exact only with identical torch RNG usage"): we make the
    # identical draws, so demand exact equality.
    assert tokens == ref, f"{case.id}: sampled {tokens} != official {ref}"


@checker("llm_bistream")
def check_llm_bistream(case: ParityCase) -> None:
    model = load_llm(case.model_dir)
    spec = model.spec
    p = case.params
    assert tuple(p["mix_ratio"]) == tuple(spec.mix_ratio), f"{case.id}: mix_ratio {spec.mix_ratio}"
    assert p["fill_token"] == spec.fill and p["eos_token"] == spec.eos, f"{case.id}: special ids differ"
    S = spec.speech_token_size
    final_calls = 0

    def test_sampler(logp: torch.Tensor, state) -> int:
        # The fixture's sampler: argmax over speech ids; in the final stage (recognised by an
        # unmasked logp[S]) it returns eos after n_final tokens.
        nonlocal final_calls
        if torch.isinf(logp[S]) and logp[S] < 0:
            return int(logp[:S].argmax())
        final_calls += 1
        return p["eos_token"] if final_calls > p["n_final"] else int(logp[:S].argmax())

    fed, last_hidden = [], []
    text = case.t("text").reshape(-1).tolist()
    cache = KVCache.for_model(model, 1, 4 * (len(text) + case.t("prompt_text").numel()
                                             + case.t("prompt_speech_token").numel()) + 64)
    tokens = list(bistream_decode(model, cache, ([t] for t in text), case.t("prompt_text"),
                                  case.t("prompt_speech_token"), BistreamState(), test_sampler,
                                  official_quirks=True,
                                  on_forward=lambda x, h: (fed.append(x), last_hidden.append(h))))
    assert [f.shape[0] for f in fed] == list(p["fed_lens"]), f"{case.id}: fed lengths {[f.shape[0] for f in fed]}"
    assert len(fed) == p["n_calls"]
    assert_matches(case, "tokens", np.array(tokens, dtype=np.int64))
    assert_matches(case, "fed_embeddings", torch.cat(fed)[None])
    assert_matches(case, "last_hidden", torch.stack(last_hidden))
