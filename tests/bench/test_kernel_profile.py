"""bench/kernel_profile.py: the per-step tables from a trace (synthetic events), and a CPU smoke
run of both targets on the tiny model (the GPU run is what counts kernels)."""
from __future__ import annotations

import json

import pytest
import torch
from torch._dynamo.utils import counters

from bench.kernel_profile import category, gap_table, kernel_table, main


@pytest.mark.parametrize(("name", "cat"), [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "attention"),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>", "norm"),
    ("void at::native::index_elementwise_kernel<128, 4>", "copy/index"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("void cudnn::cnn::conv1d_kernel", "convolution"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel", "sampling"),
    ("something_new", "other"),
])
def test_kernels_fall_into_categories_by_name(name, cat):
    assert category(name) == cat


def test_kernel_table_divides_by_the_steps_and_orders_by_time():
    events = [{"cat": "kernel", "name": "nvjet_a", "dur": 10.0}] * 4 + \
             [{"cat": "kernel", "name": "vectorized_layer_norm_kernel", "dur": 2.0}] * 8 + \
             [{"cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 50.0},  # not a kernel
              {"cat": "kernel", "name": "no duration"}]
    t = kernel_table(events, reps=2)
    assert t["kernels_per_step"] == 6 and t["kernel_us_per_step"] == 28.0
    assert list(t["categories"]) == ["gemm", "norm"]
    assert t["categories"]["gemm"] == {"count": 2.0, "us": 20.0}
    assert [k["name"] for k in t["top"]] == ["nvjet_a", "vectorized_layer_norm_kernel"]
    assert t["top"][1]["per_step"] == 4.0 and t["top"][1]["us_each"] == 2.0


def test_idle_stream_time_is_charged_to_the_kernel_that_ends_it():
    """Per stream, in time order; overlapping kernels leave no gap; a copy occupies the stream too;
    host-side events are no stream work."""
    def k(name, ts, dur, tid=7, cat="kernel"):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [k("gemm_b", 20.0, 5.0), k("gemm_a", 0.0, 10.0), k("add", 10.0, 3.0),  # b: 7 us after add
              k("copy_in", 25.0, 1.0, cat="gpu_memcpy"), k("gemm_b", 30.0, 2.0),  # b: 4 us after the copy
              k("inside", 31.0, 0.5), k("other_stream", 100.0, 1.0, tid=9),  # overlapped / alone on its stream
              {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 50.0, "dur": 9.0, "tid": 7}]
    t = gap_table(events, reps=1)
    assert t["gap_us_per_step_traced"] == 11.0
    assert [(g["name"], g["per_step"], g["us_per_step"]) for g in t["gaps_before"]] == [("gemm_b", 2.0, 11.0)]
    assert gap_table(events, reps=2)["gaps_before"][0]["us_per_step"] == 5.5


def test_cpu_smoke_run_profiles_both_targets_and_writes_the_report(tmp_path):
    doc = main(["--device", "cpu", "--size", "tiny", "--dtype", "fp32", "--reps", "2", "--out", str(tmp_path),
                "--tag", "t"])
    assert json.loads((tmp_path / "kernel-profile-t.json").read_text()) == doc
    assert set(doc["targets"]) == {"decode", "flow"}
    for t in doc["targets"].values():
        assert t["kernels_per_step"] > 0 and t["event_ms_per_step"] > 0 and t["gap_us_per_step"] is None
        assert sum(c["count"] for c in t["categories"].values()) == pytest.approx(t["kernels_per_step"])
    # the CPU trace names aten ops: the flow pass runs attention and GEMMs, and its causal
    # convolutions are GEMMs too (the estimators' channels-last forward_cached)
    flow = doc["targets"]["flow"]["categories"]
    assert "attention" in flow and "gemm" in flow and "convolution" not in flow
    assert "## decode" in (tmp_path / "kernel-profile-t.md").read_text()


def test_attention_backends_are_profiled_apart_and_a_refusing_one_is_reported(tmp_path):
    """``--sdpa``: each target once per backend; on the CPU the math backend serves the flow's
    masked attention and cuDNN's cannot (the error is kept, the run goes on)."""
    doc = main(["--device", "cpu", "--size", "tiny", "--dtype", "fp32", "--reps", "2", "--what", "flow",
                "--sdpa", "default,math,cudnn"])
    assert set(doc["targets"]) == {"flow", "flow (math attention)"}
    assert set(doc["errors"]) == {"flow (cudnn attention)"}
    # the math backend spells attention out in ops: more of them than the fused CPU kernel
    assert doc["targets"]["flow (math attention)"]["kernels_per_step"] > doc["targets"]["flow"]["kernels_per_step"]


def test_cosyvoice3_flow_pass_is_profiled_too():
    doc = main(["--device", "cpu", "--size", "tiny", "--dtype", "fp32", "--reps", "2", "--what", "flow",
                "--family", "cosyvoice3"])
    flow = doc["targets"]["flow"]
    assert flow["family"] == "cosyvoice3" and flow["kernels_per_step"] > 0
    assert flow["graph_replays"] == 0 and flow["eager_passes"] > 0  # no graphs on the CPU
    # the DiT's grouped position convolutions run as batched GEMMs (fused.causal_conv_gemm), not
    # as the library's convolution (cuDNN split each into 16, H100 2026-12-06)
    assert "convolution" not in flow["categories"]
    assert "gemm" in flow["categories"] and "attention" in flow["categories"]


def test_the_decode_step_can_be_profiled_compiled():
    """``--compile``: the engine's static step through torch.compile (the "eager" backend here:
    dynamo's trace without code generation), reported as such."""
    torch._dynamo.reset()
    counters.clear()
    doc = main(["--device", "cpu", "--size", "tiny", "--dtype", "fp32", "--reps", "2", "--what", "decode",
                "--compile", "eager"])
    decode = doc["targets"]["decode"]
    assert decode["compile"] == "eager" and decode["kernels_per_step"] > 0
    assert counters["stats"]["unique_graphs"] >= 1  # the step was traced, not only labelled


def test_fused_norms_flag_falls_back_to_the_same_ops_without_a_gpu():
    """``--fused-norms`` on the CPU (no CUDA, no interpreter): the PyTorch composite serves, op for op."""
    args = ["--device", "cpu", "--size", "tiny", "--dtype", "fp32", "--reps", "2"]
    plain, fused = main(args), main([*args, "--fused-norms"])
    for what in ("decode", "flow"):
        assert fused["targets"][what]["fused_norms"] is True and plain["targets"][what]["fused_norms"] is False
        assert fused["targets"][what]["kernels_per_step"] == plain["targets"][what]["kernels_per_step"]
