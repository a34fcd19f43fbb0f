"""The fleet simulation (bench/fleet_*.py): short traces, fixed seeds, the real policy."""
from __future__ import annotations

import dataclasses
import inspect
import json
import math

import numpy as np
import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from bench import fleet_sim
from bench.calibrate import derive
from bench.fleet_inputs import Curve, calibration_reports, load_replica_model, load_serve_settings, replica_start
from bench.fleet_model import STREAMS, DelayRule, ServeConfigView, SimConfig, SimContext, oracle_replicas, simulate
from bench.fleet_policies import GpuUtilBandPolicy, policies, queue_length_policy
from bench.fleet_report import bin_samples, compare_replicas, replica_bins, summarise, violation_minutes
from bench.fleet_workload import diurnal_trace, parse_ramp, ramp_trace, rise_within
from bench.timed_fleet import cold_start_record
from deployments.autoscaling_policy import LoadBandPolicy

RECORD, REPORTS = calibration_reports()
REPLICA = load_replica_model(REPORTS)
START_S = replica_start(gpu=REPLICA.device)[0]


def _settings(**kw):
    return load_serve_settings(**{"max_replicas": 200, **kw})


def _cfg(settings=None, **kw):
    base = {"settings": settings or _settings(), "replica": REPLICA, "replica_start_s": START_S, "node_start_s": 180.0}
    return SimConfig(**{**base, **kw})


def _gpu_hours(run) -> float:
    return run.nodes.sum() / 3600


# --- inputs ---------------------------------------------------------------------------------------

def test_curve_interpolates_holds_and_crosses():
    c = Curve([(0, 0), (10, 100), (20, 300)], hold_above=True)
    assert c(5) == 50 and c(15) == 200 and c(40) == 300 and c(-10) == -100
    assert c.crossing(150) == pytest.approx(12.5)
    with pytest.raises(ValueError):
        c.crossing(400)


def test_the_replica_model_is_the_measurement_the_configs_setpoint_was_calibrated_from():
    # The config's slo_streams names its fastcosy calibrate record; the curve is that record's measurements.
    record = json.loads(RECORD.read_text())
    assert [str(p.relative_to(RECORD.parents[2])) for p in REPORTS] == record["measurements"]
    assert list(REPLICA.reports) == record["measurements"]
    assert REPLICA.capacity_sessions == record["read_at_sessions"]
    assert math.floor(REPLICA.slo_streams * 100) / 100 == record["slo_streams"] == _settings().load_band["slo_streams"]
    steady = [p for r in REPORTS for s in json.loads(r.read_text())["searches"] if s["kind"] in ("sessions", "loads")
              for p in s["probes"]]
    met = [p["load"] for p in steady if p["meets_slo"]]
    failed = [p["load"] for p in steady if not p["meets_slo"]]
    # The SLO is crossed between the heaviest load that met it and the lightest that did not.
    assert max(met) <= REPLICA.max_sessions < min(failed)
    at_cap = next(p for p in steady if p["load"] == REPLICA.capacity_sessions)
    assert REPLICA.p99_ms(at_cap["load"]) == pytest.approx(at_cap["ttfa_p99_ms"])
    # Probes that ran their whole window (met or missed) set the in-flight share; aborted ones do not.
    whole = sorted(p["load"] for p in steady if p["aborted"] is None)
    assert REPLICA.streams_per_session.xs == whole and len(whole) < len(steady)
    assert REPLICA.streams_per_session(1) > 0  # held below the lightest steady load


def _report(path, probes, one=(1, 150.0)):
    doc = {"device": "GPU X", "date": "2026-12-07",
           "workload": {"family": "cosyvoice2", "level": "serve", "name": "production", "slo_ttfa_p99_ms": 300.0},
           "searches": [{"kind": "loads", "capacity": None, "probes": [
               {"load": n, "meets_slo": p99 <= 300, "ttfa_p99_ms": p99, "streams_in_flight_mean": f, "audio_s": 60.0 * n,
                "window_s": 60.0, "gpu_util_pct": 90.0, "aborted": stop} for n, p99, f, stop in probes]},
               {"kind": "one-session", "probes": [{"load": one[0], "meets_slo": True, "ttfa_p99_ms": one[1],
                                                   "streams_in_flight_mean": 1.0, "audio_s": 10.0, "window_s": 5.0,
                                                   "gpu_util_pct": 80.0, "aborted": None}]}]}
    path.write_text(json.dumps(doc))
    return path


def test_reports_of_one_node_merge_into_one_curve(tmp_path):
    low = _report(tmp_path / "low.json", [(10, 200.0, 1.0, None), (20, 400.0, 2.4, None)], one=(1, 120.0))
    high = _report(tmp_path / "high.json", [(20, 350.0, 2.2, None), (40, 900.0, 0.5, "underrun (1)")], one=(1, 160.0))
    model = load_replica_model([low, high])
    # a load probed twice: the worse probe stands for it (p99 and in-flight share alike)
    assert model.p99_ms.xs == [1, 10, 20, 40] and model.p99_ms(20) == 400.0 and model.p99_ms(1) == 160.0
    assert model.max_sessions == pytest.approx(15.0)
    # the aborted probe's figures cover seconds, not its window: left out of the shares
    assert model.streams_per_session.xs == [10, 20] and model.streams_per_session(20) == pytest.approx(0.12)
    assert (model.capacity_sessions, model.slo_streams) == (10, 1.0)
    assert model.reports == (str(low), str(high)) and "production workload" in model.source
    other = _report(tmp_path / "other.json", [(10, 200.0, 1.0, None)])
    other.write_text(other.read_text().replace("GPU X", "GPU Y"))
    with pytest.raises(ValueError, match="differ"):
        load_replica_model([low, other])


def test_the_replica_start_is_the_newest_gpu_cold_start_of_the_replica_curves_card():
    cold = cold_start_record(gpu=REPLICA.device)
    assert cold is not None and START_S == cold["cold_start_s"]
    assert REPLICA.device and cold["device"] == REPLICA.device  # the shipped curve's card has a record


def test_serve_settings_come_from_the_config_and_the_manifest():
    s = _settings()
    assert s.max_replicas == 200 and s.overrides == {"max_replicas": 200}
    assert s.upscale_delay_s >= 0 and s.downscale_delay_s >= s.upscale_delay_s and s.node_idle_timeout_s > 0
    assert s.load_band["slo_streams"] > 0
    with pytest.raises(ValueError):
        load_serve_settings(max_replicaz=3)


# --- workload --------------------------------------------------------------------------------------

def test_the_diurnal_trace_conserves_sessions_and_is_seeded():
    a = diurnal_trace(3, 2000, seed=3, bursts_per_day=24)
    a.check()
    b = diurnal_trace(3, 2000, seed=3, bursts_per_day=24)
    assert np.array_equal(a.active, b.active) and a.description == b.description
    assert not np.array_equal(a.active, diurnal_trace(3, 2000, seed=4, bursts_per_day=24).active)
    assert a.seconds == 3 * 3600 and a.description.count(" h +") == 3  # 24 a day -> 3 in 3 h
    a.active[5] += 1
    with pytest.raises(AssertionError):
        a.check()


def test_a_day_peaks_near_its_peak_in_the_evening():
    day = diurnal_trace(24, 10_000, seed=0, bursts_per_day=0)
    per_hour = day.active.reshape(24, 3600).mean(axis=1)
    assert 9_000 < per_hour.max() < 10_500 and int(per_hour.argmax()) in (18, 19, 20)
    assert per_hour.min() < 0.1 * per_hour.max() and int(per_hour.argmin()) in (3, 4, 5)


def test_a_ramp_is_replayed_as_given():
    points = parse_ramp("0:10, 60:70, 60:200, 120:200, 180:0")
    assert points == [(0, 10), (60, 70), (60, 200), (120, 200), (180, 0)]
    r = ramp_trace(points)
    r.check()
    assert r.seconds == 180 and r.active[0] == 10 and r.active[30] == 40
    assert r.active[60] == 200 and r.active[119] == 200 and r.active[150] == 100


def test_a_ramp_loads_from_json(tmp_path):
    path = tmp_path / "ramp.json"
    path.write_text(json.dumps({"points": [[0, 0], [30, 5]]}))
    assert parse_ramp(str(path)) == [(0, 0), (30, 5)]


# --- Serve's machinery ----------------------------------------------------------------------------

def test_the_delay_rule_needs_an_unbroken_ask():
    d = DelayRule(up_s=30, down_s=600)
    assert d(5, 3, 0) == 3 and d(5, 3, 29) == 3 and d(6, 3, 30) == 6  # the latest ask, once 30 s passed
    assert d(8, 6, 31) == 6 and d(6, 6, 40) == 6 and d(8, 6, 50) == 6  # a hold resets the clock
    assert d(8, 6, 79) == 6 and d(8, 6, 80) == 8
    assert d(2, 8, 100) == 8 and d(2, 8, 699) == 8 and d(2, 8, 700) == 2


def test_the_sim_context_reads_like_serves():
    # Every field the simulator fills is one of AutoscalingContext's, and the policy decides the
    # same on both.
    assert {f.name for f in dataclasses.fields(SimContext)} <= set(inspect.signature(AutoscalingContext).parameters)
    dep = DeploymentID(name="Synthesizer", app_name="tts")
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(3)]
    metrics = {STREAMS: {rid: v for rid, v in zip(ids, [16.0, 17.0, 18.0], strict=True)}}
    common = {"deployment_name": "Synthesizer", "app_name": "tts", "current_num_replicas": 3, "target_num_replicas": 3,
                  "running_replicas": ids, "total_num_requests": 53.0, "total_queued_requests": 2.0,
                  "aggregated_metrics": metrics, "raw_metrics": {}, "capacity_adjusted_min_replicas": 1,
                  "capacity_adjusted_max_replicas": 50, "policy_state": {}, "last_scale_up_time": None,
                  "last_scale_down_time": None, "current_time": 0.0}
    real = AutoscalingContext(deployment_id=dep, config=AutoscalingConfig(min_replicas=1, max_replicas=50,
                                                                          target_ongoing_requests=24), **common)
    sim = SimContext(config=_serve_config(), **common)
    assert sim.total_running_requests == real.total_running_requests == 51
    policy = LoadBandPolicy(slo_streams=REPLICA.slo_streams)
    # 53 streams (51 in flight, 2 queued) at the band centre (75 %) of the replica's streams at the SLO
    assert policy(sim)[0] == policy(real)[0] == math.ceil(53 / (0.75 * REPLICA.slo_streams))
    assert queue_length_policy(sim)[0] == math.ceil(53 / _settings().target_ongoing_requests)  # the config's target


def _serve_config():
    return ServeConfigView(_settings())


# --- the fleet ------------------------------------------------------------------------------------

SHORT = diurnal_trace(2, 1500, seed=1, start_hour=17, bursts_per_day=24)


@pytest.fixture(scope="module")
def short_runs():
    settings = _settings(max_replicas=150, min_replicas=2)
    out = {}
    for spec in policies(settings, REPLICA):
        run = simulate(SHORT, spec.make(), _cfg(settings, admission=spec.admission, seed=1), spec.name)
        out[spec.name] = (run, settings)
    return out


def test_replicas_stay_within_bounds_and_sessions_are_all_counted(short_runs):
    for name, (run, settings) in short_runs.items():
        assert run.running.min() >= 0 and run.replicas.max() <= settings.max_replicas, name
        assert run.target.min() >= settings.min_replicas and run.target.max() <= settings.max_replicas, name
        assert (run.running <= run.replicas).all() and (run.replicas <= run.nodes).all(), name
        assert np.array_equal(run.served + run.rejected, SHORT.active), name
        assert run.policy_calls == SHORT.seconds - 10, name  # every second from the first push


def test_the_oracle_is_a_lower_bound_for_a_fleet_within_the_slo(short_runs):
    # Fewer GPU-hours than the oracle's only by serving late: the queue policy at the config's
    # target (24 requests a replica, far above the 2.09 streams at the SLO) and the utilisation band.
    oracle = oracle_replicas(SHORT, REPLICA, min_replicas=2)
    within = {name for name, (run, _) in short_runs.items() if violation_minutes(run).mean() <= 0.05}
    assert {"load_band", "load_band_admission", "queue_measured"} <= within
    for name, (run, _) in short_runs.items():
        below = _gpu_hours(run) < oracle.sum() / 60
        assert not below if name in within else below or violation_minutes(run).mean() > 0.05, name
        if name in within:
            assert summarise(run, oracle, REPLICA, 3.0)["gpu_hours_vs_oracle"] >= 1, name


def test_the_utilisation_band_cannot_find_the_capacity(short_runs):
    # NVML reads about the same from one stream to the SLO's (the reports' curve): whether that
    # reading sits above the band (the policy adds replicas to the ceiling) or in it (the policy
    # holds while the load runs past the SLO), the replica count does not follow the load.
    run, settings = short_runs["gpu_util"]
    flat = [REPLICA.util_pct(x) for x in (1.0, REPLICA.slo_streams)]
    assert max(flat) - min(flat) < 10
    band = settings.load_band
    if REPLICA.util_pct(1.0) > band["high_pct"]:  # one stream a replica already reads above the band
        assert run.running.max() == settings.max_replicas
    else:
        assert violation_minutes(run).mean() > 0.2
    assert GpuUtilBandPolicy().low == 70


def test_admission_refuses_instead_of_serving_late(short_runs):
    ours, admitted = short_runs["load_band"][0], short_runs["load_band_admission"][0]
    assert admitted.late.sum() == 0
    cap = REPLICA.max_sessions
    assert (admitted.served <= admitted.running * cap + 1e-9).all()
    assert ours.rejected.sum() == 0


def _step(before=150, after=2400, at=600, end=2400):
    return ramp_trace([(0, before), (at, before), (at, after), (end, after)])


def _queue_at_capacity_settings(share=1.0, **kw):
    # The queue policy with its target at (a share of) the measured streams in flight at the SLO:
    # right in the steady state, so violations after a step are the start time's.
    return _settings(target_ongoing_requests=share * REPLICA.slo_streams, **kw)


def test_start_time_shows_as_violations_for_the_queue_policy_after_a_step():
    trace = _step()
    run = simulate(trace, queue_length_policy, _cfg(_queue_at_capacity_settings(0.85)), "queue")
    bad = violation_minutes(run)
    assert not bad[:10].any()  # steady before the step
    # Over the SLO from the step until a node (180 s) and a replica (the measured cold start) have
    # started after the upscale delay and a metrics push: about 5 minutes.
    lag_min = (30 + 180 + START_S) / 60
    assert lag_min - 1 <= bad[10:].sum() <= lag_min + 2
    fast = simulate(trace, queue_length_policy, _cfg(_queue_at_capacity_settings(0.85, upscale_delay_s=0),
                                                     replica_start_s=0, node_start_s=0), "queue")
    assert violation_minutes(fast)[10:].sum() <= 1  # only the metrics' push and look-back remain


def test_without_start_time_or_delays_a_policy_tracks_the_oracle():
    trace = diurnal_trace(3, 3000, seed=2, start_hour=6, bursts_per_day=0)
    # Queue policy at 90 % of the streams in flight where the curve crosses the SLO, nothing to
    # wait for: within a replica each minute of the fleet that holds the minute's sessions at that
    # load (the metrics' look-back still lags a rising day), and its GPU-hours the oracle's over
    # that share at most.
    at_slo = REPLICA.max_sessions * REPLICA.streams_per_session(REPLICA.max_sessions)
    settings = _settings(target_ongoing_requests=0.9 * at_slo, upscale_delay_s=0, downscale_delay_s=0,
                         node_idle_timeout_s=0)
    run = simulate(trace, queue_length_policy, _cfg(settings, replica_start_s=0, node_start_s=0), "queue")
    oracle = oracle_replicas(trace, REPLICA, settings.min_replicas)
    per_replica = _sessions_at_load(0.9 * at_slo)
    at_share = np.array([trace.active[m * 60:(m + 1) * 60].mean() / per_replica for m in range(len(oracle))])
    ratio = _gpu_hours(run) / (oracle.sum() / 60)
    assert 1.0 <= ratio <= 1.05 * REPLICA.max_sessions / per_replica
    per_minute = run.running[: len(oracle) * 60].reshape(-1, 60).mean(axis=1)
    assert np.abs(per_minute - at_share).mean() <= 1.0
    assert violation_minutes(run).mean() <= 0.1


def test_our_policy_holds_a_ramp_within_the_slo_once_scaled():
    trace = ramp_trace([(0, 100), (1800, 3000), (3600, 3000)])  # 100 -> 3000 sessions over 30 min
    settings = _settings()
    (spec,) = [p for p in policies(settings, REPLICA) if p.name == "load_band"]
    run = simulate(trace, spec.make(), _cfg(settings), "load_band")
    assert not violation_minutes(run)[40:].any()  # ten minutes after the ramp ends
    held = run.served[-600:].sum() / run.running[-600:].sum()
    assert 0.6 * REPLICA.max_sessions < held <= REPLICA.max_sessions


# --- the live comparison --------------------------------------------------------------------------

def test_replica_bins_and_the_comparison_on_synthetic_runs():
    per_second = [1] * 20 + [2] * 15 + [3] * 5
    assert replica_bins(per_second, 10) == [1, 1, 2, 2.5]
    samples = [(0.5, 1), (4, 1), (12, 1), (21, 2), (27, 2)]  # no sample in 30-40 s
    live = bin_samples(samples, end_s=40, bin_s=10)
    assert live == [1, 1, 2, 2]
    assert bin_samples([(15, 3)], end_s=30)[0] != bin_samples([(15, 3)], end_s=30)[0]  # NaN before the first
    same = compare_replicas(live, live)
    assert same["mae_replicas"] == 0 and same["sim_vs_live_replica_error"] == 0 and same["bins"] == 4
    off = compare_replicas([v + 1 for v in live], live)
    assert off["mae_replicas"] == 1 and off["sim_vs_live_replica_error"] == 1
    assert off["relative_error"] == pytest.approx(1 / 1.5, abs=1e-4)
    skipped = compare_replicas([1, 5, 2], [math.nan, 4, 2])
    assert skipped["bins"] == 2 and skipped["mae_replicas"] == 0.5
    with pytest.raises(ValueError):
        compare_replicas([math.nan], [1])


def test_the_cli_replays_a_ramp_and_its_bins_compare(tmp_path):
    out = tmp_path / "ramp"
    latest = tmp_path / "latest.json"
    fleet_sim.main(["--ramp", "0:50,120:50,120:600,600:600", "--policies", "queue,load_band", "--out", str(out),
                    "--latest", str(latest), "--max-replicas", "40"])
    data = json.loads((out / "fleet-sim.json").read_text())
    assert set(data["policies"]) == {"queue", "load_band"} and (out / "day.png").exists()
    bins = data["replicas_per_bin"]
    assert bins["bin_s"] == 10 and len(bins["load_band"]) == 60
    band = _settings().load_band
    mid = (band["low_pct"] + band["high_pct"]) / 200
    assert bins["load_band"][0] == math.ceil(50 / (mid * REPLICA.max_sessions))  # a fleet at rest at the band centre
    assert bins["load_band"][-1] > bins["load_band"][0]
    assert compare_replicas(bins["load_band"], bins["load_band"])["sim_vs_live_replica_error"] == 0
    summary = json.loads(latest.read_text())
    curve = summary["inputs"]["measured"]["replica_curve"]
    assert curve.startswith("bench/results/") and "/capacity-serve-" in curve  # a reading in its run folder
    assert summary["inputs"]["assumed"]["node_start_s"]["value"] == 180.0
    measured = summary["inputs"]["measured"]
    assert measured["replica_start_s"]["value"] == cold_start_record(gpu=REPLICA.device)["cold_start_s"]
    assert measured["setpoint"]["same_measurement"] and measured["setpoint"]["slo_streams"] == band["slo_streams"]
    assert summary["headroom"]["reaction_s"] == pytest.approx(
        _settings().upscale_delay_s + 10 + 180 + measured["replica_start_s"]["value"])
    assert summary["oracle"]["gpu_hours"] <= summary["policies"]["load_band"]["gpu_hours"]


# --- the load band as the product runs it -----------------------------------------------------------

def test_our_policy_runs_the_configs_setpoint_which_calibrate_derives_from_the_curves_reports():
    specs = {p.name: p for p in policies(_settings(), REPLICA)}
    policy = specs["load_band"].make().policy
    assert policy.slo_streams == _settings().load_band["slo_streams"] == derive(REPORTS).slo_streams
    assert (policy.low, policy.high) == (_settings().load_band["low_pct"], _settings().load_band["high_pct"])
    assert type(policy) is LoadBandPolicy  # the product's class, not a variant


def test_a_rise_is_measured_over_the_window_ahead():
    # 100 sessions, +20 % at 600 s: the seconds within 60 s before the step see 1.2x ahead of them.
    step = ramp_trace([(0, 100), (600, 100), (600, 120), (1200, 120)])
    assert rise_within(step, 60, 1.0) == pytest.approx(1.2)
    assert rise_within(step, 60, 0.5) == 1.0
    assert rise_within(step, 60, 0.99) == pytest.approx(1.2)  # 60 of 1,140 seconds: over 1 %
    assert rise_within(step, 6, 0.99) == 1.0  # 6 of 1,194: under 1 %
    assert rise_within(ramp_trace([(0, 0), (100, 0)]), 60) == 1.0  # nothing open, nothing to rise


def _sessions_at_load(load_streams: float) -> float:
    """Sessions per replica whose streams in flight read ``load_streams`` on the curve (bisection)."""
    lo, hi = 0.0, 10 * REPLICA.max_sessions
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * REPLICA.streams_per_session(mid) < load_streams else (lo, mid)
    return lo


def test_the_shipped_band_keeps_the_headroom_the_day_needs():
    # At the band's centre a replica serves sessions_at(centre x slo_streams); its headroom to the
    # SLO must cover the load's rise while the fleet adds capacity (upscale delay, a push, a node
    # and a replica start), else bursts run over the SLO. Each point of headroom over that is
    # GPU-hours over the oracle: the product's 70-80 % keeps ~1.4x, past issue 40's 1.25x budget
    # (docs/tuning.md, "Choosing the band"; the simulation reports it, this test does not hide it).
    settings = _settings()
    band = settings.load_band
    centre = (band["low_pct"] + band["high_pct"]) / 200
    headroom = REPLICA.max_sessions / _sessions_at_load(centre * band["slo_streams"])
    reaction_s = settings.upscale_delay_s + 10 + 180 + START_S
    needed = rise_within(diurnal_trace(24, 10_000, seed=0), reaction_s, 0.99)
    assert needed <= headroom, (needed, headroom)


def test_the_scale_in_latch_follows_a_slow_decline_sooner():
    # 4,000 sessions falling to 2,500 over an hour: the stateless band scales in only on the ticks
    # whose load reads under the band, and each tick inside it restarts Serve's downscale delay.
    trace = ramp_trace([(0, 4000), (3600, 2500), (5400, 2500)])
    specs = {p.name: p for p in policies(_settings(), REPLICA)}
    latch, no_latch = (simulate(trace, specs[n].make(), _cfg(), n) for n in ("load_band", "load_band_no_latch"))
    assert latch.running.sum() < no_latch.running.sum()
    assert latch.late.sum() == 0 == no_latch.late.sum()
    # Once the decline is over both hold the load inside the band
    band, sessions = _settings().load_band, trace.active[-1]
    for n in (latch.running[-1], no_latch.running[-1]):
        load = 100 * sessions * REPLICA.streams_per_session(sessions / n) / (n * band["slo_streams"])
        assert band["low_pct"] <= load <= band["high_pct"], (n, load)
