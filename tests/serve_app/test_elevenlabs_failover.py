"""Failover mid-stream on the ElevenLabs-compatible HTTP routes (serve_app/elevenlabs_http.py through
serve_app/failover.py), in process: the client of a stream whose synthesizer replica "dies" gets
the audio of the unbroken run (same length, samples equal within float noise) and, with
timestamps, an alignment that stays monotonic with every character once across the seam; without
a continuation left, ElevenLabs' error shape (503) or an aborted body.

The replicas and the dying handle are tests/serve_app/test_failover.py's (the real tiny
random-weight models; the handle raises Ray's ``ActorDiedError`` after N chunks); here they stand
behind the ingress's HTTP app with the real text frontend of the same model.
"""
from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest

from deployments.frontend import FrontendConfig, TextFrontend
from deployments.model_source import ModelSource
from serve_app.failover import StreamLostError
from serve_app.ingress import IngressConfig, TTSIngress
from tests.serve_app.test_failover import TEXT, _Handle, _synth
from tests.serve_app.test_ingress_inproc import FakeHandle, client

VOICE = "fo"
SEED = 1234
INT16_STEP = 1  # float noise (test_failover.py's 1e-4) after the pcm route rounds to int16
SAMPLE_RATE = 24000  # the tiny model's, and the pcm_24000 asked for: no resampling
STREAMED = ("/stream", "/stream/with-timestamps")  # chunked token2wav; the others one chunk a piece
ROUTES = ("", "/stream", "/with-timestamps", "/stream/with-timestamps")


@pytest.fixture(scope="module")
def app_of(tmp_path_factory):
    """``app_of(deaths, retries)``: (the ingress's HTTP app over two tiny CosyVoice2 replicas, the
    handle to them, whose call ``n`` dies after ``deaths[n]`` chunks)."""
    from cosyvoice_runtime.tiny_model import write_tiny_model

    model_dir = str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "cosyvoice2", "cosyvoice2"))
    frontend = TextFrontend(FrontendConfig(voices_dir=str(tmp_path_factory.mktemp("voices"))), ModelSource(model_dir))
    audio = (0.1 * np.random.default_rng(3).standard_normal(2 * 16000)).astype(np.float32)
    asyncio.run(frontend.register_voice(VOICE, "A voice for the test.", audio, 16000))
    replicas = [_synth(model_dir), _synth(model_dir)]

    def make(deaths: dict[int, int], retries: int = 2):
        handle = _Handle(replicas, deaths)
        ingress = TTSIngress(IngressConfig(max_input_chars=1000, stream_failover_retries=retries),
                             FakeHandle(frontend), handle)
        return ingress.__serve_build_asgi_app__(), handle
    return make


def _post(app, route: str, seed: int | None = SEED) -> httpx.Response:
    body = {"text": TEXT, "model_id": "eleven_flash_v2_5"} | ({"seed": seed} if seed is not None else {})

    async def main():
        async with client(app) as c:
            return await c.post(f"/v1/text-to-speech/{VOICE}{route}?output_format=pcm_24000", json=body)
    return asyncio.run(main())


def _read(route: str, r: httpx.Response) -> tuple[np.ndarray, dict | None]:
    """(the int16 samples, the merged alignment or None) of a route's 200 answer."""
    assert r.status_code == 200, r.text
    if "with-timestamps" not in route:
        return np.frombuffer(r.content, np.int16), None
    objs = [json.loads(x) for x in r.text.splitlines() if x] if route.startswith("/stream") else [r.json()]
    pcm = np.frombuffer(b"".join(base64.b64decode(o["audio_base64"]) for o in objs), np.int16)
    t = 0.0
    for o in objs:  # each line's characters start within its own audio (times are absolute)
        end = t + len(base64.b64decode(o["audio_base64"])) / 2 / SAMPLE_RATE
        if o["alignment"] and len(objs) > 1:
            assert all(t - 1e-3 <= s <= end + 1e-3 for s in o["alignment"]["character_start_times_seconds"])
        t = end
    spans = [o["alignment"] for o in objs if o["alignment"]]
    return pcm, {k: [v for s in spans for v in s[k]] for k in spans[0]}


def _check_alignment(a: dict, audio_s: float) -> None:
    """Monotonic, every character of the text once and in order, within the audio."""
    chars, starts, ends = a["characters"], a["character_start_times_seconds"], a["character_end_times_seconds"]
    assert "".join(chars) == TEXT and len(starts) == len(ends) == len(chars)
    assert all(s <= e for s, e in zip(starts, ends)) and starts == sorted(starts) and ends == sorted(ends)
    assert starts[0] == 0.0 and ends[-1] <= audio_s + 1e-3




def _unbroken(app_of, route: str) -> tuple[np.ndarray, dict | None, list[int]]:
    """The route's answer in an unbroken run: (samples, alignment, the piece of each synthesizer chunk)."""
    app, handle = app_of({})
    audio, alignment = _read(route, _post(app, route))

    async def pieces():
        return [c.piece async for c in handle.replicas[0].synthesize(handle.calls[0])]
    return audio, alignment, asyncio.run(pieces())


# The whole-file routes take the same path with one chunk a piece: ~20 s more, under slow.
@pytest.mark.parametrize("route", [pytest.param(r, marks=pytest.mark.slow) if r not in STREAMED else r for r in ROUTES])
def test_a_dead_replica_leaves_the_client_the_unbroken_runs_audio(app_of, route):
    unbroken, unbroken_alignment, pieces = _unbroken(app_of, route)
    border = pieces.index(1)
    assert pieces[0] == 0 and pieces[-1] == 1 and (route not in STREAMED or border > 1), pieces
    # Deaths before the first chunk, at the border of the two pieces, in the second piece, twice in
    # a row (the continuation dies too) and, where a piece has several chunks, mid first piece.
    cases = [{0: 0}, {0: border}, {0: border + 1}, {0: 1, 1: 1}] if route in STREAMED else [{0: 0}, {0: border}, {0: 0, 1: 1}]
    for deaths in cases:
        app, handle = app_of(deaths)
        audio, alignment = _read(route, _post(app, route))
        assert len(handle.calls) == len(deaths) + 1 and handle.calls[1].resume is not None, deaths
        assert len(audio) == len(unbroken), (deaths, len(audio), len(unbroken))
        assert np.abs(audio.astype(np.int32) - unbroken).max() <= INT16_STEP, deaths
        if alignment is not None:
            # Marks are an estimate that may depend on when the LLM's sequence ended relative to
            # the chunks (deployments/text_marks.py), so a continuation's need not equal the
            # unbroken run's times; the invariants must hold across the seam.
            _check_alignment(alignment, len(audio) / SAMPLE_RATE)
            assert alignment["characters"] == unbroken_alignment["characters"]


@pytest.mark.parametrize("route", ROUTES)
def test_no_continuation_left_is_elevenlabs_503_or_an_aborted_body(app_of, route):
    """Before the headers (the first chunk, or a whole-file route): ElevenLabs' error shape, 503;
    after them the body is aborted (in process the app's exception reaches the client)."""
    app, handle = app_of({0: 0}, retries=0)
    r = _post(app, route)
    assert r.status_code == 503 and r.json()["detail"]["status"] == "engine_unavailable", r.text
    assert len(handle.calls) == 1
    app, handle = app_of({0: 1, 1: 1}, retries=1)
    if route in STREAMED:
        # Starlette's handler for the error cannot answer once the response has started: the body
        # is cut (through Serve's proxy the client sees an incomplete response).
        with pytest.raises(RuntimeError, match="response already started") as info:
            _post(app, route)
        assert isinstance(info.value.__cause__, StreamLostError)
    else:
        r = _post(app, route)
        assert r.status_code == 503 and "could not be continued" in r.json()["detail"]["message"], r.text
    assert len(handle.calls) == 2


def test_a_request_without_seed_is_continued_with_the_seed_chosen_for_it(app_of):
    app, handle = app_of({0: 1})
    audio, _ = _read("/stream", _post(app, "/stream", seed=None))
    assert len(audio) and handle.calls[0].seed is not None and handle.calls[1].seed == handle.calls[0].seed
