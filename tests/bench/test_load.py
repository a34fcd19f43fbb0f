"""bench.load without a server: an in-process ASGI app stands in for the TTS API."""
from __future__ import annotations

import json
import random
import statistics

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bench.load import LoadConfig, LoadGenerator, error_outcome, is_documented, poisson_arrivals, write_outputs

SR = 24000


def _err(status: int, code: str, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": "m", "type": "t", "code": code}, "request_id": "r"},
                        status_code=status, headers=headers)


async def _speech(request: Request) -> Response:
    body = await request.json()
    assert body["stream"] is True and body["response_format"] == "pcm"
    text = body["input"]
    if text == "busy":
        return _err(429, "queue_full", {"Retry-After": "2"})
    if text == "boom":
        return JSONResponse({"detail": "no error shape"}, status_code=500)
    if text == "plain503":
        return Response("unavailable", status_code=503)
    if text == "unknown-voice":
        return _err(404, "voice_not_found")
    pcm = (np.ones(SR // 10, dtype="<i2") * 1000).tobytes()  # 0.1 s per chunk

    async def chunks():
        for _ in range(len(text)):
            yield pcm

    return StreamingResponse(chunks(), media_type="audio/pcm")


APP = Starlette(routes=[Route("/v1/audio/speech", _speech, methods=["POST"])])


def _run(**kw) -> dict:
    cfg = LoadConfig(base_url="http://test", progress=False, **kw)
    return LoadGenerator(cfg, transport=httpx.ASGITransport(app=APP)).run()


def test_closed_loop_counts_every_outcome_and_its_audio():
    texts = ("abc", "busy", "boom", "plain503", "unknown-voice", "abcdefgh")
    report = _run(mode="closed", concurrency=3, max_requests=60, texts=texts, seed=4)
    s = report["summary"]
    assert s["requests"] == 60 == len(report["requests"])
    picks = random.Random(4)
    expected = {}
    for _ in range(60):  # the generator draws text then voice per request from one seeded RNG
        t = picks.choice(texts)
        picks.choice(("default",))
        expected[t] = expected.get(t, 0) + 1
    by = s["outcomes"]
    assert by.get("ok", 0) == expected.get("abc", 0) + expected.get("abcdefgh", 0) == s["ok"]
    assert by.get("429:queue_full", 0) == expected.get("busy", 0) == s["rejected_429"]
    assert by.get("404:voice_not_found", 0) == expected.get("unknown-voice", 0)
    # A 500 and an error without the JSON shape are lost requests; documented 4xx/429 are not.
    assert s["lost"] == expected.get("boom", 0) + expected.get("plain503", 0)
    assert by.get("500:no-json", 0) == expected.get("boom", 0) and by.get("503:no-json", 0) == expected["plain503"]
    assert s["retry_after_missing"] == 0
    ok_rows = [r for r in report["requests"] if r["outcome"] == "ok"]
    assert {r["audio_s"] for r in ok_rows} <= {0.3, 0.8}
    assert all(r["audio_s"] == pytest.approx(0.1 * r["chars"]) for r in ok_rows)


def test_open_loop_is_bounded_by_duration_and_count():
    report = _run(mode="open", rate_rps=200.0, max_requests=1000, max_duration_s=0.25, texts=("ab",))
    n = report["summary"]["requests"]
    assert 10 < n < 120 and report["summary"]["lost"] == 0  # ~50 expected at 200/s for 0.25 s
    capped = _run(mode="open", rate_rps=500.0, max_requests=7, max_duration_s=30.0, texts=("ab",))
    assert capped["summary"]["requests"] == 7


def test_poisson_arrivals_have_the_requested_rate():
    times = poisson_arrivals(5.0, 100_000, 400.0, random.Random(0))
    gaps = np.diff([0.0, *times])
    assert len(times) == pytest.approx(2000, rel=0.05)
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.08)  # exponential: sd == mean
    assert times == sorted(times) and times[-1] <= 400.0
    assert len(poisson_arrivals(5.0, 10, 400.0, random.Random(0))) == 10


class _Broken(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request):
        raise httpx.ReadError("connection reset")


def test_transport_errors_are_lost_requests():
    cfg = LoadConfig(base_url="http://test", progress=False, max_requests=5, concurrency=2)
    s = LoadGenerator(cfg, transport=_Broken()).run()["summary"]
    assert s["outcomes"] == {"transport:ReadError": 5} and s["lost"] == 5


def test_outcome_classification():
    assert is_documented("ok") and is_documented("429:queue_full") and is_documented("413:payload_too_large")
    assert not is_documented("500:none") and not is_documented("503:no-json") and not is_documented("timeout")
    assert not is_documented("200:empty") and not is_documented("transport:RemoteProtocolError")
    assert error_outcome(400, b'{"error": {"code": "invalid_input"}, "request_id": "x"}') == "400:invalid_input"
    assert error_outcome(400, b'{"error": {"code": "invalid_input"}}') == "400:no-json"
    assert error_outcome(502, b"\xff\xfe") == "502:no-json"


def test_write_outputs(tmp_path):
    report = _run(mode="closed", concurrency=2, max_requests=12, texts=("abc", "busy"))
    paths = write_outputs(report, tmp_path / "load-unit", title="unit")
    data = json.loads(paths["json"].read_text())
    assert data["summary"]["requests"] == 12 and len(data["requests"]) == 12
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["md"].read_text()
    assert "TTFA p50" in md and "`429:queue_full`" in md


def test_config_is_validated():
    with pytest.raises(ValueError):
        LoadConfig(base_url="x", mode="burst")
    with pytest.raises(ValueError):
        LoadConfig(base_url="x", max_requests=0)


def test_soak_bounds_flag_growth_and_dead_workers():
    from bench.soak import Bounds, check_bounds

    before = {"1": {"title": "ray::A", "rss_mib": 1000.0, "fds": 50}, "2": {"title": "ray::B", "rss_mib": 100.0, "fds": 9},
              "3": {"title": "ray::C", "rss_mib": 100.0, "fds": 9}}
    after = {"1": {"title": "ray::A", "rss_mib": 1090.0, "fds": 60}, "2": {"title": "ray::B", "rss_mib": 170.0, "fds": 30}}
    out = check_bounds(before, after, Bounds(rss_abs_mib=64.0, rss_rel=0.10, fd_slack=16))
    assert out["workers"]["1"]["rss_allowed_mib"] == 100.0  # 10 % of 1000 MiB beats 64 MiB
    assert out["violations"] == ["worker 2 (ray::B) RSS grew 70.0 MiB > 64.0", "worker 2 (ray::B) open fds grew 21 > 16",
                                 "worker 3 (ray::C) died during the soak"]


def test_soak_rss_over_run_and_titles():
    from bench.soak import rss_over_run, short_title

    assert short_title("ray::ServeReplica:tts:Synthesizer  x") == "Synthesizer"
    assert short_title("ray::ProxyActor") == "ProxyActor"
    assert short_title("ray::ServeReplica:tts:Synthesizer.handle_request_with_rejection") == "Synthesizer"
    assert short_title("ray::ProxyActor.receive_asgi_messages") == "ProxyActor"
    series = [{"t_s": i, "rss_mib": {"Synthesizer": 600.0 + i, "ProxyActor": 150.0}} for i in range(1, 9)]
    over = rss_over_run(series)
    assert over == {"ProxyActor": [150.0] * 4, "Synthesizer": [602.0, 604.0, 606.0, 608.0]}
    assert rss_over_run([{"t_s": 1, "rss_mib_total": 3.0}]) == {}  # series of older results


def test_soak_sampler_records_per_worker_rss_and_stops():
    import psutil

    from bench.soak import Sampler

    sampler = Sampler([psutil.Process()], every_s=0.05)
    sampler.start()
    import time

    deadline = time.monotonic() + 60  # a failure guard: the test waits for two samples, not for a while
    while len(sampler.series) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert not sampler.is_alive() and sampler.series
    row = sampler.series[-1]
    assert row["rss_mib_total"] > 0 and len(row["rss_mib"]) == 1
