"""Config of the synthesizer replica (:class:`SynthesizerConfig`) and of its token2wav stage."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from deployments import constants
from deployments.deadlines import DEFAULT_SLACK_S
from deployments.options import DeploymentKnobs, StrictModel


class Token2WavBatchConfig(StrictModel):
    """``@serve.batch`` knobs of the flow + HiFT stage (chunk jobs from many streams)."""

    max_batch_size: PositiveInt = 8
    batch_wait_timeout_s: float = Field(0.005, ge=0)
    # First streamed chunk at the first 25-token attention-chunk boundary after the prompt that is at
    # least first_chunk_min_tokens away, instead of one hop later: same mel for every emitted frame
    # (chunk masks), first audio up to one hop of LLM work earlier.
    early_first_chunk: bool = True
    # Audio of the first chunk (40 ms per token) must outlast making the second one (a full hop of LLM
    # steps plus a flow call), or the stream stutters right after it starts.
    first_chunk_min_tokens: PositiveInt = 10
    # Deadline-first admission (deployments.deadlines): while a stream's audio runs out within this
    # many seconds, streams with more audio in hand wait for the next batch. None: first come, first served.
    deadline_slack_s: PositiveFloat | None = DEFAULT_SLACK_S
    # CosyVoice3's causal vocoder: "incremental" vocodes only each chunk's new frames plus a bounded
    # left context (same samples within float noise, tests/runtime/test_hift_batch.py); "recompute"
    # re-vocodes the whole accumulated mel every chunk, as the official implementation does.
    cv3_vocoder: Literal["incremental", "recompute"] = "incremental"
    # CosyVoice2's streamed flow calls: "recompute" solves the prompt and every earlier token again on
    # each call, as the official implementation does; "incremental" keeps each stream's estimator state
    # of the frames already emitted and solves only the new ones (same mel within float noise,
    # tests/runtime/test_flow_incremental*.py; batched and stepped as the recompute, one CUDA graph per
    # (batch, new frames, cached frames) bucket). "auto": incremental on CUDA replicas, where it
    # raised the sessions at the SLO (docs/tuning.md §2, cv2_flow), recompute on the CPU.
    cv2_flow: Literal["auto", "recompute", "incremental"] = "auto"
    # With the incremental flow: the flow state of each voice prompt's whole attention chunks (the
    # same in every request with that voice) kept for later requests, which then solve ~150 fewer
    # frames each after a 3.5 s prompt (cosyvoice_runtime.flow.flow_cache.PromptPrefixes; bit-identical
    # audio, tests/runtime/test_flow_incremental_batch.py). ~84 MiB per 3.5 s voice in bf16; 0: off.
    # "auto": on a CUDA replica, a share of the GPU memory still free once the model, KV cache,
    # first graphs and the flow cache budget are in place, within a floor and a cap
    # (deployments.assembler.prompt_cache_budget): one H100 with 48 voices of 3.5 s prompts missed
    # the SLO at 48 sessions over HTTP with 1 GiB and met it with 8 GiB (docs/tuning.md §2,
    # cv2_prompt_cache_bytes); on the CPU 1 GiB. The size a replica resolved: /health?detail=1
    # (prompt_cache_bytes) and tts_flow_prompt_cache_budget_bytes.
    cv2_prompt_cache_bytes: Literal["auto"] | NonNegativeInt = "auto"
    # CosyVoice3's streamed flow calls, the same choice over its DiT (same mel within float noise,
    # tests/runtime/test_flow_incremental_batch.py; 880 KiB per cached frame in bf16; the prompt
    # cache above serves it too). "auto" as above: a pass over cached frames is a fraction of the
    # recompute's (docs/tuning.md §2; its capacity against the recompute's is not measured).
    cv3_flow: Literal["auto", "recompute", "incremental"] = "auto"
    # With an incremental flow: the most the open streams' flow caches may hold together (~0.4 GiB for
    # a 10 s CosyVoice2 answer after a 3.5 s prompt in bf16); a stream that would grow them past it
    # drops its cache and is recomputed from then on (same audio) instead of the replica running out
    # of GPU memory. A CUDA replica also holds it under half the GPU memory free once it has started
    # (an RTX 5090 has 32 GiB for everything) and, with max_mem_gb, under what of that it has left.
    flow_cache_bytes: int = Field(16 * 1024**3, ge=0)
    # "steps": the flow solved one Euler pass at a time over the jobs picked earliest deadline first
    # (deployments.token2wav_loop), so a first chunk never waits for a whole batch; "batch": whole
    # solves batched by @serve.batch behind the deadline gate. "auto": steps on CUDA replicas (more
    # sessions at the SLO: docs/tuning.md §2, scheduler), batch on the CPU (not measured there).
    scheduler: Literal["auto", "batch", "steps"] = "auto"
    # With "steps": while a chunk job in hand is already due (a stream's first chunk, or a late
    # one) and no stream waiting for speech tokens is due within deadline_slack_s (less the decode
    # steps its missing tokens take), the LLM step thread waits up to this many ms at a time
    # (woken when token2wav's rows leave) instead of decoding tokens that play a second later on
    # the same GPU (deployments/engine_mailbox.py). 0: the LLM never waits. 5 lowered first audio at
    # one stream and held more sessions at the SLO than 0 (docs/tuning.md §2).
    give_way_ms: float = Field(5.0, ge=0, le=50)
    # With "steps": a pass for rows due within deadline_slack_s (first chunks) also carries rows
    # with slack of up to this many times the urgent rows' frames (1: no longer, the same padded
    # size). CosyVoice2's later chunks are 2-4 times a first chunk's frames, so at 1 they never
    # ride with first chunks (cosyvoice_runtime/stream_schedule.py). One GPU A/B so far, not
    # conclusive (docs/tuning.md §2).
    rider_ratio: float = Field(1.0, ge=1.0, le=8.0)
    # With "steps" on CUDA: flow passes queued on the GPU at once. 1: each pass is prepared after the
    # one before it has ended, and the token2wav lane idles through the host work between them
    # (about a millisecond a pass); 2: the next pass is prepared and queued while one runs, and a
    # newly arrived first chunk joins one pass later. 2 lowered first audio at one session and met
    # the SLO at a load where 1 underran (docs/tuning.md §2); 3-4 are not measured.
    passes_in_flight: int = Field(2, ge=1, le=4)


class AdmissionConfig(StrictModel):
    """Admission by predicted first audio (deployments/admission.py): a request this replica would
    start later than ``slo_first_audio_ms`` is refused at once (429 + Retry-After) instead of
    answered late. The prediction is a monotone fit of the replica's own first audio against its
    load, over every load it measured, with fading readings."""

    # Refuse when the prediction exceeds the SLO; false: measure and report the margin only (the
    # CPU config: a 2-core machine's first audio exceeds a GPU SLO at one stream).
    enabled: bool = False
    # The replica's share of the first-audio SLO (from the synthesizer call's start to its first
    # chunk): the end-to-end SLO (300 ms p99, docs/tuning.md) less the ingress and frontend time.
    slo_first_audio_ms: PositiveFloat = 250.0
    # A reading's weight halves every half_life_s: the fit follows the replica's recent state.
    half_life_s: PositiveFloat = 20.0
    # The least weight of readings behind a prediction that refuses (one slow reading refuses nothing).
    min_samples: PositiveFloat = 5.0
    # The share of would-be refusals admitted anyway, so a refused load keeps being measured.
    explore_share: float = Field(0.1, ge=0.0, le=1.0)


class SynthesizerConfig(DeploymentKnobs):
    """Synthesizer replica: model, device, engine capacity, token2wav batching.

    The code paths these knobs choose ("auto" values, CUDA-only stages) are resolved once per
    replica into its execution plan (deployments/execution_plan.py), which /health shows."""

    model_dir: str | None = None  # None: AppArgs.model_dir, then $FAST_COSY_MODEL_DIR, then the tiny model
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # Execution mode; None: $FAST_COSY_MODE of the node, else pytorch (a value set here wins over the env).
    # torchscript: torch.compile of the flow estimator + vocoder; trt: prebuilt TensorRT plans of the estimator.
    mode: Literal["pytorch", "torchscript", "trt"] | None = None
    trt_plan_dir: str | None = None
    # GPU memory budget of the replica (GiB): lowers the flow batch / longest flow call until the estimate fits.
    max_mem_gb: PositiveFloat | None = None
    max_running: PositiveInt = 16  # decode slots (sequences in the running batch)
    max_model_len: PositiveInt = 2048  # KV-cache positions per slot (prompt + generated)
    compute_threads: PositiveInt = 1
    # CUDA replicas: LLM decode steps and (pytorch mode) whole flow solves, the CV2 token encoder and
    # the CV2 vocoder replayed as CUDA graphs, captured at start-up (each graph lengthens it:
    # docs/tuning.md §2); vocoder lengths first met in traffic are captured when they recur.
    cuda_graphs: bool = True
    # With cuda_graphs, which graphs a replica captures before it is ready: "first", those of batch
    # bucket 1 (one stream at a time, the first request included; the recomputed flow's and the
    # vocoder's last-chunk graphs excepted), every other one in a background thread once it serves,
    # the smallest batches first, shapes without their graph running eagerly meanwhile
    # (cosyvoice_runtime/graph_schedule.py); "all": every one before ready (a longer start:
    # docs/tuning.md "Cold start"). "auto": first on CUDA.
    graphs_before_ready: Literal["auto", "first", "all"] = "auto"
    # CUDA replicas with cuda_graphs: each LLM decode step is queued before the one before it has
    # been read, its rows fed that step's ids on the GPU (cosyvoice_runtime/llm/engine.py), so the
    # LLM's lane does not idle while the host reads, commits and delivers a step's tokens and packs
    # the next. Same tokens; events one step behind; it lowers first audio at one stream (docs/tuning.md
    # §2). Steps that feed a bistream
    # (WebSocket) row wait as without it; while such a request is parked waiting for text, the
    # others run ahead.
    llm_run_ahead: bool = True
    # CUDA replicas with an incremental flow: its pass (the walk over the estimator's blocks) through
    # torch.compile (inductor) under its CUDA graphs, as mode torchscript does too. A CosyVoice2 pass
    # runs ~930 small kernels: at small batches its time is their launches in sequence; fused, they
    # are fewer. But the whole estimator compiled and graphed was no faster than graphed alone, so
    # fusion may not pay, and start-up compiles the walk for minutes before capturing the graphs:
    # its speed is not measured (docs/tuning.md §2). Off.
    flow_compile: bool = False
    # CUDA replicas: each residual add and the norm after it as one hand-written Triton kernel
    # (cosyvoice_runtime/kernels.py): in the LLM (48 kernels fewer of a decode step's 521) and in
    # an incremental CosyVoice2 flow pass, with its cache-slot writes (154 fewer of ~930); at one
    # stream both cost their kernels' launches in sequence. Needs Triton (CUDA builds of torch
    # bring it; without it PyTorch's ops run); checked against PyTorch's under Triton's
    # interpreter. It shortens a decode step and a flow pass and lowers first audio (GPU readings:
    # docs/tuning.md §2). Not in a stage
    # compiled by torch.compile (mode torchscript, flow_compile: inductor fuses these
    # ops itself; the two together were never run). /health lists where it runs.
    fused_norms: bool = True
    # LLM steps and token2wav batches on two threads (each with its own CUDA stream) instead of one,
    # so neither waits for the other; None: on for CUDA replicas, off on the CPU (two cores are
    # already shared by torch's intra-op threads).
    overlap_stages: bool | None = None
    # Longest flow call (prompt + audio, seconds) served by a flow graph; longer calls run eagerly
    # (tts_cuda_graph_misses_total), each pass launching its hundreds of kernels one by one under
    # the GIL instead of one replay, and hold up every stream's token2wav meanwhile. 60 s (the
    # longest call a replica takes, max_total_s): the production workload's answers with 3-10 s
    # prompts passed 24 s and broke the SLO at 40 sessions (H100 and H200, 2026-12-07); graphs past
    # 24 s are captured after the replica is ready (assembler.FIRST_READY_FLOW_S). docs/tuning.md §2.
    flow_graph_max_s: PositiveFloat = 60.0
    # Where an utterance ends. "model": where the LLM predicts the end of speech (within the
    # official 2x-20x speech tokens per text token), what real weights do. "text_rate": after
    # exactly the speech tokens a speaker takes to read the text (English ~150 words/min, Mandarin
    # ~4.5 characters/s; cosyvoice_runtime/speech_length.py, docs/tuning.md), within
    # +-speech_length_jitter, fixed by the request's seed: for random weights, which never predict
    # an end and otherwise make minutes of noise per sentence. "auto": text_rate for a
    # random-weight model (the embedded tiny one, random full-size benchmark models), else model.
    speech_length: Literal["auto", "model", "text_rate"] = "auto"
    # With text_rate: each length drawn uniformly within +-this share of the rate's (from the
    # request's seed and the piece's text ids; random without a seed). 0: the rate's exactly.
    speech_length_jitter: float = Field(0.1, ge=0, le=0.5)
    token2wav: Token2WavBatchConfig = Field(default_factory=Token2WavBatchConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    startup_timeout_s: PositiveFloat = constants.REPLICA_START_TIMEOUT_S
    warmup: bool = True  # one short utterance through LLM + flow + HiFT before serving
    # Import path "module:callable" of a factory (config, model source, execution plan) -> SynthesisRuntime
    # (tests inject fakes here; default: deployments.assembler.load_synthesis_runtime).
    runtime_factory: str | None = None

    @model_validator(mode="after")
    def _capacity(self) -> SynthesizerConfig:
        if self.max_ongoing_requests > self.max_running:
            # Every admitted request must get a decode slot at once; excess waits in Serve's queue,
            # where max_queued_requests bounds it and answers 429.
            raise ValueError(f"max_ongoing_requests ({self.max_ongoing_requests}) must not exceed "
                             f"max_running ({self.max_running})")
        if self.token2wav.max_batch_size > self.max_running:
            raise ValueError("token2wav.max_batch_size cannot exceed max_running (one open job per stream)")
        if self.mode == "trt" and not self.trt_plan_dir:
            raise ValueError("mode 'trt' needs trt_plan_dir (plans are built offline, never in a replica)")
        return self
