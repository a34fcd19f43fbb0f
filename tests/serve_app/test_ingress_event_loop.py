"""Nothing slow runs on the ingress's event loop (issue 16 item 6): /health answers from a cached
count of Serve's running replicas (the controller call runs in a worker thread), encoders run in
the encoder pool, large JSON bodies are parsed in a thread.

Each blocking call is replaced by one the test holds on a ``threading.Event`` and that records
whether it was called on an event loop's thread; a call made on the loop returns at once (and
fails the test) instead of waiting, so a regression fails fast rather than hanging.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx
from ray import serve
from starlette.testclient import TestClient

from serve_app import request_body, speech
from serve_app.ingress import IngressConfig
from serve_app.running_replicas import STATUS_MAX_AGE_S, RunningReplicas
from tests.deployments import fakes
from tests.serve_app.test_ingress_inproc import _ingress, _wav
from tests.serve_app.test_ingress_speech import _decode

GUARD_S = 120.0  # failure guard only: held calls are released by the test, never by this bound
# The ingress's own audio-progress timeout (60 s by default, real time) must not end a stream the
# test is holding: it once fired in CI on the held mp3 stream, likely a drawn seed in the fakes'
# hold range (tests/deployments/fakes.py, since moved above the drawn seeds)
CFG = {"max_input_chars": 1000, "stream_idle_timeout_s": 10 * GUARD_S}
TEXT = "Hello there."


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class HeldCall:
    """A stand-in for a blocking call: waits until the test releases it, unless it is called on
    an event loop's thread (recorded in ``on_loop``; it then returns at once)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.on_loop: list[str] = []

    def __call__(self, what: str) -> None:
        if _on_event_loop():
            self.on_loop.append(what)
            self.entered.set()
            return
        self.entered.set()
        assert self.release.wait(GUARD_S), "never released"


def _n_samples(text: str) -> int:
    return len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN


@contextlib.asynccontextmanager
async def _client_with_voice(app) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/voices", data={"voice_id": "v1", "prompt_text": "hi"},
                         files={"audio": ("a.wav", _wav(), "audio/wav")})
        assert r.status_code == 201
        yield c


def _speech(fmt: str, text: str = TEXT) -> dict:
    return {"model": "tts-1", "input": text, "voice": "v1", "response_format": fmt, "stream": True}


def test_health_answers_from_cache_while_the_serve_controller_call_is_held(monkeypatch):
    held = HeldCall()
    states = {"RUNNING": 1}
    status = SimpleNamespace(applications={
        "app": SimpleNamespace(deployments={"Synthesizer": SimpleNamespace(replica_states=states)})})

    def controller_status():
        held("serve.status")
        return status

    monkeypatch.setattr(serve, "status", controller_status)
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(app_name="app"))
    ingress = _ingress(IngressConfig(**CFG))
    app = ingress.__serve_build_asgi_app__()

    async def main():
        async with _client_with_voice(app) as c:
            r = await c.get("/health?detail=1")  # starts the background reader; answers without waiting for it
            assert r.status_code == 200 and r.json()["synthesizer_replicas"]["local"]["ready"]
            assert await asyncio.to_thread(held.entered.wait, GUARD_S)
            # The controller call is in progress and held: /health and a stream are still served.
            r = await c.get("/health?detail=1")
            body = r.json()
            assert r.status_code == 200 and body["synthesizer_running_replicas"] == 0  # not read yet
            assert body["probes_failed"] == 0 and "local" in body["synthesizer_replicas"]
            r = await c.post("/v1/audio/speech", json=_speech("pcm"))
            assert r.status_code == 200 and len(r.content) == 2 * _n_samples(TEXT)
            held.release.set()
            assert await ingress.health_monitor.running_synthesizers.refresh() == 1  # what the reader will find next
            assert (await c.get("/health?detail=1")).json()["synthesizer_running_replicas"] == 1
            # Readiness still rests on that count when probes fail (the busy-replica case).
            ingress.health_monitor.synth = SimpleNamespace(health=SimpleNamespace(remote=_failing_probe))
            r = await c.get("/health?detail=1")
            assert r.status_code == 200 and r.json()["probes_failed"] == 2

    asyncio.run(main())
    assert held.on_loop == []


async def _failing_probe():
    raise RuntimeError("replica queue full")


def _held_mp3(monkeypatch, held: HeldCall) -> None:
    """MP3 stream encoders whose every call goes through ``held`` (opening one included)."""
    real = speech.make_stream_encoder

    def make(fmt, *args, **kwargs):
        if fmt != "mp3":
            return real(fmt, *args, **kwargs)
        held("open")
        enc = real(fmt, *args, **kwargs)
        encode, finish = enc.encode, enc.finish

        def held_encode(samples):
            held("encode")
            return encode(samples)

        def held_finish():
            held("finish")
            return finish()

        enc.encode, enc.finish = held_encode, held_finish
        return enc

    monkeypatch.setattr(speech, "make_stream_encoder", make)


def test_a_held_encoder_does_not_stop_another_stream(monkeypatch):
    held = HeldCall()
    _held_mp3(monkeypatch, held)
    app = _ingress(IngressConfig(**CFG)).__serve_build_asgi_app__()

    async def main():
        async with _client_with_voice(app) as c:
            mp3 = asyncio.create_task(c.post("/v1/audio/speech", json=_speech("mp3")))
            assert await asyncio.to_thread(held.entered.wait, GUARD_S)  # its encoder is held
            other = await c.post("/v1/audio/speech", json=_speech("pcm", "Another stream."))
            assert other.status_code == 200 and len(other.content) == 2 * _n_samples("Another stream.")
            assert not mp3.done()
            held.release.set()
            r = await mp3
            again = await c.post("/v1/audio/speech", json=_speech("mp3"))  # nothing held this time
            return r, again

    r, again = asyncio.run(main())
    assert held.on_loop == []
    assert r.status_code == 200 and r.content == again.content  # same bytes, chunks in order
    y, rate = _decode(r.content)
    n = _n_samples(TEXT)
    assert rate == fakes.SAMPLE_RATE and n <= len(y) <= n + 3 * 1152


def test_sse_deltas_are_encoded_in_the_pool_too(monkeypatch):
    held = HeldCall()
    held.release.set()  # not held: only where each call runs is checked
    _held_mp3(monkeypatch, held)
    app = _ingress(IngressConfig(**CFG)).__serve_build_asgi_app__()

    async def main():
        async with _client_with_voice(app) as c:
            return await c.post("/v1/audio/speech", json={**_speech("mp3"), "stream_format": "sse"})

    r = asyncio.run(main())
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert len(_decode(audio)[0]) >= _n_samples(TEXT)
    assert held.entered.is_set() and held.on_loop == []


def test_websocket_stream_input_encodes_off_the_event_loop(monkeypatch):
    held = HeldCall()
    held.release.set()
    _held_mp3(monkeypatch, held)
    with TestClient(_ingress(IngressConfig(**CFG)).__serve_build_asgi_app__()) as client:
        r = client.post("/v1/voices", data={"voice_id": "default", "prompt_text": "hi"},
                        files={"audio": ("a.wav", _wav(), "audio/wav")})
        assert r.status_code == 201
        with client.websocket_connect("/v1/text-to-speech/default/stream-input?output_format=mp3_24000_64") as ws:
            ws.send_json({"text": " "})
            ws.send_json({"text": "One. Two."})
            ws.send_json({"text": ""})
            audio = b""
            while not (m := ws.receive_json()).get("isFinal"):
                assert "error" not in m
                audio += base64.b64decode(m["audio"]) if m.get("audio") else b""
    assert held.entered.is_set() and held.on_loop == []
    assert len(_decode(audio)[0]) >= _n_samples("One.") + _n_samples("Two.")


def test_a_large_json_body_is_parsed_off_the_event_loop(monkeypatch):
    where: list[bool] = []

    def loads(data):
        where.append(_on_event_loop())
        return json.loads(data)

    monkeypatch.setattr(request_body, "json", SimpleNamespace(loads=loads))
    app = _ingress(IngressConfig(**CFG)).__serve_build_asgi_app__()

    async def main():
        async with _client_with_voice(app) as c:
            small = await c.post("/v1/audio/speech", json=_speech("pcm"))
            padded = {**_speech("pcm"), "padding": "x" * 1_000_000}  # an ignored field
            large = await c.post("/v1/audio/speech", json=padded)
            return small, large

    small, large = asyncio.run(main())
    assert small.status_code == large.status_code == 200 and small.content == large.content
    assert where == [True, False]  # a small body inline (cheaper than a thread hop), a large one in a thread


def test_running_count_is_read_in_a_thread_and_expires_when_not_refreshed():
    clock = {"t": 0.0}
    count = {"n": 3}
    where: list[bool] = []

    def read(deployment: str) -> int:
        assert deployment == "Synthesizer"
        where.append(_on_event_loop())
        return count["n"]

    running = RunningReplicas("Synthesizer", read=read, clock=lambda: clock["t"])
    assert running.current() == 0  # no loop: nothing read, nothing started

    async def main():
        assert await running.refresh() == 3
        count["n"] = 5
        assert running.current() == 3  # the last count read; the reader is only started (no await yet)
        clock["t"] = STATUS_MAX_AGE_S + 1
        assert running.current() == 0  # too old to trust
        assert await running.refresh() == 5 and running.current() == 5

    asyncio.run(main())
    assert where and not any(where)


def test_a_failing_status_read_counts_as_unavailable(caplog):
    def read(deployment: str) -> int:
        raise ConnectionError("controller gone")

    running = RunningReplicas("Synthesizer", read=read)

    async def main():
        with caplog.at_level(logging.WARNING):
            assert await running.refresh() == 0
        assert running.current() == 0

    asyncio.run(main())
    assert "running replicas of Synthesizer unavailable" in caplog.text


def test_background_reader_keeps_the_count_fresh():
    reads = []
    second = threading.Event()

    def read(deployment: str) -> int:
        reads.append(deployment)
        if len(reads) == 2:
            second.set()
        return len(reads)

    running = RunningReplicas("Synthesizer", read=read, period_s=0.0)

    async def main():
        running.start()
        assert await asyncio.to_thread(second.wait, GUARD_S)  # two reads without anyone asking
        assert running.current() >= 1

    asyncio.run(main())
