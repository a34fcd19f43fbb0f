"""The one assembler of a synthesizer replica's runtime: :func:`assemble` builds the model, the
token engine and token2wav from an :class:`~deployments.execution_plan.ExecutionPlan`.

It decides nothing the plan decides: it loads the weights on the plan's device in the plan's mode,
fits the flow limits, the flow cache budget and the prompt prefix cache to the memory this replica has (facts known only
once the weights are in), captures the CUDA graphs the plan names, and hands each executor its
part of the plan. :func:`load_synthesis_runtime` is the production ``runtime_factory``'s body.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from deployments.execution_plan import ExecutionPlan, replica_plan
from deployments.runtime_adapter import RuntimeToken2Wav, RuntimeTokenEngine
from deployments.runtime_protocol import SynthesisRuntime

logger = logging.getLogger(__name__)

VOCODER_GRAPH_MAX_FRAMES = 512  # ~10 s of audio; whole-utterance (unstreamed) calls beyond it run eagerly
FLOW_CACHE_FREE_SHARE = 0.5  # the flow caches may fill at most this share of the GPU memory free after start
# token2wav.cv2_prompt_cache_bytes "auto" (CUDA): this share of the GPU memory still free once the
# flow cache budget is set aside. Conservative because "free" is read when only the first CUDA
# graphs are captured (graphs_before_ready "first": the rest allocate after, in the background),
# and eager calls' activations and the allocator's fragmentation take from it too; the kept
# prefixes are a hit-rate optimisation, never worth an out-of-memory.
PROMPT_CACHE_FREE_SHARE = 0.25
# The floor is the fixed default "auto" replaced (never fewer voices kept than before); the cap
# keeps a large GPU from handing tens of GiB to a least-recently-used list whose oldest voices
# are rarely hit again, and is the flow cache's default budget (token2wav.flow_cache_bytes).
# The flow calls (prompt + audio, seconds) whose graphs a replica captures before it is ready; the
# graphs of longer ones, up to flow_graph_max_s, come after, in the background: 24 s is what the
# cold start of 2026-12-07 captured (111 graphs before ready in 9.8-15.6 s on two H100s), and a
# fresh replica's first calls are rarely longer
FIRST_READY_FLOW_S = 24.0
PROMPT_CACHE_FLOOR_BYTES = 1024**3
PROMPT_CACHE_CAP_BYTES = 16 * 1024**3


def replica_limits(cfg, model, dtype_bytes: int):
    """The flow batch / call sizes this replica accepts: the config, fitted to ``max_mem_gb``."""
    from cosyvoice_runtime.errors import ModelLoadError
    from cosyvoice_runtime.trt.profiles import ReplicaLimits, fit_to_memory

    limits = ReplicaLimits(max_flow_batch=cfg.token2wav.max_batch_size)
    if cfg.max_mem_gb is None:
        return limits
    weights = sum(p.numel() * p.element_size() for m in (model.llm, model.flow, model.hift) for p in m.parameters())
    try:
        fitted = fit_to_memory(model.spec, cfg.max_mem_gb, limits, weights_bytes=weights, max_running=cfg.max_running,
                               max_model_len=cfg.max_model_len, dtype_bytes=dtype_bytes)
    except ValueError as exc:
        raise ModelLoadError("max_mem_gb", str(exc)) from None
    if fitted != limits:
        logger.warning("max_mem_gb %g lowers the flow limits: batch %d -> %d, longest call %.0f s -> %.0f s",
                       cfg.max_mem_gb, limits.max_flow_batch, fitted.max_flow_batch, limits.max_total_s,
                       fitted.max_total_s)
    return fitted


def gpu_memory_left(device, max_mem_gb: float | None = None) -> tuple[int, int | None]:
    """(GPU memory free now, what of ``max_mem_gb`` the replica has not reserved yet or None
    without it): replicas sharing a GPU set ``max_mem_gb``."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    if max_mem_gb is None:
        return free, None
    return free, max(0, int(max_mem_gb * 2**30) - torch.cuda.memory_reserved(device))


def flow_cache_budget(configured: int, device, max_mem_gb: float | None = None) -> int:
    """``token2wav.flow_cache_bytes``, held under half the GPU memory free now and, with
    ``max_mem_gb`` (replicas sharing a GPU), under what of that budget the replica has not taken
    yet (CUDA; call it once the weights, the KV cache and the graphs are allocated): the default
    16 GiB fits an H200, not what is left of an RTX 5090's 32 GiB."""
    if not str(device).startswith("cuda"):
        return configured
    free, unreserved = gpu_memory_left(device, max_mem_gb)
    budget = min(configured, int(free * FLOW_CACHE_FREE_SHARE))
    if unreserved is not None:
        budget = min(budget, unreserved)
    if budget < configured:
        logger.info("flow cache budget %.1f GiB (%.1f GiB free on the GPU, max_mem_gb %s), not the configured %.1f GiB",
                    budget / 2**30, free / 2**30, max_mem_gb, configured / 2**30)
    return budget


def gpu_free_bytes(device, max_mem_gb: float | None = None) -> int:
    """GPU memory free now for this replica: the device's free memory and, with ``max_mem_gb``
    (replicas sharing a GPU), at most what of that budget the replica has not reserved yet."""
    free, unreserved = gpu_memory_left(device, max_mem_gb)
    return free if unreserved is None else min(free, unreserved)


def prompt_cache_budget(configured: int | str, flow_cache_bytes: int, free_bytes: Callable[[], int]) -> int:
    """``token2wav.cv2_prompt_cache_bytes`` as the plan has it, resolved: an integer as given;
    "auto" (left by the plan on CUDA replicas only) :data:`PROMPT_CACHE_FREE_SHARE` of what
    ``free_bytes()`` reads (call it once the weights, the KV cache and the first graphs are
    allocated) less the flow cache budget ``flow_cache_bytes``, within
    [:data:`PROMPT_CACHE_FLOOR_BYTES`, :data:`PROMPT_CACHE_CAP_BYTES`]."""
    if configured != "auto":
        return int(configured)
    free = free_bytes()
    share = int(max(0, free - flow_cache_bytes) * PROMPT_CACHE_FREE_SHARE)
    budget = min(PROMPT_CACHE_CAP_BYTES, max(PROMPT_CACHE_FLOOR_BYTES, share))
    logger.info("prompt prefix cache %.1f GiB (auto: %.1f GiB free on the GPU, flow cache budget %.1f GiB)",
                budget / 2**30, free / 2**30, flow_cache_bytes / 2**30)
    return budget


def token2wav_graph_owners(model, plan: ExecutionPlan, limits, flow_graph_max_s: float) -> tuple[list, dict[str, int]]:
    """Turn on the token2wav CUDA graphs the plan names (``plan.token2wav.cuda_graphs``), capturing
    none yet: ((name, owner) for the replica's graph schedule, how many graphs of each stage).

    Flow (``flow_graphs``): the whole CFM solve (scheduler "steps": one Euler pass of it) and, for
    CosyVoice2, the token encoder, per padded (batch, length) bucket, batches up to the replica's
    largest and calls up to ``flow_graph_max_s`` of audio (prompt included); with an incremental
    streamed flow, its pass per (batch, new frames, cached frames) bucket, cached frames up to the
    same length, compiled and with the fused kernels as the plan says. Vocoder (``vocoder_graphs``),
    CosyVoice2: the lengths of every streamed call after the first, for every batch bucket, every
    first-chunk length for batches of 1 and 2, and every last-chunk length for a batch of 1; other
    lengths are captured when they recur (:mod:`cosyvoice_runtime.hift.graphs`). CosyVoice3 with
    the incremental vocoder: the body per padded (batch, frames) bucket up to the longest streamed
    window (:mod:`cosyvoice_runtime.hift.causal_graphs`; what they did for CosyVoice3's capacity:
    docs/tuning.md, ``cv3_vocoder``).

    Why all of them: the solve graphs with the early first chunk cut first audio at one stream
    against LLM graphs alone, and the encoder and vocoder graphs raised throughput at 64 streams
    (docs/tuning.md §2, ``cuda_graphs``, and §6);
    which of them are captured before the replica is ready and which in the background after:
    :mod:`cosyvoice_runtime.graph_schedule` (``graphs_before_ready``). torchscript mode captures
    the same graphs over its compiled modules (each shape's warm-up compiles it first, so start-up
    is longer); trt mode replaces the estimator and keeps its own execution (the plan has no
    token2wav graphs there).
    """
    t2w = plan.token2wav
    if not t2w.cuda_graphs:
        return [], {"flow_graphs": 0, "vocoder_graphs": 0}
    from cosyvoice_runtime.flow.graph_setup import enable_flow_graphs, flow_graph_owners
    from cosyvoice_runtime.graph_schedule import KeyGroup
    from cosyvoice_runtime.hift.causal_graphs import graph_causal_body, streaming_window_frames
    from cosyvoice_runtime.hift.graphs import graph_streaming_vocoder

    spec = model.spec
    flow = t2w.flow(spec.family)
    rate, ratio = spec.token_frame_rate, spec.flow.token_mel_ratio
    max_s = min(flow_graph_max_s, limits.max_total_s)
    enable_flow_graphs(model.flow, max_batch=limits.max_flow_batch, max_frames=int(max_s * rate) * ratio,
                       stepper=t2w.scheduler == "steps", incremental=flow.streamed == "incremental",
                       incremental_compile=flow.compile_backend, incremental_fused_norms=flow.fused_norms,
                       defer_whole_solve=t2w.scheduler == "steps")
    owners = flow_graph_owners(model.flow, first_frames=int(min(FIRST_READY_FLOW_S, max_s) * rate) * ratio)
    n_flow = sum(len(owner.graph_keys()) for _, owner in owners)
    if not t2w.vocoder_graphs(spec.family):  # CV3's recompute vocodes whole accumulated mels: too long for graphs
        vocoder = []
    elif not spec.hift.causal:  # the CV2 vocoder: exact lengths
        graphed = graph_streaming_vocoder(model.hift, spec, limits.max_flow_batch, VOCODER_GRAPH_MAX_FRAMES,
                                          t2w.first_chunk_min_tokens, capture=False)
        vocoder = [("vocoder", graphed), ("vocoder.last_chunks", KeyGroup(graphed, graphed.last_chunk_keys))]
    else:  # the CV3 body over padded buckets of streamed windows
        vocoder = [("vocoder", graph_causal_body(model.hift, limits.max_flow_batch,
                                                 streaming_window_frames(model.hift, spec), capture=False))]
    n_vocoder = sum(len(owner.graph_keys()) for _, owner in vocoder)
    logger.info("token2wav CUDA graphs: %d flow and %d vocoder (batch <= %d, flow calls <= %.0f s)",
                n_flow, n_vocoder, limits.max_flow_batch, max_s)
    return owners + vocoder, {"flow_graphs": n_flow, "vocoder_graphs": n_vocoder}


def speech_length_rule(configured: str, model_dir: str) -> str:
    """``speech_length`` resolved once per replica: "auto" is "text_rate" for a random-weight
    model (its LLM never predicts a sensible end of speech), else "model" (real weights end their
    utterances themselves). Not in the plan: it needs the model directory, which the plan's
    resolver does not see."""
    if configured != "auto":
        return configured
    from cosyvoice_runtime.tiny_model import is_random_weight_model

    return "text_rate" if is_random_weight_model(model_dir) else "model"


def load_synthesis_runtime(cfg, model_dir: str, plan: ExecutionPlan | None = None) -> SynthesisRuntime:
    """Load the model and assemble the runtime that ``plan`` describes (None: this node's
    :func:`~deployments.execution_plan.replica_plan` of ``cfg``, its mode preflighted here, as the
    synthesizer does before it calls its runtime factory)."""
    import torch

    from cosyvoice_runtime.graph_capture import captured_total, missed_total
    from cosyvoice_runtime.graph_schedule import GraphSchedule
    from cosyvoice_runtime.model import load_model
    from cosyvoice_runtime.modes import apply_mode, preflight
    from cosyvoice_runtime.tiny_model import is_random_weight_model
    from cosyvoice_runtime.trt.profiles import derive_profile

    if plan is None:
        plan = replica_plan(cfg)
        preflight(plan.mode, cfg.trt_plan_dir)  # before the weights: a missing TensorRT fails in seconds
    dtype = getattr(torch, plan.dtype)
    started = time.perf_counter()
    model = load_model(model_dir, device=plan.device, dtype=dtype)
    load_s = time.perf_counter() - started
    limits = replica_limits(cfg, model, dtype_bytes=torch.finfo(dtype).bits // 8)
    trt_estimator = None
    if plan.mode == "trt":
        from cosyvoice_runtime.trt.engine import load_trt_estimator

        trt_estimator = load_trt_estimator(cfg.trt_plan_dir, derive_profile(model.spec, limits), device=plan.device,
                                           pool_size=cfg.compute_threads,
                                           flow_checkpoint=Path(model_dir) / model.spec.files["flow"])
    report = apply_mode(model, plan.mode, dtype, trt_estimator=trt_estimator)
    family = model.spec.family
    flow = plan.token2wav.flow(family)
    t2w_owners, graphs = token2wav_graph_owners(model, plan, limits, cfg.flow_graph_max_s)
    rate = model.spec.token_frame_rate
    speech_length = speech_length_rule(cfg.speech_length, model_dir)
    length_rule = None
    if speech_length == "text_rate":
        from cosyvoice_runtime.speech_length import TextRateLength

        length_rule = TextRateLength.for_model(model_dir, family, rate, cfg.speech_length_jitter)
    engine = RuntimeTokenEngine(model, cfg.max_running, cfg.max_model_len, plan.llm, length_rule=length_rule,
                                capture_graphs=False)
    # the graphs a first request needs now, the rest once the replica serves (Synthesizer starts them)
    schedule = GraphSchedule(engine.graph_owners() + t2w_owners, plan.graphs_before_ready)
    schedule.capture_first()
    flow_cache_bytes = flow_cache_budget(plan.token2wav.flow_cache_bytes, plan.device, cfg.max_mem_gb)
    # the prefixes are kept by the incremental flow only (the recompute keeps none)
    prompt_cache_bytes = (prompt_cache_budget(plan.token2wav.prompt_cache_bytes, flow_cache_bytes,
                                              lambda: gpu_free_bytes(plan.device, cfg.max_mem_gb))
                          if flow.streamed == "incremental" else 0)
    token2wav = RuntimeToken2Wav(model, plan.token2wav, flow_cache_bytes=flow_cache_bytes,
                                 prompt_cache_bytes=prompt_cache_bytes)
    return SynthesisRuntime(
        engine=engine, token2wav=token2wav, device=plan.device, graph_captures=captured_total,
        graph_misses=missed_total, graph_schedule=schedule, max_flow_batch=limits.max_flow_batch,
        max_prompt_tokens=int(limits.max_prompt_s * rate),
        # what was loaded and built (the plan says what runs; /health shows both)
        details={"family": family, "mode": plan.mode, "mode_source": plan.mode_source, "dtype": plan.dtype,
                 "t2w_scheduler": plan.token2wav.scheduler, "flow": flow.streamed,
                 "compiled": report["compiled"] + (["llm decode step"] if plan.llm.compile_backend else [])
                 + (["incremental flow pass"] if flow.compile_backend else []),
                 # where the Triton add + norm kernels run (fused_norms, and Triton and a GPU here)
                 "fused_norms": (["llm"] if plan.llm.fused_norms else [])
                 + (["incremental flow pass"] if flow.fused_norms and graphs["flow_graphs"] else []),
                 "llm_run_ahead": engine.engine.run_ahead,  # on only with the static (graphed) decode step
                 "estimator": report["estimator"], **graphs, "model_load_s": round(load_s, 2),
                 "max_flow_batch": limits.max_flow_batch, "max_prompt_tokens": int(limits.max_prompt_s * rate),
                 "max_flow_tokens": int(limits.max_total_s * rate),
                 # the voice prompt prefixes kept (0: none, the flow recomputes), "auto" resolved
                 "prompt_cache_bytes": token2wav.prompt_cache_bytes,
                 "random_weights": is_random_weight_model(model_dir),  # the tiny test model: noise, not speech
                 "speech_length": speech_length,  # text_rate: each utterance as long as its text reads
                 "llm_params_m": round(sum(p.numel() for p in model.llm.parameters()) / 1e6, 1)},  # which size
    )
