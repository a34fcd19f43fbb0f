"""fastcosy calibrate (bench/calibrate.py, fastcosy_cli/calibrate.py): the load band's setpoint is
derived from a recorded measurement, never typed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench import calibrate
from bench.calibrate import configured, derive, named_record, set_slo_streams, write_configs
from fastcosy_cli.main import main
from serve_app.args import AppArgs

ROOT = Path(__file__).resolve().parents[2]
# The configs whose load band has a slo_streams (found, not listed: a new one is checked too).
WITH_BAND = sorted(p for p in [*ROOT.glob("configs/*.yaml"), *ROOT.glob("deploy/**/*.yaml")]
                   if "slo_streams" in p.read_text())
# The CPU ramp's config: the embedded tiny model on a 2-core test machine, whose setpoint makes the
# CPU ramp scale at a few streams; it is not a GPU node's and no GPU measurement sets it.
CPU_TEST_CONFIGS = {"configs/ramp-cpu.yaml"}


def test_the_gpu_targets_are_the_configs_with_a_band():
    found = {p.relative_to(ROOT).as_posix() for p in WITH_BAND} - CPU_TEST_CONFIGS
    assert found == set(calibrate.GPU_TARGETS)


@pytest.mark.parametrize("path", [p for p in WITH_BAND if p.relative_to(ROOT).as_posix() not in CPU_TEST_CONFIGS],
                         ids=lambda p: p.name)
def test_each_config_holds_what_calibrate_derives_from_the_measurement_it_names(path: Path):
    text = path.read_text()
    records = named_record(text)
    values = configured(text)
    assert values and len(records) == text.count("slo_streams:")  # every setpoint names its record
    for name in set(records):
        record = json.loads((ROOT / name).read_text())
        cal = derive([ROOT / m for m in record["measurements"]])
        assert cal.record() == record  # the record is calibrate's own, not edited
        assert set(values) == {cal.slo_streams}


def test_the_setpoint_is_in_flight_at_the_h100_production_capacity():
    # The 2026-12-07 H100 readings: 24 sessions met the SLO, 32 (and 48, 64) missed it.
    low = ROOT / "bench/results/2026-12-07-h100-production-low"
    high = ROOT / "bench/results/2026-12-07-h100-production"
    reports = [next(low.glob("capacity-*.json")), next(high.glob("capacity-*.json"))]
    cal = derive(reports)
    at_24 = next(p for s in json.loads(reports[0].read_text())["searches"] for p in s["probes"] if p["load"] == 24)
    assert (cal.sessions, cal.capacity_below_sessions, cal.commit) == (24, 32, "841c0fe")
    assert cal.slo_streams <= at_24["streams_in_flight_mean"] < cal.slo_streams + 0.01


def _report(tmp_path: Path, probes: list[tuple[int, bool, float]], name: str = "r.json", **workload) -> Path:
    doc = {"device": "GPU X", "date": "2026-12-07",
           "workload": {"family": "cosyvoice2", "level": "serve", "name": "production", "slo_ttfa_p99_ms": 300.0,
                        **workload},
           "searches": [{"mode": "m", "kind": "loads", "capacity": None,
                         "probes": [{"load": n, "meets_slo": ok, "streams_in_flight_mean": f} for n, ok, f in probes]},
                        {"mode": "m", "kind": "one-session", "probes": [{"load": 1, "meets_slo": True,
                                                                         "streams_in_flight_mean": 0.9}]}]}
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_the_load_is_the_highest_met_below_every_miss(tmp_path):
    # 40 met after 32 missed: noise above a miss, not capacity
    cal = derive([_report(tmp_path, [(16, True, 1.5), (24, True, 2.345), (32, False, 3.0), (40, True, 4.0)])])
    assert (cal.sessions, cal.slo_streams, cal.capacity_below_sessions, cal.commit) == (24, 2.34, 32, "unknown")
    # a load probed twice counts as met only if both met
    a = _report(tmp_path, [(16, True, 1.5), (24, True, 2.3)], "a.json")
    b = _report(tmp_path, [(24, False, 2.2), (32, False, 3.0)], "b.json")
    assert derive([a, b]).sessions == 16
    # nothing missed: the heaviest load probed, no upper bracket
    assert derive([_report(tmp_path, [(8, True, 0.8), (12, True, 1.25)])]).capacity_below_sessions is None


@pytest.mark.parametrize("probes, other, match", [
    ([(8, False, 1.0)], {}, "no steady load met"),
    ([(8, True, 1.0)], {"level": "synth"}, "differ"),
    ([(8, True, 1.0)], {"timing_model": "h200"}, "timed"),
])
def test_reports_that_cannot_set_a_setpoint(tmp_path, probes, other, match):
    reports = [_report(tmp_path, probes, "a.json", **other)]
    if "level" in other:  # mixed with a serve-level one
        reports.append(_report(tmp_path, probes, "b.json"))
    with pytest.raises(ValueError, match=match):
        derive(reports)


def test_writing_changes_only_the_setpoint_line_and_the_file_still_loads(tmp_path):
    cal = derive([_report(tmp_path, [(8, True, 1.234), (12, False, 2.0)])])
    for source in ("configs/production.yaml", "deploy/kuberay/rayservice.yaml"):
        target = tmp_path / Path(source).name
        before = (ROOT / source).read_text()
        target.write_text(before)
        assert write_configs(cal, [target], "configs/calibration/x.json") == [target]
        after = target.read_text()
        changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
        assert len(changed) == before.count("slo_streams:") and all("slo_streams: 1.23}" in b for _, b in changed)
        assert configured(after) == [1.23] and named_record(after) == ["configs/calibration/x.json"]
    assert AppArgs.from_file(tmp_path / "production.yaml").synthesizer.autoscaling.load_band.slo_streams == 1.23
    assert yaml.safe_load(set_slo_streams("a:\n  slo_streams: 3  # old\n", 2.5, "new")) == {"a": {"slo_streams": 2.5}}
    with pytest.raises(ValueError):
        set_slo_streams("a: 1\n", 2.0, "x")


def test_the_command_writes_the_record_and_the_configs_then_checks_them(tmp_path, capsys):
    report = _report(tmp_path, [(8, True, 1.0), (16, True, 1.876), (24, False, 3.0)])
    config, record = tmp_path / "production.yaml", tmp_path / "rec.json"
    config.write_text((ROOT / "configs/production.yaml").read_text())
    assert main(["calibrate", "--from", str(report), "--write", str(config), "--record", str(record)]) == 0
    assert "slo_streams 1.87" in capsys.readouterr().out
    assert configured(config.read_text()) == [1.87] and json.loads(record.read_text())["slo_streams"] == 1.87
    assert main(["calibrate", "--check", "--from", str(report), "--write", str(config)]) == 0
    config.write_text(set_slo_streams(config.read_text(), 12, "typed by hand"))
    assert main(["calibrate", "--check", "--from", str(report), "--write", str(config)]) == 1
    assert main(["calibrate", "--from", str(tmp_path / "none.json"), "--write"]) == 2


def test_without_from_it_measures_the_serve_level_production_workload(tmp_path, monkeypatch, capsys):
    from bench import capacity

    report = _report(tmp_path, [(8, True, 1.0), (16, False, 3.0)])
    seen = []
    monkeypatch.setattr(capacity, "measure", lambda argv: (seen.append(argv), ({}, report))[1])
    monkeypatch.setattr(calibrate, "head_commit", lambda cwd=None: "abc1234")
    record = tmp_path / "rec.json"
    assert main(["calibrate", "--config", "configs/production.yaml", "--loads", "8,16", "--write",
                 "--record", str(record), "--", "--window-s", "30"]) == 0
    (argv,) = seen
    assert argv[:4] == ["--level", "serve", "--config", "configs/production.yaml"]
    assert {"--workload", "production", "--loads", "8,16", "--window-s", "30"} <= set(argv)
    assert json.loads(record.read_text())["commit"] == "abc1234"
