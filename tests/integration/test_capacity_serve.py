"""The capacity tool's Serve level (bench/capacity.py --level serve) against the real local
service: voice-agent sessions over HTTP streaming PCM through ingress, frontend and synthesizer
replicas (the session's fake runtimes: exact lengths, no model math). Plumbing only: the figures
come from the GPU lease."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from bench.capacity import Run, _searches, parse_args
from bench.capacity_load import Mix, Slo, Workload
from bench.capacity_targets import HttpTarget, text_for
from bench.load import synthetic_prompt_wav
from bench.workload import ProductionSource, register_pool
from tests.deployments import fakes


@pytest.fixture(scope="module")
def voice(tts_app):
    r = httpx.post(f"{tts_app['base_url']}/v1/voices", timeout=30,
                   data={"voice_id": "capacity0", "prompt_text": "hello", "overwrite": "true"},
                   files={"audio": ("a.wav", synthetic_prompt_wav(3.5), "audio/wav")})
    assert r.status_code == 201, r.text
    return "capacity0"


def test_http_target_times_every_pcm_sample_of_a_streamed_answer(tts_app, voice):
    target = HttpTarget(tts_app["base_url"], voice)
    trace = asyncio.run(target.synthesize("r7", 4.0, time.perf_counter()))
    text = text_for(4.0, random.Random("r7"))
    assert trace.error is None
    assert sum(trace.chunk_samples) == len(text) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN
    assert trace.chunk_times_s == sorted(trace.chunk_times_s) and trace.ttfa_s > 0


def test_serve_level_search_probes_sessions_over_http_and_reports(tts_app, voice, tmp_path):
    args = parse_args(["--level", "serve", "--out", str(tmp_path), "--start", "2", "--max-sessions", "2",
                       "--no-open-loop", "--c1-window-s", "1"])
    work = Workload(Mix.parse("1:2-3"), seed=1, window_s=3, ramp_s=0.5)
    # a generous first-audio bound: this checks the plumbing on a shared 2-core machine, not speed
    run = Run(args, work, Slo(ttfa_p99_ms=60_000), "cpu")
    _searches(args, run, "local", HttpTarget(tts_app["base_url"], voice), sampler=None)
    probes = {s["kind"]: s["probes"] for s in run.searches}
    assert [p["load"] for p in probes["sessions"]] == [2] and [p["load"] for p in probes["one-session"]] == [1]
    for p in probes["sessions"] + probes["one-session"]:
        assert p["requests"] >= 1 and p["errors"] == 0 and p["audio_s"] > 0, p
    assert (tmp_path / f"{run.stem}.md").exists()
    assert run.searches[0]["capacity"] == 2  # the only load it may probe met the (loose) SLO


def test_production_workload_registers_its_pool_speaks_corpus_text_and_removes_cold_voices(tts_app, tmp_path):
    """The default workload over HTTP: the pool registered with POST /v1/voices, each session in
    its own voice, cold voices registered before their request and deleted after it."""
    url = tts_app["base_url"]
    source = ProductionSource(voices=3, prompt_s=(3.0, 4.0), cold_share=0.5, sentences="1:1")
    target = HttpTarget(url, "capacity0")
    asyncio.run(register_pool(target, source.voices))
    args = parse_args(["--level", "serve", "--out", str(tmp_path), "--start", "2", "--max-sessions", "2",
                       "--no-open-loop", "--c1-window-s", "1"])
    run = Run(args, Workload(seed=1, window_s=3, ramp_s=0.5, source=source), Slo(ttfa_p99_ms=60_000), "cpu")
    _searches(args, run, "local", target, sampler=None)
    sessions = next(s for s in run.searches if s["kind"] == "sessions")["probes"][0]
    assert sessions["requests"] >= 1 and sessions["errors"] == 0 and sessions["served_s_p50"] > 0, sessions
    one = next(s for s in run.searches if s["kind"] == "one-session")["probes"][0]
    assert one["cold_voice_requests"] >= 1 and one["errors"] == 0  # seed 1: session 0 opens in a cold voice
    listed = {v["voice_id"] for v in httpx.get(f"{url}/v1/voices", timeout=30).json()["voices"]}
    assert {v.voice_id for v in source.voices} <= listed
    assert not any(v.startswith("capacity-cold-") for v in listed)  # every cold voice was removed
    assert run.workload()["name"] == "production" and run.workload()["served_length"]["requests"] >= 1
