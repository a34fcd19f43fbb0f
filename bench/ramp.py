"""Load ramp against the service (low, high, low): replicas, utilisation and queue over time.

Drives ``POST /v1/audio/speech`` open loop (Poisson arrivals) through phases of set rates with
:mod:`bench.load`, while a sampler polls ``GET /health`` every ``--sample-s``: running synthesizer
replicas (Serve's count), each sampled replica's utilisation (NVML on GPUs, the compute busy
fraction otherwise) and engine queue (running + waiting sequences). It shows whether the
autoscaler scales out when load rises and back in when it falls, and whether utilisation under
sustained load stays in the configured band:

    python -m bench.ramp --config configs/ramp-cpu.yaml --phases low:0.3:90,high:2:240,low:0.3:240 \\
        --out bench/results/<date>-cpu-ramp/ramp-cpu-<date>

writes ``<out>.json`` (phases, per-phase load summaries, the time series), ``<out>.md`` and
``<out>.png`` (three panels over time, phases shaded). ``--url`` drives a running service instead.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.load import LoadConfig, LoadGenerator, register_voices

logger = logging.getLogger(__name__)

TEXTS = ("Hi.", "Hello there.", "A short sentence.", "Good morning, everyone.")


@dataclass(frozen=True)
class Phase:
    name: str
    rate_rps: float
    duration_s: float

    @classmethod
    def parse(cls, text: str) -> Phase:
        """``name:rate:seconds``, e.g. ``high:2.5:120``."""
        try:
            name, rate, dur = text.split(":")
            phase = cls(name, float(rate), float(dur))
        except ValueError:
            raise ValueError(f"phase must be name:rate_rps:duration_s, got {text!r}") from None
        if phase.rate_rps <= 0 or phase.duration_s <= 0:
            raise ValueError(f"phase {text!r}: rate and duration must be positive")
        return phase


class HealthSampler(threading.Thread):
    """Polls /health; each sample: time, running replicas, per-replica utilisation and queue."""

    def __init__(self, url: str, every_s: float) -> None:
        super().__init__(daemon=True, name="ramp-sampler")
        self.url, self.every_s = url, every_s
        self.series: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self._halt = threading.Event()
        self._nvml = self._nvml_handles()

    @staticmethod
    def _nvml_handles() -> list:
        """Every GPU of this node through NVML (utilisation per GPU, read here, not through the service)."""
        try:
            import pynvml

            pynvml.nvmlInit()
            return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no NVML (CPU machine): the replicas' own figures only
            return []

    def _gpu_utilization(self) -> list[float]:
        import pynvml

        return [float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in self._nvml]

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"t_s": round(time.perf_counter() - self.t0, 2)}
        try:
            body = httpx.get(f"{self.url}/health?detail=1", timeout=10).json()
        except (httpx.HTTPError, ValueError) as exc:
            return {**row, "error": type(exc).__name__}
        # Only answers of this poll (remembered ones are under synthesizer_replicas_unreached):
        # a remembered figure plotted as current would mislead.
        replicas = body.get("synthesizer_replicas") or {}
        row["replicas"] = body.get("synthesizer_running_replicas")
        row["probes_failed"] = body.get("probes_failed", 0)
        if self._nvml:
            row["gpu_utilization_pct"] = self._gpu_utilization()
        row["utilization_pct"] = {rid: r.get("utilization_pct") for rid, r in replicas.items()}
        row["queue"] = {rid: (r.get("engine") or {}).get("running", 0) + (r.get("engine") or {}).get("waiting", 0)
                        for rid, r in replicas.items()}
        return row

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            self.series.append(self.sample())

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=15)


def run_ramp(url: str, phases: list[Phase], voices: list[str], texts: tuple[str, ...] = TEXTS,
             sample_s: float = 2.0, progress: bool = True, seed: int = 0) -> dict[str, Any]:
    sampler = HealthSampler(url, sample_s)
    sampler.start()
    done = []
    try:
        for k, ph in enumerate(phases):
            start = time.perf_counter() - sampler.t0
            cfg = LoadConfig(base_url=url, mode="open", rate_rps=ph.rate_rps,
                             max_requests=max(1, int(ph.rate_rps * ph.duration_s * 2)), max_duration_s=ph.duration_s,
                             texts=texts, voices=tuple(voices), progress=progress, seed=seed + k)
            summary = LoadGenerator(cfg).run()["summary"]
            done.append({"phase": ph.name, "rate_rps": ph.rate_rps, "duration_s": ph.duration_s,
                         "start_s": round(start, 2), "end_s": round(time.perf_counter() - sampler.t0, 2),
                         "summary": summary})
            logger.info("phase %s (%.2f req/s): %s", ph.name, ph.rate_rps,
                        json.dumps({k: summary.get(k) for k in ("requests", "ok", "lost", "ttfa_p50_ms",
                                                                "ttfa_p99_ms", "throughput_x_realtime")}))
    finally:
        sampler.stop()
    return {"phases": phase_figures(done, sampler.series), "series": sampler.series}


def phase_figures(phases: list[dict[str, Any]], series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds to each phase the replica range, last replica count and median utilisation of its samples."""
    for ph in phases:
        window = [r for r in series if ph["start_s"] <= r["t_s"] <= ph["end_s"] and "replicas" in r]
        reps = [r["replicas"] for r in window if r["replicas"] is not None]
        utils = [u for r in window for u in r["utilization_pct"].values() if u is not None]
        gpus = [u for r in window for u in (r.get("gpu_utilization_pct") or [])]
        ph["gpu_utilization_pct_median"] = statistics.median(gpus) if gpus else None
        ph["probes_failed"] = sum(r.get("probes_failed", 0) for r in window)
        ph["replicas_min_max"] = [min(reps), max(reps)] if reps else None
        ph["replicas_at_end"] = reps[-1] if reps else None
        ph["utilization_pct_median"] = statistics.median(utils) if utils else None
    return phases


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [r for r in result["series"] if "replicas" in r]
    t = [r["t_s"] for r in series]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True)
    axes[0].step(t, [r["replicas"] for r in series], where="post", color="black")
    axes[0].set_ylabel("synthesizer replicas")
    ids = sorted({rid for r in series for rid in r["utilization_pct"]})
    nan = float("nan")  # a poll without this replica's answer breaks its line: no interpolation over gaps
    for rid in ids:
        axes[1].plot(t, [nan if r["utilization_pct"].get(rid) is None else r["utilization_pct"][rid] for r in series],
                     marker=".", linestyle="-", label=rid)
        axes[2].plot(t, [r["queue"].get(rid, nan) for r in series], marker=".", linestyle="-", label=rid)
    unreached = [r["t_s"] for r in series if r.get("probes_failed") and not r["utilization_pct"]]
    if unreached:
        axes[1].plot(unreached, [0] * len(unreached), "x", color="red", label="no replica answered /health")
    gpu = [(r["t_s"], r["gpu_utilization_pct"]) for r in series if r.get("gpu_utilization_pct")]
    for i in range(len(gpu[0][1]) if gpu else 0):
        axes[1].plot([g[0] for g in gpu], [g[1][i] for g in gpu], linestyle=":", label=f"GPU {i} (NVML)")
    band = result.get("band_pct")
    if band:
        axes[1].axhspan(band[0], band[1], color="green", alpha=0.15, label="target band")
    axes[1].set_ylabel("utilisation %")
    axes[2].set_ylabel("running + waiting")
    axes[2].set_xlabel("time (s)")
    colors = {"low": "#dde8f5", "high": "#f5dddd"}
    for ax in axes:
        for ph in result["phases"]:
            ax.axvspan(ph["start_s"], ph["end_s"], color=colors.get(ph["phase"], "#eeeeee"), alpha=0.5, zorder=0)
        ax.grid(True, alpha=0.3)
    if ids:
        axes[1].legend(fontsize=7, loc="upper left")
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Load ramp: {result['target']}, {result['date']}", "",
             (f"Machine: {result['machine']}. Open loop (Poisson) per phase; `/health` sampled every "
              f"{result['sample_s']} s (`bench/ramp.py`)."),
             "",
             ("| phase | req/s | s | requests | ok | lost | 429 | TTFA p50 / p99 ms | x real time "
              "| replicas min-max (end) | utilisation median % | /health probes failed |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ph in result["phases"]:
        s = ph["summary"]
        reps = ph["replicas_min_max"]
        util = ph["utilization_pct_median"]
        lines.append(f"| {ph['phase']} | {ph['rate_rps']:g} | {ph['duration_s']:g} | {s['requests']} | {s['ok']} | "
                     f"{s['lost']} | {s['rejected_429']} | {s['ttfa_p50_ms']:.0f} / {s['ttfa_p99_ms']:.0f} | "
                     f"{s['throughput_x_realtime']:.2f} | {reps[0] if reps else '-'}-{reps[1] if reps else '-'} "
                     f"({ph['replicas_at_end']}) | {'-' if util is None else f'{util:.0f}'} | "
                     f"{ph.get('probes_failed', 0)} |")
    lines += ["", f"![{result['plot']}]({result['plot']})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--config", type=Path, help="start this serve config on local Ray")
    target.add_argument("--url", help="drive a running service")
    ap.add_argument("--phases", default="low:0.3:90,high:2:240,low:0.3:240")
    ap.add_argument("--voices", type=int, default=2, help="voices registered before the ramp")
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--band", default="70,80", help="utilisation band drawn on the plot (%%)")
    ap.add_argument("--num-cpus", type=float, default=4)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    phases = [Phase.parse(p) for p in args.phases.split(",")]
    if args.config:
        from bench.soak import start_local

        url = start_local(args.config, num_cpus=args.num_cpus)
    else:
        url = args.url.rstrip("/")
    voices = register_voices(url, args.voices, prefix="ramp")
    result = run_ramp(url, phases, voices, sample_s=args.sample_s, progress=not args.no_progress)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    result.update({"target": str(args.config or url), "date": dt.date.today().isoformat(),
                   "machine": f"{os.cpu_count()} CPUs, {platform.platform()}", "sample_s": args.sample_s,
                   "band_pct": [float(x) for x in args.band.split(",")], "plot": f"{out.name}.png"})
    plot(result, out.parent / result["plot"], f"{result['target']} ({result['date']})")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(out.with_suffix(".md"))
    return 1 if any(ph["summary"]["lost"] for ph in result["phases"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
