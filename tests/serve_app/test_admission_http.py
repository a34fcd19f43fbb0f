"""A synthesizer's admission refusal (deployments/admission.py) through the ingress's app, in
process: the OpenAI error shape, 429 and Retry-After, for a unary and a streamed request."""
from __future__ import annotations

import asyncio

from deployments.synthesizer_config import AdmissionConfig
from tests.serve_app.test_ingress_inproc import _ingress, _wav, client


def test_a_refused_request_is_a_json_429_with_retry_after():
    ingress = _ingress()
    synth = ingress.synth._target
    cfg = AdmissionConfig(enabled=True, slo_first_audio_ms=100)
    synth.admission.enabled = True
    synth.admission.slo_s = cfg.slo_first_audio_ms / 1e3
    for _ in range(int(cfg.min_samples)):  # enough readings: 1 s of first audio at two streams
        synth.admission.first_audio(2, 1.0)
    retry_after = synth.cfg.retry_after_s

    async def main():
        async with client(ingress.__serve_build_asgi_app__()) as c:
            r = await c.post("/v1/voices", data={"voice_id": "v1", "prompt_text": "hi"},
                             files={"audio": ("a.wav", _wav(), "audio/wav")})
            assert r.status_code == 201
            body = {"model": "tts-1", "input": "Hello there.", "voice": "v1", "response_format": "pcm"}
            alone = await c.post("/v1/audio/speech", json={**body, "stream": False})
            assert alone.status_code == 200  # an idle replica always admits
            synth._active = 1  # another stream open: this request would be the second
            try:
                return [await c.post("/v1/audio/speech", json={**body, "stream": s}) for s in (False, True)]
            finally:
                synth._active = 0

    for r in asyncio.run(main()):
        assert r.status_code == 429 and r.headers["retry-after"] == str(retry_after)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and r.json()["request_id"]
        assert error["type"] == "overloaded_error" and "first-audio SLO" in error["message"]
    assert synth.admission.refused >= 2
