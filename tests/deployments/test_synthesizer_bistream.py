"""Bistream through the Synthesizer and EngineLoop without Ray (fakes), and the text inbox.

The fake engine speaks TOKENS_PER_TEXT_ID tokens per text id fed so far and waits (parked: no
work) for more until the text ends; the inbox is the in-process one.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deployments.protocol import InvalidInputError, OverloadedError, PreparedRequest
from deployments.text_inbox import BistreamTicket, LocalInbox, TextInbox
from tests.deployments import fakes
from tests.deployments.test_synthesizer_unit import _prompt, _synth


def _bistream_req(rid: str) -> PreparedRequest:
    return PreparedRequest(request_id=rid, pieces=[], prompt=_prompt(), llm_prompt_text_ids=np.arange(3, dtype=np.int32),
                           llm_use_prompt_speech=True, stream=True)


def test_audio_starts_before_the_text_ends_and_covers_all_of_it():
    s = _synth()
    inbox = s._inbox
    assert isinstance(inbox, LocalInbox)  # made with the replica (in Ray: its actor starts then)
    engine = s.runtime.engine
    rid = "bs/0"

    async def main():
        gen = s.synthesize_bistream(_bistream_req("bs"))
        ticket = await gen.__anext__()
        assert isinstance(ticket, BistreamTicket) and ticket.session == "bs" and ticket.inbox is inbox
        await ticket.push(list(range(1, 8)))  # 7 ids -> 14 tokens: one streamed hop of 12
        first = await gen.__anext__()
        assert first.index == 0 and len(first.samples) == fakes.HOP * fakes.SAMPLES_PER_TOKEN
        # all text so far is spoken; the request waits for more without work for the step thread
        assert await asyncio.to_thread(engine.wait_until, lambda: engine.emitted(rid) == 14)
        assert not engine.has_unfinished() and engine.num_running() == 1
        await ticket.push(list(range(8, 13)), end=True)  # 5 more ids, and the end
        rest = [c async for c in gen]
        assert rest[-1].is_last and all(c.piece == 0 for c in rest)
        total = len(first.samples) + sum(len(c.samples) for c in rest)
        assert total == 12 * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN
        assert s._inbox.inbox.num_sessions() == 0  # closed when the call ended
        with pytest.raises(InvalidInputError, match="already ended"):
            await ticket.push([1])

    asyncio.run(main())


def test_closing_the_call_aborts_the_parked_request_and_closes_the_session():
    s = _synth()
    engine = s.runtime.engine

    async def main():
        gen = s.synthesize_bistream(_bistream_req("c"))
        ticket = await gen.__anext__()
        await ticket.push([5] * 7)
        await gen.__anext__()
        await gen.aclose()  # the client went away mid-text
        assert await asyncio.to_thread(engine.wait_until, lambda: "c/0" in engine.aborted)
        assert engine.num_running() == 0 and s._inbox.inbox.num_sessions() == 0

    asyncio.run(main())


def test_a_text_source_error_fails_the_request():
    s = _synth()

    async def main():
        inbox = TextInbox()
        s._inbox = LocalInbox(inbox)
        gen = s.synthesize_bistream(_bistream_req("t"))
        await gen.__anext__()
        inbox.close("t")  # the session vanished under the request: its next read fails
        with pytest.raises(InvalidInputError, match="not open"):
            await gen.__anext__()

    asyncio.run(main())


def test_text_inbox_bounds_and_order():
    async def main():
        inbox = TextInbox(max_sessions=1, max_queued_ids=4)
        inbox.open("a")
        with pytest.raises(OverloadedError):
            inbox.open("b")
        with pytest.raises(InvalidInputError, match="already open"):
            inbox.open("a")
        inbox.push("a", [1, 2])
        inbox.push("a", [3])
        with pytest.raises(InvalidInputError, match="wait for synthesis"):
            inbox.push("a", [4, 5])
        assert await inbox.take("a") == ([1, 2, 3], False)
        waiter = asyncio.ensure_future(inbox.take("a"))
        await asyncio.sleep(0)  # a yield: the waiter blocks on the empty queue (same result if it had not)
        inbox.push("a", [4], end=True)
        assert await waiter == ([4], True)
        with pytest.raises(InvalidInputError, match="after the end"):
            inbox.push("a", [5])
        inbox.close("a")
        inbox.open("b")
        with pytest.raises(InvalidInputError, match="no text for"):
            await inbox.take("b", timeout_s=0.01)

    asyncio.run(main())
