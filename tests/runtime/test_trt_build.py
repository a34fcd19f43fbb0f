"""Offline build CLI: without TensorRT it writes (and checks) the ONNX, then exits 2 with what
to install. With TensorRT and a GPU (``-m trt``) it builds plans a replica loads and that match
torch."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from cosyvoice_runtime.trt import build
from tests.runtime.parity.common import parity_dir

HAS_TRT = importlib.util.find_spec("tensorrt") is not None


@pytest.mark.skipif(HAS_TRT and torch.cuda.is_available(), reason="TensorRT and a GPU are present: the plan builds")
def test_without_tensorrt_onnx_is_written_then_exit_2(tmp_path, caplog):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    model = parity_dir() / "cosyvoice3" / "model"
    with caplog.at_level("INFO"):
        rc = build.main(["--model-dir", str(model), "--out", str(tmp_path), "--attention", "chunk", "--max-batch", "3"])
    assert rc == build.EXIT_CANNOT_RUN
    path = tmp_path / "estimator.chunk.onnx"
    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == ["x", "mask", "mu", "t", "spks", "cond"]
    text = caplog.text
    assert "onnxruntime matches torch" in text  # the export was checked on CPU
    assert "needs TensorRT" in text and "[trt] extra" in text and str(path) in text
    assert "(6, 80, 3000)" in text  # summary table: 2 x max batch rows, 60 s of frames
    assert not list(tmp_path.glob("*.plan"))


def test_cli_forwards_to_the_builder(monkeypatch, tmp_path, capsys):
    from fastcosy_cli.main import main

    seen = {}

    def fake_main(argv):
        seen["argv"] = argv
        return 2

    monkeypatch.setattr(build, "main", fake_main)
    argv = ["--model-dir", str(parity_dir() / "cosyvoice3" / "model"), "--out", str(tmp_path), "--fp16"]
    assert main(["build-trt", *argv]) == 2
    assert seen["argv"] == argv
    summary = capsys.readouterr().out
    assert "precision    fp16" in summary and "failed (exit 2" in summary


def test_too_small_memory_budget_is_exit_2(tmp_path):
    model = parity_dir() / "cosyvoice2" / "model"
    assert build.main(["--model-dir", str(model), "--out", str(tmp_path), "--max-mem-gb", "0.5"]) == 2
    assert not list(tmp_path.iterdir())  # refused before exporting anything


@pytest.mark.trt
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_built_plan_loads_and_matches_torch(family, tmp_path):
    pytest.importorskip("tensorrt")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from cosyvoice_runtime.flow.flow import build_flow
    from cosyvoice_runtime.trt.engine import load_trt_estimator
    from cosyvoice_runtime.trt.export import dummy_inputs
    from cosyvoice_runtime.trt.profiles import ReplicaLimits, derive_profile
    from cosyvoice_runtime.weights import load_checkpoint
    from cosyvoice_runtime.yaml_config import read_model_spec

    model = parity_dir() / family / "model"
    assert build.main(["--model-dir", str(model), "--out", str(tmp_path), "--max-batch", "2",
                       "--max-total-s", "40"]) == build.EXIT_OK
    spec = read_model_spec(model)
    profile = derive_profile(spec, ReplicaLimits(max_flow_batch=2, max_total_s=40.0))
    est = load_trt_estimator(tmp_path, profile, device="cuda", pool_size=2, flow_checkpoint=model / spec.files["flow"])
    flow = build_flow(spec.flow)
    load_checkpoint(flow, model / spec.files["flow"])
    ref_est = flow.decoder.estimator.eval().cuda()
    for streaming in (False, True):
        args = [a.cuda() for a in dummy_inputs(profile.n_mels, profile.spk_dim, 4, 300, lengths=[300, 250, 200, 9])]
        with torch.inference_mode():
            ref = ref_est(*args, streaming=streaming)
            got = est(*args, streaming=streaming)
        assert torch.isfinite(got).all()
        assert (got - ref).abs().max().item() < 1e-2
