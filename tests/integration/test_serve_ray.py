"""The app on real local Ray: HTTP and handle, streaming, batching, voices, 429, cancellation, 4xx."""
from __future__ import annotations

import asyncio
import io
import re
import struct
import wave

import httpx
import numpy as np
import pytest
import soundfile as sf

from deployments.protocol import InvalidInputError, SynthesisMode, SynthesisRequest, VoiceNotFoundError
from tests.deployments import fakes
from tests.integration.conftest import APP_NAME, replica_ongoing
from tests.integration.waiting import GUARD_S, wait_for

pytestmark = pytest.mark.ray

SR = fakes.SAMPLE_RATE


def _prompt_wav(seconds: float = 2.0, sr: int = 16000) -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(seconds * sr)) / sr
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), sr, format="WAV")
    return buf.getvalue()


def _expected_samples(text: str) -> int:
    return len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN


@pytest.fixture(scope="module")
def voice(tts_app):
    url = tts_app["base_url"]
    r = httpx.post(f"{url}/v1/voices", data={"voice_id": "alice", "prompt_text": "hello there", "overwrite": "true"},
                   files={"audio": ("a.wav", _prompt_wav(), "audio/wav")}, timeout=30)
    assert r.status_code == 201, r.text
    return "alice"


def _metric(text: str, name: str) -> list[tuple[str, float]]:
    return [(m.group(1) or "", float(m.group(2)))
            for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)]


# ------------------------------------------------------------------------------ HTTP synthesis
def test_openai_speech_wav_non_streaming(tts_app, voice):
    text = "Hello world."
    r = httpx.post(f"{tts_app['base_url']}/v1/audio/speech", timeout=30,
                   json={"model": "tts-1", "input": text, "voice": voice, "response_format": "wav", "stream": False})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/wav" and r.headers["x-request-id"]
    assert int(r.headers["content-length"]) == len(r.content)
    with wave.open(io.BytesIO(r.content)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SR, 1, 2)
        assert w.getnframes() == _expected_samples(text)


def test_openai_speech_pcm_streaming_arrives_in_chunks(tts_app, voice):
    text = "A somewhat longer sentence to stream."
    pieces = []
    with httpx.stream("POST", f"{tts_app['base_url']}/v1/audio/speech", timeout=30,
                      json={"model": "tts-1", "input": text, "voice": voice, "response_format": "pcm",
                            "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers.get("transfer-encoding") == "chunked"
        pieces.extend(r.iter_raw())
    data = b"".join(pieces)
    assert len(data) == 2 * _expected_samples(text)  # s16le
    assert len(pieces) > 1  # audio came out as it was made
    assert np.abs(np.frombuffer(data, "<i2")).max() > 1000


def test_native_zero_shot_stream_wav(tts_app):
    text = "Zero shot with an uploaded prompt."
    with httpx.stream("POST", f"{tts_app['base_url']}/v1/tts", timeout=30,
                      data={"text": text, "mode": "zero_shot", "prompt_text": "the prompt transcript",
                            "stream": "true", "response_format": "wav"},
                      files={"prompt_audio": ("p.wav", _prompt_wav(), "audio/wav")}) as r:
        assert r.status_code == 200, r.read()
        data = r.read()
    assert data[:4] == b"RIFF" and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    assert (len(data) - 44) // 2 == _expected_samples(text)


@pytest.mark.parametrize("mode, extra", [("cross_lingual", {}), ("instruct", {"instruct_text": "Speak slowly."})])
def test_native_modes_with_registered_voice(tts_app, voice, mode, extra):
    r = httpx.post(f"{tts_app['base_url']}/v1/tts", timeout=30,
                   json={"text": "Bonjour.", "mode": mode, "voice_id": voice, "response_format": "flac", **extra})
    assert r.status_code == 200, r.text
    audio, sr = sf.read(io.BytesIO(r.content))
    assert sr == SR and len(audio) == _expected_samples("Bonjour.")


# ------------------------------------------------------------------------------ handle API
def test_handle_unary_and_streaming(tts_app, voice):
    handle = tts_app["handle"]
    req = SynthesisRequest(request_id="h1", text="Via a handle.", mode=SynthesisMode.VOICE, voice_id=voice)
    result = handle.synthesize.remote(req).result(timeout_s=30)
    assert result.sample_rate == SR and len(result.samples) == _expected_samples("Via a handle.")
    req.stream, req.request_id = True, "h2"
    chunks = list(handle.options(stream=True).stream.remote(req))
    assert len(chunks) > 1 and chunks[-1].is_last
    np.testing.assert_allclose(np.concatenate([c.samples for c in chunks]).size, result.samples.size)


def test_handle_errors_keep_their_type(tts_app):
    handle = tts_app["handle"]
    with pytest.raises(VoiceNotFoundError):
        handle.synthesize.remote(SynthesisRequest(request_id="e1", text="x", voice_id="nobody")).result(timeout_s=30)
    with pytest.raises(InvalidInputError):
        handle.synthesize.remote(SynthesisRequest(request_id="e2", text="  ", voice_id="alice")).result(timeout_s=30)


# ------------------------------------------------------------------------------ voices
def test_voices_register_list_get_delete(tts_app):
    url = tts_app["base_url"]
    r = httpx.post(f"{url}/v1/voices", data={"voice_id": "bob", "prompt_text": "bob speaking"},
                   files={"audio": ("b.wav", _prompt_wav(1.0), "audio/wav")}, timeout=30)
    assert r.status_code == 201 and r.json()["num_prompt_tokens"] == 25
    dup = httpx.post(f"{url}/v1/voices", data={"voice_id": "bob", "prompt_text": "again"},
                     files={"audio": ("b.wav", _prompt_wav(1.0), "audio/wav")}, timeout=30)
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "voice_exists"
    assert "bob" in [v["voice_id"] for v in httpx.get(f"{url}/v1/voices").json()["voices"]]
    assert httpx.get(f"{url}/v1/voices/bob").json()["prompt_text"] == "bob speaking"
    assert httpx.delete(f"{url}/v1/voices/bob").status_code == 200
    assert httpx.get(f"{url}/v1/voices/bob").status_code == 404
    assert "bob" not in [v["voice_id"] for v in httpx.get(f"{url}/v1/voices").json()["voices"]]


# ------------------------------------------------------------------------------ bad input
def _post(url, path, **kw):
    return httpx.post(f"{url}{path}", timeout=30, **kw)


_ZS = {"text": "x", "mode": "zero_shot", "prompt_text": "t"}
BAD = [
    ("/v1/audio/speech", {"content": b"{not json", "headers": {"content-type": "application/json"}},
     400, "invalid_json"),
    ("/v1/audio/speech", {"json": {"model": "tts-1", "voice": "alice"}}, 400, "invalid_input"),  # no input
    ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "", "voice": "alice"}}, 400, "invalid_input"),
    ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "x", "voice": "alice", "speed": 9}},
     400, "invalid_input"),
    ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "x", "voice": "../etc"}}, 400, "invalid_input"),
    ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "x", "voice": "alice", "response_format": "ogg"}},
     400, "invalid_input"),
    ("/v1/audio/speech", {"json": {"model": "whisper-1", "input": "x", "voice": "alice"}}, 400, "model_not_found"),
    ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "x", "voice": {"name": "alice"}}}, 400, "invalid_input"),
    ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "x" * 2001, "voice": "alice"}}, 413, "payload_too_large"),
    ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "x", "voice": "nobody"}}, 404, "voice_not_found"),
    ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "   ", "voice": "alice"}}, 400, "invalid_input"),
    ("/v1/tts", {"json": {"text": "x", "mode": "zero_shot"}}, 400, "invalid_input"),  # no prompt audio
    ("/v1/tts", {"json": {"text": "x", "mode": "karaoke", "voice_id": "alice"}}, 400, "invalid_input"),
    ("/v1/tts", {"json": {"text": "x", "mode": "instruct", "voice_id": "alice"}}, 400, "invalid_input"),
    ("/v1/tts", {"data": _ZS,
                 "files": {"prompt_audio": ("p.wav", b"garbage", "audio/wav")}}, 400, "invalid_input"),
    # zero-shot without the transcript of the prompt audio
    ("/v1/tts", {"data": {"text": "x", "mode": "zero_shot"},
                 "files": {"prompt_audio": ("p.wav", _prompt_wav(), "audio/wav")}}, 400, "invalid_input"),
    ("/v1/tts", {"data": _ZS,  # prompt too short
                 "files": {"prompt_audio": ("p.wav", _prompt_wav(0.1), "audio/wav")}}, 400, "invalid_input"),
    ("/v1/tts", {"data": _ZS,
                 "files": {"prompt_audio": ("p.wav", _prompt_wav(31.0, 8000), "audio/wav")}}, 413, "payload_too_large"),
    ("/v1/voices", {"json": {"voice_id": "v"}}, 415, "unsupported_media_type"),
    ("/v1/voices", {"files": [("voice_id", (None, "v")), ("prompt_text", (None, "t"))]}, 400, "invalid_input"),
    ("/v1/voices", {"data": {"voice_id": "bad id!", "prompt_text": "t"},
                    "files": {"audio": ("a.wav", _prompt_wav(), "audio/wav")}}, 400, "invalid_input"),
]


@pytest.mark.parametrize("path, kwargs, status, code", BAD, ids=[f"{i}-{b[0]}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_its_4xx(tts_app, voice, path, kwargs, status, code):
    r = _post(tts_app["base_url"], path, **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["code"] == code and body["request_id"] == r.headers["x-request-id"]
    assert "Traceback" not in r.text


def test_unknown_route_and_method(tts_app):
    url = tts_app["base_url"]
    assert httpx.get(f"{url}/v1/nothing").status_code == 404
    r = httpx.get(f"{url}/v1/audio/speech")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.delete(f"{url}/v1/voices/nobody").status_code == 404


# ------------------------------------------------------------------------------ concurrency
def _engine_stats(tts_app) -> dict:
    stats = tts_app["synth"].stats.remote().result(timeout_s=30)
    return {**stats["engine"], "replica_id": stats["replica_id"]}


def test_concurrent_requests_are_batched(tts_app, voice):
    """Four streams are held after their first chunk (a hold seed of the fakes) until all four
    decode at once, then released together: they share decode steps and flow + HiFT batches
    however the machine's load spaced their arrivals."""
    url = tts_app["base_url"]
    seed = fakes.hold_seed()
    before = _engine_stats(tts_app)

    async def one(client, i):
        r = await client.post(f"{url}/v1/audio/speech", json={
            "model": "tts-1", "input": f"Concurrent request number {i}.", "voice": voice,
            "response_format": "pcm", "stream": True, "seed": seed})
        return r.status_code

    async def main():
        async with httpx.AsyncClient(timeout=GUARD_S) as client:
            calls = asyncio.gather(*(one(client, i) for i in range(4)))
            await asyncio.to_thread(wait_for, lambda: list(replica_ongoing(APP_NAME, "Synthesizer").values()) == [4],
                                    "4 streams in the synthesizer (4 slots: all decoding)")
            fakes.release(seed)
            return await calls

    try:
        assert asyncio.run(main()) == [200] * 4
    finally:
        fakes.release(seed)
        fakes.forget(seed)
    assert _engine_stats(tts_app)["finished"] == before["finished"] + 4
    text = httpx.get(f"{url}/metrics").text
    count = dict(_metric(text, "tts_token2wav_batch_size_count"))
    le1 = [v for labels, v in _metric(text, "tts_token2wav_batch_size_bucket") if 'le="1.0"' in labels]
    assert sum(count.values()) > le1[0]  # at least one flow+HiFT batch held more than one chunk
    decode_le1 = [v for labels, v in _metric(text, "tts_decode_batch_size_bucket") if 'le="1.0"' in labels]
    assert sum(dict(_metric(text, "tts_decode_batch_size_count")).values()) > decode_le1[0]


def test_overload_returns_429_with_retry_after(tts_app, voice):
    """16 requests held by the fakes (a hold seed) until the first 429 has come: the slots stay
    taken whatever the machine's load, then every admitted one is served."""
    url = tts_app["base_url"]
    seed = fakes.hold_seed()

    async def main():
        async with httpx.AsyncClient(timeout=GUARD_S) as client:
            posts = [asyncio.ensure_future(client.post(f"{url}/v1/audio/speech", json={
                "model": "tts-1", "input": "x" * 40, "voice": voice, "response_format": "pcm", "seed": seed}))
                for _ in range(16)]
            done, _ = await asyncio.wait(posts, return_when=asyncio.FIRST_COMPLETED)
            first = [(p.result().status_code, p.result().text[:300]) for p in done]
            assert all(code == 429 for code, _ in first), first  # nothing is served while held
            fakes.release(seed)
            return await asyncio.gather(*posts)

    try:
        responses = asyncio.run(main())
    finally:
        fakes.release(seed)
        fakes.forget(seed)
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 429 in codes, codes
    rejected = [r for r in responses if r.status_code == 429]
    assert all(r.headers["retry-after"] == "3" for r in rejected)
    assert all(r.json()["error"]["code"] == "queue_full" for r in rejected)
    # 4 decode slots + 4 queued at the caller: the rest is rejected, nothing fails otherwise.
    assert codes.count(200) >= 4 and set(codes) == {200, 429}


def test_disconnect_mid_stream_frees_the_decode_slot(tts_app, voice):
    url = tts_app["base_url"]
    before = _engine_stats(tts_app)
    with httpx.stream("POST", f"{url}/v1/audio/speech", timeout=30, json={
            "model": "tts-1", "input": "y" * 100, "voice": voice, "response_format": "pcm", "stream": True,
            "seed": fakes.hold_seed()}) as r:  # held after its first chunk: never finishes by itself
        assert r.status_code == 200
        chunks = r.iter_raw()  # keep a reference: a collected iterator closes the response
        next(chunks)
        during = _engine_stats(tts_app)
        assert during["running"] == 1, str((before, during))
    # Leaving the block closes the connection mid-stream.
    def freed() -> bool:
        e = _engine_stats(tts_app)
        return e["running"] == 0 and e["open_streams"] == 0

    wait_for(freed, "the slot freed")
    assert _engine_stats(tts_app)["aborted"] == before["aborted"] + 1


# ------------------------------------------------------------------------------ health / metrics
def test_health_and_metrics(tts_app, voice):
    url = tts_app["base_url"]
    # the cached status (the background probe may still be on its way right after start)
    wait_for(lambda: httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok", "/health says ok")
    h = httpx.get(f"{url}/health?detail=1", timeout=30)  # the live probe
    assert h.status_code == 200 and h.json()["status"] == "ok"
    replicas = h.json()["synthesizer_replicas"]
    assert len(replicas) == 1
    (rep,) = replicas.values()
    assert rep["ready"] and rep["device"] == "cpu" and "gpu_memory_allocated_bytes" in rep
    assert rep["mode"] == "pytorch" and rep["mode_source"] in ("config", "env", "default")
    # Serve's running count, read by the ingress's background task (in a thread, off the event loop)
    wait_for(lambda: httpx.get(f"{url}/health", timeout=30).json()["synthesizer_running_replicas"] == 1,
              "the ingress read Serve's running count")
    # one answered and one refused request of its own: the counters below exist whatever ran before
    assert httpx.get(f"{url}/v1/voices", timeout=30).status_code == 200
    assert httpx.get(f"{url}/v1/voices/no-such-voice", timeout=30).status_code == 404
    text = httpx.get(f"{url}/metrics").text
    assert httpx.get(f"{url}/metrics").headers["content-type"].startswith("text/plain")
    for name in ("tts_http_requests_total", "tts_http_errors_total", "tts_time_to_first_audio_seconds_count",
                 "tts_rtf_count", "tts_engine_queue_length", "tts_engine_running", "tts_device_utilization_pct",
                 "tts_token2wav_batch_size_count", "tts_requests_in_flight", "tts_generated_tokens_total",
                 "tts_stream_underruns_total", "tts_token2wav_deadline_held_total"):
        assert _metric(text, name), f"{name} missing from /metrics"
    ok = [v for labels, v in _metric(text, "tts_http_requests_total") if 'status="200"' in labels]
    assert sum(ok) > 0
