"""The static prefill of empty slots (what the prefill CUDA graphs capture) equals the eager prefill."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cosyvoice_runtime.llm.batch_sampling import NONFINITE
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.generate import DecodeState, default_sample_fn, select_tokens
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.prefill_graph import PrefillRunner, default_length_buckets
from cosyvoice_runtime.llm.sampling import SamplingParams, min_len_mask_ids
from tests.runtime.test_llm_engine import assert_matches_reference, prompts, run_engine, tiny_model


def greedy_states(n):
    return [DecodeState(min_len=0, max_len=8, params=SamplingParams(method="greedy")) for _ in range(n)]


def mixed_states(n):
    """Greedy, RAS, top-k/top-p rows with their own seeds; every other row below its min length."""
    kinds = [SamplingParams(method="greedy"), SamplingParams(seed=11),
             SamplingParams(method="top_k_top_p", top_k=5, top_p=0.9, temperature=0.8, seed=12)]
    return [DecodeState(min_len=2 * (i % 2), max_len=8, params=replace(kinds[i % 3], seed=40 + i))
            for i in range(n)]


def test_length_buckets():
    assert default_length_buckets(2048)[:9] == [64, 128, 192, 256, 320, 384, 448, 512, 640]
    assert default_length_buckets(2048)[-1] == 1024
    assert default_length_buckets(300) == [64, 128, 192, 256]
    assert default_length_buckets(40) == [40]


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_runner_equals_eager_prefill_across_buckets_and_groups(family):
    model = tiny_model(family)
    # Seven prompts: two groups of max_batch 4 (the second padded with a scratch row), lengths
    # across buckets, one exactly on a bucket edge (16) and one a position past it (17).
    lengths, slots = [5, 16, 17, 3, 30, 9, 12], [4, 0, 2, 5, 1, 3, 7]
    xs = prompts(lengths, seed=21)
    ref_cache = KVCache.for_model(model, 9, 64)
    ref = model.logits(model.prefill_batch(xs, ref_cache, slots))
    cache = KVCache.for_model(model, 9, 64)
    sentinel = torch.randn_like(cache.k[0][6])
    for layer in range(len(cache.k)):  # slot 6 belongs to no row: the runner must leave it alone
        cache.k[layer][6] = sentinel
    runner = PrefillRunner(model, cache, pad_slot=8, stop_mask_ids=min_len_mask_ids(model.spec), max_batch=4, length_buckets=[8, 16, 32])
    _, got = runner.run(xs, slots, greedy_states(len(xs)))
    assert runner.forwards == 2
    assert got.shape == ref.shape
    assert (got - ref).abs().max() < 1e-5
    assert [cache.lengths[s] for s in slots] == lengths and cache.lengths[6] == 0
    for layer in range(len(cache.k)):
        for s, n in zip(slots, lengths):
            assert torch.allclose(cache.k[layer][s, :, :n], ref_cache.k[layer][s, :, :n], atol=1e-5)
            assert torch.allclose(cache.v[layer][s, :, :n], ref_cache.v[layer][s, :, :n], atol=1e-5)
        assert torch.equal(cache.k[layer][6], sentinel)


def test_runner_fills_only_empty_slots_and_knows_its_largest_bucket():
    model = tiny_model("cosyvoice2")
    cache = KVCache.for_model(model, 3, 64)
    runner = PrefillRunner(model, cache, pad_slot=2, stop_mask_ids=min_len_mask_ids(model.spec), length_buckets=[8, 16])
    assert runner.fits([16, 3]) and not runner.fits([17])
    runner.run(prompts([4], seed=1), [0], greedy_states(1))
    with pytest.raises(ValueError, match="empty slots"):
        runner.run(prompts([4], seed=2), [0], greedy_states(1))


def test_static_engine_prefills_through_the_runner_and_falls_back_for_long_prompts():
    model = tiny_model("cosyvoice3")
    greedy = SamplingParams(method="greedy")
    xs = prompts([6, 40, 11], seed=9)
    schedule = {0: [("a", xs[0], 5, 5, greedy), ("b", xs[1], 7, 7, SamplingParams(seed=3))],
                2: [("c", xs[2], 6, 6, greedy)]}
    engine = LLMEngine(model, max_batch_size=3, max_seq_len=64, return_logits=True, static_decode=True)
    # Prompt "b" (40 positions) is longer than the largest bucket: its step prefills eagerly.
    engine.prefill_runner = PrefillRunner(model, engine.cache, pad_slot=3, stop_mask_ids=min_len_mask_ids(model.spec),
                                          length_buckets=[16, 32])
    result = run_engine(engine, schedule)
    assert engine.prefill_runner.forwards == 1  # "c" alone: "a" shared its step with "b"
    assert_matches_reference(model, schedule, *result)


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_runner_chooses_the_first_tokens_as_the_eager_choice_and_marks_nonfinite_rows(family):
    """The first token of each row comes out of the same forward (no eager sampling after it:
    ~90 launches and two syncs per admission, H100 2026-12-05): greedy, RAS and top-k/top-p rows
    with their seeds and min-length masks equal ``select_tokens`` on the runner's logits; a row
    whose prompt is not finite is marked NONFINITE, the others are unaffected."""
    model = tiny_model(family)
    lengths, slots = [5, 16, 9, 3, 12, 7], [0, 1, 2, 3, 4, 5]
    xs = prompts(lengths, seed=31)
    xs[4] = xs[4].clone()
    xs[4][-1, 0] = float("nan")
    states = mixed_states(len(xs))
    runner = PrefillRunner(model, KVCache.for_model(model, 7, 64), pad_slot=6, stop_mask_ids=min_len_mask_ids(model.spec), max_batch=4,
                           length_buckets=[8, 16])
    ids, logits = runner.run(xs, slots, states)
    assert ids[4] == NONFINITE and not torch.isfinite(logits[4]).all()
    good = [i for i in range(len(xs)) if i != 4]
    expected = select_tokens(model.spec, logits[good], [states[i] for i in good], [default_sample_fn] * len(good))
    assert [ids[i] for i in good] == expected
    # the min-length rows never start with a stop id
    stop = set(min_len_mask_ids(model.spec))
    assert all(ids[i] not in stop for i in good if states[i].min_len > 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_graphs_equal_eager_prefill(dtype):
    model = tiny_model().to("cuda", dtype)
    xs = [x.to("cuda", dtype) for x in prompts([5, 70, 130, 17, 64], seed=4)]
    slots = [0, 1, 2, 3, 4]
    ref_cache = KVCache.for_model(model, 6, 256)
    ref = model.logits(model.prefill_batch(xs, ref_cache, slots))
    cache = KVCache.for_model(model, 6, 256)
    runner = PrefillRunner(model, cache, pad_slot=5, stop_mask_ids=min_len_mask_ids(model.spec), use_graphs=True)
    states = mixed_states(len(xs))
    with torch.inference_mode():
        assert runner.capture() == len(runner.batch_buckets) * len(runner.length_buckets)
        ids, got = runner.run(xs, slots, states)
    tol = 1e-3 if dtype == torch.float32 else 0.1
    assert (got.float() - ref.float()).abs().max() < tol
    # the first tokens chosen in the replay are the ones the engine's eager choice makes from its logits
    assert ids == select_tokens(model.spec, got, states, [default_sample_fn] * len(states))
