"""Fleet simulation for the scale we cannot rent: autoscaling policies over a day of sessions.

A discrete-time model (1 s ticks) of a GPU fleet of synthesizer replicas under Ray Serve's
autoscaler (``bench/fleet_model.py``), fed with the measured per-replica latency-vs-load curve
and Serve's settings (``bench/fleet_inputs.py``), comparing policies (``bench/fleet_policies.py``;
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

from bench.fleet_inputs import ASSUMPTIONS, SERVE_CONFIG, load_replica_model, load_serve_settings, serve_report_path
from bench.fleet_model import SimConfig, oracle_replicas, simulate
from bench.fleet_policies import policies
from bench.fleet_report import oracle_summary, plot_curve, plot_day, plot_window, replica_bins, series, summarise
from bench.fleet_workload import diurnal_trace, parse_ramp, ramp_trace

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
    p.add_argument("--report", type=Path, help="capacity report JSON (default: latest.json's capacity_report_serve)")
    p.add_argument("--config", type=Path, default=SERVE_CONFIG, help="serve config with the synthesizer's autoscaling")
    p.add_argument("--max-replicas", type=int, default=500, help="replaces the config's (sized for 8 GPUs)")
    p.add_argument("--min-replicas", type=int, help="replaces the config's")
    p.add_argument("--replica-start-s", type=float, default=a["replica_start_s"])
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
    report = args.report or serve_report_path()
    replica = load_replica_model(report)
    overrides: dict[str, Any] = {"max_replicas": args.max_replicas}
    if args.min_replicas is not None:
        overrides["min_replicas"] = args.min_replicas
    if args.band:
        low, high = (float(v) for v in args.band.split(","))
        overrides["load_band"] = dict(load_band_of(args.config), low_pct=low, high_pct=high)
    if args.node_idle_timeout_s is not None:
        overrides["node_idle_timeout_s"] = args.node_idle_timeout_s
    settings = load_serve_settings(args.config, **overrides)
    if args.ramp:
        trace = ramp_trace(parse_ramp(args.ramp))
    else:
        trace = diurnal_trace(args.hours, args.peak_sessions, seed=args.seed, mean_session_s=args.mean_session_s,
                              bursts_per_day=args.bursts_per_day)
    trace.check()
    wanted = {n for n in args.policies.split(",") if n}
    specs = [p for p in policies(settings, replica) if not wanted or p.name in wanted]
    if wanted - {p.name for p in specs}:
        raise SystemExit(f"unknown policies: {sorted(wanted - {p.name for p in specs})}")
    oracle = oracle_replicas(trace, replica, settings.min_replicas)
    runs, out_policies = {}, {}
    for spec in specs:
        cfg = SimConfig(settings=settings, replica=replica, replica_start_s=args.replica_start_s,
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
        "sim_vs_live_replica_error": None,
        "sim_vs_live_note": "not compared in this run: python -m bench.fleet_sim --live <run>/autoscale.json "
                            "--latest <this file> replays a live ramp (bench/fleet_live.py)",
        "inputs": {
            "measured": {
                "replica_curve": replica.source,
                "first_audio_p99_ms_vs_sessions": replica.p99_ms.as_dict(),
                "streams_in_flight_per_session_vs_sessions": replica.streams_per_session.as_dict(),
                "audio_s_per_session_s_vs_sessions": replica.audio_per_session.as_dict(),
                "gpu_util_pct_vs_streams_in_flight": replica.util_pct.as_dict(),
                "slo_first_audio_p99_ms": replica.slo_p99_ms,
                "capacity_sessions": replica.capacity_sessions,
                "sessions_per_replica_at_slo": round(replica.max_sessions, 3),
                "slo_streams_measured": round(replica.slo_streams, 3),
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
