"""WebSocket text-in streaming (ElevenLabs stream-input shapes), in process through Starlette's
TestClient: message shapes, bistream (the default) and sentence-wise start, flush, output formats,
errors, admission. Through real Ray with the ``websockets`` client:
tests/integration/test_openai_contract_ray.py, and bistream on the tiny model in
tests/integration/test_tiny_model_ray.py."""
from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
from starlette.testclient import TestClient

from deployments.protocol import InvalidInputError
from serve_app import stream_input
from serve_app.ingress import IngressConfig
from serve_app.stream_input import SentenceBuffer, WordCutter, parse_output_format
from tests.deployments import fakes
from tests.serve_app.test_ingress_inproc import _ingress, _wav

SR = fakes.SAMPLE_RATE
PATH = "/v1/text-to-speech/{voice}/stream-input"


def _samples(text: str) -> int:
    return len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN


@pytest.fixture
def ingress():
    return _ingress(IngressConfig(max_input_chars=1000, max_ongoing_requests=2, max_queued_requests=4))


@pytest.fixture
def client(ingress):
    with TestClient(ingress.__serve_build_asgi_app__()) as c:
        r = c.post("/v1/voices", data={"voice_id": "default", "prompt_text": "hi"},
                   files={"audio": ("a.wav", _wav(), "audio/wav")})
        assert r.status_code == 201
        yield c


def _emitted(ingress) -> dict[str, int]:
    """Speech tokens per LLM sequence of the fake engine, by request id suffix (turn/piece)."""
    engine = ingress.synth._target.runtime.engine
    return {rid.split("-")[-1]: n for rid, n in engine.progress.items()}


def _collect(ws) -> tuple[list[dict], bytes]:
    messages = []
    while True:
        m = ws.receive_json()
        messages.append(m)
        if m.get("isFinal") or "error" in m:
            return messages, b"".join(base64.b64decode(x["audio"]) for x in messages if x.get("audio"))


def _served(ingress) -> tuple[float, float]:
    """tts_served_audio_seconds: (observations, their sum); one per synthesis call."""
    reg = ingress.metrics.registry
    return (reg.get_sample_value("tts_served_audio_seconds_count"),
            pytest.approx(reg.get_sample_value("tts_served_audio_seconds_sum")))


def test_sentences_are_spoken_as_they_complete_then_final(client, ingress):
    with client.websocket_connect(PATH.format(voice="alloy") + "?output_format=pcm_24000&mode=sentence") as ws:
        ws.send_json({"text": " ", "voice_settings": {"stability": 0.5}, "generation_config": {}})
        ws.send_json({"text": "Hello there. How"})  # one complete sentence: synthesis starts now
        first = ws.receive_json()
        assert set(first) == {"audio", "isFinal", "normalizedAlignment", "alignment"} and first["isFinal"] is False
        ws.send_json({"text": " are you"})
        ws.send_json({"text": "? Fine"})
        ws.send_json({"text": ""})
        messages, audio = _collect(ws)
    pcm = base64.b64decode(first["audio"]) + audio
    # "Hello there." + "How are you?" + "Fine" (the rest at the end), each its own synthesis
    parts = [_samples("Hello there."), _samples("How are you?"), _samples("Fine")]
    assert len(pcm) // 2 == sum(parts)
    assert messages[-1] == {"isFinal": True, "audioSeconds": round(sum(parts) / SR, 3)}  # what was sent
    assert _served(ingress) == (3, sum(parts) / SR)  # per synthesis call, in /metrics


def test_flush_forces_out_the_buffer_and_pcm_16000(client):
    with client.websocket_connect(PATH.format(voice="default") + "?output_format=pcm_16000&mode=sentence") as ws:
        ws.send_json({"text": " "})
        ws.send_json({"text": "no sentence end here", "flush": True})
        first = ws.receive_json()  # audio before the end of the text: the flush sent it to synthesis
        assert first["audio"] and first["isFinal"] is False
        ws.send_json({"text": ""})
        _, audio = _collect(ws)
    n = (len(base64.b64decode(first["audio"])) + len(audio)) // 2
    assert abs(n - _samples("no sentence end here") * 16000 // SR) < 200


def test_mp3_output_is_one_stream(client):
    with client.websocket_connect(PATH.format(voice="default") + "?output_format=mp3_44100_128&mode=sentence") as ws:
        ws.send_json({"text": " "})
        ws.send_json({"text": "One. Two. Three."})
        ws.send_json({"text": ""})
        _, audio = _collect(ws)
    with av.open(io.BytesIO(audio)) as c:
        y = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
        rate = c.streams.audio[0].rate
    expected = sum(_samples(s) for s in ("One.", "Two.", "Three.")) * 44100 // SR
    assert rate == 44100 and expected <= len(y) <= expected + 3 * 1152


@pytest.mark.parametrize("query, first, code", [
    ("?output_format=wav_123", {"text": " "}, "invalid_input"),
    ("?inactivity_timeout=999", {"text": " "}, "invalid_input"),
    ("?mode=words", {"text": " "}, "invalid_input"),
    ("", {"nope": 1}, "invalid_input"),
    ("", {"text": " ", "voice_settings": {"speed": 9}}, "invalid_input"),
])
def test_bad_input_is_an_error_message_then_close_1008(client, query, first, code):
    with client.websocket_connect(PATH.format(voice="default") + query) as ws:
        ws.send_json(first)
        ws.send_json({"text": "Hi."})
        body = ws.receive_json()
        assert body["error"]["code"] == code and set(body["error"]) == {"message", "type", "param", "code"}
        assert ws.receive()["code"] == 1008


def test_unknown_voice_is_404_shape(client):
    with client.websocket_connect(PATH.format(voice="nobody") + "?output_format=pcm_24000") as ws:
        ws.send_json({"text": " "})
        ws.send_json({"text": "Hi there. "})
        ws.send_json({"text": ""})
        messages, _ = _collect(ws)
    assert messages[-1]["error"]["code"] == "voice_not_found"


def test_sessions_take_admission_turns(client):
    with client.websocket_connect(PATH.format(voice="default")) as a, \
            client.websocket_connect(PATH.format(voice="default")) as b:
        for ws in (a, b):  # two sessions hold both turns (max_ongoing_requests=2); sessions never queue
            ws.send_json({"text": " "})
        with client.websocket_connect(PATH.format(voice="default")) as c:
            body = c.receive_json()
            assert body["error"]["code"] == "queue_full"
            assert c.receive()["code"] == 1013


def test_bistream_speaks_before_the_text_ends_and_all_of_it(client, ingress):
    """Text is tokenised as it is (the fake: utf-8 bytes, spaces included), not normalised, up to
    the last whitespace, and read by ONE sequence while it speaks: audio before any sentence end."""
    fragments = ["Hello", " there", " how are", " you", " doing"]
    with client.websocket_connect(PATH.format(voice="default") + "?output_format=pcm_24000") as ws:
        ws.send_json({"text": " ", "voice_settings": {"stability": 0.5}})
        for f in fragments[:3]:  # "Hello there how" is sent (" are" held): 15 ids -> 30 tokens, a hop of 12
            ws.send_json({"text": f})
        first = ws.receive_json()
        assert set(first) == {"audio", "isFinal", "normalizedAlignment", "alignment"} and first["isFinal"] is False
        for f in fragments[3:]:
            ws.send_json({"text": f})
        ws.send_json({"text": ""})
        messages, audio = _collect(ws)
    pcm = base64.b64decode(first["audio"]) + audio
    assert len(pcm) // 2 == _samples("".join(fragments))
    assert messages[-1] == {"isFinal": True, "audioSeconds": round(len(pcm) / 2 / SR, 3)}
    assert _served(ingress) == (1, len(pcm) / 2 / SR)  # the one turn
    assert _emitted(ingress) == {"0/0": 2 * len("".join(fragments))}  # one sequence for the session
    # alignment: every character once, in order, within each message's own audio (test_multi_stream.py)
    aligned = [m["alignment"] for m in [first, *messages] if m.get("alignment")]
    assert "".join(c for a in aligned for c in a["chars"]) == "".join(fragments)


def test_bistream_flush_ends_the_turn_and_later_text_starts_another(client, ingress):
    with client.websocket_connect(PATH.format(voice="default") + "?output_format=pcm_24000") as ws:
        ws.send_json({"text": " "})
        ws.send_json({"text": "abcdefg", "flush": True})  # 14 tokens: a hop of 12, then the final 2
        got = 0
        while got < 2 * _samples("abcdefg"):  # the whole turn is spoken before the session ends
            got += len(base64.b64decode(ws.receive_json()["audio"]))
        assert got == 2 * _samples("abcdefg")
        ws.send_json({"text": "xyz"})
        ws.send_json({"text": ""})
        _, audio = _collect(ws)
    assert len(audio) // 2 == _samples("xyz")
    assert _emitted(ingress) == {"0/0": 14, "1/0": 6}


def test_bistream_turn_ends_at_a_sentence_end_past_the_soft_bound(client, ingress, monkeypatch):
    monkeypatch.setattr(stream_input, "TURN_SOFT_IDS", 8)
    with client.websocket_connect(PATH.format(voice="default") + "?output_format=pcm_24000") as ws:
        ws.send_json({"text": " "})
        for f in ["Hi.", " Again", " now.", " Last"]:  # 3 ids, 9 (no sentence end), 14 at one: the turn ends
            ws.send_json({"text": f})
        ws.send_json({"text": ""})
        _, audio = _collect(ws)
    assert _emitted(ingress) == {"0/0": 2 * 14, "1/0": 2 * 4}  # a turn starts at text: "Last"
    assert len(audio) // 2 == _samples("Hi. Again now.") + _samples("Last")


def test_bistream_close_mid_text_aborts_the_sequence(client, ingress):
    engine = ingress.synth._target.runtime.engine
    with client.websocket_connect(PATH.format(voice="default") + "?output_format=pcm_24000") as ws:
        ws.send_json({"text": " "})
        ws.send_json({"text": "waiting for more text"})
        assert ws.receive_json()["audio"]
    # the socket closed with the sequence parked, waiting for text: its decode slot is freed
    assert engine.wait_until(lambda: any(rid.endswith("-0/0") for rid in engine.aborted))
    assert engine.wait_until(lambda: engine.num_running() == 0)


def test_word_cutter():
    cut = WordCutter()
    assert cut.feed("Hel") == "" and cut.feed("lo wo") == "Hello" and cut.feed("rld, and") == " world,"
    assert cut.feed(" ") == " and" and cut.feed("x") == "" and cut.flush() == " x" and cut.flush() == ""
    assert cut.feed("你好世界") == "" and cut.feed("你好世界你") == "你好世界你好世界你"  # no whitespace: runs of > 8


def test_sentence_buffer():
    buf = SentenceBuffer(max_chars=20)
    assert buf.feed("Pi is 3.14 and") == []  # no end: "3.14" is not a sentence end
    assert buf.feed(" more. He said \"yes.\" Then") == ["Pi is 3.14 and more.", "He said \"yes.\""]
    assert buf.feed(" a very long run without any end at all") == ["Then a very long", "run without any end"]
    assert buf.flush() == ["at all"] and buf.flush() == []
    assert SentenceBuffer().feed("你好。世界") == ["你好。"]


def test_output_formats():
    assert parse_output_format("pcm_24000").rate == 24000
    assert parse_output_format("mp3_44100_128") == parse_output_format("mp3_44100_128")
    assert parse_output_format("mp3_44100_128").bit_rate == 128_000
    assert parse_output_format("ulaw_8000").fmt == "ulaw"  # the ElevenLabs names (serve_app/elevenlabs.py)
    for bad in ("pcm_12345", "mp3_44100", "opus_16000_64", "ulaw_16000"):
        with pytest.raises(InvalidInputError, match="not supported"):
            parse_output_format(bad)
