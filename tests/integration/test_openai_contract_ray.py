"""OpenAI clients and WebSocket text-in streaming against the app on real local Ray.

The official ``openai`` SDK streams out of the box (no extension field): first audio while the
request still decodes, every format decodes back, SSE events parse, errors come in OpenAI's
shape. The ``websockets`` client speaks ElevenLabs' stream-input shapes through Serve's proxy;
closing the socket (or the HTTP stream) mid-synthesis frees the decode slot. Waits are on replica
state read over RPC, never on wall-clock bounds. Runs in the session's app (conftest ``tts_app``,
fake runtimes: exact lengths).
"""
from __future__ import annotations

import base64
import io
import json
import time

import av
import numpy as np
import openai
import pytest
from websockets.sync.client import connect

from tests.deployments import fakes
from tests.deployments.fakes import GUARD_S, HOLD_SEED
from tests.integration.conftest import fake_samples, register_default_voice

pytestmark = pytest.mark.ray

SR = fakes.SAMPLE_RATE


def _samples(text: str) -> int:
    return fake_samples(text)


@pytest.fixture(scope="module")
def service(tts_app):
    """The app with a voice 'default' (what OpenAI's built-in names alias to) and an SDK client."""
    url = tts_app["base_url"]
    register_default_voice(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    return {**tts_app, "client": client, "ws_url": url.replace("http://", "ws://")}


def _engine(service) -> dict:
    return service["synth"].stats.remote().result(timeout_s=30)["engine"]


def _wait_for(predicate, what: str) -> None:
    """Poll replica state until ``predicate`` holds; fail after GUARD_S (a guard, not a bound)."""
    deadline = time.monotonic() + GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.05)  # spacing between polls, not a synchronisation


def _decode(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.audio[0]
        return np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(s)]), s.rate


# ------------------------------------------------------------------------------ HTTP, openai SDK
def test_sdk_gets_first_audio_while_the_request_still_decodes(service):
    text = "A long answer, sentence after sentence. " * 12  # ~4 s of fake decoding
    total = 2 * _samples(text)
    received = []
    with service["client"].audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=text, response_format="pcm") as response:
        chunks = response.iter_bytes()
        received.append(next(chunks))
        during = _engine(service)  # the first bytes are here: the sequence still holds its slot
        received.extend(chunks)
    assert during["running"] == 1, during
    got = sum(map(len, received))
    assert 0.95 * total < got <= total  # (the fake frontend drops the spaces between its pieces)
    assert 0 < len(received[0]) < got // 4


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav"])
def test_sdk_streamed_formats_decode_back(service, fmt):
    text = "Every format streams."
    with service["client"].audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice={"id": "default"}, input=text, response_format=fmt) as response:
        assert response.headers.get("transfer-encoding") == "chunked"
        data = b"".join(response.iter_bytes())
    y, sr = _decode(data)
    expected = _samples(text) * sr // SR
    assert expected - sr // 100 <= len(y) <= expected + sr // 10


def test_sdk_sse_events(service):
    text = "Server-sent events, please."
    with service["client"].audio.speech.with_streaming_response.create(
            model="tts-1", voice="nova", input=text, response_format="pcm", stream_format="sse") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    types = [e["type"] for e in events]
    assert types[-1] == "speech.audio.done" and set(types[:-1]) == {"speech.audio.delta"} and len(types) > 2
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == 2 * _samples(text)
    usage = events[-1]["usage"]
    assert usage["input_tokens"] == len(text.encode()) and usage["total_tokens"] == sum(
        usage[k] for k in ("input_tokens", "output_tokens"))


def test_sdk_buffered_speed_and_extra_fields(service):
    text = "Quick."
    audio = service["client"].audio.speech.create(model="tts-1-hd", voice="default", input=text,
                                                  response_format="pcm", speed=4.0,
                                                  extra_body={"stream": False, "colour": "red"})
    assert abs(len(audio.content) // 2 - _samples(text) / 4) < 0.05 * _samples(text) / 4 + 2048


def test_sdk_sees_openai_error_shape(service):
    with pytest.raises(openai.BadRequestError) as info:
        service["client"].audio.speech.create(model="whisper-1", voice="alloy", input="x")
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.NotFoundError) as info:
        service["client"].audio.speech.create(model="tts-1", voice="nobody", input="x")
    assert info.value.code == "voice_not_found" and info.value.type == "not_found_error"


def test_sdk_disconnect_mid_stream_frees_the_decode_slot(service):
    before = _engine(service)
    with service["client"].audio.speech.with_streaming_response.create(
            model="tts-1", voice="default", input="Held until the client goes.", response_format="mp3",
            extra_body={"seed": HOLD_SEED}) as response:
        chunks = response.iter_bytes()
        next(chunks)
        assert _engine(service)["running"] == before["running"] + 1
    # Leaving the block closes the connection; the sequence would otherwise hold its slot forever.
    _wait_for(lambda: _engine(service)["running"] == before["running"], "the decode slot is freed")
    assert _engine(service)["aborted"] == before["aborted"] + 1


# ------------------------------------------------------------------------------ WebSocket
def _ws(service, voice: str = "default", fmt: str = "pcm_24000"):
    """Sentence-wise mode (these tests count its segments); bistream through Ray: test_tiny_model_ray.py."""
    return connect(f"{service['ws_url']}/v1/text-to-speech/{voice}/stream-input?output_format={fmt}&mode=sentence",
                   open_timeout=30, close_timeout=10)


def test_websocket_audio_starts_before_the_text_ends(service):
    with _ws(service) as ws:
        ws.send(json.dumps({"text": " ", "voice_settings": {"speed": 1.0}}))
        ws.send(json.dumps({"text": "First sentence is complete. Second"}))
        first = json.loads(ws.recv(timeout=GUARD_S))  # audio of sentence one while sentence two is open
        assert first["isFinal"] is False and first["audio"]
        ws.send(json.dumps({"text": " one ends here."}))
        ws.send(json.dumps({"text": ""}))
        messages = [first]
        while not messages[-1].get("isFinal"):
            messages.append(json.loads(ws.recv(timeout=GUARD_S)))
    pcm = b"".join(base64.b64decode(m["audio"]) for m in messages[:-1])
    assert len(pcm) // 2 == _samples("First sentence is complete.") + _samples("Second one ends here.")
    assert messages[-1] == {"isFinal": True, "audioSeconds": round(len(pcm) / 2 / SR, 3)}


def test_websocket_close_mid_synthesis_frees_the_decode_slot(service):
    before = _engine(service)
    with _ws(service, fmt="mp3_44100_128") as ws:
        ws.send(json.dumps({"text": " "}))
        ws.send(json.dumps({"text": ("y" * 200 + ". ") * 5, "flush": True}))  # 5 segments, ~8 s of fake decoding
        assert json.loads(ws.recv(timeout=GUARD_S))["audio"]
        assert _engine(service)["running"] == before["running"] + 1
    _wait_for(lambda: _engine(service)["running"] == before["running"], "the decode slot is freed")
    assert _engine(service)["aborted"] == before["aborted"] + 1
