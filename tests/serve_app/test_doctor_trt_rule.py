"""doctor's TensorRT plan rule agrees with the loader's (``cosyvoice_runtime.trt.engine``).

doctor restates the rule with the standard library (it must import without torch); these tests
write plans with the loader's own sidecar writer and check that, for every case, the loader
(``read_plans`` + ``select_plans``) and doctor (``read_plan_sidecar`` + ``plan_mismatches``,
then ``check_engine_cache``) accept and reject the same plans.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from cosyvoice_runtime.trt import engine
from cosyvoice_runtime.trt.profiles import EstimatorProfile
from serve_app import doctor
from serve_app.doctor import Environment, GpuInfo, Status

NEEDED = EstimatorProfile(rows=(2, 8, 16), frames=(2, 1550, 3000), n_mels=80, spk_dim=80)

# (built with, installed): the loader keys plans by the full version string.
TRT_PAIRS = [
    ("10.13.3.9", "10.13.3.9", True),
    ("10.13.3", "10.13.3.9", False),  # a patch release apart: doctor used to accept this (major.minor)
    ("10.13.3.9", "10.13.2.6", False),
    ("10.13.3.9", "10.14.1.48", False),
    ("10.13.3.9", "11.0.0.114", False),
    ("11.4.0.106", "11.4.0.106", True),
]
# (built for, this GPU as torch/nvidia-smi report it)
CAPABILITY_PAIRS = [("12.0", (12, 0), True), ("9.0", (12, 0), False), ("12.0", (9, 0), False),
                    ("8.6", (8, 6), True), ("8.0", (8, 6), False), ("10.0", (12, 0), False)]
PROFILES = [
    (NEEDED, True),
    (EstimatorProfile(rows=(2, 16, 32), frames=(2, 1550, 4000), n_mels=80, spk_dim=80), True),  # larger covers
    (EstimatorProfile(rows=(2, 4, 8), frames=(2, 1550, 3000), n_mels=80, spk_dim=80), False),  # smaller batch
    (EstimatorProfile(rows=(2, 8, 16), frames=(2, 1550, 2000), n_mels=80, spk_dim=80), False),  # shorter calls
    (EstimatorProfile(rows=(4, 8, 16), frames=(2, 1550, 3000), n_mels=80, spk_dim=80), False),  # min too high
    (EstimatorProfile(rows=(2, 8, 16), frames=(2, 1550, 3000), n_mels=80, spk_dim=512), False),  # other model
]


def _write_plan(root: Path, *, trt: str = "10.13.3.9", cap: str = "12.0", profile: EstimatorProfile = NEEDED,
                precision: str = "fp16", attention: str = "full", **extra) -> Path:
    key = engine.EngineKey(compute_capability=cap, tensorrt_version=trt, profile_hash=profile.digest(),
                           precision=precision, onnx_hash="0" * 16, attention=attention)
    root.mkdir(parents=True, exist_ok=True)
    plan = root / key.plan_name()
    plan.write_bytes(b"engine")
    engine.write_sidecar(plan, key, profile, **extra)
    return plan


def _loader_accepts(root: Path, cap: str, trt: str, flow_sha: str | None = None) -> set[str]:
    plans, _ = engine.read_plans(root)
    chosen, _ = engine.select_plans(plans, compute_capability=cap, tensorrt_version=trt, profile=NEEDED,
                                    flow_sha256=flow_sha)
    usable = {p.path.name for p in plans if not engine.select_plans(
        [p], compute_capability=cap, tensorrt_version=trt, profile=NEEDED, flow_sha256=flow_sha)[1]}
    assert {p.path.name for p in chosen.values()} <= usable
    return usable


def _doctor_accepts(root: Path, cap: str, trt: str, flow_sha: str | None = None) -> set[str]:
    out = set()
    for plan in sorted(root.glob("*.plan")):
        meta, _ = doctor.read_plan_sidecar(plan)
        if meta is not None and not doctor.plan_mismatches(meta, compute_capability=cap, tensorrt_version=trt,
                                                           needed=NEEDED.to_dict(), flow_sha256=flow_sha):
            out.add(plan.name)
    return out


def _env(root: Path, capability: tuple[int, int], trt: str, model_dir: Path | None = None) -> Environment:
    return Environment(mode="trt", gpus=(GpuInfo(0, "gpu", capability),), tensorrt_version=trt,
                       engine_cache_dir=root, trt_profile_needed=NEEDED.to_dict(), model_dir=model_dir,
                       device="cuda")


def test_the_rules_share_their_constants_with_the_loader():
    assert doctor.PLAN_KEY_FIELDS == tuple(f.name for f in dataclasses.fields(engine.EngineKey))
    assert doctor.PLAN_PRECISIONS == engine.PRECISIONS and doctor.PLAN_ATTENTIONS == engine.ATTENTIONS
    assert doctor.PLAN_SUFFIX == engine.PLAN_SUFFIX and doctor.PLAN_SIDECAR_SUFFIX == engine.SIDECAR_SUFFIX
    plan = Path("/p/x.plan")
    assert doctor.plan_sidecar_path(plan) == engine.sidecar_path(plan)
    assert set(doctor.PLAN_PROFILE_FIELDS) == set(NEEDED.to_dict())
    assert "fastcosy build-trt --model-dir" in engine.BUILD_HINT  # the command doctor's fixes name


@pytest.mark.parametrize(("built", "installed", "loads"), TRT_PAIRS)
def test_tensorrt_version_pairs_agree(tmp_path, built, installed, loads):
    plan = _write_plan(tmp_path, trt=built)
    expected = {plan.name} if loads else set()
    assert _loader_accepts(tmp_path, "12.0", installed) == expected
    assert _doctor_accepts(tmp_path, "12.0", installed) == expected
    results = doctor.check_engine_cache(_env(tmp_path, (12, 0), installed))
    assert doctor.exit_code(results) == (0 if loads else 1), doctor.format_report(results)
    if not loads:
        assert any("fastcosy build-trt" in r.fix for r in results if r.status is Status.FAIL)


@pytest.mark.parametrize(("built", "gpu", "loads"), CAPABILITY_PAIRS)
def test_compute_capability_pairs_agree(tmp_path, built, gpu, loads):
    plan = _write_plan(tmp_path, cap=built)
    expected = {plan.name} if loads else set()
    as_torch = f"{gpu[0]}.{gpu[1]}"  # engine.gpu_compute_capability's format
    assert _loader_accepts(tmp_path, as_torch, "10.13.3.9") == expected
    assert _doctor_accepts(tmp_path, as_torch, "10.13.3.9") == expected
    assert doctor.exit_code(doctor.check_engine_cache(_env(tmp_path, gpu, "10.13.3.9"))) == (0 if loads else 1)


@pytest.mark.parametrize(("profile", "loads"), PROFILES)
def test_profile_coverage_agrees(tmp_path, profile, loads):
    plan = _write_plan(tmp_path, profile=profile)
    expected = {plan.name} if loads else set()
    assert _loader_accepts(tmp_path, "12.0", "10.13.3.9") == expected
    assert _doctor_accepts(tmp_path, "12.0", "10.13.3.9") == expected


def test_flow_checkpoint_hash_agrees(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "flow.pt").write_bytes(b"weights")
    sha = hashlib.sha256(b"weights").hexdigest()
    good = _write_plan(tmp_path / "plans", flow_sha256=sha)
    _write_plan(tmp_path / "plans", attention="chunk", flow_sha256="f" * 64)
    assert engine.sha256_file(model / "flow.pt") == sha
    assert _loader_accepts(tmp_path / "plans", "12.0", "10.13.3.9", sha) == {good.name}
    assert _doctor_accepts(tmp_path / "plans", "12.0", "10.13.3.9", sha) == {good.name}
    results = doctor.check_engine_cache(_env(tmp_path / "plans", (12, 0), "10.13.3.9", model_dir=model))
    statuses = {r.message.split(":")[0]: r.status for r in results}
    assert statuses[good.name] is Status.OK and Status.WARN in statuses.values()


def _corrupt(plan: Path, how: str) -> None:
    side = engine.sidecar_path(plan)
    meta = json.loads(side.read_text())
    if how == "no sidecar":
        side.unlink()
    elif how == "empty plan":
        plan.write_bytes(b"")
    elif how == "not json":
        side.write_text("{not json")
    elif how == "missing key":
        del meta["onnx_hash"]
        side.write_text(json.dumps(meta))
    elif how == "bad precision":
        side.write_text(json.dumps({**meta, "precision": "int8"}))
    elif how == "bad attention":
        side.write_text(json.dumps({**meta, "attention": "sliding"}))
    elif how == "no profile":
        del meta["profile"]
        side.write_text(json.dumps(meta))
    elif how == "profile min > max":
        side.write_text(json.dumps({**meta, "profile": {**meta["profile"], "rows": [16, 8, 2]}}))
    elif how == "profile missing n_mels":
        del meta["profile"]["n_mels"]
        side.write_text(json.dumps(meta))


@pytest.mark.parametrize("how", ["no sidecar", "empty plan", "not json", "missing key", "bad precision",
                                 "bad attention", "no profile", "profile min > max", "profile missing n_mels"])
def test_unusable_plans_agree(tmp_path, how):
    plan = _write_plan(tmp_path)
    _corrupt(plan, how)
    plans, skipped = engine.read_plans(tmp_path)
    assert plans == [] and len(skipped) == 1  # the loader skips it
    meta, why = doctor.read_plan_sidecar(plan)
    assert meta is None and why  # doctor says why
    results = doctor.check_engine_cache(_env(tmp_path, (12, 0), "10.13.3.9"))
    assert doctor.exit_code(results) == 1


def test_doctor_module_imports_only_the_standard_library():
    path = Path(doctor.__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('doctor_alone', {str(path)!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['doctor_alone'] = mod\n"
        "spec.loader.exec_module(mod)\n"
        "extra = sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)"
        " - {'doctor_alone', '__main__'})\n"
        "print(','.join(m for m in extra if not m.startswith('_')))\n"
    )
    res = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "", res.stdout
