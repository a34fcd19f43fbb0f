"""Every stream path shares one audio-progress timeout (issue 41 item 5; serve_app/progress.py): a
stream whose audio stalls for ``stream_idle_timeout_s`` ends as its API says, and one that keeps
delivering audio is never cut, however long it runs. Requests answered whole (``"stream": false``,
the handle API's ``synthesize``) read the same stream (``TTSIngress.synthesize_whole``): the same
timeout, a 504 (or ``NoAudioError``) at any point.

Deterministic: the synthesizer's streams are paced by the test (:class:`Paced`: each item past the
free ones waits for a permit) and the timeout's clock is a fake one (:class:`FakeTimers`) that moves
only when the test advances it; the in-process app runs on the test's own event loop (HTTP through
httpx's ASGI transport, WebSockets through :class:`WsClient`). ``GUARD_S`` only turns a route that
never ends a stalled stream (the code before this timeout) into a failed test, not a hung one.
"""
from __future__ import annotations

import asyncio
import base64
import json
import math
from urllib.parse import urlsplit

import numpy as np
import pytest

from deployments.protocol import SynthesisRequest
from serve_app.ingress import IngressConfig
from serve_app.progress import AudioProgress, NoAudioError
from tests.deployments import fakes
from tests.serve_app.test_ingress_inproc import _ingress, client

IDLE_S = 60.0  # fake seconds
GUARD_S = fakes.GUARD_S
EL = "/v1/text-to-speech/default"
TEXT = "Hello there. How are you?"
LONG = "One here. Two there. Three more. Four now. Five then. Six at last."  # six pieces


class FakeTimers:
    """``sleep`` for :class:`AudioProgress` on a clock that moves only by :meth:`advance`."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, asyncio.Future]] = []
        self._registered = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now + seconds, fut))
        self._registered.set()
        await fut  # a cancelled timer cancels this future at once: it is no longer pending

    def pending(self) -> int:
        return sum(not f.done() for _, f in self._sleepers)

    async def armed(self) -> None:
        """Until a timer is running (a stream's wait is being timed)."""
        while not self.pending():
            self._registered.clear()
            await self._registered.wait()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for deadline, fut in self._sleepers:
            if deadline <= self.now and not fut.done():
                fut.set_result(None)
        self._sleepers = [(d, f) for d, f in self._sleepers if not f.done()]


class Paced:
    """A synthesizer handle stand-in whose streams (``synthesize``, ``synthesize_bistream``) give
    their first ``free`` items at once and each later one only for a permit (:meth:`release`)."""

    STREAMED = ("synthesize", "synthesize_bistream")

    def __init__(self, inner, free: float = math.inf) -> None:
        self._inner, self.free = inner, free
        self.blocked: int | None = None  # the index of the item a stream waits a permit for
        self._permits = asyncio.Semaphore(0)
        self._moved = asyncio.Event()
        self.streams: list[_PacedStream] = []

    def options(self, stream: bool = False):
        return _PacedView(self, self._inner.options(stream=stream), stream)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._permits.release()

    async def blocked_at(self, k: int) -> None:
        while self.blocked != k:
            self._moved.clear()
            await self._moved.wait()


class _PacedView:
    def __init__(self, owner: Paced, inner, stream: bool) -> None:
        self._owner, self._inner, self._stream = owner, inner, stream

    def __getattr__(self, name: str):
        method, owner, stream = getattr(self._inner, name), self._owner, self._stream

        class Method:
            @staticmethod
            def remote(*args):
                res = method.remote(*args)
                if stream and name in Paced.STREAMED:
                    res = _PacedStream(res, owner)
                    owner.streams.append(res)
                return res

        return Method


class _PacedStream:
    def __init__(self, inner, owner: Paced) -> None:
        self.inner, self.owner, self.n, self.cancelled = inner, owner, 0, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        owner = self.owner
        if self.n >= owner.free:
            owner.blocked = self.n
            owner._moved.set()
            await owner._permits.acquire()
            owner.blocked = None
        self.n += 1
        return await self.inner.__anext__()

    def cancel(self) -> None:
        self.cancelled = True
        self.inner.cancel()


def _app(free: float = math.inf):
    """(app, ingress, paced synthesizer, fake timers) with a registered shared voice ``default``."""
    ingress = _ingress(IngressConfig(max_input_chars=1000, stream_idle_timeout_s=IDLE_S))
    timers = FakeTimers()
    ingress.progress = AudioProgress(IDLE_S, sleep=timers.sleep)
    paced = Paced(ingress.synth, free)
    ingress.synth = paced
    return ingress.__serve_build_asgi_app__(), ingress, paced, timers


async def _voice(ingress) -> None:
    await ingress.frontend._target.register_voice("default", "hi", np.full(16000, 0.1, np.float32), 16000)


def _run(coro_fn):
    async def guarded():
        return await asyncio.wait_for(coro_fn(), GUARD_S)

    return asyncio.run(guarded())


async def _stall(paced: Paced, timers: FakeTimers, at: int) -> None:
    """Let the stream reach item ``at`` (never released), then let the timeout run out."""
    await paced.blocked_at(at)
    await timers.armed()
    timers.advance(IDLE_S)


async def _pace(paced: Paced, timers: FakeTimers, done: asyncio.Future, gap_s: float) -> int:
    """Release each held item ``gap_s`` fake seconds after its wait started, until ``done``; the
    number of items paced. Each wait is timed (a timer runs) when the clock moves."""
    k, n = paced.free, 0
    while True:
        blocked = asyncio.ensure_future(paced.blocked_at(k))
        await asyncio.wait({blocked, done}, return_when=asyncio.FIRST_COMPLETED)
        if done.done():
            blocked.cancel()
            return n
        await timers.armed()
        timers.advance(gap_s)
        paced.release()
        k, n = k + 1, n + 1


# ------------------------------------------------------------------ the mechanism


class _Items:
    """An iterator whose items come when the test puts them (``None``: the end)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.asked = asyncio.Event()  # an item is being waited for
        self.cancelled = False

    async def __anext__(self):
        self.asked.set()
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self.cancelled = True


def test_a_wait_is_timed_from_its_start_and_only_once_owed():
    async def main():
        timers = FakeTimers()
        progress = AudioProgress(IDLE_S, sleep=timers.sleep)
        items = _Items()
        stream = progress.watch(items)
        for k in range(5):  # five gaps just under the limit: 4.5 limits in all, never cut
            nxt = asyncio.ensure_future(stream.__anext__())
            await timers.armed()
            timers.advance(0.9 * IDLE_S)
            items.queue.put_nowait(k)
            assert await nxt == k
        nxt = asyncio.ensure_future(stream.__anext__())
        await timers.armed()
        timers.advance(IDLE_S)
        with pytest.raises(NoAudioError, match="no audio for 60 s"):
            await nxt
        # owed: the clock does not count before the event (a bistream turn whose text is not complete)
        owed = asyncio.Event()
        items = _Items()
        nxt = asyncio.ensure_future(progress.next(items, owed))
        await items.asked.wait()  # the wait's timer task starts in the same loop turn as its step
        assert timers.pending() == 0
        timers.advance(100 * IDLE_S)
        owed.set()
        await timers.armed()
        timers.advance(0.9 * IDLE_S)
        items.queue.put_nowait("late")
        assert await nxt == "late"
        with pytest.raises(StopAsyncIteration):
            items.queue.put_nowait(None)
            await progress.next(items)
        assert timers.pending() == 0  # no timer outlives its wait

    _run(main)


# ------------------------------------------------------------------ HTTP


SPEECH = {"model": "tts-1", "input": TEXT, "voice": "default", "response_format": "pcm", "stream": True}
OPENAI_ROUTES = [("/v1/audio/speech", SPEECH), ("/v1/tts", {"text": TEXT, "mode": "voice", "voice_id": "default",
                                                            "response_format": "pcm", "stream": True})]
EL_ROUTES = [(EL + r, {"text": TEXT}) for r in ("", "/stream", "/with-timestamps", "/stream/with-timestamps")]
# Answered whole: the synthesizer makes one chunk a sentence piece (no chunked token2wav).
WHOLE_ROUTES = [(path, {**body, "stream": False}) for path, body in OPENAI_ROUTES]


def _ids(x):
    return x if isinstance(x, str) else ("whole" if x.get("stream") is False else "")


@pytest.mark.parametrize(("path", "body"), OPENAI_ROUTES + WHOLE_ROUTES + EL_ROUTES, ids=_ids)
def test_no_first_audio_is_a_504_in_the_route_familys_shape(path, body):
    app, ingress, paced, timers = _app(free=0)

    async def main():
        await _voice(ingress)
        async with client(app) as c:
            req = asyncio.ensure_future(c.post(path, json=body))
            await _stall(paced, timers, 0)
            r = await req
        assert r.status_code == 504 and r.headers["retry-after"], r.text
        if path.startswith(EL):
            detail = r.json()["detail"]
            assert set(detail) == {"status", "message", "request_id"} and detail["status"] == "audio_timeout"
        else:
            assert set(r.json()) == {"error", "request_id"} and r.json()["error"]["code"] == "audio_timeout"
        assert paced.streams[0].cancelled  # the synthesizer's sequence is aborted

    _run(main)
    assert ingress.metrics.in_flight._value.get() == 0


# Whole answers: no header has left before the last chunk, so a stall at any point is a 504.
EL_WHOLE_ROUTES = [(path, body) for path, body in EL_ROUTES if "/stream" not in path]


@pytest.mark.parametrize(("path", "body"), WHOLE_ROUTES + EL_WHOLE_ROUTES, ids=_ids)
def test_a_whole_answer_stalling_midway_is_a_504(path, body):
    """Two of six sentence pieces made, then none: the route family's 504, and the sequence aborted."""
    app, ingress, paced, timers = _app(free=2)
    body = {**body, "input" if "input" in body else "text": LONG}

    async def main():
        await _voice(ingress)
        async with client(app) as c:
            req = asyncio.ensure_future(c.post(path, json=body))
            await _stall(paced, timers, 2)
            r = await req
        assert r.status_code == 504 and r.headers["retry-after"], r.text
        if path.startswith(EL):
            assert r.json()["detail"]["status"] == "audio_timeout", r.text
        else:
            error = r.json()["error"]
            assert error["code"] == "audio_timeout" and "no audio for 60 s" in error["message"]
        assert paced.streams[0].cancelled

    _run(main)
    assert ingress.metrics.in_flight._value.get() == 0


@pytest.mark.parametrize("route", ["/stream", "/stream/with-timestamps"])
def test_an_elevenlabs_stream_stalling_after_its_headers_is_aborted(route):
    app, ingress, paced, timers = _app(free=1)

    async def main():
        await _voice(ingress)
        async with client(app) as c:
            req = asyncio.ensure_future(c.post(EL + route, json={"text": TEXT}))
            await _stall(paced, timers, 1)
            # Starlette cannot answer an error once the response has started: the body is cut
            # (through Serve's proxy the client sees an incomplete response).
            with pytest.raises(RuntimeError, match="response already started") as info:
                await req
            assert isinstance(info.value.__cause__, NoAudioError)
        assert paced.streams[0].cancelled

    _run(main)
    assert ingress.metrics.in_flight._value.get() == 0


@pytest.mark.parametrize(("path", "body"),
                         [("/v1/audio/speech", {**SPEECH, "stream_format": "sse"}), *WHOLE_ROUTES, *EL_ROUTES], ids=_ids)
def test_a_stream_that_keeps_delivering_audio_is_never_cut(path, body):
    """Every chunk comes 0.9 limits after the one before: many limits in all, every byte arrives
    (the same body as unpaced; a whole answer has one chunk a piece, six here)."""
    app, ingress, paced, timers = _app()
    body = {**body, "input" if "input" in body else "text": LONG}

    async def main():
        await _voice(ingress)
        async with client(app) as c:
            whole = await c.post(path, json=body)  # unpaced: the reference
            assert whole.status_code == 200
            paced.free = 1
            req = asyncio.ensure_future(c.post(path, json=body))
            n = await _pace(paced, timers, req, 0.9 * IDLE_S)
            r = await req
        assert r.status_code == 200 and n >= 6 and timers.now >= 5 * IDLE_S
        assert r.content == whole.content

    _run(main)


def test_the_handle_apis_stream_raises_no_audio_error():
    _, ingress, paced, timers = _app(free=1)

    async def main():
        await _voice(ingress)
        req = SynthesisRequest(request_id="h1", text=TEXT, voice_id="default", stream=True)
        got = []

        async def consume():
            async for chunk in ingress.stream(req):
                got.append(chunk)

        task = asyncio.ensure_future(consume())
        await _stall(paced, timers, 1)
        with pytest.raises(NoAudioError):
            await task
        assert len(got) == 1 and paced.streams[0].cancelled

    _run(main)


def test_the_handle_apis_synthesize_is_timed_like_a_stream():
    """A whole utterance paced 0.9 limits a piece is returned whole; one that stalls midway raises
    :class:`NoAudioError` and aborts its sequence."""
    _, ingress, paced, timers = _app()

    def req(rid):
        return SynthesisRequest(request_id=rid, text=LONG, voice_id="default")

    async def main():
        await _voice(ingress)
        unpaced = await ingress.synthesize(req("h0"))
        assert unpaced.num_chunks == 6  # a chunk a sentence piece
        paced.free = 1
        task = asyncio.ensure_future(ingress.synthesize(req("h1")))
        n = await _pace(paced, timers, task, 0.9 * IDLE_S)
        result = task.result()
        assert n == 6 and timers.now >= 5 * IDLE_S
        np.testing.assert_array_equal(result.samples, unpaced.samples)
        assert (result.num_chunks, result.sample_rate) == (6, unpaced.sample_rate)
        paced.free = 2
        task = asyncio.ensure_future(ingress.synthesize(req("h2")))
        await _stall(paced, timers, 2)
        with pytest.raises(NoAudioError, match="no audio for 60 s"):
            await task
        assert paced.streams[-1].cancelled

    _run(main)


# ------------------------------------------------------------------ WebSockets


class WsClient:
    """An ASGI WebSocket session with ``app`` on this event loop (Starlette's TestClient runs the
    app on a thread of its own, whose loop the fake clock could not drive in step)."""

    def __init__(self, app, url: str) -> None:
        parts = urlsplit(url)
        scope = {"type": "websocket", "asgi": {"version": "3.0"}, "scheme": "ws", "path": parts.path,
                 "raw_path": parts.path.encode(), "query_string": parts.query.encode(), "root_path": "",
                 "headers": [(b"host", b"t")], "client": ("127.0.0.1", 1), "server": ("t", 80), "subprotocols": []}
        self._in: asyncio.Queue = asyncio.Queue()
        self._out: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(app(scope, self._in.get, self._out.put))

    async def connect(self) -> None:
        self._in.put_nowait({"type": "websocket.connect"})
        assert (await self._out.get())["type"] == "websocket.accept"

    def send(self, obj: dict) -> None:
        self._in.put_nowait({"type": "websocket.receive", "text": json.dumps(obj)})

    async def receive(self) -> dict:
        """The next message; a close is ``{"close": code}``."""
        msg = await self._out.get()
        if msg["type"] == "websocket.close":
            return {"close": msg.get("code", 1000)}
        return json.loads(msg["text"])

    async def until(self, pred) -> list[dict]:
        got = []
        while not got or not pred(got[-1]):
            got.append(await self.receive())
        return got


STREAM_INPUT = EL + "/stream-input?output_format=pcm_24000"
MULTI = EL + "/multi-stream-input?output_format=pcm_24000"


def _samples(text: str) -> int:
    return len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN


def _ends(m: dict) -> bool:
    return "close" in m


@pytest.mark.parametrize("mode", ["sentence", "bistream"])
def test_a_stalled_websocket_stream_is_an_error_then_close_1011(mode):
    """Sentence mode: a segment's audio is owed at once. Bistream: a turn's once its text is complete
    (flush); its first item (the text-inbox ticket) comes, then its audio stalls."""
    app, ingress, paced, timers = _app(free=1)

    async def main():
        await _voice(ingress)
        ws = WsClient(app, f"{STREAM_INPUT}&mode={mode}")
        await ws.connect()
        ws.send({"text": " "})
        ws.send({"text": "Hello there. ", "flush": True})
        await _stall(paced, timers, 1)
        got = await ws.until(_ends)
        error, close = got[-2], got[-1]
        assert error["error"]["code"] == "audio_timeout" and error["error"]["type"] == "server_error"
        assert "no audio for 60 s" in error["error"]["message"] and close == {"close": 1011}
        await ws.task
        assert paced.streams[0].cancelled

    _run(main)
    assert ingress.metrics.in_flight._value.get() == 0


def test_a_bistream_turn_is_not_timed_while_its_text_is_incomplete():
    """The model may wait for the client's text (the client's inactivity timeout bounds that): a
    turn held for a hundred limits of fake time before its text ends is spoken whole, its chunks
    after the flush paced just under the limit."""
    app, ingress, paced, timers = _app(free=2)  # the ticket, the first audio; then each for a permit

    async def main():
        await _voice(ingress)
        ws = WsClient(app, STREAM_INPUT)
        await ws.connect()
        ws.send({"text": " "})
        ws.send({"text": "Hello there how are"})  # audio starts before the text ends (" are" held)
        await paced.blocked_at(2)  # the turn's wait for its next item has started
        # NOTE: the wait's timer task starts in the loop turn its step starts in, before this
        # coroutine resumes: a timer counting now would be pending here and fire below.
        assert timers.pending() == 0
        timers.advance(100 * IDLE_S)
        ws.send({"text": " you doing", "flush": True})
        ws.send({"text": ""})
        got = asyncio.ensure_future(ws.until(_ends))
        n = await _pace(paced, timers, got, 0.9 * IDLE_S)
        assert not any("error" in m for m in got.result()) and got.result()[-1] == {"close": 1000}, got.result()
        audio = b"".join(base64.b64decode(m["audio"]) for m in got.result() if m.get("audio"))
        assert len(audio) == 2 * _samples("Hello there how are you doing") and n >= 2

    _run(main)


def test_a_stalled_multi_stream_context_ends_with_its_error_and_the_others_go_on():
    app, ingress, paced, timers = _app(free=1)

    async def main():
        await _voice(ingress)
        ws = WsClient(app, MULTI)
        await ws.connect()
        ws.send({"text": "Hello there", "context_id": "a", "flush": True})
        await _stall(paced, timers, 1)
        error = await ws.receive()
        assert error["error"] == "audio_timeout" and error["code"] == 1011 and error["contextId"] == "a", error
        paced.free = math.inf  # the socket is still open: another context speaks
        ws.send({"text": "now b", "context_id": "b", "flush": True})
        ws.send({"context_id": "b", "close_context": True})
        got = await ws.until(lambda m: m.get("isFinal") is True)
        assert got[-1] == {"isFinal": True, "contextId": "b"} and all("error" not in m for m in got)
        ws.send({"close_socket": True})
        assert await ws.receive() == {"close": 1000}
        await ws.task

    _run(main)
