"""The hand-over between :class:`~deployments.engine_loop.EngineLoop`'s step thread and one request's
consumer: the :class:`Mailbox` that holds a request's tokens until the consumer can use them, and
what the step thread reads to decide whether to give way to token2wav (:class:`GiveWay`).

A mailbox wakes its consumer only once the request has the tokens the consumer asked for
(``need``: the next streamed chunk's token count) or has finished, so a step costs one coroutine
switch per chunk, not one per stream (the serving layer's cost per decode step this saves:
docs/serving.md, "Event-loop cost per decode step").

Giving way to token2wav (``token2wav.give_way_ms``): the LLM lane runs on a high-priority CUDA
stream, so a stream's first chunk, solved on the token2wav lane, shares the GPU with every decode
step meanwhile, decoding tokens that would be played a second later (how much of first audio that
costs: docs/tuning.md, ``give_way_ms``). With a :class:`GiveWay`, before each step the step thread
waits while token2wav has a job that is already due (a first chunk, or a late one) and no consumer
waiting for tokens is due within the slack: each consumer tells when its next chunk is due (``due``
of :meth:`~deployments.engine_loop.EngineLoop.generate`; a first chunk is due at once, so a new
request is never held), less the decode steps its missing tokens still take (CosyVoice2's later
chunks want 100 tokens, ~0.4 s of steps under load: more than the slack).
"""
from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cosyvoice_runtime.lm_messages import TokenEvent
from deployments.protocol import RequestFailedError


@dataclass(frozen=True)
class GiveWay:
    """When the step thread waits for token2wav instead of stepping (module docstring).

    ``overdue``: whether token2wav holds a job that is due already (thread-safe); ``slack_s``: a
    consumer due within this long keeps the LLM stepping; ``max_s``: the longest one wait (woken
    early by new work and by :meth:`EngineLoop.wake`), after which the step thread looks again;
    ``clock``: the clock the consumers' ``due`` times are on; ``wait``: ``Event.wait`` (tests pass
    one that records the wait instead of sleeping)."""

    overdue: Callable[[], bool]
    slack_s: float
    max_s: float
    clock: Callable[[], float]
    wait: Callable[[threading.Event, float], object] = threading.Event.wait


def need_by(box: Mailbox, due: Callable[[], float] | None) -> tuple[float, float]:
    """When a consumer about to wait needs its next chunk and the tokens it still lacks for it
    (unknown: infinitely many; no ``due``: needed at once). On the event loop."""
    if due is None:
        return -math.inf, math.inf
    if box.need is None:  # woken by any token
        return due(), 1
    want = box.need()
    return due(), math.inf if want is None else max(0, want - box.total)


@dataclass
class Mailbox:
    """Tokens of one request delivered by the loop and not yet taken by its consumer."""

    need: Callable[[], int | None] | None  # see EngineLoop.generate
    on_first_token: Callable[[], None] | None = None  # see EngineLoop.generate
    tokens: list[int] = field(default_factory=list)
    raw: list[int] = field(default_factory=list)  # the LLM's ids of ``tokens``' steps, unfiltered (TokenEvent.raw)
    text_read: list[int] | None = None  # with tokens, for bistream requests (TokenEvent.text_read)
    total: int = 0  # tokens delivered so far, taken or not
    finished: bool = False
    reason: str | None = None
    error: BaseException | None = None
    waiter: asyncio.Future | None = None

    def ready(self) -> bool:
        if self.error is not None or self.finished:
            return True
        if not self.tokens:
            return False
        if self.need is None:
            return True
        want = self.need()
        return want is not None and self.total >= want

    def put(self, event: TokenEvent) -> None:
        if event.error is not None:
            self.fail(RequestFailedError(event.error))
            return
        if event.tokens and self.total == 0 and self.on_first_token is not None:
            self.on_first_token()
        self.tokens.extend(event.tokens)
        self.raw.extend(event.tokens if event.raw is None else event.raw)
        if event.text_read is not None:
            self.text_read = (self.text_read or []) + event.text_read
        self.total += len(event.tokens)
        if event.finished:
            self.finished, self.reason = True, event.finish_reason
        self._wake()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done() and self.ready():
            self.waiter.set_result(None)

    def take(self, request_id: str) -> TokenEvent:
        event = TokenEvent(request_id, self.tokens, finished=self.finished, finish_reason=self.reason,
                           raw=self.raw, text_read=self.text_read)
        self.tokens, self.raw, self.text_read = [], [], None
        return event


def latest_start(waiting: Iterable[tuple[float, float]], step_s: float) -> float:
    """The latest time at which the missing tokens of every waiting consumer (``need_by``'s pairs)
    can still start decoding, given ``step_s`` per decode step; infinity when none waits."""
    return min((due - (missing * step_s if missing < math.inf else math.inf) for due, missing in waiting),
               default=math.inf)
