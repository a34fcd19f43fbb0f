"""What a synthesizer replica runs, decided once: :class:`ExecutionPlan` and :func:`resolve_plan`.

Every knob of :class:`~deployments.synthesizer_config.SynthesizerConfig` that chooses a code path
("auto" values, knobs that only run on CUDA or only with graphs, stages a compile excludes) is
resolved here, from the config, the execution mode, the device and what the machine has (Triton),
into a frozen plan (:func:`resolve_plan`; :func:`replica_plan` finds those inputs on this node).
The assembler (:mod:`deployments.assembler`) builds the runtime from the plan, the synthesizer
reads its scheduling decisions from it, and ``/health`` shows it. Nothing here imports torch, so
the whole table of cases is tested on the CPU (``tests/deployments/test_execution_plan.py``).

What a CUDA replica runs by default (mode pytorch, Triton present) is ``resolve_plan(SynthesizerConfig(),
"pytorch", "cuda", triton=True)``: LLM decode and prefill steps through CUDA graphs, run ahead,
with the Triton add + norm kernels; token2wav stepped pass by pass (two passes queued), the
streamed flow incremental for both families (its graphed pass with the fused kernels), the early
first chunk, the incremental CosyVoice3 vocoder, the voice prompt prefix cache sized by the
assembler from the GPU memory free once the replica has started; the two stages on two threads. A CPU replica runs
everything eagerly, the batch scheduler behind the deadline gate and the flow recomputed.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

from deployments.model_source import replica_mode, resolve_device

FAMILIES = ("cosyvoice2", "cosyvoice3")
INDUCTOR = "inductor"  # the torch.compile backend of a compiled stage
GRAPHED_MODES = ("pytorch", "torchscript")  # modes whose token2wav runs through CUDA graphs (trt: its own engine)


@dataclass(frozen=True)
class LLMPlan:
    """The speech LM's decode loop (``cosyvoice_runtime.llm.engine.LLMEngine``)."""

    cuda_graphs: bool  # decode steps replay CUDA graphs per (batch, key window) bucket
    prefill_graphs: bool  # new requests prefilled through graphs too (with the graphed decode step)
    compile_backend: str | None  # torch.compile of the graphed decode step (mode torchscript); None: not compiled
    fused_norms: bool  # each residual add + RMSNorm as one Triton kernel
    run_ahead: bool  # each decode step queued before the one before it has been read


@dataclass(frozen=True)
class FlowPlan:
    """How one family's streamed flow calls are solved."""

    streamed: str  # "incremental" (each stream's estimator state kept) or "recompute" (official)
    compile_backend: str | None  # torch.compile of the graphed incremental pass; None: not compiled
    fused_norms: bool  # the graphed incremental pass's Triton add + LayerNorm kernels


@dataclass(frozen=True)
class Token2WavPlan:
    """Flow + HiFT: scheduling, the flow of each family, the vocoder, the first chunk, budgets."""

    scheduler: str  # "steps" (one Euler pass at a time, deadline first) or "batch" (@serve.batch)
    deadline_gate: bool  # "batch": streams whose audio runs out first go first (deadline_slack_s set)
    give_way_ms: float  # "steps": the LLM waits up to this long while a due chunk job is in hand; 0: never
    cuda_graphs: bool  # flow solves / passes, the CV2 token encoder and the vocoders captured at start
    first_chunk_min_tokens: int | None  # the early first chunk at least this long; None: the official one
    cv2: FlowPlan
    cv3: FlowPlan
    cv3_vocoder: str  # "incremental" (new frames + bounded context) or "recompute" (official)
    passes_in_flight: int  # "steps" on CUDA: flow passes queued on the GPU at once
    # voice prompt prefixes of the incremental flow; 0: off; "auto" (CUDA only): sized from the GPU
    # memory free at load, by the assembler (deployments.assembler.prompt_cache_budget)
    prompt_cache_bytes: int | str
    flow_cache_bytes: int  # the open streams' flow caches together (held under the free GPU memory at load)

    def flow(self, family: str) -> FlowPlan:
        """The streamed flow of a model of ``family`` (the model's own spec says which)."""
        if family not in FAMILIES:
            raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")
        return self.cv2 if family == "cosyvoice2" else self.cv3

    def vocoder_graphs(self, family: str) -> bool:
        """Whether the vocoder of ``family`` is graphed: CosyVoice2's per exact streamed length,
        CosyVoice3's incremental body per padded bucket; its recompute vocodes whole mels (too long)."""
        return self.cuda_graphs and (family == "cosyvoice2" or self.cv3_vocoder == "incremental")


@dataclass(frozen=True)
class ExecutionPlan:
    """Everything a synthesizer replica runs that its config, mode, device and machine decide."""

    mode: str  # pytorch | torchscript | trt
    mode_source: str  # config | env | default
    device: str  # "cpu", "cuda", "cuda:N"
    dtype: str
    overlap_stages: bool  # LLM steps and token2wav on two threads, each with its own CUDA stream
    llm: LLMPlan
    token2wav: Token2WavPlan
    # which CUDA graphs are captured before the replica is ready: "first" (batch 1; the rest in the
    # background once it serves, cosyvoice_runtime.graph_schedule) or "all"
    graphs_before_ready: str = "all"

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain data (``/health``'s ``plan``)."""
        return dataclasses.asdict(self)


def replica_plan(cfg) -> ExecutionPlan:
    """The plan of a replica of ``cfg`` on this node: the mode by the one rule (config, else
    ``$FAST_COSY_MODE``, else pytorch), the device (``auto``: CUDA when there is one, unless
    ``$FAST_COSY_DEVICE``), whether Triton is installed."""
    mode, source = replica_mode(cfg.mode)
    return resolve_plan(cfg, mode, resolve_device(cfg.device), triton_available(), mode_source=source)


def triton_available() -> bool:
    """Whether Triton is installed here (CUDA builds of torch bring it; the CPU wheel does not).
    The kernels check again where they run (``cosyvoice_runtime.kernels.AVAILABLE``)."""
    return importlib.util.find_spec("triton") is not None


CPU_PROMPT_CACHE_BYTES = 1024**3  # cv2_prompt_cache_bytes "auto" off CUDA: the fixed size it had before "auto"


def _auto(configured: str, on_cuda: str, elsewhere: str, cuda: bool) -> str:
    """An "auto" knob: the value measured to pay on CUDA replicas there, the other elsewhere."""
    if configured != "auto":
        return configured
    return on_cuda if cuda else elsewhere


def resolve_plan(cfg, mode: str, device: str, triton: bool, mode_source: str = "config") -> ExecutionPlan:
    """The one resolver of a replica's code paths.

    Args:
        cfg: the replica's :class:`~deployments.synthesizer_config.SynthesizerConfig`.
        mode: the execution mode already resolved (``deployments.model_source.replica_mode``).
        device: the device already resolved (``deployments.model_source.resolve_device``).
        triton: whether Triton is installed (:func:`triton_available`).
        mode_source: where the mode came from (shown with the plan).
    """
    cuda = str(device).startswith("cuda")
    t2w = cfg.token2wav
    llm_graphs = cfg.cuda_graphs and cuda  # the engine ignores graphs off CUDA
    # Mode torchscript compiles the LLM's graphed decode step (the graphs replaying its fused
    # kernels are what it pays for, so CUDA only); inductor fuses the add + norm pairs itself and
    # the two together were never run, so the hand-written kernels stay off in that mode, also
    # where its compile does not apply (graphs off): the rule the replicas have run by.
    llm_compiled_mode = mode == "torchscript" and cuda
    llm = LLMPlan(cuda_graphs=llm_graphs, prefill_graphs=llm_graphs,
                  compile_backend=INDUCTOR if llm_compiled_mode and llm_graphs else None,
                  fused_norms=cfg.fused_norms and triton and cuda and not llm_compiled_mode,
                  run_ahead=cfg.llm_run_ahead and llm_graphs)
    # token2wav's CUDA graphs: pytorch and torchscript modes (trt replaces the estimator)
    t2w_graphs = cfg.cuda_graphs and cuda and mode in GRAPHED_MODES

    def flow(configured: str) -> FlowPlan:
        streamed = _auto(configured, "incremental", "recompute", cuda)
        # the incremental pass's options apply to its graphed stepper (captured at start)
        graphed = streamed == "incremental" and t2w_graphs
        compiled = graphed and (mode == "torchscript" or cfg.flow_compile)
        return FlowPlan(streamed=streamed, compile_backend=INDUCTOR if compiled else None,
                        fused_norms=graphed and cfg.fused_norms and triton and not compiled)

    scheduler = _auto(t2w.scheduler, "steps", "batch", cuda)
    steps = scheduler == "steps"
    token2wav = Token2WavPlan(
        scheduler=scheduler, deadline_gate=not steps and t2w.deadline_slack_s is not None,
        give_way_ms=t2w.give_way_ms if steps else 0.0, cuda_graphs=t2w_graphs,
        first_chunk_min_tokens=t2w.first_chunk_min_tokens if t2w.early_first_chunk else None,
        cv2=flow(t2w.cv2_flow), cv3=flow(t2w.cv3_flow), cv3_vocoder=t2w.cv3_vocoder,
        passes_in_flight=t2w.passes_in_flight,
        # "auto" on CUDA stays for the assembler, which knows the free GPU memory once the model is in
        prompt_cache_bytes=_auto(t2w.cv2_prompt_cache_bytes, "auto", CPU_PROMPT_CACHE_BYTES, cuda),
        flow_cache_bytes=t2w.flow_cache_bytes)
    # two threads on CUDA; on the CPU torch's intra-op threads already share the cores
    overlap = cfg.overlap_stages if cfg.overlap_stages is not None else cuda
    # graphs left to the background capture: only where there are graphs (CUDA)
    before_ready = _auto(cfg.graphs_before_ready, "first", "all", cuda) if llm_graphs else "all"
    return ExecutionPlan(mode=mode, mode_source=mode_source, device=str(device), dtype=cfg.dtype,
                         overlap_stages=overlap, llm=llm, token2wav=token2wav, graphs_before_ready=before_ready)
