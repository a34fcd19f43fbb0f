"""The app with the REAL runtime (tiny random-weight model) on real local Ray, over HTTP.

The tiny model does not speak; this checks that the production adapters (frontend, LLM engine,
token2wav) work inside replicas: voice registration through the ONNX prompt encoder, unary WAV,
streamed PCM in several chunks, tokens counted in /metrics, disconnect aborting a real sequence,
bistream text-in streaming over the WebSocket (text inbox actor, engine parking).
Runs as a second application (route prefix /tiny) in the session's Ray: the ``tiny_app`` fixture of
conftest.py, shared with the browser test of the playground; the disconnect and bistream tests also
against ``tiny_cuda_plan_app``, the CUDA replica's default plan on the CPU.
"""
from __future__ import annotations

import io
import re
import time
import wave

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.ray

# the CPU replica's default plan and the CUDA replica's run on the CPU (tests/integration/test_plans_ray.py)
PLANS = ["tiny_app", "tiny_cuda_plan_app"]


def test_unary_wav_and_streamed_pcm(tiny_app):
    url = tiny_app["url"]
    r = httpx.post(f"{url}/v1/audio/speech", timeout=120,
                   json={"model": "tts-1", "input": "Hello world.", "voice": "tiny", "response_format": "wav",
                         "seed": 1, "stream": False})
    assert r.status_code == 200, r.text
    with wave.open(io.BytesIO(r.content)) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 0
    parts = []
    with httpx.stream("POST", f"{url}/v1/audio/speech", timeout=120,
                      json={"model": "tts-1", "input": "Hello world, streaming now.", "voice": "tiny",
                            "response_format": "pcm", "stream": True, "seed": 2}) as s:
        assert s.status_code == 200
        parts = list(s.iter_raw())
    pcm = np.frombuffer(b"".join(parts), "<i2")
    assert pcm.size > 0 and np.isfinite(pcm).all()
    text = httpx.get(f"{url}/metrics").text
    tokens = float(re.search(r"^tts_generated_tokens_total\{[^}]*\} (\S+)$", text, re.MULTILINE).group(1))
    assert tokens > 0


@pytest.mark.parametrize("app", PLANS)
def test_disconnect_aborts_a_real_sequence(app, request):
    tiny_app = request.getfixturevalue(app)
    synth = tiny_app["synth"]
    before = synth.stats.remote().result(timeout_s=30)["engine"]
    with httpx.stream("POST", f"{tiny_app['url']}/v1/audio/speech", timeout=120,
                      json={"model": "tts-1", "input": "word " * 40, "voice": "tiny", "response_format": "pcm",
                            "stream": True}) as s:
        assert s.status_code == 200  # the worst-case length is capped to the slot, not refused
        chunks = s.iter_raw()
        next(chunks)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = synth.stats.remote().result(timeout_s=30)["engine"]
        if stats["running"] == 0 and stats["open_streams"] == 0:
            break
        time.sleep(0.1)
    assert stats["running"] == 0 and stats["open_streams"] == 0
    assert stats["aborted"] + stats["finished"] > before["aborted"] + before["finished"]


def test_openai_sdk_streams_the_real_runtime(tiny_app):
    """The official SDK against the real runtime: OpenAI's voice name aliases the tiny model's
    'default' voice, the Ogg Opus stream decodes, and speed 4.0 (model 2.0 x tempo 2.0) with SSE
    ends with usage."""
    import base64
    import json

    import av
    import openai

    client = openai.OpenAI(base_url=f"{tiny_app['url']}/v1", api_key="unused", max_retries=0, timeout=120)
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="Hello from the tiny model.", response_format="opus",
            extra_body={"seed": 3}) as response:
        data = b"".join(response.iter_bytes())
    with av.open(io.BytesIO(data)) as c:
        n = sum(f.samples for f in c.decode(audio=0))
    assert n > 0.1 * 48000  # Ogg Opus decodes at 48 kHz
    with client.audio.speech.with_streaming_response.create(
            model="cosyvoice2", voice="alloy", input="Fast.", response_format="pcm", speed=4.0,
            stream_format="sse", extra_body={"seed": 3}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
    assert sum(len(base64.b64decode(e["audio"])) for e in events[:-1]) > 0


@pytest.mark.parametrize("app", PLANS)
def test_websocket_bistream_speaks_before_the_text_ends(app, request):
    """One LLM sequence reads the text while it speaks: the end of the text is held back until the
    first audio message has arrived (a missing one fails the recv's guard). The fragments reach the
    replica running the sequence through its text inbox actor."""
    tiny_app = request.getfixturevalue(app)
    import base64
    import json

    from websockets.sync.client import connect

    from tests.integration.waiting import GUARD_S

    url = tiny_app["url"].replace("http://", "ws://") + "/v1/text-to-speech/tiny/stream-input?output_format=pcm_24000"
    # ~60 text ids (the tiny tokenizer is about one id per character): enough to pair the 75-token
    # prompt speech and pass the first chunk, few enough for one turn
    words = [f" word{i % 7}" for i in range(10)]
    with connect(url, open_timeout=30, close_timeout=10) as ws:
        ws.send(json.dumps({"text": " ", "voice_settings": {"speed": 1.0}}))
        for w in words:
            ws.send(json.dumps({"text": w}))
        first = json.loads(ws.recv(timeout=GUARD_S))
        assert first["isFinal"] is False and first["audio"], first
        ws.send(json.dumps({"text": ""}))
        messages = [first]
        while not messages[-1].get("isFinal"):
            messages.append(json.loads(ws.recv(timeout=GUARD_S)))
            assert "error" not in messages[-1], messages[-1]
    pcm = np.frombuffer(b"".join(base64.b64decode(m["audio"]) for m in messages[:-1]), "<i2")
    assert len(messages) > 2 and pcm.size > 24000  # more than a second of audio, in several messages
    stats = tiny_app["synth"].stats.remote().result(timeout_s=30)["engine"]
    assert stats["running"] == 0 and stats["open_streams"] == 0
