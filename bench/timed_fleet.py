"""Timed replicas for the live autoscaling ramp (``bench/autoscale_live.py``), calibrated from files.

A fleet of GPUs we do not have: Ray declares N logical GPUs and each synthesizer replica takes
one, running :mod:`bench.timed_runtime` (it sleeps a GPU's times). Two things make those replicas
stand for the measured H100 ones, both read from ``bench/results`` (no figure is typed here):

* **Speed** (:func:`calibrate`): the newest H100 Serve-level capacity reading of the production
  workload (``*-h100-production*/capacity-serve-*.json``) gives, at the largest load that met the
  SLO, the sessions one replica holds, its streams in flight (the load band's ``slo_streams``) and
  the audio each stream in flight made per second. The timed profile's times are scaled by one
  factor so that a stream's speed at that many streams in flight matches: to first order the
  decode step sets a stream's speed (one token, 40 ms of audio, per step), so the factor is the
  profile's audio per stream-second at that batch over the measured one.
* **Start** (:func:`cold_start_record`): the newest measured GPU cold start
  (``cold-start-*.json`` with ``device: cuda``: process start to first request served). A timed
  replica sleeps it, times the run's explicit ``start_scale``, before it is ready, so a ramp meets
  a realistic scale-up lag.

A replica cannot be handed arguments through ``synthesizer.runtime_factory`` (an import path), so
the factory's name carries them: ``bench.timed_fleet:calibrated_start_ms_<ms>`` is the calibrated
runtime that sleeps ``<ms>`` milliseconds at start (module ``__getattr__``). Each replica reads the
calibration from the same files itself.
"""
from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from bench.null_runtime import SAMPLE_RATE, SAMPLES_PER_TOKEN
from bench.timed_runtime import H200, GpuTimes, make_timed_runtime

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
READING_GLOB = "*-h100-production*/capacity-serve-*.json"
AUDIO_PER_TOKEN_S = SAMPLES_PER_TOKEN / SAMPLE_RATE
FACTORY_PREFIX = "calibrated_start_ms_"


@dataclass(frozen=True)
class Calibration:
    """What one measured replica holds at the SLO, and the timed profile scaled to its speed."""

    source: str  # the capacity report (path from the repository root)
    device: str
    date: str
    sessions_per_replica: float  # the largest load (voice-agent sessions) that met the SLO
    slo_streams: float  # streams in flight at that load (the load band's 100 % mark)
    stream_speed_x: float  # audio seconds each stream in flight made per second there
    slo_ttfa_p99_ms: float
    time_factor: float  # the timed profile's times multiplied by this
    times: GpuTimes

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["times"] = {f.name: round(getattr(self.times, f.name), 5) for f in fields(self.times)}
        return out


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _met_at_capacity(report: dict) -> dict | None:
    probes = [p for s in report.get("searches", []) if s.get("kind") in ("sessions", "loads")
              for p in s.get("probes", []) if p.get("meets_slo")]
    return max(probes, key=lambda p: p["load"], default=None)


def newest_reading(results: Path = RESULTS) -> Path:
    """The newest H100 production-workload Serve reading with a load that met the SLO (newest run
    folder first, by its dated name)."""
    for path in sorted(results.glob(READING_GLOB), key=lambda p: p.parent.name, reverse=True):
        if _met_at_capacity(json.loads(path.read_text())) is not None:
            return path
    raise FileNotFoundError(f"no {READING_GLOB} under {results} with a load meeting the SLO")


def calibrate(reading: Path | None = None, base: GpuTimes = H200) -> Calibration:
    """The calibration of :mod:`this module <bench.timed_fleet>` from a capacity report."""
    reading = reading or newest_reading()
    report = json.loads(reading.read_text())
    probe = _met_at_capacity(report)
    if probe is None:
        raise ValueError(f"{reading}: no load met the SLO")
    streams = float(probe["streams_in_flight_mean"])
    speed = float(probe["audio_s"]) / float(probe["window_s"]) / streams
    batch = max(1, round(streams))
    base_speed = AUDIO_PER_TOKEN_S / base.step_s(batch)
    factor = base_speed / speed
    scaled = replace(base, **{f.name: getattr(base, f.name) * factor for f in fields(base)
                              if f.name != "host_frac"})
    return Calibration(source=_shown(reading), device=report["device"], date=report["date"],
                       sessions_per_replica=float(probe["load"]), slo_streams=round(streams, 3),
                       stream_speed_x=round(speed, 3), slo_ttfa_p99_ms=float(report["workload"]["slo_ttfa_p99_ms"]),
                       time_factor=round(factor, 4), times=scaled)


def cold_start_record(results: Path = RESULTS, before_ready: str = "first") -> dict | None:
    """The newest measured GPU cold start of a replica that captured ``before_ready`` CUDA graphs
    before serving (``first``: what ``graphs_before_ready: auto`` runs on a GPU), else the newest
    of any: ``{"cold_start_s", "source", "device", "date"}``, or None when no record was measured
    on a GPU. (A record that does not say predates ``first``: it captured all of them.)"""
    found = []
    for path in [*results.glob("cold-start-*.json"), *results.glob("*/cold-start-*.json")]:
        data = json.loads(path.read_text())
        if data.get("device") == "cuda" and data.get("cold_start_s") is not None:
            graphs = (data.get("replica") or {}).get("cuda_graphs") or {}
            found.append((graphs.get("before_ready", "all") == before_ready, data.get("date", ""),
                          path.parent.name, path.name, path, data))
    if not found:
        return None
    *_, path, data = max(found, key=lambda f: f[:4])
    return {"cold_start_s": float(data["cold_start_s"]), "source": _shown(path), "device": data.get("gpu", "cuda"),
            "date": data.get("date")}


def factory_name(start_s: float) -> str:
    """The ``runtime_factory`` import path of a calibrated replica that starts in ``start_s``."""
    return f"bench.timed_fleet:{FACTORY_PREFIX}{round(start_s * 1000)}"


def calibrated_factory(start_s: float):
    """A ``runtime_factory``: sleeps ``start_s`` (the replica's model load and graph capture), then
    the timed runtime at the calibrated times."""
    def factory(cfg, source, plan=None):
        cal = calibrate()
        started = time.perf_counter()
        time.sleep(start_s)  # stands for model load + graph capture: the replica is not ready before
        runtime = make_timed_runtime(cfg, cal.times, f"{cal.device} ({cal.source}) x{cal.time_factor:g} of H200 times")
        runtime.details["start_s"] = round(time.perf_counter() - started, 2)
        return runtime
    return factory


def __getattr__(name: str):
    match = re.fullmatch(FACTORY_PREFIX + r"(\d+)", name)
    if match is None:
        raise AttributeError(name)
    return calibrated_factory(int(match.group(1)) / 1000)
