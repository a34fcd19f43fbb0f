"""bench/measure_loop.py over the zero-cost runtime of bench/null_runtime.py: every token becomes
audio, steps are counted, the figures are there (their values are the measurement, not asserted)."""
from __future__ import annotations

import numpy as np

from bench.measure_loop import measure
from bench.null_runtime import HOP, SAMPLES_PER_TOKEN, NullEngine, NullToken2Wav
from cosyvoice_runtime.lm_messages import LMRequest


def test_null_runtime_cuts_hops_and_the_rest_and_frees_slots_in_order():
    engine = NullEngine(max_running=1)
    ids = np.arange(7, dtype=np.int32)  # 14 tokens
    engine.add("a", LMRequest(ids, ids[:0], ids[:0]))
    engine.add("b", LMRequest(ids[:1], ids[:0], ids[:0]))
    t2w = NullToken2Wav()
    state, tokens, jobs = t2w.new_stream(None, stream=True, speed=1.0, seed=None), [], []
    while engine.num_running() + engine.num_waiting():
        for ev in engine.step():
            assert ev.request_id == "a" or not tokens or len(tokens) == 14  # "b" only after "a" left
            if ev.request_id == "a":
                tokens += ev.tokens
                while (job := t2w.next_job(state, tokens, ev.finished)) is not None:
                    jobs.append(job)
    assert [(j.tokens, j.finalize) for j in jobs] == [(HOP, False), (14 - HOP, True)]
    assert [len(a) for a in t2w.run_batch(jobs)] == [HOP * SAMPLES_PER_TOKEN, 2 * SAMPLES_PER_TOKEN]


def test_measure_streams_every_token_through_the_synthesizer():
    row = measure(streams=3, tokens=48, deadline_slack_s=0.5)
    assert row["samples_per_stream"] == [48 * SAMPLES_PER_TOKEN]  # every token of every stream became audio
    assert row["steps"] >= 48  # one token per request and step
    assert row["ms_per_step"] > 0 and row["us_per_token"] > 0
