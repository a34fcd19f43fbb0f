"""EngineLoop mailboxes: a consumer is woken when it has the tokens it asked for, not per step."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deployments.compute import ComputeExecutor
from deployments.engine_loop import EngineLoop
from deployments.runtime_adapter import LMRequest
from tests.deployments import fakes


def _lm(n_ids: int) -> LMRequest:  # fakes emit TOKENS_PER_TEXT_ID tokens per text id
    return LMRequest(text_ids=np.arange(n_ids, dtype=np.int32), prompt_text_ids=np.zeros(0, np.int32),
                     prompt_speech_ids=np.zeros(0, np.int32))


def _loop(max_running: int = 4) -> tuple[EngineLoop, fakes.FakeEngine, ComputeExecutor]:
    engine = fakes.FakeEngine(max_running=max_running, step_s=0.0)
    compute = ComputeExecutor()
    return EngineLoop(engine, compute), engine, compute


def test_without_need_every_step_is_an_event():
    loop, _, compute = _loop()

    async def main():
        return [e async for e in loop.generate("a", _lm(5))]

    events = asyncio.run(main())
    compute.shutdown()
    assert [len(e.new_tokens) for e in events] == [1] * 10
    assert [e.finished for e in events] == [False] * 9 + [True]


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
        for _ in range(50):
            await asyncio.sleep(0.001)
        assert engine.running  # decoding, the consumer asleep on its mailbox
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The freed slot lets the next request run to its end.
        return [e async for e in loop.generate("next", _lm(2))]

    events = asyncio.run(main())
    compute.shutdown()
    assert "slow" in engine.aborted and events[-1].finished and loop.aborted == 1
