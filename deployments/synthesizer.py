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
text inbox actor (started with the replica), and the request reads it from there.

A request that is abandoned (client disconnect, handle ``cancel()``) raises ``CancelledError``
inside :meth:`synthesize`; the ``finally`` of the engine loop's generator aborts its sequence.

An error in one request fails that request only (:class:`RequestFailedError`): the engine loop
isolates a request whose decode step fails (``deployments.engine_loop``); a token2wav batch that
raises (e.g. CUDA out of memory) is split in halves and retried, down to the one job that still
fails; a chunk with non-finite samples (NaN/Inf) fails its request instead of reaching the client
(``deployments.token2wav_batch``).
A fault that leaves the device unusable (``engine_loop.is_fatal``) fails every open stream with
:class:`EngineDeadError` and makes ``check_health`` raise, so Serve replaces the replica.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from ray import serve

from cosyvoice_runtime.lm_messages import BistreamLMRequest, LMRequest
from cosyvoice_runtime.modes import preflight
from deployments.admission import Admission
from deployments.compute import MAIN as MAIN_LANE
from deployments.compute import ComputeExecutor
from deployments.deadlines import DeadlineGate, Playback
from deployments.engine_loop import EngineLoop, GiveWay, TextSource
from deployments.execution_plan import replica_plan
from deployments.gpu_stats import DeviceProbe
from deployments.housekeeping import IdleTrim, cap_malloc_arenas
from deployments.model_source import ModelSource
from deployments.observability import ReplicaMetrics, replica_id
from deployments.protocol import (
    REPLICA_UP,
    AudioChunk,
    CosyVoiceError,
    EngineDeadError,
    InvalidInputError,
    OverloadedError,
    PreparedRequest,
    ReplicaHealth,
    portable_error,
)
from deployments.python_gc import settle_replica
from deployments.replica_start import ColdStart
from deployments.resume import PieceCursor, start_of
from deployments.runtime_adapter import call_with_timeout
from deployments.runtime_factory import RuntimeFactory, default_runtime_factory, import_factory
from deployments.synthesizer_config import SynthesizerConfig
from deployments.text_inbox import BistreamTicket, InboxClient, default_inbox
from deployments.text_marks import TextMarker
from deployments.thread_load import gil_wait, thread_cpu_seconds
from deployments.token2wav_batch import BatchJobs
from deployments.token2wav_loop import SteppedToken2Wav
from deployments.warmup import warm_up

logger = logging.getLogger(__name__)
TOKEN2WAV_LANE = "token2wav"  # the compute lane of flow + HiFT batches when stages overlap

class Synthesizer:
    """See the module docstring. Constructed by ``serve_app.app.build_app``.

    Args:
        cfg: replica config.
        source: the model to load (resolved on this node by the runtime factory).
        runtime_factory: builds the runtime; defaults to the real one (or ``cfg.runtime_factory``).
        metrics: exporter; a no-op one is used outside a replica.
        clock: seconds for playback deadlines, underruns and latencies (tests inject a fake clock).
        inbox: where bistream text arrives; default: a text inbox actor in a replica (started
            with it: one small idle process per replica), one in this process outside.
    """

    def __init__(self, cfg: SynthesizerConfig, source: ModelSource | None = None,
                 runtime_factory: RuntimeFactory | None = None,
                 metrics: ReplicaMetrics | None = None, clock: Callable[[], float] = time.perf_counter,
                 inbox: InboxClient | None = None) -> None:
        self.cfg = cfg
        self.clock = clock
        # Started with the replica, in the background while the model loads: a Ray actor's worker
        # process takes a while to come up (docs/serving.md, text-in streaming), which the first
        # bistream session of a replica otherwise waited for before its first audio.
        self._inbox = inbox or default_inbox()
        if runtime_factory is None:
            runtime_factory = import_factory(cfg.runtime_factory) if cfg.runtime_factory else default_runtime_factory
        self.cold_start = ColdStart()
        source = source or ModelSource(cfg.model_dir)
        # Every code path of this replica (mode, device, graphs, schedulers: deployments.execution_plan),
        # decided once, on its own node; the runtime is built from it. A mode that cannot run here fails
        # now, before the weights load, not mid-request.
        self.plan = plan = replica_plan(cfg)
        self.mode, self.mode_source = plan.mode, plan.mode_source
        logger.info("synthesizer execution mode: %s (from %s); plan: %s", self.mode, self.mode_source, plan)
        preflight(self.mode, cfg.trt_plan_dir)
        resolved = cfg.model_copy(update={"mode": self.mode})
        factory = runtime_factory
        self.runtime = call_with_timeout(lambda: factory(resolved, source, plan), cfg.startup_timeout_s,
                                         "synthesizer model")
        self.cold_start.mark("runtime")  # model load and the CUDA graphs captured before ready
        self.t2w = self.runtime.token2wav
        self.sample_rate = self.t2w.sample_rate
        overlap = plan.overlap_stages
        self.compute = ComputeExecutor(cfg.compute_threads, lanes=(TOKEN2WAV_LANE,) if overlap else ())
        self._t2w_lane = TOKEN2WAV_LANE if overlap else MAIN_LANE
        slack = cfg.token2wav.deadline_slack_s
        steps = plan.token2wav.scheduler == "steps"
        # the flow batch this replica takes: the config's, lowered by max_mem_gb when the runtime fitted it
        max_flow_batch = min(cfg.token2wav.max_batch_size, self.runtime.max_flow_batch or cfg.token2wav.max_batch_size)
        give_way = GiveWay(overdue=lambda: self.stepped.overdue(), slack_s=slack or 0.0,
                           max_s=plan.token2wav.give_way_ms / 1e3, clock=clock) \
            if plan.token2wav.give_way_ms > 0 else None
        self.loop = EngineLoop(self.runtime.engine, self.compute, lane=None if overlap else MAIN_LANE,
                               give_way=give_way)
        self.probe = DeviceProbe(self.runtime.device)
        self.metrics = metrics or ReplicaMetrics.for_replica("synthesizer")
        self.t2w_batch_sizes: Counter[int] = Counter()
        self.jobs = BatchJobs(self.t2w, self.compute, self._t2w_lane, self.loop)  # failure isolation of both schedulers
        # the batch scheduler's deadline-first admission (the stepped loop schedules by deadline itself)
        self.gate = DeadlineGate(slack, clock=clock) if plan.token2wav.deadline_gate else None
        self.stepped: SteppedToken2Wav | None = None  # token2wav.scheduler "steps"
        if steps:
            self.stepped = SteppedToken2Wav(self.t2w, self.compute, self._t2w_lane, clock, slack or 0.0,
                                            max_flow_batch,
                                            on_fatal=self.loop.kill, on_rows_left=self.loop.wake,
                                            rider_ratio=cfg.token2wav.rider_ratio)
        self.underruns = 0  # chunks made after the request's audio so far had run out (at the replica)
        self._active = 0  # synthesize() calls in progress; 0 for a while -> freed memory given back
        self.admission = Admission.from_config(cfg.admission, cfg.max_ongoing_requests, cfg.retry_after_s, clock)
        graphs = self.runtime.graph_schedule
        # no device-wide cache release while graphs are captured in the background (graph_schedule)
        self.idle_trim = IdleTrim(self.runtime.device, self.compute.run,
                                  idle=lambda: self._active == 0 and not (graphs is not None and graphs.busy))
        # max_mem_gb may lower the flow batch and the prompt length this replica accepts.
        self.max_prompt_tokens: int | None = self.runtime.max_prompt_tokens
        self._token2wav.set_max_batch_size(max_flow_batch)
        self._token2wav.set_batch_wait_timeout_s(cfg.token2wav.batch_wait_timeout_s)
        if cfg.warmup:
            call_with_timeout(lambda: warm_up(self.runtime), cfg.startup_timeout_s, "synthesizer warmup")
            self.cold_start.mark("warmup")
        self.gc = settle_replica(cfg.gc_freeze)  # last: the model, warm-up and graphs are all made
        self.gil = gil_wait()
        logger.info("synthesizer ready on %s in %.1f s (model %s; %d objects frozen out of GC walks)",
                    self.runtime.device, self.cold_start.ready(), source, self.gc.snapshot()["frozen"])
        self.ready_at = clock()  # a first chunk tells how long its replica had served (REPLICA_UP)
        if graphs is not None:  # the graphs left for after ready (graphs_before_ready: first)
            graphs.start_background()

    # ---------------------------------------------------------------- handle API
    async def synthesize_bistream(self, req: PreparedRequest) -> AsyncIterator[BistreamTicket | AudioChunk]:
        """Text-in streaming (handle ``.options(stream=True)``): first a :class:`BistreamTicket`
        (push this request's text ids there, then the end), then audio chunks as :meth:`synthesize`
        makes them, the first before the text has ended. ``req.pieces`` is not used."""
        if not hasattr(self.runtime.engine, "add_bistream"):
            raise InvalidInputError("this replica's engine does not take bistream requests")
        self._admit()  # before the ticket: a refusal is the call's first answer
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
        if text is None and req.resume is None:  # bistream: synthesize_bistream admits; a resume was admitted
            self._admit()
        started = self.clock()
        playback = Playback(started)
        first_piece, index = start_of(req.resume)
        samples, status = 0, "ok"
        self._active += 1
        load = self._active
        self.idle_trim.cancel()
        try:
            n_prompt = len(req.prompt.speech_tokens)
            if self.max_prompt_tokens is not None and n_prompt > self.max_prompt_tokens:
                raise InvalidInputError(f"prompt of {n_prompt} speech tokens is longer than this replica accepts "
                                        f"({self.max_prompt_tokens})")
            pieces = req.pieces if text is None else [None]
            last_piece = len(pieces) - 1
            marks: dict[str, float] = {}  # FIRST_AUDIO_STAGES, clock times (the first piece stamps them)
            for p, piece in enumerate(pieces[first_piece:], first_piece):
                cursor = PieceCursor(req.resume if p == first_piece else None)
                async for audio, final, text_marks in self._synthesize_piece(req, p, piece, playback, text, marks,
                                                                              cursor):
                    if (audio := cursor.trim(audio, keep_empty=final and p == last_piece)) is None:
                        continue  # a continuation: all of it is audio its client has
                    now = self.clock()
                    timing = None
                    if index == 0:
                        self.metrics.observe_ttfa(now - started)
                        if text is None:  # a bistream request's first audio waits for its client's text
                            self.admission.first_audio(load, now - started)
                        marks["first_audio"] = now
                        timing = {k: round((t - started) * 1e3, 2) for k, t in marks.items()}
                        timing[REPLICA_UP] = round((started - self.ready_at) * 1e3, 2)
                    self.underruns += playback.add(now, len(audio) / self.sample_rate)
                    samples += len(audio)
                    yield AudioChunk(request_id=req.request_id, samples=audio, sample_rate=self.sample_rate,
                                     index=index, piece=p, is_last=final and p == last_piece, timing=timing,
                                     tokens=cursor.take(), llm_done=cursor.llm_done, text_marks=text_marks)
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
                self.admission.stream_ended(elapsed)
            self._active -= 1
            if self._active == 0:
                self.idle_trim.arm()

    def stats(self) -> dict[str, Any]:
        """Engine, batching and device figures of this replica (for /metrics, /health, tests)."""
        engine = self.loop.stats()
        allocated, total = self.probe.memory()
        return {
            "replica_id": replica_id(),
            "engine": engine.__dict__,
            "step_batch_sizes": dict(Counter(self.loop.step_batch_sizes)),
            "token2wav_batch_sizes": dict(self.t2w_batch_sizes),
            "generated_tokens_total": self.loop.tokens,
            "underruns_total": self.underruns,
            "deadline_held_total": self.gate.held if self.gate is not None else 0,
            "token2wav_splits_total": self.jobs.splits,
            "token2wav_failed_jobs_total": self.jobs.failed_jobs + self._stepped_failed(),
            "failed_requests_total": self.loop.failed + self.jobs.failed_jobs + self._stepped_failed(),
            "token2wav_scheduler": "steps" if self.stepped is not None else "batch",
            "flow_passes_total": self.stepped.passes if self.stepped is not None else 0,
            "flow_rows_in_passes_total": self.stepped.rows_in_passes if self.stepped is not None else 0,
            "flow_rows_ready_total": self.stepped.rows_ready if self.stepped is not None else 0,
            "llm_give_way_total": self.loop.gave_way,
            **self.runtime.token2wav.flow_stats(),
            "cuda_cache_releases": self.idle_trim.cuda_cache_releases,
            "cuda_graph_captures_total": self.runtime.graph_captures(),
            "cuda_graph_misses_total": self.runtime.graph_misses(),
            "cold_start": self.cold_start.snapshot(self.runtime),
            "gc": self.gc.snapshot(),
            "gil_wait": self.gil.snapshot(),
            "thread_cpu_seconds": thread_cpu_seconds(),
            "utilization_pct": self.probe.utilization_pct(self.compute.busy_fraction()),
            "sm_activity_pct": self.probe.sm_activity_pct(),
            "streams_in_flight": self._active,
            "admission": self.admission.snapshot(self._active + 1),
            "gpu_memory_allocated_bytes": allocated,
            "gpu_memory_total_bytes": total,
        }

    def health(self) -> ReplicaHealth:
        # only what the answer holds: stats() also reads every thread's CPU time from /proc, on the
        # event loop, which a /health probe has no use for
        allocated, total = self.probe.memory()
        self.metrics.set_admission(self.admission.margin_s(self._active + 1))  # also without autoscaling
        return ReplicaHealth(
            deployment="Synthesizer", replica_id=replica_id(), ready=not self.loop.is_dead,
            device=self.runtime.device, gpu_memory_allocated_bytes=allocated, gpu_memory_total_bytes=total,
            gpu_utilization_pct=self.probe.utilization_pct(self.compute.busy_fraction()),
            engine=self.loop.stats(),
            detail={"mode": self.mode, "mode_source": self.mode_source,
                    **{k: v for k, v in self.runtime.details.items() if k not in ("mode", "mode_source")},
                    "plan": self.plan.as_dict(),  # what this replica runs (deployments.execution_plan)
                    # its start's phases and CUDA graphs captured n of m (the rest in the background)
                    "cold_start": self.cold_start.snapshot(self.runtime),
                    # predicted first-audio margin of a request admitted now (deployments.admission)
                    "admission": self.admission.snapshot(self._active + 1)},
        )

    def open_entries(self) -> dict[str, int]:
        """Sizes of this replica's per-request bookkeeping (engine loop, engine, compute executor),
        each back to its idle size once every request has ended (``bench/leak_probe.py``)."""
        engine = getattr(self.runtime.engine, "open_entries", None)  # the protocol's fakes need not have it
        return {**self.loop.open_entries(), **self.compute.open_entries(), **(engine() if engine else {})}

    def outside_serve(self) -> None:
        """Use this replica without Serve around it (in-process tools): ``@serve.batch`` needs a
        replica context (ray-serve-notes §5.1), so under the batch scheduler each chunk job then
        runs as a batch of its own; the stepped scheduler batches by itself and is unchanged."""
        async def one_job(job) -> np.ndarray | Exception:
            return (await self._run_jobs([job]))[0]

        self._token2wav = one_job

    # ---------------------------------------------------------------- Serve hooks
    def check_health(self) -> None:
        self.loop.raise_if_dead()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics (read by ``deployments.autoscaling_policy``)."""
        util = self.probe.utilization_pct(self.compute.busy_fraction())
        engine = self.loop.stats()
        self.metrics.set_engine(engine.running, engine.waiting, util)
        margin = self.admission.margin_s(self._active + 1)
        self.metrics.set_admission(margin)
        # streams_in_flight (+ streams_refused: demand refused by admission) is the load policy's
        # signal; utilisation is for dashboards only.
        return {"streams_in_flight": float(self._active), "streams_refused": self.admission.streams_refused(),
                "gpu_utilization_pct": util, "engine_running": float(engine.running)}

    # ---------------------------------------------------------------- internals
    def _admit(self) -> None:
        """Refuse (OverloadedError: 429) a request whose predicted first audio misses the SLO."""
        try:
            self.admission.admit(self._active + 1)
        except OverloadedError:
            self.metrics.count_request("refused")
            raise

    async def _synthesize_piece(self, req: PreparedRequest, p: int, piece, playback: Playback,
                                text: TextSource | None, marks: dict[str, float],
                                cursor: PieceCursor) -> AsyncIterator[tuple]:
        """The audio of one piece, chunk by chunk, with whether it is the last and its text marks
        (deployments/text_marks.py); stamps the first token and the first chunk's tokens into
        ``marks`` unless an earlier piece did; ``cursor`` sees every token event."""
        prompt = req.prompt
        speech = prompt.speech_tokens if req.llm_use_prompt_speech else np.zeros(0, dtype=np.int32)
        if text is not None:
            lm = BistreamLMRequest(prompt_text_ids=req.llm_prompt_text_ids, prompt_speech_ids=speech, seed=req.seed)
        elif piece.text_ids.size == 0:
            raise InvalidInputError(f"text piece {p} has no tokens")
        else:
            lm = LMRequest(text_ids=piece.text_ids, prompt_text_ids=req.llm_prompt_text_ids,
                           prompt_speech_ids=speech, seed=req.seed, **cursor.lm_fields())
        state = self.t2w.new_stream(prompt, stream=req.stream, speed=req.speed, seed=req.seed)
        prefix = self._solve_prefix(state, playback)
        tokens: list[int] = []
        marker = TextMarker(None if text is not None else int(piece.text_ids.size))
        try:
            # Woken when the next chunk's tokens are there (or at the end), not on every decode step.
            async for event in self.loop.generate(f"{req.request_id}/{p}", lm,
                                                  need=lambda: self.t2w.tokens_needed(state), text=text,
                                                  on_first_token=lambda: marks.setdefault("first_token", self.clock()),
                                                  due=playback.deadline_s):
                tokens.extend(event.tokens)
                cursor.saw(event)
                marker.add(len(event.tokens), event.text_read)
                while (job := self.t2w.next_job(state, tokens, llm_done=event.finished)) is not None:
                    marks.setdefault("first_chunk_tokens", self.clock())
                    if self.stepped is not None:
                        if prefix is not None:  # the first job starts after its voice's prefix
                            await asyncio.wait([prefix])
                            prefix = None
                        audio = await self._token2wav_stepped(job, playback.deadline_s(), marks)
                    else:
                        turn = (self.gate.turn(playback.deadline_s()) if self.gate is not None
                                else contextlib.nullcontext())
                        async with turn:
                            audio = await self._token2wav(job)
                    if isinstance(audio, Exception):  # this job failed alone (BatchJobs.run)
                        raise audio
                    final = bool(getattr(job, "finalize", False))
                    yield audio, final, marker.chunk(len(tokens) if final else marker.spoken + job.hop, final,
                                                     event.finished)
        finally:
            if prefix is not None:  # the request ended first: the driver drops the row
                prefix.cancel()

    def _solve_prefix(self, state, playback: Playback) -> asyncio.Future | None:
        """With the stepped token2wav, a new voice's prompt prefix solved now, while the LLM makes
        the stream's first chunk (``Token2Wav.prefix_job``), due as that chunk is; None: nothing to
        solve. Its outcome is not the request's: a failed prefix leaves the first job to solve it."""
        job = self.t2w.prefix_job(state) if self.stepped is not None else None
        if job is None:
            return None
        return asyncio.ensure_future(self.stepped.run(job, playback.deadline_s()))

    def _stepped_failed(self) -> int:
        return self.stepped.failed_jobs if self.stepped is not None else 0

    async def _token2wav_stepped(self, job, deadline_s: float, marks: dict[str, float]) -> np.ndarray | Exception:
        if self.loop.is_dead:
            raise EngineDeadError("replica unhealthy: an earlier fault left the device unusable")
        audio = await self.stepped.run(job, deadline_s, marks)
        return audio if isinstance(audio, Exception) else self.jobs.finite(audio)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def _token2wav(self, jobs: list) -> list[np.ndarray | Exception]:
        """Flow + HiFT over chunk jobs of many streams, as one batch (:class:`BatchJobs`: failure isolation)."""
        return await self._run_jobs(jobs)

    async def _run_jobs(self, jobs: list) -> list[np.ndarray | Exception]:
        self.t2w_batch_sizes[len(jobs)] += 1
        self.metrics.observe_batch(len(jobs))
        return await self.jobs.run(jobs)

    def shutdown(self) -> None:
        """Stop the background graph capture, the step thread, the compute lanes and the device
        probe (no wait). Serve calls ``__del__`` on shutdown; in-process tools call this before the
        next replica loads on the same device."""
        if getattr(getattr(self, "runtime", None), "graph_schedule", None) is not None:
            self.runtime.graph_schedule.stop()
        if hasattr(self, "loop"):
            self.loop.stop()
        if hasattr(self, "compute"):
            self.compute.shutdown()
        if hasattr(self, "probe"):
            self.probe.close()

    def __del__(self) -> None:
        self.shutdown()  # also safe under GC of a replica whose constructor failed

    @classmethod
    def deployment_options(cls, cfg: SynthesizerConfig) -> dict[str, Any]:
        return cap_malloc_arenas(cfg.serve_options("Synthesizer"))  # RSS that does not ratchet up
