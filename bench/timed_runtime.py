"""A synthesis runtime that takes a GPU's time without a GPU: the serving layer under GPU-like load.

The H200 runs of 2026-12-05 left one question open: the whole Serve app held 7 sessions at the
SLO where the same runtime in the replica simulation held 42, with the GPU 36-63 % busy. This
runtime lets the deployments' code (engine loop, stepped token2wav driver, Ray streaming, the
ingress and the HTTP proxy) run at tens of sessions on a machine without a GPU: every call
sleeps (the GIL free, as while a replica waits on CUDA) for the time the H200 took for the same
call, after a short spin holding the GIL (the host side: Python, kernel launches, graph replays).

Times (:class:`GpuTimes`, ``H200``), fitted to the H200 runs of 2026-12-05: the LLM decode step
p50 2.7 ms at one running sequence and 4.2 ms at 48 (linear between); one incremental flow pass
(CUDA-event timed, ``bench/stepper_check.py --incremental``, CosyVoice2, bf16, 128 new frames):
``3.58 + 0.316 b + 0.00089 c + 0.00028 b c`` ms for a batch of ``b`` rows over ``c`` cached frames
(within 0.2 ms of the seven measured points). The encoder and vocoder batches are not timed
separately on the H200: 1.5 ms and 4 ms + 0.25 ms per row are assumptions, as are a prefill's
5 ms (the Serve level's first token took 8 ms p50 on the H200, one step of it 2.7) and every
host share (``host_frac``). The decode step and the flow passes run on two lanes; on the GPU they
share the SMs, so a decode step that starts while a token2wav call holds the GPU takes
``1 + llm_slowdown`` times as long (:class:`SharedGpu`). The H200 profile leaves that at 0 (the
lanes overlap perfectly: optimistic near a busy GPU); :mod:`bench.timed_fleet` fits it to an H100
reading. Read this for what the serving layer costs, not as GPU capacity.

The chunk schedule is CosyVoice2's streamed one with the early first chunk (the serving default,
:func:`cosyvoice_runtime.stream_schedule.first_hop`, 25-token hops, 3 look-ahead tokens, 2 mel
frames a token), and a request makes ``max_token_text_ratio`` (20) tokens per text id, as the
random-weight models do (they rarely sample the stop token). The audio is silence.

Use: ``synthesizer.runtime_factory: bench.timed_runtime:h200`` (or ``h200_gil``: half of every
call holding the GIL); ``bench/capacity.py --timed [PROFILE]`` sets it, with the CPU and the
stepped scheduler.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from bench.null_runtime import SAMPLE_RATE, SAMPLES_PER_TOKEN, NullEngine
from cosyvoice_runtime.stream_schedule import first_hop
from deployments.runtime_protocol import FLOW_STATS, SynthesisRuntime

MEL_PER_TOKEN = 2
HOP, LOOKAHEAD, FIRST_MIN_TOKENS = 25, 3, 10  # CosyVoice2's stream, the early first chunk's minimum
TOKENS_PER_TEXT_ID = 20  # max_token_text_ratio: random weights run to the length cap
N_STEPS = 10  # flow ODE steps


@dataclass(frozen=True)
class GpuTimes:
    """Milliseconds a call takes on the GPU (see the module docstring for where they come from)."""

    step_ms_1: float = 2.7  # decode step, one running sequence
    step_ms_48: float = 4.2  # decode step, 48 running sequences
    prefill_ms: float = 5.0  # a new request's graphed prefill, added to the step that admits it (assumed)
    pass_ms: float = 3.58  # flow pass: constant
    pass_ms_row: float = 0.316  # ... per row
    pass_ms_cached: float = 0.00089  # ... per cached frame (of the longest row)
    pass_ms_row_cached: float = 0.00028  # ... per row and cached frame
    encoder_ms: float = 1.5  # one encoder batch (assumed)
    vocoder_ms: float = 4.0  # one vocoder batch (assumed) ...
    vocoder_ms_row: float = 0.25  # ... plus per row (assumed)
    host_frac: float = 0.15  # share of each call spent on the host holding the GIL (assumed)
    llm_slowdown: float = 0.0  # a decode step takes 1 + this times as long while token2wav holds the GPU

    def step_s(self, running: int, admitted: int = 0) -> float:
        return 1e-3 * (self.step_ms_1 + (self.step_ms_48 - self.step_ms_1) * (max(1, running) - 1) / 47
                       + self.prefill_ms * admitted)

    def pass_s(self, rows: int, cached_frames: int) -> float:
        return 1e-3 * (self.pass_ms + self.pass_ms_row * rows + self.pass_ms_cached * cached_frames
                       + self.pass_ms_row_cached * rows * cached_frames)

    def encoder_s(self) -> float:
        return 1e-3 * self.encoder_ms

    def vocoder_s(self, rows: int) -> float:
        return 1e-3 * (self.vocoder_ms + self.vocoder_ms_row * rows)


H200 = GpuTimes()
# The same times with half of every call spent holding the GIL: how much a GIL-bound host side
# (the hypothesis to rule out on the GPU) costs the serving layer.
H200_GIL = replace(H200, host_frac=0.5)


def spend(seconds: float, host_frac: float) -> None:
    """``seconds`` of a GPU call: the host share spinning with the GIL held, then the rest asleep."""
    host_end = time.perf_counter() + seconds * host_frac
    while time.perf_counter() < host_end:
        pass
    time.sleep(seconds * (1 - host_frac))


class SharedGpu:
    """The one GPU a timed replica's two lanes share: token2wav's calls say how long they hold it,
    and a decode step that starts inside such a call is slowed by ``times.llm_slowdown``."""

    def __init__(self, times: GpuTimes) -> None:
        self.times = times
        self._t2w_until = 0.0  # perf_counter time the latest token2wav call ends (one writer thread)

    def t2w_holds(self, seconds: float) -> None:
        """A token2wav call of ``seconds`` on the GPU starts now (its time is spent by the caller)."""
        self._t2w_until = max(self._t2w_until, time.perf_counter() + seconds)

    def t2w(self, seconds: float) -> None:
        """A token2wav call on this thread: holds the GPU for ``seconds`` and spends them."""
        self.t2w_holds(seconds)
        spend(seconds, self.times.host_frac)

    def step(self, running: int, admitted: int) -> None:
        """One decode step (with the prefills it admits), slower while token2wav holds the GPU."""
        seconds = self.times.step_s(running, admitted)
        if time.perf_counter() < self._t2w_until:
            seconds *= 1 + self.times.llm_slowdown
        spend(seconds, self.times.host_frac)


def timed_engine(max_running: int, gpu: SharedGpu) -> NullEngine:
    """Continuous batching without a model whose steps (and the prefills they run) take ``gpu``'s times."""
    return NullEngine(max_running, tokens_per_id=TOKENS_PER_TEXT_ID, step_cost=gpu.step)


@dataclass(eq=False)
class _Stream:
    prompt_tokens: int
    stream: bool
    offset: int = 0  # tokens already cut into jobs
    calls: int = 0
    done: bool = False


@dataclass(eq=False)
class _Job:
    state: _Stream
    tokens: int  # new tokens this job turns into audio
    finalize: bool

    @property
    def hop(self) -> int:  # what the synthesizer's text marks read (Token2WavJob.hop: 0 for the final call)
        return 0 if self.finalize else self.tokens


@dataclass(eq=False)
class _Row:
    """A job's flow solve in progress (what ``pick_rows`` and the stepped driver read)."""

    tag: _Job
    frames: int  # new mel frames
    cached: int  # frames before them (prompt and earlier chunks)
    kind: str = "incremental"
    step: int = 0


class TimedToken2Wav:
    """CosyVoice2's streamed chunk schedule (early first chunk) over timed flow passes; silence out."""

    sample_rate = SAMPLE_RATE
    n_mels = 80
    embedding_dim = 192
    n_steps = N_STEPS

    def __init__(self, gpu: SharedGpu) -> None:
        self.gpu = gpu
        self.times = gpu.times

    def new_stream(self, prompt, stream: bool, speed: float, seed: int | None) -> _Stream:
        return _Stream(prompt_tokens=len(prompt.speech_tokens), stream=stream)

    def flow_stats(self) -> dict[str, float]:
        return dict.fromkeys(FLOW_STATS, 0.0)

    def _hop(self, state: _Stream) -> int:
        return first_hop(state.prompt_tokens, HOP, FIRST_MIN_TOKENS) if state.calls == 0 else HOP

    def tokens_needed(self, state: _Stream) -> int | None:
        return None if state.done or not state.stream else state.offset + self._hop(state) + LOOKAHEAD

    def prefix_job(self, state: _Stream) -> None:
        return None  # one voice: the calibration's requests had their voice's prefix kept

    def next_job(self, state: _Stream, tokens, llm_done: bool) -> _Job | None:
        if state.done:
            return None
        hop = self._hop(state)
        if state.stream and len(tokens) >= state.offset + hop + LOOKAHEAD:
            return _Job(state, hop, finalize=False)
        if not llm_done:
            return None
        return _Job(state, len(tokens) - state.offset, finalize=True)

    # -- token2wav.scheduler "steps" --------------------------------------------------------
    def start_solves(self, jobs: list[_Job]) -> list[_Row]:
        self.gpu.t2w(self.times.encoder_s())
        return [_Row(job, MEL_PER_TOKEN * job.tokens, MEL_PER_TOKEN * (job.state.prompt_tokens + job.state.offset))
                for job in jobs]

    def advance(self, rows: list[_Row]) -> None:
        self.gpu.t2w(self.times.pass_s(len(rows), max(r.cached for r in rows)))
        for row in rows:
            row.step += 1

    def finish(self, rows: list[_Row]) -> Callable[[], list[np.ndarray]]:
        """The vocoder's host share now; the function returned sleeps out its GPU share (the wait
        for the audio, off the token2wav thread as on a GPU replica)."""
        if any(r.step < N_STEPS for r in rows):
            raise ValueError("finish() takes rows whose solve is done")
        seconds = self.times.vocoder_s(len(rows))
        self.gpu.t2w_holds(seconds)
        spend(seconds * self.times.host_frac, 1.0)
        ready_at = time.perf_counter() + seconds * (1 - self.times.host_frac)
        out = []
        for row in rows:
            job = row.tag
            job.state.offset += job.tokens
            job.state.calls += 1
            job.state.done = job.finalize
            out.append(np.zeros(job.tokens * SAMPLES_PER_TOKEN, np.float32))

        def collect() -> list[np.ndarray]:
            time.sleep(max(0.0, ready_at - time.perf_counter()))
            return out
        return collect

    def run_batch(self, jobs: list[_Job]) -> list[np.ndarray]:
        """The whole solve of each job (the batch scheduler's call)."""
        rows = self.start_solves(jobs)
        for _ in range(N_STEPS):
            self.advance(rows)
        return self.finish(rows)()


def make_timed_runtime(cfg, times: GpuTimes, name: str) -> SynthesisRuntime:
    """A runtime of ``cfg``'s decode slots taking ``times`` instead of a GPU's work (``name`` says whose)."""
    details = {"family": "cosyvoice2", "random_weights": True, "t2w_scheduler": "steps",
               "timing_model": f"{name}, no GPU (bench/timed_runtime.py), host share {times.host_frac:g}"}
    gpu = SharedGpu(times)
    return SynthesisRuntime(engine=timed_engine(cfg.max_running, gpu), token2wav=TimedToken2Wav(gpu),
                            device="cpu", details=details)


def h200(cfg, source, plan=None) -> SynthesisRuntime:
    """A ``runtime_factory`` taking the H200's times (:data:`H200`), stepped token2wav."""
    return make_timed_runtime(cfg, H200, "H200 times")


def h200_gil(cfg, source, plan=None) -> SynthesisRuntime:
    """:func:`h200` with half of every call holding the GIL (:data:`H200_GIL`)."""
    return make_timed_runtime(cfg, H200_GIL, "H200 times, GIL-bound host")


PROFILES = {"h200": h200, "h200_gil": h200_gil}  # bench/capacity.py --timed PROFILE
