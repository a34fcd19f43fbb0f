"""The fleet simulation against the live ramp: the same ramp in both, replica counts side by side.

:func:`compare_live` replays a live run of ``bench/autoscale_live.py`` in the fleet model
(``bench/fleet_model.py``) in reference seconds (the live run's times over its time scale): the
sessions it recorded open every half second, its autoscaling settings (the config's, unscaled:
the live run scaled them with its ramp), its replica start time (over the time scale), Serve's
10 s metrics push, every GPU already up (one machine: no node start, no node released), one
replica at the start, the policy the live run deployed (``LoadBandPolicy`` at its setpoint), and
the replica curve of the capacity reading the live replicas were calibrated from (with one stream
in flight per session when the live sessions asked back to back, ``--back-to-back``). It compares
the simulated running replicas, as the mean per 10 s bin, with the live run's per bin
(:func:`bench.fleet_report.compare_replicas`): ``sim_vs_live_replica_error`` is the mean absolute
difference in replicas. Written to ``sim-vs-live.json`` and ``sim-vs-live.png`` in the live run's
folder and, with ``update_latest``, into ``fleet-sim-latest.json``.

    python -m bench.fleet_sim --live bench/results/<run>/autoscale.json --latest bench/results/fleet-sim-latest.json
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.fleet_inputs import ROOT, Curve, ServeSettings, load_replica_model
from bench.fleet_model import SimConfig, simulate
from bench.fleet_policies import policies
from bench.fleet_report import compare_replicas, replica_bins
from bench.fleet_workload import ramp_trace

RESULTS = ROOT / "bench" / "results"
FLEET_LATEST = "fleet-sim-latest.json"
BIN_S = 10  # reference seconds: the live run's bin over its time scale


def settings_of(run: dict[str, Any]) -> ServeSettings:
    auto = run["autoscaling_reference"]
    return ServeSettings(
        min_replicas=int(auto["min_replicas"]), max_replicas=int(auto["max_replicas"]),
        target_ongoing_requests=float(auto["target_ongoing_requests"]),
        upscale_delay_s=float(auto["upscale_delay_s"]), downscale_delay_s=float(auto["downscale_delay_s"]),
        look_back_period_s=float(auto["look_back_period_s"]), max_ongoing_requests=int(run["max_ongoing_requests"]),
        load_band={k: v for k, v in auto["load_band"].items() if k != "enabled"}, node_idle_timeout_s=math.inf,
        source=f"the live run's synthesizer.autoscaling ({run['config']})")


def simulate_live(live: dict[str, Any]) -> dict[str, Any]:
    """The live ramp in the fleet model; its running replicas per bin and the comparison."""
    run = live["run"]
    points = [(float(t), float(n)) for t, n in live["sessions_reference"]["points"]]
    points[0] = (0.0, points[0][1])  # the first record is a few ms into the run
    trace = ramp_trace(points)
    replica = load_replica_model(ROOT / run["calibration"]["source"])
    if not run["wait_playback"]:  # back-to-back sessions: each always has its one stream in flight
        replica = replace(replica, streams_per_session=Curve([(0.0, 1.0), (1.0, 1.0)], hold_below=True,
                                                             hold_above=True))
    settings = settings_of(run)
    (spec,) = [p for p in policies(settings, replica) if p.name == "load_band"]  # the live run's band and setpoint
    cfg = SimConfig(settings=settings, replica=replica,
                    replica_start_s=run["replica_start_s"] / run["time_scale"], node_start_s=0.0,
                    metrics_push_s=10.0, initial_replicas=settings.min_replicas)
    serve_log = logging.getLogger("ray.serve")  # the policy's decision lines: the controller's, not ours
    saved = serve_log.level
    serve_log.setLevel(logging.WARNING)
    try:
        sim = simulate(trace, spec.make(), cfg, "live-ramp")
    finally:
        serve_log.setLevel(saved)
    sim_bins = replica_bins(sim.running, BIN_S)
    live_bins = [float(r["running"]) if "running" in r else math.nan for r in live["series"]]
    n = min(len(sim_bins), len(live_bins))
    comparison = compare_replicas(sim_bins[:n], live_bins[:n])
    return {**comparison,
            "bin_s_reference": BIN_S, "sim_bins": sim_bins[:n], "live_bins": live_bins[:n],
            "sim_inputs": {"policy": spec.label, "replica_curve": replica.source,
                           "replica_start_s": cfg.replica_start_s, "node_start_s": 0.0, "metrics_push_s": 10.0,
                           "settings": settings.source, "trace": trace.description[:200]}}


def plot(result: dict[str, Any], live: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [k * BIN_S for k in range(len(result["sim_bins"]))]
    ideal = [r["ideal"] for r in live["series"]][:len(t)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.step(t, result["live_bins"], where="post", color="black", lw=1.5, label="live: running replicas")
    ax.step(t, result["sim_bins"], where="post", color="tab:blue", lw=1.2, label="fleet simulation (bin mean)")
    ax.step(t, ideal, where="post", color="tab:green", ls="--", lw=1, label="ideal")
    ax.set_xlabel("reference time (s)")
    ax.set_ylabel("synthesizer replicas")
    ax.set_title(f"the same ramp, live and simulated: mean |sim - live| {result['mae_replicas']:g} replicas per "
                 f"{BIN_S} s bin", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare_live(live_json: Path, results: Path = RESULTS, update_latest: bool = False) -> dict[str, Any]:
    live = json.loads(live_json.read_text())
    result = simulate_live(live)
    folder = live_json.parent
    shown = str(live_json.resolve().relative_to(results.resolve())) if live_json.resolve().is_relative_to(
        results.resolve()) else str(live_json)
    result["live"] = shown
    result["live_machine"] = live["run"]["machine"]
    (folder / "sim-vs-live.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, live, folder / "sim-vs-live.png")
    record = folder / "run.json"
    if record.exists():  # the run folder's record lists its files: these two too
        data = json.loads(record.read_text())
        data["files"] = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "run.json")
        record.write_text(json.dumps(data, indent=1) + "\n")
    if update_latest:
        path = results / FLEET_LATEST
        latest = json.loads(path.read_text()) if path.exists() else {}
        latest["sim_vs_live_replica_error"] = result["sim_vs_live_replica_error"]
        latest["sim_vs_live_note"] = ("mean absolute difference of running replicas per 10 s bin, the live ramp "
                                      f"{shown} ({live['run']['gpus']} logical GPUs of timed replicas on "
                                      f"{live['run']['machine'].split(',')[0]}) replayed in the fleet model "
                                      f"(bench/fleet_live.py); side by side: "
                                      f"{Path(shown).parent / 'sim-vs-live.png'}")
        latest["sim_vs_live"] = {k: v for k, v in result.items() if k not in ("sim_bins", "live_bins")}
        path.write_text(json.dumps(latest, indent=1) + "\n")
    return result
