"""Long answers through Serve's real proxy (issue 41 item 5).

Ray Serve 2.60's ``request_timeout_s`` (``http_options``, or per request the proxy's
``x-request-timeout-seconds`` header) is a TOTAL limit: the proxy computes each chunk's wait from the
request's start, so it cuts a stream that is still delivering audio. The shipped configs set none
(tests/serve_app/test_ingress_long_streams.py checks that); this shows both halves on one running
app: a stream under a 2 s total limit is cut, and a stream that was open longer than that, its
audio held meanwhile by the fake engine (a hold seed, released by the test), streams whole.
No sleeps: the cut stream's end is the moment the other one has outlived the limit.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.deployments import fakes
from tests.integration.test_serve_ray import _prompt_wav
from tests.integration.waiting import GUARD_S

pytestmark = pytest.mark.ray

TOTAL_LIMIT_S = 2  # what `request_timeout_s: 2` would do to every request
TEXT = "Long answers stream whole."


def _body_bytes(text: str) -> int:
    return 2 * len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN  # s16le PCM


async def _stream(c: httpx.AsyncClient, seed: int, headers: dict) -> tuple[int, int, str | None]:
    """(status, body bytes received, the transport error that ended it, if any)."""
    got, status = 0, None
    try:
        async with c.stream("POST", "/v1/audio/speech", headers=headers, json={
                "model": "tts-1", "input": TEXT, "voice": "long", "response_format": "pcm", "stream": True,
                "seed": seed}) as r:
            status = r.status_code
            async for data in r.aiter_bytes():
                got += len(data)
    except httpx.TransportError as exc:  # "incomplete chunked read": the proxy dropped the stream
        return status, got, type(exc).__name__
    return status, got, None


def test_a_stream_outlives_a_total_limit_that_cuts_another(tts_app):
    url = tts_app["base_url"]
    r = httpx.post(f"{url}/v1/voices", data={"voice_id": "long", "prompt_text": "hello there", "overwrite": "true"},
                   files={"audio": ("a.wav", _prompt_wav(), "audio/wav")}, timeout=30)
    assert r.status_code == 201, r.text
    limited, whole = fakes.hold_seed(), fakes.hold_seed()

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=GUARD_S) as c:
            long = asyncio.create_task(_stream(c, whole, {}))
            cut = await _stream(c, limited, {"x-request-timeout-seconds": str(TOTAL_LIMIT_S)})
            # Serve's total limit ended that stream after its first chunk, audio still to come...
            status, got, _ = cut
            assert status == 200 and 0 < got < _body_bytes(TEXT), cut
            # ...while the one without it, open since before, waits for its audio: let it come.
            assert not long.done()
            fakes.release(whole)
            return await long

    try:
        status, got, error = asyncio.run(main())
    finally:
        for seed in (limited, whole):
            fakes.release(seed)
            fakes.forget(seed)
    assert (status, got, error) == (200, _body_bytes(TEXT), None)
