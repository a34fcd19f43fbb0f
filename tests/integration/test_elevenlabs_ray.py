"""ElevenLabs clients against the app on real local Ray, through Serve's proxy: the official
``elevenlabs`` SDK's own client code on the HTTP routes, and multi-stream-input over the
``websockets`` client with a barge-in that frees the context's decode slot. Runs in the session's
app (conftest ``tts_app``, fake runtimes: exact lengths); waits are on replica state."""
from __future__ import annotations

import base64
import json

import pytest
from websockets.sync.client import connect

from tests.deployments.fakes import GUARD_S
from tests.integration.conftest import fake_samples, register_default_voice
from tests.integration.test_openai_contract_ray import _engine, _wait_for

pytestmark = pytest.mark.ray
TEXT = "Hello there. How are you?"


def _samples(text: str) -> int:
    return fake_samples(text)


@pytest.fixture(scope="module")
def service(tts_app):
    url = tts_app["base_url"]
    register_default_voice(url)
    return {**tts_app, "ws_url": url.replace("http://", "ws://")}


def test_official_sdk_stream_and_timestamps_through_serve(service):
    elevenlabs = pytest.importorskip("elevenlabs")
    client = elevenlabs.ElevenLabs(api_key="sk-unused-0123456789abcdef", base_url=service["base_url"], timeout=60)
    tts = client.text_to_speech
    n = 2 * (_samples("Hello there.") + _samples("How are you?"))  # the fake frontend's two pieces
    assert len(b"".join(tts.stream("alloy", text=TEXT, output_format="pcm_24000"))) == n
    assert len(b"".join(tts.convert("alloy", text=TEXT, output_format="pcm_24000"))) == n
    chunks = list(tts.stream_with_timestamps("alloy", text=TEXT, output_format="pcm_24000"))
    assert sum(len(base64.b64decode(c.audio_base_64)) for c in chunks) == n
    assert "".join(ch for c in chunks if c.alignment for ch in c.alignment.characters) == TEXT
    with pytest.raises(elevenlabs.core.ApiError) as err:
        b"".join(tts.convert("nobody", text="Hi."))
    assert err.value.status_code == 404 and err.value.body["detail"]["status"] == "voice_not_found"


def test_multi_stream_barge_in_frees_the_slot_while_another_context_speaks(service):
    before = _engine(service)
    url = f"{service['ws_url']}/v1/text-to-speech/default/multi-stream-input?output_format=pcm_24000"
    with connect(url, open_timeout=30, close_timeout=10, additional_headers={"xi-api-key": "unused"}) as ws:
        ws.send(json.dumps({"text": "waiting for more text", "context_id": "a"}))
        first = json.loads(ws.recv(timeout=GUARD_S))
        assert first["contextId"] == "a" and first["audio"]
        assert _engine(service)["running"] == before["running"] + 1
        ws.send(json.dumps({"context_id": "a", "close_context": True}))
        # audio already sent on its way before the close was read may still arrive (a loaded
        # machine makes more of it): only context a's audio, then its final message
        while (m := json.loads(ws.recv(timeout=GUARD_S))) != {"isFinal": True, "contextId": "a"}:
            assert m["contextId"] == "a" and m["audio"] and not m["isFinal"], m
        _wait_for(lambda: _engine(service)["running"] == before["running"], "the decode slot is freed")
        assert _engine(service)["aborted"] == before["aborted"] + 1
        ws.send(json.dumps({"text": "now b speaks", "context_id": "b", "flush": True}))
        ws.send(json.dumps({"close_socket": True}))
        got = 0
        while (m := json.loads(ws.recv(timeout=GUARD_S))) != {"isFinal": True, "contextId": "b"}:
            got += len(base64.b64decode(m["audio"]))
    assert got == 2 * _samples("now b speaks")
