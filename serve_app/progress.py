"""The audio-progress timeout: how long any stream may go without audio (docs/serving.md, Long answers).

No stream has a total time limit: a long answer streams for as long as its audio keeps coming.
Instead every stream path waits at most ``ingress.stream_idle_timeout_s`` for a synthesizer
stream's next item (the first included) while the synthesizer owes one, and ends the stream with
:class:`NoAudioError` when none comes. One mechanism, :class:`AudioProgress`, is shared by every
route, whole answers included (they join the same stream, ``TTSIngress.synthesize_whole``); each
ends the stream as its API says (the one error mapping, serve_app/errors.py):

* HTTP before the headers (and whole answers, at any point): 504 ``audio_timeout`` with
  ``Retry-After``, in the route family's error shape (OpenAI's or ElevenLabs');
* HTTP after the headers: an SSE ``error`` event, else an aborted body;
* WebSocket: the error message, then close 1011 (a multi-stream-input context: the error message
  with its ``contextId``; the other contexts go on, as for any failed context);
* the Python handle API: the caller's stream (or ``synthesize`` call) raises :class:`NoAudioError`.

A text-in (bistream) turn owes audio only once its text is complete (flush, the end, the turn
bound): before that the model may wait for the client's text, which the client's own inactivity
timeout bounds. The turn's first item (its text-inbox ticket) is owed at once.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.protocol import CosyVoiceError

DEFAULT_IDLE_S = 60.0  # ingress.stream_idle_timeout_s


class NoAudioError(CosyVoiceError):
    """A stream's next audio did not come within ``stream_idle_timeout_s`` (504 ``audio_timeout``)."""


class AudioProgress:
    """The progress timeout of a route's synthesizer streams.

    Args:
        idle_s: the longest wait for a stream's next item while one is owed.
        sleep: ``asyncio.sleep`` in production; tests pass a fake clock's sleep, so that a long
            stream and a stall are told apart without waiting for wall time.
    """

    def __init__(self, idle_s: float, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        self.idle_s = idle_s
        self._sleep = sleep

    def watch(self, gen: Any, owed: asyncio.Event | None = None) -> WatchedStream:
        """``gen`` (a streaming handle call, or anything with ``__anext__`` and ``cancel``) whose
        items each come within ``idle_s`` or raise :class:`NoAudioError`; with ``owed``, the wait
        is counted only from the moment the event is set (a bistream turn's end of text)."""
        return WatchedStream(self, gen, owed)

    async def next(self, gen: Any, owed: asyncio.Event | None = None) -> Any:
        """``gen``'s next item (``StopAsyncIteration`` at its end); :class:`NoAudioError` when none
        came within ``idle_s`` of being owed. The pending ``__anext__`` is cancelled then; the
        caller cancels the stream itself (which aborts the sequence in the synthesizer)."""
        step = asyncio.ensure_future(gen.__anext__())
        step.add_done_callback(_retrieved)  # a caller cancelled meanwhile never reads its outcome
        timer = asyncio.ensure_future(self._deadline(owed))
        try:
            done, _ = await asyncio.wait((step, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also on the caller's cancellation (a client gone): nothing is left running
            timer.cancel()
            if not step.done():
                step.cancel()
        if step in done:  # an item that came with the deadline still counts
            return step.result()
        await asyncio.gather(step, return_exceptions=True)  # its cancellation has run (as wait_for's)
        raise NoAudioError(f"no audio for {self.idle_s:g} s; the synthesizer is busy or stalled")

    async def _deadline(self, owed: asyncio.Event | None) -> None:
        if owed is not None:
            await owed.wait()
        await self._sleep(self.idle_s)


def _retrieved(task: asyncio.Future) -> None:
    """Mark a task's exception as read (asyncio would log it as never retrieved)."""
    if not task.cancelled():
        task.exception()


class WatchedStream:
    """A stream read through :meth:`AudioProgress.next` (``async for`` / ``__anext__`` / ``cancel``)."""

    def __init__(self, progress: AudioProgress, gen: Any, owed: asyncio.Event | None) -> None:
        self.progress, self.gen, self.owed = progress, gen, owed

    def __aiter__(self) -> WatchedStream:
        return self

    async def __anext__(self) -> Any:
        return await self.progress.next(self.gen, self.owed)

    def cancel(self) -> None:
        self.gen.cancel()
