"""Voices belong to the key that registered them; a store that refuses writes is a 503 naming its
path and a degraded /health (issue 41 item 4). In process, keys on (``$FAST_COSY_API_KEYS``)."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from deployments import constants
from deployments.frontend import FrontendConfig, TextFrontend
from deployments.model_source import ModelSource
from deployments.protocol import OWNER_META_KEY
from serve_app.auth import key_id
from serve_app.ingress import IngressConfig, TTSIngress
from tests.serve_app.test_ingress_inproc import FakeHandle, _ingress, _wav, client

ALICE = "sk-alice-0123456789abcdef"  # synthesis + voices
BOB = "sk-bob-00000000000000000000"  # synthesis + voices
READER = "sk-reader-000000000000000"  # synthesis only
ROOT_KEY = "sk-root-00000000000000000"  # admin
KEYS = f"{ALICE}:synthesis+voices,{BOB}:synthesis+voices,{READER}:synthesis,{ROOT_KEY}:admin"


def _h(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def _register(c, key: str, voice_id: str, overwrite: bool = False) -> httpx.Response:
    return await c.post("/v1/voices", headers=_h(key), data={"voice_id": voice_id, "prompt_text": "hi",
                                                              "overwrite": str(overwrite).lower()},
                        files={"audio": ("a.wav", _wav(), "audio/wav")})


async def _speak(c, key: str, voice: str) -> httpx.Response:
    return await c.post("/v1/audio/speech", headers=_h(key), json={
        "model": "tts-1", "input": "Hi.", "voice": voice, "response_format": "pcm", "stream": False})


async def _listed(c, key: str) -> set[str]:
    r = await c.get("/v1/voices", headers=_h(key))
    assert r.status_code == 200, r.text
    return {v["voice_id"] for v in r.json()["voices"]}


def test_each_key_sees_uses_and_deletes_only_its_own_voices_and_admin_sees_all(monkeypatch):
    monkeypatch.setenv(constants.ENV_API_KEYS, KEYS)
    ingress = _ingress()
    app = ingress.__serve_build_asgi_app__()
    frontend = ingress.frontend._target

    async def main():
        # a shared voice: registered without a key (built-in voices and open mode do this)
        await frontend.register_voice("shared", "hi", np.full(16000, 0.1, np.float32), 16000)
        async with client(app) as c:
            assert (await _register(c, ALICE, "a1")).status_code == 201
            assert (await _register(c, BOB, "b1")).status_code == 201
            assert await _listed(c, ALICE) == {"shared", "a1"}
            assert await _listed(c, BOB) == {"shared", "b1"}
            assert await _listed(c, READER) == {"shared"}
            assert await _listed(c, ROOT_KEY) == {"shared", "a1", "b1"}
            # another key's voice answers as unknown, to read and to use
            r = await c.get("/v1/voices/b1", headers=_h(ALICE))
            assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found"
            assert (await c.get("/v1/voices/a1", headers=_h(ALICE))).json()["prompt_text"] == "hi"
            assert (await _speak(c, ALICE, "b1")).status_code == 404
            assert (await _speak(c, ALICE, "a1")).status_code == 200
            assert (await _speak(c, READER, "shared")).status_code == 200
            assert (await _speak(c, ROOT_KEY, "b1")).status_code == 200
            # nor can it be replaced or deleted by another key; a shared one only by an admin
            r = await _register(c, ALICE, "b1", overwrite=True)
            assert r.status_code == 409 and r.json()["error"]["code"] == "voice_exists"
            assert (await c.delete("/v1/voices/b1", headers=_h(ALICE))).status_code == 404
            r = await c.delete("/v1/voices/shared", headers=_h(ALICE))
            assert r.status_code == 403 and r.json()["error"]["code"] == "voice_not_owned"
            assert (await _register(c, ALICE, "a1", overwrite=True)).status_code == 201  # its own: fine
            assert (await c.delete("/v1/voices/b1", headers=_h(BOB))).status_code == 200
            assert (await c.delete("/v1/voices/a1", headers=_h(ROOT_KEY))).status_code == 200
            assert (await c.delete("/v1/voices/shared", headers=_h(ROOT_KEY))).status_code == 200
            assert await _listed(c, ROOT_KEY) == set()

    asyncio.run(main())


def test_the_owner_stored_is_a_fingerprint_of_the_key_never_the_key(monkeypatch):
    monkeypatch.setenv(constants.ENV_API_KEYS, KEYS)
    ingress = _ingress()
    app = ingress.__serve_build_asgi_app__()

    async def main():
        async with client(app) as c:
            assert (await _register(c, ALICE, "a1")).status_code == 201

    asyncio.run(main())
    owner = ingress.frontend._target.rt.voices["a1"].meta[OWNER_META_KEY]
    assert owner == key_id(ALICE) != key_id(BOB) and ALICE not in owner and len(owner) == 20


def test_without_keys_every_voice_is_everyones_as_before(monkeypatch):
    monkeypatch.delenv(constants.ENV_API_KEYS, raising=False)
    ingress = _ingress()
    app = ingress.__serve_build_asgi_app__()

    async def main():
        async with client(app) as c:
            r = await c.post("/v1/voices", data={"voice_id": "v1", "prompt_text": "hi"},
                             files={"audio": ("a.wav", _wav(), "audio/wav")})
            assert r.status_code == 201
            assert [v["voice_id"] for v in (await c.get("/v1/voices")).json()["voices"]] == ["v1"]
            assert (await c.delete("/v1/voices/v1")).status_code == 200

    asyncio.run(main())
    assert ingress.frontend._target.rt.voices == {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-cosyvoice2", "cosyvoice2")


def test_a_store_that_refuses_writes_is_a_503_naming_it_and_health_says_degraded(model_dir, tmp_path, monkeypatch):
    """The real frontend runtime and voice store (tiny model) behind the ingress."""
    monkeypatch.delenv(constants.ENV_API_KEYS, raising=False)
    voices = tmp_path / "voices"
    frontend = TextFrontend(FrontendConfig(voices_dir=str(voices)), ModelSource(str(model_dir)))
    synth = _ingress().synth
    ingress = TTSIngress(IngressConfig(health_refresh_s=3600.0), FakeHandle(frontend), synth)
    app = ingress.__serve_build_asgi_app__()

    async def main():
        async with client(app) as c:
            await ingress.health_monitor.probe()
            r = await c.get("/health")
            assert r.json()["status"] == "ok" and r.json()["voice_store_writable"] is True
            # the directory becomes unusable for writes (tests/runtime/frontend/test_voice_store.py)
            voices.rename(tmp_path / "moved")
            voices.write_bytes(b"")
            # overwrite: the moved directory fails reads too, so the record's absence is unknown here
            # (on a read-only mount reads work and a plain registration gets the same 503)
            r = await c.post("/v1/voices", data={"voice_id": "v1", "prompt_text": "A prompt transcript.",
                                                 "overwrite": "true"},
                             files={"audio": ("a.wav", _wav(2.0), "audio/wav")})
            assert r.status_code == 503 and r.json()["error"]["code"] == "voice_store_unavailable"
            assert f"the voice store {voices} is not writable" in r.json()["error"]["message"]
            await ingress.health_monitor.probe()
            r = await c.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "degraded"  # still synthesises
            assert r.json()["voice_store_writable"] is False
            detail = (await c.get("/health?detail=1")).json()["frontend"]["voice_store"]
            assert detail["path"] == str(voices) and detail["writable"] is False and detail["error"]

    asyncio.run(main())


def test_a_replica_starts_on_a_store_that_refuses_writes(model_dir, tmp_path, monkeypatch, caplog):
    """Start-up writes nothing then (no orphan collection, no default voice) and says why."""
    from cosyvoice_runtime.frontend.voices import VoiceRegistry

    def refuse(self):
        return "Read-only file system"

    def no_writes(self, *a, **kw):
        raise AssertionError("wrote to a store that refuses writes")

    monkeypatch.setattr(VoiceRegistry, "check_writable", refuse)
    monkeypatch.setattr(VoiceRegistry, "gc", no_writes)
    monkeypatch.setattr(VoiceRegistry, "put", no_writes)
    with caplog.at_level("ERROR", logger="deployments.frontend_runtime"):
        frontend = TextFrontend(FrontendConfig(voices_dir=str(tmp_path)), ModelSource(str(model_dir)))
    assert any(f"voice store {tmp_path} is not writable (Read-only file system)" in r.getMessage()
               for r in caplog.records)
    status = asyncio.run(frontend.status())
    assert status["voice_store"] == {"path": str(tmp_path), "writable": False, "error": "Read-only file system"}


def test_the_elevenlabs_routes_use_only_the_keys_own_and_shared_voices(monkeypatch):
    """The ElevenLabs-compatible HTTP routes (xi-api-key) apply the same ownership as /v1/audio/speech."""
    monkeypatch.setenv(constants.ENV_API_KEYS, KEYS)
    ingress = _ingress()
    app = ingress.__serve_build_asgi_app__()

    async def main():
        async with client(app) as c:
            assert (await _register(c, BOB, "b1")).status_code == 201
            for key, status in ((ALICE, 404), (BOB, 200), (ROOT_KEY, 200)):
                r = await c.post("/v1/text-to-speech/b1?output_format=pcm_24000", headers={"xi-api-key": key},
                                 json={"text": "Hi."})
                assert r.status_code == status, (key, r.text)
                if status == 404:  # unknown to this key, in ElevenLabs' error shape
                    assert r.json()["detail"]["status"] == "voice_not_found"

    asyncio.run(main())
