"""EngineLoop: mailboxes wake a consumer when it has the tokens it asked for, not per step; the step
thread steps on whatever the event loop is doing, ends when idle, and a broken engine fails every request.

No test waits for a while: they wait for what the fake engine did (``FakeEngine.wait_until``)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deployments import engine_loop
from deployments.compute import ComputeExecutor
from deployments.engine_loop import EngineLoop
from deployments.protocol import EngineDeadError
from deployments.runtime_adapter import LMRequest
from tests.deployments import fakes


def _lm(n_ids: int) -> LMRequest:  # fakes emit TOKENS_PER_TEXT_ID tokens per text id
    return LMRequest(text_ids=np.arange(n_ids, dtype=np.int32), prompt_text_ids=np.zeros(0, np.int32),
                     prompt_speech_ids=np.zeros(0, np.int32))


def _loop(max_running: int = 4) -> tuple[EngineLoop, fakes.FakeEngine, ComputeExecutor]:
    engine = fakes.FakeEngine(max_running=max_running, step_s=0.0)
    compute = ComputeExecutor()
    return EngineLoop(engine, compute), engine, compute


def test_without_need_every_token_arrives_once_in_order():
    loop, _, compute = _loop()

    async def main():
        return [e async for e in loop.generate("a", _lm(5))]

    events = asyncio.run(main())
    compute.shutdown()
    # The step thread may run several steps before the consumer wakes: events carry one or more.
    tokens = [t for e in events for t in e.new_tokens]
    assert tokens == [0, 1, 2, 3, 4] * 2 and all(e.new_tokens for e in events)  # the fake cycles its text ids
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True] and loop.steps == 10


def test_need_coalesces_tokens_up_to_what_the_consumer_can_use():
    loop, _, compute = _loop()
    wants = iter([4, 10, None])  # next chunk at 4 tokens, then at 10, then only the end (20)
    current = {"want": next(wants)}

    async def main():
        got = []
        async for e in loop.generate("a", _lm(10), need=lambda: current["want"]):
            got.append(e)
            total = sum(len(x.new_tokens) for x in got)
            if current["want"] is not None and total >= current["want"]:
                current["want"] = next(wants)
        return got

    events = asyncio.run(main())
    compute.shutdown()
    sizes = [len(e.new_tokens) for e in events]
    assert sum(sizes) == 20 and len(events) == 3, sizes  # woken 3 times for 20 steps
    assert sizes[0] >= 4 and sizes[0] + sizes[1] >= 10 and events[-1].finished


def test_a_consumer_cancelled_while_waiting_frees_its_slot():
    loop, engine, compute = _loop(max_running=1)

    async def main():
        async def never_enough():
            async for _ in loop.generate("slow", _lm(500), need=lambda: None):  # only the end
                pass

        task = asyncio.create_task(never_enough())
        assert await asyncio.to_thread(engine.wait_until, lambda: engine.emitted("slow") >= 3)
        assert engine.running and not task.done()  # decoding, the consumer asleep on its mailbox
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The freed slot lets the next request run to its end.
        return [e async for e in loop.generate("next", _lm(2))]

    events = asyncio.run(main())
    compute.shutdown()
    assert "slow" in engine.aborted and events[-1].finished and loop.aborted == 1


def test_steps_go_on_while_the_event_loop_is_busy():
    """The step thread submits the next step itself: a busy event loop (here blocked outright until
    the request has decoded to its end) delays the token hand-over, not the decode steps. An
    asyncio task driving the engine would never get there: the wait would fail at its guard."""
    engine = fakes.FakeEngine(max_running=1, step_s=0.0)
    compute = ComputeExecutor()
    loop = EngineLoop(engine, compute)

    async def main():
        got, finished_while_blocked = [], None
        async for e in loop.generate("a", _lm(200)):  # 400 tokens
            got.append(e)
            if len(got) == 1:  # the event loop does nothing else until the engine is done
                finished_while_blocked = engine.wait_until(lambda: not engine.has_unfinished())
        return got, finished_while_blocked

    events, finished_while_blocked = asyncio.run(main())
    compute.shutdown()
    assert finished_while_blocked and engine.steps == 400
    assert sum(len(e.new_tokens) for e in events) == 400 and events[-1].finished


def test_an_idle_step_thread_ends_and_the_next_request_starts_one(monkeypatch):
    monkeypatch.setattr(engine_loop, "IDLE_EXIT_S", 0.0)  # ends as soon as it finds nothing to do
    loop, _, compute = _loop()
    threads = []
    ensure_running = loop._ensure_running

    def started_by_request():  # called by generate(), lock held: the thread stepping that request
        ensure_running()
        threads.append(loop._thread)

    loop._ensure_running = started_by_request

    async def one(rid):
        return [e async for e in loop.generate(rid, _lm(3))]

    async def main():
        first = await one("a")
        await asyncio.to_thread(threads[0].join, fakes.GUARD_S)  # it ends by itself
        ended = not threads[0].is_alive() and loop._thread is None
        second = await one("b")
        return first, ended, second

    first, ended, second = asyncio.run(main())
    compute.shutdown()
    assert ended and threads[1] is not threads[0]
    assert first[-1].finished and second[-1].finished and loop.steps == 12


def test_an_engine_that_raises_fails_every_open_request_and_marks_the_loop_dead():
    class Broken(fakes.FakeEngine):
        def step(self):
            if any(seq.emitted >= 3 for seq in self.running.values()):
                raise RuntimeError("CUDA error: an illegal memory access")
            return super().step()

    compute = ComputeExecutor()
    loop = EngineLoop(Broken(max_running=2, step_s=0.0), compute)

    async def consume(rid):
        return [e async for e in loop.generate(rid, _lm(50))]

    async def main():
        return await asyncio.gather(consume("a"), consume("b"), return_exceptions=True)

    results = asyncio.run(main())
    compute.shutdown()
    assert all(isinstance(r, EngineDeadError) for r in results), results
    with pytest.raises(EngineDeadError):
        loop.raise_if_dead()
