"""bench/import_results.py: a device call's bundle lands in a run folder named by its day, card and
tag, with its run record; reports regenerated, the profile trace left out unless asked,
latest.json's report names the new reports by path."""
from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from bench import import_results
from bench.import_results import import_bundle

REPO = Path(__file__).resolve().parents[2]
DEVICE_STEM = "capacity-synth-nvidia-h100-80gb-hbm3-2026-12-05"
REPORT = (REPO / "bench" / "results" / "2026-12-05-h100-capacity-synth-late"
          / "capacity-synth-nvidia-h100-80gb-hbm3-2026-12-05-late.json")


def _bundle(tmp_path: Path, **extra: bytes) -> Path:
    files = {
        f"results/{DEVICE_STEM}.json": REPORT.read_bytes(),
        "results/profile-first-audio-nvidia-h100-80gb-hbm3-2026-12-05.json": b'{"requests": []}',
        "results/profile-first-audio-nvidia-h100-80gb-hbm3-2026-12-05.md": b"# profile\n",
        "results/profile-first-audio-nvidia-h100-80gb-hbm3-2026-12-05-trace.json.gz": b"\x1f\x8b big",
        "results/cold-start-nvidia-h100-80gb-hbm3-2026-12-05-run1.json": b'{"cold_start_s": 107.4}',
        "results/latest.json": json.dumps({"slo_streams": 62,
                                           "capacity_report_synth": f"{DEVICE_STEM}.md"}).encode(),
        "gpu.txt": b"name, driver_version\nNVIDIA H100 80GB HBM3, 580.1\n",
        "gpu_tests.txt": b"== runtime/test_no_gpu_waits\n4 passed\n",
        **extra,
    }
    path = tmp_path / "capacity.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size, info.mtime = len(data), 1796472000  # 2026-12-05 12:00 UTC
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_bundle_lands_in_its_run_folder_and_a_second_lease_keeps_the_first(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    bundle = _bundle(tmp_path)
    written = import_bundle(bundle, "late", out, latest=True)
    run = out / "2026-12-05-h100-late"  # the report's day and card, the tag
    assert {p.relative_to(out).as_posix() for p in written} >= {
        f"{run.name}/{DEVICE_STEM}-late.json", f"{run.name}/{DEVICE_STEM}-late.md",
        f"{run.name}/profile-first-audio-nvidia-h100-80gb-hbm3-2026-12-05-late.json",
        f"{run.name}/profile-first-audio-nvidia-h100-80gb-hbm3-2026-12-05-late.md",
        f"{run.name}/gpu-tests-nvidia-h100-80gb-hbm3-2026-12-05-late.txt", f"{run.name}/run.json", "latest.json",
        f"{run.name}/cold-start-nvidia-h100-80gb-hbm3-2026-12-05-run1-late.json"}
    assert not any(p.name.endswith(".json.gz") for p in written)  # the trace only with trace=True
    assert (run / f"{DEVICE_STEM}-late-latency.png").exists()  # the plots regenerated under the tag
    assert "62 sessions" in (run / f"{DEVICE_STEM}-late.md").read_text()
    record = json.loads((run / "run.json").read_text())
    assert record["date"] == "2026-12-05" and record["device"] == "NVIDIA H100 80GB HBM3"
    assert record["main"] == f"{DEVICE_STEM}-late.md" and f"{DEVICE_STEM}-late.json" in record["files"]
    latest_report = json.loads((out / "latest.json").read_text())["capacity_report_synth"]
    assert latest_report == f"{run.name}/{DEVICE_STEM}-late.md" and (out / latest_report).exists()
    import_bundle(bundle, "night", out, trace=True)
    night = out / "2026-12-05-h100-night"
    assert (run / f"{DEVICE_STEM}-late.json").exists() and (night / f"{DEVICE_STEM}-night.json").exists()
    assert (night / "profile-first-audio-nvidia-h100-80gb-hbm3-2026-12-05-night-trace.json.gz").exists()
    assert json.loads((out / "latest.json").read_text())["capacity_report_synth"] == latest_report
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["latest.json"]  # nothing loose


def test_the_same_tag_twice_is_refused(tmp_path):
    bundle = _bundle(tmp_path)
    import_bundle(bundle, "late", tmp_path)
    with pytest.raises(ValueError, match="exists already"):
        import_bundle(bundle, "late", tmp_path)


@pytest.mark.parametrize("tag", ["", "Late", "a b", "../x"])
def test_a_tag_is_a_plain_slug(tmp_path, tag):
    with pytest.raises(ValueError, match="tag"):
        import_bundle(_bundle(tmp_path), tag, tmp_path)
    assert os.listdir(tmp_path) == ["capacity.tgz"]


def test_the_run_record_names_the_call_the_device_script_wrote_down(tmp_path):
    """bench/device_capacity.sh writes its settings to call.txt; a bundle without it says so."""
    line = b"SERVE_S='330' TAG='x' bash bench/device_capacity.sh\n"
    import_bundle(_bundle(tmp_path, **{"call.txt": line}), "late", tmp_path)
    command = json.loads((tmp_path / "2026-12-05-h100-late" / "run.json").read_text())["command"]
    assert command.startswith("SERVE_S='330' TAG='x' bash bench/device_capacity.sh (device call), then ")
    import_bundle(_bundle(tmp_path), "night", tmp_path)
    assert "settings not recorded" in json.loads((tmp_path / "2026-12-05-h100-night" / "run.json").read_text())["command"]
    script = (REPO / "bench" / "device_capacity.sh").read_text()
    assert '> "$W/call.txt"' in script and "CAP_ARGS" in script


def test_a_live_ramp_comes_in_as_named_with_this_checkout_s_commit(tmp_path):
    ramp = "results/2026-12-05-h100-autoscale-live"
    record = {"run": "2026-12-05-h100-autoscale-live", "commit": "55b2604 (with uncommitted changes)"}
    bundle = _bundle(tmp_path, **{
        f"{ramp}/run.json": json.dumps(record).encode(),
        f"{ramp}/autoscale.json": json.dumps({"run": {"commit": "55b2604"}, "summary": {}}).encode(),
        f"{ramp}/replicas.png": b"png",
        "results/autoscale-latest.json": b'{"max_replicas": 8}',
        "results/fleet-sim-latest.json": b'{"sim_vs_live_replica_error": 0.4}'})
    out = tmp_path / "results"
    out.mkdir()
    written = import_bundle(bundle, "late", out, latest=True)
    folder = out / "2026-12-05-h100-autoscale-live"
    assert (folder / "replicas.png").read_bytes() == b"png" and folder / "replicas.png" in written
    commit = import_results._commit()
    assert json.loads((folder / "run.json").read_text())["commit"].startswith(commit + " (the checkout")
    assert json.loads((folder / "autoscale.json").read_text())["run"]["commit"].startswith(commit + " ")
    assert json.loads((out / "autoscale-latest.json").read_text()) == {"max_replicas": 8}
    assert json.loads((out / "fleet-sim-latest.json").read_text()) == {"sim_vs_live_replica_error": 0.4}
    with pytest.raises(ValueError, match="exists already"):  # a second import never overwrites a ramp
        import_bundle(bundle, "night", out)
    assert not (out / "2026-12-05-h100-night").exists()  # and refuses before writing anything
