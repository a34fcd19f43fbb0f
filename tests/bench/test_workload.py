"""The capacity tool's workloads (bench/workload.py, bench/corpus.py): corpus sentences the
service's normaliser rewrites, 1-4 per request, seeded; a voice pool with one voice per session;
cold voices registered just before their request; the p95 criterion of the Poisson search; the
workload object in the result JSON and latest.json; the production workload end to end on the
tiny model in process."""
from __future__ import annotations

import asyncio
import io
import json
import random
import re
from collections import Counter
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bench import capacity as capacity_mod
from bench import workload as workload_mod
from bench.capacity import Run, _searches, main, parse_args
from bench.capacity_load import Mix, Probe, Slo, Workload, closed_loop, open_loop, rate_search
from bench.capacity_targets import HttpTarget
from bench.corpus import SPEAKING_RATE, Sentence, corpus, expected_seconds
from bench.metrics import RequestTrace
from bench.workload import PROMPT_RATE, ProductionSource, SyntheticSource, Utterance, length_summary, parse_shares
from cosyvoice_runtime.frontend.normalize import TextNormalizer
from tests.bench.test_capacity import FakeClock, _local_config, run_virtual

SLO = Slo()


def _sentences(lang: str):
    return [s for group in corpus()[lang] for s in group]


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_corpus_makes_the_services_normaliser_rewrite_numbers_dates_and_units(lang):
    """Through the project's normaliser (wetext + rules): nearly every sentence carries a number,
    date, amount or unit that comes out as words; a few plain ones carry none."""
    norm = TextNormalizer()
    sentences = _sentences(lang)
    assert len(sentences) >= 150
    with_digits = [s for s in sentences if re.search(r"\d", s.text)]
    assert len(with_digits) >= 0.8 * len(sentences) and len(with_digits) < len(sentences)
    for s in with_digits:
        spoken = norm.normalize(s.text, split=False)
        assert spoken == s.spoken and spoken != s.text and not re.search(r"\d", spoken)
    text = " ".join(s.text for s in sentences)
    marks = ("$", "%", "USD", "km", "kg", "Dr.", "Mr.", "approx.", "incl.", ":") if lang == "en" else \
        ("元", "%", "℃", "年", "月", "公里", "公斤", ":", "PM2.5")
    assert all(m in text for m in marks)
    assert "kilometers" in " ".join(s.spoken for s in sentences) if lang == "en" else "摄氏度" in \
        "".join(s.spoken for s in sentences)


def test_expected_seconds_read_the_spoken_words_at_the_stated_rate():
    assert expected_seconds("twenty-three dollars and five cents", "en") == pytest.approx(6 / SPEAKING_RATE["en"])
    assert expected_seconds("您的余额为七十元。", "zh") == pytest.approx(8 / SPEAKING_RATE["zh"])
    assert expected_seconds("航班CA一千", "zh") == pytest.approx(4 / SPEAKING_RATE["zh"] + 1 / SPEAKING_RATE["en"])


def test_requests_hold_one_to_four_sentences_in_the_stated_shares_and_languages():
    source = ProductionSource(voices=4, cold_share=0.0)
    rng = random.Random(0)
    draws = [source.draw(rng, 0) for _ in range(4000)]
    counts = Counter(u.sentences for u in draws)
    assert set(counts) == {1, 2, 3, 4}
    for k, share in ((1, 0.4), (2, 0.3), (3, 0.2), (4, 0.1)):
        assert abs(counts[k] / len(draws) - share) < 0.03
    zh = sum(bool(re.search(r"[\u4e00-\u9fff]", u.text)) for u in draws) / len(draws)
    assert abs(zh - 0.5) < 0.03
    # the drawn length is the sentences' expected speech: a longer request means more
    by_count = {k: sum(u.drawn_s for u in draws if u.sentences == k) / counts[k] for k in counts}
    assert by_count[1] < by_count[2] < by_count[3] < by_count[4]
    assert all(0 < u.drawn_s <= source.longest_s for u in draws)
    only_en = ProductionSource(voices=2, sentences="2:1", languages="en:1")
    u = only_en.draw(rng, 0)
    assert u.sentences == 2 and not re.search(r"[\u4e00-\u9fff]", u.text)
    for bad in ("5:1", "1:0", "x", ""):
        with pytest.raises(ValueError):
            parse_shares(bad, keys=("1", "2", "3", "4"))


def test_the_same_seed_draws_the_same_requests_and_voices():
    def draws(seed: int, rng_seed: int):
        source = ProductionSource(seed=seed, voices=16, cold_share=0.2)
        rng = random.Random(rng_seed)
        return [(u.text, u.drawn_s, u.voice.voice_id, u.voice.prompt_text, u.cold) for u in
                (source.draw(rng, i % 5) for i in range(200))]

    assert draws(0, 1) == draws(0, 1)
    assert draws(0, 1) != draws(0, 2)
    a, b = ProductionSource(seed=0, voices=16), ProductionSource(seed=1, voices=16)
    assert [v.prompt_s for v in a.voices] != [v.prompt_s for v in b.voices]


def test_the_pool_has_distinct_voices_with_prompts_in_range():
    source = ProductionSource(voices=256, prompt_s=(3.0, 10.0))
    assert len({v.voice_id for v in source.voices}) == 256 and len({v.content for v in source.voices}) == 256
    assert all(3.0 <= v.prompt_s <= 10.0 and v.prompt_text for v in source.voices)
    assert max(v.prompt_s for v in source.voices) > 9 and min(v.prompt_s for v in source.voices) < 4
    wav, rate = sf.read(io.BytesIO(source.voices[0].wav()))
    assert rate == PROMPT_RATE and len(wav) == int(source.voices[0].prompt_s * PROMPT_RATE)
    assert (source.voices[0].audio() != source.voices[1].audio()[:len(source.voices[0].audio())]).any()
    # one voice per session, distinct while sessions <= voices
    assert len({source.session_voice(i).voice_id for i in range(256)}) == 256
    assert source.session_voice(256) == source.session_voice(0)


class RecordingTarget:
    """First audio 100 ms after submission, then the request's drawn length at once; records the
    voice of each request and the voices added and removed, in order."""

    def __init__(self, register_s: float = 0.0) -> None:
        self.register_s = register_s
        self.events: list[tuple[str, str]] = []
        self.requests: list[tuple[str, Utterance]] = []

    async def add_voice(self, spec):
        await asyncio.sleep(self.register_s)
        self.events.append(("add", spec.voice_id))

    async def remove_voice(self, voice_id):
        self.events.append(("remove", voice_id))

    async def synthesize(self, rid, request, submitted_s):
        self.events.append(("speak", request.voice.voice_id))
        self.requests.append((rid, request))
        await asyncio.sleep(0.1)
        trace = RequestTrace(submitted_s=submitted_s)
        trace.add_chunk(submitted_s + 0.1, int(2 * request.drawn_s * trace.sample_rate))  # served twice as long
        return trace


def test_each_session_keeps_one_voice_of_the_pool_and_sessions_do_not_share():
    source = ProductionSource(voices=8, cold_share=0.0)
    target = RecordingTarget()
    work = Workload(seed=2, window_s=40, ramp_s=2, source=source)
    probe = run_virtual(closed_loop(target, 6, work, SLO, clock=FakeClock()))
    by_session: dict[str, set] = {}
    for rid, request in target.requests:
        by_session.setdefault(rid.split("-")[0], set()).add(request.voice.voice_id)
    assert len(by_session) == 6 and all(len(v) == 1 for v in by_session.values())
    assert len(set.union(*by_session.values())) == 6  # distinct
    s = probe.summary(SLO)
    assert s["cold_voice_requests"] == 0 and s["served_over_drawn_p50"] == pytest.approx(2.0, abs=0.01)
    # open loop: each arrival is a caller of its own, voices drawn across the pool
    target = RecordingTarget()
    run_virtual(open_loop(target, 4.0, Workload(seed=1, window_s=30, ramp_s=0, source=source), SLO, clock=FakeClock()))
    assert len({r.voice.voice_id for _, r in target.requests}) == 8


def test_cold_voices_take_their_share_are_registered_before_and_removed_after_and_not_timed():
    source = ProductionSource(voices=4, cold_share=0.3)
    target = RecordingTarget(register_s=1.0)  # a slow registration: not in first audio
    probe = run_virtual(open_loop(target, 5.0, Workload(seed=4, window_s=80, ramp_s=0, source=source), SLO,
                                  clock=FakeClock()))
    cold = [r for _, r in target.requests if r.cold]
    assert abs(len(cold) / len(target.requests) - 0.3) < 0.06
    pool = {v.voice_id for v in source.voices}
    assert all(r.voice.voice_id not in pool for r in cold) and len({r.voice.voice_id for r in cold}) == len(cold)
    for r in cold:  # added, spoken, removed, in that order
        vid = r.voice.voice_id
        order = [i for i, e in enumerate(target.events) if e[1] == vid]
        assert [target.events[i][0] for i in order] == ["add", "speak", "remove"]
    s = probe.summary(SLO)
    assert s["cold_voice_requests"] == sum(t.cold_voice for t in probe.traces) > 0
    assert s["ttfa_p99_ms"] == pytest.approx(100.0) and s["ttfa_cold_p95_ms"] == pytest.approx(100.0)
    prompts = {v.voice_id: v.prompt_s for v in source.voices} | {r.voice.voice_id: r.voice.prompt_s for r in cold}
    spoken = [r.voice.voice_id for _, r in target.requests]
    judged = Counter(t.prompt_s for t in probe.traces)  # the window's requests: some of those spoken
    assert judged and judged <= Counter(prompts[v] for v in spoken)  # each trace its voice's prompt length


def test_a_failed_cold_registration_is_a_failed_request():
    class Refusing(RecordingTarget):
        async def add_voice(self, spec):
            raise RuntimeError("HTTP 503")

    source = ProductionSource(voices=2, cold_share=1.0)
    probe = run_virtual(open_loop(Refusing(), 2.0, Workload(seed=0, window_s=5, ramp_s=0, source=source), SLO,
                                  clock=FakeClock()))
    assert probe.aborted and "registering cold voice" in probe.aborted
    assert not probe.summary(SLO)["meets_slo"]


def _probe_at(load: float, p95_limit: float, p99_limit: float) -> Probe:
    """100 requests: 90 at 50 ms; 10 at 200 ms above ``p95_limit`` rps; 2 at 400 ms above ``p99_limit``."""
    ttfas = [0.05] * 100
    if load > p95_limit:
        ttfas[:10] = [0.2] * 10
    if load > p99_limit:
        ttfas[:2] = [0.4] * 2
    traces = []
    for ttfa in ttfas:
        t = RequestTrace(submitted_s=0.0, drawn_s=2.0)
        t.add_chunk(ttfa, 48000)
        traces.append(t)
    return Probe(load, traces, window_s=60)


def test_the_p95_criterion_finds_its_own_rate():
    p95 = Slo(ttfa_p99_ms=float("inf"), ttfa_p95_ms=150.0)
    row = _probe_at(5, 3, 6).summary(p95)
    assert row["ttfa_p95_ms"] == pytest.approx(200.0) and not row["meets_slo"] and SLO.meets(row)

    async def probe(load):
        return _probe_at(load, 3.0, 6.0)

    assert rate_search(probe, SLO, start=1.0, tolerance=0.05)[0] == pytest.approx(6.0, rel=0.06)
    assert rate_search(probe, p95, start=1.0, tolerance=0.05)[0] == pytest.approx(3.0, rel=0.06)


def test_the_rate_is_searched_for_both_criteria_on_one_set_of_probes_and_latest_json_names_the_workload(
        tmp_path, monkeypatch):
    """The open loop is searched for p99 <= 300 ms and for p95 <= 150 ms (slo_rate_rps_p95); a rate
    is probed once and judged by both. The result JSON and latest.json carry the workload object."""
    probed = []

    async def fake_open_loop(target, rate, work, slo):
        probed.append(rate)
        return _probe_at(rate, 3.0, 6.0)

    monkeypatch.setattr(capacity_mod, "open_loop", fake_open_loop)
    (tmp_path / "latest.json").write_text(json.dumps({"slo_streams": 42, "throughput_x_realtime": 9.0}))
    args = parse_args(["--out", str(tmp_path), "--level", "synth", "--no-sessions", "--c1-window-s", "0.05",
                       "--tolerance", "0.05", "--voices", "4"])
    source = ProductionSource(voices=4, cold_share=0.1)
    run = Run(args, Workload(seed=0, window_s=0.1, ramp_s=0, source=source), SLO, "NVIDIA H100")

    class Quick(RecordingTarget):
        async def counters(self):
            return {}

        async def synthesize(self, rid, request, submitted_s):
            trace = RequestTrace(submitted_s=submitted_s)
            trace.add_chunk(submitted_s + 0.01, int(request.drawn_s * trace.sample_rate))
            return trace

    _searches(args, run, "arm", Quick(), sampler=None)
    rates = next(s for s in run.searches if s["kind"] == "rate")
    assert len(probed) == len(set(probed))  # no rate probed twice
    assert sorted(p["load"] for p in rates["probes"]) == sorted(probed)
    assert rates["capacity"] == pytest.approx(6.0, rel=0.06) and rates["capacity_p95"] == pytest.approx(3.0, rel=0.06)
    assert all(p["meets_slo_p95"] == (p["load"] <= 3.0) for p in rates["probes"])
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["slo_rate_rps_p95"] == rates["capacity_p95"] and latest["slo_rate_rps"] == rates["capacity"]
    assert latest["slo_rate_rps_p95_workload"] == "production" and latest["slo_rate_rps_p95_device"] == "NVIDIA H100"
    assert latest["slo_streams"] == 42 and latest["throughput_x_realtime"] == 9.0  # other keys kept
    w = latest["workload"]
    assert w["name"] == "production" and w["voices"]["count"] == 4 and w["voices"]["prompt_s"] == [3.0, 10.0]
    assert w["cold_voice_share"] == 0.1 and w["slo_ttfa_p95_ms"] == 150.0
    assert w["text"]["corpus_sentences"]["en"] >= 150 and w["text"]["sentences_per_request_pct"]["1"] == 40.0
    # served against drawn: every request (fake probes, the one-session probe) served its drawn length
    assert w["served_length"]["served_over_drawn"] == {"p5": 1.0, "p50": 1.0, "p95": 1.0}
    doc = json.loads((tmp_path / f"{run.stem}.json").read_text())
    assert doc["workload"] == w
    report = (tmp_path / f"{run.stem}.md").read_text()
    assert report.splitlines()[0].endswith(", production workload")
    assert "Workload **production**" in report and "Served against drawn length" in report
    assert "p95 criterion: 3" in report and "| p95 ms |" in report


def test_a_synthetic_run_names_its_workload_and_an_old_report_reads_as_synthetic():
    from bench.capacity_report import markdown

    work = Workload(Mix.parse("1:1-2"))
    assert isinstance(work.source, SyntheticSource) and work.source.describe()["voices"]["count"] == 1
    w = {**work.source.describe(), "seed": 0, "window_s": 60, "ramp_s": 5, "prompt_s": 3.48, "slo_ttfa_p99_ms": 300,
         "slo_underruns": 0, "level": "synth", "family": "cosyvoice2"}
    doc = {"device": "cpu", "date": "2026-12-07", "searches": []}
    assert markdown({**doc, "workload": w}, []).splitlines()[0].endswith(", synthetic workload")
    old = {k: v for k, v in w.items() if k not in ("name", "text", "voices", "cold_voice_share")}
    text = markdown({**doc, "workload": old}, [])
    assert text.splitlines()[0].endswith(", synthetic workload") and "utterance mix 100 % 1-2 s" in text
    with pytest.raises(ValueError):
        Workload()


def test_length_summary_compares_served_with_drawn():
    got = length_summary([(2.0, 2.8), (4.0, 4.0), (1.0, 3.0), (None, 5.0)])
    assert got["requests"] == 3 and got["served_over_drawn"]["p50"] == 1.4
    assert got["drawn_s"]["p50"] == 2.0 and got["served_s"]["mean"] == pytest.approx(3.27, abs=0.01)
    assert length_summary([(None, 1.0)]) is None


def test_the_http_target_registers_speaks_in_and_removes_a_voice():
    seen = []

    async def voices(request):
        form = await request.form()
        audio = await form["audio"].read()
        seen.append(("add", form["voice_id"], form["prompt_text"], form["overwrite"], len(sf.read(io.BytesIO(audio))[0])))
        return JSONResponse({"voice_id": form["voice_id"]}, status_code=201)

    async def delete(request):
        seen.append(("delete", request.path_params["voice_id"]))
        return Response(status_code=204)

    async def speech(request):
        body = await request.json()
        seen.append(("speak", body["voice"], body["input"]))

        async def gen():
            yield b"\x00\x00" * 10
        return StreamingResponse(gen(), media_type="audio/pcm")

    app = Starlette(routes=[Route("/v1/voices", voices, methods=["POST"]),
                            Route("/v1/voices/{voice_id}", delete, methods=["DELETE"]),
                            Route("/v1/audio/speech", speech, methods=["POST"])])
    source = ProductionSource(voices=2)
    spec = source.voices[0]
    request = source.draw(random.Random(0), 0)

    async def go():
        target = HttpTarget("http://test", "fallback", transport=httpx.ASGITransport(app=app))
        await target.add_voice(spec)
        trace = await target.synthesize("r1", request, 0.0)
        await target.remove_voice(spec.voice_id)
        return trace

    trace = asyncio.run(go())
    assert trace.error is None and sum(trace.chunk_samples) == 10
    assert seen[0] == ("add", spec.voice_id, spec.prompt_text, "true", int(spec.prompt_s * PROMPT_RATE))
    assert seen[1] == ("speak", request.voice.voice_id, request.text) and seen[2] == ("delete", spec.voice_id)


def test_the_production_workload_runs_in_process_on_the_tiny_model(tmp_path, monkeypatch):
    """--level synth with the default workload: the pool registered through the config's
    frontend, text with numbers through its normaliser and the synthesizer, cold voices registered
    and removed; the report compares the served length with the drawn one. Short sentences: random
    weights speak to the length limit (~0.8 s a text token), which a CPU makes in about real time."""
    norm = TextNormalizer()
    short = {lang: tuple((Sentence(lang, t, norm.normalize(t, split=False), 1.0),) for t in texts)
             for lang, texts in (("en", ("Call 5.", "Gate 7.")), ("zh", ("共3元。", "第9号。")))}
    monkeypatch.setattr(workload_mod, "corpus", lambda: short)
    main(["--level", "synth", "--config", str(_local_config(tmp_path, "steps")), "--window-s", "2", "--ramp-s", "0.2",
          "--start", "2", "--max-sessions", "2", "--c1-window-s", "0.5", "--no-open-loop", "--voices", "3",
          "--prompt-s", "3-4", "--cold-voice-share", "0.5", "--sentences", "1:1", "--ttfa-ms", "60000",
          "--out", str(tmp_path)])
    doc = json.loads(next(tmp_path.glob("capacity-synth-cpu-*.json")).read_text())
    w = doc["workload"]
    assert w["name"] == "production" and w["voices"]["count"] == 3 and w["cold_voice_share"] == 0.5
    probe = next(s for s in doc["searches"] if s["kind"] == "sessions")["probes"][0]
    assert probe["requests"] >= 1 and probe["errors"] == 0 and probe["served_s_p50"] > 0
    assert w["served_length"]["requests"] >= probe["requests"] and w["served_length"]["drawn_s"]["p50"] == 1.0
    assert "production workload" in Path(tmp_path / f"{next(tmp_path.glob('capacity-synth-cpu-*.md')).name}").read_text()


def test_lengths_of_a_source_keep_its_draws_without_its_text_or_voices():
    """The live ramp's timed replicas get the production workload's lengths as synthetic requests."""
    from bench.workload import LengthsOf, ProductionSource

    prod = ProductionSource(seed=3, voices=4)
    lengths = LengthsOf(ProductionSource(seed=3, voices=4))
    a, b = random.Random(7), random.Random(7)
    for session in (0, 1, None, 2):
        want, got = prod.draw(a, session), lengths.draw(b, session)
        assert got.drawn_s == want.drawn_s > 0 and got.text is None and got.voice is None and not got.cold
    assert lengths.voices == () and lengths.name == "production-lengths"
    assert lengths.longest_s == prod.longest_s
    assert lengths.describe()["lengths_of"]["name"] == "production"
