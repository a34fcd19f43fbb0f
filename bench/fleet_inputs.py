"""Inputs of the fleet simulation (``bench/fleet_sim.py``), each loaded from the file that holds it.

Measured (read from files, never typed here):

* the per-replica latency-vs-load curve: first audio p99 against voice-agent sessions, streams in
  flight and audio made per session, NVML utilisation against streams in flight, from the Serve
  capacity reports the load band's setpoint was calibrated from: the serve config's
  ``slo_streams`` names its ``fastcosy calibrate`` record (``configs/calibration/*.json``), and the
  record names its measurements (:func:`calibration_reports`), so the curve, the setpoint and the
  configs are one measurement;
* the replica start: the newest GPU cold-start record, read by the live ramp's reader
  (:func:`replica_start`, ``bench.timed_fleet.cold_start_record``);
* Serve's autoscaling settings of the synthesizer (``configs/production.yaml``) and the idle time
  before the Ray autoscaler removes a GPU node (``deploy/kuberay/rayservice.yaml``).

Assumed (parameters; :data:`ASSUMPTIONS` states each with its source): the node start time, the
metrics push interval, the price of a GPU-hour.
"""
from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.calibrate import derive, named_record
from bench.timed_fleet import cold_start_record

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SERVE_CONFIG = ROOT / "configs" / "production.yaml"
KUBERAY_MANIFEST = ROOT / "deploy" / "kuberay" / "rayservice.yaml"

ASSUMPTIONS = {
    "node_start_s": (180.0, ("assumed: a cloud GPU VM or pod from request to a Ray worker joined, image "
                            "cached (3 min); not measured here")),
    "metrics_push_s": (10.0, ("Serve's default replica and handle metrics push interval "
                             "(RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S, ray-serve-notes.md 5.2)")),
    "gpu_hour_usd": (3.0, "assumed on-demand price of one H100 GPU-hour; cost scales linearly"),
}


class Curve:
    """Piecewise-linear y(x) through measured points, extrapolated linearly past an end or, with
    ``hold_below`` / ``hold_above``, held at that end's value."""

    def __init__(self, points: list[tuple[float, float]], hold_below: bool = False, hold_above: bool = False) -> None:
        pts = sorted(points)
        if len(pts) < 2 or len({x for x, _ in pts}) != len(pts):
            raise ValueError(f"need two or more points with distinct x, got {pts}")
        self.xs = [float(x) for x, _ in pts]
        self.ys = [float(y) for _, y in pts]
        self.hold_below, self.hold_above = hold_below, hold_above

    def __call__(self, x: float) -> float:
        if x <= self.xs[0] and self.hold_below:
            return self.ys[0]
        if x >= self.xs[-1] and self.hold_above:
            return self.ys[-1]
        i = min(max(bisect.bisect_right(self.xs, x), 1), len(self.xs) - 1)
        x0, x1, y0, y1 = self.xs[i - 1], self.xs[i], self.ys[i - 1], self.ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def crossing(self, y: float) -> float:
        """The largest x at or below which the curve stays <= ``y`` (the curve rising past it)."""
        for i in range(len(self.xs) - 1):
            x0, x1, y0, y1 = self.xs[i], self.xs[i + 1], self.ys[i], self.ys[i + 1]
            if y1 > y >= y0:
                return x0 + (y - y0) * (x1 - x0) / (y1 - y0)
        raise ValueError(f"the curve does not cross {y} between its points")

    def as_dict(self) -> dict[str, Any]:
        return {"x": self.xs, "y": self.ys, "below": "held" if self.hold_below else "linear",
                "above": "held" if self.hold_above else "linear"}


@dataclass(frozen=True)
class ReplicaModel:
    """One replica against its load in sessions (the capacity benchmark's voice-agent session:
    it asks for an answer, plays it out, asks again)."""

    p99_ms: Curve            # first audio p99 against sessions
    streams_per_session: Curve  # syntheses in flight / sessions, against sessions
    audio_per_session: Curve    # seconds of audio made per session-second, against sessions
    util_pct: Curve          # NVML utilisation against streams in flight
    slo_p99_ms: float
    capacity_sessions: int   # the reports' capacity (calibrate's: largest load meeting the SLO below every miss)
    slo_streams: float       # streams in flight at that capacity
    source: str
    reports: tuple[str, ...] = ()  # the capacity reports' JSON (paths as :func:`_shown` gives them)
    device: str | None = None  # the card the reports measured (its cold start goes with it)

    @property
    def max_sessions(self) -> float:
        """Sessions per replica at which first audio p99 reaches the SLO on the curve."""
        return self.p99_ms.crossing(self.slo_p99_ms)


def _by_load(probes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One probe per load: where a load was probed more than once, the one with the highest p99
    stands for it (as ``fastcosy calibrate`` counts a load met only if every probe met it)."""
    worst: dict[float, dict[str, Any]] = {}
    for p in probes:
        if p["load"] not in worst or p["ttfa_p99_ms"] > worst[p["load"]]["ttfa_p99_ms"]:
            worst[p["load"]] = p
    return [worst[k] for k in sorted(worst)]


def load_replica_model(reports: Path | Sequence[Path]) -> ReplicaModel:
    """The curves from capacity reports' JSON of one node and workload (a calibration's
    measurements): their steady loads (``sessions`` searches, ``--loads`` probes) and one-session probes.

    Raises:
        ValueError: the reports differ in device or workload, or no steady load met the SLO.
    """
    paths = [Path(reports)] if isinstance(reports, (str, Path)) else [Path(p) for p in reports]
    docs = [json.loads(p.read_text()) for p in paths]
    cal = derive(paths)  # checks the reports are of one node and workload; the capacity as calibrate reads it
    slo = cal.slo_ttfa_p99_ms
    steady = _by_load([p for d in docs for s in d["searches"] if s["kind"] in ("sessions", "loads")
                       for p in s["probes"]])
    one = [p for p in _by_load([p for d in docs for s in d["searches"] if s["kind"] == "one-session"
                                for p in s["probes"]]) if p["load"] not in {q["load"] for q in steady}]
    latency = [(p["load"], p["ttfa_p99_ms"]) for p in steady + one]
    # A probe stops early at its first failed or underrun request (``aborted``): its in-flight and
    # audio figures cover seconds, not the window. The others, past the SLO's p99 or not, served
    # the whole window at that load and describe it.
    whole = [p for p in steady if p.get("aborted") is None]
    per_session = [(p["load"], p["streams_in_flight_mean"] / p["load"]) for p in whole]
    audio = [(p["load"], p["audio_s"] / p["window_s"] / p["load"]) for p in whole]
    if len(whole) == 1:  # one steady load measured: its shares held at every load
        per_session.insert(0, (0.0, per_session[0][1]))
        audio.insert(0, (0.0, audio[0][1]))
    met = [p for p in steady if p["meets_slo"]]
    # An idle GPU reads 0 % (assumed anchor); the rest is measured (one-session probe included).
    util = [(0.0, 0.0)] + sorted({(p["streams_in_flight_mean"], p["gpu_util_pct"]) for p in met + one
                                  if p.get("gpu_util_pct") is not None})
    at_cap = min(p["streams_in_flight_mean"] for d in docs for s in d["searches"] if s["kind"] in ("sessions", "loads")
                 for p in s["probes"] if p["load"] == cal.sessions and p["meets_slo"])
    first = docs[0]
    shown = tuple(_shown(p) for p in paths)
    return ReplicaModel(
        # Below the lightest steady load the share of a session in synthesis is held (assumed: less
        # load synthesises faster, so this overstates streams there); past the heaviest, the latency
        # and in-flight curves keep rising along their last segment.
        p99_ms=Curve(latency), streams_per_session=Curve(per_session, hold_below=True),
        audio_per_session=Curve(audio, hold_below=True, hold_above=True),
        util_pct=Curve(_distinct_x(util), hold_above=True), slo_p99_ms=slo, capacity_sessions=int(cal.sessions),
        slo_streams=float(at_cap),
        source=f"{' + '.join(shown)} ({first['device']}, {cal.date}, {cal.family}, level {cal.level}, "
               f"{cal.workload} workload)",
        reports=shown, device=first["device"])


def _distinct_x(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """One point per x (the last of equal readings), as :class:`Curve` needs."""
    return sorted(dict(points).items())


def _shown(report_json: Path) -> str:
    """A report's path as the summary cites it: from the repository root when it is a reading
    under ``bench/results``, else as given."""
    path = report_json.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(RESULTS) else str(report_json)


def calibration_reports(config: Path = SERVE_CONFIG) -> tuple[Path, list[Path]]:
    """The ``fastcosy calibrate`` record a serve config's ``slo_streams`` names, and the capacity
    reports it was derived from (``measurements``), as paths.

    Raises:
        ValueError: the config names no record, or more than one.
    """
    records = sorted(set(named_record(config.read_text())))
    if len(records) != 1:
        raise ValueError(f"{config}: its slo_streams should name one calibration record, names {records}")
    record = ROOT / records[0]
    return record, [ROOT / m for m in json.loads(record.read_text())["measurements"]]


def replica_start(results: Path = RESULTS, gpu: str | None = None) -> tuple[float, str]:
    """The newest measured GPU cold start (process start to first request served), on ``gpu`` where
    there is one (the card of the replica curve), and its source.

    Raises:
        FileNotFoundError: no cold-start record was measured on a GPU.
    """
    cold = cold_start_record(results, gpu=gpu)
    if cold is None:
        raise FileNotFoundError(f"no GPU cold-start-*.json under {results}: pass --replica-start-s")
    return cold["cold_start_s"], (f"{cold['source']} ({cold['device']}, {cold['date']}): process start to "
                                  "first request served, the newest GPU cold-start record "
                                  "(bench.timed_fleet.cold_start_record)")


@dataclass(frozen=True)
class ServeSettings:
    """The synthesizer's autoscaling settings as Serve applies them."""

    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float
    upscale_delay_s: float
    downscale_delay_s: float
    look_back_period_s: float
    max_ongoing_requests: int
    load_band: dict[str, Any]
    node_idle_timeout_s: float
    source: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)


def _find(tree: Any, key: str) -> Any:
    """The first value under ``key`` anywhere in a YAML tree (depth first)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            found = _find(item, key)
            if found is not None:
                return found
    return None


def load_serve_settings(config: Path = SERVE_CONFIG, manifest: Path = KUBERAY_MANIFEST,
                        **overrides: Any) -> ServeSettings:
    """The synthesizer block of a serve config and the KubeRay autoscaler's idle timeout;
    ``overrides`` replace fields (e.g. ``max_replicas`` for a fleet larger than the config's)."""
    synth = _find(yaml.safe_load(config.read_text()), "synthesizer")
    auto = synth["autoscaling"]
    idle = _find(next(yaml.safe_load_all(manifest.read_text())), "idleTimeoutSeconds")
    values = {
        "min_replicas": int(auto["min_replicas"]), "max_replicas": int(auto["max_replicas"]),
        "target_ongoing_requests": float(auto["target_ongoing_requests"]),
        "upscale_delay_s": float(auto["upscale_delay_s"]), "downscale_delay_s": float(auto["downscale_delay_s"]),
        "look_back_period_s": float(auto["look_back_period_s"]),
        "max_ongoing_requests": int(synth["max_ongoing_requests"]),
        "load_band": {k: v for k, v in auto["load_band"].items() if k != "enabled"},
        "node_idle_timeout_s": float(idle)}
    unknown = set(overrides) - set(values)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}")
    values.update(overrides)
    return ServeSettings(**values, source=f"{config.relative_to(ROOT)} (synthesizer.autoscaling), "
                                          f"{manifest.relative_to(ROOT)} (idleTimeoutSeconds)",
                         overrides=dict(overrides))
