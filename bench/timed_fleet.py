"""Timed replicas for the live autoscaling ramp (``bench/autoscale_live.py``), calibrated from files.

A fleet of GPUs we do not have: Ray declares N logical GPUs and each synthesizer replica takes
one, running :mod:`bench.timed_runtime` (it sleeps a GPU's times). Two things make those replicas
stand for the measured H100 ones, both read from ``bench/results`` (no figure is typed here):

* **Speed** (:func:`calibrate`): the newest H100 Serve-level capacity reading of the production
  workload (``*-h100-production*/capacity-serve-*.json``) gives, at the largest load that met the
  SLO, the sessions one replica holds and its streams in flight (the load band's ``slo_streams``).
  The timed profile's two lanes are scaled to that replica's own stage times, each from the probe
  where it is alone: the **decode step** from the one-session probe's first chunk (its tokens after
  the first, before any other stream's token2wav runs), **token2wav** from that probe's first-chunk
  solve; the **contention** ``llm_slowdown`` from the SLO probe's first chunk, whose steps ran
  slower by ``1 + llm_slowdown x`` the share of time token2wav was busy (a first chunk's steps are
  not held by ``give_way``, which the timed replica's own deployment code does). One factor for
  everything (before 2026-12-07) matched a stream's speed at the SLO but made every decode step
  ~3.5 ms on an H100 whose first chunk runs at ~1.6 ms a token: the timed replicas' first audio
  was ~60 ms slower than the real one's.
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

from bench.timed_runtime import (
    FIRST_MIN_TOKENS,
    H200,
    HOP,
    LOOKAHEAD,
    MEL_PER_TOKEN,
    N_STEPS,
    GpuTimes,
    make_timed_runtime,
)
from cosyvoice_runtime.stream_schedule import first_hop

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
READING_GLOB = "*-h100-production*/capacity-serve-*.json"
FACTORY_PREFIX = "calibrated_start_ms_"
TOKENS_PER_S = 25
LLM_TIMES = ("step_ms_1", "step_ms_48", "prefill_ms")
T2W_TIMES = ("pass_ms", "pass_ms_row", "pass_ms_cached", "pass_ms_row_cached", "encoder_ms", "vocoder_ms",
             "vocoder_ms_row")
# speech tokens the LLM makes before a stream's first chunk can start: the early first hop plus the
# look-ahead, averaged over the prompt's position in the 25-token attention chunk (prompts of 3-10 s
# spread it evenly)
FIRST_CHUNK_TOKENS = sum(first_hop(n, HOP, FIRST_MIN_TOKENS) for n in range(HOP)) / HOP + LOOKAHEAD


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
    step_ms_alone: float  # a decode step with the GPU to itself (one session's first chunk)
    step_ms_at_slo: float  # ... at the SLO, token2wav t2w_busy of the time (that load's first chunks)
    t2w_busy: float  # share of the SLO probe's time the token2wav thread was busy
    llm_factor: float  # the timed profile's decode step and prefill multiplied by this
    t2w_factor: float  # its encoder, flow passes and vocoder multiplied by this
    times: GpuTimes  # the scaled profile, llm_slowdown fitted

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


def _one_session(report: dict) -> dict | None:
    return next((p for s in report.get("searches", []) if s.get("kind") == "one-session"
                 for p in s.get("probes", [])), None)


def _first_chunk_step_s(probe: dict) -> float:
    """Seconds a decode step took during a first chunk: its tokens after the first one (p50s)."""
    stages = probe["stages_ms"]
    return (stages["llm-first-chunk"][0] - stages["llm-first-token"][0]) / 1e3 / (FIRST_CHUNK_TOKENS - 1)


def calibrate(reading: Path | None = None, base: GpuTimes = H200) -> Calibration:
    """The calibration of :mod:`this module <bench.timed_fleet>` from a capacity report (module docstring)."""
    reading = reading or newest_reading()
    report = json.loads(reading.read_text())
    probe, alone = _met_at_capacity(report), _one_session(report)
    if probe is None or alone is None:
        raise ValueError(f"{reading}: calibration needs a load that met the SLO and a one-session probe")
    streams = float(probe["streams_in_flight_mean"])
    speed = float(probe["audio_s"]) / float(probe["window_s"]) / streams
    step_alone, step_slo = _first_chunk_step_s(alone), _first_chunk_step_s(probe)
    llm_factor = step_alone / base.step_s(1)
    prompt_s = sum(report["workload"]["voices"]["prompt_s"]) / 2  # the voices' prompts, uniform in that range
    first_solve_s = (base.encoder_s() + N_STEPS * base.pass_s(1, MEL_PER_TOKEN * TOKENS_PER_S * prompt_s)
                     + base.vocoder_s(1))
    t2w_factor = alone["stages_ms"]["t2w-solve"][0] / 1e3 / first_solve_s
    busy = float(probe["threads_busy"]["compute-token2wav"])
    slowdown = max(0.0, (step_slo / (llm_factor * base.step_s(max(1, round(streams)))) - 1) / busy)
    scaled = replace(base, llm_slowdown=round(slowdown, 4),
                     **{name: getattr(base, name) * llm_factor for name in LLM_TIMES},
                     **{name: getattr(base, name) * t2w_factor for name in T2W_TIMES})
    return Calibration(source=_shown(reading), device=report["device"], date=report["date"],
                       sessions_per_replica=float(probe["load"]), slo_streams=round(streams, 3),
                       stream_speed_x=round(speed, 3), slo_ttfa_p99_ms=float(report["workload"]["slo_ttfa_p99_ms"]),
                       step_ms_alone=round(step_alone * 1e3, 3), step_ms_at_slo=round(step_slo * 1e3, 3),
                       t2w_busy=busy, llm_factor=round(llm_factor, 4), t2w_factor=round(t2w_factor, 4), times=scaled)


def cold_start_record(results: Path = RESULTS, before_ready: str = "first", gpu: str | None = None) -> dict | None:
    """The newest measured GPU cold start of a replica that captured ``before_ready`` CUDA graphs
    before serving (``first``: what ``graphs_before_ready: auto`` runs on a GPU), on ``gpu`` (the
    card the calibration measured: an H200's start does not stand for an H100's) where there is one,
    else the newest of any: ``{"cold_start_s", "source", "device", "date"}``, or None when no record
    was measured on a GPU. (A record that does not say predates ``first``: it captured all of them.)"""
    found = []
    for path in [*results.glob("cold-start-*.json"), *results.glob("*/cold-start-*.json")]:
        data = json.loads(path.read_text())
        if data.get("device") == "cuda" and data.get("cold_start_s") is not None:
            graphs = (data.get("replica") or {}).get("cuda_graphs") or {}
            found.append((graphs.get("before_ready", "all") == before_ready, gpu is None or data.get("gpu") == gpu,
                          data.get("date", ""), path.parent.name, path.name, path, data))
    if not found:
        return None
    *_, path, data = max(found, key=lambda f: f[:5])
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
        runtime = make_timed_runtime(cfg, cal.times, f"{cal.device} ({cal.source}): H200 times, decode x{cal.llm_factor:g}, "
                                     f"token2wav x{cal.t2w_factor:g}, contention {cal.times.llm_slowdown:g}")
        runtime.details["start_s"] = round(time.perf_counter() - started, 2)
        return runtime
    return factory


def __getattr__(name: str):
    match = re.fullmatch(FACTORY_PREFIX + r"(\d+)", name)
    if match is None:
        raise AttributeError(name)
    return calibrated_factory(int(match.group(1)) / 1000)
