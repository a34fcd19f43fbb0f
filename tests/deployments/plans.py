"""The CUDA replica's default plan, run on the CPU (issue 42, ask 7).

A CUDA replica and a CPU replica resolve the "auto" knobs differently (stepped scheduler and
incremental flow on two threads against whole batched solves recomputed on one), so a suite that
only runs on the CPU would test a plan no GPU replica runs. :func:`cuda_default_overrides` is the
synthesizer config under which a CPU replica chooses the CUDA default plan's code paths; what it
cannot run there (CUDA graphs, compiled graphed steps, Triton kernels, run-ahead of the graphed
step, the prompt cache sized from the free GPU memory) is what :func:`without_gpu` takes out of a plan (with it, the background capture of the graphs
left for after ready). ``tests/deployments/test_execution_plan.py``
checks that the two agree, so a new "auto" choice the overrides miss fails there.
"""
from __future__ import annotations

from dataclasses import replace

from deployments.execution_plan import CPU_PROMPT_CACHE_BYTES, ExecutionPlan, FlowPlan, resolve_plan
from deployments.synthesizer_config import SynthesizerConfig

# How far the two plans' audio may differ: the incremental flow against the recompute differs by
# matmul rounding only, which the random-weight tiny vocoder amplifies (~1.4e-4 measured; the
# bound of tests/runtime/test_flow_incremental.py).
AUDIO_TOL = 5e-4


def cuda_default_plan() -> ExecutionPlan:
    """What a CUDA replica of the default config runs (mode pytorch, Triton present)."""
    return resolve_plan(SynthesizerConfig(), "pytorch", "cuda", triton=True)


def cuda_default_overrides() -> dict:
    """Synthesizer config keys that make any replica choose the CUDA default plan's code paths."""
    plan = cuda_default_plan()
    t2w = plan.token2wav
    return {"overlap_stages": plan.overlap_stages,
            "token2wav": {"scheduler": t2w.scheduler, "cv2_flow": t2w.cv2.streamed, "cv3_flow": t2w.cv3.streamed,
                          "cv3_vocoder": t2w.cv3_vocoder}}


def without_gpu(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` less what needs a GPU: the same choices on the CPU."""
    def flow(f: FlowPlan) -> FlowPlan:
        return replace(f, compile_backend=None, fused_norms=False)

    llm = replace(plan.llm, cuda_graphs=False, prefill_graphs=False, compile_backend=None, fused_norms=False,
                  run_ahead=False)
    # "auto" prompt cache: no GPU memory to size it from, so the CPU's fixed size
    prompt_cache = plan.token2wav.prompt_cache_bytes
    t2w = replace(plan.token2wav, cuda_graphs=False, cv2=flow(plan.token2wav.cv2), cv3=flow(plan.token2wav.cv3),
                  prompt_cache_bytes=CPU_PROMPT_CACHE_BYTES if prompt_cache == "auto" else prompt_cache)
    # no graphs to leave to the background capture (deployments/replica_start.py): all "before ready"
    return replace(plan, device="cpu", llm=llm, token2wav=t2w, graphs_before_ready="all")


def synthesizer_config(plan: str, **knobs) -> SynthesizerConfig:
    """A CPU replica's config running ``plan``: "cpu" (its own default) or "cuda-default"."""
    if plan == "cpu":
        return SynthesizerConfig(device="cpu", **knobs)
    if plan != "cuda-default":
        raise ValueError(plan)
    overrides = cuda_default_overrides()
    t2w = {**knobs.pop("token2wav", {}), **overrides.pop("token2wav")}
    return SynthesizerConfig(device="cpu", token2wav=t2w, **overrides, **knobs)
