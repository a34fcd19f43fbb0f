"""bench/timed_runtime.py: the H200's times without a GPU, and ``bench/capacity.py --timed``."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from bench import timed_runtime as timed
from bench.capacity import main, timed_config
from cosyvoice_runtime.lm_messages import LMRequest
from deployments.protocol import PreparedRequest, TextPiece, VoicePrompt
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from serve_app.args import AppArgs, application_of

# One incremental flow pass on the H200, 2026-12-05 (bench/results/2026-12-05-h200-capacity/capacity-h200-2026-12-05.md §2,
# CosyVoice2 column): (batch, cached frames) -> ms.
H200_PASS_MS = {(1, 0): 3.90, (1, 1024): 5.11, (4, 512): 5.67, (4, 1024): 6.72, (16, 0): 8.64, (16, 512): 11.40,
                (16, 1024): 14.06}


def test_the_pass_time_fits_the_seven_h200_points_within_a_quarter_millisecond():
    for (batch, cached), ms in H200_PASS_MS.items():
        assert abs(1e3 * timed.H200.pass_s(batch, cached) - ms) < 0.25, (batch, cached)


def test_the_decode_step_goes_from_the_one_stream_to_the_48_stream_p50():
    assert 1e3 * timed.H200.step_s(1) == pytest.approx(2.7)
    assert 1e3 * timed.H200.step_s(48) == pytest.approx(4.2)
    assert 1e3 * timed.H200.step_s(0) == pytest.approx(2.7)  # an idle step costs what one row does
    assert 1e3 * timed.H200.step_s(1, admitted=2) == pytest.approx(2.7 + 2 * 5.0)  # and each prefill it runs


def test_spend_sleeps_the_gpu_share_and_spins_the_host_share(monkeypatch):
    slept, now = [], iter([0.0, 0.0, 0.2, 0.31])  # host end at 0.3 s: spins until the clock passes it
    monkeypatch.setattr(timed.time, "perf_counter", lambda: next(now))
    monkeypatch.setattr(timed.time, "sleep", slept.append)
    timed.spend(2.0, 0.15)
    assert slept == [pytest.approx(1.7)]


def _prompt(tokens: int) -> VoicePrompt:
    return VoicePrompt(family="cosyvoice2", text_tokens=np.arange(3, dtype=np.int32),
                       speech_tokens=np.arange(tokens, dtype=np.int32), mel=np.zeros((2 * tokens, 80), np.float32),
                       embedding=np.ones(192, np.float32))


def _no_time(monkeypatch) -> list[float]:
    spent = []
    monkeypatch.setattr(timed, "spend", lambda s, host_frac: spent.append(s))
    return spent


def test_chunk_schedule_is_cosyvoice2s_early_first_chunk_then_25_token_hops(monkeypatch):
    spent = _no_time(monkeypatch)
    t2w = timed.TimedToken2Wav(timed.SharedGpu(timed.H200))
    state = t2w.new_stream(_prompt(87), stream=True, speed=1.0, seed=None)
    # 87 prompt tokens: the first chunk ends on the 100-token attention boundary (13 tokens >= 10)
    assert t2w.tokens_needed(state) == 13 + 3
    tokens = [1] * 70
    assert t2w.next_job(state, tokens[:15], llm_done=False) is None
    hops = []
    while (job := t2w.next_job(state, tokens, llm_done=True)) is not None:
        rows = t2w.start_solves([job])
        assert rows[0].cached == 2 * (87 + state.offset) and rows[0].frames == 2 * job.tokens
        for _ in range(t2w.n_steps):
            t2w.advance(rows)
        (audio,) = t2w.finish(rows)()
        assert len(audio) == job.tokens * timed.SAMPLES_PER_TOKEN
        hops.append((job.tokens, job.finalize))
    assert hops == [(13, False), (25, False), (25, False), (7, True)]
    assert t2w.tokens_needed(state) is None
    # one encoder batch, ten passes and one vocoder batch per job, at the model's times (the
    # vocoder's host share at finish; its GPU share is slept out by the wait for the audio)
    assert spent[:12] == ([timed.H200.encoder_s()] + [timed.H200.pass_s(1, 174)] * 10
                          + [timed.H200.vocoder_s(1) * timed.H200.host_frac])


def test_a_decode_step_inside_a_token2wav_call_is_slowed_by_the_contention_factor(monkeypatch):
    spent, now = _no_time(monkeypatch), [100.0]
    monkeypatch.setattr(timed.time, "perf_counter", lambda: now[0])
    times = replace(timed.H200, llm_slowdown=0.4)
    gpu = timed.SharedGpu(times)
    gpu.step(2, 0)  # the GPU is the LLM's alone
    gpu.t2w(0.010)  # a flow pass holds it 10 ms from t = 100 s
    now[0] = 100.009
    gpu.step(2, 0)  # starts inside the pass
    now[0] = 100.011
    gpu.step(2, 0)  # after it
    gpu.t2w_holds(0.005)  # the vocoder's GPU share, waited for off this thread
    gpu.step(2, 1)
    assert spent == [times.step_s(2), 0.010, 1.4 * times.step_s(2), times.step_s(2), 1.4 * times.step_s(2, 1)]
    assert timed.SharedGpu(timed.H200).times.llm_slowdown == 0  # the H200 profile: lanes overlap perfectly


def test_finish_refuses_unsolved_rows(monkeypatch):
    _no_time(monkeypatch)
    t2w = timed.TimedToken2Wav(timed.SharedGpu(timed.H200))
    state = t2w.new_stream(_prompt(10), stream=False, speed=1.0, seed=None)
    rows = t2w.start_solves([t2w.next_job(state, [1] * 5, llm_done=True)])
    with pytest.raises(ValueError, match="solve is done"):
        t2w.finish(rows)


def test_the_engine_gives_20_tokens_per_text_id_one_per_step(monkeypatch):
    spent = _no_time(monkeypatch)
    engine = timed.timed_engine(max_running=1, gpu=timed.SharedGpu(timed.H200))
    engine.add("a", LMRequest(np.arange(2), np.arange(0), np.arange(0)))
    engine.add("b", LMRequest(np.arange(1), np.arange(0), np.arange(0)))
    steps = []
    while engine.has_unfinished():
        steps.append([(e.request_id, e.finished) for e in engine.step()])
    assert len(steps) == 60 and steps[39] == [("a", True)] and steps[-1] == [("b", True)]
    assert engine.num_running() == 0
    # the step admitting a request pays its prefill; "b" waits for the one slot
    assert spent[0] == timed.H200.step_s(1, admitted=1) and spent[1] == timed.H200.step_s(1)
    assert spent[40] == timed.H200.step_s(1, admitted=1)


def test_every_profile_is_a_runtime_factory_with_its_host_share():
    cfg = SynthesizerConfig(device="cpu")
    for name, factory in timed.PROFILES.items():
        assert factory is getattr(timed, name)  # the config names it bench.timed_runtime:<name>
        runtime = factory(cfg, None)
        assert runtime.details["t2w_scheduler"] == "steps" and runtime.engine.max_running == cfg.max_running
    assert timed.h200(cfg, None).token2wav.times.host_frac == 0.15
    assert timed.h200_gil(cfg, None).token2wav.times.host_frac == 0.5


def test_a_synthesizer_on_the_timed_runtime_streams_the_whole_utterance(monkeypatch):
    """The real deployment code (engine loop, stepped token2wav driver) over the timed runtime."""
    _no_time(monkeypatch)
    cfg = SynthesizerConfig(runtime_factory="bench.timed_runtime:h200", device="cpu", warmup=False, gc_freeze=False,
                            token2wav={"scheduler": "steps"})
    synth = Synthesizer(cfg)
    assert synth.stepped is not None and synth.runtime.details["timing_model"].startswith("H200 times")
    req = PreparedRequest(request_id="r1", pieces=[TextPiece("x", np.arange(4, dtype=np.int32))], prompt=_prompt(87),
                          llm_prompt_text_ids=np.zeros(0, np.int32), llm_use_prompt_speech=True, stream=True)

    async def run():
        return [len(c.samples) async for c in synth.synthesize(req)]

    try:
        sizes = asyncio.run(run())
    finally:
        synth.compute.shutdown()
    assert sum(sizes) == 80 * timed.SAMPLES_PER_TOKEN  # 4 text ids x 20 tokens
    assert sizes[0] == 13 * timed.SAMPLES_PER_TOKEN


def test_timed_config_puts_the_synthesizer_on_the_timed_runtime(tmp_path, monkeypatch):
    monkeypatch.delenv("FAST_COSY_MODEL_DIR", raising=False)
    path = timed_config(Path("configs/single-gpu.yaml"))
    app = application_of(yaml.safe_load(path.read_text()))
    args = AppArgs.model_validate(app["args"])  # still a valid app
    synth = app["args"]["synthesizer"]
    assert synth["runtime_factory"] == "bench.timed_runtime:h200" and synth["device"] == "cpu"
    assert synth["resources"] == {"num_cpus": 4, "num_gpus": 0} and synth["token2wav"]["scheduler"] == "steps"
    assert synth["token2wav"]["max_batch_size"] == 16  # the rest of the config is kept
    assert args.tiny_family == "cosyvoice2"  # the frontend's tokenizer: no model configured here
    gil = application_of(yaml.safe_load(timed_config(Path("configs/single-gpu.yaml"), "h200_gil").read_text()))
    assert gil["args"]["synthesizer"]["runtime_factory"] == "bench.timed_runtime:h200_gil"
    with pytest.raises(ValueError, match="unknown timing profile 'a100'"):
        timed_config(Path("configs/single-gpu.yaml"), "a100")
    monkeypatch.setenv("FAST_COSY_MODEL_DIR", str(tmp_path))
    assert "tiny_family" not in application_of(yaml.safe_load(timed_config(Path("configs/single-gpu.yaml")).read_text()))["args"]


def test_a_timed_run_reports_but_leaves_latest_json_alone(tmp_path, monkeypatch):
    _no_time(monkeypatch)
    monkeypatch.delenv("FAST_COSY_MODEL_DIR", raising=False)
    (tmp_path / "latest.json").write_text(json.dumps({"slo_streams": 42}))
    latest = main(["--level", "synth", "--timed", "--config", "configs/single-gpu.yaml", "--window-s", "2",
                   "--ramp-s", "0.2", "--start", "1", "--max-sessions", "1", "--c1-window-s", "1", "--no-open-loop",
                   "--mix", "1:1-2", "--ttfa-ms", "60000", "--out", str(tmp_path), "--workload", "synthetic"])
    assert json.loads((tmp_path / "latest.json").read_text()) == {"slo_streams": 42}
    assert latest["slo_streams"] == 1
    doc = json.loads(next(tmp_path.glob("capacity-synth-cpu-*-timed-h200.json")).read_text())
    assert "timing model: H200 times, no GPU" in doc["workload"]["model"] and doc["workload"]["timing_model"] == "h200"
    report = next(tmp_path.glob("capacity-synth-cpu-*-timed-h200.md")).read_text()
    assert "**No model ran**" in report and "Random weights" not in report


def test_the_h100_profile_runs_the_calibrated_replica_on_the_production_workloads_lengths(tmp_path, monkeypatch):
    """``--timed h100``: the live ramp's replica; real text would run to 20 tokens a text id, so the
    default workload becomes its lengths as one-word requests, and the report says so."""
    _no_time(monkeypatch)
    monkeypatch.delenv("FAST_COSY_MODEL_DIR", raising=False)
    main(["--level", "synth", "--timed", "h100", "--config", "configs/single-gpu.yaml", "--window-s", "2",
          "--ramp-s", "0.2", "--start", "1", "--max-sessions", "1", "--c1-window-s", "1", "--no-open-loop",
          "--ttfa-ms", "60000", "--out", str(tmp_path)])
    doc = json.loads(next(tmp_path.glob("capacity-synth-cpu-*-timed-h100.json")).read_text())
    assert doc["workload"]["name"] == "production-lengths" and doc["workload"]["lengths_of"]["name"] == "production"
    assert "bench/results/" in doc["workload"]["model"]  # the calibration reading the replica was scaled to
    report = next(tmp_path.glob("capacity-synth-cpu-*-timed-h100.md")).read_text()
    assert "Workload **production-lengths**: the drawn lengths of the `production` workload" in report
