"""TensorRT estimator without TensorRT: cache keys, plan selection, the context pool, row
splitting by attention pattern, and the start-up errors. The GPU test at the end needs a
TensorRT build (``-m trt``) and skips cleanly elsewhere."""
from __future__ import annotations

import dataclasses
import importlib.util
import threading
import time

import pytest
import torch

from cosyvoice_runtime.errors import InvalidInputError, ModelLoadError
from cosyvoice_runtime.trt import engine as trt_engine
from cosyvoice_runtime.trt.engine import (
    ContextPool,
    PlanInfo,
    TrtEstimator,
    load_trt_estimator,
    read_plans,
    select_plans,
)
from cosyvoice_runtime.trt.plan_key import EngineKey, write_sidecar
from cosyvoice_runtime.trt.profiles import EstimatorProfile

PROFILE = EstimatorProfile(rows=(2, 4, 8), frames=(2, 100, 400), n_mels=80, spk_dim=80)
KEY = EngineKey(compute_capability="9.0", tensorrt_version="10.13.3.9", profile_hash=PROFILE.digest(),
                precision="fp16", onnx_hash="ab" * 8, attention="full")


def test_cache_key_changes_with_gpu_trt_profile_precision_onnx():
    names = {KEY.plan_name()}
    for change in ({"compute_capability": "12.0"}, {"tensorrt_version": "10.14.1"},
                   {"profile_hash": dataclasses.replace(PROFILE, rows=(2, 4, 16)).digest()},
                   {"precision": "fp32"}, {"onnx_hash": "cd" * 8}, {"attention": "chunk"}):
        other = dataclasses.replace(KEY, **change)
        assert other.digest() != KEY.digest()
        names.add(other.plan_name())
    assert len(names) == 7
    assert dataclasses.replace(KEY).plan_name() == KEY.plan_name()  # deterministic
    # The sm / trt tokens fastcosy doctor reads from file names.
    assert "_sm90_" in KEY.plan_name() and "_trt10.13.3.9_" in KEY.plan_name()
    with pytest.raises(ValueError):
        dataclasses.replace(KEY, precision="int8")


def _plan(tmp_path, key: EngineKey, profile: EstimatorProfile = PROFILE, **meta):
    path = tmp_path / key.plan_name()
    path.write_bytes(b"plan")
    write_sidecar(path, key, profile.to_dict(), **meta)
    return path


def test_read_plans_keeps_usable_plans_and_says_why_it_skips_the_others(tmp_path):
    path = _plan(tmp_path, KEY, flow_sha256="f" * 64)
    (tmp_path / "broken.plan").write_bytes(b"")
    (tmp_path / "nosidecar.plan").write_bytes(b"x")
    plans, skipped = read_plans(tmp_path)
    assert [p.key for p in plans] == [KEY] and plans[0].profile == PROFILE
    assert plans[0].meta["flow_sha256"] == "f" * 64
    assert sorted(skipped) == ["broken.plan: empty (left by a failed build)",
                               "nosidecar.plan: no nosidecar.plan.json sidecar (replicas skip plans without one)"]
    assert plans[0].path == path


def test_plan_selection_rejects_other_gpu_trt_and_small_profiles(tmp_path):
    _plan(tmp_path, KEY)
    _plan(tmp_path, dataclasses.replace(KEY, compute_capability="8.9"))
    _plan(tmp_path, dataclasses.replace(KEY, tensorrt_version="10.13.2.6"))
    small = dataclasses.replace(PROFILE, frames=(2, 100, 200))
    _plan(tmp_path, dataclasses.replace(KEY, attention="chunk", profile_hash=small.digest()), small)
    plans, _ = read_plans(tmp_path)
    chosen, rejected = select_plans(plans, compute_capability="9.0", tensorrt_version="10.13.3.9", profile=PROFILE)
    assert set(chosen) == {"full"} and chosen["full"].key == KEY
    text = "\n".join(rejected)
    assert "built for sm8.9, this GPU is sm9.0" in text
    assert "built with TensorRT 10.13.2.6, installed is 10.13.3.9" in text
    assert "does not cover" in text
    # Another GPU: nothing loads.
    chosen, rejected = select_plans(plans, compute_capability="12.0", tensorrt_version="10.13.3.9", profile=PROFILE)
    assert not chosen and len(rejected) == 4
    # A plan exported from another checkpoint is refused.
    other = [dataclasses.replace(p, meta={**p.meta, "flow_sha256": "1" * 64}) for p in plans]
    chosen, rejected = select_plans(other, compute_capability="9.0", tensorrt_version="10.13.3.9",
                                    flow_sha256="2" * 64)
    assert not chosen and all("another flow.pt" in r for r in rejected if "sm8.9" not in r and "10.13.2" not in r)


def test_plan_selection_prefers_exact_profile_then_fp16(tmp_path):
    big = dataclasses.replace(PROFILE, rows=(2, 8, 32), frames=(2, 100, 800))
    plans = [PlanInfo(tmp_path / n, k, prof, {}) for n, k, prof in (
        ("a", dataclasses.replace(KEY, precision="fp32"), PROFILE),
        ("b", dataclasses.replace(KEY, profile_hash=big.digest()), big),
        ("c", KEY, PROFILE))]
    chosen, _ = select_plans(plans, compute_capability="9.0", tensorrt_version="10.13.3.9", profile=PROFILE)
    assert chosen["full"].path.name == "c"
    chosen, _ = select_plans(plans[:2], compute_capability="9.0", tensorrt_version="10.13.3.9", profile=PROFILE)
    assert chosen["full"].path.name == "a"  # exact profile beats fp16 with a larger one
    chosen, _ = select_plans(plans, compute_capability="9.0", tensorrt_version="10.13.3.9", profile=PROFILE,
                             precision="fp32")
    assert chosen["full"].path.name == "a"


def test_context_pool_blocks_until_a_context_is_free():
    pool = ContextPool(["ctx0"])
    order = []

    def worker(name):
        with pool.checkout() as ctx:
            order.append((name, ctx, "in"))
            time.sleep(0.05)
            order.append((name, ctx, "out"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # One context: calls never overlap (every "in" is followed by its own "out").
    assert [step for _, _, step in order] == ["in", "out"] * 3
    assert pool.available() == 1
    with pytest.raises(ValueError):
        ContextPool([])


class _FakeRunner:
    """Engine stand-in: x * scale, recording the shapes it was called with."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, inputs):
        assert set(inputs) == {"x", "mask", "mu", "t", "spks", "cond"}
        self.calls.append(tuple(inputs["x"].shape))
        return inputs["x"] * self.scale


def _args(rows: int, frames: int):
    x = torch.arange(rows, dtype=torch.float32)[:, None, None].expand(rows, 80, frames).contiguous()
    return x, torch.ones(rows, 1, frames), torch.zeros(rows, 80, frames), torch.zeros(rows), \
        torch.zeros(rows, 80), torch.zeros(rows, 80, frames)


def test_estimator_routes_rows_by_attention_and_splits_large_batches():
    full, chunk = _FakeRunner(2.0), _FakeRunner(3.0)
    est = TrtEstimator({"full": full, "chunk": chunk}, PROFILE)
    args = _args(4, 10)
    assert torch.equal(est(*args, streaming=False), args[0] * 2)
    assert torch.equal(est(*args, streaming=True), args[0] * 3)
    flags = torch.tensor([True, False, False, True])
    out = est(*args, streaming=flags)
    assert torch.equal(out[:, 0, 0], torch.tensor([0.0 * 3, 1 * 2, 2 * 2, 3 * 3]))
    assert full.calls[-1] == (2, 80, 10) and chunk.calls[-1] == (2, 80, 10)
    # 20 rows, profile max 8: pieces of 8, 8, 4, same result as one call.
    big = _args(20, 10)
    assert torch.equal(est(*big, streaming=False), big[0] * 2)
    assert full.calls[-3:] == [(8, 80, 10), (8, 80, 10), (4, 80, 10)]
    with pytest.raises(InvalidInputError, match="outside the TensorRT profile"):
        est(*_args(2, 401))


def test_estimator_without_chunk_engine_falls_back_to_full():
    full = _FakeRunner(2.0)
    est = TrtEstimator({"full": full}, PROFILE)
    args = _args(2, 10)
    assert torch.equal(est(*args, streaming=True), args[0] * 2) and est.fallback_warned


def test_swapped_into_the_cfm_solver():
    from cosyvoice_runtime.flow.cfm import CFMSolver
    from tests.runtime.test_flow_batch import _flow

    flow = _flow("cosyvoice2")
    torch_est = flow.decoder.estimator
    solver = CFMSolver(flow.spec, TrtEstimator({"full": lambda a: torch_est(*a.values(), False)}, PROFILE))
    mu, mask = torch.randn(1, 80, 30), torch.ones(1, 1, 30)
    spks, cond = torch.randn(1, 80), torch.randn(1, 80, 30)
    with torch.inference_mode():
        assert torch.allclose(solver(mu, mask, spks, cond), flow.decoder(mu, mask, spks, cond), atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed")
def test_load_without_tensorrt_is_a_clear_start_up_error(tmp_path):
    with pytest.raises(ModelLoadError, match=r"not installed.*\[trt\] extra"):
        load_trt_estimator(tmp_path, PROFILE)


def test_load_with_no_matching_plan_names_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setattr(trt_engine, "tensorrt_version", lambda purpose="": "10.13.3.9")
    monkeypatch.setattr(trt_engine, "gpu_compute_capability", lambda device=None, purpose="": "12.0")
    _plan(tmp_path, KEY)
    with pytest.raises(ModelLoadError) as err:
        load_trt_estimator(tmp_path, PROFILE, device="cuda")
    msg = str(err.value)
    assert "no TensorRT plan for sm12.0" in msg and "built for sm9.0" in msg and "fastcosy build-trt" in msg
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_trt_estimator(tmp_path / "missing", PROFILE, device="cuda")
    with pytest.raises(ModelLoadError, match="CUDA device"):
        load_trt_estimator(tmp_path, PROFILE, device="cpu")
