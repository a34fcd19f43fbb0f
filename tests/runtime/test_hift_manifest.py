"""Full-size vocoders: every key and shape of the released ``hift.pt`` manifests, and the CV3
noise buffers regenerated bit-exactly at full size (``manifests/summary.json`` hashes and the
stored heads in ``manifests/cosyvoice3_hift_noise_head.safetensors``).

The full-size spec is the tiny fixture's spec with the released widths (base 512, f0 512) and
the released flow sizes (CV3 flow: vocab 6561, input 80, spk 192, output 80).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest
import torch

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.hift.generator import build_hift
from cosyvoice_runtime.hift.noise import NoiseRecipe, replay_noise_buffers
from cosyvoice_runtime.weights import official_to_ours
from cosyvoice_runtime.yaml_config import read_model_spec
from tests.runtime.parity.common import parity_dir

MANIFESTS = parity_dir() / "manifests"
FULL_BASE_CHANNELS = 512
pytestmark = pytest.mark.skipif(not MANIFESTS.is_dir(), reason="no full-size manifests in this fixture set")


def _full_spec(family: str) -> ModelSpec:
    spec = read_model_spec(parity_dir() / family / "model")
    hift = dataclasses.replace(spec.hift, base_channels=FULL_BASE_CHANNELS, f0_cond_channels=FULL_BASE_CHANNELS)
    return spec.replace(hift=hift)


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_full_size_keys_and_shapes_match_manifest(family):
    manifest = json.loads((MANIFESTS / f"{family}_hift.json").read_text())
    spec = _full_spec(family)
    with torch.device("meta"):
        hift = build_hift(spec.hift, spec.flow)
    ours = {k: tuple(v.shape) for k, v in hift.state_dict().items()}
    # The documented loader rewrite: a "generator." prefix is stripped (absent in these manifests).
    raw = {e["key"]: tuple(e["shape"]) for e in manifest["keys"]}
    renamed = official_to_ours({k: torch.empty(0) for k in raw}, strip_prefix="generator.")
    theirs = dict(zip(renamed, raw.values()))
    assert len(theirs) == manifest["n_keys"] == 328
    assert sorted(set(theirs) - set(ours)) == [] and sorted(set(ours) - set(theirs)) == []
    bad = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    assert not bad, bad
    assert sum(int(np.prod(s)) for s in ours.values()) == manifest["n_elements_total"]
    # Weight norm folds to plain weights of the same shapes.
    hift.remove_weight_norm()
    folded = hift.state_dict()
    assert not any("parametrizations" in k for k in folded)
    assert tuple(folded["conv_pre.weight"].shape) == theirs["conv_pre.parametrizations.weight.original1"]


def _sha256(x: torch.Tensor) -> str:
    return hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()


def test_full_size_cv3_noise_buffers_are_bit_exact():
    summary = json.loads((MANIFESTS / "summary.json").read_text())
    ref = summary["cosyvoice3"]["runtime_constants_not_in_state_dict"]["causal_hift_noise_buffers"]
    spec = _full_spec("cosyvoice3")
    buffers = replay_noise_buffers(NoiseRecipe.from_specs(spec.hift, spec.flow), with_uv=True)
    try:
        assert buffers.rand_ini.flatten().tolist() == ref["rand_ini"]
        assert list(buffers.sine_waves.shape) == ref["sine_waves"]["shape"]
        assert list(buffers.uv.shape) == ref["uv"]["shape"]
        from safetensors.numpy import load_file

        heads = load_file(str(MANIFESTS / ref["head_file"]))
        n = heads["sine_waves_head"].shape[1]
        np.testing.assert_array_equal(buffers.sine_waves[:, :n].numpy(), heads["sine_waves_head"])
        np.testing.assert_array_equal(buffers.uv[:, : heads["uv_head"].shape[1]].numpy(), heads["uv_head"])
        np.testing.assert_array_equal(buffers.rand_ini.numpy(), heads["rand_ini"])
        assert _sha256(buffers.sine_waves) == ref["sine_waves"]["sha256_float32"]
        assert _sha256(buffers.uv) == ref["uv"]["sha256_float32"]
    finally:
        del buffers
