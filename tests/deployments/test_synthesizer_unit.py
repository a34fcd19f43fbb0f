"""Synthesizer + EngineLoop without Ray: fakes injected through ``runtime_factory``.

``@serve.batch`` cannot run outside a replica (ray-serve-notes §5.1), so these tests run the
replica :meth:`~deployments.synthesizer.Synthesizer.outside_serve`: the same batch function with
one job a call; the batching behaviour itself is tested against real Ray in tests/integration.

Time is a :class:`~tests.deployments.fakes.FakeClock` that the fakes advance by their emulated
compute time: latencies, deadlines and underruns do not depend on the machine's load, and tests
wait for what the fake engine did, never for a while.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deployments.protocol import (
    EngineDeadError,
    InvalidInputError,
    PreparedRequest,
    RequestFailedError,
    TextPiece,
    VoicePrompt,
)
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from tests.deployments import fakes


def _prompt() -> VoicePrompt:
    return VoicePrompt(family="cosyvoice2", text_tokens=np.arange(3, dtype=np.int32),
                       speech_tokens=np.arange(10, dtype=np.int32), mel=np.zeros((20, 80), np.float32),
                       embedding=np.ones(192, np.float32))


def _req(rid: str, n_ids: int, stream: bool, pieces: int = 1, seed: int | None = None) -> PreparedRequest:
    text = [TextPiece("x", np.arange(n_ids, dtype=np.int32)) for _ in range(pieces)]
    return PreparedRequest(request_id=rid, pieces=text,
                           prompt=_prompt(), llm_prompt_text_ids=np.zeros(0, np.int32), llm_use_prompt_speech=True,
                           stream=stream, seed=seed)


async def _audio(s: Synthesizer, req: PreparedRequest) -> np.ndarray:
    """A request's audio joined, as the ingress answers a request whole."""
    return np.concatenate([c.samples async for c in s.synthesize(req)])


def _synth(max_running: int = 4, overlap_stages: bool | None = None, **token2wav) -> Synthesizer:
    cfg = SynthesizerConfig(max_running=max_running, max_ongoing_requests=max_running,
                            token2wav={"max_batch_size": 2, **token2wav}, overlap_stages=overlap_stages)
    clock = fakes.FakeClock()
    s = Synthesizer(cfg, runtime_factory=fakes.fake_runtime_on(clock), clock=clock)
    s.outside_serve()  # a batch of one, through the same failure isolation as a real batch
    return s


@pytest.mark.gc_freeze
def test_a_started_replica_has_frozen_its_heap_and_reports_gc_pauses_threads_and_gil_waits():
    s = _synth()
    stats = s.stats()
    assert stats["gc"]["frozen"] > 0 and set(stats["gc"]["by_generation"]) == {"0", "1", "2"}
    assert "MainThread" in stats["thread_cpu_seconds"] and stats["gil_wait"]["bounds"]


def test_streaming_chunks_follow_hop_schedule_and_cover_all_tokens():
    s = _synth()

    async def main():
        return [c async for c in s.synthesize(_req("a", 20, stream=True, pieces=2))]

    chunks = asyncio.run(main())
    n_tokens = 20 * fakes.TOKENS_PER_TEXT_ID
    per_piece = n_tokens // fakes.HOP + 1  # full hops + the final remainder
    assert len(chunks) == 2 * per_piece
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [c.is_last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    total = sum(len(c.samples) for c in chunks)
    assert total == 2 * n_tokens * fakes.SAMPLES_PER_TOKEN


def test_a_replicas_bookkeeping_returns_to_idle_and_its_compute_is_counted_by_kind():
    """What bench/leak_probe.py reads: every per-request entry of the loop gone once the requests
    have ended (an abandoned stream's included), the compute seconds per kind of call, the batches
    of one (the real engine's entries: tests/bench/test_leak_probe.py)."""
    s = _synth(max_running=2)

    async def main():
        gen = s.synthesize(_req("gone", 200, stream=True, seed=fakes.hold_seed()))
        await gen.__anext__()
        await gen.aclose()  # abandoned after its first chunk
        await asyncio.gather(*(_audio(s, _req(f"r{i}", 15, stream=False)) for i in range(3)))
        await s.loop.close()

    asyncio.run(main())
    entries = s.open_entries()
    assert {"loop_mailboxes", "loop_pending_adds", "loop_live", "compute_intervals", "step_batch_sizes"} <= set(entries)
    assert all(n == 0 for k, n in entries.items() if k not in ("compute_intervals", "step_batch_sizes")), entries
    assert entries["step_batch_sizes"] > 0 and entries["compute_intervals"] > 0  # bounded, trimmed when read
    assert s.compute.seconds_by_call() and s.t2w_batch_sizes.keys() == {1}
    assert s.metrics.recorded["batch"] and set(s.metrics.recorded["batch"]) == {1}
    s.shutdown()
    s.shutdown()  # idempotent: __del__ runs it again


def test_an_unchunked_request_is_one_chunk_a_piece_and_counted():
    s = _synth()

    async def main():
        return [c async for c in s.synthesize(_req("u", 10, stream=False, pieces=2))]

    chunks = asyncio.run(main())
    assert [c.piece for c in chunks] == [0, 1] and chunks[-1].is_last
    assert all(len(c.samples) == 10 * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN for c in chunks)
    assert all(c.sample_rate == fakes.SAMPLE_RATE for c in chunks)
    assert s.metrics.recorded["status"] == ["ok"]
    assert len(s.metrics.recorded["rtf"]) == 1


def test_requests_join_running_batch_and_respect_slots():
    s = _synth(max_running=2)

    async def main():
        await asyncio.gather(*(_audio(s, _req(f"r{i}", 15, stream=False)) for i in range(3)))

    asyncio.run(main())
    sizes = s.loop.step_batch_sizes
    assert max(sizes) == 2  # never more than the slots, and batched (> 1)
    assert s.loop.stats().finished == 3 and s.loop.stats().running == 0
    assert s.loop.tokens == 3 * 15 * fakes.TOKENS_PER_TEXT_ID


def test_abandoned_stream_aborts_and_frees_its_slot():
    s = _synth(max_running=2)

    async def main():
        gen = s.synthesize(_req("c", 200, stream=True, seed=fakes.hold_seed()))  # held after its first chunk
        first = await gen.__anext__()
        assert len(first.samples) > 0
        assert s.loop.stats().running == 1
        await gen.aclose()  # what a disconnect does to the replica generator
        engine = s.runtime.engine  # the abort is applied between two steps
        assert await asyncio.to_thread(engine.wait_until, lambda: engine.aborted and not engine.running)
        return s.loop.stats()

    stats = asyncio.run(main())
    assert stats.running == 0 and stats.aborted == 1
    assert s.runtime.engine.aborted == ["c/0"]


def test_cancelled_task_aborts_sequence():
    s = _synth(max_running=2)

    async def consume():
        async for _ in s.synthesize(_req("k", 300, stream=False, seed=fakes.hold_seed())):  # never ends by itself
            pass

    async def main():
        engine = s.runtime.engine
        task = asyncio.ensure_future(consume())
        assert await asyncio.to_thread(engine.wait_until, lambda: engine.emitted("k/0") >= 3)
        assert s.loop.stats().running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(engine.wait_until, lambda: engine.aborted and not engine.running)
        return s.loop.stats()

    stats = asyncio.run(main())
    assert stats.running == 0 and s.runtime.engine.aborted == ["k/0"]
    assert s.metrics.recorded["status"] == ["cancelled"]


def test_empty_piece_is_invalid_input():
    s = _synth()

    async def main():
        return [c async for c in s.synthesize(_req("e", 0, stream=False))]

    with pytest.raises(InvalidInputError):
        asyncio.run(main())


def test_capacity_validation():
    with pytest.raises(ValueError, match="max_running"):
        SynthesizerConfig(max_running=2, max_ongoing_requests=4)
    with pytest.raises(ValueError, match="trt_plan_dir"):
        SynthesizerConfig(mode="trt")


def test_overlapping_stages_run_token2wav_on_its_own_lane():
    """overlap_stages: flow + HiFT batches on the token2wav thread, decode steps on the engine
    loop's step thread itself (no main-lane hop); off by default on a CPU replica."""
    import threading

    def threads_of(s):
        threads = {"t2w": set(), "llm": set()}
        run_batch, step = s.t2w.run_batch, s.runtime.engine.step

        def t2w_on(jobs):
            threads["t2w"].add(threading.current_thread().name)
            return run_batch(jobs)

        def step_on():
            threads["llm"].add(threading.current_thread().name)
            return step()

        s.t2w.run_batch, s.runtime.engine.step = t2w_on, step_on

        async def main():
            return await asyncio.gather(*(_audio(s, _req(f"o{i}", 15, stream=True)) for i in range(2)))

        results = asyncio.run(main())
        assert all(len(r) == 15 * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN for r in results)
        return threads

    default = _synth(max_running=2)
    assert default.compute.lanes == ("main",)
    # one lane: steps and token2wav batches serialised on the main lane's one thread
    assert threads_of(default) == {"t2w": {"compute_0"}, "llm": {"compute_0"}}
    assert threads_of(_synth(max_running=2, overlap_stages=True)) == {"t2w": {"compute-token2wav_0"},
                                                                       "llm": {"engine-step"}}


# ------------------------------------------------------------------------------ failure isolation
class _Faulty(fakes.FakeToken2Wav):
    """run_batch raises for batches over ``fits`` jobs (like CUDA out of memory) or holding a
    poisoned stream's job; ``nan`` streams get NaN audio; ``fatal`` raises a sticky CUDA error."""

    def __init__(self, clock) -> None:
        super().__init__(clock=clock)
        self.fits, self.poisoned, self.nan, self.fatal = 8, set(), set(), False
        self.calls: list[int] = []

    def run_batch(self, jobs):
        self.calls.append(len(jobs))
        if self.fatal:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if len(jobs) > self.fits:
            raise RuntimeError("CUDA out of memory. Tried to allocate 3.00 GiB")
        if any(id(job.state) in self.poisoned for job in jobs):
            raise ValueError("shape mismatch in the flow decoder")
        out = super().run_batch(jobs)
        return [np.full_like(a, np.nan) if id(job.state) in self.nan else a for a, job in zip(out, jobs)]


def _faulty_synth(max_running: int = 4) -> tuple[Synthesizer, _Faulty]:
    s = _synth(max_running=max_running)
    s.t2w = s.jobs.t2w = _Faulty(s.clock)
    return s, s.t2w


def _jobs(t2w, n: int) -> list:
    jobs = []
    for _ in range(n):
        state = t2w.new_stream(_prompt(), stream=True, speed=1.0, seed=None)
        jobs.append(t2w.next_job(state, list(range(fakes.HOP)), llm_done=False))
    return jobs


def test_a_token2wav_batch_that_raises_is_split_and_only_the_job_that_fails_alone_fails():
    s, t2w = _faulty_synth()
    t2w.fits = 2  # 4 jobs do not fit at once, 2 do
    jobs = _jobs(t2w, 4)
    t2w.poisoned.add(id(jobs[3].state))
    out = asyncio.run(s.jobs.run(jobs))
    assert [type(a) for a in out[:3]] == [np.ndarray] * 3
    assert all(len(a) == fakes.HOP * fakes.SAMPLES_PER_TOKEN for a in out[:3])
    assert isinstance(out[3], RequestFailedError) and "shape mismatch" in str(out[3])
    assert t2w.calls == [4, 2, 2, 1, 1] and s.jobs.splits == 2 and s.jobs.failed_jobs == 1
    s.check_health()  # the replica is fine


def test_non_finite_audio_fails_that_request_and_not_the_others():
    s, t2w = _faulty_synth()
    real_new_stream = t2w.new_stream

    def new_stream(prompt, stream, speed, seed):
        state = real_new_stream(prompt, stream, speed, seed)
        if seed == 13:
            t2w.nan.add(id(state))
        return state

    t2w.new_stream = new_stream

    async def collect(rid, seed):
        req = _req(rid, 20, stream=True)
        req.seed = seed
        return [c async for c in s.synthesize(req)]

    async def main():
        return await asyncio.gather(collect("ok", 1), collect("nan", 13), return_exceptions=True)

    ok, nan = asyncio.run(main())
    assert isinstance(nan, RequestFailedError) and "non-finite" in str(nan)
    assert ok[-1].is_last and all(np.isfinite(c.samples).all() for c in ok)
    assert sorted(s.metrics.recorded["status"]) == ["error", "ok"]
    assert s.stats()["failed_requests_total"] == 1
    s.check_health()


def test_a_fatal_token2wav_fault_ends_every_open_stream_with_an_error_and_marks_the_replica_unhealthy():
    s, t2w = _faulty_synth()
    engine = s.runtime.engine

    async def collect(req):
        return [c async for c in s.synthesize(req)]

    async def main():
        # "open": unchunked, held in the engine (no chunk job until its end); then a stream whose first
        # chunk job meets a device that is gone.
        waiting = asyncio.create_task(collect(_req("open", 50, stream=False, seed=fakes.hold_seed())))
        assert await asyncio.to_thread(engine.wait_until, lambda: engine.emitted("open/0") >= fakes.HOP)
        t2w.fatal = True
        breaking = asyncio.create_task(collect(_req("b", 50, stream=True)))
        return await asyncio.gather(waiting, breaking, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results  # an error, never silence
    with pytest.raises(EngineDeadError):
        s.check_health()  # Serve replaces the replica
    assert s.health().ready is False
    with pytest.raises(EngineDeadError):  # new requests are refused at once
        asyncio.run(_audio(s, _req("late", 5, stream=False)))


def test_a_decode_step_that_fails_for_one_request_fails_that_stream_only():
    s = _synth(max_running=4)
    engine = s.runtime.engine
    step = engine.step

    def poisoned_step():
        if "bad/0" in engine.running and engine.running["bad/0"].emitted >= 2:
            raise ValueError("probability tensor contains either inf, nan or element < 0")
        return step()

    engine.step = poisoned_step

    async def collect(rid, n_ids, seed=None):
        return [c async for c in s.synthesize(_req(rid, n_ids, stream=True, seed=seed))]

    seed = fakes.hold_seed()  # "good" decodes until held, then waits for the test

    async def main():
        good = asyncio.create_task(collect("good", 30, seed))
        assert await asyncio.to_thread(engine.wait_until, lambda: engine.emitted("good/0") >= fakes.HOP)
        bad = asyncio.create_task(collect("bad", 30))  # joins later: the newest, the first suspect
        with pytest.raises(RequestFailedError):
            await bad
        fakes.release(seed)
        return await good

    try:
        good = asyncio.run(main())
    finally:
        fakes.forget(seed)
    assert sum(len(c.samples) for c in good) == 30 * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN
    s.check_health()
