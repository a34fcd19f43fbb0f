"""Sampling rules of §3.5-§3.6: kept set, repetition fallback, min-length masks, generators."""
from __future__ import annotations

import math

import pytest
import torch

from cosyvoice_runtime.config import LLMSpec, Qwen2Spec
from cosyvoice_runtime.llm.sampling import (
    SamplingParams,
    greedy,
    make_generator,
    mask_ids_,
    min_len_mask_ids,
    nucleus_keep_count,
    nucleus_sample,
    ras_sample,
    top_k_top_p_sample,
)


def spec(family):
    backbone = Qwen2Spec(32, 2, 4, 2, 64, 100, 1e-6, 1e6, True)
    return LLMSpec(family=family, backbone=backbone, speech_token_size=6561, llm_input_size=32, llm_output_size=32)


def logp_of(probs):
    p = torch.tensor(probs, dtype=torch.float32)
    return (p / p.sum()).log()


@pytest.mark.parametrize("official", [False, True])
def test_kept_set_includes_the_entry_that_crosses_top_p(official):
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    # sums before each entry: 0, .5, .7, .85 -> the third entry (crossing .8) is the last kept
    assert nucleus_keep_count(probs, 0.8, 25, official) == 3
    assert nucleus_keep_count(probs, 0.8, 2, official) == 2  # top_k caps it
    assert nucleus_keep_count(probs, 1.0, 25, official) == 5
    assert nucleus_keep_count(probs, 0.4, 25, official) == 1


def test_nucleus_never_returns_an_id_outside_the_kept_set():
    logp = logp_of([0.05, 0.5, 0.1, 0.2, 0.15])
    gen = make_generator(0)
    picks = {nucleus_sample(logp, 0.8, 25, gen) for _ in range(300)}
    assert picks == {1, 3, 4}  # ids of 0.5, 0.2, 0.15


def test_ras_fallback_masks_the_repeated_pick():
    logp = logp_of([0.97, 0.01, 0.01, 0.01])
    gen = make_generator(1)
    assert all(ras_sample(logp, [5, 6], gen) == 0 for _ in range(50))  # not recent -> nucleus pick
    fallback = [ras_sample(logp, [0], gen) for _ in range(200)]
    assert 0 not in fallback and set(fallback) == {1, 2, 3}
    # only the last win_size ids count
    assert all(ras_sample(logp, [0] + [7] * 10, gen) == 0 for _ in range(50))


def test_ras_draw_sequence_matches_the_official_recipe():
    """nucleus: multinomial over the K kept probs; fallback: multinomial over the full softmax."""
    torch.manual_seed(0)
    logp = torch.randn(60).mul(3).log_softmax(0)
    history = []
    ours, gen = [], make_generator(123)
    for _ in range(40):
        ours.append(ras_sample(logp, ours, gen, official_rng=True))
    ref_gen = make_generator(123)
    for _ in range(40):
        p, ids = logp.softmax(0).sort(descending=True, stable=True)
        kept, acc = [], torch.tensor(0.0)
        for v in p:
            if not (acc < 0.8 and len(kept) < 25):
                break
            acc = acc + v
            kept.append(v)
        pick = int(ids[torch.tensor(kept).multinomial(1, replacement=True, generator=ref_gen)])
        if history[-10:].count(pick) >= 1:
            masked = logp.clone()
            masked[pick] = -math.inf
            pick = int(masked.softmax(0).multinomial(1, replacement=True, generator=ref_gen))
        history.append(pick)
    assert ours == history


def test_same_seed_same_tokens_different_seed_different_tokens():
    logp = torch.randn(200).log_softmax(0)
    draw = lambda seed: [top_k_top_p_sample(logp, g, top_k=50, top_p=0.95)
                         for g in [make_generator(seed)] for _ in range(30)]
    assert draw(7) == draw(7) and draw(7) != draw(8)


def test_top_k_top_p_respects_top_k():
    logp = torch.randn(100).log_softmax(0)
    allowed = set(logp.topk(3).indices.tolist())
    gen = make_generator(0)
    assert {top_k_top_p_sample(logp, gen, top_k=3) for _ in range(200)} <= allowed


def test_greedy_and_masks():
    logp = logp_of([0.1, 0.6, 0.3])
    assert greedy(logp) == 1
    assert greedy(mask_ids_(logp.clone(), [1])) == 2


def test_min_len_mask_default_covers_every_stop_id_quirk_only_index_s():
    cv2, cv3 = spec("cosyvoice2"), spec("cosyvoice3")
    assert min_len_mask_ids(cv2) == (6561, 6562, 6563)
    assert min_len_mask_ids(cv3) == tuple(range(6561, 6761)) and cv3.eos in min_len_mask_ids(cv3)
    assert min_len_mask_ids(cv2, official_quirks=True) == (6561,) == (cv2.eos,)
    assert min_len_mask_ids(cv3, official_quirks=True) == (6561,) == (cv3.sos,)  # not eos 6562


def test_sampling_params_validation_and_spec_defaults():
    p = SamplingParams.from_spec(spec("cosyvoice2"), seed=3)
    assert (p.method, p.top_p, p.top_k, p.win_size, p.tau_r, p.seed) == ("ras", 0.8, 25, 10, 0.1, 3)
    with pytest.raises(ValueError):
        SamplingParams(method="beam")
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
