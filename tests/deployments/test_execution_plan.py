"""deployments.execution_plan: what a replica runs, resolved once, on the CPU for every device.

Two proofs that the plan is what replicas ran before it (issue 42, a refactor):

* a table of cases (cpu / cuda x cv2 / cv3 x mode x knobs) with the plan written out by hand;
* every combination of the knobs that choose a code path, against :func:`_before_the_plan`: the
  rules of ``deployments/runtime_adapter.py`` and ``deployments/synthesizer.py`` as they were
  before the plan (``token2wav_scheduler``, ``torch_compile_backend``, ``fused_norms_where``,
  ``streamed_flow``, the loader's and the runtime's conditions, the synthesizer's overlap / gate /
  give-way choices), copied here verbatim apart from ``llm_compile`` (removed: always off), and
  read as what each stage runs (a compile backend handed to a stage that is not graphed ran nowhere).
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from deployments.execution_plan import ExecutionPlan, replica_plan, resolve_plan, triton_available
from deployments.synthesizer_config import SynthesizerConfig
from tests.deployments import plans

CPU_DEFAULT = {
    "llm.cuda_graphs": False, "llm.prefill_graphs": False, "llm.compile": None, "llm.fused_norms": False,
    "llm.run_ahead": False, "scheduler": "batch", "deadline_gate": True, "give_way_ms": 0.0,
    "t2w.cuda_graphs": False, "first_chunk_min_tokens": 10, "flow": "recompute", "flow.compile": None,
    "flow.fused_norms": False, "vocoder_graphs": False, "cv3_vocoder": "incremental", "passes_in_flight": 2,
    "overlap_stages": False,
}
CUDA_DEFAULT = {
    "llm.cuda_graphs": True, "llm.prefill_graphs": True, "llm.compile": None, "llm.fused_norms": True,
    "llm.run_ahead": True, "scheduler": "steps", "deadline_gate": False, "give_way_ms": 5.0,
    "t2w.cuda_graphs": True, "first_chunk_min_tokens": 10, "flow": "incremental", "flow.compile": None,
    "flow.fused_norms": True, "vocoder_graphs": True, "cv3_vocoder": "incremental", "passes_in_flight": 2,
    "overlap_stages": True,
}
CPU, CUDA = "cpu", "cuda"

# (device, family, mode, triton, knobs) -> what differs from that device's default row
TABLE = [
    (CUDA, "cosyvoice2", "pytorch", True, {}, {}),
    (CUDA, "cosyvoice3", "pytorch", True, {}, {}),
    ("cuda:1", "cosyvoice2", "pytorch", True, {}, {}),
    (CPU, "cosyvoice2", "pytorch", True, {}, {}),
    (CPU, "cosyvoice3", "pytorch", False, {}, {}),
    (CPU, "cosyvoice3", "torchscript", True, {}, {}),  # nothing compiled or graphed off CUDA
    # mode torchscript: the graphed LLM step and incremental pass compiled; no hand-written kernels there
    (CUDA, "cosyvoice2", "torchscript", True, {},
     {"llm.compile": "inductor", "llm.fused_norms": False, "flow.compile": "inductor", "flow.fused_norms": False}),
    # trt: the estimator is TensorRT's; no token2wav graphs, so the pass options apply nowhere
    (CUDA, "cosyvoice2", "trt", True, {}, {"t2w.cuda_graphs": False, "flow.fused_norms": False,
                                           "vocoder_graphs": False}),
    (CUDA, "cosyvoice3", "trt", True, {"flow_compile": True}, {"t2w.cuda_graphs": False, "flow.fused_norms": False,
                                                               "vocoder_graphs": False}),
    (CUDA, "cosyvoice2", "pytorch", False, {}, {"llm.fused_norms": False, "flow.fused_norms": False}),  # no Triton
    (CUDA, "cosyvoice2", "pytorch", True, {"fused_norms": False}, {"llm.fused_norms": False, "flow.fused_norms": False}),
    (CUDA, "cosyvoice2", "pytorch", True, {"flow_compile": True}, {"flow.compile": "inductor", "flow.fused_norms": False}),
    (CUDA, "cosyvoice3", "pytorch", True, {"flow_compile": True, "token2wav": {"cv3_flow": "recompute"}},
     {"flow": "recompute", "flow.fused_norms": False}),
    (CUDA, "cosyvoice2", "pytorch", True, {"flow_compile": True, "token2wav": {"cv3_flow": "recompute"}},
     {"flow.compile": "inductor", "flow.fused_norms": False}),  # cv3_flow is the other family's
    # no graphs: the LLM steps eagerly (no run-ahead), its kernels still fused; token2wav eager
    (CUDA, "cosyvoice2", "pytorch", True, {"cuda_graphs": False},
     {"llm.cuda_graphs": False, "llm.prefill_graphs": False, "llm.run_ahead": False, "t2w.cuda_graphs": False,
      "flow.fused_norms": False, "vocoder_graphs": False}),
    # ... and in mode torchscript the LLM's kernels stay off although its compile applies nowhere
    (CUDA, "cosyvoice2", "torchscript", True, {"cuda_graphs": False},
     {"llm.cuda_graphs": False, "llm.prefill_graphs": False, "llm.run_ahead": False, "llm.fused_norms": False,
      "t2w.cuda_graphs": False, "flow.fused_norms": False, "vocoder_graphs": False}),
    (CUDA, "cosyvoice2", "pytorch", True, {"llm_run_ahead": False}, {"llm.run_ahead": False}),
    (CUDA, "cosyvoice2", "pytorch", True, {"token2wav": {"scheduler": "batch"}},
     {"scheduler": "batch", "deadline_gate": True, "give_way_ms": 0.0}),
    (CUDA, "cosyvoice2", "pytorch", True, {"token2wav": {"scheduler": "batch", "deadline_slack_s": None}},
     {"scheduler": "batch", "give_way_ms": 0.0}),
    (CUDA, "cosyvoice2", "pytorch", True, {"token2wav": {"give_way_ms": 0}}, {"give_way_ms": 0.0}),
    (CUDA, "cosyvoice2", "pytorch", True, {"token2wav": {"early_first_chunk": False}}, {"first_chunk_min_tokens": None}),
    (CUDA, "cosyvoice2", "pytorch", True, {"token2wav": {"first_chunk_min_tokens": 4, "passes_in_flight": 1}},
     {"first_chunk_min_tokens": 4, "passes_in_flight": 1}),
    (CUDA, "cosyvoice3", "pytorch", True, {"token2wav": {"cv3_vocoder": "recompute"}},
     {"cv3_vocoder": "recompute", "vocoder_graphs": False}),
    (CUDA, "cosyvoice2", "pytorch", True, {"token2wav": {"cv3_vocoder": "recompute"}},
     {"cv3_vocoder": "recompute"}),  # CosyVoice2's vocoder is graphed by exact lengths whatever cv3_vocoder says
    (CUDA, "cosyvoice2", "pytorch", True, {"overlap_stages": False}, {"overlap_stages": False}),
    (CPU, "cosyvoice2", "pytorch", True, {"overlap_stages": True}, {"overlap_stages": True}),
    (CPU, "cosyvoice2", "pytorch", True, {"token2wav": {"scheduler": "steps", "cv2_flow": "incremental"}},
     {"scheduler": "steps", "deadline_gate": False, "give_way_ms": 5.0, "flow": "incremental"}),
    (CPU, "cosyvoice2", "pytorch", True, {"flow_compile": True, "token2wav": {"cv2_flow": "incremental"}},
     {"flow": "incremental"}),  # compiled only where graphed
]


def _row(plan: ExecutionPlan, family: str) -> dict:
    llm, t2w = plan.llm, plan.token2wav
    flow = t2w.flow(family)
    return {
        "llm.cuda_graphs": llm.cuda_graphs, "llm.prefill_graphs": llm.prefill_graphs,
        "llm.compile": llm.compile_backend, "llm.fused_norms": llm.fused_norms, "llm.run_ahead": llm.run_ahead,
        "scheduler": t2w.scheduler, "deadline_gate": t2w.deadline_gate, "give_way_ms": t2w.give_way_ms,
        "t2w.cuda_graphs": t2w.cuda_graphs, "first_chunk_min_tokens": t2w.first_chunk_min_tokens,
        "flow": flow.streamed, "flow.compile": flow.compile_backend, "flow.fused_norms": flow.fused_norms,
        "vocoder_graphs": t2w.vocoder_graphs(family), "cv3_vocoder": t2w.cv3_vocoder,
        "passes_in_flight": t2w.passes_in_flight, "overlap_stages": plan.overlap_stages,
    }


@pytest.mark.parametrize("device, family, mode, triton, knobs, differs", TABLE)
def test_the_plan_of_each_case(device, family, mode, triton, knobs, differs):
    plan = resolve_plan(SynthesizerConfig(**knobs), mode, device, triton)
    default = CUDA_DEFAULT if device.startswith("cuda") else CPU_DEFAULT
    assert _row(plan, family) == {**default, **differs}
    assert (plan.mode, plan.device, plan.cuda) == (mode, device, device.startswith("cuda"))


def test_the_plan_is_frozen_plain_data_for_health():
    plan = resolve_plan(SynthesizerConfig(), "pytorch", "cuda", triton=True, mode_source="env")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.llm.cuda_graphs = False
    shown = plan.as_dict()
    assert shown["mode_source"] == "env" and shown["llm"]["run_ahead"] is True
    assert shown["token2wav"]["cv2"] == {"streamed": "incremental", "compile_backend": None, "fused_norms": True}
    # the prompt cache is sized from the free GPU memory by the assembler (the plan keeps "auto")
    assert shown["token2wav"]["flow_cache_bytes"] == 16 * 1024**3 and shown["token2wav"]["prompt_cache_bytes"] == "auto"
    with pytest.raises(ValueError, match="unknown model family"):
        plan.token2wav.flow("cosyvoice1")


def test_a_replica_plans_for_its_nodes_mode_device_and_triton(monkeypatch):
    monkeypatch.setenv("FAST_COSY_DEVICE", "cuda:1")
    monkeypatch.setenv("FAST_COSY_MODE", "torchscript")
    plan = replica_plan(SynthesizerConfig())
    assert (plan.mode, plan.mode_source, plan.device) == ("torchscript", "env", "cuda:1")
    assert plan == resolve_plan(SynthesizerConfig(), "torchscript", "cuda:1", triton_available(), mode_source="env")
    assert replica_plan(SynthesizerConfig(mode="pytorch")).mode_source == "config"  # the config wins


def test_the_cuda_default_plan_runs_on_the_cpu_less_what_needs_a_gpu():
    """The CPU suite's CUDA-plan replicas (tests/deployments/plans.py): a CPU replica of those
    overrides resolves every choice of the CUDA default plan, only graphs, compiled steps, Triton
    kernels and run-ahead off; and that differs from the CPU default in its scheduling and flow."""
    cuda = plans.cuda_default_plan()
    for triton in (False, True):
        on_cpu = resolve_plan(plans.synthesizer_config("cuda-default"), "pytorch", "cpu", triton=triton)
        assert on_cpu == plans.without_gpu(cuda)
    cpu = resolve_plan(plans.synthesizer_config("cpu"), "pytorch", "cpu", triton=False)
    assert (cpu.token2wav.scheduler, cpu.token2wav.cv2.streamed, cpu.token2wav.cv3.streamed, cpu.overlap_stages) \
        == ("batch", "recompute", "recompute", False)
    assert (on_cpu.token2wav.scheduler, on_cpu.token2wav.cv2.streamed, on_cpu.token2wav.cv3.streamed,
            on_cpu.overlap_stages) == ("steps", "incremental", "incremental", True)


def test_llm_compile_is_gone():
    with pytest.raises(ValueError, match="llm_compile"):
        SynthesizerConfig(llm_compile=False)


# ---------------------------------------------------------------------- the rules before the plan
def _token2wav_scheduler(configured, device):
    if configured != "auto":
        return configured
    return "steps" if str(device).startswith("cuda") else "batch"


def _torch_compile_backend(mode, knob, device):
    return "inductor" if (mode == "torchscript" or knob) and str(device).startswith("cuda") else None


def _fused_norms_where(wanted, available, device, compiled):
    return wanted and available and str(device).startswith("cuda") and not compiled


def _streamed_flow(configured, device):
    if configured != "auto":
        return configured
    return "incremental" if str(device).startswith("cuda") else "recompute"


def _before_the_plan(cfg, mode: str, device: str, triton: bool, family: str) -> dict:
    cuda = device.startswith("cuda")
    t2w = cfg.token2wav
    llm_backend = _torch_compile_backend(mode, False, device)  # llm_compile: off (removed)
    llm_fused = _fused_norms_where(cfg.fused_norms, triton, device, compiled=llm_backend is not None)
    scheduler = _token2wav_scheduler(t2w.scheduler, device)
    cv2_flow, cv3_flow = _streamed_flow(t2w.cv2_flow, device), _streamed_flow(t2w.cv3_flow, device)
    flow = cv2_flow if family == "cosyvoice2" else cv3_flow
    flow_backend = _torch_compile_backend(mode, cfg.flow_compile, device) if flow == "incremental" and cfg.cuda_graphs else None
    flow_fused = flow == "incremental" and _fused_norms_where(cfg.fused_norms, triton, device,
                                                              compiled=flow_backend is not None)
    # capture_graphs ran (and applied the incremental pass's compile and kernels) only when
    captured = cfg.cuda_graphs and mode in ("pytorch", "torchscript") and cuda
    # LLMEngine: graphs on CUDA only; the compile backend and run-ahead only with the graphed step
    llm_graphs = cfg.cuda_graphs and cuda
    steps = scheduler == "steps"
    overlap = cfg.overlap_stages if cfg.overlap_stages is not None else cuda  # runtime.device is the plan's
    return {
        "llm.cuda_graphs": llm_graphs, "llm.prefill_graphs": llm_graphs,
        "llm.compile": llm_backend if llm_graphs else None, "llm.fused_norms": llm_fused,
        "llm.run_ahead": cfg.llm_run_ahead and llm_graphs,
        "scheduler": scheduler,
        "deadline_gate": t2w.deadline_slack_s is not None and not steps,
        "give_way_ms": t2w.give_way_ms if steps and t2w.give_way_ms > 0 else 0.0,
        "t2w.cuda_graphs": captured,
        "first_chunk_min_tokens": t2w.first_chunk_min_tokens if t2w.early_first_chunk else None,
        "flow": flow, "flow.compile": flow_backend if captured else None, "flow.fused_norms": flow_fused and captured,
        "vocoder_graphs": captured and (family == "cosyvoice2" or t2w.cv3_vocoder == "incremental"),
        "cv3_vocoder": t2w.cv3_vocoder, "passes_in_flight": t2w.passes_in_flight, "overlap_stages": overlap,
    }


DEVICES, MODES, FAMILIES = ("cpu", "cuda", "cuda:1"), ("pytorch", "torchscript", "trt"), ("cosyvoice2", "cosyvoice3")
FLOWS, BOOLS = ("auto", "recompute", "incremental"), (False, True)


def _same(cfg: SynthesizerConfig, mode: str, device: str, triton: bool) -> None:
    plan = resolve_plan(cfg, mode, device, triton)
    for family in FAMILIES:
        assert _row(plan, family) == _before_the_plan(cfg, mode, device, triton, family), (cfg, mode, device, family)


def test_every_compile_graph_and_kernel_combination_runs_what_it_ran_before_the_plan():
    for device, mode, graphs, fused, triton, flow_compile, ahead, cv2, cv3 in itertools.product(
            DEVICES, MODES, BOOLS, BOOLS, BOOLS, BOOLS, BOOLS, FLOWS, FLOWS):
        cfg = SynthesizerConfig(cuda_graphs=graphs, fused_norms=fused, flow_compile=flow_compile, llm_run_ahead=ahead,
                                token2wav={"cv2_flow": cv2, "cv3_flow": cv3})
        _same(cfg, mode, device, triton)


def test_every_scheduling_combination_runs_what_it_ran_before_the_plan():
    for device, mode, graphs, scheduler, slack, give_way, overlap, early, vocoder in itertools.product(
            DEVICES, MODES, BOOLS, ("auto", "batch", "steps"), (None, 0.5), (0.0, 5.0), (None, False, True),
            BOOLS, ("incremental", "recompute")):
        cfg = SynthesizerConfig(cuda_graphs=graphs, overlap_stages=overlap,
                                token2wav={"scheduler": scheduler, "deadline_slack_s": slack, "give_way_ms": give_way,
                                           "early_first_chunk": early, "cv3_vocoder": vocoder})
        _same(cfg, mode, device, True)


def test_graphs_before_ready_first_on_cuda_with_graphs_else_all():
    """``graphs_before_ready``: auto is "first" where there are graphs (CUDA, cuda_graphs on), and
    a replica without graphs has nothing to leave for the background whatever the config says."""
    def plan(device, **knobs):
        return resolve_plan(SynthesizerConfig(**knobs), "pytorch", device, triton=True).graphs_before_ready

    assert plan("cuda") == "first" and plan("cuda:1", graphs_before_ready="first") == "first"
    assert plan("cuda", graphs_before_ready="all") == "all"
    assert plan("cpu") == "all" and plan("cpu", graphs_before_ready="first") == "all"
    assert plan("cuda", cuda_graphs=False, graphs_before_ready="first") == "all"
    assert resolve_plan(SynthesizerConfig(), "trt", "cuda", triton=True).graphs_before_ready == "first"  # LLM graphs
    assert resolve_plan(SynthesizerConfig(), "pytorch", "cuda", triton=True).as_dict()["graphs_before_ready"] == "first"
