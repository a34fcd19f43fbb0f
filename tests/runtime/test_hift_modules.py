"""Unit behaviour of the vocoder modules: weight-norm folding, f0 precision, noise-buffer cache,
look-ahead/lag arithmetic and the CV2 source's RNG contract."""
from __future__ import annotations

import pytest
import torch

from cosyvoice_runtime.hift.generator import build_hift
from cosyvoice_runtime.hift.layers import causal_padding
from cosyvoice_runtime.hift.noise import official_noise_buffers
from cosyvoice_runtime.weights import load_checkpoint
from cosyvoice_runtime.yaml_config import read_model_spec
from tests.runtime.parity.common import assert_matches, load_cases
from tests.runtime.parity.hift_cases import load_hift

CASES = {c.family: c for c in load_cases() if c.name == "hift_inference"}


def _unfolded(family):
    case = CASES[family]
    spec = read_model_spec(case.model_dir)
    hift = build_hift(spec.hift, spec.flow)
    load_checkpoint(hift, case.model_dir / spec.files["hift"], strip_prefix="generator.")
    return case, hift.eval()


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_weight_norm_folding_keeps_the_output(family):
    case, hift = _unfolded(family)
    mel, source = case.t("mel"), case.t("s" if family == "cosyvoice2" else "s_final")
    with torch.inference_mode():
        before = hift.decode(mel, source)
    n_params = len(hift.state_dict())
    hift.remove_weight_norm()
    assert len(hift.state_dict()) < n_params
    assert not any("parametrizations" in k for k in hift.state_dict())
    with torch.inference_mode():
        after = hift.decode(mel, source)
    assert float((before - after).abs().max()) < 1e-5
    hift.remove_weight_norm()  # idempotent


def test_causal_padding_matches_the_official_rule():
    assert [causal_padding(k) for k in (1, 3, 4, 5, 7)] == [0, 2, 3, 4, 6]
    assert causal_padding(11, 5) == 50


def test_cv3_lag_and_output_lengths():
    _spec, hift = load_hift(CASES["cosyvoice3"].model_dir)
    assert (hift.f0_look_right, hift.conv_pre_look_right, hift.lag_frames) == (3, 4, 8)
    mel = CASES["cosyvoice3"].t("mel")
    t = mel.shape[2]
    speech, source = hift.inference(mel, finalize=False)
    assert speech.shape == (1, 480 * (t - 8)) and source.shape == (1, 1, 480 * (t - 3))


def test_cv3_f0_is_computed_in_float64_whatever_the_module_dtype():
    import copy

    case = CASES["cosyvoice3"]
    _, hift = load_hift(case.model_dir)
    mel, ref = case.t("mel"), case.t("f0_final")
    with torch.inference_mode():
        f64 = hift.f0(mel)
        assert f64.dtype == torch.float32
        f32_model = copy.deepcopy(hift.f0_predictor)
        f32_model.compute_dtype = torch.float32
        f32 = f32_model(mel)
        half_params = copy.deepcopy(hift.f0_predictor).to(torch.float64)  # params' dtype is irrelevant
        assert torch.equal(half_params(mel), f64)
    # the float64 pass matches the reference (computed in float64) more closely than float32 does
    e64, e32 = float((f64 - ref).abs().max()), float((f32 - ref).abs().max())
    assert e64 <= e32 and e32 > 0


def test_noise_buffers_are_shared_per_process_and_lazy():
    spec = read_model_spec(CASES["cosyvoice3"].model_dir)
    a = official_noise_buffers(spec.hift, spec.flow)
    assert official_noise_buffers(spec.hift, spec.flow) is a
    lazy = build_hift(spec.hift, spec.flow)
    assert not lazy.m_source.has_noise_buffers  # nothing generated at construction
    lazy.source(torch.full((1, 4), 100.0))
    assert lazy.m_source.sine_waves.data_ptr() == a.sine_waves.data_ptr()  # shared, not copied
    none = build_hift(spec.hift, spec.flow, noise="none")
    with pytest.raises(RuntimeError, match="load_noise_buffers"):
        none.source(torch.full((1, 4), 100.0))


def test_cv2_source_requires_and_uses_the_given_generator():
    _, hift = load_hift(CASES["cosyvoice2"].model_dir)
    f0 = CASES["cosyvoice2"].t("f0")
    with pytest.raises(ValueError):
        hift.source(f0)
    a = hift.source(f0, generator=torch.Generator().manual_seed(3))
    b = hift.source(f0, generator=torch.Generator().manual_seed(3))
    c = hift.source(f0, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    z = hift.source(f0, zero_noise=True)
    # the fixture's tolerance, not bit equality: sin/cos differ by an ulp between the CPU's AVX2
    # and AVX-512 kernels (3e-8 on an AVX-512 VM, 2026-12-06; equal on the AVX2 machines before)
    assert_matches(CASES["cosyvoice2"], "s_zero_noise", z)


def test_cv3_rejects_utterances_longer_than_the_noise_buffer():
    from cosyvoice_runtime.errors import InvalidInputError

    _, hift = load_hift(CASES["cosyvoice3"].model_dir)
    limit = hift.m_source.max_samples // hift.samples_per_frame
    with pytest.raises(InvalidInputError):
        hift.m_source.buffer_noise(0, (limit + 1) * hift.samples_per_frame)
