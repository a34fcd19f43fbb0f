"""Bistream state machine (§3.8): interleaving, forced fills, final stage, quirk switches."""
from __future__ import annotations

import pytest
import torch

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID, LLMSpec, Qwen2Spec
from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.llm.bistream import BistreamError, BistreamState, bistream_decode, first_fill_index
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.model import build_llm

S = 30


def tiny(family="cosyvoice2"):
    torch.manual_seed(0)
    backbone = Qwen2Spec(16, 1, 2, 1, 32, ENDOFPROMPT_TOKEN_ID + 1, 1e-6, 1e6, True)
    return build_llm(LLMSpec(family=family, backbone=backbone, speech_token_size=S, llm_input_size=16,
                             llm_output_size=16)).eval()


def speech_then_eos(eos, n_final):
    """argmax over speech ids; in the final stage, eos after n_final tokens."""
    final_calls = [0]

    def fn(logp, state):
        if state.final:
            final_calls[0] += 1
            if final_calls[0] > n_final:
                return eos
        return int(logp[:S].argmax())

    return fn


def run(model, text, prompt_text, prompt_speech, quirks, n_final=4, sample_fn=None, **kw):
    fn = speech_then_eos(model.spec.eos, n_final)
    fed = []
    cache = KVCache.for_model(model, 1, 256)
    state = BistreamState()
    tokens = list(bistream_decode(model, cache, ([t] for t in text), prompt_text, prompt_speech, state,
                                  sample_fn or fn, official_quirks=quirks,
                                  on_forward=lambda x, h: fed.append(x), **kw))
    return tokens, fed, state, cache


def test_first_fill_index():
    assert [first_fill_index(p, 15, False) for p in (0, 1, 14, 15, 20, 30)] == [15, 14, 1, 0, 10, 0]
    assert [first_fill_index(p, 15, True) for p in (0, 15, 20, 30)] == [15, 15, 10, 15]


@pytest.mark.parametrize("quirks", [False, True])
def test_interleaving_and_fill_schedule(quirks):
    model = tiny()
    text, prompt_text, prompt_speech = list(range(40, 52)), list(range(1, 7)), list(range(20))
    tokens, fed, state, cache = run(model, text, prompt_text, prompt_speech, quirks)
    lens = [f.shape[0] for f in fed]
    # sos + (5 text + 15 speech) + (5 text + 5 speech), then 10 tokens to the forced fill,
    # 5 text, 15 tokens + fill, then final stage: 3 text + task_id (+ the re-fed input).
    assert lens == [31] + [1] * 10 + [5] + [1] * 15 + [5 if quirks else 4] + [1] * 4
    fills = [i for i, t in enumerate(state.tokens) if t == model.spec.fill]
    assert fills == [10, 26]
    assert len(tokens) == 10 + 15 + 4 and all(t < S for t in tokens)
    assert cache.lengths[0] == sum(lens)
    if quirks:  # the official re-feeds the last already-cached input at the final stage
        assert torch.equal(fed[-5][0], fed[-6][0])


def test_default_fill_right_away_after_whole_prompt_groups():
    model = tiny()
    _, _fed, state, _ = run(model, list(range(40, 55)), list(range(1, 6)), list(range(15)), quirks=False)
    assert state.tokens[0] == model.spec.fill  # one full group of prompt speech -> ask for text now
    _, _, state_q, _ = run(model, list(range(40, 55)), list(range(1, 6)), list(range(15)), quirks=True)
    assert state_q.tokens[0] != model.spec.fill and state_q.tokens[15] == model.spec.fill


def test_cv3_prefix_is_not_interleaved_and_is_required():
    model = tiny("cosyvoice3")
    prompt_text = [7, ENDOFPROMPT_TOKEN_ID, 1, 2, 3]
    _, fed, _, _ = run(model, list(range(40, 52)), prompt_text, list(range(20)), quirks=True)
    assert fed[0].shape[0] == 1 + 2 + 20 + 10
    assert torch.equal(fed[0][1:3], model.embed_text(torch.tensor(prompt_text[:2])))
    with pytest.raises(InvalidInputError):
        run(model, [40, 41], [1, 2], [3], quirks=False)


def test_default_keeps_unpaired_prompt_speech_and_caps_length():
    model = tiny()
    never_eos = lambda logp, state: int(logp[:S].argmax())
    tokens, fed, _, _ = run(model, [40, 41], [1, 2], list(range(20)), quirks=False, sample_fn=never_eos)
    # too little text to pair any prompt speech: all of it follows task_id in the only prefill
    assert fed[0].shape[0] == 1 + 4 + 1 + 20
    assert torch.equal(fed[0][5], model.task_id_embedding())
    assert len(tokens) == int(2 * model.spec.max_token_text_ratio)


def test_quirk_mode_raises_on_a_forbidden_control_id():
    model = tiny()
    bad = lambda logp, state: S + 1  # CV2's unused id
    with pytest.raises(BistreamError):
        run(model, list(range(40, 52)), list(range(1, 7)), list(range(20)), quirks=True, sample_fn=bad)
