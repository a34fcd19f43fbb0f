"""fastcosy doctor: every check against faked environments (no GPU, Ray or TensorRT needed)."""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastcosy_cli import doctor
from fastcosy_cli.doctor_checks import (
    CHECKS,
    Environment,
    GpuInfo,
    Status,
    arch_support,
    check_driver,
    check_engine_cache,
    check_gpu,
    check_gpu_arch,
    check_gpu_memory,
    check_model_dir,
    check_model_files,
    check_ray,
    check_tensorrt,
    check_torch,
    check_wetext,
    exit_code,
    format_report,
    run_checks,
)

GIB = 1024**3
# torch 2.6.0+cu124's arch list: no Blackwell, no PTX.
CU124_ARCHS = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
CU128_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")
RTX5090 = GpuInfo(0, "NVIDIA GeForce RTX 5090", (12, 0), 32 * GIB, 30 * GIB)
H200 = GpuInfo(0, "NVIDIA H200", (9, 0), 141 * GIB, 139 * GIB)


def gpu_env(**kw) -> Environment:
    base = {"torch_version": "2.7.1+cu128", "torch_cuda_version": "12.8", "torch_arch_list": CU128_ARCHS,
            "cuda_available": True, "gpus": (RTX5090,), "driver_version": "570.124.04",
            "driver_cuda_version": "12.8", "needs_gpu": True, "device": "cuda"}
    base.update(kw)
    return Environment(**base)


def only(results):
    assert len(results) == 1
    return results[0]


# ------------------------------------------------------------------------------- GPU / torch
def test_rtx5090_with_torch_lacking_sm120_fails_with_the_torch_cuda128_fix():
    env = gpu_env(torch_version="2.6.0+cu124", torch_cuda_version="12.4", torch_arch_list=CU124_ARCHS)
    r = only(check_gpu_arch(env))
    assert r.status is Status.FAIL
    assert "sm_120" in r.message and "no kernel image is available" in r.message
    assert "install torch >= 2.7 built with CUDA 12.8" in r.fix
    assert exit_code(run_checks(env)) == 1


def test_rtx5090_with_cu128_torch_passes_arch_check():
    assert only(check_gpu_arch(gpu_env())).status is Status.OK


def test_arch_compatibility_rules():
    assert arch_support(["sm_80"], (8, 6)) == "native"  # same major, newer minor runs the cubin
    assert arch_support(["sm_86"], (8, 0)) is None  # not the other way round
    assert arch_support(["sm_90a"], (9, 0)) == "native"
    assert arch_support(["sm_90a"], (10, 0)) is None  # arch-specific cubins run only there
    assert arch_support(["sm_90", "compute_90"], (12, 0)) == "ptx"  # PTX JIT for newer GPUs
    assert arch_support(["sm_100"], (12, 0)) is None  # Blackwell datacenter cubins do not run on sm_120


def test_ptx_only_support_is_a_warning():
    env = gpu_env(torch_arch_list=("sm_80", "sm_90", "compute_90"))
    r = only(check_gpu_arch(env))
    assert r.status is Status.WARN and "JIT" in r.message


def test_old_driver_for_torch_cuda_fails_with_driver_version():
    env = gpu_env(driver_version="535.104", driver_cuda_version="11.8")
    r = check_driver(env)
    assert r.status is Status.FAIL
    assert "570.26" in r.fix and "CUDA <= 11.8" in r.fix


def test_driver_minor_version_behind_is_a_warning():
    r = check_driver(gpu_env(driver_version="560.35", driver_cuda_version="12.6"))
    assert r.status is Status.WARN and "570.26" in r.fix


def test_driver_ok_and_skipped_without_gpu():
    assert check_driver(gpu_env()).status is Status.OK
    assert check_driver(Environment(torch_version="2.13.0+cpu")).status is Status.OK


def test_cpu_torch_on_gpu_config_fails_but_cpu_config_is_fine():
    cpu = Environment(torch_version="2.13.0+cpu", needs_gpu=True, driver_version="570.1")
    r = check_gpu(cpu)
    assert r.status is Status.FAIL and "CUDA build of torch" in r.fix
    cpu.needs_gpu = False
    assert check_gpu(cpu).status is Status.OK


def test_missing_driver_in_container_points_to_container_toolkit():
    env = Environment(torch_version="2.7.1+cu128", torch_cuda_version="12.8", needs_gpu=True)
    r = check_gpu(env)
    assert r.status is Status.FAIL and "--gpus all" in r.fix


def test_torch_missing_and_too_old():
    assert check_torch(Environment()).status is Status.FAIL
    assert check_torch(Environment(torch_version="2.3.1+cu121", torch_cuda_version="12.1")).status is Status.FAIL
    assert check_torch(Environment(torch_version="2.13.0+cpu")).status is Status.OK


# ---------------------------------------------------------------------------------- TensorRT
def test_tensorrt_needed_only_in_trt_mode():
    assert check_tensorrt(Environment(mode="pytorch")).status is Status.OK
    r = check_tensorrt(Environment(mode="trt", tensorrt_error="ModuleNotFoundError: tensorrt"))
    assert r.status is Status.FAIL and "[trt] extra" in r.fix
    assert check_tensorrt(Environment(mode="trt", tensorrt_version="10.8.0")).status is Status.FAIL
    assert check_tensorrt(Environment(mode="trt", tensorrt_version="10.13.3.9")).status is Status.OK


PROFILE = {"rows": [2, 8, 16], "frames": [2, 1550, 3000], "n_mels": 80, "spk_dim": 80}


def _meta(**kw) -> dict:
    """A complete sidecar as ``cosyvoice_runtime.trt.plan_key.write_sidecar`` writes it."""
    meta = {"compute_capability": "12.0", "tensorrt_version": "10.13.3.9", "profile_hash": "p" * 12,
            "precision": "fp16", "onnx_hash": "o" * 16, "attention": "full", "key": "k" * 16, "profile": PROFILE}
    meta.update(kw)
    return meta


def _plan(d: Path, name: str, meta: dict | None = None, size: int = 16) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_bytes(b"\0" * size)
    if meta is not None:
        (d / (name + ".json")).write_text(json.dumps(meta))
    return p


def _trt_env(plans: Path, **kw) -> Environment:
    base = {"mode": "trt", "tensorrt_version": "10.13.3.9", "engine_cache_dir": plans,
            "trt_profile_needed": PROFILE, "model_dir": Path("/models/cv2")}
    return gpu_env(**{**base, **kw})


def _by_plan(results) -> dict:
    return {r.message.split(":")[0]: r for r in results if r.message.split(":")[0].endswith(".plan")}


def test_engine_cache_plan_for_this_gpu_and_exact_trt_loads(tmp_path):
    _plan(tmp_path, "full.plan", _meta())
    _plan(tmp_path, "chunk.plan", _meta(attention="chunk"))
    results = check_engine_cache(_trt_env(tmp_path))
    assert [r.status for r in results] == [Status.OK, Status.OK], format_report(results)
    assert "a replica loads it" in results[0].message
    assert exit_code(results) == 0


def test_engine_cache_patch_release_of_tensorrt_is_a_mismatch(tmp_path):
    # The loader keys plans by the full TensorRT version: 10.13.3 plans do not load on 10.13.3.9.
    _plan(tmp_path, "a.plan", _meta(tensorrt_version="10.13.3"))
    results = check_engine_cache(_trt_env(tmp_path))
    r = _by_plan(results)["a.plan"]
    assert r.status is Status.FAIL and "built with TensorRT 10.13.3, installed is 10.13.3.9" in r.message
    assert "fastcosy build-trt --model-dir /models/cv2 --out " in r.fix and "--fp16 --max-batch 8" in r.fix
    assert results[-1].status is Status.FAIL and "refuse to start" in results[-1].message
    assert "fastcosy build-trt" in results[-1].fix and exit_code(results) == 1


def test_engine_cache_built_for_another_gpu_fails(tmp_path):
    _plan(tmp_path, "estimator_sm90.plan", _meta(compute_capability="9.0"))
    r = _by_plan(check_engine_cache(_trt_env(tmp_path)))["estimator_sm90.plan"]
    assert r.status is Status.FAIL and "built for sm9.0, this GPU is sm12.0" in r.message
    assert "build-trt" in r.fix


def test_engine_cache_profile_must_cover_the_replica(tmp_path):
    small = {**PROFILE, "rows": [2, 4, 8]}  # built with --max-batch 4, the replica batches 8
    _plan(tmp_path, "small.plan", _meta(profile=small))
    r = _by_plan(check_engine_cache(_trt_env(tmp_path)))["small.plan"]
    assert r.status is Status.FAIL and "does not cover rows (2, 8, 16)" in r.message
    assert "--max-batch 8" in r.fix


def test_engine_cache_plan_of_another_flow_checkpoint_fails(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "flow.pt").write_bytes(b"weights v2")
    _plan(tmp_path / "plans", "a.plan", _meta(flow_sha256=hashlib.sha256(b"weights v1").hexdigest()))
    env = _trt_env(tmp_path / "plans")
    env.model_dir = model
    r = _by_plan(check_engine_cache(env))["a.plan"]
    assert r.status is Status.FAIL and "another flow.pt" in r.message
    (model / "flow.pt").write_bytes(b"weights v1")
    assert exit_code(check_engine_cache(env)) == 0


def test_stale_plan_beside_a_usable_one_is_a_warning(tmp_path):
    _plan(tmp_path, "new.plan", _meta())
    _plan(tmp_path, "old.plan", _meta(tensorrt_version="10.12.0.36"))
    results = check_engine_cache(_trt_env(tmp_path))
    by = _by_plan(results)
    assert by["new.plan"].status is Status.OK
    assert by["old.plan"].status is Status.WARN and "ignored by replicas" in by["old.plan"].message
    assert "delete" in by["old.plan"].fix and exit_code(results) == 0


def test_unusable_plans_empty_no_sidecar_incomplete_sidecar_and_missing_dir(tmp_path):
    _plan(tmp_path, "empty.plan", size=0)
    _plan(tmp_path, "bare.plan")  # no sidecar: the loader skips it whatever its name says
    _plan(tmp_path, "partial.plan", {"compute_capability": "12.0", "tensorrt_version": "10.13.3.9"})
    _plan(tmp_path, "badprec.plan", _meta(precision="int8"))
    by = _by_plan(check_engine_cache(_trt_env(tmp_path)))
    assert "empty" in by["empty.plan"].message
    assert "no bare.plan.json sidecar" in by["bare.plan"].message
    assert "lacks profile_hash" in by["partial.plan"].message
    assert "unknown precision 'int8'" in by["badprec.plan"].message
    assert all(r.status is Status.FAIL for r in by.values())
    env = _trt_env(tmp_path / "nope")
    r = only(check_engine_cache(env))
    assert r.status is Status.FAIL and "does not exist" in r.message and "build-trt" in r.fix


def test_engine_cache_without_detected_gpu_or_tensorrt_warns_and_pytorch_mode_skips(tmp_path):
    _plan(tmp_path, "a.plan", _meta())
    env = _trt_env(tmp_path, tensorrt_version=None)
    r = _by_plan(check_engine_cache(env))["a.plan"]
    assert r.status is Status.WARN and "installed TensorRT version" in r.message
    assert only(check_engine_cache(gpu_env(mode="pytorch"))).status is Status.OK


def test_doctor_checks_import_only_the_standard_library_and_the_plan_rule():
    """doctor runs on a GPU node before torch or the serving stack is installed."""
    code = ("import sys, fastcosy_cli.doctor_checks\n"
            "print(','.join(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    outside = {m for m in res.stdout.strip().split(",") if m and not m.startswith("_")}
    assert outside == {"fastcosy_cli", "cosyvoice_runtime"}


def test_only_full_attention_plans_is_noted_not_failed(tmp_path):
    _plan(tmp_path, "full.plan", _meta())
    results = check_engine_cache(_trt_env(tmp_path))
    assert exit_code(results) == 0 and any("no chunk-attention plan" in r.message for r in results)


# ------------------------------------------------------------------------------- model files
CV2_FILES = ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx",
             "CosyVoice-BlankEN/config.json", "CosyVoice-BlankEN/tokenizer_config.json",
             "CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt")


def _fake_model_dir(root: Path, files=CV2_FILES) -> Path:
    import zipfile

    for rel in files:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".pt"):
            with zipfile.ZipFile(p, "w") as zf:
                zf.writestr("archive/data.pkl", b"x")
        elif rel.endswith(".json"):
            p.write_text("{}")
        else:
            p.write_bytes(b"placeholder")
    return root


def test_complete_fake_model_dir_passes(tmp_path):
    env = Environment(model_dir=_fake_model_dir(tmp_path))
    assert check_model_dir(env).status is Status.OK


def test_missing_official_file_is_named(tmp_path):
    d = _fake_model_dir(tmp_path, [f for f in CV2_FILES if f != "speech_tokenizer_v2.onnx"])
    r = check_model_dir(Environment(model_dir=d))
    assert r.status is Status.FAIL and "speech_tokenizer_v2.onnx" in r.message


def test_cv3_needs_v3_tokenizer(tmp_path):
    files = [f.replace("cosyvoice2", "cosyvoice3") for f in CV2_FILES]
    d = _fake_model_dir(tmp_path, files)
    r = check_model_dir(Environment(model_dir=d))
    assert r.status is Status.FAIL and "speech_tokenizer_v3.onnx" in r.message


def test_model_dir_absent_unset_and_v1(tmp_path):
    assert check_model_dir(Environment(model_dir=tmp_path / "missing")).status is Status.FAIL
    assert check_model_dir(Environment(model_dir=None)).status is Status.WARN  # tiny default
    (tmp_path / "cosyvoice.yaml").write_text("")
    r = check_model_dir(Environment(model_dir=tmp_path))
    assert r.status is Status.FAIL and "v1" in r.message


def test_truncated_checkpoint_found_without_checksums(tmp_path):
    d = _fake_model_dir(tmp_path)
    (d / "flow.pt").write_bytes(b"PK\x03\x04 truncated")
    (d / "hift.pt").write_bytes(b"")
    r = check_model_files(Environment(model_dir=d))
    assert r.status is Status.FAIL and "flow.pt" in r.message and "hift.pt (empty)" in r.message


def test_checksums_json_is_verified(tmp_path):
    d = _fake_model_dir(tmp_path)
    sums = {rel: hashlib.sha256((d / rel).read_bytes()).hexdigest() for rel in CV2_FILES}
    (d / "checksums.json").write_text(json.dumps(sums))
    assert check_model_files(Environment(model_dir=d)).status is Status.OK
    (d / "llm.pt").write_bytes(b"changed")
    r = check_model_files(Environment(model_dir=d))
    assert r.status is Status.FAIL and "llm.pt (checksum mismatch)" in r.message
    assert check_model_files(Environment(model_dir=d, verify_checksums=False)).status is Status.OK


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("cosyvoice_runtime.flow.flow")  # the tiny writer builds the real modules
    from cosyvoice_runtime.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-cv2", family="cosyvoice2")


def test_real_tiny_model_passes_completeness_and_checksums(tiny_model):
    env = Environment(model_dir=tiny_model)
    assert check_model_dir(env).status is Status.OK
    r = check_model_files(env)
    assert r.status is Status.OK and "checksums.json" in r.message


# ------------------------------------------------------------------------- wetext, Ray, memory
def test_wetext_versions_and_grammars(tmp_path):
    assert check_wetext(Environment()).status is Status.FAIL
    assert check_wetext(Environment(wetext_version="0.0.4")).status is Status.FAIL
    r = check_wetext(Environment(wetext_version="0.1.8", wetext_fst_dir=tmp_path))
    assert r.status is Status.FAIL and "zh/tn/tagger.fst" in r.message
    for rel in ("en/tn/tagger.fst", "en/tn/verbalizer.fst", "zh/tn/tagger.fst", "zh/tn/verbalizer.fst"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"fst")
    assert check_wetext(Environment(wetext_version="0.1.8", wetext_fst_dir=tmp_path)).status is Status.OK


def test_ray_reachability_uses_the_injected_probe():
    calls = []

    def probe(addr):
        calls.append(addr)
        return None if addr.endswith("8265") else "ConnectError: refused"

    assert check_ray(Environment(ray_address="http://head:8265", ray_probe=probe)).status is Status.OK
    r = check_ray(Environment(ray_address="http://head:9999", ray_probe=probe))
    assert r.status is Status.FAIL and "refused" in r.message and "8265" in r.fix
    assert calls == ["http://head:8265", "http://head:9999"]
    assert check_ray(Environment()).status is Status.OK  # local mode: nothing to reach


def test_ray_probe_reports_closed_port():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "Error" in doctor.probe_ray(f"127.0.0.1:{port}")


def test_free_gpu_memory_against_max_mem_gb():
    busy = GpuInfo(0, "NVIDIA GeForce RTX 5090", (12, 0), 32 * GIB, 5 * GIB)
    r = check_gpu_memory(gpu_env(gpus=(busy,), max_mem_gb=12))
    assert r.status is Status.FAIL and "5.0 GiB free" in r.message and "12.0 GiB" in r.message
    assert check_gpu_memory(gpu_env(max_mem_gb=12)).status is Status.OK
    assert check_gpu_memory(gpu_env(gpus=(GpuInfo(0, "x", (12, 0), 32 * GIB, 13 * GIB),), max_mem_gb=12)
                            ).status is Status.WARN
    assert check_gpu_memory(gpu_env(estimated_need_bytes=40 * GIB)).status is Status.FAIL
    assert check_gpu_memory(gpu_env(device="cuda:3", max_mem_gb=1)).status is Status.FAIL  # GPU not visible


def test_the_need_estimate_counts_the_incremental_flow_budget_only_when_that_flow_is_on(tiny_model):
    """On by default ("auto") wherever the replica may run on a GPU, off on the CPU or when set to recompute."""
    from deployments.synthesizer_config import SynthesizerConfig

    base = doctor.estimate_need_bytes(tiny_model, "bfloat16", 8, 512)
    assert base > 0
    off = {"cv2_flow": "recompute", "cv3_flow": "recompute"}
    for device, knobs, extra in (("auto", {}, 16 * GIB), ("cuda", {"flow_cache_bytes": 3 * GIB}, 3 * GIB),
                                 ("cpu", {}, 0), ("cuda", off, 0),
                                 ("cuda", {**off, "cv2_flow": "incremental", "flow_cache_bytes": 3 * GIB}, 3 * GIB),
                                 ("cuda", {**off, "cv3_flow": "incremental"}, 16 * GIB)):
        synth = SynthesizerConfig(device=device, token2wav=knobs)
        budget = doctor.incremental_flow_budget(synth)
        assert budget == extra, knobs
        assert doctor.estimate_need_bytes(tiny_model, "bfloat16", 8, 512, budget) == base + extra


# ------------------------------------------------------------------------------ whole report
def test_healthy_gpu_node_exits_zero(tmp_path):
    fst = tmp_path / "fsts"
    for rel in ("en/tn/tagger.fst", "en/tn/verbalizer.fst", "zh/tn/tagger.fst", "zh/tn/verbalizer.fst"):
        (fst / rel).parent.mkdir(parents=True, exist_ok=True)
        (fst / rel).write_bytes(b"fst")
    env = gpu_env(gpus=(H200,), model_dir=_fake_model_dir(tmp_path / "m"), wetext_version="0.1.8",
                  wetext_fst_dir=fst, max_mem_gb=20)
    results = run_checks(env)
    assert exit_code(results) == 0, format_report(results)
    assert {r.name for r in results} >= {c.__name__.removeprefix("check_") for c in CHECKS}


def test_a_crashing_check_is_reported_not_raised():
    def check_boom(env):
        raise RuntimeError("kaboom")

    results = run_checks(Environment(), checks=(check_boom, check_torch))
    assert results[0].status is Status.FAIL and "kaboom" in results[0].message
    assert results[1].name == "torch"


def test_cli_run_prints_report_and_returns_exit_code(capsys):
    env = gpu_env(torch_version="2.6.0+cu124", torch_cuda_version="12.4", torch_arch_list=CU124_ARCHS)
    args = argparse.Namespace(json=False)
    assert doctor.run(args, environment=env) == 1
    text = capsys.readouterr().out
    assert "[FAIL] gpu_arch" in text and "serving is blocked" in text
    args.json = True
    doctor.run(args, environment=gpu_env())
    data = json.loads(capsys.readouterr().out)
    assert {d["status"] for d in data} <= {"ok", "warn", "fail"}


def test_probe_of_this_machine_with_a_config_does_not_crash(tmp_path):
    cfg = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
    ns = argparse.Namespace(config=str(cfg), model_dir=None, plan_dir=None, mode=None, device=None,
                            ray_address=None, max_mem_gb=None, no_checksums=True, json=False)
    env = doctor.probe_environment(ns)
    assert env.config_error is None and env.torch_version and env.mode == "pytorch"
    assert env.wetext_version is not None


# ------------------------------------------------------------------- probes, faked environment
FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu*) echo "0, NVIDIA GeForce RTX 5090, 570.124.04, 12.0, 32607, 5120" ;;
  *) echo "| NVIDIA-SMI 570.124.04   Driver Version: 570.124.04   CUDA Version: 12.8 |" ;;
esac
"""


@pytest.fixture()
def fake_node(tmp_path, monkeypatch):
    """An RTX 5090 node as the probes see it: nvidia-smi on PATH, a cu124 torch whose arch list
    lacks sm_120 (CUDA calls faked), and TensorRT 10.13.3.9 importable."""
    import importlib.machinery
    import os
    import sys
    import types

    import torch

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_NVIDIA_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(CU124_ARCHS))
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.13.3.9"
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    return tmp_path


def _doctor_args(**kw) -> argparse.Namespace:
    base = {"config": None, "model_dir": None, "plan_dir": None, "mode": None, "device": None, "ray_address": None,
            "max_mem_gb": None, "no_checksums": True, "json": False}
    base.update(kw)
    return argparse.Namespace(**base)


def test_probe_nvidia_smi_parses_driver_cuda_and_gpus(fake_node):
    driver, cuda, gpus = doctor.probe_nvidia_smi()
    assert (driver, cuda) == ("570.124.04", "12.8")
    (gpu,) = gpus
    assert gpu.name == "NVIDIA GeForce RTX 5090" and gpu.capability == (12, 0)
    assert gpu.total_bytes == 32607 * 1024**2 and gpu.free_bytes == 5120 * 1024**2


def test_probe_without_nvidia_smi_reports_no_driver(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    assert doctor.probe_nvidia_smi() == (None, None, [])


def test_probe_tensorrt_version_and_import_error(fake_node, monkeypatch):
    import sys

    env = Environment()
    doctor.probe_tensorrt(env)
    assert env.tensorrt_version == "10.13.3.9"
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import raises ImportError
    env = Environment()
    doctor.probe_tensorrt(env)
    assert env.tensorrt_version is None and "ModuleNotFoundError" in env.tensorrt_error


def test_faked_rtx5090_node_blocks_serving_with_every_fix(fake_node, tiny_model, capsys):
    """The whole doctor on the faked node, trt mode: torch lacks sm_120, the plan was built with
    another TensorRT, 5 GiB free for a 12 GB replica."""
    plans = fake_node / "plans"
    _plan(plans, "old.plan", _meta(tensorrt_version="10.12.0.36", precision="fp32"))
    args = _doctor_args(model_dir=str(tiny_model), mode="trt", plan_dir=str(plans), device="cuda", max_mem_gb=12.0)
    env = doctor.probe_environment(args)
    assert env.gpus[0].capability == (12, 0) and env.tensorrt_version == "10.13.3.9"
    assert env.trt_profile_needed == PROFILE  # from the tiny spec and the default synthesizer limits
    results = run_checks(env)
    status = {}
    for r in results:
        status.setdefault(r.name, []).append(r)
    arch = only(status["gpu_arch"])
    assert arch.status is Status.FAIL and "sm_120" in arch.message and "CUDA 12.8" in arch.fix
    assert only(status["driver"]).status is Status.OK  # 12.8 driver, 12.4 torch
    assert only(status["tensorrt"]).status is Status.OK
    stale = next(r for r in status["engine_cache"] if r.message.startswith("old.plan"))
    assert stale.status is Status.FAIL and "installed is 10.13.3.9" in stale.message
    assert f"fastcosy build-trt --model-dir {tiny_model} --out {plans} --max-batch 8" in stale.fix
    mem = only(status["gpu_memory"])
    assert mem.status is Status.FAIL and "5.0 GiB free" in mem.message and "max_mem_gb 12" in mem.message
    assert doctor.run(args, environment=env) == 1
    assert "serving is blocked" in capsys.readouterr().out


def test_probe_needed_profile_follows_the_synthesizer_config(tiny_model):
    from deployments.synthesizer_config import SynthesizerConfig

    cfg = SynthesizerConfig(token2wav={"max_batch_size": 3})
    need = doctor.needed_trt_profile(tiny_model, cfg)
    assert need["rows"] == [2, 4, 6] and need["frames"][2] == 3000  # opt: half the largest batch, rounded up
    assert doctor.needed_trt_profile(None, cfg) is None


def test_ray_probe_against_a_dashboard_like_http_server():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = {"/api/version": 200}

    class Dashboard(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(answers.get(self.path, 404))
            self.end_headers()
            self.wfile.write(b'{"ray_version": "2.60.0"}')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Dashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        env = Environment(ray_address=url, ray_probe=doctor.probe_ray)
        assert check_ray(env).status is Status.OK
        answers["/api/version"] = 401  # token auth on, no token here
        r = check_ray(env)
        assert r.status is Status.FAIL and "auth token" in r.message and "RAY_AUTH_TOKEN" in r.fix
        gcs = Environment(ray_address=f"127.0.0.1:{server.server_address[1]}", ray_probe=doctor.probe_ray)
        assert check_ray(gcs).status is Status.OK  # a TCP connect for GCS addresses
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------- voice store
def test_voice_store_check_fails_on_a_store_that_refuses_writes_and_names_it(tmp_path):
    from fastcosy_cli.doctor_checks import check_voice_store

    writable = tmp_path / "voices"
    writable.mkdir()
    env = Environment()
    doctor.probe_voice_store(env, str(writable), None)
    assert env.voices_dir == writable and env.voices_dir_problem is None
    assert check_voice_store(env).status is Status.OK and list(writable.iterdir()) == []  # probe removed
    doctor.probe_voice_store(env, str(tmp_path / "not-yet" / "voices"), None)  # the replica creates it
    assert env.voices_dir_problem is None
    # A store the OS refuses writes to, whoever runs the test (root ignores permission bits): its
    # name is taken by a file, so nothing can be created in it.
    blocked = tmp_path / "blocked"
    blocked.write_bytes(b"")
    doctor.probe_voice_store(env, str(blocked / "voices"), None)
    result = check_voice_store(env)
    assert result.status is Status.FAIL and str(blocked / "voices") in result.message
    assert "503" in result.message and "frontend.voices_dir" in result.fix


def test_pronunciation_store_check_names_a_store_that_refuses_writes(tmp_path, monkeypatch):
    from deployments import constants
    from fastcosy_cli.doctor_checks import check_pronunciation_store

    monkeypatch.setenv(constants.ENV_HOME, str(tmp_path / "home"))
    env = Environment()
    doctor.probe_pronunciation_store(env, None)  # the default, not made yet: judged by its parents
    assert env.pronunciation_dir == tmp_path / "home" / "pronunciation"
    assert check_pronunciation_store(env).status is Status.OK and not (tmp_path / "home").exists()
    blocked = tmp_path / "blocked"
    blocked.write_bytes(b"")
    doctor.probe_pronunciation_store(env, str(blocked / "pron"))
    result = check_pronunciation_store(env)
    assert result.status is Status.FAIL and str(blocked / "pron") in result.message
    assert "503" in result.message and "frontend.pronunciation.dir" in result.fix


def test_voice_store_of_a_config_is_its_frontend_voices_dir_or_the_family_default(tmp_path, monkeypatch):
    from deployments import constants

    monkeypatch.setenv(constants.ENV_HOME, str(tmp_path / "home"))
    cfg = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
    env = doctor.probe_environment(_doctor_args(config=str(cfg)))
    assert env.voices_dir == tmp_path / "home" / "voices" / "cosyvoice2" and env.voices_dir_problem is None
