"""The fixed CFM noise equals the official seed-0 buffer, and using it leaves global RNGs alone."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from cosyvoice_runtime.flow.cfm import fixed_noise, time_grid
from tests.runtime.parity.common import parity_dir

SUMMARY = parity_dir() / "manifests" / "summary.json"


def test_fixed_noise_head_matches_official_buffer():
    """First 512 frames of the CFM noise equal the stored head of the official buffer."""
    heads = load_file(str(parity_dir() / "cfm_rand_noise_head.safetensors"))
    (name, head), = heads.items()
    ours = fixed_noise(80, 15000)[..., : head.shape[-1]]
    assert torch.equal(ours.reshape(head.shape), head), name


@pytest.mark.skipif(not SUMMARY.is_file(), reason="no manifests/summary.json in this fixture set")
def test_fixed_noise_full_buffer_hash():
    """All 80 x 15000 values, bit for bit (SHA-256 of the float32 bytes in summary.json)."""
    ref = json.loads(SUMMARY.read_text())["cosyvoice2"]["runtime_constants_not_in_state_dict"]["cfm_rand_noise"]
    noise = fixed_noise(*ref["shape"][1:])
    assert list(noise.shape) == ref["shape"] and noise.dtype == torch.float32
    assert hashlib.sha256(noise.contiguous().numpy().tobytes()).hexdigest() == ref["sha256_float32"]


def test_fixed_noise_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    fixed_noise.cache_clear()
    fixed_noise(80, 64)
    assert torch.equal(torch.rand(3), expected)


def test_cosine_time_grid():
    """t_k = 1 - cos(pi/2 * k/10): the values listed in spec §4.5."""
    t = time_grid(10, "cosine", torch.float32, torch.device("cpu"))
    listed = [0, 0.0123, 0.0489, 0.1090, 0.1910, 0.2929, 0.4122, 0.5460, 0.6910, 0.8436, 1.0]
    assert t.shape == (11,) and t[0] == 0 and abs(float(t[-1]) - 1) < 1e-7
    assert torch.allclose(t, torch.tensor(listed), atol=6e-5)
