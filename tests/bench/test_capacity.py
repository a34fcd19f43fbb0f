"""The capacity tool (bench/capacity.py): the workload mix, the SLO verdict of a probe, the
search, the closed and open loops on a fake clock with a fake target, the HTTP target on an
in-process app, and the in-process level on the tiny model, arms included (plumbing only: the
figures come from the GPU lease)."""
from __future__ import annotations

import asyncio
import itertools
import json
import random
import selectors
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import yaml
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from bench import capacity as capacity_mod
from bench import capacity_targets as targets_mod
from bench.capacity import Run, _searches, main, parse_args
from bench.capacity_counters import counter_deltas, gc_counters, probe_counters
from bench.capacity_load import Clock, Mix, Probe, Slo, Workload, closed_loop, open_loop, rate_search, sessions_search
from bench.capacity_report import _slowest_table, _stage_table, _thread_table, markdown
from bench.capacity_targets import HttpTarget, InProcessTarget, text_for
from bench.metrics import RequestTrace
from bench.soak import config_env
from deployments.protocol import AudioChunk
from deployments.python_gc import GcPauses
from deployments.thread_load import GilWait
from serve_app.args import AppArgs, application_of
from serve_app.metrics import IngressMetrics

ROOT = Path(__file__).resolve().parents[2]

SLO = Slo()


def test_mix_parses_and_draws_in_its_proportions():
    mix = Mix.parse("40:1-3,40:3-8,20:8-20")
    rng = random.Random(0)
    draws = [mix.draw(rng) for _ in range(20000)]
    assert all(1 <= d <= 20 for d in draws)
    short = sum(d < 3 for d in draws) / len(draws)
    long_ = sum(d >= 8 for d in draws) / len(draws)
    assert abs(short - 0.4) < 0.02 and abs(long_ - 0.2) < 0.02
    assert mix.longest_s == 20 and mix.describe() == "40 % 1-3 s, 40 % 3-8 s, 20 % 8-20 s"
    for bad in ("", "40:3-1", "0:1-2", "x:1-2", "40:0-2"):
        with pytest.raises(ValueError):
            Mix.parse(bad)


def _trace(ttfa_s=0.1, chunks=((0.1, 1.0), (0.5, 1.0)), error=None, t0=0.0) -> RequestTrace:
    """Chunks as (arrival after submission, seconds of audio)."""
    tr = RequestTrace(submitted_s=t0, error=error)
    for at, audio in chunks:
        tr.add_chunk(t0 + at, int(audio * tr.sample_rate))
    return tr


def test_probe_verdict_needs_every_request_ok_no_underrun_and_p99_first_audio():
    fine = [_trace(chunks=((0.1, 1.0), (0.9, 1.0))) for _ in range(99)]
    assert Probe(4, fine, window_s=60).summary(SLO)["meets_slo"]
    slow = fine + [_trace(chunks=((0.9, 1.0),)) for _ in range(3)]  # 3 % of requests at 900 ms
    s = Probe(4, slow, window_s=60).summary(SLO)
    assert s["ttfa_p99_ms"] > 300 and not s["meets_slo"]
    late = fine + [_trace(chunks=((0.1, 0.4), (0.6, 1.0)))]  # second chunk after 0.4 s of audio ran out
    s = Probe(4, late, window_s=60).summary(SLO)
    assert s["underruns"] == 1 and not s["meets_slo"]
    failed = fine + [RequestTrace(submitted_s=0.0, error="HTTP 500")]
    assert Probe(4, failed, window_s=60).summary(SLO)["errors"] == 1
    assert not Probe(4, failed, window_s=60).summary(SLO)["meets_slo"]
    assert not Probe(4, [], window_s=60).summary(SLO)["meets_slo"]  # nothing measured is no capacity
    assert not Probe(4, fine, window_s=60, aborted="underrun").summary(SLO)["meets_slo"]


def test_probe_summary_and_report_give_first_audio_by_stage():
    traces = [_trace(chunks=((0.1, 1.0),)) for _ in range(101)]
    for i, t in enumerate(traces):
        t.stages_ms = {"frontend": float(i), "handoff": 2.0 * i}
    traces[0].stages_ms = {"frontend": 0.0}  # a stage a request lacks is left out of its percentiles
    row = Probe(4, traces, window_s=60).summary(SLO)
    assert row["stages_ms"] == {"frontend": [50.0, 99.0], "handoff": [101.0, 198.02]}  # 2, 4, ..., 200
    traces[1].stages_ms["first-audio"] = 60.0  # the client saw its first audio at 100 ms
    proxy = Probe(4, traces, window_s=60).summary(SLO)["stages_ms"]
    assert proxy["first-audio"] == [60.0, 60.0] and proxy["proxy"] == [40.0, 40.0]
    assert Probe(4, [_trace(chunks=((0.1, 1.0),))], window_s=60).summary(SLO)["stages_ms"] == {}
    table = "\n".join(_stage_table([{**row, "load": 4}, {"load": 2, "stages_ms": {"frontend": [1.0, 3.0]}}]))
    assert "| load | frontend | handoff |" in table
    assert "| 2 | 1 / 3 | - |" in table and "| 4 | 50 / 99 | 101 / 198 |" in table
    assert _stage_table([{"load": 1, "stages_ms": {}}]) == []


def test_a_probe_names_its_slowest_requests_with_what_may_explain_them():
    traces = [_trace(chunks=((0.05 + 0.01 * i, 1.0),)) for i in range(20)]
    for i, t in enumerate(traces):
        t.stages_ms, t.drawn_s = {"frontend": 1.0 * i, "token2wav": 10.0 * i}, 2.0
    traces[-1].cold_voice, traces[-1].prompt_s = True, 9.5  # the slowest: a cold 9.5 s voice
    row = Probe(4, traces, window_s=60).summary(SLO)
    assert [r["ttfa_ms"] for r in row["slowest"]] == [240.0, 230.0, 220.0, 210.0, 200.0]
    assert row["slowest"][0] == {"ttfa_ms": 240.0, "cold_voice": True, "prompt_s": 9.5, "drawn_s": 2.0,
                                 "underruns": 0, "stages_ms": {"frontend": 19.0, "token2wav": 190.0}}
    assert row["stages_ms_cold"] == {"frontend": [19.0, 19.0], "token2wav": [190.0, 190.0]}
    table = "\n".join(_slowest_table([{**row, "load": 4}]))
    assert "| load | first audio ms | cold | prompt s | drawn s | frontend | token2wav |" in table
    assert "| 4 | 240 | yes | 9.5 | 2.0 | 19 | 190 |" in table and "| 4 | 230 | no | - | 2.0 | 18 | 180 |" in table
    assert _slowest_table([{"load": 1}]) == []  # reports from before the field


def test_the_report_says_what_served_the_probes():
    """The model (or that none ran: a --timed run) and the serve level's HTTP path."""
    workload = {"slo_ttfa_p99_ms": 300, "slo_underruns": 0, "mix": "100 % 1-2 s", "prompt_s": 3.48, "seed": 0,
                "window_s": 60, "ramp_s": 5, "level": "serve", "family": "cosyvoice2", "model": "m"}
    doc = {"device": "cpu", "date": "2026-12-05", "searches": []}
    plain = markdown({**doc, "workload": {**workload, "random_weights": True}}, [])
    assert "Random weights: the audio is noise" in plain and "HTTP path" not in plain
    timed = markdown({**doc, "workload": {**workload, "timing_model": "h200_gil",
                                          "http_proxy": "HAProxy with direct ingress"}}, [])
    assert "**No model ran**" in timed and "(profile h200_gil)" in timed and "Random weights" not in timed
    assert "HTTP path: HAProxy with direct ingress." in timed
    assert "`t2w busy`" not in plain  # the removed simulation's lane columns, explained in its reports only
    replica = markdown({**doc, "workload": {**workload, "level": "replica", "random_weights": True}}, [])
    assert "only the finishing vocoder batches" in replica  # a record of it re-rendered (import_results)
    assert "**Note**" not in plain
    noted = markdown({**doc, "workload": {**workload, "notes": ["graphs short"]}}, [])
    assert "**Note**: graphs short." in noted


def test_a_search_cut_before_it_converged_reports_its_bracket():
    """The device call's limit cut a CosyVoice3 search after 27 met and 30 missed (H100 2026-12-06):
    no capacity is claimed, but the summary says between which loads it lies."""
    workload = {"slo_ttfa_p99_ms": 300, "slo_underruns": 0, "mix": "100 % 1-2 s", "prompt_s": 3.48, "seed": 0,
                "window_s": 60, "ramp_s": 5, "level": "synth", "family": "cosyvoice3", "model": "m"}
    probes = [{"load": n, "meets_slo": met} for n, met in ((24, True), (48, False), (36, False), (30, False), (27, True))]
    search = {"mode": "arm", "kind": "sessions", "capacity": None, "probes": probes}
    text = markdown({"device": "cpu", "date": "2026-12-06", "workload": workload, "searches": [search]}, [])
    assert "| arm | sessions | unfinished: 27 met, 30 missed |" in text
    # no bracket without a met and a missed load below it, or when they cross (a noisy probe)
    for loads in (((24, True),), ((24, False),), ((24, True), (12, False))):
        cut = {**search, "probes": [{"load": n, "meets_slo": m} for n, m in loads]}
        assert "| arm | sessions | - |" in markdown({"device": "cpu", "date": "2026-12-06", "workload": workload,
                                                    "searches": [cut]}, [])
    fixed = {**search, "kind": "loads"}  # A/B arms at fixed loads: nothing was cut
    assert "| arm | loads | - |" in markdown({"device": "cpu", "date": "2026-12-06", "workload": workload,
                                             "searches": [fixed]}, [])


def test_the_report_notes_flow_graphs_shorter_than_the_mixs_longest_request():
    """A config whose flow graphs end before the mix's longest request (3.48 s prompt + 20 s) is
    noted: its probes measure eager passes. The shipped config covers it; a timed (CPU) one has none."""
    work = Workload(Mix.parse(capacity_mod.DEFAULT_MIX), seed=0)
    shipped = AppArgs.from_file(ROOT / "configs/single-gpu.yaml")
    assert capacity_mod.graph_coverage(shipped, work) is None
    short = shipped.model_copy(update={"synthesizer": shipped.synthesizer.model_copy(update={"flow_graph_max_s": 20.0})})
    note = capacity_mod.graph_coverage(short, work)
    assert note is not None and "cover 20 s" in note and "23.5 s" in note
    cpu = short.model_copy(update={"synthesizer": short.synthesizer.model_copy(update={"device": "cpu"})})
    assert capacity_mod.graph_coverage(cpu, work) is None


def _threshold_probe(limit, seen):
    async def probe(load):
        seen.append(load)
        ttfa = 0.1 if load <= limit else 0.9
        return Probe(load, [_trace(chunks=((ttfa, 1.0),))], window_s=60)
    return probe


def test_sessions_search_doubles_then_bisects_to_the_largest_load_meeting_the_slo():
    seen = []
    cap, probes = sessions_search(_threshold_probe(13, seen), SLO, start=4, tolerance=0.0)
    assert cap == 13
    assert seen == [4, 8, 16, 12, 14, 13]
    assert [p.load for p in probes] == seen
    seen = []
    assert sessions_search(_threshold_probe(3, seen), SLO, start=16, tolerance=0.0)[0] == 3
    assert seen == [16, 8, 4, 2, 3]
    assert sessions_search(_threshold_probe(0, []), SLO, start=4)[0] == 0
    assert sessions_search(_threshold_probe(10**6, []), SLO, start=4, ceiling=64)[0] == 64


def test_rate_search_stops_within_its_tolerance():
    cap, probes = rate_search(_threshold_probe(3.3, []), SLO, start=1.0, tolerance=0.1)
    assert 3.0 <= cap <= 3.3
    assert all(p.summary(SLO)["meets_slo"] == (p.load <= 3.3) for p in probes)


class _AdvancingSelector(selectors.SelectSelector):
    """Where the loop would sleep until its next timer, virtual time jumps there instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self.loop = loop

    def select(self, timeout=None):
        if timeout is None:
            raise RuntimeError("deadlock: nothing ready and no timer")
        self.loop.now += max(0.0, timeout)
        return super().select(0)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time: timers fire in order, no wall-clock time passes."""

    def __init__(self) -> None:
        self.now = 1000.0
        super().__init__(selector=_AdvancingSelector(self))

    def time(self) -> float:
        return self.now


class FakeClock(Clock):
    """The driver's clock read from the virtual loop; its waits are the real ones (loop timers)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()


def run_virtual(coro):
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


class FakeTarget:
    """First audio after 100 ms, then chunks well ahead of playback; ``underrun_at`` makes that
    request's second chunk late."""

    def __init__(self, underrun_at: str | None = None) -> None:
        self.underrun_at = underrun_at
        self.calls: list[tuple[str, float, float]] = []  # (rid, submitted, audio_s)

    async def synthesize(self, rid, request, submitted_s):
        audio_s = request.drawn_s
        self.calls.append((rid, submitted_s, audio_s))
        second = 1.5 if rid == self.underrun_at else 0.3
        return _trace(t0=submitted_s, chunks=((0.1, 0.5), (second, audio_s - 0.5)))


def test_closed_loop_sessions_wait_out_playback_and_only_the_window_is_judged():
    target = FakeTarget()
    work = Workload(Mix.parse("1:2-4"), seed=3, window_s=60, ramp_s=5)
    probe = run_virtual(closed_loop(target, 3, work, SLO, clock=FakeClock()))
    s = probe.summary(SLO)
    assert s["meets_slo"] and s["requests"] == len(probe.traces) > 10
    t0, t1 = probe.span
    assert t1 - t0 == 60 and all(t0 <= tr.submitted_s < t1 for tr in probe.traces)
    by_session: dict[str, list] = {}
    for rid, at, audio in target.calls:
        by_session.setdefault(rid.split("-")[0], []).append((at, audio))
    assert len(by_session) == 3
    for calls in by_session.values():
        for (at, audio), (nxt, _) in itertools.pairwise(calls):
            assert nxt >= at + 0.1 + audio - 1e-4  # the previous answer played out (samples round down)
    starts = sorted(calls[0][0] for calls in by_session.values())
    assert len(set(starts)) == 3 and starts[-1] == t0  # staggered; the window opens at the last start


class _BusyTarget(FakeTarget):
    """Each answer takes 0.4 s to make (virtual time), then plays for its audio's length."""

    async def synthesize(self, rid, request, submitted_s):
        await asyncio.sleep(0.4)
        return await super().synthesize(rid, request, submitted_s)


@pytest.mark.parametrize("wait_playback", [True, False])
def test_one_session_probe_sends_back_to_back_without_waiting_out_playback(wait_playback):
    """The one-session latency probe (wait_playback False) submits each request when the previous
    answer is made, not when it has played out: a 15 s window held two requests on an H100
    (2026-12-06); sessions under load still wait out their playback."""
    target = _BusyTarget()
    work = Workload(Mix.parse("1:2-4"), seed=3, window_s=10, ramp_s=0, wait_playback=wait_playback)
    probe = run_virtual(closed_loop(target, 1, work, SLO, clock=FakeClock()))
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(target.calls)]
    if wait_playback:
        assert all(g >= 2.1 for g in gaps) and len(probe.traces) <= 5
    else:
        assert all(g == pytest.approx(0.4) for g in gaps) and len(probe.traces) >= 24  # 10 s / 0.4 s
    assert probe.summary(SLO)["meets_slo"]


def test_closed_loop_stops_at_the_first_underrun_in_the_window():
    target = FakeTarget(underrun_at="s0-3")
    work = Workload(Mix.parse("1:2-4"), seed=3, window_s=60, ramp_s=1)
    probe = run_virtual(closed_loop(target, 2, work, SLO, clock=FakeClock()))
    assert probe.aborted and "underrun" in probe.aborted
    assert not probe.summary(SLO)["meets_slo"]
    assert max(at for _, at, _ in target.calls) < probe.span[0] + 30  # nobody went on to the window's end


def test_open_loop_arrivals_follow_the_rate():
    target = FakeTarget()
    work = Workload(Mix.parse("1:1-2"), seed=1, window_s=200, ramp_s=10)
    probe = run_virtual(open_loop(target, 2.0, work, SLO, clock=FakeClock()))
    assert 340 < len(probe.traces) < 460  # 400 expected in the window
    assert len(target.calls) > len(probe.traces)  # the warm-up's requests were sent, not judged
    assert probe.summary(SLO)["meets_slo"]


def _pcm_app(status=200, pieces=(b"\x01\x00\x02", b"\x00", b"")):
    async def speech(request):
        body = await request.json()
        assert body["stream"] is True and body["response_format"] == "pcm"
        if status != 200:
            return JSONResponse({"error": {"message": "busy"}}, status_code=status)

        async def gen():
            for p in pieces:
                yield p
        return StreamingResponse(gen(), media_type="audio/pcm",
                                 headers={"Server-Timing": "frontend;dur=2.50, token2wav;dur=40"})

    async def metrics(request):  # two synthesizer replicas in one scrape, and a series not counted
        return PlainTextResponse('tts_cuda_graph_captures_total{replica="a"} 400.0\n'
                                 'tts_cuda_graph_captures_total{replica="b"} 12.0\n'
                                 'tts_cuda_graph_misses_total{replica="a"} 5.0\n'
                                 'tts_cuda_graph_misses_total{replica="b"} 2.0\n'
                                 'tts_generated_tokens_total{replica="a"} 9.0\n'
                                 'tts_flow_passes_total{replica="a"} 30.0\n'
                                 'tts_flow_passes_total{replica="b"} 10.0\n'
                                 'tts_flow_rows_in_passes_total{replica="a"} 200.0\n'
                                 'tts_flow_rows_ready_total{replica="a"} 260.0\n'
                                 'tts_flow_prompt_prefix_hits_total{replica="a"} 90.0\n'
                                 'tts_flow_prompt_prefix_misses_total{replica="a"} 10.0\n'
                                 'tts_flow_prompt_cache_budget_bytes{replica="a"} 5368709120.0\n')
    return Starlette(routes=[Route("/v1/audio/speech", speech, methods=["POST"]), Route("/metrics", metrics)])


def test_http_target_counts_samples_across_split_chunks_and_reports_errors():
    async def run(app):
        target = HttpTarget("http://test", "v", transport=httpx.ASGITransport(app=app))
        return await target.synthesize("r1", 2.0, 0.0)

    tr = asyncio.run(run(_pcm_app()))
    assert tr.error is None and sum(tr.chunk_samples) == 2  # 4 bytes of 16-bit PCM, split 3 + 1
    assert tr.stages_ms == {"frontend": 2.5, "token2wav": 40.0}
    assert "429" in asyncio.run(run(_pcm_app(status=429))).error
    assert asyncio.run(run(_pcm_app(pieces=(b"",)))).error == "empty body"


def test_http_target_sums_the_replicas_graph_captures_and_a_probe_reports_the_growth():
    target = HttpTarget("http://test", "v", transport=httpx.ASGITransport(app=_pcm_app()))
    got = asyncio.run(target.counters())
    assert got == {"graph_captures": 412.0, "graph_misses": 7.0, "flow_passes": 40.0, "flow_rows_in_passes": 200.0,
                   "flow_rows_ready": 260.0, "flow_prompt_prefix_hits": 90.0, "flow_prompt_prefix_misses": 10.0,
                   "prompt_cache_gib": 5.0}
    assert counter_deltas({"graph_captures": 400.0, "graph_misses": 3.0}, got) == {"graph_captures": 12.0,
                                                                                  "graph_misses": 4.0}
    # the stepped token2wav's passes over the probe, the rows they carried and had in hand on average
    assert probe_counters({"flow_passes": 30.0, "flow_rows_in_passes": 50.0, "flow_rows_ready": 60.0}, got) == {
        "flow_passes": 10.0, "flow_rows_per_pass": 15.0, "flow_rows_ready_per_pass": 20.0, "prompt_cache_gib": 5.0}
    assert probe_counters({"flow_passes": 40.0, "flow_rows_in_passes": 200.0, "flow_rows_ready": 260.0}, got) == {
        "flow_passes": 0.0, "prompt_cache_gib": 5.0}
    # the prompt prefixes the flow reused over the probe, of those it looked up (the cache's hit rate)
    assert probe_counters({"flow_prompt_prefix_hits": 60.0, "flow_prompt_prefix_misses": 0.0}, got) == {
        "prompt_cache_gib": 5.0, "prompt_prefix_hit_pct": 75.0}


def test_http_target_reads_the_gc_pauses_of_the_synthesizer_and_the_ingress_from_metrics():
    def pauses(*pairs):  # (generation, pause s) collections on a fake clock
        now = [0.0]
        rec = GcPauses(clock=lambda: now[0])
        for gen, pause_s in pairs:
            rec.callback("start", {"generation": gen})
            now[0] += pause_s
            rec.callback("stop", {"generation": gen})
        return rec

    synth = pauses((0, 0.002), (2, 0.08), (2, 0.005))
    ingress = pauses((2, 0.03))
    late = iter([0.004, 0.02])
    gil = GilWait(period_s=0.02, clock=iter([0.0, 0.024, 0.0, 0.04]).__next__, sleep=lambda s: next(late))
    gil.tick(), gil.tick()  # 4 ms and 20 ms late
    text = IngressMetrics("i", gc_pauses=ingress).render({"replica_id": "s", "gc": synth.snapshot(),
                                                          "thread_cpu_seconds": {"engine-step": 4.5, "native": 1.0},
                                                          "gil_wait": gil.snapshot()})
    app = Starlette(routes=[Route("/metrics", lambda request: PlainTextResponse(text.decode()))])
    got = asyncio.run(HttpTarget("http://test", "v", transport=httpx.ASGITransport(app=app)).counters())
    assert got["gc_full"] == 2.0 and got["gc_slow"] == 1.0 and got["gc_pause_ms"] == pytest.approx(87.0)
    assert got["ingress_gc_full"] == 1.0 and got["ingress_gc_slow"] == 1.0
    assert got == {**got, **gc_counters(synth.snapshot()), **gc_counters(ingress.snapshot(), "ingress_gc")}
    assert got["cpu_s:engine-step"] == 4.5 and got["cpu_s:native"] == 1.0
    assert got["gil_readings"] == 2.0 and got["gil_slow"] == 1.0 and got["gil_wait_ms"] == pytest.approx(24.0)


def test_a_probe_reports_threads_as_cores_busy_and_the_mean_gil_wait():
    before = {"wall_s": 10.0, "cpu_s:engine-step": 1.0, "cpu_s:native": 0.5, "gil_readings": 100.0,
              "gil_wait_ms": 50.0, "gil_slow": 1.0, "graph_captures": 3.0}
    after = {**before, "wall_s": 20.0, "cpu_s:engine-step": 6.0, "cpu_s:native": 2.5, "cpu_s:new-thread": 1.0,
             "gil_readings": 600.0, "gil_wait_ms": 350.0, "gil_slow": 4.0}
    got = probe_counters(before, after)
    assert got == {"threads_busy": {"engine-step": 0.5, "native": 0.2, "new-thread": 0.1}, "gil_wait_mean_ms": 0.6,
                   "gil_wait_ms": 300.0, "gil_slow": 3.0, "graph_captures": 0.0}
    table = "\n".join(_thread_table([{"load": 2, **got}, {"load": 1, "threads_busy": {"native": 0.1, "x": 0.05}}]))
    assert "| load | engine-step | native | new-thread | others |" in table
    assert "| 1 | 0.00 | 0.10 | 0.00 | 0.05 |" in table and "| 2 | 0.50 | 0.20 | 0.10 | 0.00 |" in table


def test_served_model_describes_what_the_health_endpoint_reports(monkeypatch):
    bodies = iter([
        {"synthesizer_replicas": {"r1": {"mode": "pytorch", "runtime": {
            "family": "cosyvoice2", "llm_params_m": 505.2, "random_weights": True, "t2w_scheduler": "steps"}}}},
        {"synthesizer_replicas": {"r1": {"runtime": {"family": "cosyvoice3", "random_weights": False}}}},
        {"synthesizer_replicas": {}},
    ])
    monkeypatch.setattr(capacity_mod.httpx, "get", lambda url, timeout: SimpleNamespace(json=lambda: next(bodies)))
    assert capacity_mod.served_model("http://x") == (
        "cosyvoice2, 505.2M-parameter LLM, random weights, mode pytorch, token2wav scheduler steps", True)
    assert capacity_mod.served_model("http://x") == ("cosyvoice3, trained weights", False)
    assert capacity_mod.served_model("http://x") == ("family not reported, weights not reported", False)


def test_text_for_asks_the_random_model_for_about_the_drawn_length():
    rng = random.Random(0)
    assert len(text_for(8.0, rng)) == 10 and len(text_for(0.1, rng)) == 2
    assert not set(text_for(20.0, rng)) & set("thearinos")  # no letter that starts a tiny-tokenizer merge


def _local_config(tmp_path, scheduler: str):
    text = (ROOT / "configs/local.yaml").read_text()
    assert "token2wav: {max_batch_size: 4, batch_wait_timeout_s: 0.005}" in text
    path = tmp_path / f"local-{scheduler}.yaml"
    path.write_text(text.replace("batch_wait_timeout_s: 0.005}", f"batch_wait_timeout_s: 0.005, scheduler: {scheduler}}}"))
    return path


def test_in_process_level_runs_the_configs_deployments_without_ray(tmp_path, monkeypatch):
    """--level synth: the config's frontend and synthesizer objects in this process, requests
    through the ingress's path (prepare, then the synthesizer's stream), first audio by stage;
    with the torch threads the config gives its replicas (local.yaml: OMP_NUM_THREADS=1)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "unset")  # restored after the test, whatever main sets
    monkeypatch.delenv("OMP_NUM_THREADS")
    threads = []
    monkeypatch.setattr(capacity_mod.torch, "set_num_threads", threads.append)
    main(["--level", "synth", "--config", str(_local_config(tmp_path, "steps")), "--window-s", "2", "--ramp-s", "0.2",
          "--start", "1", "--max-sessions", "1", "--c1-window-s", "1", "--no-open-loop", "--mix", "1:1-2",
          "--ttfa-ms", "60000", "--out", str(tmp_path), "--workload", "synthetic"])
    doc = json.loads(next(tmp_path.glob("capacity-synth-cpu-*.json")).read_text())
    assert doc["workload"]["level"] == "synth"
    assert doc["workload"]["model"].startswith("cosyvoice2, ") and "token2wav scheduler steps" in doc["workload"]["model"]
    probe = doc["searches"][0]["probes"][0]
    assert doc["searches"][0]["mode"] == "local-steps-in-process" and probe["requests"] >= 1
    assert probe["graph_captures"] == 0  # no CUDA here
    assert probe["flow_passes"] > 0 and probe["flow_rows_per_pass"] >= 1  # the stepped token2wav's passes
    assert probe["flow_rows_ready_per_pass"] >= probe["flow_rows_per_pass"]
    stages = probe["stages_ms"]
    assert {"frontend", "llm-first-token", "token2wav", "t2w-queue", "t2w-solve", "t2w-return"} <= set(stages)
    assert threads == [1]


def test_in_process_first_audio_is_the_first_chunk_with_samples(monkeypatch):
    """An empty stamped first chunk is not audio: first audio and the handoff are timed at the
    chunk with samples, the synthesizer's stage stamps still read from the stamped one."""
    class Frontend:
        async def prepare(self, req):
            return req

    class Synth:
        async def synthesize(self, prepared):
            stamps = {"first_token": 10.0, "first_chunk_tokens": 20.0, "first_audio": 30.0}
            yield AudioChunk(prepared.request_id, np.zeros(0, np.float32), 24000, 0, 0, timing=stamps)
            yield AudioChunk(prepared.request_id, np.zeros(480, np.float32), 24000, 1, 0, is_last=True)

    async def make():
        return Frontend(), Synth()

    ticks = iter([0.0, 1.0, 2.0, 5.0])  # started, prepared, the empty chunk, the chunk with audio
    monkeypatch.setattr(targets_mod, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    target = InProcessTarget(make, "v")
    try:
        trace = target.call(target._one("r1", 1.0, 0.0))
    finally:
        target.close()
    assert trace.error is None and trace.chunk_times_s == [5.0]
    assert trace.stages_ms["first-audio"] == 5000.0 and trace.stages_ms["frontend"] == 1000.0
    assert trace.stages_ms["token2wav"] == 10.0 and trace.stages_ms["handoff"] == 4000.0 - 30.0


def test_the_in_process_level_and_local_serve_give_the_configs_replica_env():
    app = application_of(yaml.safe_load(Path("configs/single-gpu.yaml").read_text()))
    assert config_env(app) == {"OMP_NUM_THREADS": "2", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert config_env({"args": {}}) == {}


def test_in_process_level_refuses_the_batch_scheduler(tmp_path):
    with pytest.raises(ValueError, match="needs token2wav.scheduler steps"):
        main(["--level", "synth", "--config", str(_local_config(tmp_path, "batch")), "--out", str(tmp_path),
              "--workload", "synthetic"])


def test_in_process_arms_are_the_configs_replica_with_overrides_one_search_each(tmp_path, monkeypatch):
    """--arm: one fresh replica of the config per arm (its overrides applied and validated by the
    product), one search each under the arm's label; the arms' overrides are noted in the report."""
    seen = {}

    def searches(args, run, label, target, sampler, settle=None):
        seen[label] = (target.synth.cfg.gc_freeze, target.synth.plan.token2wav.cv2.streamed)

    monkeypatch.setattr(capacity_mod, "_searches", searches)
    main(["--level", "synth", "--config", str(_local_config(tmp_path, "steps")), "--out", str(tmp_path),
          "--workload", "synthetic", "--arm", "base", "--arm", "nofreeze:gc_freeze=false,token2wav.cv2_flow=incremental"])
    assert seen == {"local-steps-in-process-base": (True, "recompute"),
                    "local-steps-in-process-nofreeze": (False, "incremental")}
    doc = json.loads(next(tmp_path.glob("capacity-synth-cpu-*.json")).read_text())
    assert doc["workload"]["notes"] == ["arm base: -", "arm nofreeze: gc_freeze=False, token2wav.cv2_flow=incremental"]


def test_arms_are_refused_at_the_serve_level(tmp_path):
    with pytest.raises(SystemExit, match="--arm is for the synth level"):
        main(["--level", "serve", "--arm", "a:dtype=float32", "--out", str(tmp_path)])


def test_a_replica_failure_stops_the_search_instead_of_reading_as_an_slo_miss(tmp_path):
    class DyingTarget:
        failed = None

        async def counters(self):
            return {}

        async def synthesize(self, rid, audio_s, submitted_s):
            self.failed = RuntimeError("CUDA error")
            return RequestTrace(submitted_s=submitted_s, error="replica failed: CUDA error")

    args = parse_args(["--out", str(tmp_path), "--window-s", "1", "--ramp-s", "0", "--start", "2"])
    run = Run(args, Workload(Mix.parse("1:1-2"), window_s=1, ramp_s=0), SLO, "cpu")
    with pytest.raises(RuntimeError, match="replica failed during the sessions probe at 2"):
        _searches(args, run, "m", DyingTarget(), sampler=None)
    assert run.searches[0]["capacity"] is None and len(run.searches[0]["probes"]) == 1
    assert not (tmp_path / "latest.json").exists()  # no capacity was claimed


def test_a_cosyvoice3_run_is_named_apart_and_each_level_keeps_its_device(tmp_path):
    """A CosyVoice3 serve run on 2026-12-05 overwrote that day's CosyVoice2 report and put its
    capacity under latest.json's CosyVoice2 key: now it has its own report and latest file, and
    each level's figure says which machine and day it came from."""
    (tmp_path / "latest.json").write_text(json.dumps({"device": "NVIDIA H200", "slo_streams": 42}))
    probe = Probe(10, [_trace(chunks=((0.1, 1.0), (2.0, 1.0)))] * 3, window_s=60).summary(SLO)
    for family, level, device, capacity in (("cosyvoice3", "serve", "NVIDIA H100", 10),
                                            ("cosyvoice2", "serve", "NVIDIA H100", 52)):
        args = parse_args(["--out", str(tmp_path), "--level", level, "--family", family])
        run = Run(args, Workload(Mix.parse("1:1-2"), window_s=1, ramp_s=0), SLO, device)
        run.searches.append({"mode": "single-gpu", "kind": "sessions", "capacity": capacity, "probes": [probe]})
        run.write()
    cv3 = json.loads((tmp_path / "cosyvoice3-latest.json").read_text())
    assert cv3["slo_streams_serve"] == 10 and cv3["slo_streams_serve_device"] == "NVIDIA H100"
    cv2 = json.loads((tmp_path / "latest.json").read_text())
    assert cv2["slo_streams_serve"] == 52 and cv2["slo_streams_serve_device"] == "NVIDIA H100"
    assert cv2["device"] == "NVIDIA H200" and cv2["slo_streams"] == 42  # the replica level's, kept
    stems = sorted(path.name for path in tmp_path.glob("capacity-*.json"))
    assert stems == [f"capacity-serve-cosyvoice3-nvidia-h100-{run.date}.json", f"capacity-serve-nvidia-h100-{run.date}.json"]


class _FixedTarget:
    """Every request: its first (and only) 10 ms of audio ``first_audio_s`` after submission."""

    def __init__(self, first_audio_s: float) -> None:
        self.first_audio_s = first_audio_s

    async def counters(self):
        return {}

    async def synthesize(self, rid, audio_s, submitted_s):
        trace = RequestTrace(submitted_s=submitted_s)
        trace.add_chunk(submitted_s + self.first_audio_s, 240)
        return trace


def test_no_sessions_searches_only_the_rate_and_latest_json_takes_it_per_level(tmp_path, monkeypatch):
    """--no-sessions: the one-session probe and the Poisson rate (a lease call's time for the rate
    alone); the rate goes to latest.json under the level's key with its device, and first audio
    at one session with it."""
    searched = []
    monkeypatch.setattr(capacity_mod, "sessions_search", lambda *a, **k: searched.append("sessions") or (9, []))
    monkeypatch.setattr(capacity_mod, "rate_search", lambda *a, **k: searched.append("rate") or (2.5, []))
    args = parse_args(["--out", str(tmp_path), "--level", "serve", "--no-sessions", "--c1-window-s", "0.05"])
    run = Run(args, Workload(Mix.parse("1:1-2"), window_s=1, ramp_s=0), SLO, "NVIDIA H100")
    _searches(args, run, "single-gpu", _FixedTarget(first_audio_s=0.04), sampler=None)
    run.write()
    assert searched == ["rate", "rate"] and [s["kind"] for s in run.searches] == ["one-session", "rate"]
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["slo_rate_rps_serve"] == 2.5 and latest["slo_rate_rps_serve_device"] == "NVIDIA H100"
    assert latest["slo_rate_rps_p95_serve"] == 2.5 and latest["slo_rate_rps_p95_serve_workload"] == "synthetic"
    assert latest["ttfb_p50_ms_c1_serve"] == pytest.approx(40.0) and "slo_streams_serve" not in latest
    assert "slo_rate_rps" not in latest  # the replica level's key is its own


def test_loads_probes_each_given_load_and_claims_no_capacity(tmp_path, monkeypatch):
    """--loads 8,4: A/B arms at fixed loads (a night A/B's arms spent their time bisecting down
    from a missed 56): each load probed once, in order, whatever its verdict, then the one-session
    probe; no search runs and latest.json gets no capacity from them."""
    monkeypatch.setattr(capacity_mod, "sessions_search", lambda *a, **k: pytest.fail("no search with --loads"))
    args = parse_args(["--out", str(tmp_path), "--level", "synth", "--loads", "8,4", "--no-open-loop",
                       "--c1-window-s", "0.05"])
    run = Run(args, Workload(Mix.parse("1:1-2"), window_s=0.2, ramp_s=0), SLO, "NVIDIA H100")
    _searches(args, run, "arm-a", _FixedTarget(first_audio_s=0.4), sampler=None)  # misses the SLO
    run.write()
    loads, one = run.searches
    assert loads["kind"] == "loads" and [p["load"] for p in loads["probes"]] == [8, 4]
    assert not any(p["meets_slo"] for p in loads["probes"]) and loads["capacity"] is None
    assert one["kind"] == "one-session" and [p["load"] for p in one["probes"]] == [1]
    assert not (tmp_path / "latest.json").exists()  # nothing measured a capacity: nothing written
    assert "| arm-a | loads | - |" in (tmp_path / f"{run.stem}.md").read_text()


def test_streams_in_flight_follow_littles_law():
    one = _trace(chunks=((0.1, 1.0), (2.0, 1.0)))  # open for 2 s
    assert Probe(1, [one] * 30, window_s=60).summary(SLO)["streams_in_flight_mean"] == 1.0


def test_a_new_capacity_replaces_its_throughput_in_flight_and_hand_note(tmp_path, monkeypatch):
    """Each level writes the throughput and streams in flight at its own capacity, and drops the
    hand-written note of the value it replaces (the late H100 lease's 62 over HTTP kept the 52's
    note and throughput, 2026-12-05); other levels' keys stay."""
    (tmp_path / "latest.json").write_text(json.dumps({
        "slo_streams_serve": 52, "slo_streams_serve_note": "52 met ...", "throughput_x_realtime_at_slo_serve": 49.7,
        "slo_streams_in_flight_serve": 12.2, "slo_streams_in_flight_serve_note": "at 52 ...",
        "slo_streams": 42, "slo_streams_note": "replica level", "throughput_x_realtime_at_slo": 42.2}))

    def search(probe, slo, **kw):  # probes two loads through the real probe, claims the one that met
        for load in (2, 3):
            asyncio.run(probe(load))
        return 2, []

    monkeypatch.setattr(capacity_mod, "sessions_search", search)
    args = parse_args(["--out", str(tmp_path), "--level", "serve", "--no-open-loop", "--c1-window-s", "0.05"])
    run = Run(args, Workload(Mix.parse("1:1-2"), window_s=0.5, ramp_s=0), SLO, "NVIDIA H100")
    _searches(args, run, "single-gpu", _FixedTarget(first_audio_s=0.04), sampler=None)
    latest = json.loads((tmp_path / "latest.json").read_text())
    at_two = run.searches[0]["probes"][0]
    assert at_two["load"] == 2 and latest["slo_streams_serve"] == 2
    assert latest["throughput_x_realtime_at_slo_serve"] == at_two["throughput_x_realtime"] != 49.7
    assert latest["slo_streams_in_flight_serve"] == at_two["streams_in_flight_mean"] != 12.2
    assert "slo_streams_serve_note" not in latest and "slo_streams_in_flight_serve_note" not in latest
    assert latest["slo_streams_note"] == "replica level" and latest["throughput_x_realtime_at_slo"] == 42.2
    assert latest["slo_streams_serve_lower_bound"] is False


def test_a_search_that_passes_its_ceiling_reports_a_lower_bound(tmp_path, monkeypatch):
    """--max-sessions 3 and every probe met the SLO: the capacity is at least 3, not 3 (a lease's
    62 -> 68 search passed both, 2026-12-06); the report and latest.json say so."""
    def search(probe, slo, ceiling, **kw):
        asyncio.run(probe(ceiling))
        return ceiling, []

    monkeypatch.setattr(capacity_mod, "sessions_search", search)
    args = parse_args(["--out", str(tmp_path), "--level", "synth", "--no-open-loop", "--max-sessions", "3",
                       "--c1-window-s", "0.05"])
    run = Run(args, Workload(Mix.parse("1:1-2"), window_s=0.5, ramp_s=0), SLO, "NVIDIA H100")
    _searches(args, run, "arm", _FixedTarget(first_audio_s=0.04), sampler=None)
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["slo_streams"] == 3 and latest["slo_streams_lower_bound"] is True  # synth: the replica level
    assert "| arm | sessions | >= 3 sessions (the search's ceiling) |" in (tmp_path / f"{run.stem}.md").read_text()
