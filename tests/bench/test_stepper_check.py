"""bench/stepper_check.py on the CPU (tiny model): the stepped and the incremental flow agree with
the whole solve, and the timing tables cover every asked shape (the GPU run is what times them)."""
from __future__ import annotations

import json

import pytest

from bench.stepper_check import main


# CosyVoice2's case under slow (~13 s): CosyVoice3's (~7 s) keeps the tool in the default run
@pytest.mark.parametrize("family", [pytest.param("cosyvoice2", marks=pytest.mark.slow), "cosyvoice3"])
def test_stepper_check_runs_both_passes_on_the_tiny_model(tmp_path, family):
    out = tmp_path / "check.json"
    doc = main(["--family", family, "--size", "tiny", "--device", "cpu", "--dtype", "fp32", "--frames", "256",
                "--batches", "1,2",
                "--incremental", "--cached", "0,256", "--new", "64", "--out", str(out)])
    assert json.loads(out.read_text()) == doc
    assert max(doc["max_err_per_job"]) < 1e-4 * max(1.0, doc["output_scale"])
    inc = doc["incremental"]
    assert len(inc["max_err_per_stream"]) == 4 and max(inc["max_err_per_stream"]) < 1e-4 * max(1.0, doc["output_scale"])
    assert [(t["batch"], t["cached"]) for t in inc["timing"]] == [(1, 0), (1, 256), (2, 0), (2, 256)]
    assert all(t["incremental_pass_ms"] > 0 and t["recomputed_pass_ms"] > 0 for t in inc["timing"])
    assert inc["replays"] == 0 and inc["eager_passes"] > 0  # no CUDA: the padded buckets run eagerly
    assert inc["compiled"] is False


@pytest.mark.slow  # ~30 s of torch.compile on 2 cores; the eager check of both families stays in the default run
def test_stepper_check_compiles_the_incremental_pass_on_request(tmp_path):
    """``--flow-compile``: the incremental pass through torch.compile (the "eager" backend here:
    dynamo's trace without code generation) gives the same mel as the whole solve."""
    doc = main(["--family", "cosyvoice2", "--size", "tiny", "--device", "cpu", "--dtype", "fp32", "--frames", "256",
                "--batches", "1", "--incremental", "--cached", "0,64", "--new", "32", "--flow-compile", "eager"])
    assert doc["flow_compile"] == "eager"
    inc = doc["incremental"]
    assert inc["compiled"] is True
    assert max(inc["max_err_per_stream"]) < 1e-4 * max(1.0, doc["output_scale"])
    assert [(t["batch"], t["cached"]) for t in inc["timing"]] == [(1, 0), (1, 64)]
