"""Fleet simulation for the scale we cannot rent: autoscaling policies over a day of sessions.

A discrete-time model (1 s ticks) of a GPU fleet of synthesizer replicas under Ray Serve's
autoscaler (``bench/fleet_model.py``), fed with the measured per-replica latency-vs-load curve (the
capacity reports the serve config's ``slo_streams`` was calibrated from), the newest measured GPU
cold start and Serve's settings (``bench/fleet_inputs.py``), comparing policies (``bench/fleet_policies.py``;
ours is the real ``deployments.autoscaling_policy.LoadBandPolicy``) on GPU-hours against an
oracle, minutes over the SLO, refused requests and cost per hour of audio::

    python -m bench.fleet_sim --hours 24 --peak-sessions 10000 --out bench/results/<date>-fleet-sim

writes ``<out>/fleet-sim.json`` (inputs with their sources, per-policy figures, per-minute series),
``<out>/day.png``, ``<out>/curve.png`` and, with ``--latest``, the summary to that path. ``--ramp
0:0,60:200,...`` replays a ramp of ``(time s, sessions)`` points instead of the day, as the live
ramp takes it, and adds each policy's replica counts per 10 s bin (``replicas_per_bin``) for
:func:`bench.fleet_report.compare_replicas` against the live run's; ``--live <run>/autoscale.json``
replays a live ramp of ``bench/autoscale_live.py`` with its own inputs (``bench/fleet_live.py``) and
writes ``sim_vs_live_replica_error`` into ``--latest``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
from pathlib import Path
from typing import Any, Self

import numpy as np
from tqdm import tqdm

from bench.fleet_inputs import (
    ASSUMPTIONS,
    ROOT,
    SERVE_CONFIG,
    calibration_reports,
    load_replica_model,
    load_serve_settings,
    replica_start,
)
from bench.fleet_model import SimConfig, oracle_replicas, simulate
from bench.fleet_policies import calibrated_setpoint, policies
from bench.fleet_report import oracle_summary, plot_curve, plot_day, plot_window, replica_bins, series, summarise
from bench.fleet_workload import diurnal_trace, parse_ramp, ramp_trace, rise_within

logger = logging.getLogger(__name__)

TARGETS = {"policy": "load_band", "gpu_hours_vs_oracle_max": 1.25, "slo_violation_minutes_pct_max": 1.0}


def _args(argv: list[str] | None) -> argparse.Namespace:
    a = {k: v for k, (v, _) in ASSUMPTIONS.items()}
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--peak-sessions", type=int, default=10_000, help="sessions open at the day's peak (before bursts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mean-session-s", type=float, default=180.0, help="mean session length (assumed)")
    p.add_argument("--bursts-per-day", type=float, default=8.0)
    p.add_argument("--ramp", help="replay a ramp instead of the day: 't:sessions,...' or a JSON file of [t, sessions]")
    p.add_argument("--policies", default="", help="comma-separated names (default: all)")
    p.add_argument("--report", type=Path, nargs="+", help="capacity reports' JSON of one node and workload (default: "
                   "the measurements of the calibration record the config's slo_streams names)")
    p.add_argument("--config", type=Path, default=SERVE_CONFIG, help="serve config with the synthesizer's autoscaling")
    p.add_argument("--max-replicas", type=int, help="replaces the config's (sized for 8 GPUs); default: twice the "
                   "oracle's peak, a ceiling only a runaway policy reaches")
    p.add_argument("--min-replicas", type=int, help="replaces the config's")
    p.add_argument("--replica-start-s", type=float, help="default: the newest measured GPU cold start")
    p.add_argument("--node-start-s", type=float, default=a["node_start_s"])
    p.add_argument("--metrics-push-s", type=float, default=a["metrics_push_s"])
    p.add_argument("--band", help="LOW,HIGH: replaces the config's load band (per cent)")
    p.add_argument("--node-idle-timeout-s", type=float, help="replaces the KubeRay manifest's idleTimeoutSeconds")
    p.add_argument("--gpu-hour-usd", type=float, default=a["gpu_hour_usd"])
    p.add_argument("--bin-s", type=int, default=10, help="bin of the replica counts for the live comparison")
    p.add_argument("--live", type=Path, help="a live ramp's autoscale.json (bench/autoscale_live.py): replay it "
                   "and compare replica counts (bench/fleet_live.py); only --latest applies")
    p.add_argument("--out", type=Path, help="output folder (required unless --live)")
    p.add_argument("--latest", type=Path, help="also write the summary here (e.g. bench/results/fleet-sim-latest.json)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-series", action="store_true", help="skip series.json (per-minute series)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    record, reports = calibration_reports(args.config)
    replica = load_replica_model(args.report or reports)
    if args.replica_start_s is None:
        start_s, start_source = replica_start(gpu=replica.device)
    else:
        start_s, start_source = args.replica_start_s, ("--replica-start-s (a sensitivity run; by default the newest "
                                                       "measured GPU cold start)")
    overrides: dict[str, Any] = {}
    if args.min_replicas is not None:
        overrides["min_replicas"] = args.min_replicas
    if args.band:
        low, high = (float(v) for v in args.band.split(","))
        overrides["load_band"] = dict(load_band_of(args.config), low_pct=low, high_pct=high)
    if args.node_idle_timeout_s is not None:
        overrides["node_idle_timeout_s"] = args.node_idle_timeout_s
    if args.ramp:
        trace = ramp_trace(parse_ramp(args.ramp))
    else:
        trace = diurnal_trace(args.hours, args.peak_sessions, seed=args.seed, mean_session_s=args.mean_session_s,
                              bursts_per_day=args.bursts_per_day)
    trace.check()
    min_replicas = overrides.get("min_replicas", load_serve_settings(args.config).min_replicas)
    oracle = oracle_replicas(trace, replica, min_replicas)
    overrides["max_replicas"] = args.max_replicas or 2 * int(oracle.max())
    settings = load_serve_settings(args.config, **overrides)
    setpoint = float(settings.load_band["slo_streams"])
    derived = calibrated_setpoint(replica)
    if derived != setpoint:
        logger.warning("the config's slo_streams %g is not what fastcosy calibrate derives from the replica curve's "
                       "reports (%g): the band and the curve are different measurements", setpoint, derived)
    wanted = {n for n in args.policies.split(",") if n}
    specs = [p for p in policies(settings, replica) if not wanted or p.name in wanted]
    if wanted - {p.name for p in specs}:
        raise SystemExit(f"unknown policies: {sorted(wanted - {p.name for p in specs})}")
    runs, out_policies = {}, {}
    for spec in specs:
        cfg = SimConfig(settings=settings, replica=replica, replica_start_s=start_s,
                        node_start_s=args.node_start_s, metrics_push_s=args.metrics_push_s,
                        admission=spec.admission, seed=args.seed)
        with tqdm(total=trace.seconds, desc=spec.name, unit="s", unit_scale=True, leave=False,
                  disable=trace.seconds < 3600) as bar, _DecisionLines() as lines:
            result = simulate(trace, spec.make(), cfg, spec.name, progress=bar.update)
        runs[spec.name] = result
        out_policies[spec.name] = {"label": spec.label, "admission": spec.admission, "setpoint": spec.setpoint,
                                   **summarise(result, oracle, replica, args.gpu_hour_usd),
                                   "decision_log_lines": lines.count,
                                   # Serve calls a policy every 0.1 s; the model every 1 s.
                                   "ticks_asking_other_than_running_at_0_1_s": 10 * result.asks_other_than_running}
    ours = out_policies.get(TARGETS["policy"])
    reaction_s = settings.upscale_delay_s + args.metrics_push_s + args.node_start_s + start_s
    summary = {
        "date": dt.date.today().isoformat(),
        "what": "fleet simulation: autoscaling policies over " + ("a ramp" if args.ramp else f"{args.hours:g} h"),
        "trace": trace.description,
        "peak_sessions_open": int(trace.active.max()),
        "session_seconds": int(trace.active.sum()),
        "oracle": oracle_summary(oracle, trace, replica, args.gpu_hour_usd),
        "policies": out_policies,
        "targets": {**TARGETS, "met": None if ours is None else bool(
            ours["gpu_hours_vs_oracle"] <= TARGETS["gpu_hours_vs_oracle_max"]
            and ours["slo_violation_minutes_pct"] <= TARGETS["slo_violation_minutes_pct_max"])},
        "headroom": {
            "reaction_s": round(reaction_s, 2),
            "reaction": (f"upscale_delay_s {settings.upscale_delay_s:g} + metrics push {args.metrics_push_s:g} + "
                         f"node start {args.node_start_s:g} + replica start {start_s:g}"),
            "load_rise_within_reaction_p99": round(rise_within(trace, reaction_s, 0.99), 3),
            "load_rise_within_reaction_max": round(rise_within(trace, reaction_s, 1.0), 3),
            "note": "a policy serves the trace's rises within the SLO about 99 % of the time when each replica's "
                    "capacity_over_mean_load (sessions at the SLO / mean sessions served) is at least the p99 "
                    "rise; each point above it is GPU-hours over the oracle (bench/fleet_workload.py rise_within)",
        },
        "sim_vs_live_replica_error": None,
        "sim_vs_live_note": "not compared in this run: python -m bench.fleet_sim --live <run>/autoscale.json "
                            "--latest <this file> replays a live ramp (bench/fleet_live.py)",
        "inputs": {
            "measured": {
                "replica_curve": replica.source,
                "replica_curve_from": ("--report" if args.report else
                                       f"the measurements of {record.relative_to(ROOT)}, the fastcosy calibrate "
                                       f"record {settings.source.split(' (')[0]} names at its slo_streams"),
                "first_audio_p99_ms_vs_sessions": replica.p99_ms.as_dict(),
                "streams_in_flight_per_session_vs_sessions": replica.streams_per_session.as_dict(),
                "audio_s_per_session_s_vs_sessions": replica.audio_per_session.as_dict(),
                "gpu_util_pct_vs_streams_in_flight": replica.util_pct.as_dict(),
                "slo_first_audio_p99_ms": replica.slo_p99_ms,
                "capacity_sessions": replica.capacity_sessions,
                "sessions_per_replica_at_slo": round(replica.max_sessions, 3),
                "slo_streams_measured": round(replica.slo_streams, 3),
                "setpoint": {"slo_streams": setpoint, "source": settings.source.split(" (")[0],
                             "calibrate_derives_from_the_curve": derived, "same_measurement": derived == setpoint},
                "replica_start_s": {"value": start_s, "source": start_source},
                "serve_settings": {k: v for k, v in vars(settings).items() if k not in ("source", "overrides")},
                "serve_settings_source": settings.source,
                "serve_settings_replaced": settings.overrides,
            },
            "assumed": {k: {"value": getattr(args, k), "source": src} for k, (_, src) in ASSUMPTIONS.items()},
            "model": {"tick_s": 1, "policy_period_s": 1, "note": "policy every 1 s (Serve: 0.1 s); see bench/fleet_model.py"},
            "mean_session_s": args.mean_session_s, "seed": args.seed,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ramp:
        summary["replicas_per_bin"] = {"bin_s": args.bin_s,
                                       **{n: replica_bins(r.running, args.bin_s) for n, r in runs.items()}}
    (args.out / "fleet-sim.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not args.no_series:
        per_minute = {"minute_s": 60, "sessions_peak": _minute_peaks(trace.active), "oracle": [int(v) for v in oracle],
                      **{name: series(r) for name, r in runs.items()}}
        # One line per series: a day is 1,440 values each.
        (args.out / "series.json").write_text("{\n" + ",\n".join(
            f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in per_minute.items()) + "\n}\n")
    if not args.no_plots:
        title = f"{summary['what']}: {trace.description[:150]}"
        labels = {n: p["label"] for n, p in out_policies.items()}
        plot_day(trace, runs, labels, oracle, replica, args.out / "day.png", title)
        plot_curve(replica, args.out / "curve.png")
        if trace.seconds >= 4 * 3600:  # the day's sharpest rise, an hour either side
            jump = int(np.argmax(trace.active[600:] - trace.active[:-600])) + 600
            lo, hi = max(0, jump - 3600), min(trace.seconds, jump + 3600)
            plot_window(trace, runs, labels, lo, hi, replica, args.out / "burst.png",
                        f"the sharpest 10-minute rise ({jump / 3600:.2f} h), second by second")
    if args.latest:
        summary["output"] = str(args.out)
        if args.latest.exists():  # a live comparison already there stays (bench/fleet_live.py writes it)
            kept = json.loads(args.latest.read_text())
            for key in ("sim_vs_live_replica_error", "sim_vs_live_note", "sim_vs_live"):
                if kept.get("sim_vs_live") and key in kept:
                    summary[key] = kept[key]
        args.latest.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


class _DecisionLines(logging.Handler):
    """Counts the policies' decision lines on Serve's logger (kept off the console)."""

    def __enter__(self) -> Self:
        self.count = 0
        self.serve = logging.getLogger("ray.serve")
        self.saved = self.serve.level, self.serve.propagate
        self.serve.setLevel(logging.INFO)
        self.serve.propagate = False
        self.serve.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.serve.removeHandler(self)
        self.serve.setLevel(self.saved[0])
        self.serve.propagate = self.saved[1]

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "replicas (" in record.getMessage()


def load_band_of(config) -> dict[str, Any]:
    return load_serve_settings(config).load_band


def _minute_peaks(values) -> list[int]:
    return [int(values[i:i + 60].max()) for i in range(0, len(values), 60)]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _args(argv)
    if args.live:
        from bench.fleet_live import compare_live

        result = compare_live(args.live, update_latest=args.latest is not None,
                              results=args.latest.parent if args.latest else args.live.parent.parent)
        logger.info("sim vs live: %.3f replicas mean absolute difference over %d bins",
                    result["sim_vs_live_replica_error"], result["bins"])
        return 0
    if args.out is None:
        raise SystemExit("--out is required (or --live)")
    summary = run(args)
    for name, p in summary["policies"].items():
        logger.info("%-20s GPU-h %8.1f (x%.3f oracle)  over SLO %6.2f %% of minutes  refused %.3f %%  "
                    "$%.3f per audio hour  peak %d replicas", name, p["gpu_hours"], p["gpu_hours_vs_oracle"],
                    p["slo_violation_minutes_pct"], p["rejected_share_pct"], p["cost_per_audio_hour_usd"] or 0,
                    p["peak_replicas"])
    logger.info("oracle GPU-h %.1f; targets met: %s", summary["oracle"]["gpu_hours"], summary["targets"]["met"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
