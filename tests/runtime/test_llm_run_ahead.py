"""The engine running ahead (LLMEngine run_ahead): each decode step queued before the one before
it is read, rows fed that step's ids on the device. Tokens and finish reasons equal the
single-request reference, as the static step's do without it (CPU: the step runs eagerly)."""
from __future__ import annotations

import pytest
import torch

from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.sampling import SamplingParams
from tests.runtime.test_llm_engine import prompts, reference, run_engine, tiny_model


def spy_launches(engine) -> list[list[int]]:
    """The carry list of every launch() (a row >= 0 was fed the step before's id on the device)."""
    carries: list[list[int]] = []
    launch = engine.runner.launch

    def spy(tokens, slots, states, carry):
        carries.append(list(carry))
        return launch(tokens, slots, states, carry)
    engine.runner.launch = spy
    return carries


def _schedule(xs):
    greedy = SamplingParams(method="greedy")
    return {
        0: [("a", xs[0], 6, 6, greedy), ("b", xs[1], 0, 25, SamplingParams(seed=4)),
            ("c", xs[2], 0, 30, SamplingParams(seed=11))],
        3: [("d", xs[3], 2, 10, SamplingParams(seed=9)), ("e", xs[4], 0, 20, SamplingParams(seed=1))],
        5: [("f", xs[5], 4, 12, SamplingParams(method="top_k_top_p", top_k=5, top_p=0.9, temperature=0.7,
                                                seed=2))],
    }


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_running_ahead_equals_the_reference_for_joining_stopping_and_waiting_requests(family):
    model = tiny_model(family)
    schedule = _schedule(prompts([5, 11, 8, 21, 2, 3], seed=3))
    engine = LLMEngine(model, max_batch_size=3, max_seq_len=48, static_decode=True, run_ahead=True)
    carries = spy_launches(engine)
    tokens, _, reasons = run_engine(engine, schedule)
    for reqs in schedule.values():
        for rid, x, lo, hi, params in reqs:
            ref_tokens, _, ref_reason = reference(model, x, lo, hi, params)
            assert tokens[rid] == ref_tokens, rid
            assert reasons[rid] == ref_reason, rid
    # both ends were met (a stop id, whose queued step is dropped, and the length), and most
    # steps fed rows from the device
    assert {"stop", "length"} <= set(reasons.values())
    fed = sum(c >= 0 for carry in carries for c in carry)
    assert fed > 0.7 * sum(len(carry) for carry in carries)
    assert engine._in_flight is None and engine.scheduler.num_free_slots == 3


def test_an_abort_while_its_step_is_in_flight_drops_that_step():
    model = tiny_model()
    xa, xb = prompts([6, 9], seed=7)
    params = SamplingParams(seed=3)
    engine = LLMEngine(model, max_batch_size=2, max_seq_len=48, static_decode=True, run_ahead=True)
    engine.add_request("a", xa, 20, 20, params)
    engine.add_request("b", xb, 15, 15, params)
    got = {"a": [], "b": []}
    for _ in range(4):
        for ev in engine.step():
            got[ev.request_id] += ev.tokens
    assert engine._in_flight is not None and len(engine._in_flight.reqs) == 2
    assert engine.abort("a")
    while engine.has_unfinished():
        events = engine.step()
        assert all(ev.request_id == "b" for ev in events)
        got["b"] += [t for ev in events for t in ev.tokens]
    assert got["b"] == reference(model, xb, 15, 15, params)[0]
    assert got["a"] == reference(model, xa, 20, 20, params)[0][:len(got["a"])] and len(got["a"]) == 3


def test_a_request_sampled_outside_the_step_reads_the_step_in_flight_first():
    """A custom sampler needs each id on the host before the next step: the step in flight is
    read, and steps wait as without running ahead while that request is in the engine."""
    model = tiny_model("cosyvoice3")
    xs = prompts([4, 7, 6], seed=8)
    seeded = SamplingParams(seed=6)
    engine = LLMEngine(model, max_batch_size=3, max_seq_len=32, static_decode=True, run_ahead=True)
    carries = spy_launches(engine)
    engine.add_request("s", xs[0], 12, 12, seeded)
    engine.add_request("t", xs[1], 12, 12, seeded)
    got = {"s": [], "t": [], "c": []}
    for step in range(40):
        if step == 3:
            assert engine._in_flight is not None
            engine.add_request("c", xs[2], 4, 4, sample_fn=lambda logp, state: 3)
            launched = len(carries)
        for ev in engine.step():
            got[ev.request_id] += ev.tokens
        if not engine.has_unfinished():
            break
    assert got["c"] == [3] * 4
    assert got["s"] == reference(model, xs[0], 12, 12, seeded)[0]
    assert got["t"] == reference(model, xs[1], 12, 12, seeded)[0]
    assert len(carries) > launched  # it ran ahead again once "c" had finished


def test_a_step_that_waits_after_running_ahead_skips_rows_its_step_in_flight_ended():
    """The step is planned before the step in flight is read: when this step must wait for it (a
    request sampled outside the step joined), the rows that step in flight ended (here by their
    length) take no further step."""
    model = tiny_model()
    xs = prompts([4, 7], seed=5)
    params = SamplingParams(seed=6)
    engine = LLMEngine(model, max_batch_size=2, max_seq_len=32, static_decode=True, run_ahead=True)
    engine.add_request("a", xs[0], 8, 8, params)
    got = {"a": [], "c": []}
    while not (engine._in_flight is not None and len(engine.state_of("a").tokens) + 1 >= 8):
        for ev in engine.step():
            got[ev.request_id] += ev.tokens
    engine.add_request("c", xs[1], 3, 3, sample_fn=lambda logp, state: 5)  # forces a waiting step now
    while engine.has_unfinished():
        for ev in engine.step():
            got[ev.request_id] += ev.tokens
    assert got["a"] == reference(model, xs[0], 8, 8, params)[0] and len(got["a"]) == 8
    assert got["c"] == [5] * 3 and engine.scheduler.num_free_slots == 2


def test_launch_needs_a_runner_that_feeds_on_the_device():
    engine = LLMEngine(tiny_model(), max_batch_size=1, max_seq_len=16, static_decode=True)
    assert not engine.run_ahead
    with pytest.raises(RuntimeError, match="feed_on_device"):
        engine.runner.launch([1], [0], [None], [-1])


def test_a_step_certain_to_be_the_last_is_not_followed_by_another():
    """A request that ends by its length takes max_len - 1 decode steps (the prefill chose its
    first id), none queued after its last: the slot has room for exactly those (5 + 12 - 1 = 16)."""
    model = tiny_model()
    params = SamplingParams(seed=2)
    x = prompts([5], seed=4)[0]
    engine = LLMEngine(model, max_batch_size=1, max_seq_len=16, static_decode=True, run_ahead=True)
    carries = spy_launches(engine)
    tokens, _, reasons = run_engine(engine, {0: [("a", x, 12, 12, params)]})
    assert tokens["a"] == reference(model, x, 12, 12, params)[0] and reasons["a"] == "length"
    assert sum(len(c) for c in carries) == 11


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_engine_running_ahead_equals_the_graphed_engine(dtype):
    """On CUDA graphs, where the step really is queued before the one before is read."""
    model = tiny_model().to("cuda", dtype)
    xs = [x.cuda() for x in prompts([5, 40, 17, 130], seed=2)]
    reqs = [(f"r{i}", x, 0, 30, SamplingParams(seed=i)) for i, x in enumerate(xs)]
    out = []
    for ahead in (False, True):
        engine = LLMEngine(model, max_batch_size=4, max_seq_len=256, use_cuda_graphs=True, run_ahead=ahead)
        engine.capture_graphs()
        out.append(run_engine(engine, {0: reqs[:2], 3: reqs[2:]}))
    assert out[0][0] == out[1][0] and out[0][2] == out[1][2]
