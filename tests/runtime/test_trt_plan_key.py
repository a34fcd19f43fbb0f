"""The TensorRT plan rule (``cosyvoice_runtime.trt.plan_key``), which the replica's loader and
``fastcosy doctor`` both apply: which plans a node may load, and which sidecars are unusable."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cosyvoice_runtime.trt import plan_key
from cosyvoice_runtime.trt.plan_key import EngineKey, plan_mismatches, read_sidecar, sha256_file, write_sidecar

NEEDED = {"rows": [2, 8, 16], "frames": [2, 1550, 3000], "n_mels": 80, "spk_dim": 80}
KEY = EngineKey(compute_capability="12.0", tensorrt_version="10.13.3.9", profile_hash="p" * 12,
                precision="fp16", onnx_hash="0" * 16)


def _write(root: Path, key: EngineKey = KEY, profile: dict = NEEDED, **extra) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    plan = root / key.plan_name()
    plan.write_bytes(b"engine")
    write_sidecar(plan, key, profile, **extra)
    return plan


def _mismatches(key: EngineKey = KEY, profile: dict = NEEDED, built_sha: str | None = None, *,
                cap: str | None = "12.0", trt: str | None = "10.13.3.9", **kw) -> list[str]:
    return plan_mismatches(key, profile, built_sha, compute_capability=cap, tensorrt_version=trt, **kw)


@pytest.mark.parametrize(("built", "installed", "loads"), [
    ("10.13.3.9", "10.13.3.9", True),
    ("10.13.3", "10.13.3.9", False),  # a patch release apart: plans do not load across any release
    ("10.13.3.9", "10.13.2.6", False),
    ("10.13.3.9", "11.0.0.114", False),
])
def test_tensorrt_version_must_match_exactly(built, installed, loads):
    why = _mismatches(dataclasses.replace(KEY, tensorrt_version=built), trt=installed)
    assert why == ([] if loads else [f"built with TensorRT {built}, installed is {installed}"])


@pytest.mark.parametrize(("built", "gpu", "loads"), [("12.0", "12.0", True), ("9.0", "12.0", False),
                                                     ("12.0", "9.0", False), ("8.0", "8.6", False)])
def test_compute_capability_must_match_exactly(built, gpu, loads):
    why = _mismatches(dataclasses.replace(KEY, compute_capability=built), cap=gpu)
    assert why == ([] if loads else [f"built for sm{built}, this GPU is sm{gpu}"])


@pytest.mark.parametrize(("built", "loads"), [
    (NEEDED, True),
    ({**NEEDED, "rows": [2, 16, 32], "frames": [2, 1550, 4000]}, True),  # a larger profile covers
    ({**NEEDED, "rows": [2, 4, 8]}, False),  # built for a smaller flow batch
    ({**NEEDED, "frames": [2, 1550, 2000]}, False),  # shorter calls
    ({**NEEDED, "rows": [4, 8, 16]}, False),  # min above the single CFG pair
    ({**NEEDED, "spk_dim": 512}, False),  # another model's widths
])
def test_profile_must_cover_the_replicas_min_and_max(built, loads):
    assert plan_key.profile_covers(built, NEEDED) is loads
    assert bool(_mismatches(profile=built, needed=NEEDED)) is not loads


def test_unknown_facts_precision_and_flow_checkpoint():
    stale = dataclasses.replace(KEY, compute_capability="9.0", tensorrt_version="10.12.0.36")
    assert _mismatches(stale, cap=None, trt=None) == []  # doctor without a GPU or TensorRT compares neither
    assert _mismatches(precision="fp32") == ["precision fp16, wanted fp32"]
    assert _mismatches(built_sha="a" * 64, flow_sha256="b" * 64) == ["exported from another flow.pt"]
    assert _mismatches(built_sha="a" * 64, flow_sha256="a" * 64) == []
    assert _mismatches(built_sha=None, flow_sha256="b" * 64) == []  # older sidecars record no hash


def test_sidecar_round_trip_and_plan_name(tmp_path):
    plan = _write(tmp_path, flow_sha256="f" * 64)
    meta, why = read_sidecar(plan)
    assert why is None and EngineKey.from_sidecar(meta) == KEY and meta["profile"] == NEEDED
    assert meta["key"] == KEY.digest() and meta["flow_sha256"] == "f" * 64
    assert plan.name == f"estimator_full_fp16_sm120_trt10.13.3.9_{KEY.digest()}.plan"
    assert plan_key.sidecar_path(plan).name == plan.name + ".json"
    assert sha256_file(plan) == hashlib.sha256(b"engine").hexdigest()
    with pytest.raises(ValueError, match="precision"):
        dataclasses.replace(KEY, precision="int8")


def _corrupt(plan: Path, how: str) -> None:
    side = plan_key.sidecar_path(plan)
    meta = json.loads(side.read_text())
    edits = {
        "missing key": lambda m: {k: v for k, v in m.items() if k != "onnx_hash"},
        "bad precision": lambda m: {**m, "precision": "int8"},
        "bad attention": lambda m: {**m, "attention": "sliding"},
        "no profile": lambda m: {k: v for k, v in m.items() if k != "profile"},
        "profile min > max": lambda m: {**m, "profile": {**m["profile"], "rows": [16, 8, 2]}},
        "profile missing n_mels": lambda m: {**m, "profile": {k: v for k, v in m["profile"].items() if k != "n_mels"}},
        "not an object": lambda m: [m],
    }
    if how == "no sidecar":
        side.unlink()
    elif how == "empty plan":
        plan.write_bytes(b"")
    elif how == "not json":
        side.write_text("{not json")
    else:
        side.write_text(json.dumps(edits[how](meta)))


@pytest.mark.parametrize(("how", "why"), [
    ("no sidecar", "sidecar"), ("empty plan", "empty"), ("not json", "unreadable"), ("missing key", "lacks onnx_hash"),
    ("bad precision", "unknown precision 'int8'"), ("bad attention", "unknown attention 'sliding'"),
    ("no profile", "lacks profile"), ("profile min > max", "malformed profile"),
    ("profile missing n_mels", "malformed profile"), ("not an object", "does not hold an object"),
])
def test_unusable_sidecars_say_why(tmp_path, how, why):
    plan = _write(tmp_path)
    _corrupt(plan, how)
    meta, reason = read_sidecar(plan)
    assert meta is None and why in reason


def test_the_rule_imports_only_the_standard_library():
    """doctor applies it on nodes where torch is not installed yet."""
    code = ("import sys, cosyvoice_runtime.trt.plan_key\n"
            "print(','.join(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    outside = {m for m in res.stdout.strip().split(",") if m and not m.startswith("_")}
    assert outside == {"cosyvoice_runtime"}
