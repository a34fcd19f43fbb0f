"""The streaming benchmark (bench/gpu_bench.py) and the CV3 vocoder benchmark (bench/cv3_vocoder.py)
end to end on the CPU with the tiny model: mode
parsing and plumbing of every extra that runs without CUDA (graph extras run their padded
buckets eagerly there), the baseline, the report, the plots and latest.json. The figures
themselves come from the GPU lease."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from bench.gpu_bench import main
from bench.replica_sim import edf_batch

MODES = ["pytorch-fp32-allgraphs-early-edf-llmcompile", "compile-fp32-early"]


@pytest.mark.slow  # ~60 s on 2 cores (a compiled mode): the CV3 test below keeps the report path in the default run
def test_tiny_benchmark_writes_a_complete_report(tmp_path, caplog):
    main(["--debug", "cosyvoice_runtime", "--size", "tiny", "--device", "cpu", "--modes", ",".join(MODES),
          "--concurrency", "1,2",
          "--tokens", "30", "--min-requests", "2", "--baseline-requests", "1", "--compile-backend", "eager",
          "--out", str(tmp_path)])
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["device"] == "cpu" and latest["family"] == "cosyvoice2"
    rows = latest["rows"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [(m, c) for m in MODES for c in (1, 2)]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] >= 2, r
        assert abs(r["audio_s"] - r["requests"] * 30 / 25) < 1e-6  # forced 30 tokens = 1.2 s each
        assert r["ttfa_p50_ms"] > 0 and r["throughput_x_realtime"] > 0
    assert latest["baseline_x_realtime"] > 0
    assert latest["speedup_vs_baseline"] == latest["throughput_x_realtime"] / latest["baseline_x_realtime"]
    report = (tmp_path / latest["report"]).read_text()
    assert "mode failed" not in report
    assert len(list(tmp_path.glob("*.png"))) == 2
    # --debug: the graph owners' per-capture lines (padded buckets run eagerly on CPU) are shown
    assert any(r.name.startswith("cosyvoice_runtime") and r.levelname == "DEBUG" for r in caplog.records)


def test_tiny_cosyvoice3_benchmark_with_the_incremental_vocoder(tmp_path):
    modes = ["pytorch-fp32-early-edf-vinc", "pytorch-fp32-early-edf"]
    main(["--family", "cosyvoice3", "--size", "tiny", "--device", "cpu", "--modes", ",".join(modes),
          "--concurrency", "2", "--tokens", "60", "--min-requests", "2", "--baseline-requests", "1",
          "--out", str(tmp_path)])
    latest = json.loads((tmp_path / "cosyvoice3-latest.json").read_text())  # not CosyVoice2's latest.json
    assert not (tmp_path / "latest.json").exists()
    assert latest["family"] == "cosyvoice3" and [r["mode"] for r in latest["rows"]] == modes
    for r in latest["rows"]:
        assert r["errors"] == 0 and abs(r["audio_s"] - r["requests"] * 60 / 25) < 1e-6, r


def test_cv3_vocoder_benchmark_times_both_strategies_on_the_same_audio(tmp_path):
    from bench.cv3_vocoder import main as vocoder_main

    vocoder_main(["--size", "tiny", "--device", "cpu", "--seconds", "4", "--batch", "2", "--reps", "1",
                  "--out", str(tmp_path / "cv3v")])
    result = json.loads((tmp_path / "cv3v.json").read_text())
    assert [r["strategy"] for r in result["rows"]] == ["recompute", "incremental"]
    assert sum(result["chunk_frames"]) == 4 * 50 and result["chunk_frames"][:2] == [50, 100]  # 25, 50 tokens
    for r in result["rows"]:
        assert len(r["per_call_ms"]) == r["calls"] == len(result["chunk_frames"]) and r["total_ms"] > 0
        assert r["max_abs_diff_vs_recompute"] < 1e-4
    assert (tmp_path / "cv3v.png").stat().st_size > 0


def _job(n_prompt: int, n_tokens: int):
    return SimpleNamespace(state=SimpleNamespace(prompt=SimpleNamespace(n_tokens=n_prompt)),
                           tokens=torch.zeros(1, n_tokens, dtype=torch.int32))


def test_edf_batch_serves_due_jobs_first_and_lenbatch_keeps_long_ones_out():
    jobs = [("long", _job(87, 400)), ("first", _job(87, 16)), ("second", _job(87, 41)), ("late", _job(87, 20))]
    deadline = {"long": 10.1, "first": 10.0, "second": 10.2, "late": 12.0}
    assert [r for r, _ in edf_batch(jobs, deadline, 10.0, 0.5, 16)] == ["first", "long", "second"]
    assert [r for r, _ in edf_batch(jobs, deadline, 10.0, 0.5, 2)] == ["first", "long"]
    # the first chunk (103 tokens with its prompt) is not padded to the 487-token job
    assert [r for r, _ in edf_batch(jobs, deadline, 10.0, 0.5, 16, length_ratio=1.5)] == ["first", "second"]
    # nothing due: every job is a candidate, still ordered by deadline
    assert [r for r, _ in edf_batch(jobs, deadline, 0.0, 0.5, 16)] == ["first", "long", "second", "late"]
    # a long job at the head takes shorter ones along (they add no padding)
    deadline["long"] = 9.0
    assert [r for r, _ in edf_batch(jobs, deadline, 10.0, 0.5, 16, length_ratio=1.5)] == ["long", "first", "second"]


def test_express_lane_takes_the_first_two_chunks_of_every_stream():
    from bench.gpu_bench import make_model, make_voice, mode_setup
    from bench.replica_sim import EXPRESS_CALLS, ReplicaSim

    base = make_model("cosyvoice2", "tiny", "cpu")
    model, sim_args = mode_setup(base, "pytorch-fp32-early-edf-express", flow_batch=4, n_tokens=120)
    assert sim_args["express"] is not None and sim_args["express"].flow is not model.flow  # own copies
    voice, text = make_voice(model)
    sim = ReplicaSim(model, max_batch=4, n_tokens=120, **sim_args)
    traces, _ = sim.run(voice, text, concurrency=3, total=5)
    assert len(traces) == 5 and all(t.error is None for t in traces)
    assert all(abs(t.audio_s - 120 / 25) < 1e-6 for t in traces)  # every token vocoded once
    lanes = [b[4] for b in sim.batch_log]
    assert set(lanes) == {"bulk", "express"}
    express_jobs = sum(n for _, _, n, _, lane in sim.batch_log if lane == "express")
    firsts_in_bulk = sum(f for _, _, _, f, lane in sim.batch_log if lane == "bulk")
    assert express_jobs == EXPRESS_CALLS * 5 and firsts_in_bulk == 0
    assert not sim.busy and not sim.open


def test_stepped_lane_solves_every_chunk_pass_by_pass():
    from bench.gpu_bench import make_model, make_voice, mode_setup
    from bench.replica_sim import ReplicaSim

    base = make_model("cosyvoice2", "tiny", "cpu")
    model, sim_args = mode_setup(base, "pytorch-fp32-allgraphs-early-edf-prio-steps", flow_batch=4, n_tokens=120)
    assert sim_args["stepped"]  # (CPU: no graphs captured; the flow makes an eager stepper on first use)
    voice, text = make_voice(model)
    sim = ReplicaSim(model, max_batch=4, n_tokens=120, **sim_args)
    traces, _ = sim.run(voice, text, concurrency=3, total=5)
    assert len(traces) == 5 and all(t.error is None for t in traces)
    assert all(abs(t.audio_s - 120 / 25) < 1e-6 for t in traces)  # every token vocoded once
    jobs = sum(n for _, _, n, _, _ in sim.batch_log)
    assert jobs == sim.t2w_jobs and sum(f for _, _, _, f, _ in sim.batch_log) == 5  # one first chunk per stream
    # every job took n_timesteps passes; shared passes make the count smaller than jobs x steps
    stepper = model.flow.stepper
    assert 0 < stepper.passes <= jobs * model.spec.flow.n_timesteps
    assert stepper.eager_calls == stepper.passes  # CPU: the padded buckets run eagerly
    assert not sim.busy and not sim.open
