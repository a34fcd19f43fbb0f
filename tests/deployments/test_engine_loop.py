"""EngineLoop: mailboxes wake a consumer when it has the tokens it asked for, not per step; the step
thread steps on whatever the event loop is doing, ends when idle, and a broken engine fails every request.

No test waits for a while: they wait for what the fake engine did (``FakeEngine.wait_until``)."""
from __future__ import annotations

import asyncio
import threading
from typing import ClassVar

import numpy as np
import pytest

from cosyvoice_runtime.lm_messages import LMRequest, TokenEvent
from deployments import engine_loop, engine_mailbox
from deployments.compute import ComputeExecutor
from deployments.engine_loop import EngineLoop
from deployments.protocol import EngineDeadError, RequestFailedError
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
    tokens = [t for e in events for t in e.tokens]
    assert tokens == [0, 1, 2, 3, 4] * 2 and all(e.tokens for e in events)  # the fake cycles its text ids
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True] and loop.steps == 10


def test_need_coalesces_tokens_up_to_what_the_consumer_can_use():
    """Steps are let through one at a time, each delivered before the next: the consumer wakes
    exactly when its next chunk's tokens are there (4, then 10, then the end at 20)."""
    class Gated(fakes.FakeEngine):
        def __init__(self) -> None:
            super().__init__(max_running=4, step_s=0.0)
            self.permits = threading.Semaphore(0)

        def step(self):
            self.permits.acquire()
            return super().step()

    engine, compute = Gated(), ComputeExecutor()
    loop = EngineLoop(engine, compute)
    wants = iter([4, 10, None])  # next chunk at 4 tokens, then at 10, then only the end (20)
    current = {"want": next(wants)}
    got = []

    async def consume():
        async for e in loop.generate("a", _lm(10), need=lambda: current["want"]):
            got.append(e)
            total = sum(len(x.tokens) for x in got)
            if current["want"] is not None and total >= current["want"]:
                current["want"] = next(wants)

    async def main():
        task = asyncio.create_task(consume())
        wakes = []
        for k in range(1, 21):
            engine.permits.release()
            while loop.steps < k:  # event-loop turns until step k is delivered
                await asyncio.sleep(0)
            for _ in range(3):  # a woken consumer runs
                await asyncio.sleep(0)
            wakes.append(len(got))
        await task
        return wakes

    wakes = asyncio.run(main())
    compute.shutdown()
    assert wakes == [0] * 3 + [1] * 6 + [2] * 10 + [3]  # woken 3 times for 20 steps
    assert [len(e.tokens) for e in got] == [4, 6, 10] and got[-1].finished


def test_a_consumer_cancelled_while_waiting_frees_its_slot():
    loop, engine, compute = _loop(max_running=1)
    held = _lm(50)
    held.seed = fakes.hold_seed()  # stops after its first tokens, until aborted

    async def main():
        async def never_enough():
            async for _ in loop.generate("slow", held, need=lambda: None):  # only the end, which never comes
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
    assert sum(len(e.tokens) for e in events) == 400 and events[-1].finished


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


# ------------------------------------------------------------------------------ failure isolation
POISON = 999  # a text id that makes the engine's step raise once its sequence is decoding


class Poisoned(fakes.FakeEngine):
    """A step raises while a poisoned sequence is in the running batch (the culprit is not named)."""

    def step(self):
        if any(POISON in seq.request.text_ids and seq.emitted >= 2 for seq in self.running.values()):
            raise ValueError("probability tensor contains either inf, nan or element < 0")
        return super().step()


def _poisoned(n_ids: int) -> LMRequest:
    return LMRequest(text_ids=np.array([POISON] * n_ids, np.int32), prompt_text_ids=np.zeros(0, np.int32),
                     prompt_speech_ids=np.zeros(0, np.int32))


def test_a_step_that_raises_for_one_request_fails_that_request_only():
    engine = Poisoned(max_running=4, step_s=0.0)
    compute = ComputeExecutor()
    loop = EngineLoop(engine, compute)

    async def consume(rid, request):
        return [t async for e in loop.generate(rid, request) for t in e.tokens]

    async def main():
        healthy = [asyncio.create_task(consume(rid, _lm(100))) for rid in ("a", "b")]
        # The poisoned request joins a running batch (the newest request: the first suspect).
        assert await asyncio.to_thread(engine.wait_until, lambda: engine.emitted("a") and engine.emitted("b"))
        with pytest.raises(RequestFailedError, match="probability tensor"):
            await consume("bad", _poisoned(100))
        tokens = await asyncio.gather(*healthy)
        after = await consume("after", _lm(3))  # the loop goes on
        return tokens, after

    tokens, after = asyncio.run(main())
    compute.shutdown()
    assert [len(t) for t in tokens] == [200, 200] and len(after) == 6  # nothing lost by the survivors
    assert "bad" in engine.aborted and loop.failed == 1 and loop.finished == 3
    loop.raise_if_dead()  # healthy


def test_a_transient_step_failure_is_retried_and_fails_nobody():
    class Flaky(fakes.FakeEngine):
        fail_at: ClassVar[set[int]] = {5}  # steps that raise once (the class lives for this test only)

        def step(self):
            if self.steps in self.fail_at:
                self.fail_at.discard(self.steps)
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().step()

    engine = Flaky(max_running=2, step_s=0.0)
    compute = ComputeExecutor()
    loop = EngineLoop(engine, compute)

    async def consume(rid):
        return [t async for e in loop.generate(rid, _lm(20)) for t in e.tokens]

    async def main():
        return await asyncio.gather(consume("a"), consume("b"))

    results = asyncio.run(main())
    compute.shutdown()
    assert [len(r) for r in results] == [40, 40] and loop.failed == 0 and not engine.aborted


def test_an_error_event_fails_its_request_and_the_others_go_on():
    """What the runtime engine emits for non-finite logits: an event naming the request."""
    class NonFinite(fakes.FakeEngine):
        def step(self):
            events = super().step()
            bad = self.running.pop("nan", None)
            if bad is not None:
                events = [e for e in events if e.request_id != "nan"]
                events.append(TokenEvent("nan", [], finished=True, finish_reason="error",
                                         error="non-finite logits (NaN/Inf) for this request"))
            return events

    engine = NonFinite(max_running=2, step_s=0.0)
    compute = ComputeExecutor()
    loop = EngineLoop(engine, compute)

    async def consume(rid):
        return [t async for e in loop.generate(rid, _lm(10)) for t in e.tokens]

    async def main():
        return await asyncio.gather(consume("ok"), consume("nan"), return_exceptions=True)

    ok, nan = asyncio.run(main())
    compute.shutdown()
    assert len(ok) == 20
    assert isinstance(nan, RequestFailedError) and "non-finite logits" in str(nan)
    assert loop.failed == 1 and loop.finished == 1
    loop.raise_if_dead()


def test_an_engine_that_fails_whatever_is_removed_marks_the_loop_dead():
    class AlwaysFails(fakes.FakeEngine):
        def step(self):
            raise ValueError("broken kernel")

    engine = AlwaysFails(max_running=2, step_s=0.0)
    compute = ComputeExecutor()
    loop = EngineLoop(engine, compute)

    async def consume(rid):
        return [e async for e in loop.generate(rid, _lm(10))]

    async def main():
        suspects = await asyncio.gather(consume("a"), consume("b"), return_exceptions=True)
        # Every request of a full batch was removed and steps still fail: the engine is broken.
        with pytest.raises(EngineDeadError):
            await consume("c")
        return suspects

    suspects = asyncio.run(main())
    compute.shutdown()
    assert all(isinstance(r, RequestFailedError) for r in suspects), suspects
    with pytest.raises(EngineDeadError):
        loop.raise_if_dead()  # check_health raises: Serve replaces the replica


def _give_way_loop(due_s: float | None, step_s: float = 0.0, overdue_after: int = 0):
    """A loop whose GiveWay sees token2wav overdue once ``overdue_after`` tokens are decoded and
    until the step thread's first wait (which stands for token2wav's due job being done); the
    clock starts at 100 and each decode step takes ``step_s`` on it. The consumer wants all 6
    tokens at once."""
    engine, compute = fakes.FakeEngine(max_running=2, step_s=0.0), ComputeExecutor()
    now, done, waits = [100.0], [False], []
    step = engine.step

    def timed_step():
        now[0] += step_s
        return step()

    engine.step = timed_step

    def wait(event, seconds):  # records the hold, then token2wav is done; no sleep
        waits.append((seconds, engine.emitted("a")))
        done[0] = True

    give_way = engine_mailbox.GiveWay(overdue=lambda: not done[0] and engine.emitted("a") >= overdue_after,
                                   slack_s=0.5, max_s=0.01, clock=lambda: now[0], wait=wait)
    loop = EngineLoop(engine, compute, give_way=give_way)

    async def main():
        due = None if due_s is None else (lambda: due_s)
        return [e async for e in loop.generate("a", _lm(3), need=lambda: 6, due=due)]

    events = asyncio.run(main())
    compute.shutdown()
    assert events[-1].finished and sum(len(e.tokens) for e in events) == 6  # every token, held or not
    return loop, waits


def test_the_step_thread_gives_way_to_a_due_token2wav_job_when_no_consumer_is_due_soon():
    """The consumer waiting for its tokens is due in 1 s (beyond the 0.5 s slack) and steps take
    no time: the first step waits for token2wav's due job (once: it is done after that wait),
    then decoding goes on."""
    loop, waits = _give_way_loop(due_s=101.0)
    assert waits == [(0.01, 0)] and loop.gave_way == 1  # before any token was decoded


@pytest.mark.parametrize("due_s", [100.3, None])
def test_a_consumer_due_within_the_slack_keeps_the_llm_stepping(due_s):
    """Due in 0.3 s, or due unknown (counted as due at once, like a first chunk): token2wav stays
    overdue for the whole request and the step thread never waits."""
    loop, waits = _give_way_loop(due_s=due_s)
    assert waits == [] and loop.gave_way == 0


@pytest.mark.parametrize("step_s, held", [(0.1, False), (0.01, True)])
def test_the_steps_a_consumer_still_lacks_count_against_its_due_time(step_s, held):
    """Due in 1 s, 6 tokens missing, token2wav overdue from the first token on: at 0.1 s a step
    the tokens take 0.6 s, so the consumer is due within the slack and the LLM goes on; at
    0.01 s a step it is not, and the LLM gives way."""
    loop, waits = _give_way_loop(due_s=101.0, step_s=step_s, overdue_after=1)
    assert (loop.gave_way == 1) == held and len(waits) == loop.gave_way
