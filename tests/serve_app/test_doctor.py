"""fastcosy doctor: every check against faked environments (no GPU, Ray or TensorRT needed)."""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from serve_app import cli_doctor
from serve_app.doctor import (
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
    base = dict(torch_version="2.7.1+cu128", torch_cuda_version="12.8", torch_arch_list=CU128_ARCHS,
                cuda_available=True, gpus=(RTX5090,), driver_version="570.124.04", driver_cuda_version="12.8",
                needs_gpu=True, device="cuda")
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


def _plan(d: Path, name: str, meta: dict | None = None, size: int = 16) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_bytes(b"\0" * size)
    if meta is not None:
        (d / (name + ".json")).write_text(json.dumps(meta))
    return p


def test_engine_cache_matches_gpu_and_trt_version(tmp_path):
    _plan(tmp_path, "estimator.fp16.plan", {"compute_capability": "12.0", "tensorrt_version": "10.13.3"})
    env = gpu_env(mode="trt", tensorrt_version="10.13.3.9", engine_cache_dir=tmp_path)
    assert only(check_engine_cache(env)).status is Status.OK


def test_engine_cache_built_for_another_gpu_fails(tmp_path):
    _plan(tmp_path, "estimator_sm90_trt10.13.plan")
    env = gpu_env(mode="trt", tensorrt_version="10.13.3.9", engine_cache_dir=tmp_path)
    r = only(check_engine_cache(env))
    assert r.status is Status.FAIL and "sm_90" in r.message and "sm_120" in r.message
    assert "build-trt" in r.fix


def test_engine_cache_other_trt_version_empty_plan_and_missing_dir(tmp_path):
    _plan(tmp_path, "a.plan", {"compute_capability": "12.0", "tensorrt_version": "10.9.0"})
    _plan(tmp_path, "b.plan", size=0)
    env = gpu_env(mode="trt", tensorrt_version="10.13.3.9", engine_cache_dir=tmp_path)
    by_name = {r.message.split(":")[0].split(" ")[0]: r for r in check_engine_cache(env)}
    assert by_name["a.plan"].status is Status.FAIL and "TensorRT 10.9.0" in by_name["a.plan"].message
    assert by_name["b.plan"].status is Status.FAIL and "empty" in by_name["b.plan"].message
    env.engine_cache_dir = tmp_path / "nope"
    assert only(check_engine_cache(env)).status is Status.FAIL


def test_engine_cache_without_metadata_warns_and_pytorch_mode_skips(tmp_path):
    _plan(tmp_path, "estimator.plan")
    env = gpu_env(mode="trt", tensorrt_version="10.13.3.9", engine_cache_dir=tmp_path)
    assert only(check_engine_cache(env)).status is Status.WARN
    assert only(check_engine_cache(gpu_env(mode="pytorch"))).status is Status.OK


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
    assert "Error" in cli_doctor.probe_ray(f"127.0.0.1:{port}")


def test_free_gpu_memory_against_max_mem_gb():
    busy = GpuInfo(0, "NVIDIA GeForce RTX 5090", (12, 0), 32 * GIB, 5 * GIB)
    r = check_gpu_memory(gpu_env(gpus=(busy,), max_mem_gb=12))
    assert r.status is Status.FAIL and "5.0 GiB free" in r.message and "12.0 GiB" in r.message
    assert check_gpu_memory(gpu_env(max_mem_gb=12)).status is Status.OK
    assert check_gpu_memory(gpu_env(gpus=(GpuInfo(0, "x", (12, 0), 32 * GIB, 13 * GIB),), max_mem_gb=12)
                            ).status is Status.WARN
    assert check_gpu_memory(gpu_env(estimated_need_bytes=40 * GIB)).status is Status.FAIL
    assert check_gpu_memory(gpu_env(device="cuda:3", max_mem_gb=1)).status is Status.FAIL  # GPU not visible


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
    assert cli_doctor.run(args, environment=env) == 1
    text = capsys.readouterr().out
    assert "[FAIL] gpu_arch" in text and "serving is blocked" in text
    args.json = True
    cli_doctor.run(args, environment=gpu_env())
    data = json.loads(capsys.readouterr().out)
    assert {d["status"] for d in data} <= {"ok", "warn", "fail"}


def test_probe_of_this_machine_with_a_config_does_not_crash(tmp_path):
    cfg = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
    ns = argparse.Namespace(config=str(cfg), model_dir=None, plan_dir=None, mode=None, device=None,
                            ray_address=None, max_mem_gb=None, no_checksums=True, json=False)
    env = cli_doctor.probe_environment(ns)
    assert env.config_error is None and env.torch_version and env.mode == "pytorch"
    assert env.wetext_version is not None
