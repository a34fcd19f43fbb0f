"""ElevenLabs' multi-stream-input WebSocket (serve_app/multi_stream.py) in process: contexts side
by side on one socket, flush, close_context as barge-in (its sequence aborted, its decode slot
freed), keep-alives, close_socket, limits, per-context errors, xi-api-key auth."""
from __future__ import annotations

import base64
import json
import threading

import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from deployments import constants
from serve_app import multi_stream
from serve_app.ingress import IngressConfig
from tests.deployments import fakes
from tests.serve_app.test_ingress_inproc import _ingress, _wav

KEY = "sk-synth-0123456789abcdef"
PATH = "/v1/text-to-speech/{voice}/multi-stream-input?output_format=pcm_24000"


def _samples(text: str) -> int:
    return len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN


@pytest.fixture
def ingress(monkeypatch):
    monkeypatch.setenv(constants.ENV_API_KEYS, f"{KEY}:synthesis+voices")
    return _ingress(IngressConfig(max_input_chars=1000, max_ongoing_requests=2, max_queued_requests=4))


@pytest.fixture
def client(ingress):
    with TestClient(ingress.__serve_build_asgi_app__(), headers={"xi-api-key": KEY}) as c:
        r = c.post("/v1/voices", data={"voice_id": "default", "prompt_text": "hi"},
                   files={"audio": ("a.wav", _wav(), "audio/wav")})
        assert r.status_code == 201
        yield c


def _engine(ingress):
    return ingress.synth._target.runtime.engine


def _until_final(ws, audio: dict[str, int], context: str) -> list[dict]:
    """Messages up to the isFinal of ``context``; audio bytes counted per context."""
    seen = []
    while True:
        m = ws.receive_json()
        seen.append(m)
        assert "error" not in m, m
        if m.get("audio"):
            assert m["isFinal"] is False and set(m) == {"audio", "isFinal", "alignment", "normalizedAlignment",
                                                        "contextId"}
            audio[m["contextId"]] = audio.get(m["contextId"], 0) + len(base64.b64decode(m["audio"]))
        if m.get("isFinal") and m.get("contextId") == context:
            assert set(m) == {"isFinal", "contextId"}
            return seen


def test_two_contexts_on_one_socket_each_with_its_own_audio(client):
    audio: dict[str, int] = {}
    with client.websocket_connect(PATH.format(voice="alloy")) as ws:
        ws.send_json({"text": " ", "context_id": "a", "voice_settings": {"stability": 0.5}})
        ws.send_json({"text": " ", "context_id": "b"})
        ws.send_json({"text": "Hello from a", "context_id": "a"})
        ws.send_json({"text": "Bonjour de b", "context_id": "b", "flush": True})
        ws.send_json({"text": " again", "context_id": "a"})
        ws.send_json({"context_id": "a", "flush": True})  # LiveKit's and Pipecat's flush: no text
        ws.send_json({"context_id": "b", "close_context": True})
        _until_final(ws, audio, "b")
        ws.send_json({"context_id": "a", "close_context": True})
        _until_final(ws, audio, "a")
        ws.send_json({"close_socket": True})
        assert ws.receive()["code"] == 1000
    assert audio == {"a": 2 * _samples("Hello from a again"), "b": 2 * _samples("Bonjour de b")}


def test_close_context_mid_utterance_aborts_its_sequence_and_frees_the_slot(client, ingress):
    """Barge-in: context a has spoken part of its text and waits for more (nothing flushed);
    closing it cancels its synthesis at once, while context b goes on."""
    engine = _engine(ingress)
    audio: dict[str, int] = {}
    with client.websocket_connect(PATH.format(voice="default")) as ws:
        ws.send_json({"text": "waiting for more text", "context_id": "a"})
        first = ws.receive_json()
        assert first["contextId"] == "a" and first["audio"]
        assert engine.num_running() == 1  # a's sequence holds a decode slot, parked for text
        ws.send_json({"context_id": "a", "close_context": True})
        assert ws.receive_json() == {"isFinal": True, "contextId": "a"}
        assert engine.wait_until(lambda: any(rid.endswith("-c0-0/0") for rid in engine.aborted))
        assert engine.wait_until(lambda: engine.num_running() == 0)  # its slot is free
        ws.send_json({"text": "now b speaks", "context_id": "b", "flush": True})
        ws.send_json({"context_id": "b", "close_context": True})
        _until_final(ws, audio, "b")
    assert audio == {"b": 2 * _samples("now b speaks")}
    assert not any("-c1-" in rid for rid in engine.aborted)


def test_close_after_flush_speaks_the_flushed_text_and_drops_the_rest(client, ingress, monkeypatch):
    engine = _engine(ingress)
    gate = threading.Event()  # engine steps wait for it: the flushed turn cannot end before the close
    step = engine.step

    def gated_step():
        gate.wait(fakes.GUARD_S)
        return step()

    monkeypatch.setattr(engine, "step", gated_step)
    audio: dict[str, int] = {}
    with client.websocket_connect(PATH.format(voice="default")) as ws:
        ws.send_json({"text": "abcdefg ", "context_id": "a", "flush": True})
        ws.send_json({"text": "never spoken", "context_id": "a"})
        ws.send_json({"context_id": "a", "close_context": True})
        ws.send_json({"text": "", "context_id": "a"})  # a keep-alive: the closing context is no longer open
        gate.set()
        _until_final(ws, audio, "a")
    assert audio == {"a": 2 * _samples("abcdefg ")}  # the text up to the flush, its trailing space included


def test_keep_alives_limits_and_close_socket(client, monkeypatch):
    monkeypatch.setattr(multi_stream, "MAX_CONTEXTS", 2)
    audio: dict[str, int] = {}
    with client.websocket_connect(PATH.format(voice="default") + "&inactivity_timeout=300") as ws:
        ws.send_json({"text": ""})  # keep-alives open no context
        ws.send_json({"text": "", "context_id": "x"})
        ws.send_json({"text": " ", "context_id": "a"})
        ws.send_json({"text": " "})  # no context_id: the default context
        ws.send_json({"text": " ", "context_id": "c"})
        err = ws.receive_json()
        assert err["error"] == "max_active_conversations" and err["contextId"] == "c" and err["code"] == 1008
        ws.send_json({"text": "bye now", "context_id": "a", "flush": True})
        ws.send_json({"close_socket": True})
        seen = _until_final(ws, audio, "a")
        assert {"isFinal": True, "contextId": "default"} in seen  # nothing flushed: ended at once
        assert ws.receive()["code"] == 1000  # once every context has ended
    assert audio == {"a": 2 * _samples("bye now")}


def test_a_failed_context_is_reported_with_its_id_and_bad_messages_close(client):
    with client.websocket_connect(PATH.format(voice="nobody")) as ws:
        ws.send_json({"text": "hello there ", "context_id": "a", "flush": True})
        err = ws.receive_json()
        assert err["contextId"] == "a" and err["error"] == "voice_not_found"
        assert set(err) == {"error", "message", "code", "request_id", "contextId"}
        ws.send_json({"text": 5, "context_id": "b"})
        err = ws.receive_json()
        assert err["error"] == "invalid_input" and "contextId" not in err
        assert ws.receive()["code"] == 1008


def test_needs_a_key_with_the_synthesis_scope(ingress):
    with TestClient(ingress.__serve_build_asgi_app__()) as c:
        with pytest.raises(WebSocketDisconnect) as exc, c.websocket_connect(PATH.format(voice="default")):
            pass
        assert exc.value.code == 1008
        with c.websocket_connect(PATH.format(voice="default"), headers={"xi-api-key": KEY}) as ws:
            ws.send_json({"close_socket": True})
            assert ws.receive()["code"] == 1000


def test_alignment_with_each_audio_message_covers_each_context_text(client):
    """Characters in order, each once, per context; each message's spans lie within its own audio
    (times from the message's start, as ElevenLabs' WebSocket sends them)."""
    chars: dict[str, str] = {"a": "", "b": ""}
    with client.websocket_connect(PATH.format(voice="default")) as ws:
        ws.send_json({"text": "The first context speaks", "context_id": "a"})
        ws.send_json({"text": "and the second one too", "context_id": "b", "flush": True})
        ws.send_json({"text": " slowly.", "context_id": "a", "flush": True})
        ws.send_json({"close_socket": True})
        while (m := ws.receive())["type"] == "websocket.send":
            msg = json.loads(m["text"])
            if not msg.get("audio"):
                continue
            a = msg["alignment"]
            assert a == msg["normalizedAlignment"]  # bistream text is read as sent
            if a is None:
                continue
            audio_ms = len(base64.b64decode(msg["audio"])) / 2 / 24
            starts, durations = a["charStartTimesMs"], a["charDurationsMs"]
            assert len(a["chars"]) == len(starts) == len(durations) and starts == sorted(starts)
            assert all(d >= 0 for d in durations) and starts[-1] + durations[-1] <= round(audio_ms) + 1
            chars[msg["contextId"]] += "".join(a["chars"])
        assert m["code"] == 1000
    assert chars == {"a": "The first context speaks slowly.", "b": "and the second one too"}


def test_the_inactivity_timeout_is_refused_past_its_cap_on_stream_input_and_cut_to_it_on_multi_stream():
    from deployments.protocol import InvalidInputError
    from serve_app.stream_input import DEFAULT_INACTIVITY_S, MAX_INACTIVITY_S, inactivity_timeout

    assert inactivity_timeout(None) == DEFAULT_INACTIVITY_S
    assert inactivity_timeout("300", clamp=True) == MAX_INACTIVITY_S  # LiveKit's ask
    for bad, clamp in (("300", False), ("0", True), ("-1", False), ("soon", True)):
        with pytest.raises(InvalidInputError, match="inactivity_timeout"):
            inactivity_timeout(bad, clamp)
