"""The throughput benchmark (bench/gpu_bench.py) and the CV3 vocoder benchmark (bench/cv3_vocoder.py)
end to end on the CPU with the tiny model: each arm is the product's replica built from the config
with its overrides (its plan in the report), every request exactly ``--tokens`` long, an arm the
in-process loop cannot measure (the batch scheduler) reported as failed while the others run, the
baseline, the report, the plots and latest.json. The figures themselves come from the GPU lease."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu_bench import main, text_for_tokens
from cosyvoice_runtime.speech_length import target_tokens

LOCAL = str(Path(__file__).resolve().parents[2] / "configs" / "local.yaml")
STEPS = "token2wav.scheduler=steps"


def test_the_text_of_a_request_reads_as_exactly_its_tokens():
    for n in (2, 30, 60, 249, 250, 251, 500, 1000):
        text = text_for_tokens(n, 25)
        assert target_tokens(text, 25, jitter=0) == n, (n, text)
        assert text.count("好") <= 4  # letters carry the length; a few Han characters make it exact


def test_tiny_benchmark_measures_each_arm_through_the_products_replica(tmp_path):
    main(["--size", "tiny", "--config", LOCAL, "--arm", f"recompute:{STEPS}",
          "--arm", f"incremental:{STEPS},token2wav.cv2_flow=incremental", "--arm", "batch",
          "--concurrency", "1,2", "--tokens", "30", "--min-requests", "2", "--baseline-requests", "1",
          "--out", str(tmp_path)])
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["device"] == "cpu" and latest["family"] == "cosyvoice2"
    rows = latest["rows"]
    assert [(r["arm"], r["concurrency"]) for r in rows] == [(a, c) for a in ("recompute", "incremental") for c in (1, 2)]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] >= 2, r
        assert abs(r["audio_s"] - r["requests"] * 30 / 25) < 1e-6  # exactly 30 tokens = 1.2 s each
        assert r["ttfa_p50_ms"] > 0 and r["throughput_x_realtime"] > 0
        assert 0 < r["first_token_ms_p50"] <= r["first_job_ms_p50"] <= r["ttfa_p50_ms"]  # the replica's stamps
        assert r["flow_passes"] > 0 and r["graph_captures"] == 0  # stepped token2wav; no CUDA here
    # what each arm ran is the plan the product resolved from the config and the overrides
    arms = latest["arms"]
    assert arms["recompute"]["overrides"] == STEPS
    assert arms["recompute"]["plan"]["token2wav"]["cv2"]["streamed"] == "recompute"  # CPU: auto is recompute
    assert arms["incremental"]["plan"]["token2wav"]["cv2"]["streamed"] == "incremental"
    assert arms["recompute"]["plan"]["token2wav"]["scheduler"] == "steps"
    assert arms["batch"]["plan"]["token2wav"]["scheduler"] == "batch"  # the plan that could not run in process
    assert latest["baseline_x_realtime"] > 0
    assert latest["speedup_vs_baseline"] == latest["throughput_x_realtime"] / latest["baseline_x_realtime"]
    report = (tmp_path / latest["report"]).read_text()
    assert "arm failed: batch: ValueError: gpu_bench needs token2wav.scheduler steps" in report
    assert "| incremental | token2wav.scheduler=steps, token2wav.cv2_flow=incremental | pytorch, float32, cpu;" in report
    assert len(list(tmp_path.glob("*.png"))) == 2


def test_an_arm_naming_a_key_the_config_lacks_stops_the_run_before_any_arm_runs(tmp_path):
    with pytest.raises(ValueError, match="(?s)arm .typo.: .*token2wav.nope"):
        main(["--size", "tiny", "--config", LOCAL, "--arm", "typo:token2wav.nope=1", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # ~8 s; CosyVoice2's arm test keeps the tool in the default run
def test_tiny_cosyvoice3_benchmark_with_either_vocoder(tmp_path):
    arms = ["incremental", "recompute"]
    main(["--family", "cosyvoice3", "--size", "tiny", "--config", LOCAL, "--concurrency", "2", "--tokens", "60",
          "--min-requests", "2", "--baseline-requests", "0", "--out", str(tmp_path),
          *[f"--arm={a}:{STEPS},token2wav.cv3_vocoder={a}" for a in arms]])
    latest = json.loads((tmp_path / "cosyvoice3-latest.json").read_text())  # not CosyVoice2's latest.json
    assert not (tmp_path / "latest.json").exists()
    assert latest["family"] == "cosyvoice3" and [r["arm"] for r in latest["rows"]] == arms
    assert [latest["arms"][a]["plan"]["token2wav"]["cv3_vocoder"] for a in arms] == arms
    assert latest["baseline"] is None and latest["speedup_vs_baseline"] is None
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
