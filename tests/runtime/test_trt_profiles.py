"""Estimator profile shapes from the streaming schedule, and the memory budget (pure functions)."""
from __future__ import annotations

import functools
import math

import pytest

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.trt.profiles import (
    GIB,
    EstimatorProfile,
    ReplicaLimits,
    derive_profile,
    first_chunk_tokens,
    fit_to_memory,
    replica_bytes,
    stream_call_frames,
)
from cosyvoice_runtime.yaml_config import read_model_spec
from tests.runtime.parity.common import parity_dir


@functools.lru_cache(maxsize=2)
def _spec(family: str) -> ModelSpec:
    return read_model_spec(parity_dir() / family / "model")


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_profile_from_schedule(family):
    spec = _spec(family)
    hop, ratio, rate = spec.stream.token_hop_len, spec.flow.token_mel_ratio, spec.token_frame_rate
    p = derive_profile(spec, ReplicaLimits(max_flow_batch=6, max_prompt_s=10.0, max_total_s=40.0))
    assert p.rows == (2, 6, 12)  # CFG pairs: 1 job, half the batch, the whole batch
    max_prompt = 10 * rate
    assert p.frames == (ratio, ratio * (math.ceil(max_prompt / hop) * hop + hop), ratio * 40 * rate)
    shapes = p.shapes()
    assert shapes["x"] == ((2, p.n_mels, ratio), (6, p.n_mels, p.frames[1]), (12, p.n_mels, p.frames[2]))
    assert shapes["mask"][2] == (12, 1, p.frames[2]) and shapes["t"] == ((2,), (6,), (12,))
    assert shapes["spks"][0] == (2, p.spk_dim)
    assert EstimatorProfile.from_dict(p.to_dict()) == p


def test_official_defaults_give_the_official_max_length():
    p = derive_profile(_spec("cosyvoice2"))
    assert p.frames[2] == 3000  # 60 s, the official profile's max (spec §7.3)
    assert p.rows[2] == 2 * ReplicaLimits().max_flow_batch


def test_first_chunk_and_call_frames_follow_the_hop_schedule():
    spec = _spec("cosyvoice2")
    hop, la = spec.stream.token_hop_len, spec.flow.pre_lookahead_len
    assert first_chunk_tokens(spec, 75) == hop + 0 + la  # 75 is a multiple of 25: no pad
    assert first_chunk_tokens(spec, 80) == hop + 20 + la  # spec §6.1 example: first hop 45
    # prompt 80, 300 generated tokens: hops 45, 50, 100, 100 (capped; 295 + 3 look-ahead <= 300),
    # then the final call over everything.
    frames = stream_call_frames(spec, 80, 300)
    assert frames == [2 * (80 + 45), 2 * (80 + 95), 2 * (80 + 195), 2 * (80 + 295), 2 * (80 + 300)]
    assert max(frames) <= derive_profile(spec).frames[2]


def test_profile_digest_changes_with_the_profile():
    spec = _spec("cosyvoice2")
    a = derive_profile(spec, ReplicaLimits(max_flow_batch=4))
    assert a.digest() == derive_profile(spec, ReplicaLimits(max_flow_batch=4)).digest()
    assert a.digest() != derive_profile(spec, ReplicaLimits(max_flow_batch=5)).digest()
    assert a.digest() != derive_profile(spec, ReplicaLimits(max_flow_batch=4, max_total_s=45.0)).digest()


def test_bad_limits_are_refused():
    with pytest.raises(ValueError):
        ReplicaLimits(max_flow_batch=0)
    with pytest.raises(ValueError):
        ReplicaLimits(max_prompt_s=60.0, max_total_s=30.0)


def test_memory_budget_lowers_batch_then_length():
    spec = _spec("cosyvoice2")
    # Fixed costs near zero so the (tiny) estimator's activations decide.
    kw = {"weights_bytes": 1 << 20, "max_running": 1, "max_model_len": 16, "dtype_bytes": 2, "reserve_gb": 0.0}
    full = ReplicaLimits(max_flow_batch=8)
    need = replica_bytes(spec, full, **kw)
    assert fit_to_memory(spec, need / GIB + 0.1, full, **kw) == full  # fits: unchanged
    fitted = fit_to_memory(spec, need / GIB * 0.7, full, **kw)
    assert 1 <= fitted.max_flow_batch < 8 and fitted.max_total_s == full.max_total_s
    assert replica_bytes(spec, fitted, **kw) <= need * 0.7
    one = replica_bytes(spec, ReplicaLimits(max_flow_batch=1), **kw)
    shorter = fit_to_memory(spec, one / GIB * 0.99, full, **kw)
    assert shorter.max_flow_batch == 1 and shorter.max_total_s < full.max_total_s
    # Larger budgets never give smaller limits.
    budgets = [one / GIB * f for f in (0.99, 1.0, 1.5, 2.0, 4.0)]
    batches = [fit_to_memory(spec, b, full, **kw).max_flow_batch for b in budgets]
    assert batches == sorted(batches)
    with pytest.raises(ValueError, match="too small"):
        fit_to_memory(spec, 1.0, full, weights_bytes=2 * GIB, max_running=16, max_model_len=2048, dtype_bytes=2)
