"""GPU synthesis deployment: speech tokens (continuous batching) + token2wav (``@serve.batch``).

One replica owns one model on one device and does both stages (the one-vs-two-deployments
decision and its measurements are in ``docs/serving.md``):

* the LLM runs in an :class:`~deployments.engine_loop.EngineLoop` (one step thread; requests
  join and leave between decode steps, tokens are handed to the event loop);
* every request coroutine turns its growing token list into flow + HiFT jobs with its own
  stream state (the hop schedule of the runtime), and submits each job to the
  ``@serve.batch``-ed :meth:`Synthesizer._token2wav`, which runs the jobs of many streams as one
  batch;
* all blocking compute goes through one :class:`~deployments.compute.ComputeExecutor`.

Text-in streaming (:meth:`Synthesizer.synthesize_bistream`, spec §3.8): one LLM sequence whose
text arrives while it speaks. Its first streamed item is a
:class:`~deployments.text_inbox.BistreamTicket`: the caller pushes the text to this replica's
text inbox actor (started at the first such call), and the request reads it from there.

A request that is abandoned (client disconnect, handle ``cancel()``) raises ``CancelledError``
inside :meth:`synthesize`; the ``finally`` of the engine loop's generator aborts its sequence.

An error in one request fails that request only (:class:`RequestFailedError`): the engine loop
isolates a request whose decode step fails (``deployments.engine_loop``); a token2wav batch that
raises (e.g. CUDA out of memory) is split in halves and retried, down to the one job that still
fails; a chunk with non-finite samples (NaN/Inf) fails its request instead of reaching the client.
A fault that leaves the device unusable (``engine_loop.is_fatal``) fails every open stream with
:class:`EngineDeadError` and makes ``check_health`` raise, so Serve replaces the replica.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import numpy as np
from pydantic import Field, PositiveFloat, PositiveInt, model_validator
from ray import serve

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID
from cosyvoice_runtime.modes import preflight, resolve_mode
from deployments import constants
from deployments.bistream import BistreamLMRequest, BistreamTokenEngine
from deployments.compute import MAIN as MAIN_LANE
from deployments.compute import ComputeExecutor
from deployments.deadlines import DEFAULT_SLACK_S, DeadlineGate, Playback
from deployments.engine_loop import EngineLoop, TextSource, is_fatal
from deployments.gpu_stats import DeviceProbe, release_fragmented_cache
from deployments.observability import ReplicaMetrics
from deployments.options import DeploymentKnobs, StrictModel
from deployments.protocol import (
    AudioChunk,
    CosyVoiceError,
    EngineDeadError,
    InvalidInputError,
    PreparedRequest,
    ReplicaHealth,
    RequestFailedError,
    SynthesisResult,
    VoicePrompt,
    portable_error,
)
from deployments.runtime_adapter import LMRequest, ModelSource, SynthesisRuntime, call_with_timeout
from deployments.text_inbox import ActorInbox, BistreamTicket, InboxClient, LocalInbox
from deployments.token2wav_loop import SteppedToken2Wav

logger = logging.getLogger(__name__)
TOKEN2WAV_LANE = "token2wav"  # the compute lane of flow + HiFT batches when stages overlap

RuntimeFactory = Callable[["SynthesizerConfig", ModelSource], SynthesisRuntime]
MALLOC_ARENA_MAX = "2"  # glibc arenas per synthesizer replica (see deployment_options)
IDLE_TRIM_DELAY_S = 1.0  # after this long without a request, freed heap goes back to the OS


def release_free_heap() -> bool:
    """glibc ``malloc_trim(0)``: return freed heap pages to the OS (False where there is no glibc).

    Measured: ~37 ms for ~400 MiB of freed, fragmented tensor memory; sub-millisecond when there is
    little to return.
    """
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


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
    # tests/runtime/test_flow_incremental.py; one stream at a time, no CUDA graphs; not yet timed on a GPU).
    cv2_flow: Literal["recompute", "incremental"] = "recompute"
    # "steps": the flow solved one Euler pass at a time over the jobs picked earliest deadline first
    # (deployments.token2wav_loop), so a first chunk never waits for a whole batch; "batch": whole
    # solves batched by @serve.batch behind the deadline gate. "auto": steps on CUDA replicas (5-6 ->
    # 21 sessions at the SLO, H200 replica simulation 2026-12-04), batch on the CPU (not measured there).
    scheduler: Literal["auto", "batch", "steps"] = "auto"

    @model_validator(mode="after")
    def _stepped_flow(self) -> Token2WavBatchConfig:
        if self.scheduler == "steps" and self.cv2_flow == "incremental":
            raise ValueError("token2wav.scheduler 'steps' needs cv2_flow 'recompute' (the incremental flow is not stepped)")
        return self


class SynthesizerConfig(DeploymentKnobs):
    """Synthesizer replica: model, device, engine capacity, token2wav batching."""

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
    # the CV2 vocoder replayed as CUDA graphs, captured at start-up (about 0.6 s per flow-solve graph
    # on an H200); vocoder lengths first met in traffic are captured when they recur.
    cuda_graphs: bool = True
    # LLM steps and token2wav batches on two threads (each with its own CUDA stream) instead of one,
    # so neither waits for the other; None: on for CUDA replicas, off on the CPU (two cores are
    # already shared by torch's intra-op threads).
    overlap_stages: bool | None = None
    # Longest flow call (prompt + audio, seconds) served by a flow graph; longer calls run eagerly.
    flow_graph_max_s: PositiveFloat = 20.0
    token2wav: Token2WavBatchConfig = Field(default_factory=Token2WavBatchConfig)
    startup_timeout_s: PositiveFloat = constants.REPLICA_START_TIMEOUT_S
    warmup: bool = True  # one short utterance through LLM + flow + HiFT before serving
    # Import path "module:callable" returning a SynthesisRuntime (tests inject fakes here).
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


def _import_factory(path: str) -> RuntimeFactory:
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"runtime_factory must be 'module:callable', got {path!r}")
    return getattr(importlib.import_module(module), attr)


def default_runtime_factory(cfg: SynthesizerConfig, source: ModelSource) -> SynthesisRuntime:
    from deployments.runtime_adapter import load_synthesis_runtime

    runtime = load_synthesis_runtime(cfg, str(source.resolve()))
    runtime.engine = BistreamTokenEngine(runtime.engine)
    return runtime


class Synthesizer:
    """See the module docstring. Constructed by ``serve_app.app.build_app``.

    Args:
        cfg: replica config.
        source: the model to load (resolved on this node by the runtime factory).
        runtime_factory: builds the runtime; defaults to the real one (or ``cfg.runtime_factory``).
        metrics: exporter; a no-op one is used outside a replica.
        clock: seconds for playback deadlines, underruns and latencies (tests inject a fake clock).
        inbox: where bistream text arrives; default: a text inbox actor in a replica (started at
            the first bistream call: no idle process per replica), one in this process outside.
    """

    def __init__(self, cfg: SynthesizerConfig, source: ModelSource | None = None,
                 runtime_factory: RuntimeFactory | None = None,
                 metrics: ReplicaMetrics | None = None, clock: Callable[[], float] = time.perf_counter,
                 inbox: InboxClient | None = None) -> None:
        self.cfg = cfg
        self.clock = clock
        self._inbox = inbox
        if runtime_factory is None:
            runtime_factory = _import_factory(cfg.runtime_factory) if cfg.runtime_factory else default_runtime_factory
        started = time.perf_counter()
        source = source or ModelSource(cfg.model_dir)
        # Decided once per replica, on its own node; a mode that cannot run here fails now, not mid-request.
        self.mode, self.mode_source = resolve_mode(cfg.mode, constants.mode_override())
        logger.info("synthesizer execution mode: %s (from %s)", self.mode, self.mode_source)
        preflight(self.mode, cfg.trt_plan_dir)
        resolved = cfg.model_copy(update={"mode": self.mode})
        factory = runtime_factory
        self.runtime = call_with_timeout(lambda: factory(resolved, source), cfg.startup_timeout_s, "synthesizer model")
        self.t2w = self.runtime.token2wav
        self.sample_rate = self.t2w.sample_rate
        overlap = cfg.overlap_stages if cfg.overlap_stages is not None else self.runtime.device.startswith("cuda")
        self.compute = ComputeExecutor(cfg.compute_threads, lanes=(TOKEN2WAV_LANE,) if overlap else ())
        self._t2w_lane = TOKEN2WAV_LANE if overlap else MAIN_LANE
        self.loop = EngineLoop(self.runtime.engine, self.compute, lane=None if overlap else MAIN_LANE)
        self.probe = DeviceProbe(self.runtime.device)
        self.metrics = metrics or ReplicaMetrics.for_replica("synthesizer")
        self.t2w_batch_sizes: Counter[int] = Counter()
        self.t2w_splits = 0  # token2wav batches that raised and were split in halves
        self.t2w_failed_jobs = 0  # chunk jobs failed alone (an error even alone, or non-finite audio)
        slack = cfg.token2wav.deadline_slack_s
        self.gate = DeadlineGate(slack, clock=clock) if slack is not None else None
        self.stepped: SteppedToken2Wav | None = None  # token2wav.scheduler "steps" (resolved by the runtime)
        if self.runtime.details.get("t2w_scheduler") == "steps":
            self.gate = None  # the stepped loop schedules by deadline itself
            self.stepped = SteppedToken2Wav(self.t2w, self.compute, self._t2w_lane, clock, slack or 0.0,
                                            min(cfg.token2wav.max_batch_size,
                                                self.runtime.details.get("max_flow_batch", cfg.token2wav.max_batch_size)),
                                            on_fatal=self.loop.kill)
        self.underruns = 0  # chunks made after the request's audio so far had run out (at the replica)
        self._active = 0  # synthesize() calls in progress; 0 for IDLE_TRIM_DELAY_S -> release_free_heap
        self._trim_timer: asyncio.TimerHandle | None = None
        self._trim_task: asyncio.Task | None = None
        self.heap_trims = 0
        self.cuda_cache_releases = 0  # empty_cache calls, each after a measured fragmentation
        details = self.runtime.details
        # max_mem_gb may lower the flow batch and the prompt length this replica accepts.
        self.max_prompt_tokens: int | None = details.get("max_prompt_tokens")
        self._token2wav.set_max_batch_size(min(cfg.token2wav.max_batch_size,
                                               details.get("max_flow_batch", cfg.token2wav.max_batch_size)))
        self._token2wav.set_batch_wait_timeout_s(cfg.token2wav.batch_wait_timeout_s)
        if cfg.warmup:
            call_with_timeout(self._warmup, cfg.startup_timeout_s, "synthesizer warmup")
        logger.info("synthesizer ready on %s in %.1f s (model %s)", self.runtime.device,
                    time.perf_counter() - started, source)

    # ---------------------------------------------------------------- handle API
    async def synthesize_bistream(self, req: PreparedRequest) -> AsyncIterator[BistreamTicket | AudioChunk]:
        """Text-in streaming (handle ``.options(stream=True)``): first a :class:`BistreamTicket`
        (push this request's text ids there, then the end), then audio chunks as :meth:`synthesize`
        makes them, the first before the text has ended. ``req.pieces`` is not used."""
        if not hasattr(self.runtime.engine, "add_bistream"):
            raise InvalidInputError("this replica's engine does not take bistream requests")
        if self._inbox is None:
            self._inbox = _default_inbox()
        inbox, session = self._inbox, req.request_id
        await inbox.open(session)
        try:
            yield BistreamTicket(inbox, session)
            async for chunk in self.synthesize(req, text=inbox.text(session)):
                yield chunk
        finally:
            inbox.close(session)

    async def synthesize(self, req: PreparedRequest, text: TextSource | None = None) -> AsyncIterator[AudioChunk]:
        """Stream audio chunks of ``req`` as they are produced (handle ``.options(stream=True)``).

        ``text``: the text of a bistream request (:meth:`synthesize_bistream` only): one LLM
        sequence over the prompt of ``req`` instead of one per piece."""
        started = self.clock()
        playback = Playback(started)
        index = 0
        samples = 0
        status = "ok"
        self._active += 1
        if self._trim_timer is not None:
            self._trim_timer.cancel()
            self._trim_timer = None
        try:
            n_prompt = len(req.prompt.speech_tokens)
            if self.max_prompt_tokens is not None and n_prompt > self.max_prompt_tokens:
                raise InvalidInputError(f"prompt of {n_prompt} speech tokens is longer than this replica accepts "
                                        f"({self.max_prompt_tokens})")
            pieces = req.pieces if text is None else [None]
            last_piece = len(pieces) - 1
            for p, piece in enumerate(pieces):
                async for audio, final in self._synthesize_piece(req, p, piece, playback, text):
                    now = self.clock()
                    if index == 0:
                        self.metrics.observe_ttfa(now - started)
                    self.underruns += playback.add(now, len(audio) / self.sample_rate)
                    samples += len(audio)
                    yield AudioChunk(request_id=req.request_id, samples=audio, sample_rate=self.sample_rate,
                                     index=index, piece=p, is_last=final and p == last_piece)
                    index += 1
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except GeneratorExit:
            status = "cancelled"
            raise
        except CosyVoiceError as exc:
            status = "error"
            portable = portable_error(exc)
            if portable is exc:
                raise
            raise portable from None
        except Exception:
            status = "error"
            raise
        finally:
            elapsed = self.clock() - started
            self.metrics.count_request(status)
            if samples and status == "ok":
                self.metrics.observe_rtf(elapsed / (samples / self.sample_rate))
            self._active -= 1
            if self._active == 0:
                self._trim_when_idle()

    async def synthesize_unary(self, req: PreparedRequest) -> SynthesisResult:
        """The whole utterance at once (handle ``.remote()`` without streaming)."""
        started = self.clock()
        chunks, first = [], None
        async for chunk in self.synthesize(req):
            if first is None:
                first = self.clock() - started
            chunks.append(chunk.samples)
        samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
        return SynthesisResult(request_id=req.request_id, samples=samples, sample_rate=self.sample_rate,
                               num_chunks=len(chunks), time_to_first_audio_s=first or 0.0,
                               compute_s=self.clock() - started)

    def stats(self) -> dict[str, Any]:
        """Engine, batching and device figures of this replica (for /metrics, /health, tests)."""
        engine = self.loop.stats()
        allocated, total = self.probe.memory()
        return {
            "replica_id": _replica_id(),
            "engine": engine.__dict__,
            "step_batch_sizes": dict(Counter(self.loop.step_batch_sizes)),
            "token2wav_batch_sizes": dict(self.t2w_batch_sizes),
            "generated_tokens_total": self.loop.tokens,
            "underruns_total": self.underruns,
            "deadline_held_total": self.gate.held if self.gate is not None else 0,
            "token2wav_splits_total": self.t2w_splits,
            "token2wav_failed_jobs_total": self.t2w_failed_jobs + self._stepped_failed(),
            "failed_requests_total": self.loop.failed + self.t2w_failed_jobs + self._stepped_failed(),
            "token2wav_scheduler": "steps" if self.stepped is not None else "batch",
            "flow_passes_total": self.stepped.passes if self.stepped is not None else 0,
            "flow_rows_in_passes_total": self.stepped.rows_in_passes if self.stepped is not None else 0,
            "cuda_cache_releases": self.cuda_cache_releases,
            "utilization_pct": self.probe.utilization_pct(self.compute.busy_fraction()),
            "sm_activity_pct": self.probe.sm_activity_pct(),
            "streams_in_flight": self._active,
            "gpu_memory_allocated_bytes": allocated,
            "gpu_memory_total_bytes": total,
        }

    def health(self) -> ReplicaHealth:
        stats = self.stats()
        return ReplicaHealth(
            deployment="Synthesizer", replica_id=stats["replica_id"], ready=not self.loop.is_dead,
            device=self.runtime.device, gpu_memory_allocated_bytes=stats["gpu_memory_allocated_bytes"],
            gpu_memory_total_bytes=stats["gpu_memory_total_bytes"], gpu_utilization_pct=stats["utilization_pct"],
            engine=self.loop.stats(),
            detail={"mode": self.mode, "mode_source": self.mode_source,
                    **{k: v for k, v in self.runtime.details.items() if k not in ("mode", "mode_source")}},
        )

    # ---------------------------------------------------------------- Serve hooks
    def check_health(self) -> None:
        self.loop.raise_if_dead()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics (read by ``deployments.autoscaling_policy``)."""
        util = self.probe.utilization_pct(self.compute.busy_fraction())
        engine = self.loop.stats()
        self.metrics.set_engine(engine.running, engine.waiting, util)
        # streams_in_flight is the load policy's signal; utilisation is for dashboards only.
        return {"streams_in_flight": float(self._active), "gpu_utilization_pct": util,
                "engine_running": float(engine.running)}

    # ---------------------------------------------------------------- internals
    def _trim_when_idle(self) -> None:
        """Once no request has run for IDLE_TRIM_DELAY_S, give freed heap back (on the compute thread).

        NOTE: even with two glibc arenas the heap keeps the freed chunks of the last peak of
        transient tensors; returning them when idle keeps an idle replica's RSS near its working set
        (the soak's after-run check measures it so). Under load nothing is trimmed.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a generator finalised outside the loop
            return
        self._trim_timer = loop.call_later(IDLE_TRIM_DELAY_S, self._trim_if_idle)

    def _trim_if_idle(self) -> None:
        """The idle timer's callback (on the event loop): trim unless a request came meanwhile."""
        self._trim_timer = None
        if self._active == 0 and (self._trim_task is None or self._trim_task.done()):
            self.heap_trims += 1
            self._trim_task = asyncio.get_running_loop().create_task(self.compute.run(self._release_idle_memory))

    def _release_idle_memory(self) -> None:
        """Idle only: freed host heap back to the OS; the CUDA cache emptied if measured fragmented."""
        release_free_heap()
        cuda = release_fragmented_cache(self.runtime.device)
        if cuda is not None and cuda["released"]:
            self.cuda_cache_releases += 1

    def _warmup(self) -> None:
        """Drive one tiny request through the engine and token2wav synchronously (before serving)."""
        n_prompt = 2 * constants.WARMUP_TEXT_TOKENS
        prompt = VoicePrompt(family="warmup", prompt_text_ids=np.zeros(0, np.int32),
                             speech_tokens=np.zeros(n_prompt, np.int32),
                             mel=np.zeros((2 * n_prompt, self.t2w.n_mels), np.float32),
                             embedding=np.zeros(self.t2w.embedding_dim, np.float32))
        engine = self.runtime.engine
        # <|endofprompt|> first: CosyVoice3 refuses text without it; for CosyVoice2 it is a plain id.
        text_ids = np.array([ENDOFPROMPT_TOKEN_ID, *range(1, constants.WARMUP_TEXT_TOKENS)], dtype=np.int32)
        lm = LMRequest(text_ids=text_ids,
                       prompt_text_ids=np.zeros(0, np.int32), prompt_speech_ids=prompt.speech_tokens, seed=0)
        started = time.perf_counter()
        engine.add("__warmup__", lm)
        tokens, done = [], False
        while not done and engine.has_unfinished():
            for event in engine.step():
                tokens.extend(event.new_tokens)
                done = done or event.finished
        state = self.t2w.new_stream(prompt, stream=False, speed=1.0, seed=0)
        if tokens:
            while (job := self.t2w.next_job(state, tokens, llm_done=True)) is not None:
                self.t2w.run_batch([job])
        logger.info("warmup: %d tokens in %.2f s", len(tokens), time.perf_counter() - started)

    async def _synthesize_piece(self, req: PreparedRequest, p: int, piece, playback: Playback,
                                text: TextSource | None = None) -> AsyncIterator[tuple[np.ndarray, bool]]:
        prompt = req.prompt
        speech = prompt.speech_tokens if req.llm_use_prompt_speech else np.zeros(0, dtype=np.int32)
        if text is not None:
            lm = BistreamLMRequest(prompt_text_ids=req.llm_prompt_text_ids, prompt_speech_ids=speech, seed=req.seed)
        elif piece.text_ids.size == 0:
            raise InvalidInputError(f"text piece {p} has no tokens")
        else:
            lm = LMRequest(text_ids=piece.text_ids, prompt_text_ids=req.llm_prompt_text_ids,
                           prompt_speech_ids=speech, seed=req.seed)
        state = self.t2w.new_stream(prompt, stream=req.stream, speed=req.speed, seed=req.seed)
        tokens: list[int] = []
        # Woken when the next chunk's tokens are there (or at the end), not on every decode step.
        async for event in self.loop.generate(f"{req.request_id}/{p}", lm, need=lambda: self.t2w.tokens_needed(state),
                                              text=text):
            tokens.extend(event.new_tokens)
            while (job := self.t2w.next_job(state, tokens, llm_done=event.finished)) is not None:
                if self.stepped is not None:
                    audio = await self._token2wav_stepped(job, playback.deadline_s())
                else:
                    turn = self.gate.turn(playback.deadline_s()) if self.gate is not None else contextlib.nullcontext()
                    async with turn:
                        audio = await self._token2wav(job)
                if isinstance(audio, Exception):  # this job failed alone (see _run_jobs)
                    raise audio
                yield audio, bool(getattr(job, "finalize", False))

    def _stepped_failed(self) -> int:
        return self.stepped.failed_jobs if self.stepped is not None else 0

    async def _token2wav_stepped(self, job, deadline_s: float) -> np.ndarray | Exception:
        if self.loop.is_dead:
            raise EngineDeadError("replica unhealthy: an earlier fault left the device unusable")
        audio = await self.stepped.run(job, deadline_s)
        return audio if isinstance(audio, Exception) else self._finite(audio)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def _token2wav(self, jobs: list) -> list[np.ndarray | Exception]:
        """Flow + HiFT over chunk jobs of many streams, as one batch (see :meth:`_run_jobs`)."""
        self.t2w_batch_sizes[len(jobs)] += 1
        self.metrics.observe_batch(len(jobs))
        return await self._run_jobs(jobs)

    async def _run_jobs(self, jobs: list) -> list[np.ndarray | Exception]:
        """The audio of each job, or the :class:`RequestFailedError` of a job that failed alone.

        A batch that raises is split in halves and each half retried (a batch too big for the
        device's memory fits in smaller ones), down to single jobs; a job that still raises alone
        fails its request only. NOTE: a retry is exact when the error came from the flow solve
        (no stream state is touched before the vocoder); a vocoder error part-way can leave a
        retried job's vocoder cache advanced, so its audio may click once. A fatal fault
        (:func:`is_fatal`) fails every open request and marks the replica unhealthy.
        """
        if self.loop.is_dead:
            raise EngineDeadError("replica unhealthy: an earlier fault left the device unusable")
        try:
            audios = await self.compute.run(self.t2w.run_batch, jobs, lane=self._t2w_lane)
        except Exception as exc:
            if is_fatal(exc):
                logger.exception("token2wav failed fatally; the replica is unhealthy")
                self.loop.kill(exc)
                raise EngineDeadError(f"token2wav failed: {type(exc).__name__}") from None
            if len(jobs) == 1:
                self.t2w_failed_jobs += 1
                logger.warning("token2wav failed for one job (%s: %s); failing its request", type(exc).__name__, exc)
                return [RequestFailedError(f"audio generation failed: {type(exc).__name__}: {exc}")]
            self.t2w_splits += 1
            logger.warning("token2wav batch of %d failed (%s); retrying in halves", len(jobs), type(exc).__name__)
            half = len(jobs) // 2
            return await self._run_jobs(jobs[:half]) + await self._run_jobs(jobs[half:])
        return [self._finite(audio) for audio in audios]

    def _finite(self, audio: np.ndarray) -> np.ndarray | Exception:
        if np.isfinite(audio).all():
            return audio
        self.t2w_failed_jobs += 1
        logger.warning("token2wav produced non-finite samples (NaN/Inf); failing that request")
        return RequestFailedError("audio generation produced non-finite samples (NaN/Inf)")

    def __del__(self) -> None:
        # Serve calls this on shutdown; also safe under GC outside a replica.
        if hasattr(self, "loop"):
            self.loop.stop()
        if hasattr(self, "compute"):
            self.compute.shutdown()
        if hasattr(self, "probe"):
            self.probe.close()

    @classmethod
    def deployment_options(cls, cfg: SynthesizerConfig) -> dict[str, Any]:
        opts = cfg.serve_options("Synthesizer")
        # NOTE: glibc malloc gives threads that allocate concurrently (event loop, compute thread,
        # Ray's threads) arenas of their own, up to 8 per core, and keeps freed chunks in each, so
        # the replica's RSS ratchets up with every new peak of transient tensors. Measured with the
        # tiny model on 2 cores (bench/leak_probe.py, 200 requests, Python objects and tensors flat):
        # RSS 522 -> 761 MiB by default, flat at 612-628 MiB after the first 20 requests with 2 arenas,
        # same throughput. Serve merges these env_vars with the application's runtime_env.
        env = opts["ray_actor_options"].setdefault("runtime_env", {}).setdefault("env_vars", {})
        env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENA_MAX)
        return opts


def _default_inbox() -> InboxClient:
    """The text inbox actor inside a Serve replica, one in this process outside (tests)."""
    try:
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - outside a replica (unit tests, in-process apps)
        return LocalInbox()
    return ActorInbox.start()


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (unit tests)
        return "local"
