"""Prompt uploads at the ingress: header-first refusals with 4xx, decoding off the event loop."""
from __future__ import annotations

import asyncio
import io
import struct
import threading

import httpx
import numpy as np
import pytest
import soundfile as sf

from deployments.protocol import InvalidInputError, PayloadTooLargeError
from serve_app import ingress as ingress_mod
from serve_app.audio_codec import decode_upload
from serve_app.ingress import IngressConfig
from tests.serve_app.test_ingress_inproc import _app


def _flac_silence(seconds: int, sr: int = 16000) -> bytes:
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", sr, 1, format="FLAC") as f:
        for _ in range(seconds):
            f.write(np.zeros(sr, np.float32))
    return buf.getvalue()


def _wav(seconds: float = 1.0, sr: int = 16000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.full(int(seconds * sr), 0.1, np.float32), sr, format="WAV")
    return buf.getvalue()


def _wav_header(channels: int, rate: int, frames: int) -> bytes:
    block = channels * 2
    data = frames * block
    return (b"RIFF" + struct.pack("<I", 36 + data) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * block, block, 16)
            + b"data" + struct.pack("<I", data) + bytes(data))


def test_decode_upload_maps_limits_to_413_and_the_rest_to_400():
    bomb = _flac_silence(3600)  # an hour of silence in a few hundred KB
    assert len(bomb) < 1_000_000
    with pytest.raises(PayloadTooLargeError, match="3600.00 s"):
        decode_upload(bomb, max_seconds=30)
    with pytest.raises(PayloadTooLargeError):
        decode_upload(_wav(3.0), max_seconds=2.0)
    for bad in (_wav_header(64, 16000, 10), _wav_header(1, 1, 10), _wav_header(1, 16000, 0), b"", b"\x00" * 64):
        with pytest.raises(InvalidInputError) as info:
            decode_upload(bad)
        assert not isinstance(info.value, PayloadTooLargeError)
    audio, sr = decode_upload(_wav(1.0, 44101))
    assert sr == 44101 and audio.shape == (44101,)


def test_uploads_are_decoded_off_the_event_loop_and_refused_from_their_header(monkeypatch):
    threads = []
    real = ingress_mod.decode_upload

    def spy(*args):
        threads.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(ingress_mod, "decode_upload", spy)

    async def main():
        loop_thread = threading.get_ident()
        transport = httpx.ASGITransport(app=_app(IngressConfig(max_input_chars=100, max_prompt_audio_s=30)))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/voices", data={"voice_id": "v1", "prompt_text": "hi"},
                             files={"audio": ("a.wav", _wav(), "audio/wav")})
            assert r.status_code == 201
            r = await c.post("/v1/voices", data={"voice_id": "v2", "prompt_text": "hi"},
                             files={"audio": ("a.flac", _flac_silence(600), "audio/flac")})
            assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
            r = await c.post("/v1/tts", data={"text": "Hi.", "mode": "zero_shot", "prompt_text": "hi"},
                             files={"prompt_audio": ("a.wav", _wav_header(1000, 16000, 4), "audio/wav")})
            assert r.status_code == 400 and "channels" in r.json()["error"]["message"]
            r = await c.post("/v1/tts", data={"text": "Hi.", "mode": "zero_shot", "prompt_text": "hi",
                                              "response_format": "pcm"},
                             files={"prompt_audio": ("a.wav", _wav(1.0), "audio/wav")})
            assert r.status_code == 200 and r.content
        assert len(threads) == 4 and loop_thread not in threads

    asyncio.run(main())
