"""Fakes of the runtime protocols in ``deployments.runtime_protocol`` (dependency injection only).

They keep the real contracts that the serving layer relies on: an engine with a fixed number of
decode slots that admits waiting sequences between steps and frees a slot on abort, and a
token2wav that emits one job per hop and a final job, with a batched ``run_batch``. Each
sequence emits ``TOKENS_PER_TEXT_ID`` tokens per text id, so tests choose how long a request
runs through the length of its text (a bistream request: of the text fed so far, waiting for more
until its end); a hold seed (:func:`hold_seed`) stops it after its first
chunk until the test releases it. ``STEP_S`` / ``BATCH_S`` emulate compute time: real sleeps (the
Ray suites), or, given a :class:`FakeClock`, that clock advanced instead (unit tests: time is what
the fakes say it is, whatever the machine's load).

Tests wait on what the fakes did (:meth:`FakeEngine.wait_until`), never for a while.
"""
from __future__ import annotations

import random
import re
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cosyvoice_runtime.lm_messages import LMRequest, TokenEvent
from deployments.protocol import VoiceExistsError, VoiceNotFoundError, VoicePrompt
from deployments.runtime_protocol import FLOW_STATS, SynthesisRuntime

SAMPLE_RATE = 24000
SAMPLES_PER_TOKEN = 960  # 25 tokens/s at 24 kHz
TOKENS_PER_TEXT_ID = 2
STEP_S = 0.004
BATCH_S = 0.01
HOP = 12
# NOTE: the seeds the fakes act on lie above every seed the ingress draws for a request without
# one (serve_app/failover.py SEED_BITS: [0, 2**31)) and below 2**32 (ElevenLabs' largest seed).
# Inside the drawn range, one request in ~2,147 drew a hold seed: its stream stopped after one hop
# until the audio-progress timeout ended it.
HOLD_SEED = 2**31 + 3  # a sequence with a hold seed emits one hop, then holds its slot until released or aborted
HOLD_SEEDS = range(HOLD_SEED, HOLD_SEED + 1_000_000)
NAN_SEED = 2**31 + 7_000_001  # token2wav returns NaN samples for this request (a stream's chunks after its first)


def hold_seed() -> int:
    """A fresh hold seed: its sequences wait for :func:`release` of that seed (a marker file, so a
    test can release sequences held in Ray replicas on this machine; other sessions' seeds differ)."""
    return random.choice(HOLD_SEEDS)


def _release_marker(seed: int) -> Path:
    return Path(tempfile.gettempdir()) / f"fastcosy-fake-release-{seed}"


def release(seed: int) -> None:
    """Let the sequences held by ``seed`` run to their end (see :func:`forget`)."""
    _release_marker(seed).touch()


def forget(seed: int) -> None:
    _release_marker(seed).unlink(missing_ok=True)
GUARD_S = 60.0  # a wait that never returns is a failed test, not a hung one (not a synchronisation bound)


class FakeClock:
    """Seconds that pass only when something says so (thread-safe: the engine's step thread and the
    token2wav lane both advance it)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def _spend(seconds: float, clock: FakeClock | None) -> None:
    if clock is not None:
        clock.advance(seconds)
    elif seconds:
        time.sleep(seconds)


@dataclass
class _Seq:
    request: LMRequest
    target: int
    emitted: int = 0
    held: bool = False  # a hold seed, not yet released
    text: list[int] | None = None  # a bistream request's text so far (None: request.text_ids)
    ended: bool = True  # a bistream request's text is complete

    @property
    def ids(self):
        return self.request.text_ids if self.text is None else self.text


class FakeEngine:
    def __init__(self, max_running: int = 4, step_s: float = STEP_S, clock: FakeClock | None = None) -> None:
        self.max_running = max_running
        self.step_s = step_s
        self.clock = clock
        self.waiting: OrderedDict[str, _Seq] = OrderedDict()
        self.running: dict[str, _Seq] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.progress: dict[str, int] = {}  # tokens emitted per request id, kept after it ends
        self.pending: list[TokenEvent] = []  # continuations' prefix events, handed out by the next step
        self._changed = threading.Condition()  # notified after every step and abort

    def wait_until(self, predicate, timeout_s: float = GUARD_S) -> bool:
        """Block until ``predicate()`` holds after a step or an abort (from a test thread, or
        ``asyncio.to_thread``); False only if it still does not after ``timeout_s`` (a failure guard)."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout_s)

    def emitted(self, request_id: str) -> int:
        """Tokens emitted so far by a request (also after it ended: a wait on it cannot miss it)."""
        return self.progress.get(request_id, 0)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def add(self, request_id: str, request: LMRequest) -> None:
        target = TOKENS_PER_TEXT_ID * len(request.text_ids)
        prefix = [] if request.prefix is None else [int(t) for t in request.prefix]
        if prefix or request.prefix_done:  # a continuation (LMRequest.prefix): its first event is the prefix
            self.pending.append(TokenEvent(request_id, prefix, request.prefix_done,
                                           "stop" if request.prefix_done else None))
        if not request.prefix_done:
            self.waiting[request_id] = _Seq(request, target, emitted=len(prefix), held=request.seed in HOLD_SEEDS)

    def add_bistream(self, request_id: str, request) -> None:
        self.waiting[request_id] = _Seq(request, 0, text=[], ended=False)

    def feed_text(self, request_id: str, ids, end: bool) -> bool:
        seq = self.waiting.get(request_id) or self.running.get(request_id)
        if seq is None:
            return False
        seq.text.extend(int(i) for i in ids)
        seq.target, seq.ended = TOKENS_PER_TEXT_ID * len(seq.text), end
        return True

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.pending = [ev for ev in self.pending if ev.request_id != request_id]
        self.waiting.pop(request_id, None)
        self.running.pop(request_id, None)
        self._notify()

    def has_unfinished(self) -> bool:
        # a bistream request that has spoken all its text so far waits for more: no work
        return bool(self.waiting or self.pending) or any(s.ended or s.emitted < s.target for s in self.running.values())

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def step(self) -> list[TokenEvent]:
        while self.waiting and len(self.running) < self.max_running:
            rid, seq = self.waiting.popitem(last=False)
            self.running[rid] = seq
        _spend(self.step_s, self.clock)
        events, self.pending = self.pending, []
        for rid, seq in list(self.running.items()):
            if seq.held and seq.emitted >= min(HOP, seq.target - 1):  # never ends while held
                if not _release_marker(seq.request.seed).exists():
                    continue  # one streamed chunk's worth, then nothing until released or aborted
                seq.held = False
            if seq.emitted >= seq.target:  # a bistream request: all its text spoken
                if seq.ended:
                    events.append(TokenEvent(rid, [], finished=True, finish_reason="stop"))
                    del self.running[rid]
                continue
            token = int(seq.ids[seq.emitted % len(seq.ids)]) % 6561
            seq.emitted += 1
            self.progress[rid] = seq.emitted
            done = seq.emitted >= seq.target and seq.ended
            read = None if seq.text is None else [len(seq.text)]  # a bistream token: the text so far was read
            events.append(TokenEvent(rid, [token], finished=done, finish_reason="stop" if done else None,
                                     text_read=read))
            if done:
                del self.running[rid]
        self.steps += 1
        self._notify()
        return events


@dataclass
class FakeStream:
    stream: bool
    speed: float
    offset: int = 0
    finished: bool = False
    nan_after_first: bool = False  # NAN_SEED


@dataclass
class FakeJob:
    state: FakeStream
    start: int
    end: int
    finalize: bool

    @property
    def hop(self) -> int:  # as Token2WavJob: tokens a streamed job advances by (0 for the final one)
        return 0 if self.finalize else self.end - self.start


class FakeToken2Wav:
    sample_rate = SAMPLE_RATE
    n_mels = 80
    embedding_dim = 192

    def __init__(self, batch_s: float = BATCH_S, clock: FakeClock | None = None) -> None:
        self.batch_s = batch_s
        self.clock = clock
        self.batches: list[int] = []

    def new_stream(self, prompt: VoicePrompt, stream: bool, speed: float, seed: int | None) -> FakeStream:
        return FakeStream(stream=stream, speed=speed, nan_after_first=seed == NAN_SEED)

    def flow_stats(self) -> dict[str, float]:
        return dict.fromkeys(FLOW_STATS, 0.0)  # no incremental flow here

    def tokens_needed(self, state: FakeStream) -> int | None:
        return state.offset + HOP if state.stream and not state.finished else None

    def prefix_job(self, state: FakeStream) -> None:
        return None  # no flow: nothing to solve ahead

    def next_job(self, state: FakeStream, tokens, llm_done: bool) -> FakeJob | None:
        if state.finished:
            return None
        n = len(tokens)
        if state.stream and n >= state.offset + HOP:
            job = FakeJob(state, state.offset, state.offset + HOP, finalize=False)
            state.offset += HOP
            return job
        if llm_done:
            state.finished = True
            return FakeJob(state, state.offset, n, finalize=True)
        return None

    def run_batch(self, jobs: list[FakeJob]) -> list[np.ndarray]:
        self.batches.append(len(jobs))
        _spend(self.batch_s, self.clock)
        out = []
        for job in jobs:
            n = int((job.end - job.start) * SAMPLES_PER_TOKEN / job.state.speed)
            t = np.arange(n, dtype=np.float32) / SAMPLE_RATE
            audio = (0.2 * np.sin(2 * np.pi * 220.0 * t)).astype(np.float32)
            if job.state.nan_after_first and (job.start > 0 or not job.state.stream):
                audio[::7] = np.nan  # a numerical fault in the vocoder
            out.append(audio)
        return out


def fake_synthesis_runtime(cfg, source, plan=None) -> SynthesisRuntime:
    """``runtime_factory`` for SynthesizerConfig (import path ``tests.deployments.fakes:fake_synthesis_runtime``)."""
    return SynthesisRuntime(engine=FakeEngine(max_running=cfg.max_running), token2wav=FakeToken2Wav(), device="cpu")


def fake_runtime_on(clock: FakeClock):
    """A ``runtime_factory`` whose fakes spend their compute time on ``clock`` instead of sleeping."""
    def factory(cfg, source, plan=None) -> SynthesisRuntime:
        return SynthesisRuntime(engine=FakeEngine(max_running=cfg.max_running, clock=clock),
                                token2wav=FakeToken2Wav(clock=clock), device="cpu")

    return factory


@dataclass
class FakeFrontendRuntime:
    family: str = "cosyvoice2"
    sample_rate: int = SAMPLE_RATE
    voices: dict[str, VoicePrompt] = field(default_factory=dict)

    def split(self, text: str) -> list[str]:
        return [p.strip() for p in re.split(r"(?<=[.!?。！？])\s*", text) if p.strip()]

    def tokenize(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def prompt_from_audio(self, audio: np.ndarray, sample_rate: int, prompt_text: str) -> VoicePrompt:
        n = max(1, int(len(audio) / sample_rate * 25))
        return VoicePrompt(family=self.family, text_tokens=self.tokenize(prompt_text),
                           speech_tokens=np.arange(n, dtype=np.int32) % 6561,
                           mel=np.zeros((2 * n, 80), np.float32), embedding=np.ones(192, np.float32),
                           text=prompt_text)

    def save_voice(self, voice_id: str, prompt: VoicePrompt, overwrite: bool = True) -> None:
        if not overwrite and voice_id in self.voices:
            raise VoiceExistsError(f"voice '{voice_id}' already exists")
        self.voices[voice_id] = prompt

    def load_voice(self, voice_id: str) -> VoicePrompt:
        try:
            return self.voices[voice_id]
        except KeyError:
            raise VoiceNotFoundError(f"voice '{voice_id}' not found") from None

    def list_voices(self) -> list[str]:
        return list(self.voices)

    def delete_voice(self, voice_id: str) -> None:
        self.load_voice(voice_id)
        del self.voices[voice_id]

    store_problem: str | None = None  # set by a test: the store "refuses writes" for this reason

    def voice_store_status(self) -> tuple[str, str | None]:
        return "memory", self.store_problem


def fake_frontend_runtime(cfg, source) -> FakeFrontendRuntime:
    """``runtime_factory`` for FrontendConfig (import path ``tests.deployments.fakes:fake_frontend_runtime``)."""
    return FakeFrontendRuntime()
