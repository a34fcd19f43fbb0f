"""Time to first audio by stage: the synthesizer's stamps, the ingress's Server-Timing header and
metrics, and the parser the capacity tool reads them with."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from deployments.protocol import FIRST_AUDIO_STAGES, REPLICA_UP, AudioChunk
from serve_app.stage_timing import (
    NOT_STAGES,
    STAGES,
    TOKEN2WAV_PARTS,
    first_audio_stages,
    parse_server_timing,
    server_timing,
)
from tests.deployments import fakes
from tests.deployments.test_synthesizer_unit import _req, _synth
from tests.serve_app.test_ingress_inproc import _app, _wav


def _chunk(timing):
    return AudioChunk("r", np.zeros(4, np.float32), 24000, index=0, piece=0, timing=timing)


def test_stages_from_the_ingress_clock_and_the_synthesizers_stamps():
    first = _chunk({"first_token": 20.0, "first_chunk_tokens": 70.0, "first_audio": 110.0})
    # arrival 10.000 s, prepared 10.004 s, first chunk at the ingress 10.130 s
    got = first_audio_stages(10.0, 10.004, 10.130, first)
    assert got == {"frontend": 4.0, "llm-first-token": 20.0, "llm-first-chunk": 50.0, "token2wav": 40.0,
                   "handoff": 16.0, "first-audio": 130.0}
    header = server_timing(got)
    assert header == ("frontend;dur=4.00, llm-first-token;dur=20.00, llm-first-chunk;dur=50.00, "
                      "token2wav;dur=40.00, handoff;dur=16.00, first-audio;dur=130.00")
    assert parse_server_timing(header) == got


def test_the_stepped_token2wav_splits_into_queue_solve_and_return():
    first = _chunk({"first_token": 20.0, "first_chunk_tokens": 70.0, "t2w_started": 75.5, "t2w_solved": 102.0,
                    "first_audio": 110.0})
    got = first_audio_stages(10.0, 10.004, 10.130, first)
    assert got["token2wav"] == 40.0
    assert (got["t2w-queue"], got["t2w-solve"], got["t2w-return"]) == (5.5, 26.5, 8.0)
    header = server_timing(got)
    assert header.endswith("first-audio;dur=130.00, t2w-queue;dur=5.50, t2w-solve;dur=26.50, t2w-return;dur=8.00")
    assert parse_server_timing(header) == got
    # how long the replica had served goes last, and is no stage of the first audio
    first.timing[REPLICA_UP] = 61234.5
    got = first_audio_stages(10.0, 10.004, 10.130, first)
    assert got["replica-up"] == 61234.5 and server_timing(got).endswith(", replica-up;dur=61234.50")
    # one mark missing (the batch scheduler sends none): no parts, the stages as before
    del first.timing["t2w_solved"]
    assert not set(first_audio_stages(10.0, 10.004, 10.130, first)) & set(TOKEN2WAV_PARTS)


def test_stages_without_the_synthesizers_stamps_or_audio():
    assert first_audio_stages(1.0, 1.5, 2.0, _chunk(None)) == {"frontend": 500.0, "first-audio": 1000.0}
    assert first_audio_stages(1.0, 1.5, 2.0, None) == {"frontend": 500.0}
    # a stamp missing in the middle drops only the stages it bounds
    got = first_audio_stages(1.0, 1.0, 1.2, _chunk({"first_token": 30.0, "first_audio": 150.0}))
    assert set(got) == {"frontend", "llm-first-token", "handoff", "first-audio"} and got["handoff"] == 50.0


@pytest.mark.parametrize("value,expected", [
    ("a;dur=1.5", {"a": 1.5}),
    ("a;desc=\"x\";dur=2, b, c;dur=oops, ;dur=3", {"a": 2.0}),
    ("", {}),
])
def test_parse_server_timing_skips_what_it_cannot_read(value, expected):
    assert parse_server_timing(value) == expected


def test_the_synthesizer_stamps_its_first_chunk_in_stage_order():
    s = _synth()

    async def main():
        return [c async for c in s.synthesize(_req("a", 20, stream=True))]

    chunks = asyncio.run(main())
    first = chunks[0].timing
    assert set(first) == {*FIRST_AUDIO_STAGES, REPLICA_UP} and first[REPLICA_UP] >= 0
    # Fake time: a decode step is STEP_S, a token2wav batch BATCH_S; the step thread may run ahead
    # of the event loop's stamps, so these are lower bounds (a stamp in the wrong place breaks them).
    ms = 1e3
    assert first["first_token"] >= fakes.STEP_S * ms
    assert first["first_chunk_tokens"] >= fakes.HOP * fakes.STEP_S * ms
    assert first["first_audio"] - first["first_chunk_tokens"] >= fakes.BATCH_S * ms - 1e-6
    assert first["first_token"] <= first["first_chunk_tokens"] <= first["first_audio"]
    assert all(c.timing is None for c in chunks[1:])


def test_a_streamed_response_carries_server_timing_and_the_stage_metrics():
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://t") as c:
            r = await c.post("/v1/voices", data={"voice_id": "v1", "prompt_text": "hi"},
                             files={"audio": ("a.wav", _wav(), "audio/wav")})
            assert r.status_code == 201
            r = await c.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hello there.", "voice": "v1",
                                                        "response_format": "pcm", "stream": True})
            assert r.status_code == 200
            stages = parse_server_timing(r.headers["server-timing"])
            metrics = (await c.get("/metrics")).text
            return stages, metrics

    stages, metrics = asyncio.run(main())
    assert list(stages) == list(STAGES + NOT_STAGES)
    assert all(v >= 0 for v in stages.values())
    inner = stages["llm-first-token"] + stages["llm-first-chunk"] + stages["token2wav"]
    assert stages["first-audio"] >= stages["frontend"] + inner - 0.05  # rounding of each entry
    for name in STAGES:
        assert f'tts_first_audio_stage_seconds_count{{ingress_replica="local",stage="{name}"}} 1.0' in metrics
    assert 'stage="replica-up"' not in metrics  # no part of the first audio
