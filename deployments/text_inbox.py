"""Text inbox: how the fragments of a bistream request reach the ONE replica that runs it.

A Serve handle routes every call on its own, so a second call with more text could reach
another synthesizer replica. Instead, each synthesizer replica starts a small Ray actor
(:class:`TextInbox`, no CPU reserved, on the replica's node, owned by the replica so it dies
with it) holding one queue per open bistream session. The bistream call's first streamed item
is a :class:`BistreamTicket` that carries the inbox's actor handle and the session id; the
caller pushes text ids (and the end of the text) straight to that actor, and the replica's
request takes them from it (:meth:`InboxClient.text`). Closing the call closes the session, and
text pushed after that is refused.

A push and the replica's take of it are one local actor call each (their time on local Ray:
docs/serving.md, text-in streaming). Starting the actor starts a worker process, which the first
bistream session of a replica would wait for (same section), so a replica starts its inbox with
itself, not at the first bistream call.

Bounded: sessions per inbox, ids queued per session (a caller that outruns the replica is
refused, not buffered without end), and a replica-side wait for text (a caller that vanished
without closing does not hold a decode slot for ever). The ingress bounds the characters of a
session and its own inactivity.

Without Ray (unit tests, in-process apps) :class:`LocalInbox` serves the same API from the
replica's own event loop.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from deployments.protocol import InvalidInputError, OverloadedError

logger = logging.getLogger(__name__)

MAX_SESSIONS = 1024  # open bistream sessions per inbox (a replica runs at most max_running of them)
MAX_QUEUED_IDS = 8192  # text ids pushed to a session and not yet taken by its request
TEXT_WAIT_S = 200.0  # a request that gets no text for this long fails (the ingress's own limit is 180 s)


@dataclass
class _Session:
    ids: list[int] = field(default_factory=list)
    ended: bool = False
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class TextInbox:
    """Per-session text queues (the body of the inbox actor; plain asyncio, one event loop)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, max_queued_ids: int = MAX_QUEUED_IDS) -> None:
        self.max_sessions, self.max_queued_ids = max_sessions, max_queued_ids
        self._sessions: dict[str, _Session] = {}

    def open(self, session: str) -> None:
        if session in self._sessions:
            raise InvalidInputError(f"bistream session {session} is already open")
        if len(self._sessions) >= self.max_sessions:
            raise OverloadedError(f"{self.max_sessions} bistream sessions are open on this replica")
        self._sessions[session] = _Session()

    def push(self, session: str, ids: Sequence[int], end: bool = False) -> None:
        """Queue text ids of a session; ``end``: its text is complete.

        Raises:
            InvalidInputError: the session is closed (its request ended), its text had ended, or
                too many ids wait in it.
        """
        s = self._sessions.get(session)
        if s is None:
            raise InvalidInputError("the speech for this text has already ended (its session is closed)")
        if s.ended:
            raise InvalidInputError("text arrived after the end of the text")
        if len(s.ids) + len(ids) > self.max_queued_ids:
            raise InvalidInputError(f"more than {self.max_queued_ids} text tokens wait for synthesis")
        s.ids.extend(int(i) for i in ids)
        s.ended = end
        s.arrived.set()

    async def take(self, session: str, timeout_s: float = TEXT_WAIT_S) -> tuple[list[int], bool]:
        """Every id queued so far (waiting for at least one, or the end); returns (ids, ended).

        Raises:
            InvalidInputError: no text within ``timeout_s``, or the session is not open.
        """
        s = self._sessions.get(session)
        if s is None:
            raise InvalidInputError(f"bistream session {session} is not open")
        if not (s.ids or s.ended):
            try:
                await asyncio.wait_for(s.arrived.wait(), timeout_s)
            except TimeoutError:
                raise InvalidInputError(f"no text for {timeout_s:g} s") from None
        ids, s.ids = s.ids, []
        s.arrived.clear()
        return ids, s.ended

    def close(self, session: str) -> None:
        self._sessions.pop(session, None)

    def num_sessions(self) -> int:
        return len(self._sessions)


class InboxClient:
    """The calls the replica and the ingress make; see :class:`LocalInbox`, :class:`ActorInbox`."""

    async def open(self, session: str) -> None:
        raise NotImplementedError

    async def push(self, session: str, ids: Sequence[int], end: bool = False) -> None:
        raise NotImplementedError

    async def take(self, session: str) -> tuple[list[int], bool]:
        raise NotImplementedError

    def close(self, session: str) -> None:
        """Drop a session now (never blocks: called from ``finally`` of a cancelled request)."""
        raise NotImplementedError

    async def text(self, session: str) -> AsyncIterator[tuple[list[int], bool]]:
        """A session's text as it arrives: (ids, ended) until ended."""
        while True:
            ids, ended = await self.take(session)
            yield ids, ended
            if ended:
                return


class LocalInbox(InboxClient):
    """An inbox in this process (no Ray): for unit tests and in-process apps."""

    def __init__(self, inbox: TextInbox | None = None) -> None:
        self.inbox = inbox or TextInbox()

    async def open(self, session: str) -> None:
        self.inbox.open(session)

    async def push(self, session: str, ids: Sequence[int], end: bool = False) -> None:
        self.inbox.push(session, ids, end)

    async def take(self, session: str) -> tuple[list[int], bool]:
        return await self.inbox.take(session)

    def close(self, session: str) -> None:
        self.inbox.close(session)


class ActorInbox(InboxClient):
    """A :class:`TextInbox` Ray actor; picklable (the handle travels in the ticket)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    @classmethod
    def start(cls) -> ActorInbox:
        """Start the inbox actor on this node, owned by the calling actor (the replica)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # NOTE: num_cpus=0: it only moves a few ids per message and must not take a CPU from the
        # replica's bundle; on this node, so a push is one local hop.
        node = ray.get_runtime_context().get_node_id()
        actor = ray.remote(TextInbox).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        # A first call, unawaited: the replica's connection to the actor is made now, in the
        # background, not by the first session's open (a read, changes nothing).
        actor.num_sessions.remote()
        return cls(actor)

    async def open(self, session: str) -> None:
        await self.handle.open.remote(session)

    async def push(self, session: str, ids: Sequence[int], end: bool = False) -> None:
        await self.handle.push.remote(session, list(ids), end)

    async def take(self, session: str) -> tuple[list[int], bool]:
        return await self.handle.take.remote(session)

    def close(self, session: str) -> None:
        self.handle.close.remote(session)  # fire and forget: the actor runs it in order


@dataclass
class BistreamTicket:
    """First item of a bistream call: where to push this request's text."""

    inbox: InboxClient
    session: str

    async def push(self, ids: Sequence[int], end: bool = False) -> None:
        await self.inbox.push(self.session, ids, end)


def default_inbox() -> InboxClient:
    """The text inbox actor inside a Serve replica, one in this process outside (tests)."""
    from ray import serve

    try:
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - outside a replica (unit tests, in-process apps)
        return LocalInbox()
    return ActorInbox.start()
