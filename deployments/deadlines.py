"""Deadline-first admission of token2wav chunk jobs (no Ray import: the benchmark uses it too).

A streamed request's next chunk is due when the audio it has already received finishes playing
(:class:`Playback`); its first chunk is due at once. :class:`DeadlineGate` sits in front of the
``@serve.batch`` token2wav method: while some admitted job is due within ``slack_s``, a job with
audio to spare waits (until those jobs are done, or until it is due itself), so the urgent jobs
form a smaller batch that returns sooner. ``@serve.batch`` still does the batching; the gate only
decides who joins the queue now. In the benchmark's replica simulation the same policy cut the
first-audio tail and the underruns and raised throughput (docs/tuning.md §2, ``deadline_slack_s``).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

DEFAULT_SLACK_S = 0.5


@dataclass
class Playback:
    """Playback model of one request at its client: chunks play back to back from the first one's
    arrival; a chunk that arrives after the audio before it ran out is an underrun (a stutter), and
    playback resumes from its arrival."""

    submitted_s: float
    play_end_s: float | None = None  # None until the first chunk
    underruns: int = 0

    def deadline_s(self) -> float:
        """When the next chunk is due: the end of the audio so far; the submission before any."""
        return self.submitted_s if self.play_end_s is None else self.play_end_s

    def add(self, arrived_s: float, audio_s: float) -> bool:
        """Record a chunk of ``audio_s`` seconds arriving at ``arrived_s``; True if it underran."""
        late = self.play_end_s is not None and arrived_s > self.play_end_s + 1e-9
        if self.play_end_s is None or late:
            self.play_end_s = arrived_s
        self.underruns += late
        self.play_end_s += audio_s
        return late


class DeadlineGate:
    """Admission by deadline, in one event loop (the replica's)."""

    def __init__(self, slack_s: float = DEFAULT_SLACK_S, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """``clock`` / ``sleep``: the time deadlines are read on and how a held job waits for its own
        deadline (tests inject a fake clock whose sleeps end when it is advanced)."""
        self.slack_s = slack_s
        self.clock = clock
        self.sleep = sleep
        self._admitted: list[float] = []  # deadlines of jobs in the batch queue or running
        self._changed: asyncio.Event | None = None
        self.held = 0  # jobs that had to wait for more urgent ones (a counter for stats)
        self.waiting = 0  # jobs held now

    def _urgent(self, deadline_s: float, now: float) -> bool:
        return deadline_s - now < self.slack_s

    def _blocked(self, deadline_s: float) -> float | None:
        """Seconds until this job is due, if it must wait now; None if it may enter."""
        now = self.clock()
        if self._urgent(deadline_s, now) or not any(self._urgent(d, now) for d in self._admitted):
            return None
        return deadline_s - self.slack_s - now

    @contextlib.asynccontextmanager
    async def turn(self, deadline_s: float) -> AsyncIterator[None]:
        """Hold the job until it may join the batch queue; it counts as admitted inside the block."""
        waited = False
        while (wait_s := self._blocked(deadline_s)) is not None:
            waited = True
            await self._wait_change_or(wait_s)
        self.held += waited
        self._admitted.append(deadline_s)
        try:
            yield
        finally:
            self._admitted.remove(deadline_s)
            if self._changed is not None:  # wake the waiters to re-check; later ones wait on a new event
                self._changed.set()
                self._changed = None

    async def _wait_change_or(self, wait_s: float) -> None:
        """Until an admitted job leaves or ``wait_s`` seconds of the clock have passed."""
        if self._changed is None:
            self._changed = asyncio.Event()
        changed = asyncio.ensure_future(self._changed.wait())
        due = asyncio.ensure_future(self.sleep(max(wait_s, 0.0)))
        self.waiting += 1
        try:
            await asyncio.wait((changed, due), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.waiting -= 1
            changed.cancel()
            due.cancel()

    @property
    def admitted(self) -> int:
        return len(self._admitted)
