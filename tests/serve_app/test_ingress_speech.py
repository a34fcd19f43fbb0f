"""The OpenAI /v1/audio/speech contract, in process (real TextFrontend/Synthesizer objects with
fake runtimes behind in-process handles): streaming by default, ``stream: false`` buffered,
every format, SSE, speed 0.25-4.0, voice forms and aliases, models, unknown fields, errors.
The same paths through real Ray and the openai SDK: tests/integration/test_openai_contract_ray.py.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import wave

import av
import httpx
import numpy as np
import pytest

from serve_app.ingress import IngressConfig
from tests.deployments import fakes
from tests.serve_app.test_ingress_inproc import _app, _wav

SR = fakes.SAMPLE_RATE
TEXT = "Hello there."  # 12 text ids in the fake frontend


def _samples(text: str, speed: float = 1.0) -> int:
    return int(len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN / speed)


def _decode(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.audio[0]
        y = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(s)])
        return y.astype(np.float32) / (32768.0 if y.dtype == np.int16 else 1.0), s.rate


def _run(calls, cfg: IngressConfig | None = None):
    """Register voice 'default', then run ``calls(client)`` against a fresh in-process app."""
    async def main():
        transport = httpx.ASGITransport(app=_app(cfg or IngressConfig(max_input_chars=1000)))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/voices", data={"voice_id": "default", "prompt_text": "hi"},
                             files={"audio": ("a.wav", _wav(), "audio/wav")})
            assert r.status_code == 201
            return await calls(c)

    return asyncio.run(main())


def _speech(**fields) -> dict:
    return {"model": "tts-1", "input": TEXT, "voice": "default", **fields}


def test_default_is_a_chunked_stream_and_stream_false_is_buffered():
    async def calls(c):
        streamed = await c.post("/v1/audio/speech", json=_speech(response_format="wav"))
        buffered = await c.post("/v1/audio/speech", json=_speech(response_format="wav", stream=False))
        return streamed, buffered

    streamed, buffered = _run(calls)
    assert streamed.status_code == buffered.status_code == 200
    assert "content-length" not in streamed.headers  # chunked transfer
    assert streamed.content[40:44] == b"\xff\xff\xff\xff"  # streaming WAV header: size unknown
    assert (len(streamed.content) - 44) // 2 == _samples(TEXT)
    assert int(buffered.headers["content-length"]) == len(buffered.content)
    with wave.open(io.BytesIO(buffered.content)) as w:
        assert w.getnframes() == _samples(TEXT)
    # the served length, per request: a whole file's in a header (a stream's has no trailer)
    assert float(buffered.headers["x-audio-seconds"]) == pytest.approx(_samples(TEXT) / SR, abs=1e-3)
    assert "x-audio-seconds" not in streamed.headers


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format_streams_as_a_file_that_decodes_back(fmt):
    async def calls(c):
        return await c.post("/v1/audio/speech", json=_speech(response_format=fmt))

    r = _run(calls)
    assert r.status_code == 200, r.text
    if fmt == "pcm":
        y, sr = np.frombuffer(r.content, "<i2"), SR
    else:
        y, sr = _decode(r.content)
    expected = _samples(TEXT) * sr // SR
    assert expected - sr // 100 <= len(y) <= expected + sr // 10, (len(y), expected)
    assert r.headers["content-type"].startswith(
        {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
         "pcm": "audio/pcm"}[fmt])


def _sse_events(text: str) -> list[dict]:
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks)
    return [json.loads(b[len("data: "):]) for b in blocks]


def test_sse_deltas_then_done_with_usage():
    async def calls(c):
        return await c.post("/v1/audio/speech", json=_speech(response_format="pcm", stream_format="sse"))

    r = _run(calls)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    assert [e["type"] for e in events] == ["speech.audio.delta"] * (len(events) - 1) + ["speech.audio.done"]
    assert len(events) > 2  # several deltas: audio as it was made
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == 2 * _samples(TEXT)
    n_tokens = 12 * fakes.TOKENS_PER_TEXT_ID
    assert events[-1]["usage"] == {"input_tokens": 12, "output_tokens": n_tokens, "total_tokens": 12 + n_tokens}
    assert events[-1]["audio_seconds"] == round(_samples(TEXT) / SR, 3)  # the served length of a stream


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
@pytest.mark.parametrize("stream", [True, False])
def test_speed_range_of_openai(speed, stream):
    async def calls(c):
        return await c.post("/v1/audio/speech", json=_speech(response_format="pcm", speed=speed, stream=stream))

    r = _run(calls)
    assert r.status_code == 200, r.text
    n = len(r.content) // 2
    assert abs(n - _samples(TEXT) / speed) < 0.03 * _samples(TEXT) / speed + 2048, (n, _samples(TEXT) / speed)
    if not stream:  # the served length counts the tempo change beyond the model's own speed range
        assert abs(float(r.headers["x-audio-seconds"]) * SR - n) < 0.03 * n + 2048


def test_voice_forms_aliases_and_the_voice_list():
    async def calls(c):
        by_object = await c.post("/v1/audio/speech", json=_speech(voice={"id": "default"}, response_format="pcm"))
        by_alias = await c.post("/v1/audio/speech", json=_speech(voice="alloy", response_format="pcm"))
        custom = await c.post("/v1/audio/speech", json=_speech(voice="echo", response_format="pcm"))
        bad = await c.post("/v1/audio/speech", json=_speech(voice={"name": "default"}))
        voices = await c.get("/v1/voices")
        return by_object, by_alias, custom, bad, voices

    cfg = IngressConfig(max_input_chars=1000, voice_aliases={"alloy": "default", "echo": "nobody"})
    by_object, by_alias, custom, bad, voices = _run(calls, cfg)
    assert by_object.status_code == by_alias.status_code == 200
    assert len(by_alias.content) == 2 * _samples(TEXT)
    assert custom.status_code == 404 and custom.json()["error"]["code"] == "voice_not_found"
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("voice")
    assert voices.json()["aliases"] == {"alloy": "default", "echo": "nobody"}


def test_default_aliases_cover_openai_voices():
    from openai.types.audio.speech_create_params import SpeechCreateParams  # noqa: F401 - the SDK is there

    aliases = IngressConfig().voice_aliases
    assert set(aliases) >= {"alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer",
                            "verse", "marin", "cedar"}
    assert set(aliases.values()) == {"default"}
    with pytest.raises(ValueError, match="voice_aliases"):
        IngressConfig(voice_aliases={"alloy": "../etc"})


def test_models_unknown_fields_and_error_shape(caplog):
    async def calls(c):
        models = [(await c.post("/v1/audio/speech", json=_speech(model=m, response_format="pcm"))).status_code
                  for m in ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "cosyvoice2")]
        unknown_model = await c.post("/v1/audio/speech", json=_speech(model="whisper-1"))
        extra = await c.post("/v1/audio/speech", json=_speech(response_format="pcm", colour="red", temperature=0.3))
        too_fast = await c.post("/v1/audio/speech", json=_speech(speed=4.5))
        return models, unknown_model, extra, too_fast

    with caplog.at_level(logging.INFO, logger="serve_app.ingress"):
        models, unknown_model, extra, too_fast = _run(calls)
    assert models == [200] * 4
    err = unknown_model.json()["error"]
    assert unknown_model.status_code == 400 and set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert extra.status_code == 200 and len(extra.content) == 2 * _samples(TEXT)
    assert "ignored unknown fields colour, temperature" in caplog.text
    assert too_fast.status_code == 400 and too_fast.json()["error"]["param"] == "speed"


def test_instructions_select_instruct_mode():
    from deployments.frontend import TextFrontend
    from deployments.protocol import SynthesisMode

    seen = []
    real = TextFrontend.prepare

    async def spy(self, req):
        seen.append((req.mode, req.instruct_text))
        return await real(self, req)

    TextFrontend.prepare = spy
    try:
        async def calls(c):
            a = await c.post("/v1/audio/speech", json=_speech(response_format="pcm", instructions="Speak slowly."))
            b = await c.post("/v1/audio/speech", json=_speech(response_format="pcm", instructions="  "))
            return a, b

        a, b = _run(calls)
    finally:
        TextFrontend.prepare = real
    assert a.status_code == b.status_code == 200
    assert seen == [(SynthesisMode.INSTRUCT, "Speak slowly."), (SynthesisMode.VOICE, None)]
