"""gpu_bench extra ``cvinc``: CosyVoice2's incremental streamed flow reaches every token2wav lane of
the replica simulation, and a tiny closed-loop run with it (whole solves or stepped) completes every request."""
from __future__ import annotations

import json

from bench.gpu_bench import main, make_model, mode_setup
from bench.replica_sim import ReplicaSim


def test_cvinc_reaches_every_token2wav_lane():
    base = make_model("cosyvoice2", "tiny", "cpu")
    for mode, expected in (("pytorch-fp32-early-edf-cvinc", "incremental"), ("pytorch-fp32-early-edf", "recompute")):
        model, sim_args = mode_setup(base, mode, flow_batch=4, n_tokens=60)
        sim = ReplicaSim(model, max_batch=2, n_tokens=60, **sim_args)
        assert [lane.t2w.flow_mode for lane in sim.lanes] == [expected], mode


def test_tiny_benchmark_runs_with_the_incremental_flow(tmp_path):
    modes = ["pytorch-fp32-early-edf-cvinc", "pytorch-fp32-early-edf", "pytorch-fp32-early-edf-steps-cvinc"]
    main(["--size", "tiny", "--device", "cpu", "--modes", ",".join(modes), "--concurrency", "2",
          "--tokens", "60", "--min-requests", "2", "--baseline-requests", "1", "--out", str(tmp_path)])
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert [r["mode"] for r in latest["rows"]] == modes
    for r in latest["rows"]:
        assert r["errors"] == 0 and abs(r["audio_s"] - r["requests"] * 60 / 25) < 1e-6, r
