"""Long answers stream whole (issue 41 item 5): no total time limit anywhere, a progress timeout
instead (``ingress.stream_idle_timeout_s``), the work bounded by the input limits.

Serve 2.60's ``http_options.request_timeout_s`` is an end-to-end limit: its proxy computes each
chunk's wait from the request's start and cuts a stream still delivering audio (measured in
tests/integration/test_long_streams_ray.py, which also streams an answer past such a limit whole).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import yaml

from deployments import constants
from deployments.frontend import TextFrontend
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from serve_app.args import AppArgs, application_of
from serve_app.ingress import IngressConfig, NoAudioError, TTSIngress
from tests.deployments import fakes
from tests.serve_app.test_auth import ADMIN_KEY as VOICES_KEY
from tests.serve_app.test_auth import KEYS_ENV
from tests.serve_app.test_ingress_health import CountingHandle
from tests.serve_app.test_ingress_inproc import FakeHandle, _ingress, _wav, client

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIGS = sorted((ROOT / "configs").glob("*.yaml")) + [ROOT / "deploy/docker/single-gpu.yaml"]
IDLE_S = 0.2  # the stalls below never end: this only sets how soon the ingress gives up


def _serve_config(path: Path) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    service = next((d for d in docs if d.get("kind") == "RayService"), None)
    if service is not None:  # the Serve config is a string inside the RayService
        return yaml.safe_load(service["spec"]["serveConfigV2"])
    return docs[0]


@pytest.mark.parametrize("path", [*SERVE_CONFIGS, ROOT / "deploy/kuberay/rayservice.yaml"], ids=lambda p: p.name)
def test_no_shipped_config_puts_a_total_time_limit_on_a_response(path):
    data = _serve_config(path)
    assert (data.get("http_options") or {}).get("request_timeout_s") is None
    args = AppArgs.model_validate(application_of(data).get("args") or {})
    assert args.ingress.stream_idle_timeout_s > 0  # the progress timeout that replaces it
    # the work of a request stays bounded by its input: characters, and the pieces they split into
    assert args.ingress.max_input_chars <= 30_000 and args.frontend.max_pieces <= 512


def _held(hold_at: int, **cfg):
    """An ingress whose synthesizer streams stop after ``hold_at`` chunks, for good."""
    ingress = _ingress(IngressConfig(max_input_chars=1000, stream_idle_timeout_s=IDLE_S, **cfg))
    ingress.synth = CountingHandle(ingress.synth, gate=asyncio.Event(), at_gate=asyncio.Event(), hold_at=hold_at)
    return ingress


async def _with_voice(c: httpx.AsyncClient, headers: dict | None = None) -> None:
    r = await c.post("/v1/voices", data={"voice_id": "v1", "prompt_text": "hi"}, headers=headers,
                     files={"audio": ("a.wav", _wav(), "audio/wav")})
    assert r.status_code == 201


def _speech(**kw) -> dict:
    return {"model": "tts-1", "input": "Hello there.", "voice": "v1", "response_format": "pcm", "stream": True, **kw}


def test_a_stream_that_stalls_after_its_headers_is_aborted_and_sse_says_why():
    ingress = _held(hold_at=1)
    app = ingress.__serve_build_asgi_app__()

    async def main():
        async with client(app) as c:
            await _with_voice(c)
            # a plain audio body cannot carry a status: aborted (Starlette cannot answer the error
            # once the response has started; through Serve's proxy an incomplete response)
            with pytest.raises(RuntimeError, match="response already started") as info:
                await c.post("/v1/audio/speech", json=_speech())
            assert isinstance(info.value.__cause__, NoAudioError)
            r = await c.post("/v1/audio/speech", json=_speech(stream_format="sse"))
            assert r.status_code == 200  # the headers had gone with the first chunk
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
            assert [e["type"] for e in events] == ["speech.audio.delta", "error"]  # no speech.audio.done
            assert events[-1]["error"]["code"] == "audio_timeout" and events[-1]["request_id"]
            assert ingress.metrics.requests.labels("/v1/audio/speech", "500")._value.get() == 1  # the aborted one

    asyncio.run(main())
    assert ingress.metrics.in_flight._value.get() == 0  # both streams released their count


def test_no_first_audio_within_the_idle_timeout_is_a_504():
    ingress = _held(hold_at=0)
    app = ingress.__serve_build_asgi_app__()

    async def main():
        async with client(app) as c:
            await _with_voice(c)
            r = await c.post("/v1/audio/speech", json=_speech())
            assert r.status_code == 504 and r.headers["retry-after"]
            assert r.json()["error"]["code"] == "audio_timeout" and set(r.json()) == {"error", "request_id"}

    asyncio.run(main())


FOX = "The quick brown fox jumps over the lazy dog again. "  # 51 characters
# The fake frontend makes a piece of every sentence; the real splitter merges short ones (at least
# split.token_min_n tokens a piece), so for the GPU config's 512 pieces the sentences are longer.
FOX_FIELD = "The quick brown fox jumps over the lazy dog again, then runs home across the wide green field. "


@pytest.mark.parametrize(("config", "chars", "sentence", "min_audio_s"), [
    ("configs/local.yaml", 10_000, FOX, 600),  # the local config: a 10,000-character text
    ("configs/production.yaml", 30_000, FOX_FIELD, 1_800),  # the GPU config: a 30-minute answer
], ids=["local-10000-chars", "gpu-30-minutes"])
def test_a_long_text_streams_start_to_end_on_the_config(config, chars, sentence, min_audio_s, monkeypatch):
    """The config's own limits (ingress and frontend: max_input_chars, max_pieces, the stream idle
    timeout) with the fakes: the fake engine's time is a FakeClock's, so the 800 s of audio per
    10,000 characters are produced as fast as the loop runs. The GPU config requires keys: they
    come from the environment here (its keys file is a cluster node's)."""
    monkeypatch.setenv(constants.ENV_API_KEYS, KEYS_ENV)
    auth = {"Authorization": f"Bearer {VOICES_KEY}"}
    args = AppArgs.from_file(ROOT / config)
    assert args.ingress.max_input_chars >= chars  # the text is one the config accepts
    text = (sentence * (chars // len(sentence) + 1))[:chars]
    frontend = TextFrontend(args.frontend.model_copy(update={"voices_dir": None}),
                            runtime_factory=fakes.fake_frontend_runtime)
    synth = Synthesizer(SynthesizerConfig(max_running=4, max_ongoing_requests=4, warmup=False,
                                          token2wav={"max_batch_size": 4}),
                        runtime_factory=fakes.fake_runtime_on(fakes.FakeClock()))

    synth.outside_serve()  # no @serve.batch outside a replica
    app = TTSIngress(args.ingress, FakeHandle(frontend), FakeHandle(synth)).__serve_build_asgi_app__()
    spoken = sum(len(p.encode()) for p in fakes.FakeFrontendRuntime().split(text))  # the fake's text ids
    assert spoken > 0.95 * chars  # nearly every character is spoken (the fake drops the spaces between sentences)
    n_samples = spoken * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN
    assert n_samples / fakes.SAMPLE_RATE >= min_audio_s

    async def main():
        async with client(app) as c:
            await _with_voice(c, auth)
            got = 0
            async with c.stream("POST", "/v1/audio/speech", json=_speech(input=text), headers=auth) as r:
                assert r.status_code == 200, (await r.aread())[:300]
                async for data in r.aiter_bytes():
                    got += len(data)
            assert got == 2 * n_samples  # every piece, to the end

    asyncio.run(main())
