"""The ingress's Starlette app without Ray: real TextFrontend/Synthesizer objects (with injected
fake runtimes) behind in-process stand-ins for DeploymentHandles. Fast checks of routing,
parsing, codecs and the error shape; the same paths run through real Ray in tests/integration.
"""
from __future__ import annotations

import asyncio
import io
import wave

import httpx
import numpy as np
import soundfile as sf

from deployments.frontend import FrontendConfig, TextFrontend
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from serve_app.ingress import IngressConfig, TTSIngress
from serve_app.running_replicas import RunningReplicas
from tests.deployments import fakes


class _Response:
    def __init__(self, coro_fn, *args):
        self._fn, self._args = coro_fn, args

    def __await__(self):
        return self._fn(*self._args).__await__()


class _Stream:
    def __init__(self, agen):
        self._agen = agen
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._agen.__anext__()

    def cancel(self):
        self.cancelled = True


class _Method:
    def __init__(self, target, name, stream):
        self._fn, self._stream = getattr(target, name), stream

    def remote(self, *args):
        return _Stream(self._fn(*args)) if self._stream else _Response(self._fn, *args)


class FakeHandle:
    def __init__(self, target, stream=False):
        self._target, self._stream = target, stream

    def options(self, stream=False):
        return FakeHandle(self._target, stream)

    def __getattr__(self, name):
        fn = getattr(self._target, name)
        if not asyncio.iscoroutinefunction(fn) and not self._stream:
            async def wrapped(*a):
                return fn(*a)
            return _Method(type("T", (), {name: staticmethod(wrapped)}), name, False)
        return _Method(self._target, name, self._stream)


def _app(ingress_cfg: IngressConfig | None = None):
    return _ingress(ingress_cfg).__serve_build_asgi_app__()


def _ingress(ingress_cfg: IngressConfig | None = None) -> TTSIngress:
    frontend = TextFrontend(FrontendConfig(), runtime_factory=fakes.fake_frontend_runtime)
    synth = Synthesizer(SynthesizerConfig(max_running=4, max_ongoing_requests=4, warmup=False,
                                          token2wav={"max_batch_size": 4}),
                        runtime_factory=fakes.fake_synthesis_runtime)

    synth.outside_serve()  # no @serve.batch outside a replica
    return TTSIngress(ingress_cfg or IngressConfig(max_input_chars=100), FakeHandle(frontend), FakeHandle(synth))


def client(app) -> httpx.AsyncClient:
    """An HTTP client calling the ASGI ``app`` in this process."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _wav(seconds=1.0, sr=16000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.full(int(seconds * sr), 0.1, np.float32), sr, format="WAV")
    return buf.getvalue()


def test_routes_end_to_end_in_process():
    async def main():
        transport = httpx.ASGITransport(app=_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/voices", data={"voice_id": "v1", "prompt_text": "hi"},
                             files={"audio": ("a.wav", _wav(), "audio/wav")})
            assert r.status_code == 201 and r.json()["num_prompt_tokens"] == 25
            r = await c.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "v1",
                                                        "response_format": "wav", "stream": False})
            assert r.status_code == 200
            with wave.open(io.BytesIO(r.content)) as w:
                assert w.getnframes() == 3 * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN
            r = await c.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hello there.", "voice": "v1",
                                                        "response_format": "pcm", "stream": True})
            n_samples = 12 * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN  # 12 text ids
            assert r.status_code == 200 and len(r.content) == 2 * n_samples
            r = await c.post("/v1/audio/speech", json={"model": "tts-1", "input": "x" * 101, "voice": "v1"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
            r = await c.post("/v1/audio/speech", json={"model": "tts-1", "input": "x", "voice": "nobody"})
            assert r.status_code == 404 and set(r.json()) == {"error", "request_id"}
            r = await c.get("/metrics")
            assert r.status_code == 200 and "tts_http_requests_total" in r.text
            assert 'status="404"' in r.text and "tts_engine_running" in r.text
            # the two synthesised requests' audio seconds (3 and 12 text ids' worth)
            assert 'tts_served_audio_seconds_count{ingress_replica="local"} 2.0' in r.text
            r = await c.get("/health?detail=1")
            assert r.status_code == 200 and r.json()["synthesizer_replicas"]["local"]["ready"]
            r = await c.get("/health")  # the cached status: counts only
            assert r.status_code == 200 and r.json()["status"] == "ok" and "synthesizer_replicas" not in r.json()

    asyncio.run(main())


def test_health_keeps_answering_when_probes_cannot_reach_busy_replicas(monkeypatch):
    """Probes queue behind synthesis work; under overload they fail. /health then keeps each
    replica's last answer (with its age) and rests readiness on Serve's running count."""
    import serve_app.health as health_mod

    frontend = TextFrontend(FrontendConfig(), runtime_factory=fakes.fake_frontend_runtime)
    synth = Synthesizer(SynthesizerConfig(max_running=4, max_ongoing_requests=4, warmup=False,
                                          token2wav={"max_batch_size": 4}), runtime_factory=fakes.fake_synthesis_runtime)
    ingress = TTSIngress(IngressConfig(), FakeHandle(frontend), FakeHandle(synth))
    app = ingress.__serve_build_asgi_app__()
    running = {"n": 1}
    ingress.health_monitor.running_synthesizers = RunningReplicas("Synthesizer", read=lambda name: running["n"])
    healthy = synth.health

    async def get():
        await ingress.health_monitor.running_synthesizers.refresh()  # the count its background task reads
        async with client(app) as c:
            return await c.get("/health?detail=1")

    r = asyncio.run(get())
    body = r.json()
    assert r.status_code == 200 and body["probes_failed"] == 0 and body["synthesizer_replicas"]["local"]["ready"]

    def overloaded():
        raise RuntimeError("replica queue full")

    synth.health = overloaded
    r = asyncio.run(get())
    body = r.json()
    assert r.status_code == 200 and body["probes_failed"] == 2  # 2 probes per running replica
    assert body["synthesizer_replicas"] == {}  # nobody answered this call
    last = body["synthesizer_replicas_unreached"]["local"]
    assert last["ready"] and last["age_s"] >= 0 and last["engine"]["running"] == 0
    running["n"] = 0  # Serve counts no running replica and none answers: down
    assert asyncio.run(get()).status_code == 503
    monkeypatch.setattr(health_mod, "HEALTH_MEMORY_S", -1.0)  # memory expired
    running["n"] = 1
    r = asyncio.run(get())
    assert r.status_code == 200 and r.json()["synthesizer_replicas_unreached"] == {}
    synth.health = healthy
    monkeypatch.setattr(health_mod, "HEALTH_MEMORY_S", 60.0)
    body = asyncio.run(get()).json()
    assert "local" in body["synthesizer_replicas"] and body["synthesizer_replicas_unreached"] == {}


def test_health_is_not_ready_while_no_frontend_replica_answers_or_runs():
    """A frontend still loading (its status call fails, Serve counts none running) makes /health 503 even
    with the synthesizer ready; Serve's count alone keeps a busy frontend ready."""
    frontend = TextFrontend(FrontendConfig(), runtime_factory=fakes.fake_frontend_runtime)
    synth = Synthesizer(SynthesizerConfig(warmup=False), runtime_factory=fakes.fake_synthesis_runtime)
    ingress = TTSIngress(IngressConfig(), FakeHandle(frontend), FakeHandle(synth))
    app = ingress.__serve_build_asgi_app__()
    running = {"n": 0}
    ingress.health_monitor.running_frontends = RunningReplicas("TextFrontend", read=lambda name: running["n"])

    async def get():
        await ingress.health_monitor.running_frontends.refresh()
        async with client(app) as c:
            return await c.get("/health?detail=1")

    r = asyncio.run(get())
    assert r.status_code == 200 and r.json()["frontend"]["answered_by"] == "local"
    assert r.json()["frontend"]["running_replicas"] == 0 and r.json()["frontend"]["voice_store_writable"]

    async def loading():
        raise RuntimeError("replica not started")

    frontend.status = loading
    r = asyncio.run(get())
    assert r.status_code == 503 and r.json()["frontend"]["answered_by"] is None
    assert r.json()["frontend"]["voice_store_writable"] is None  # nobody said
    assert r.json()["synthesizer_replicas"]["local"]["ready"]  # the synthesizer was fine all along
    running["n"] = 1  # busy, not gone: Serve counts it running
    assert asyncio.run(get()).status_code == 200


def test_health_probes_again_until_every_running_replica_answered():
    """The handle picks the replica of each probe; a round can miss one. Idle, /health sends more
    rounds until every replica Serve counts as running answered; a failed probe stops the rounds."""
    import dataclasses

    frontend = TextFrontend(FrontendConfig(), runtime_factory=fakes.fake_frontend_runtime)
    synth = Synthesizer(SynthesizerConfig(warmup=False), runtime_factory=fakes.fake_synthesis_runtime)
    ingress = TTSIngress(IngressConfig(), FakeHandle(frontend), FakeHandle(synth))
    app = ingress.__serve_build_asgi_app__()
    ingress.health_monitor.running_synthesizers = RunningReplicas("Synthesizer", read=lambda name: 2)
    calls = {"n": 0}
    real = synth.health

    def routed():  # the first round (4 probes) all land on replica "a", later ones on "b"
        calls["n"] += 1
        return dataclasses.replace(real(), replica_id="a" if calls["n"] <= 4 else "b")

    synth.health = routed

    async def get():
        await ingress.health_monitor.running_synthesizers.refresh()
        async with client(app) as c:
            return (await c.get("/health?detail=1")).json()

    body = asyncio.run(get())
    assert set(body["synthesizer_replicas"]) == {"a", "b"} and calls["n"] == 8 and body["probes_failed"] == 0

    def busy():
        calls["n"] += 1
        if calls["n"] % 4 == 0:
            raise RuntimeError("replica queue full")
        return dataclasses.replace(real(), replica_id="a")

    synth.health, calls["n"] = busy, 0
    body = asyncio.run(get())
    assert set(body["synthesizer_replicas"]) == {"a"} and body["probes_failed"] == 1 and calls["n"] == 4
    assert set(body["synthesizer_replicas_unreached"]) == {"b"}  # heard from by the call before
