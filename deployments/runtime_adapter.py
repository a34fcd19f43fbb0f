"""The production runtime of a synthesizer replica: adapters and loader.

:class:`RuntimeTokenEngine` and :class:`RuntimeToken2Wav` implement the protocols of
:mod:`deployments.runtime_protocol` over :mod:`cosyvoice_runtime`; :func:`load_synthesis_runtime`
loads the model in the replica's mode, fits the flow limits to the memory budget and captures the
CUDA graphs. Swapping a runtime component is a change here, not in a deployment.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_runtime.lm_messages import BistreamLMRequest, LMRequest, TokenEvent
from deployments.model_source import replica_mode, resolve_device
from deployments.protocol import InvalidInputError, VoicePrompt
from deployments.runtime_protocol import FrontendRuntime, SynthesisRuntime

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- adapters
# Stream priority of the LLM lane (lower is higher; CUDA maps it into the device's range): a decode
# step's blocks are scheduled ahead of a running flow batch's as SMs free up. Replica simulation
# on an H200 (2026-12-04, bench/results/capacity-replica-nvidia-h200-2026-12-04.md): p99 first
# audio at 3 voice-agent sessions 357 -> 234 ms, SLO capacity 2 -> at least 6 sessions.
LLM_STREAM_PRIORITY = -1


def own_stream(device, priority: int = 0):
    """A CUDA stream of its own for one compute lane (None off CUDA: ``torch.cuda.stream(None)`` is a no-op).

    The LLM lane and the token2wav lane each work on their own stream, so a decode step and a flow
    batch submitted from the two lane threads run side by side on the GPU instead of queueing on
    the default stream. No tensor crosses from one lane's stream to the other's: tokens reach
    token2wav as host ints.
    """
    import torch

    device = torch.device(device)
    return torch.cuda.Stream(device, priority=priority) if device.type == "cuda" else None


class RuntimeTokenEngine:
    """:class:`TokenEngine` over ``cosyvoice_runtime.llm.engine.LLMEngine``, bistream requests included.

    Builds each request's prefill input (spec §3.3) and applies CosyVoice3's silent-token
    filter per request (dropped tokens were still fed back to the LLM; only the flow skips them).
    Bistream text ids are fed one id per chunk, as the official frontend streams them: the engine
    consumes one chunk each time the model asks for text (a ``fill``), so a many-id chunk would be
    read 5 ids at a time with its surplus left until the end (:mod:`cosyvoice_runtime.llm.bistream_seq`).

    ``length_rule`` (``speech_length: text_rate``, :mod:`cosyvoice_runtime.speech_length`): text
    ids and seed -> the speech tokens a request decodes, exactly (its min and max length); a
    bistream request gets it from its whole text when that ends.
    """

    def __init__(self, model, max_running: int, max_model_len: int, cuda_graphs: bool = True,
                 compile_backend: str | None = None, run_ahead: bool = False,
                 length_rule: Callable[[Sequence[int], int | None], int] | None = None) -> None:
        from cosyvoice_runtime.llm.bistream_seq import FINISH_PROTOCOL
        from cosyvoice_runtime.llm.engine import NONFINITE_LOGITS, LLMEngine

        self._errors = {NONFINITE_LOGITS: "non-finite logits (NaN/Inf) in speech token generation",
                        # official-quirk mode only: a control id the bistream protocol does not allow
                        FINISH_PROTOCOL: "the model produced a control id the bistream protocol does not allow"}

        self.model = model
        self.spec = model.spec
        self.llm = model.llm
        # CUDA graphs per (batch, key window) bucket; the engine ignores the flag off CUDA.
        self.engine = LLMEngine(model.llm, max_batch_size=max_running, max_seq_len=max_model_len,
                                use_cuda_graphs=cuda_graphs, compile_backend=compile_backend, run_ahead=run_ahead)
        # NOTE: capture every decode graph now, before token2wav work runs concurrently: a lazy
        # capture beside other GPU work fails ("capturing stream has unjoined work", seen in
        # bench/gpu_bench.py on an H200, 2026-12-02). Graphs: 5 ms vs 26 ms per bf16 decode step at
        # batch 64 (bench/results/llm-decode-h200-2026-12-02.md). Returns 0 on the CPU.
        if captured := self.engine.capture_graphs():
            logger.info("captured %d CUDA graphs for the LLM decode step", captured)
        self.max_running = max_running
        self.max_model_len = max_model_len
        self._filters: dict[str, Any] = {}
        self.length_rule = length_rule
        self._bistream_text: dict[str, tuple[list[int], int | None]] = {}  # with length_rule: (ids so far, seed)
        self._stream = own_stream(next(model.llm.parameters()).device, priority=LLM_STREAM_PRIORITY)

    def add(self, request_id: str, request: LMRequest) -> None:
        import torch

        with torch.cuda.stream(self._stream):  # the prefill input is built where it is used
            self._add(request_id, request)

    def _add(self, request_id: str, request: LMRequest) -> None:
        import torch

        from cosyvoice_runtime.llm.inputs import build_lm_input
        from cosyvoice_runtime.llm.sampling import SamplingParams
        from cosyvoice_runtime.llm.silent_tokens import SilentTokenFilter

        lm = build_lm_input(self.llm, torch.as_tensor(request.text_ids, dtype=torch.long),
                            torch.as_tensor(request.prompt_text_ids, dtype=torch.long),
                            torch.as_tensor(request.prompt_speech_ids, dtype=torch.long))
        # The 20x text-length bound is a worst case that real speech does not approach; cap it at
        # what one KV slot holds (finish reason "length") instead of refusing the request.
        room = self.max_model_len - int(lm.embeds.shape[0]) + 1
        if self.length_rule is not None:  # random weights: the text's length, not a random stop
            n = self.length_rule(request.text_ids, request.seed)
            lm = replace(lm, min_len=min(n, max(room, 1)), max_len=n)
        if room < max(lm.min_len, 1):
            need = int(lm.embeds.shape[0]) + lm.min_len
            raise InvalidInputError(f"text piece too long for a decode slot: needs at least {need} positions, "
                                    f"slots hold {self.max_model_len}")
        params = SamplingParams.from_spec(self.spec.llm, seed=request.seed)
        self.engine.add_request(request_id, lm.embeds, lm.min_len, min(lm.max_len, room), params)
        self._filters[request_id] = SilentTokenFilter(self.spec)

    def add_bistream(self, request_id: str, request: BistreamLMRequest) -> None:
        import torch

        from cosyvoice_runtime.llm.sampling import SamplingParams
        from cosyvoice_runtime.llm.silent_tokens import SilentTokenFilter

        params = SamplingParams.from_spec(self.spec.llm, seed=request.seed)
        with torch.cuda.stream(self._stream):
            self.engine.add_bistream_request(request_id, request.prompt_text_ids, request.prompt_speech_ids, params)
        self._filters[request_id] = SilentTokenFilter(self.spec)
        if self.length_rule is not None:
            self._bistream_text[request_id] = ([], request.seed)

    def feed_text(self, request_id: str, ids: Sequence[int], end: bool) -> bool:
        length, text = None, self._bistream_text.get(request_id)
        if text is not None:
            text[0].extend(int(i) for i in ids)
            if end:
                length = self.length_rule(self._bistream_text.pop(request_id)[0], text[1])
        return self.engine.feed_text(request_id, [[int(i)] for i in ids], end, length)

    def step(self) -> list[TokenEvent]:
        import torch

        out = []
        with torch.cuda.stream(self._stream):
            events = self.engine.step()
        for ev in events:
            keep = self._filters.get(ev.request_id)
            tokens = [t for t in ev.tokens if keep is None or keep.keep(t)]
            out.append(TokenEvent(ev.request_id, tokens, ev.finished, ev.finish_reason,
                                  self._errors.get(ev.finish_reason)))
            if ev.finished:
                self._filters.pop(ev.request_id, None)
                self._bistream_text.pop(ev.request_id, None)
        return out

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._filters.pop(request_id, None)
        self._bistream_text.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def num_running(self) -> int:
        return self.engine.num_running()

    def num_waiting(self) -> int:
        return self.engine.num_waiting()


class RuntimeToken2Wav:
    """:class:`Token2WavRuntime` over ``cosyvoice_runtime.token2wav.Token2Wav``."""

    def __init__(self, model, first_chunk_min_tokens: int | None = None, cv3_vocoder: str = "incremental",
                 cv2_flow: str = "recompute", prompt_cache_bytes: int = 0, cv3_flow: str = "recompute",
                 flow_cache_bytes: int = 16 * 1024**3, passes_in_flight: int = 2) -> None:
        import torch

        from cosyvoice_runtime.token2wav import Token2Wav

        # None: the official first chunk (one hop + alignment pad); else the early one (Token2Wav min_first_hop)
        self.t2w = Token2Wav(model.spec, model.flow, model.hift, min_first_hop=first_chunk_min_tokens,
                             cv3_vocoder=cv3_vocoder, cv2_flow=cv2_flow, prompt_cache_bytes=prompt_cache_bytes,
                             cv3_flow=cv3_flow, flow_cache_bytes=flow_cache_bytes)
        self.sample_rate = model.spec.sample_rate
        self.n_mels = model.spec.flow.output_size
        self.embedding_dim = model.spec.flow.spk_embed_dim
        self.device = model.device
        self.dtype = next(model.flow.parameters()).dtype
        self._stream = own_stream(model.device)
        # scheduler "steps": the flow passes on the GPU (off CUDA nothing is queued: no marks)
        self._passes = PassQueue(passes_in_flight, torch.cuda.Event if self._stream is not None else None)

    def new_stream(self, prompt: VoicePrompt, stream: bool, speed: float, seed: int | None) -> Any:
        import torch

        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(seed))
        return self.t2w.new_stream(prompt, stream=stream, speed=speed, generator=generator)

    def next_job(self, state: Any, tokens: Sequence[int], llm_done: bool) -> Any | None:
        return self.t2w.next_job(state, tokens, llm_done)

    def flow_stats(self) -> dict[str, float]:
        t2w = self.t2w
        prefixes = t2w.prompt_prefixes
        return {"flow_cache_bytes": float(t2w.live_cache_bytes()), "flow_cache_fallbacks_total": float(t2w.flow_fallbacks),
                "flow_prompt_prefix_hits_total": float(prefixes.hits if prefixes else 0),
                "flow_prompt_prefix_misses_total": float(prefixes.misses if prefixes else 0)}

    def tokens_needed(self, state: Any) -> int | None:
        return self.t2w.tokens_needed(state)

    def run_batch(self, jobs: list[Any]) -> list[np.ndarray]:
        import torch

        with torch.cuda.stream(self._stream):  # .cpu() waits for this stream's work only
            return _host_audio(self.t2w.run_batch(jobs))

    # -- token2wav.scheduler "steps" (deployments.token2wav_loop) ---------------------------
    @property
    def n_steps(self) -> int:
        return self.t2w.n_steps

    def start_solves(self, jobs: list[Any]) -> list[Any]:
        import torch

        with torch.cuda.stream(self._stream):
            return self.t2w.start_solves(jobs)

    def advance(self, rows: list[Any]) -> None:
        """One flow pass, queued on the GPU behind at most ``passes_in_flight - 1`` others."""
        import torch

        with torch.cuda.stream(self._stream):
            self._passes.make_room()
            self.t2w.advance(rows)
            self._passes.queued(self._stream)

    def finish(self, rows: list[Any]) -> Callable[[], list[np.ndarray]]:
        """Vocode finished rows (queued now); returns what waits for their audio on the host."""
        import torch

        with torch.cuda.stream(self._stream):
            return _audio_later(self.t2w.finish(rows))


class PassQueue:
    """The flow passes queued on the token2wav stream, at most ``depth`` of them.

    ``make_room`` before a pass waits until fewer than ``depth`` are on the GPU; ``queued`` after
    it marks the pass's end on the stream. Depth 1 waits for the previous pass to end before the
    next is prepared, so the GPU's token2wav lane idles through the driver's host work between
    passes (~1.1-1.6 ms a pass in a profiled one-stream request, H100 2026-12-06: ~0.5 ms of
    Python, then the pass's input copies and launch); depth 2 prepares a pass while the one
    before it runs, and a job that arrives meanwhile joins one pass later.
    """

    def __init__(self, depth: int, event: Callable[[], Any] | None) -> None:
        if depth < 1:
            raise ValueError("passes_in_flight is at least 1")
        self.depth = depth
        self._event = event  # a factory of CUDA events; None: nothing is queued (CPU)
        self._marks: deque = deque()

    def make_room(self) -> None:
        while len(self._marks) >= self.depth:
            self._marks.popleft().synchronize()

    def queued(self, stream: Any) -> None:
        if self._event is not None:
            mark = self._event()
            mark.record(stream)
            self._marks.append(mark)


def _host_audio(chunks: list) -> list[np.ndarray]:
    return _audio_later(chunks)()


def _audio_later(chunks: list) -> Callable[[], list[np.ndarray]]:
    """Each (samples,) audio tensor as float32 numpy, through one device->host copy for the whole
    batch, queued on the current stream into pinned memory; the function returned waits for it.
    Why: the token2wav thread that waited on its stream for every finished batch left new first
    chunks queued behind a vocoder (t2w-queue p99 42 ms at 56 sessions, H100 2026-12-05)."""
    import torch

    if not chunks:
        return list  # list() is the empty batch's audio
    flat = torch.cat([a.detach().reshape(-1).float() for a in chunks])
    splits = np.cumsum([a.numel() for a in chunks])[:-1]
    if flat.device.type != "cuda":
        host = flat.numpy()
        return lambda: np.split(host, splits)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> list[np.ndarray]:
        copied.synchronize()
        return np.split(host.numpy().copy(), splits)  # the pinned block goes back to PyTorch's cache
    return wait


# --------------------------------------------------------------------------------------- loader
_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


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


VOCODER_GRAPH_MAX_FRAMES = 512  # ~10 s of audio; whole-utterance (unstreamed) calls beyond it run eagerly


def token2wav_scheduler(configured: str, device) -> str:
    """``token2wav.scheduler`` resolved once per replica: "auto" is "steps" on CUDA, else "batch"."""
    if configured != "auto":
        return configured
    return "steps" if str(device).startswith("cuda") else "batch"


def torch_compile_backend(mode: str, knob: bool, device) -> str | None:
    """The ``torch.compile`` backend of the LLM decode step (``llm_compile``) or of the incremental
    flow pass (``flow_compile``): inductor in mode torchscript or with the knob, on CUDA only (the
    graphs replaying the fused kernels are what it pays for); else none."""
    return "inductor" if (mode == "torchscript" or knob) and str(device).startswith("cuda") else None


def fused_norms_where(wanted: bool, available: bool, device, compiled: bool) -> bool:
    """Whether the Triton add + norm kernels (``fused_norms``) run in a stage: asked for, Triton
    installed, on CUDA, and the stage not compiled (inductor fuses these ops itself, and the two
    together were never run; ``fused_norms`` became a default while mode torchscript compiles)."""
    return wanted and available and str(device).startswith("cuda") and not compiled


def streamed_flow(configured: str, device) -> str:
    """``token2wav.cv2_flow`` / ``cv3_flow`` resolved once per replica: "auto" is "incremental" on
    CUDA (where it was measured), else "recompute"."""
    if configured != "auto":
        return configured
    return "incremental" if str(device).startswith("cuda") else "recompute"


def speech_length_rule(configured: str, model_dir: str) -> str:
    """``speech_length`` resolved once per replica: "auto" is "text_rate" for a random-weight
    model (its LLM never predicts a sensible end of speech), else "model" (real weights end their
    utterances themselves)."""
    if configured != "auto":
        return configured
    from cosyvoice_runtime.tiny_model import is_random_weight_model

    return "text_rate" if is_random_weight_model(model_dir) else "model"


FLOW_CACHE_FREE_SHARE = 0.5  # the flow caches may fill at most this share of the GPU memory free after start


def flow_cache_budget(configured: int, device, max_mem_gb: float | None = None) -> int:
    """``token2wav.flow_cache_bytes``, held under half the GPU memory free now and, with
    ``max_mem_gb`` (replicas sharing a GPU), under what of that budget the replica has not taken
    yet (CUDA; call it once the weights, the KV cache and the graphs are allocated): the default
    16 GiB fits an H200, not what is left of an RTX 5090's 32 GiB."""
    if not str(device).startswith("cuda"):
        return configured
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    budget = min(configured, int(free * FLOW_CACHE_FREE_SHARE))
    if max_mem_gb is not None:
        budget = min(budget, max(0, int(max_mem_gb * 2**30) - torch.cuda.memory_reserved(device)))
    if budget < configured:
        logger.info("flow cache budget %.1f GiB (%.1f GiB free on the GPU, max_mem_gb %s), not the configured %.1f GiB",
                    budget / 2**30, free / 2**30, max_mem_gb, configured / 2**30)
    return budget


def capture_graphs(model, cfg, mode: str, limits, first_chunk_min_tokens: int | None,
                   stepper: bool = False, incremental: bool = False, incremental_compile: str | None = None,
                   incremental_fused_norms: bool = False) -> dict[str, int]:
    """Capture the token2wav CUDA graphs of a CUDA replica (pytorch, torchscript): how many of each.

    Flow (``flow_graphs``): the whole CFM solve (``stepper``: one Euler pass of it, for the
    "steps" scheduler) and, for CosyVoice2, the token encoder, per padded (batch, length)
    bucket, batches up to the replica's largest and calls up to ``flow_graph_max_s`` of audio
    (prompt included); with ``incremental`` (``cv2_flow`` / ``cv3_flow``), the incremental pass per
    (batch, new frames, cached frames) bucket, cached frames up to the same length. Vocoder
    (``vocoder_graphs``), CosyVoice2: the lengths of every streamed
    call after the first, for every batch bucket, every first-chunk length for batches of 1 and
    2, and every last-chunk length for a batch of 1; other lengths are captured when they recur (:mod:`cosyvoice_runtime.hift.graphs`).
    CosyVoice3 with ``cv3_vocoder: incremental``: the body per padded (batch, frames) bucket up to
    the longest streamed window (:mod:`cosyvoice_runtime.hift.causal_graphs`; not yet timed on a GPU).
    ``incremental_fused_norms``: the incremental pass's Triton add + norm kernels (:func:`fused_norms_where`).

    Measured on an H200 (2026-12-03, bench/results/nvidia-h200-2026-12-03-allgraphs.md): with
    the solve graphs and the early first chunk, first audio at one stream fell from 1.11 s (LLM
    graphs only, 2026-12-02) to 135 ms; the encoder and vocoder graphs took throughput at 64
    streams from 90.1x to 115.4x real time (same run).
    torchscript mode captures the same graphs over its compiled modules (each shape's warm-up
    compiles it first, so start-up is longer); trt mode replaces the estimator and keeps its own
    execution.
    """
    if not cfg.cuda_graphs or mode not in ("pytorch", "torchscript") or model.device.type != "cuda":
        return {"flow_graphs": 0, "vocoder_graphs": 0}
    from cosyvoice_runtime.flow.graph_setup import capture_flow_graphs, enable_flow_graphs
    from cosyvoice_runtime.hift.causal_graphs import graph_causal_body, streaming_window_frames
    from cosyvoice_runtime.hift.graphs import graph_streaming_vocoder

    spec = model.spec
    rate, ratio = spec.token_frame_rate, spec.flow.token_mel_ratio
    max_s = min(cfg.flow_graph_max_s, limits.max_total_s)
    started = time.perf_counter()
    enable_flow_graphs(model.flow, max_batch=limits.max_flow_batch, max_frames=int(max_s * rate) * ratio, stepper=stepper,
                       incremental=incremental, incremental_compile=incremental_compile,
                       incremental_fused_norms=incremental_fused_norms)
    n_flow = capture_flow_graphs(model.flow)
    if not spec.hift.causal:  # the CV2 vocoder: exact lengths
        n_vocoder = graph_streaming_vocoder(model.hift, spec, limits.max_flow_batch, VOCODER_GRAPH_MAX_FRAMES,
                                            first_chunk_min_tokens).num_graphs
    elif cfg.token2wav.cv3_vocoder == "incremental":  # the CV3 body over padded buckets of streamed windows
        n_vocoder = graph_causal_body(model.hift, limits.max_flow_batch,
                                      streaming_window_frames(model.hift, spec)).num_graphs
    else:  # the recompute vocodes whole accumulated mels: too long for graphs
        n_vocoder = 0
    logger.info("captured %d flow and %d vocoder CUDA graphs (batch <= %d, flow calls <= %.0f s) in %.1f s",
                n_flow, n_vocoder, limits.max_flow_batch, max_s, time.perf_counter() - started)
    return {"flow_graphs": n_flow, "vocoder_graphs": n_vocoder}


def load_synthesis_runtime(cfg, model_dir: str) -> SynthesisRuntime:
    """Load the model on the replica's device in the replica's execution mode.

    The mode comes from :func:`~deployments.model_source.replica_mode`, the one rule (config,
    else ``$FAST_COSY_MODE``, else pytorch): :class:`~deployments.synthesizer.Synthesizer` has
    already applied it and passes the result in ``cfg.mode``, which the rule returns as given; a
    caller of its own that leaves ``cfg.mode`` None gets it resolved here.
    """
    import torch

    from cosyvoice_runtime import kernels
    from cosyvoice_runtime.graph_capture import captured_total, missed_total
    from cosyvoice_runtime.model import load_model
    from cosyvoice_runtime.modes import apply_mode, preflight
    from cosyvoice_runtime.tiny_model import is_random_weight_model
    from cosyvoice_runtime.trt.profiles import derive_profile

    mode, source = replica_mode(cfg.mode)
    preflight(mode, cfg.trt_plan_dir)  # before the weights: a missing TensorRT fails in seconds
    device = resolve_device(cfg.device)
    dtype = getattr(torch, _DTYPES[cfg.dtype])
    model = load_model(model_dir, device=device, dtype=dtype)
    llm_backend = torch_compile_backend(mode, cfg.llm_compile, device)
    # the LLM's add + RMSNorm kernels (fused_norms): before any decode or prefill graph is captured
    model.llm.backbone.fused_norms = fused_norms_where(cfg.fused_norms, kernels.AVAILABLE, model.device,
                                                       compiled=llm_backend is not None)
    limits = replica_limits(cfg, model, dtype_bytes=torch.finfo(dtype).bits // 8)
    trt_estimator = None
    if mode == "trt":
        from cosyvoice_runtime.trt.engine import load_trt_estimator

        trt_estimator = load_trt_estimator(cfg.trt_plan_dir, derive_profile(model.spec, limits), device=device,
                                           pool_size=cfg.compute_threads,
                                           flow_checkpoint=Path(model_dir) / model.spec.files["flow"])
    report = apply_mode(model, mode, dtype, trt_estimator=trt_estimator)
    min_first = cfg.token2wav.first_chunk_min_tokens if cfg.token2wav.early_first_chunk else None
    scheduler = token2wav_scheduler(cfg.token2wav.scheduler, device)
    cv2_flow, cv3_flow = streamed_flow(cfg.token2wav.cv2_flow, device), streamed_flow(cfg.token2wav.cv3_flow, device)
    flow = cv2_flow if model.spec.family == "cosyvoice2" else cv3_flow
    flow_backend = torch_compile_backend(mode, cfg.flow_compile, device) if flow == "incremental" and cfg.cuda_graphs else None
    flow_fused = flow == "incremental" and fused_norms_where(cfg.fused_norms, kernels.AVAILABLE, device,
                                                             compiled=flow_backend is not None)
    graphs = capture_graphs(model, cfg, mode, limits, min_first, stepper=scheduler == "steps",
                            incremental=flow == "incremental", incremental_compile=flow_backend,
                            incremental_fused_norms=flow_fused)
    rate = model.spec.token_frame_rate
    speech_length = speech_length_rule(cfg.speech_length, model_dir)
    length_rule = None
    if speech_length == "text_rate":
        from cosyvoice_runtime.speech_length import TextRateLength

        length_rule = TextRateLength.for_model(model_dir, model.spec.family, rate, cfg.speech_length_jitter)
    engine = RuntimeTokenEngine(model, cfg.max_running, cfg.max_model_len, cuda_graphs=cfg.cuda_graphs,
                                compile_backend=llm_backend, run_ahead=cfg.llm_run_ahead, length_rule=length_rule)
    return SynthesisRuntime(
        engine=engine,
        token2wav=RuntimeToken2Wav(model, first_chunk_min_tokens=min_first, cv3_vocoder=cfg.token2wav.cv3_vocoder,
                                   cv2_flow=cv2_flow, prompt_cache_bytes=cfg.token2wav.cv2_prompt_cache_bytes,
                                   cv3_flow=cv3_flow,
                                   flow_cache_bytes=flow_cache_budget(cfg.token2wav.flow_cache_bytes, device,
                                                                      cfg.max_mem_gb),
                                   passes_in_flight=cfg.token2wav.passes_in_flight),
        device=str(device), graph_captures=captured_total, graph_misses=missed_total,
        details={"family": model.spec.family, "mode": mode, "mode_source": source, "dtype": cfg.dtype,
                 "t2w_scheduler": scheduler, "flow": flow,
                 "compiled": report["compiled"] + (["llm decode step"] if llm_backend else [])
                 + (["incremental flow pass"] if flow_backend else []),
                 # where the Triton add + norm kernels run (fused_norms, and Triton and a GPU here)
                 "fused_norms": (["llm"] if model.llm.backbone.fused_norms else [])
                 + (["incremental flow pass"] if flow_fused and graphs["flow_graphs"] else []),
                 "llm_run_ahead": engine.engine.run_ahead,  # on only with the static (graphed) decode step
                 "estimator": report["estimator"], **graphs,
                 "max_flow_batch": limits.max_flow_batch, "max_prompt_tokens": int(limits.max_prompt_s * rate),
                 "max_flow_tokens": int(limits.max_total_s * rate),
                 "random_weights": is_random_weight_model(model_dir),  # the tiny test model: noise, not speech
                 "speech_length": speech_length,  # text_rate: each utterance as long as its text reads
                 "llm_params_m": round(sum(p.numel() for p in model.llm.parameters()) / 1e6, 1)},  # which size
    )


def load_frontend_runtime(cfg, model_dir: str) -> FrontendRuntime:
    """The runtime frontend (normaliser, splitter, tokenizer, prompt features, voice store)."""
    from deployments.frontend_runtime import RuntimeFrontend

    return RuntimeFrontend(cfg, model_dir)


def call_with_timeout(fn, timeout_s: float, what: str):
    """Run a blocking constructor step with a deadline (house style §2.3 rule 11).

    A replica whose model load hangs (stuck filesystem, wedged driver) fails with a clear error
    instead of sitting in STARTING; Serve then retries or reports it.
    """
    import concurrent.futures

    from cosyvoice_runtime.errors import ModelLoadError

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="startup")
    try:
        return pool.submit(fn).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise ModelLoadError(what, f"not ready after {timeout_s:.0f} s") from None
    finally:
        pool.shutdown(wait=False)
