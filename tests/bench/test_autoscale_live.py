"""The live autoscaling ramp (bench/autoscale_live.py): calibration from the readings, the recorded
policy, the bins and their figures, and a small ramp on a real local Ray with 2 logical GPUs."""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from bench import timed_fleet
from bench.autoscale_live import (
    Pause,
    RampShape,
    Sampler,
    SessionDriver,
    drive,
    join_offsets,
    record_of,
    recorded_policy,
)
from bench.autoscale_record import RecordedPolicy
from bench.autoscale_report import bins, markdown, summarise
from bench.metrics import RequestTrace
from bench.timed_fleet import calibrate, cold_start_record, factory_name
from tests.ray_env import SERVE_PROXY_TIMERS

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"max_replicas", "cut_streams", "p99_ttfa_ms_outside_scaleup_max", "replica_tracking", "cold_start_s_gpu",
        "series"}


def _probe(load: float, met: bool, streams: float, audio_s: float, first_token: float, first_chunk: float,
           solve: float = 40.0, busy: float = 0.5) -> dict:
    return {"load": load, "meets_slo": met, "streams_in_flight_mean": streams, "audio_s": audio_s, "window_s": 60.0,
            "stages_ms": {"llm-first-token": [first_token, 99.0], "llm-first-chunk": [first_chunk, 99.0],
                          "t2w-solve": [solve, 99.0]}, "threads_busy": {"compute-token2wav": busy}}


def _reading(tmp_path: Path, folder: str, probes: list[dict], device: str = "NVIDIA H100 80GB HBM3") -> Path:
    path = tmp_path / folder / "capacity-serve-x.json"
    path.parent.mkdir(parents=True)
    alone = _probe(1, True, 1.0, 50.0, first_token=6.0, first_chunk=6.0 + 24 * 1.5, solve=39.0)
    path.write_text(json.dumps({"device": device, "date": folder[:10],
                                "workload": {"slo_ttfa_p99_ms": 300.0, "voices": {"prompt_s": [3.0, 10.0]}},
                                "searches": [{"kind": "loads", "probes": probes},
                                             {"kind": "one-session", "probes": [alone]}]}))
    return path


def test_calibration_scales_each_lane_to_the_readings_own_stage_times(tmp_path):
    # the SLO probe's first chunk: 24 steps after the first token at 2.1 ms, token2wav busy 60 %
    probes = [_probe(20, True, 3.0, 900.0, first_token=10.0, first_chunk=10.0 + 24 * 2.1, busy=0.6),
              _probe(30, False, 5.0, 1000.0, first_token=10.0, first_chunk=200.0)]
    _reading(tmp_path, "2026-01-01-h100-production-old", [dict(probes[0], load=10)])
    newest = _reading(tmp_path, "2026-02-01-h100-production-new", probes)
    assert timed_fleet.newest_reading(tmp_path) == newest
    assert timed_fleet.FIRST_CHUNK_TOKENS == 25  # first hops of 10-34 tokens (mean 22) and 3 of look-ahead
    cal = calibrate(newest)
    assert (cal.sessions_per_replica, cal.slo_streams) == (20, 3.0)  # the largest load that met the SLO
    assert cal.stream_speed_x == pytest.approx(900.0 / 60.0 / 3.0)
    # the decode step alone is the one-session first chunk's: 1.5 ms a token after the first
    assert 1e3 * cal.times.step_s(1) == pytest.approx(1.5) and cal.step_ms_alone == pytest.approx(1.5)
    # one session's first-chunk solve (one row over a 6.5 s prompt's frames) takes the measured 39 ms
    solve = cal.times.encoder_s() + 10 * cal.times.pass_s(1, 2 * 25 * 6.5) + cal.times.vocoder_s(1)
    assert 1e3 * solve == pytest.approx(39.0)
    # at the SLO's 3 streams a step started while token2wav holds the GPU (60 % of the time) is
    # slowed so that the mean step is the measured 2.1 ms
    step = cal.times.step_s(3)
    assert 1e3 * step * (1 + 0.6 * cal.times.llm_slowdown) == pytest.approx(2.1, rel=1e-3)
    assert cal.times.host_frac == timed_fleet.H200.host_frac


def test_calibration_needs_the_one_session_probe(tmp_path):
    path = _reading(tmp_path, "2026-02-01-h100-production-new",
                    [_probe(20, True, 3.0, 900.0, first_token=10.0, first_chunk=60.0)])
    data = json.loads(path.read_text())
    data["searches"] = data["searches"][:1]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="one-session probe"):
        calibrate(path)


def test_the_shipped_calibration_and_cold_start_come_from_bench_results():
    cal = calibrate()
    assert cal.source.startswith("bench/results/") and "h100" in cal.source
    data = json.loads((ROOT / cal.source).read_text())
    assert cal.sessions_per_replica in {p["load"] for s in data["searches"] for p in s["probes"] if p["meets_slo"]}
    cold = cold_start_record()
    assert cold is None or json.loads((ROOT / cold["source"]).read_text())["cold_start_s"] == cold["cold_start_s"]


def test_cold_start_takes_the_newest_gpu_record(tmp_path):
    for folder, device, date, s in (("a", "cuda", "2026-01-01", 90.0), ("b", "cpu", "2026-03-01", 5.0),
                                    ("c", "cuda", "2026-02-01", 40.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "cold-start-x.json").write_text(json.dumps({"device": device, "date": date,
                                                                        "cold_start_s": s}))
    assert cold_start_record(tmp_path)["cold_start_s"] == 40.0
    assert cold_start_record(tmp_path / "a" / "none") is None


def test_cold_start_prefers_the_product_default_plan_over_a_newer_all_graphs_record(tmp_path):
    def record(name: str, date: str, s: float, before_ready: str | None) -> None:
        graphs = {"cuda_graphs": {"before_ready": before_ready}} if before_ready else {}
        (tmp_path / name).write_text(json.dumps({"device": "cuda", "date": date, "cold_start_s": s,
                                                 "replica": graphs}))

    record("cold-start-old.json", "2026-01-01", 107.0, None)  # predates graphs_before_ready: all graphs
    record("cold-start-first.json", "2026-02-01", 26.0, "first")
    record("cold-start-all.json", "2026-03-01", 68.0, "all")
    assert cold_start_record(tmp_path)["cold_start_s"] == 26.0  # loose files in the folder are read too
    assert cold_start_record(tmp_path, before_ready="all")["cold_start_s"] == 68.0
    (tmp_path / "cold-start-first.json").unlink()
    assert cold_start_record(tmp_path)["cold_start_s"] == 68.0  # none of the default plan: the newest


def test_cold_start_prefers_the_calibrated_card(tmp_path):
    for name, gpu, date, s in (("h100", "NVIDIA H100 80GB HBM3", "2026-01-01", 30.0),
                               ("h200", "NVIDIA H200", "2026-01-02", 25.0)):
        (tmp_path / f"cold-start-{name}.json").write_text(json.dumps({
            "device": "cuda", "gpu": gpu, "date": date, "cold_start_s": s,
            "replica": {"cuda_graphs": {"before_ready": "first"}}}))
    assert cold_start_record(tmp_path)["cold_start_s"] == 25.0  # no card asked: the newest
    assert cold_start_record(tmp_path, gpu="NVIDIA H100 80GB HBM3")["cold_start_s"] == 30.0
    assert cold_start_record(tmp_path, gpu="NVIDIA RTX 5090")["cold_start_s"] == 25.0  # none of it: the newest


def test_the_factory_name_carries_the_start_time():
    path = factory_name(3.25)
    module, _, attr = path.partition(":")
    assert module == "bench.timed_fleet" and callable(getattr(timed_fleet, attr))
    with pytest.raises(AttributeError):
        timed_fleet.__getattr__("calibrated_start_ms_x")


def test_the_ramp_goes_up_holds_bursts_and_comes_back_to_zero():
    shape = RampShape(up_s=100, plateau_s=50, burst_s=10, burst_share=0.5, hold_s=20, down_s=40, idle_s=30)
    pts = shape.points(4)
    assert pts[0] == (0, 0) and pts[1] == (100, 4) and pts[-1] == (shape.total_s, 0)
    assert max(v for _, v in pts) == 6 and (150, 6) in pts and (160, 4) in pts


class _Inner:
    def __init__(self, answer: int) -> None:
        self.answer = answer

    def __call__(self, ctx):
        return self.answer, {"load_pct": 90.0, "decision": self.answer, "reason": "load band", "skip": [1]}


def _ctx(n: int) -> SimpleNamespace:
    return SimpleNamespace(current_num_replicas=n, target_num_replicas=n, total_num_requests=3.0,
                           total_queued_requests=0.0, aggregated_metrics={"streams_in_flight": {"r1": 2.5}})


class _QuietSampler(Sampler):
    """The real sampler's thread and bins, without Ray: each sample says the fleet is at rest."""

    def sample(self):
        return {"t_s": 0.0, "states": {"RUNNING": 1}}


class _Driver:
    def __init__(self, interrupt: bool) -> None:
        self.interrupt, self.ran = interrupt, False

    async def run(self, t0: float) -> None:
        self.ran = True
        if self.interrupt:  # what asyncio.run raises when SIGINT cancels the ramp
            raise KeyboardInterrupt


def test_the_ramp_stands_still_at_its_pause_until_the_fleet_is_there():
    fleet = {"running": 1}
    driver = SessionDriver(None, None, None, 100.0, 0, False, None,
                           Pause(at_s=10.0, resume=lambda: fleet["running"] >= 2, guard_s=50.0))
    assert driver.ramp_time(5.0) == 5.0 and driver.resumed is None
    assert driver.ramp_time(12.0) == 10.0 and driver.ramp_time(30.0) == 10.0  # held at the pause
    fleet["running"] = 2
    assert driver.ramp_time(31.0) == pytest.approx(11.0) and driver.resumed is True
    assert driver.ramp_time(40.0) == pytest.approx(20.0) and driver.paused_s == pytest.approx(20.0)
    # a fleet that never gets there: the guard ends the pause, and the run says so
    stuck = SessionDriver(None, None, None, 100.0, 0, False, None, Pause(10.0, lambda: False, 50.0))
    assert stuck.ramp_time(59.0) == 10.0 and stuck.ramp_time(60.0) == pytest.approx(11.0)
    assert stuck.resumed is False


@pytest.mark.parametrize("interrupt", [False, True])
def test_drive_keeps_what_ran_when_the_ramp_is_interrupted(interrupt):
    sampler, driver = _QuietSampler(0.0, 0.01), _Driver(interrupt)
    settled, cut = drive(driver, sampler, 0.0, min_replicas=1, guard_s=60.0)  # returns at the first sample
    assert driver.ran and cut is interrupt and settled is not interrupt  # a cut ramp has not settled
    assert not sampler.is_alive() and sampler.samples  # the sampler stopped, its samples kept


def test_recorded_policy_returns_the_inner_answer_and_writes_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "INNER", lambda: _Inner(2), raising=False)
    record = tmp_path / "p.jsonl"
    policy = RecordedPolicy(f"{__name__}:INNER", {}, str(record), every_s=3600)
    assert policy(_ctx(1)) == (2, {"load_pct": 90.0, "decision": 2, "reason": "load band", "skip": [1]})
    policy(_ctx(1))  # the same answer within every_s: no line
    policy.policy.answer = 3
    policy(_ctx(2))
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    assert [(x["running"], x["decision"]) for x in lines] == [(1, 2), (2, 3)]
    assert lines[0]["streams_in_flight"] == {"r1": 2.5} and "skip" not in lines[0]["state"]


def test_the_build_wraps_the_real_policy_and_scales_its_delays(tmp_path):
    from deployments.options import AutoscalingKnobs

    knobs = AutoscalingKnobs(max_replicas=4, upscale_delay_s=15, downscale_delay_s=60, look_back_period_s=20,
                             load_band={"enabled": True, "slo_streams": 2.5})
    plain = knobs.serve_config()
    with recorded_policy(tmp_path / "r.jsonl", 0.5, every_s=1.0):
        cfg = knobs.serve_config()
    assert knobs.serve_config() == plain  # restored
    assert (cfg["upscale_delay_s"], cfg["downscale_delay_s"], cfg["look_back_period_s"]) == (7.5, 30, 10)
    kw = cfg["policy"]["policy_kwargs"]
    assert cfg["policy"]["policy_function"] == "bench.autoscale_record:RecordedPolicy"
    assert (kw["inner"], kw["inner_kwargs"]) == (plain["policy"]["policy_function"], plain["policy"]["policy_kwargs"])


def _run(**kw) -> dict:
    return {"bin_s": 1.0, "time_scale": 0.1, "sessions_per_replica_worth": 2.0, "settled": True,
            "shape_reference_s": {"up_s": 50.0, "burst_share": 0.25}, "cold_start_gpu": None,
            "autoscaling_reference": {"min_replicas": 1, "max_replicas": 2}, **kw}


def _five_bins() -> tuple[dict, list, list, list]:
    """(run, sessions open, samples, policy lines) of five 1 s bins; bins 2 and 3 scale up (a
    replica starting in 2, and the bin after it)."""
    open_per_s = [(t / 2, n, n) for t, n in enumerate([0, 0, 2, 2, 4, 4, 4, 4, 1, 1])]
    samples = [{"t_s": 0.5, "states": {"RUNNING": 1}}, {"t_s": 1.5, "states": {"RUNNING": 1}},
               {"t_s": 2.5, "states": {"RUNNING": 1, "STARTING": 1}}, {"t_s": 3.5, "states": {"RUNNING": 2}},
               {"t_s": 4.5, "states": {"RUNNING": 2, "STOPPING": 1}}]
    policy = [{"t_s": 2.2, "running": 1, "target": 1, "decision": 2, "streams_in_flight": {},
               "state": {"load_pct": 150.0}}]
    return _run(), open_per_s, samples, policy


REQ = {"session": 0, "audio_s": 2.0, "drawn_s": 2.0, "underruns": 0, "rejected_429": False, "error": None,
       "cut": False, "stages_ms": {}}


def test_bins_ideal_tracking_scale_up_and_cuts():
    run, open_per_s, samples, policy = _five_bins()
    requests = [dict(REQ, t_s=1.2, ttfa_ms=100.0), dict(REQ, t_s=3.7, ttfa_ms=200.0),
                dict(REQ, t_s=3.8, ttfa_ms=None, rejected_429=True, error="HTTP 429: full"),
                dict(REQ, t_s=4.1, ttfa_ms=150.0, cut=True, error="RemoteProtocolError")]
    rows = bins(run, open_per_s, requests, samples, policy)
    assert [r["ideal"] for r in rows] == [1, 1, 2, 2, 1]  # ceil(sessions / 2), within [1, 2]
    assert [r["running"] for r in rows] == [1, 1, 1, 2, 2]
    assert [r["scale_up"] for r in rows] == [False, False, True, True, False]
    assert rows[4]["draining"] == 1 and rows[2]["policy"]["asked_more"]
    s = summarise(run, open_per_s, requests, samples, policy)["summary"]
    assert s["cut_streams"] == 1 and s["rejected_429"] == 1 and s["errors"] == 1 and s["max_replicas"] == 2
    assert s["p99_ttfa_ms_outside_scaleup_max"] == 150.0  # bins 1 and 4 (100, 150 ms); 3.7 s fell in a scale-up
    assert s["replica_tracking"] == 1.0


def _stages(first_audio: float, proxy: float) -> dict[str, float]:
    return {"frontend": 4.0, "llm-first-token": 30.0, "first-audio": first_audio, "proxy": proxy}


def test_the_report_names_the_slowest_requests_outside_scale_up_and_of_the_run():
    run, open_per_s, samples, policy = _five_bins()
    # (sent s, first audio ms, session): seven in bins 0, 1 and 4, outside scale-up; the two slowest
    # in bins 2 and 3, inside (2.0 s: bin 2's first instant)
    sent = [(0.2, 110.0, 1), (0.9, 130.0, 2), (1.1, 300.0, 3), (1.5, 126.0, 4), (4.2, 120.0, 5), (4.6, 300.0, 6),
            (4.9, 140.0, 7), (2.0, 900.0, 8), (3.99, 800.0, 9)]
    requests = [dict(REQ, t_s=t, ttfa_ms=ms, session=i, stages_ms=_stages(ms - 20.0, 20.0)) for t, ms, i in sent]
    requests.append(dict(REQ, t_s=1.3, ttfa_ms=None, session=10, rejected_429=True, error="HTTP 429: full"))
    result = summarise(run, open_per_s, requests, samples, policy)
    assert [r["scale_up"] for r in result["series"]] == [False, False, True, True, False]

    def entry(t_s, submitted_s, ttfa_ms, session, scale_up=False):
        return {"t_s": t_s, "scale_up": scale_up, "submitted_s": submitted_s, "ttfa_ms": ttfa_ms, "session": session,
                "stages_ms": _stages(ttfa_ms - 20.0, 20.0)}

    # a tie (300 ms) keeps the earlier bin; the 429 (no first audio) is in neither list
    calm = [entry(1.0, 1.1, 300.0, 3), entry(4.0, 4.6, 300.0, 6), entry(4.0, 4.9, 140.0, 7),
            entry(0.0, 0.9, 130.0, 2), entry(1.0, 1.5, 126.0, 4)]
    assert result["slowest_outside_scaleup"] == calm
    assert result["slowest"] == [entry(2.0, 2.0, 900.0, 8, True), entry(3.0, 3.99, 800.0, 9, True), *calm[:3]]
    # the figure keeps its meaning: the largest p99 of bins 0, 1 and 4, bin 1's (126 and 300 ms), just
    # under its slowest request, the first named outside scale-up
    assert result["summary"]["p99_ttfa_ms_outside_scaleup_max"] == 298.3
    result["run"].update(_report_run())
    report = markdown(result).splitlines()
    head = "| bin s | sent s | session | scale-up | first audio ms | frontend | llm-first-token | first-audio | proxy |"
    outside = report.index("The slowest requests outside scale-up bins (what `p99_ttfa_ms_outside_scaleup_max` "
                           "is made of):")
    assert report[outside + 2:outside + 9] == [head, "|---|---|---|---|---|---|---|---|---|",
                                               "| 1 | 1.10 | 3 | no | 300 | 4 | 30 | 280 | 20 |",
                                               "| 4 | 4.60 | 6 | no | 300 | 4 | 30 | 280 | 20 |",
                                               "| 4 | 4.90 | 7 | no | 140 | 4 | 30 | 120 | 20 |",
                                               "| 0 | 0.90 | 2 | no | 130 | 4 | 30 | 110 | 20 |",
                                               "| 1 | 1.50 | 4 | no | 126 | 4 | 30 | 106 | 20 |"]
    whole = report.index("The slowest requests of the whole run:")
    assert report[whole + 4:whole + 6] == ["| 2 | 2.00 | 8 | yes | 900 | 4 | 30 | 880 | 20 |",
                                           "| 3 | 3.99 | 9 | yes | 800 | 4 | 30 | 780 | 20 |"]
    assert any(line.startswith("Columns: `bin s` the start of the request's bin") for line in report)


def test_the_slowest_requests_add_a_few_kb_to_the_json_whatever_the_run_length():
    run, open_per_s, samples, policy = _five_bins()
    stages = {f"stage-{k}": 123.4 for k in range(12)}  # more stages than the server reports
    requests = [dict(REQ, t_s=i / 500, ttfa_ms=100.0 + i % 97, session=i, stages_ms=stages) for i in range(2500)]
    result = summarise(run, open_per_s, requests, samples, policy)
    assert len(json.dumps({k: result[k] for k in ("slowest", "slowest_outside_scaleup")}, indent=1)) < 5000
    assert "requests" not in result and len(result["slowest"]) == len(result["slowest_outside_scaleup"]) == 5


def test_a_request_record_keeps_its_first_audio_stages_and_the_proxy_hop():
    trace = RequestTrace(submitted_s=10.0, stages_ms={"frontend": 5.0, "first-audio": 140.04}, drawn_s=1.0)
    trace.add_chunk(10.15, 24000)
    record = record_of(trace, t0=4.0, session=3)
    assert (record["t_s"], record["session"], record["ttfa_ms"], record["error"]) == (6.0, 3, 150.0, None)
    assert record["stages_ms"] == {"frontend": 5.0, "first-audio": 140.0, "proxy": 10.0}
    refused = RequestTrace(submitted_s=10.0, error="HTTP 429: full")
    assert record_of(refused, 4.0, 3)["stages_ms"] == {} and record_of(refused, 4.0, 3)["ttfa_ms"] is None


def _report_run() -> dict:
    return {"calibration": {"source": "x", "sessions_per_replica": 2, "slo_streams": 2, "llm_factor": 0.58,
                            "step_ms_alone": 1.57, "t2w_factor": 0.79, "times": {"llm_slowdown": 0.645}},
            "date": "d", "gpus": 2, "machine": "m", "command": "c", "commit": "k", "replica_start_s": 1.0,
            "start_scale": 0.1}


def test_a_paused_ramp_is_judged_to_its_later_end_and_a_cut_one_says_so():
    open_per_s = [(t / 2, 2, 2) for t in range(10)]
    samples = [{"t_s": t + 0.5, "states": {"RUNNING": 1}} for t in range(5)]
    short = _run(shape_reference_s={"up_s": 10.0})  # the ramp ends at 1 s (x 0.1)
    assert summarise(short, open_per_s, [], samples, [])["summary"]["bins_judged_for_tracking"] == 1
    held = _run(shape_reference_s={"up_s": 10.0}, paused_s=3.0, cut_short=True)
    result = summarise(held, open_per_s, [], samples, [])
    assert result["summary"]["bins_judged_for_tracking"] == 4 and result["summary"]["cut_short"] is True
    result["run"].update(_report_run())
    report = markdown(result)
    assert "**Cut short**" in report and "decode step x0.58 (1.57 ms alone), token2wav x0.79" in report
    assert "1.65x slower while token2wav holds the GPU" in report
    result["run"]["calibration"] = {"source": "x", "sessions_per_replica": 2, "slo_streams": 2, "time_factor": 1.31}
    assert "times x1.31 of the H200 profile" in markdown(result)  # a run of the one-factor calibration


def _live(tmp_path: Path, *extra: str) -> dict:
    env = {**os.environ, **SERVE_PROXY_TIMERS, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    results = tmp_path / "results"
    results.mkdir()
    (results / "fleet-sim-latest.json").write_text("{}")
    cmd = [sys.executable, "-m", "bench.autoscale_live", "--gpus", "2", "--frontends", "1", "--results",
           str(results), "--latest", "--tag", "test", *extra]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    latest = json.loads((results / "autoscale-latest.json").read_text())
    folder = results / latest["output"]
    for name in ("autoscale.json", "autoscale.md", "replicas.png", "first-audio.png", "run.json",
                 "sim-vs-live.json", "sim-vs-live.png"):
        assert (folder / name).is_file(), name
    assert json.loads((results / "fleet-sim-latest.json").read_text())["sim_vs_live_replica_error"] >= 0
    return {"latest": latest, "full": json.loads((folder / "autoscale.json").read_text())}


@pytest.mark.ray
def test_a_small_live_ramp_scales_out_under_load_and_back_when_idle(tmp_path):
    """Two logical GPUs; sessions ask back to back (one stream in flight each), two per replica:
    the plateau holds three sessions (150 % of one replica), so the real policy asks for two."""
    out = _live(tmp_path, "--time-scale", "0.05", "--start-scale", "0.005", "--back-to-back",
                "--sessions-per-replica", "2", "--slo-streams", "2", "--mix", "1:1-2",
                "--shape", "up_s=60,plateau_s=40,burst_s=20,hold_s=20,down_s=40,idle_s=40", "--settle-s", "4000",
                "--wait-for-replicas", "2", "--wait-guard-s", "300")
    latest, full = out["latest"], out["full"]
    assert KEYS <= latest.keys()
    assert full["run"]["resumed"] is True  # the plateau lasted until the policy's second replica ran
    assert latest["max_replicas"] == 2 and latest["cut_streams"] == 0 and latest["scaled_in_after_ramp"]
    rows = full["series"]
    loaded = [r for r in rows if r["sessions"] >= 3 and "running" in r]
    assert loaded and any(r["running"] == 2 for r in loaded)
    assert any((r.get("policy") or {}).get("decision") == 2 for r in rows)  # the real policy asked for it
    assert full["run"]["autoscaling_reference"]["load_band"]["slo_streams"] == 2


@pytest.mark.slow
@pytest.mark.ray
def test_a_longer_live_ramp_with_voice_agent_sessions(tmp_path):
    """The calibrated sessions (they play their answers out), the whole ramp at a fifth of real time."""
    latest = _live(tmp_path, "--time-scale", "0.2")["latest"]
    assert latest["max_replicas"] == 2 and latest["cut_streams"] == 0 and latest["scaled_in_after_ramp"]
    assert not math.isnan(latest["replica_tracking"])


def test_the_committed_latest_names_its_run_folder_and_plots():
    results = ROOT / "bench" / "results"
    latest = json.loads((results / "autoscale-latest.json").read_text())
    assert KEYS <= latest.keys() and (results / latest["output"] / "run.json").is_file()
    assert all((results / plot).is_file() for plot in latest["plots"])
    fleet = json.loads((results / "fleet-sim-latest.json").read_text())
    if fleet.get("sim_vs_live"):
        assert (results / fleet["sim_vs_live"]["live"]).is_file()
        assert fleet["sim_vs_live_replica_error"] == fleet["sim_vs_live"]["mae_replicas"]


def test_a_step_of_sessions_joins_spread_and_a_single_joiner_at_once():
    rng = random.Random(0)
    assert join_offsets(1, 5.0, rng) == [0.0] and join_offsets(0, 5.0, rng) == []
    assert join_offsets(36, 0.0, rng) == [0.0] * 36  # the instantaneous step, on request
    steps = [join_offsets(36, 5.0, random.Random(seed)) for seed in range(200)]
    for offsets in steps:
        assert offsets == sorted(offsets) and offsets[0] > 0.0
    # exponential gaps at rate n / spread: the last start is on average at the spread
    assert 4.5 < sum(o[-1] for o in steps) / len(steps) < 5.5


def test_a_joined_session_sends_its_first_request_at_its_start_and_not_if_it_left():
    class FakeClock:
        def __init__(self):
            self.t, self.waits = 0.0, []

        def now(self):
            return self.t

        async def wait_until(self, stop, until_s):
            self.waits.append(until_s)
            return stop.is_set()

    sent = []

    async def scenario():
        clock = FakeClock()
        source = SimpleNamespace(draw=lambda rng, i: None)
        driver = SessionDriver(None, source, None, 100.0, 0, False, clock)

        async def fake_serve(target, rid, spec, clk):
            sent.append(rid)
            leave.set()  # one request, then the session leaves
            return SimpleNamespace(chunk_times_s=[], error=None, submitted_s=clock.t, audio_s=0.0, drawn_s=1.0)

        leave = asyncio.Event()
        with mock.patch("bench.autoscale_live.serve_one", fake_serve):
            await driver.session(0, leave, 0.0, start_at=2.5)
            assert clock.waits[0] == 2.5 and sent == ["s0-0"]
            gone = asyncio.Event()
            gone.set()
            await driver.session(1, gone, 0.0, start_at=4.0)  # left before its start: sends nothing
        assert sent == ["s0-0"]

    asyncio.run(scenario())
