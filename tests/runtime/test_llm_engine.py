"""Continuous batching: the batched engine reproduces the single-request reference exactly."""
from __future__ import annotations

import pytest
import torch

from cosyvoice_runtime.config import LLMSpec, Qwen2Spec
from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.generate import DecodeState, decode_all
from cosyvoice_runtime.llm.model import build_llm
from cosyvoice_runtime.llm.sampling import SamplingParams, make_generator

S = 40  # a small speech vocabulary keeps the random model fast


def tiny_model(family: str = "cosyvoice2", seed: int = 0):
    torch.manual_seed(seed)
    backbone = Qwen2Spec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                         vocab_size=100, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
    model = build_llm(LLMSpec(family=family, backbone=backbone, speech_token_size=S, llm_input_size=32,
                              llm_output_size=32))
    with torch.no_grad():  # sharpen the random head so greedy choices have clear margins
        model.llm_decoder.weight.mul_(8.0)
    return model.eval()


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 32, generator=g) for n in lengths]


def reference(model, lm_input, min_len, max_len, params):
    steps = []
    state = DecodeState(min_len=min_len, max_len=max_len, params=params,
                        generator=make_generator(params.seed))
    tokens = decode_all(model, lm_input, state, on_step=lambda i, h, lg, t: steps.append(lg.clone()))
    return tokens, torch.stack(steps), state.finish_reason


def run_engine(engine, schedule, max_steps=500):
    """``schedule`` maps step index -> list of (rid, lm_input, min_len, max_len, params) to add."""
    tokens, logits, reasons = {}, {}, {}
    for step in range(max_steps):
        for rid, x, lo, hi, params in schedule.get(step, []):
            engine.add_request(rid, x, lo, hi, params)
            tokens[rid], logits[rid] = [], []
        if not engine.has_unfinished() and step > max(schedule):
            break
        for ev in engine.step():
            logits[ev.request_id].append(ev.logits)
            tokens[ev.request_id].extend(ev.tokens)
            if ev.finished:
                reasons[ev.request_id] = ev.finish_reason
    stacked = {k: torch.stack(v) for k, v in logits.items() if v and v[0] is not None}
    return tokens, stacked, reasons


def assert_matches_reference(model, schedule, tokens, logits, reasons):
    """Every scheduled request's tokens and finish reason equal the single-request reference, its
    logits within 1e-4."""
    for reqs in schedule.values():
        for rid, x, lo, hi, params in reqs:
            ref_tokens, ref_logits, ref_reason = reference(model, x, lo, hi, params)
            assert tokens[rid] == ref_tokens, rid
            assert reasons[rid] == ref_reason, rid
            assert (logits[rid] - ref_logits).abs().max() < 1e-4, rid


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_batched_greedy_matches_single_request(family):
    model = tiny_model(family)
    greedy = SamplingParams(method="greedy")
    xs = prompts([3, 9, 17, 30])
    # min_len = max_len: stop ids are masked throughout, so every request decodes to max_len.
    reqs = [(f"r{i}", x, 12 + i, 12 + i, greedy) for i, x in enumerate(xs)]
    engine = LLMEngine(model, max_batch_size=4, max_seq_len=64, return_logits=True)
    tokens, logits, reasons = run_engine(engine, {0: reqs})
    for rid, x, lo, hi, params in reqs:
        ref_tokens, ref_logits, ref_reason = reference(model, x, lo, hi, params)
        assert tokens[rid] == ref_tokens and len(ref_tokens) == hi
        assert reasons[rid] == ref_reason == "length"
        assert (logits[rid] - ref_logits).abs().max() < 1e-4
    assert len(set(map(tuple, tokens.values()))) == len(reqs)  # the requests really differ
    assert engine.num_running() == 0 and engine.scheduler.num_free_slots == 4


def test_requests_joining_mid_run_and_waiting_for_a_slot():
    model = tiny_model()
    greedy = SamplingParams(method="greedy")
    xs = prompts([5, 11, 8, 21, 2], seed=3)
    schedule = {
        0: [("a", xs[0], 6, 6, greedy), ("b", xs[1], 15, 15, greedy), ("c", xs[2], 9, 9, greedy)],
        4: [("d", xs[3], 10, 10, greedy)],
        7: [("e", xs[4], 0, 20, greedy)],  # stop ids allowed at once: may end early
    }
    engine = LLMEngine(model, max_batch_size=2, max_seq_len=48, return_logits=True)
    assert_matches_reference(model, schedule, *run_engine(engine, schedule))


def test_seeded_ras_is_per_request_and_batch_independent():
    model = tiny_model("cosyvoice3")
    xs = prompts([4, 13, 7], seed=5)
    reqs = [(f"s{i}", x, 10, 10, SamplingParams(seed=100 + i)) for i, x in enumerate(xs)]
    engine = LLMEngine(model, max_batch_size=3, max_seq_len=32)
    tokens, _, _ = run_engine(engine, {0: reqs})
    for rid, x, lo, hi, params in reqs:
        assert tokens[rid] == reference(model, x, lo, hi, params)[0]


def test_abort_frees_the_slot_for_a_waiting_request():
    model = tiny_model()
    greedy = SamplingParams(method="greedy")
    xa, xb = prompts([6, 9], seed=7)
    engine = LLMEngine(model, max_batch_size=1, max_seq_len=40)
    engine.add_request("a", xa, 30, 30, greedy)
    engine.add_request("b", xb, 8, 8, greedy)
    assert [ev.request_id for ev in engine.step()] == ["a"]  # b waits: one slot only
    assert engine.num_running() == 1 and engine.num_waiting() == 1
    assert engine.abort("a") is True
    assert engine.scheduler.num_free_slots == 1 and engine.state_of("a") is None
    assert engine.abort("a") is False
    got = []
    while engine.has_unfinished():
        events = engine.step()
        assert all(ev.request_id == "b" for ev in events)
        got += [t for ev in events for t in ev.tokens]
    assert got == reference(model, xb, 8, 8, greedy)[0]
    assert engine.scheduler.num_free_slots == 1


def test_abort_of_a_waiting_request_and_input_validation():
    model = tiny_model()
    engine = LLMEngine(model, max_batch_size=1, max_seq_len=16)
    x = prompts([4])[0]
    engine.add_request("a", x, 2, 4)
    engine.add_request("w", x, 2, 4)
    assert engine.abort("w") and engine.num_waiting() == 1  # "a" is still queued too
    with pytest.raises(KeyError):
        engine.add_request("a", x, 2, 4)
    with pytest.raises(InvalidInputError):
        engine.add_request("long", x, 2, 20)  # 4 + 20 - 1 positions > 16
    with pytest.raises(InvalidInputError):
        engine.add_request("bad", x[:, :5], 2, 4)


def test_stop_token_finishes_without_emitting():
    model = tiny_model()
    with torch.no_grad():  # make eos (S) win from the first step
        model.llm_decoder.bias.zero_()
        model.llm_decoder.bias[S] = 1e4
    engine = LLMEngine(model, max_batch_size=2, max_seq_len=32)
    engine.add_request("x", prompts([5])[0], 0, 10, SamplingParams(method="greedy"))
    events = engine.step()
    assert [(e.tokens, e.finished, e.finish_reason) for e in events] == [([], True, "stop")]
    assert not engine.has_unfinished() and engine.scheduler.num_free_slots == 2


def test_batched_prefill_equals_one_prefill_per_request():
    """One padded forward for several prompts: the same last hidden state, KV contents and slot
    lengths as one prefill each, also on a slot that held a longer sequence before."""
    from cosyvoice_runtime.llm.kv_cache import KVCache

    model = tiny_model()
    xs = prompts([3, 17, 9], seed=7)
    single, batched = (KVCache.for_model(model, 4, 32) for _ in range(2))
    batched.lengths[2] = 25  # stale content of an earlier request (the engine resets the slot)
    batched.reset(2)
    with torch.inference_mode():
        want = torch.stack([model.prefill(x, single, s) for x, s in zip(xs, [0, 2, 3])])
        got = model.prefill_batch(xs, batched, [0, 2, 3])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert batched.lengths == single.lengths == [3, 0, 17, 9]
    for layer in range(len(single.k)):
        for s, n in ((0, 3), (2, 17), (3, 9)):
            torch.testing.assert_close(batched.k[layer][s, :, :n], single.k[layer][s, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(batched.v[layer][s, :, :n], single.v[layer][s, :, :n], atol=1e-5, rtol=1e-5)


def test_requests_admitted_together_are_prefilled_in_one_forward():
    model = tiny_model()
    calls = []
    real = model.prefill_batch
    model.prefill_batch = lambda xs, cache, slots: (calls.append(len(xs)), real(xs, cache, slots))[1]
    greedy = SamplingParams(method="greedy")
    engine = LLMEngine(model, max_batch_size=4, max_seq_len=64, max_prefills_per_step=3)
    reqs = [(f"r{i}", x, 5, 5, greedy) for i, x in enumerate(prompts([4, 10, 6, 8], seed=9))]
    tokens, _, _ = run_engine(engine, {0: reqs})
    assert calls == [3, 1]  # three admitted in the first step, the fourth in the next
    for rid, x, lo, hi, params in reqs:
        assert tokens[rid] == reference(model, x, lo, hi, params)[0]


def test_prefill_token_budget_splits_a_step_into_several_forwards(monkeypatch):
    import cosyvoice_runtime.llm.engine as engine_mod

    monkeypatch.setattr(engine_mod, "PREFILL_TOKEN_BUDGET", 30)
    model = tiny_model()
    calls = []
    real = model.prefill_batch
    model.prefill_batch = lambda xs, cache, slots: (calls.append([x.shape[0] for x in xs]), real(xs, cache, slots))[1]
    greedy = SamplingParams(method="greedy")
    engine = LLMEngine(model, max_batch_size=4, max_seq_len=64)
    reqs = [(f"r{i}", x, 4, 4, greedy) for i, x in enumerate(prompts([4, 10, 6, 20], seed=11))]
    tokens, _, _ = run_engine(engine, {0: reqs})
    assert calls == [[4, 10, 6], [20]]  # 3 rows x 10 = 30 padded positions fit; 4 x 20 would not
    for rid, x, lo, hi, params in reqs:
        assert tokens[rid] == reference(model, x, lo, hi, params)[0]


@pytest.mark.parametrize("static", [False, True])  # eager decode, the static (CUDA-graph) step
@pytest.mark.parametrize("poisoned_call", [0, 3])  # the prefill forward, a decode step
def test_non_finite_logits_fail_that_request_alone(poisoned_call, static):
    """NaN logits in one row (what a numerical fault looks like) end that request with
    NONFINITE_LOGITS; sampling them would raise for the whole batch. The others decode on,
    token for token as alone. The static step marks the row in its one copy to the host."""
    from cosyvoice_runtime.llm.engine import NONFINITE_LOGITS

    model = tiny_model("cosyvoice3")
    xs = prompts([4, 13, 7], seed=5)
    reqs = [(f"s{i}", x, 10, 10, SamplingParams(seed=100 + i)) for i, x in enumerate(xs)]
    engine = LLMEngine(model, max_batch_size=3, max_seq_len=32, static_decode=static)
    assert (engine.runner is not None) == static
    logits_of, calls = model.logits, []

    def poisoned(hidden):
        out = logits_of(hidden)
        if len(calls) == poisoned_call:
            out = out.clone()
            out[1, 3] = float("nan")
        calls.append(out.shape[0])
        return out

    model.logits = poisoned
    tokens, _, reasons = run_engine(engine, {0: reqs})
    failed = [rid for rid, reason in reasons.items() if reason == NONFINITE_LOGITS]
    assert len(failed) == 1 and len(reasons) == 3
    for rid, x, lo, hi, params in reqs:
        if rid not in failed:
            assert tokens[rid] == reference(model, x, lo, hi, params)[0]
    assert not engine.has_unfinished() and engine.scheduler.num_free_slots == 3
