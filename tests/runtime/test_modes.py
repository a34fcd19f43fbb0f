"""Execution modes: which mode a replica runs (config wins, then $FAST_COSY_MODE, then pytorch),
what each mode does to a loaded model, and that trt without TensorRT fails at replica start."""
from __future__ import annotations

import copy
import functools
import importlib.util

import pytest
import torch

from cosyvoice_runtime.errors import ModelLoadError
from cosyvoice_runtime.modes import MODES, apply_mode, preflight, resolve_mode, validate_mode
from tests.runtime.parity.common import parity_dir

HAS_TRT = importlib.util.find_spec("tensorrt") is not None


@pytest.mark.parametrize("config_mode, env_mode, expected", [
    (None, None, ("pytorch", "default")),
    (None, "", ("pytorch", "default")),
    (None, "trt", ("trt", "env")),
    (None, " TorchScript ", ("torchscript", "env")),
    ("pytorch", "trt", ("pytorch", "config")),  # the config wins when both are set
    ("trt", "pytorch", ("trt", "config")),
    ("torchscript", None, ("torchscript", "config")),
])
def test_resolution_table(config_mode, env_mode, expected):
    assert resolve_mode(config_mode, env_mode) == expected


def test_unknown_modes_are_refused_with_the_valid_names():
    assert MODES == ("pytorch", "torchscript", "trt")
    with pytest.raises(ValueError, match="pytorch, torchscript, trt"):
        resolve_mode(None, "tensorrt")
    with pytest.raises(ValueError, match="config mode"):
        resolve_mode("jit", None)
    assert validate_mode("TRT") == "trt"


@functools.lru_cache(maxsize=1)
def _model():
    from cosyvoice_runtime.model import load_model

    return load_model(parity_dir() / "cosyvoice2" / "model")


def test_pytorch_mode_casts_llm_and_flow_not_the_vocoder():
    model = copy.deepcopy(_model())
    report = apply_mode(model, "pytorch", torch.bfloat16)
    assert report == {"mode": "pytorch", "dtype": "bfloat16", "compiled": [], "estimator": "CausalUNet"}
    assert {p.dtype for p in model.llm.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.flow.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.hift.parameters()} == {torch.float32}


def test_torchscript_mode_wraps_estimator_and_vocoder_body():
    model = copy.deepcopy(_model())
    est = model.flow.decoder.estimator
    report = apply_mode(model, "torchscript", compile_backend="eager")
    assert report["compiled"] == ["flow.decoder.estimator", "flow.encoder", "hift.body"]
    assert type(model.flow.decoder.estimator).__name__ == "OptimizedModule"
    assert model.flow.decoder.estimator._orig_mod is est
    assert "body" in vars(model.hift)  # the instance attribute shadows the method


@pytest.mark.slow  # dynamo tracing of the U-Net takes ~7 s even with the eager backend
def test_torchscript_mode_gives_the_same_output():
    model = copy.deepcopy(_model())
    est = model.flow.decoder.estimator
    args = (torch.randn(2, 80, 40), torch.ones(2, 1, 40), torch.randn(2, 80, 40), torch.rand(2),
            torch.randn(2, 80), torch.randn(2, 80, 40))
    with torch.inference_mode():
        ref = est(*args, streaming=True)
    apply_mode(model, "torchscript", compile_backend="eager")
    with torch.inference_mode():
        assert torch.allclose(model.flow.decoder.estimator(*args, streaming=True), ref, atol=1e-6)


def test_trt_mode_swaps_the_estimator():
    model = copy.deepcopy(_model())

    class Fake(torch.nn.Module):
        def forward(self, x, mask, mu, t, spks, cond, streaming=False):
            return x

    report = apply_mode(model, "trt", trt_estimator=Fake())
    assert report["estimator"] == "Fake" and isinstance(model.flow.decoder.estimator, Fake)
    with pytest.raises(ValueError, match="load_trt_estimator"):
        apply_mode(copy.deepcopy(_model()), "trt")


@pytest.mark.skipif(HAS_TRT, reason="tensorrt is installed")
def test_preflight_refuses_trt_without_tensorrt(tmp_path):
    preflight("pytorch")
    preflight("torchscript")
    with pytest.raises(ModelLoadError, match=r"TensorRT, which is not installed.*\[trt\] extra"):
        preflight("trt", str(tmp_path))


# ------------------------------------------------------------------------------- synthesizer
def _synth(monkeypatch, env: str | None, **cfg):
    from deployments.synthesizer import Synthesizer
    from deployments.synthesizer_config import SynthesizerConfig
    from tests.deployments import fakes

    if env is None:
        monkeypatch.delenv("FAST_COSY_MODE", raising=False)
    else:
        monkeypatch.setenv("FAST_COSY_MODE", env)
    seen = {}

    def factory(c, source, plan):
        seen["mode"], seen["plan"] = c.mode, plan
        return fakes.fake_synthesis_runtime(c, source, plan)

    s = Synthesizer(SynthesizerConfig(warmup=False, max_running=4, max_ongoing_requests=4,
                                      token2wav={"max_batch_size": 2}, **cfg),
                    runtime_factory=factory)
    return s, seen


@pytest.mark.parametrize("config_mode, env, expected", [
    (None, None, ("pytorch", "default")),
    (None, "torchscript", ("torchscript", "env")),
    ("pytorch", "torchscript", ("pytorch", "config")),
])
def test_health_carries_the_mode_and_its_source(monkeypatch, config_mode, env, expected):
    s, seen = _synth(monkeypatch, env, mode=config_mode)
    health = s.health()
    assert (health.detail["mode"], health.detail["mode_source"]) == expected
    assert seen["mode"] == expected[0]  # the runtime factory gets the resolved mode
    assert (seen["plan"].mode, seen["plan"].mode_source) == expected and seen["plan"] is s.plan  # and the plan
    assert health.detail["plan"] == s.plan.as_dict()


@pytest.mark.skipif(HAS_TRT, reason="tensorrt is installed")
def test_trt_without_tensorrt_fails_in_the_replica_constructor(monkeypatch, tmp_path):
    with pytest.raises(ModelLoadError, match=r"\[trt\] extra"):
        _synth(monkeypatch, "trt")  # via the env: the config leaves the mode unset
    with pytest.raises(ModelLoadError, match=r"\[trt\] extra"):
        _synth(monkeypatch, None, mode="trt", trt_plan_dir=str(tmp_path))


def test_bad_env_mode_fails_in_the_constructor(monkeypatch):
    with pytest.raises(ValueError, match="environment mode"):
        _synth(monkeypatch, "tensorrt")


def test_memory_limits_from_the_runtime_bound_the_prompt_at_admission(monkeypatch):
    import asyncio

    import numpy as np

    from deployments.protocol import InvalidInputError, PreparedRequest, TextPiece, VoicePrompt
    from deployments.synthesizer import Synthesizer
    from deployments.synthesizer_config import SynthesizerConfig
    from tests.deployments import fakes

    def factory(c, source, plan):
        rt = fakes.fake_synthesis_runtime(c, source, plan)
        rt.max_flow_batch, rt.max_prompt_tokens = 1, 5
        return rt

    monkeypatch.delenv("FAST_COSY_MODE", raising=False)
    s = Synthesizer(SynthesizerConfig(warmup=False, max_running=2, max_ongoing_requests=2,
                                      token2wav={"max_batch_size": 2}), runtime_factory=factory)
    assert s._token2wav._get_max_batch_size() == 1  # the flow batch the runtime fitted, not the config's 2
    prompt = VoicePrompt(family="cosyvoice2", text_tokens=np.zeros(0, np.int32),
                         speech_tokens=np.arange(10, dtype=np.int32), mel=np.zeros((20, 80), np.float32),
                         embedding=np.ones(192, np.float32))
    req = PreparedRequest(request_id="r", pieces=[TextPiece("x", np.arange(3, dtype=np.int32))], prompt=prompt,
                          llm_prompt_text_ids=np.zeros(0, np.int32), llm_use_prompt_speech=True, stream=False)

    async def main():
        return [c async for c in s.synthesize(req)]

    with pytest.raises(InvalidInputError, match="10 speech tokens is longer than this replica accepts"):
        asyncio.run(main())
