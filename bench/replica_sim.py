"""The replica simulation of the GPU benchmarks: one model, an LLM engine thread and one or two
token2wav lanes, like one GPU replica without Serve around it.

* The engine thread runs continuous-batching decode steps (CUDA graphs optional) on its own CUDA
  stream.
* The bulk token2wav lane runs flow + HiFT batches of ready jobs (first chunks first, or earliest
  playback deadline first with ``edf_slack_s``).
* With an ``express`` model (its own graphed copies of the flow and vocoder, sharing nothing
  mutable with the bulk lane's), a second lane on a higher-priority CUDA stream takes the first
  two chunks of every stream, so a new stream's first audio never queues behind another stream's
  long flow solve (CosyVoice2 recomputes the whole prefix per chunk: a late chunk of a 20 s
  utterance is a ~200 ms job, H200 2026-12-04).

Used by ``bench/gpu_bench.py`` (closed loop per concurrency) and ``bench/capacity.py`` (sessions
and Poisson arrivals).
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.metrics import RequestTrace
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.inputs import build_lm_input
from cosyvoice_runtime.llm.sampling import SamplingParams
from cosyvoice_runtime.model import CosyVoiceModel
from cosyvoice_runtime.stream_schedule import pick_rows
from cosyvoice_runtime.token2wav import StreamState, Token2Wav
from cosyvoice_runtime.voice_prompt import VoicePrompt
from deployments.runtime_adapter import PassQueue

logger = logging.getLogger("bench")

PROMPT_SPEECH, PROMPT_TEXT, TEXT = 87, 14, 40  # the official baseline's zero-shot shapes
EXPRESS_CALLS = 2  # the express lane takes each stream's first this many token2wav jobs
EXPRESS_BATCH = 8  # the express lane's largest batch (its graphs are captured up to it)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Stream:
    trace: RequestTrace
    state: StreamState
    tokens: list[int] = field(default_factory=list)
    llm_done: bool = False
    first_token_s: float | None = None  # time-to-first-audio breakdown
    first_job_s: float | None = None  # the first token2wav job started
    on_finish: Callable[[_Stream], None] | None = None


@dataclass
class _Lane:
    """A token2wav thread: its Token2Wav (own graphed modules), CUDA stream priority, which jobs."""

    name: str
    t2w: Token2Wav
    priority: int
    takes: Callable[[StreamState], bool]
    max_batch: int


class ReplicaSim:
    """An LLM engine thread and one or two token2wav lanes around one model (module docstring)."""

    def __init__(self, model: CosyVoiceModel, max_batch: int, n_tokens: int, cuda_graphs: bool = False,
                 flow_batch: int = 16, min_first_hop: int | None = None, edf_slack_s: float | None = None,
                 llm_compile: str | None = None, cv3_vocoder: str = "recompute", streamed_flow: str = "recompute",
                 stream_priority: bool = False, max_text: int = TEXT, length_ratio: float | None = None,
                 express: CosyVoiceModel | None = None, stepped: bool = False, prefill_graphs: bool = True,
                 prompt_cache_bytes: int = 0):
        self.model = model
        self.edf_slack_s = edf_slack_s  # None: first chunks first (see _pick)
        self.n_tokens = n_tokens  # per request unless submit() says otherwise (then the most it may say)
        self.flow_batch = flow_batch
        # extra "prio": decode steps on a high-priority CUDA stream, token2wav on a low-priority one,
        # so a step's kernels are scheduled ahead of a running flow batch's as SMs free up
        self.priorities = (-1, 0) if stream_priority or express else (0, 0)
        # extra "lenbatch" (with edf): a batch holds only jobs at most this many times as long as its
        # most urgent one, so a first chunk is not padded to a 20 s stream's prefix
        self.length_ratio = length_ratio
        # extra "steps": the bulk lane solves the flow one Euler pass at a time over rows picked by
        # deadline (cosyvoice_runtime.flow.stepper); a new stream's first chunk joins at the next pass
        if stepped and express is not None:
            raise ValueError("steps: one lane only")
        self.stepped = stepped
        self.engine = LLMEngine(model.llm, max_batch_size=max_batch,
                                max_seq_len=PROMPT_SPEECH + PROMPT_TEXT + max_text + n_tokens + 8,
                                use_cuda_graphs=cuda_graphs and model.device.type == "cuda",
                                compile_backend=llm_compile, prefill_graphs=prefill_graphs)
        if cuda_graphs and model.device.type == "cuda":
            # NOTE: capture every bucket now, on the default stream with nothing else running: a
            # capture started lazily on the LLM thread while the token2wav thread works fails
            # ("capturing stream has unjoined work", H200 2026-12-02).
            self.engine.capture_graphs()
            sync(model.device)
        self.t2w = Token2Wav(model.spec, model.flow, model.hift, min_first_hop=min_first_hop, cv3_vocoder=cv3_vocoder,
                             cv2_flow=streamed_flow, cv3_flow=streamed_flow, prompt_cache_bytes=prompt_cache_bytes)
        self.lanes = [_Lane("bulk", self.t2w, self.priorities[1],
                            (lambda st: st.calls >= EXPRESS_CALLS) if express else (lambda st: True), flow_batch)]
        if express is not None:
            ex = Token2Wav(model.spec, express.flow, express.hift, min_first_hop=min_first_hop, cv3_vocoder=cv3_vocoder,
                           cv2_flow=streamed_flow, cv3_flow=streamed_flow)
            self.lanes.append(_Lane("express", ex, -1, lambda st: st.calls < EXPRESS_CALLS, EXPRESS_BATCH))
        self.busy: set[str] = set()  # streams with a job running in some lane (a stream's jobs are sequential)
        self.lock = threading.Condition()
        self.streams: dict[str, _Stream] = {}
        self.open: dict[str, _Stream] = {}  # streams with audio still to make (token2wav scans only these)
        self.pending: list[tuple[str, torch.Tensor, int]] = []
        self.stop = False
        self.error: BaseException | None = None
        self.llm_steps = self.t2w_batches = self.t2w_jobs = 0  # progress counters for a timed-out row
        # where the time goes: (start, end) of every decode step; (start, end, jobs, first chunks, lane) of
        # every token2wav batch
        self.step_log: list[tuple[float, float]] = []
        self.batch_log: list[tuple[float, float, int, int, str]] = []
        # stepped: (start, queued, rows, frames, rows in hand when picked) per flow pass
        self.pass_log: list[tuple[float, float, int, int, int]] = []
        self._threads: list[threading.Thread] = []
        self.on_error: Callable[[BaseException], None] | None = None  # called once a worker thread failed

    def submit(self, rid: str, voice: VoicePrompt, text: torch.Tensor, t_s: float, n_tokens: int | None = None,
               on_finish=None) -> None:
        """Queue a request of ``n_tokens`` speech tokens (default: the sim's); ``on_finish(stream)``
        is called from the token2wav thread, under the lock, when its last chunk is out."""
        n = n_tokens or self.n_tokens
        if n > self.n_tokens:
            raise ValueError(f"{n} tokens: this sim holds at most {self.n_tokens} per request")
        lm = build_lm_input(self.model.llm, text, voice.text_tokens, voice.speech_tokens)
        state = self.t2w.new_stream(voice, stream=True)
        with self.lock:
            st = _Stream(RequestTrace(submitted_s=t_s), state, on_finish=on_finish)
            self.streams[rid] = self.open[rid] = st
            self.pending.append((rid, lm.embeds, n))
            self.lock.notify_all()

    def start(self) -> None:
        """Start the worker threads (for a caller that drives submissions itself)."""
        t2w_loop = self._t2w_step_loop if self.stepped else self._t2w_loop
        loops = [self._llm_loop] + [lambda lane=lane: t2w_loop(lane) for lane in self.lanes]
        self._threads = [threading.Thread(target=self._guard(f), daemon=True) for f in loops]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        with self.lock:
            self.stop = True
            self.lock.notify_all()
        for t in self._threads:
            t.join(timeout=5 if self.error else 30)

    def _llm_loop(self) -> None:
        cuda = self.model.device.type == "cuda"
        stream = torch.cuda.Stream(priority=self.priorities[0]) if cuda else None
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            while not self.stop:
                with self.lock:
                    while not self.stop and not self.pending and not self.engine.has_unfinished():
                        self.lock.wait()
                    adds, self.pending = self.pending, []
                for rid, embeds, n in adds:
                    self.engine.add_request(rid, embeds, n, n, SamplingParams.from_spec(self.model.spec.llm,
                                                                                       seed=hash(rid) % 2**31))
                if self.stop:
                    return
                start = time.perf_counter()
                events = self.engine.step()
                self.llm_steps += 1
                now = time.perf_counter()
                self.step_log.append((start, now))
                with self.lock:
                    for ev in events:
                        st = self.streams[ev.request_id]
                        if ev.tokens:
                            st.tokens.extend(ev.tokens)
                            st.first_token_s = st.first_token_s or now
                        st.llm_done = st.llm_done or ev.finished
                    self.lock.notify_all()

    def _t2w_loop(self, lane: _Lane) -> None:
        device = self.model.device
        stream = torch.cuda.Stream(priority=lane.priority) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            while not self.stop:
                with self.lock:
                    jobs = []
                    while not self.stop:
                        jobs = self._ready_jobs(lane)
                        if jobs:
                            break
                        self.lock.wait()
                    if self.stop:
                        return
                    jobs = self._pick(jobs, time.perf_counter(), lane.max_batch)
                    self.busy.update(rid for rid, _ in jobs)
                start = time.perf_counter()
                firsts = 0
                for rid, job in jobs:
                    if job.state.calls == 0:
                        self.streams[rid].first_job_s = start
                        firsts += 1
                audios = lane.t2w.run_batch([j for _, j in jobs], max_batch=lane.max_batch)
                # this lane's stream only: a device-wide sync while the other lane captures a graph
                # invalidates that capture (H200 2026-12-04: cudaErrorStreamCaptureUnsupported)
                if stream is not None:
                    stream.synchronize()
                self.t2w_batches += 1
                self.t2w_jobs += len(jobs)
                now = time.perf_counter()
                self.batch_log.append((start, now, len(jobs), firsts, lane.name))
                with self.lock:
                    for (rid, job), audio in zip(jobs, audios):
                        st = self.streams[rid]
                        self.busy.discard(rid)
                        if audio.numel():
                            st.trace.add_chunk(now, audio.numel())
                        if job.state.finished:
                            del self.open[rid]
                            if st.on_finish is not None:
                                st.on_finish(st)
                    self.lock.notify_all()

    def _t2w_step_loop(self, lane: _Lane) -> None:
        """The bulk lane, stepped: admit ready jobs as flow rows, one pass over the rows picked by
        deadline, vocode the rows whose solve is done; the GPU runs at most one pass ahead."""
        device = self.model.device
        cuda = device.type == "cuda"
        stream = torch.cuda.Stream(priority=lane.priority) if cuda else None
        rows: list = []
        rid_of: dict[int, str] = {}
        slack = self.edf_slack_s if self.edf_slack_s is not None else 0.0
        ratio = self.length_ratio or 2.0
        # two passes on the GPU at once, as a replica's default token2wav.passes_in_flight (one
        # left the lane idle through the host work between passes, H100 2026-12-06)
        passes = PassQueue(2, torch.cuda.Event if cuda else None)
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            while not self.stop:
                with self.lock:
                    while not self.stop and not rows:
                        if self._ready_jobs(lane):
                            break
                        self.lock.wait()
                    if self.stop:
                        return
                    jobs = self._ready_jobs(lane)
                    self.busy.update(rid for rid, _ in jobs)
                    deadline = {rid: self.streams[rid].trace.playback_deadline_s() for rid in self.busy}
                start = time.perf_counter()
                if jobs:
                    for rid, job in jobs:
                        if job.state.calls == 0:
                            self.streams[rid].first_job_s = start
                    new = lane.t2w.start_solves([j for _, j in jobs])
                    rid_of.update((id(r), rid) for r, (rid, _) in zip(new, jobs))
                    rows += new
                batch = pick_rows(rows, {id(r): deadline[rid_of[id(r)]] for r in rows}, start, slack,
                                  lane.max_batch, ratio)
                passes.make_room()
                t_pass = time.perf_counter()
                lane.t2w.advance(batch)
                self.pass_log.append((t_pass, time.perf_counter(), len(batch), max(r.frames for r in batch), len(rows)))
                passes.queued(stream)
                done = [r for r in batch if r.step == lane.t2w.n_steps]
                if not done:
                    continue
                rows = [r for r in rows if r.step < lane.t2w.n_steps]
                start = time.perf_counter()  # the batch log times the vocoder here (passes: pass_log)
                audios = lane.t2w.finish(done)
                if stream is not None:
                    stream.synchronize()
                now = time.perf_counter()
                self.t2w_batches += 1
                self.t2w_jobs += len(done)
                firsts = sum(1 for r in done if r.tag.state.calls == 1)
                self.batch_log.append((start, now, len(done), firsts, lane.name))
                with self.lock:
                    for row, audio in zip(done, audios):
                        rid = rid_of.pop(id(row))
                        st = self.streams[rid]
                        self.busy.discard(rid)
                        if audio.numel():
                            st.trace.add_chunk(now, audio.numel())
                        if row.tag.state.finished:
                            del self.open[rid]
                            if st.on_finish is not None:
                                st.on_finish(st)
                    self.lock.notify_all()

    def _ready_jobs(self, lane: _Lane) -> list:
        """(rid, job) of every open stream with a job ready and none running (caller holds the lock)."""
        return [(rid, j) for rid, st in self.open.items()
                if rid not in self.busy and lane.takes(st.state)
                and (j := lane.t2w.next_job(st.state, list(st.tokens), st.llm_done)) is not None]

    def _pick(self, jobs: list, now: float, max_batch: int) -> list:
        """The token2wav batch to run now out of a lane's ready jobs (caller holds the lock).

        Default: first chunks first, then up to ``max_batch`` of the rest. With ``edf_slack_s``:
        earliest playback deadline first (a stream's audio so far runs out; first audio is due at
        once), and while some job is due within the slack, only those run: a smaller batch
        returns sooner, and streams with audio to spare wait for the next one.
        """
        if self.edf_slack_s is None:
            jobs.sort(key=lambda rj: rj[1].state.calls)  # first chunks first
            return jobs[:max_batch]
        deadline = {rid: self.streams[rid].trace.playback_deadline_s() for rid, _ in jobs}
        return edf_batch(jobs, deadline, now, self.edf_slack_s, max_batch, self.length_ratio)

    def run(self, voice: VoicePrompt, text: torch.Tensor, concurrency: int, total: int,
            deadline_s: float = 180.0) -> tuple[list[RequestTrace], float]:
        """Closed loop of ``concurrency`` streams until ``total`` requests finished.

        Raises TimeoutError (after dumping every thread's stack) when the row takes longer than
        ``deadline_s``, so one stuck row cannot eat the whole lease.
        """
        self.start()
        t0 = time.perf_counter()
        while True:
            with self.lock:
                submitted = len(self.streams)
                active = sum(1 for s in self.streams.values() if not s.state.finished)
                if self.error or submitted - active == total:
                    break
                if time.perf_counter() - t0 > deadline_s:
                    faulthandler.dump_traceback(all_threads=True)
                    self.error = TimeoutError(f"row c={concurrency} not done after {deadline_s:.0f} s: "
                                              f"{submitted - active}/{total} finished; {self._progress()}")
                    break
                if active >= concurrency or submitted >= total:
                    self.lock.wait(timeout=1.0)
                    continue
            self.submit(f"r{submitted}", voice, text, time.perf_counter())
        wall = time.perf_counter() - t0
        self.close()
        if self.error:
            raise self.error
        self.breakdown = _ttfa_breakdown(list(self.streams.values()))
        return [s.trace for s in self.streams.values()], wall

    def _progress(self) -> str:
        """Where the unfinished streams stand (caller holds the lock): tells a hang from slowness."""
        open_ = [s for s in self.streams.values() if not s.state.finished]
        rows = [f"{len(s.tokens)}tok/{'done' if s.llm_done else 'gen'}/off{s.state.token_offset}/calls{s.state.calls}"
                for s in open_[:8]]
        return (f"llm steps {self.llm_steps}, t2w batches {self.t2w_batches} (jobs {self.t2w_jobs}), "
                f"engine unfinished {self.engine.has_unfinished()}; open streams: {', '.join(rows)}")

    def _guard(self, fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # surfaced by run()
                logger.exception("worker failed")
                with self.lock:
                    self.error = exc
                    self.stop = True
                    self.lock.notify_all()
                if self.on_error is not None:
                    self.on_error(exc)
        return run


def _flow_tokens(job) -> int:
    """Tokens a flow job solves over (prompt + generated so far): its share of a padded batch."""
    return job.state.prompt.n_tokens + int(job.tokens.shape[1])


def edf_batch(jobs: list, deadline: dict, now: float, slack_s: float, flow_batch: int,
              length_ratio: float | None = None) -> list:
    """Earliest playback deadline first: while some ``(rid, job)`` is due within ``slack_s``,
    only those; at most ``flow_batch``; with ``length_ratio``, only jobs at most that many
    times as long (:func:`_flow_tokens`) as the most urgent one, which the batch pads to."""
    jobs = sorted(jobs, key=lambda rj: deadline[rj[0]])
    batch = [rj for rj in jobs if deadline[rj[0]] - now < slack_s] or jobs
    if length_ratio:
        limit = length_ratio * _flow_tokens(batch[0][1])
        batch = [rj for rj in batch if _flow_tokens(rj[1]) <= limit]
    return batch[:flow_batch]


def _ttfa_breakdown(streams: list[_Stream]) -> dict:
    """Median ms from submission to the first token, to the first token2wav job, to first audio."""
    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values) * 1e3, 1) if values else None

    return {"first_token_ms_p50": med([s.first_token_s and s.first_token_s - s.trace.submitted_s for s in streams]),
            "first_job_ms_p50": med([s.first_job_s and s.first_job_s - s.trace.submitted_s for s in streams])}


