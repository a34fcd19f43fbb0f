"""Parity of the HiFT vocoders with the official implementation (case ``hift_inference``).

CV2 (random source): f0; the noise-free source ``s_zero_noise`` and its waveform; the waveform
for the recorded source via ``decode``; and, with a request generator seeded like the fixture's
global RNG, the very same random draws (hashes in ``params.random_draws``), source and waveform
via ``inference``.
CV3 (deterministic): the regenerated noise buffers (values / hashes in ``params.noise_buffers``
and the stored heads), f0 / source / waveform for ``finalize`` True and False, and ``decode`` on
the recorded source.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import torch

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.hift.generator import build_hift
from cosyvoice_runtime.hift.noise import NoiseRecipe, replay_noise_buffers
from cosyvoice_runtime.weights import load_checkpoint
from cosyvoice_runtime.yaml_config import read_model_spec
from tests.runtime.parity.common import ParityCase, assert_matches, checker, parity_dir

HIFT_PREFIX = "generator."


@functools.lru_cache(maxsize=4)
def load_hift(model_dir: Path):
    """(spec, vocoder) of a model directory, weights loaded strictly and weight norm folded."""
    spec = read_model_spec(model_dir)
    hift = build_hift(spec.hift, spec.flow)
    load_checkpoint(hift, model_dir / spec.files["hift"], strip_prefix=HIFT_PREFIX)
    hift.remove_weight_norm()
    return spec, hift.eval()


def _sha256(x: torch.Tensor) -> str:
    return hashlib.sha256(x.detach().cpu().float().contiguous().numpy().tobytes()).hexdigest()


def _with_parsed_tolerance(case: ParityCase, key: str, alias: str) -> ParityCase:
    """A view of ``case`` whose tolerance ``alias`` is the prose entry ``key`` ("atol 1e-4, ...")."""
    text = case.meta["tolerance"][key]
    if isinstance(text, dict):
        tol = text
    else:
        tol = {name: float(value) for name, value in re.findall(r"\b(atol|rtol)\s+([0-9.eE+-]+)", text)}
        assert tol, f"{case.id}: cannot read a tolerance from '{text}'"
    view = dataclasses.replace(case, meta={**case.meta, "tolerance": {**case.meta["tolerance"], alias: tol}})
    view.__dict__["tensors"] = case.tensors  # share the loaded tensors
    return view


def _seeded_tolerance_key(case: ParityCase) -> str:
    return next(k for k in case.meta["tolerance"] if "seed" in k)


def _given_source_key(case: ParityCase) -> str:
    return next(k for k in case.meta["tolerance"] if "given s" in k)


def _check_cv2(case: ParityCase) -> None:
    _, hift = load_hift(case.model_dir)
    mel = case.t("mel")
    with torch.inference_mode():
        f0 = hift.f0(mel)
        assert_matches(case, "f0", f0)
        s_zero = hift.source(f0, zero_noise=True)
        assert_matches(case, "s_zero_noise", s_zero)
        assert_matches(case, "speech_zero_noise", hift.decode(mel, s_zero))
        assert_matches(case, "speech", hift.decode(mel, case.t("s")), tol_key=_given_source_key(case))

        # The draws a request generator seeded with params.seed makes, in the official order.
        seed = int(case.params["seed"])
        draws = case.params.get("random_draws", [])
        g = torch.Generator().manual_seed(seed)
        got = [torch.rand(draws[0]["shape"], generator=g)] if draws else []
        for d in draws[1:]:
            shape = d["shape"]
            got.append(torch.empty(shape[0], shape[2], shape[1]).transpose(1, 2).normal_(generator=g))
        for d, x in zip(draws, got):
            assert _sha256(x) == d["sha256_float32"], f"{case.id}: random draw {d['fn']}{d['shape']} differs"
        if "rand_ini" in case.tensors and got:
            np.testing.assert_array_equal(got[0].numpy(), case.tensors["rand_ini"])

        seeded = _with_parsed_tolerance(case, _seeded_tolerance_key(case), "seeded")
        speech, s = hift.inference(mel, generator=torch.Generator().manual_seed(seed))
        assert_matches(seeded, "s", s, tol_key="seeded")
        assert_matches(seeded, "speech", speech, tol_key="seeded")


def _check_cv3_buffers(case: ParityCase, spec: ModelSpec, hift) -> None:
    nb = case.params["noise_buffers"]
    src = hift.m_source
    np.testing.assert_array_equal(src.rand_ini.cpu().numpy(), np.asarray(nb["rand_ini"], dtype=np.float32))
    index = json.loads((parity_dir() / "index.json").read_text())
    recorded = index["models"].get(case.family, {}).get("checks", {}).get("causal_hift_buffers", {})
    if "rand_ini_values" in recorded:
        assert src.rand_ini.flatten().tolist() == recorded["rand_ini_values"]
    n = int(nb["prefix_len"])
    assert _sha256(src.sine_waves[:, :n]) == nb["sine_waves_prefix_sha256"], f"{case.id}: sine_waves prefix differs"
    head = case.tensors["sine_waves_head"]
    np.testing.assert_array_equal(src.sine_waves[:, : head.shape[1]].cpu().numpy(), head)
    # uv is unused at inference; regenerate the whole stream once to check it as well.
    full = replay_noise_buffers(NoiseRecipe.from_specs(spec.hift, spec.flow), with_uv=True)
    assert _sha256(full.uv[:, :n]) == nb["uv_prefix_sha256"], f"{case.id}: uv prefix differs"
    uv_head = case.tensors["uv_noise_head"]
    np.testing.assert_array_equal(full.uv[:, : uv_head.shape[1]].numpy(), uv_head)


def _check_cv3(case: ParityCase) -> None:
    spec, hift = load_hift(case.model_dir)
    mel = case.t("mel")
    assert hift.conv_pre_look_right == case.params["conv_pre_look_right"]
    assert hift.f0_look_right == case.params["f0_right_context"]
    with torch.inference_mode():
        for finalize, tag in ((True, "final"), (False, "chunk")):
            assert_matches(case, f"f0_{tag}", hift.f0(mel, finalize=finalize))
            speech, s = hift.inference(mel, finalize=finalize)
            assert_matches(case, f"s_{tag}", s)
            assert_matches(case, f"speech_{tag}", speech)
            x = mel if finalize else mel[:, :, : -hift.f0_look_right]
            assert_matches(case, f"speech_{tag}", hift.decode(x, case.t(f"s_{tag}"), finalize=finalize))
        _check_cv3_buffers(case, spec, hift)


@checker("hift_inference")
def check_hift_inference(case: ParityCase) -> None:
    spec, _ = load_hift(case.model_dir)
    if spec.hift.causal:
        _check_cv3(case)
    else:
        _check_cv2(case)
