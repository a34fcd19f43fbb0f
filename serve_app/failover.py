"""Streams that survive the synthesizer replica serving them (docs/serving.md, Failover).

:class:`FailoverStream` stands where a streaming handle call stood (``__anext__``, ``cancel``):
it calls ``Synthesizer.synthesize`` and, when the replica dies mid-stream (Ray reports the actor
dead or unreachable), calls it again with a :class:`~deployments.protocol.Resume` built from what
the client has received (:class:`Progress`); Serve's router has marked the dead replica, so the
call goes to another one, which continues the same stream (``deployments/resume.py``). The client
sees a pause and then the audio an unbroken run gives, sample for sample within float noise.

That needs a reproducible run: a request without a seed gets one here (:func:`with_seed`), so its
sampling and the vocoder's noise can be replayed. At most ``retries`` continuations per stream;
after that, or when a continuation fails before its first chunk, :class:`StreamLostError`: the
routes end the stream as their API says (an SSE ``error`` event, an aborted HTTP body, WebSocket
close 1011). A bistream (text-in) sequence is not continued: its replica's text inbox dies with it.
A request answered whole reads the same stream (``TTSIngress.synthesize_whole``), so it is
continued the same way.
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import replace

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from deployments.protocol import AudioChunk, EngineDeadError, InvalidInputError, PreparedRequest, Resume
from serve_app.handles import cancel_stream

logger = logging.getLogger(__name__)

DEFAULT_RETRIES = 2  # continuations of one stream (ingress.stream_failover_retries)
SEED_BITS = 31  # an ingress-chosen seed; clients may give any in [0, 2**63)


class StreamLostError(EngineDeadError):
    """The replica serving a stream died and the stream could not be continued on another (503)."""


def replica_lost(exc: BaseException) -> bool:
    """Whether a handle call failed because its replica died or became unreachable (not because
    of the request: those errors are the request's own and are never retried)."""
    return isinstance(exc, RayActorError)


def with_seed(prepared: PreparedRequest) -> PreparedRequest:
    """``prepared`` with a seed: the client's, else one chosen here, so that a continuation on
    another replica samples what this run would have."""
    if prepared.seed is not None:
        return prepared
    return replace(prepared, seed=secrets.randbits(SEED_BITS))


def seed_param(value: str | None) -> int | None:
    """A seed given as a query parameter (WebSocket sessions), as the JSON bodies' ``seed``."""
    if value is None:
        return None
    if not value.isdigit() or int(value) >= 2**63:
        raise InvalidInputError("seed must be an integer in [0, 2**63)")
    return int(value)


class Progress:
    """What the client has of a stream, as a continuation needs it (:class:`Resume`)."""

    def __init__(self) -> None:
        self.resume = Resume()

    def saw(self, chunk: AudioChunk) -> None:
        r = self.resume
        if chunk.piece != r.piece:  # a new piece: the ones before were delivered whole
            r.piece, r.tokens, r.samples, r.llm_done = chunk.piece, [], 0, False
        r.tokens.extend(chunk.tokens)
        r.samples += len(chunk.samples)
        r.llm_done = r.llm_done or chunk.llm_done
        r.chunks += 1

    def snapshot(self) -> Resume:
        r = self.resume
        return Resume(piece=r.piece, tokens=list(r.tokens), samples=r.samples, llm_done=r.llm_done, chunks=r.chunks)


class FailoverStream:
    """An async iterator of a request's :class:`AudioChunk` s over ``synth`` (a Synthesizer handle)
    that continues on another replica when the one serving it dies (module docstring).

    ``retries``: continuations allowed (0: none; the death is :class:`StreamLostError` at once).
    ``on_failover``: called with ``"continued"`` when a continuation starts and ``"lost"`` when
    none is left (metrics).
    """

    def __init__(self, synth, prepared: PreparedRequest, retries: int = DEFAULT_RETRIES, on_failover=None) -> None:
        self.synth = synth
        self.prepared = with_seed(prepared)
        self.retries = retries
        self.failovers = 0
        self.progress = Progress()
        self._on_failover = on_failover
        self._gen = self._call(self.prepared)

    def _call(self, prepared: PreparedRequest):
        return self.synth.options(stream=True).synthesize.remote(prepared)

    def __aiter__(self) -> FailoverStream:
        return self

    async def __anext__(self) -> AudioChunk:
        while True:
            try:
                chunk = await self._gen.__anext__()
            except StopAsyncIteration:
                raise
            except Exception as exc:
                if self.failovers and isinstance(exc, BackPressureError):  # no replica has room for it
                    raise self._lost(f"the synthesizer replica serving this stream died and no other replica "
                                     f"had room to continue it ({type(exc).__name__})") from None
                if not replica_lost(exc):
                    raise
                self._continue(exc)
                continue
            self.progress.saw(chunk)
            return chunk

    def _continue(self, exc: BaseException) -> None:
        rid = self.prepared.request_id
        if self.failovers >= self.retries:
            raise self._lost(f"the synthesizer replica serving this stream died ({type(exc).__name__}) and "
                             f"it could not be continued after {self.failovers} continuation(s)") from None
        self.failovers += 1
        resume = self.progress.snapshot()
        logger.warning("request %s: its synthesizer replica died (%s); continuing on another at piece %d, "
                       "sample %d", rid, type(exc).__name__, resume.piece, resume.samples)
        if self._on_failover is not None:
            self._on_failover("continued")
        cancel_stream(self._gen)
        self._gen = self._call(replace(self.prepared, resume=resume))

    def _lost(self, message: str) -> StreamLostError:
        logger.warning("request %s: %s", self.prepared.request_id, message)
        if self._on_failover is not None:
            self._on_failover("lost")
        return StreamLostError(message)

    def cancel(self) -> None:
        cancel_stream(self._gen)


async def lost_as_error(gen):
    """The items of a handle stream that is not continued (a bistream sequence: its text went to
    the dead replica's inbox); its replica's death becomes :class:`StreamLostError`, which says why
    (WebSocket close 1011)."""
    try:
        async for item in gen:
            yield item
    except Exception as exc:
        if not replica_lost(exc):
            raise
        raise StreamLostError(f"the synthesizer replica serving this text-in stream died ({type(exc).__name__}); "
                              "a text-in sequence cannot be continued on another replica") from None
