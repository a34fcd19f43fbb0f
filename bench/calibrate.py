"""The load band's setpoint from a capacity measurement (``fastcosy calibrate``).

``slo_streams`` (``synthesizer.autoscaling.load_band``) is the streams one replica has in flight,
on average, at the largest load that met the latency SLO. This module derives it from the JSON of
one or more ``bench/capacity.py`` reports of one node (same device, model family, level, workload
and SLO), and writes it into the serve configs with a provenance comment naming a record file
(the measurement, its commit, device and date), so no config types the number by hand:

* **the load**: the highest load (sessions) of a ``sessions`` search or ``--loads`` probe that
  met the SLO and lies below every load that missed it (a lucky probe above a miss is noise, not
  capacity); a load probed more than once counts as met only if every probe met it. The
  one-session probe is not a steady load (its requests go back to back) and is left out.
* **the value**: that probe's ``streams_in_flight_mean`` (Little's law over its window; the
  smallest if several probes met that load), rounded *down* to two decimals: a setpoint too high
  under-provisions.

A ``loads`` probe set or a search cut short brackets the capacity rather than finding it: the
record keeps the lowest missed load above it (``capacity_below_sessions``), so the reader knows
the setpoint is a lower bound.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
# The configs whose load band a GPU node's calibration sets (a CPU test config keeps its own).
GPU_TARGETS = ("configs/production.yaml", "configs/production-trt.yaml", "configs/multi-gpu.yaml",
               "deploy/kuberay/rayservice.yaml")
RECORD_DIR = "configs/calibration"
STEADY_KINDS = ("sessions", "loads")
_LINE = re.compile(r"^(?P<head>.*\bslo_streams:\s*)(?P<value>[0-9][0-9.eE+-]*)(?P<tail>[^#\n]*?)\s*(?:#[^\n]*)?$",
                   re.MULTILINE)
_RECORD = re.compile(r"fastcosy calibrate: (?P<record>\S+\.json)")


@dataclass(frozen=True)
class Calibration:
    """A derived setpoint and where it comes from."""

    slo_streams: float
    sessions: int                     # the load it was read at
    capacity_below_sessions: int | None  # the lowest load that missed the SLO (None: none missed)
    measurements: list[str]           # the reports' JSON, relative to the repository where inside it
    device: str
    date: str
    family: str
    level: str
    workload: str
    slo_ttfa_p99_ms: float
    commit: str                       # the commit the measurement ran at ("unknown" where not recorded)
    probes: list[dict[str, Any]] = field(default_factory=list)  # (load, met, in flight) of every steady probe

    def record(self) -> dict[str, Any]:
        return {"what": "the load band's slo_streams, derived by fastcosy calibrate (bench/calibrate.py)",
                "slo_streams": self.slo_streams, "read_at_sessions": self.sessions,
                "capacity_below_sessions": self.capacity_below_sessions, "measurements": self.measurements,
                "device": self.device, "date": self.date, "family": self.family, "level": self.level,
                "workload": self.workload, "slo_ttfa_p99_ms": self.slo_ttfa_p99_ms, "commit": self.commit,
                "rule": "streams_in_flight_mean at the highest load that met the SLO below every load that "
                        "missed it, rounded down to 0.01", "probes": self.probes}

    def comment(self, record: str) -> str:
        return (f"fastcosy calibrate: {record} ({self.device}, {self.date}, {self.workload} workload, "
                f"{self.slo_streams:g} in flight at {self.sessions} sessions); not typed by hand")


def _shown(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _commit_of(report: Path) -> str:
    """The commit a measurement ran at: its run folder's ``run.json`` (``bench/results``), else unknown."""
    run = report.parent / "run.json"
    if run.exists():
        return str(json.loads(run.read_text()).get("commit") or "unknown")
    return "unknown"


def head_commit(cwd: Path = ROOT) -> str:
    """This checkout's commit (a measurement just made here ran at it), marked when the tree differs."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}+uncommitted changes" if dirty else sha


def derive(reports: list[Path], commit: str | None = None) -> Calibration:
    """The setpoint from capacity reports' JSON (see the module docstring).

    Raises:
        ValueError: the reports are of different nodes or workloads, or no steady load met the SLO.
    """
    if not reports:
        raise ValueError("no capacity report given")
    docs = [(Path(p), json.loads(Path(p).read_text())) for p in reports]
    keys = {(d["device"], d["workload"].get("family"), d["workload"].get("level"),
             d["workload"].get("name", "synthetic"), float(d["workload"]["slo_ttfa_p99_ms"])) for _, d in docs}
    if len(keys) != 1:
        raise ValueError("the reports differ in device, family, level, workload or SLO: "
                         + "; ".join(" / ".join(map(str, k)) for k in sorted(keys)))
    if any(d["workload"].get("timing_model") for _, d in docs):
        raise ValueError("a --timed report slept a GPU's times: no GPU served it, it cannot set a GPU's setpoint")
    (device, family, level, workload, slo), = keys
    probes = [p for _, d in docs for s in d["searches"] if s["kind"] in STEADY_KINDS for p in s["probes"]]
    missed = [p["load"] for p in probes if not p.get("meets_slo")]
    ceiling = min(missed) if missed else None
    met = sorted({p["load"] for p in probes if p.get("meets_slo") and p["load"] not in missed
                  and (ceiling is None or p["load"] < ceiling)})
    if not met:
        raise ValueError(f"no steady load met the SLO below {ceiling} sessions in {', '.join(map(str, reports))}")
    load = met[-1]
    value = min(float(p["streams_in_flight_mean"]) for p in probes if p["load"] == load and p.get("meets_slo"))
    if value <= 0:
        raise ValueError(f"no stream in flight at {load} sessions: the report is not a steady load")
    commits = sorted({_commit_of(p) for p, _ in docs})
    return Calibration(
        slo_streams=math.floor(value * 100) / 100, sessions=int(load), capacity_below_sessions=ceiling,
        measurements=[_shown(p) for p, _ in docs], device=device, date=max(d["date"] for _, d in docs),
        family=str(family), level=str(level), workload=str(workload), slo_ttfa_p99_ms=slo,
        commit=commit or ", ".join(commits),
        probes=[{"load": p["load"], "meets_slo": bool(p.get("meets_slo")),
                 "streams_in_flight_mean": round(float(p.get("streams_in_flight_mean") or 0), 4)}
                for p in sorted(probes, key=lambda p: p["load"])])


def record_path(cal: Calibration) -> str:
    """Where a calibration's record goes by default: one file per device and model family."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", cal.device).strip("-").lower()
    return f"{RECORD_DIR}/{slug}-{cal.family}.json"


def write_record(cal: Calibration, record: Path) -> None:
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(cal.record(), indent=1) + "\n")


def set_slo_streams(text: str, value: float, comment: str) -> str:
    """``text`` (a config file) with every ``slo_streams:`` value replaced and its line's comment
    set to ``comment``; the rest of the file is left as it is (its layout and other comments)."""
    new, count = _LINE.subn(lambda m: f"{m['head']}{value:g}{m['tail'].rstrip()}  # {comment}", text)
    if not count:
        raise ValueError("no slo_streams line")
    return new


def write_configs(cal: Calibration, targets: list[Path], record: str) -> list[Path]:
    """Sets ``slo_streams`` in each target config (see :func:`set_slo_streams`); checks each still
    parses and reads the new value. Returns the files changed."""
    changed = []
    for path in targets:
        text = path.read_text()
        new = set_slo_streams(text, cal.slo_streams, cal.comment(record))
        if configured(new) != [cal.slo_streams] * len(configured(new)):
            raise ValueError(f"{path}: after the edit it reads {configured(new)}, not {cal.slo_streams}")
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def configured(text: str) -> list[float]:
    """Every ``slo_streams`` a config file's YAML holds (a KubeRay manifest's ``serveConfigV2``,
    a YAML document inside a string, included)."""
    found: list[float] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "slo_streams":
                    found.append(float(value))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, str) and "slo_streams" in node:
            walk(yaml.safe_load(node))

    for doc in yaml.safe_load_all(text):
        walk(doc)
    return found


def named_record(text: str) -> list[str]:
    """The calibration records a config's ``slo_streams`` comments name (one per line)."""
    return [m["record"] for line in text.splitlines() if "slo_streams:" in line
            for m in [_RECORD.search(line)] if m]
