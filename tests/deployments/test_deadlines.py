"""Deadline-first admission (deployments.deadlines): the playback model and the gate's rules.

Time is a fake clock whose sleeps end when the test advances it: no test waits for a while."""
from __future__ import annotations

import asyncio

import pytest

from deployments.deadlines import DeadlineGate, Playback
from tests.deployments import fakes
from tests.deployments.test_synthesizer_unit import _req, _synth


def test_playback_deadlines_and_underruns():
    play = Playback(submitted_s=10.0)
    assert play.deadline_s() == 10.0  # first audio is due at once
    assert play.add(10.3, 1.0) is False  # first chunk: playback starts at its arrival
    assert play.deadline_s() == pytest.approx(11.3)
    assert play.add(11.0, 2.0) is False  # in time: queued behind the audio in hand
    assert play.deadline_s() == pytest.approx(13.3)
    assert play.add(14.0, 0.5) is True  # 0.7 s late: a stutter, playback resumes at arrival
    assert play.deadline_s() == pytest.approx(14.5) and play.underruns == 1


class FakeClock(fakes.FakeClock):
    """Also a ``sleep`` for the gate: a sleeper wakes once the clock is advanced past its end (one
    event loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.sleepers: list[tuple[float, asyncio.Future]] = []

    async def sleep(self, seconds: float) -> None:
        entry = (self.now + seconds, asyncio.get_running_loop().create_future())
        self.sleepers.append(entry)
        try:
            await entry[1]
        finally:
            self.sleepers.remove(entry)

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        for due, future in self.sleepers:
            if due <= self.now and not future.done():
                future.set_result(None)


async def _until(predicate, rounds: int = 1000) -> None:
    """Let the other tasks run until ``predicate()`` holds (event-loop turns, not time)."""
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def test_urgent_jobs_enter_at_once_and_hold_back_jobs_with_audio_in_hand():
    clock = FakeClock()
    gate = DeadlineGate(slack_s=0.5, clock=clock)
    order: list[str] = []

    async def job(name: str, deadline: float, release: asyncio.Event) -> None:
        async with gate.turn(deadline):
            order.append(name)
            await release.wait()

    async def main():
        urgent_done, other_done = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(job("first-chunk", clock.now, urgent_done))  # due now
        await asyncio.sleep(0)
        second = asyncio.create_task(job("also-urgent", clock.now + 0.2, urgent_done))
        relaxed = asyncio.create_task(job("relaxed", clock.now + 3.0, other_done))  # 3 s of audio in hand
        for _ in range(5):
            await asyncio.sleep(0)
        assert order == ["first-chunk", "also-urgent"] and gate.admitted == 2
        urgent_done.set()  # both urgent jobs leave: the held one may enter
        await asyncio.gather(first, second)
        for _ in range(5):
            await asyncio.sleep(0)
        assert order[-1] == "relaxed" and gate.held == 1
        other_done.set()
        await relaxed

    asyncio.run(main())
    assert gate.admitted == 0


def test_nothing_urgent_means_no_waiting():
    clock = FakeClock()
    gate = DeadlineGate(slack_s=0.5, clock=clock)

    async def main():
        async with gate.turn(clock.now + 5.0), gate.turn(clock.now + 2.0):  # neither is due within the slack
            assert gate.admitted == 2

    asyncio.run(main())
    assert gate.held == 0 and gate.admitted == 0


def test_a_held_job_enters_when_it_becomes_due_itself():
    clock = FakeClock()
    gate = DeadlineGate(slack_s=0.05, clock=clock, sleep=clock.sleep)

    async def main():
        release, entered = asyncio.Event(), asyncio.Event()

        async def blocker():
            async with gate.turn(clock.now):  # urgent, holds its turn until released
                await release.wait()

        async def held():
            async with gate.turn(clock.now + 0.15):  # due within the slack 0.1 s from now
                entered.set()

        blocking = asyncio.create_task(blocker())
        await _until(lambda: gate.admitted == 1)
        holding = asyncio.create_task(held())
        await _until(lambda: gate.waiting == 1 and clock.sleepers)  # held, asleep until it is due
        clock.advance(0.08)  # not yet due
        for _ in range(20):
            await asyncio.sleep(0)
        assert not entered.is_set() and gate.waiting == 1
        clock.advance(0.04)  # now due within the slack: enters, the urgent job still inside
        await _until(entered.is_set)
        assert not release.is_set() and gate.admitted == 1  # the urgent job is still inside
        release.set()
        await asyncio.gather(blocking, holding)

    asyncio.run(main())
    assert gate.held == 1 and gate.admitted == 0 and gate.waiting == 0


def test_a_cancelled_waiter_leaves_no_admission_behind():
    clock = FakeClock()
    gate = DeadlineGate(slack_s=0.5, clock=clock)

    async def main():
        release = asyncio.Event()

        async def urgent():
            async with gate.turn(clock.now):
                await release.wait()

        async def relaxed():
            async with gate.turn(clock.now + 10.0):
                pass

        u = asyncio.create_task(urgent())
        await asyncio.sleep(0)
        r = asyncio.create_task(relaxed())
        await _until(lambda: gate.waiting == 1)
        r.cancel()  # a client disconnect while held
        with pytest.raises(asyncio.CancelledError):
            await r
        assert gate.admitted == 1
        release.set()
        await u

    asyncio.run(main())
    assert gate.admitted == 0


@pytest.mark.parametrize("slack", [0.5, None])
def test_synthesizer_streams_through_the_gate(slack):
    s = _synth(max_running=4, deadline_slack_s=slack)

    async def collect(rid):
        return [c async for c in s.synthesize(_req(rid, 20, stream=True))]

    async def main():
        return await asyncio.gather(*(collect(f"s{i}") for i in range(3)))

    streams = asyncio.run(main())
    assert all(len(chunks) > 1 and chunks[-1].is_last for chunks in streams)
    stats = s.stats()
    assert (s.gate is None) == (slack is None)
    assert stats["deadline_held_total"] == (s.gate.held if s.gate else 0)
    # The fakes make audio ~8x faster than real time on the fake clock: no chunk arrives late.
    assert stats["underruns_total"] == 0
    assert s.gate is None or s.gate.admitted == 0


def test_synthesizer_counts_chunks_made_after_the_audio_ran_out():
    s = _synth(max_running=2)
    fast = s._token2wav

    async def slow(job):  # every chunk after the first takes longer than the audio before it lasts
        if s.t2w_batch_sizes:
            s.clock.advance(0.6)
        return await fast(job)

    s._token2wav = slow

    async def main():
        return [c async for c in s.synthesize(_req("late", 10, stream=True))]

    chunks = asyncio.run(main())
    assert len(chunks) == 2  # one hop of 12 tokens (0.48 s of audio), then the final 8
    assert s.stats()["underruns_total"] == 1
