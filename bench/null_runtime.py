"""A synthesis runtime that costs nothing (or a fixed sleep), to measure the serving layer itself.

:func:`null_runtime` builds a :class:`~deployments.runtime_protocol.SynthesisRuntime` whose
engine emits ``TOKENS_PER_ID`` tokens per text id, one per step and request, and whose token2wav
cuts a job every ``HOP`` tokens and returns silence; a step and a token2wav batch sleep
``step_s`` / ``batch_s`` (the GIL is free meanwhile, as while a replica waits on CUDA). What
remains is the synthesizer's own work: the engine loop, the per-request coroutines, chunk
scheduling. No model, no bistream. (The unit tests have richer fakes with fault injection:
``tests/deployments/fakes.py``.)
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cosyvoice_runtime.lm_messages import LMRequest, TokenEvent
from deployments.runtime_protocol import FLOW_STATS, SynthesisRuntime

TOKENS_PER_ID = 2
HOP = 12  # tokens per streamed chunk
SAMPLE_RATE = 24000
SAMPLES_PER_TOKEN = SAMPLE_RATE // 25


class NullEngine:
    """Continuous batching without a model: ``max_running`` slots, FIFO admission between steps,
    one token per running request and step, ``tokens_per_id`` tokens per text id.

    A step sleeps ``step_s``, or calls ``step_cost(running, admitted)`` to take its time
    (:mod:`bench.timed_runtime`: a GPU's time for that many rows and prefills)."""

    def __init__(self, max_running: int, step_s: float = 0.0, tokens_per_id: int = TOKENS_PER_ID,
                 step_cost: Callable[[int, int], None] | None = None) -> None:
        self.max_running = max_running
        self.step_s = step_s
        self.tokens_per_id = tokens_per_id
        self.step_cost = step_cost
        self._waiting: OrderedDict[str, int] = OrderedDict()  # request -> tokens left
        self._running: dict[str, int] = {}

    def add(self, request_id: str, request: LMRequest) -> None:
        self._waiting[request_id] = max(1, len(request.text_ids) * self.tokens_per_id)

    def step(self) -> list[TokenEvent]:
        admitted = 0
        while self._waiting and len(self._running) < self.max_running:
            rid, left = self._waiting.popitem(last=False)
            self._running[rid] = left
            admitted += 1
        if self.step_cost is not None:
            self.step_cost(len(self._running), admitted)
        elif self.step_s:
            time.sleep(self.step_s)
        events = []
        for rid in list(self._running):
            self._running[rid] -= 1
            done = self._running[rid] == 0
            events.append(TokenEvent(rid, [0], finished=done, finish_reason="stop" if done else None))
            if done:
                del self._running[rid]
        return events

    def abort(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self._running.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def num_running(self) -> int:
        return len(self._running)

    def num_waiting(self) -> int:
        return len(self._waiting)


@dataclass
class _Stream:
    stream: bool
    emitted: int = 0  # tokens already cut into jobs
    done: bool = False


@dataclass
class _Job:
    tokens: int
    finalize: bool

    @property
    def hop(self) -> int:  # what the synthesizer's text marks read (Token2WavJob.hop: 0 for the final call)
        return 0 if self.finalize else self.tokens


class NullToken2Wav:
    """A job per ``HOP`` tokens (streamed) and one for the rest at the end; silence out."""

    sample_rate = SAMPLE_RATE
    n_mels = 80
    embedding_dim = 192

    def __init__(self, batch_s: float = 0.0) -> None:
        self.batch_s = batch_s

    def new_stream(self, prompt, stream: bool, speed: float, seed: int | None) -> _Stream:
        return _Stream(stream=stream)

    def flow_stats(self) -> dict[str, float]:
        return dict.fromkeys(FLOW_STATS, 0.0)  # no flow at all

    def tokens_needed(self, state: _Stream) -> int | None:
        return None if state.done or not state.stream else state.emitted + HOP

    def prefix_job(self, state: _Stream) -> None:
        return None  # no flow

    def next_job(self, state: _Stream, tokens, llm_done: bool) -> _Job | None:
        if state.done:
            return None
        if state.stream and len(tokens) - state.emitted >= HOP:
            state.emitted += HOP
            return _Job(HOP, finalize=False)
        if not llm_done:
            return None
        state.done = True
        return _Job(len(tokens) - state.emitted, finalize=True)

    def run_batch(self, jobs: list[_Job]) -> list[np.ndarray]:
        if self.batch_s:
            time.sleep(self.batch_s)
        return [np.zeros(job.tokens * SAMPLES_PER_TOKEN, np.float32) for job in jobs]


def null_runtime(step_s: float = 0.0, batch_s: float = 0.0):
    """A ``runtime_factory`` (SynthesizerConfig) over :class:`NullEngine` and :class:`NullToken2Wav`."""
    def factory(cfg, source, plan=None) -> SynthesisRuntime:
        return SynthesisRuntime(engine=NullEngine(cfg.max_running, step_s), token2wav=NullToken2Wav(batch_s),
                                device="cpu")

    return factory
