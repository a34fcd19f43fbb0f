"""cosyvoice_runtime.kernels: the fused add + LayerNorm against PyTorch's ops.

The PyTorch composite (what serves without CUDA or Triton) is checked here in every run. The
Triton kernel runs under Triton's interpreter on the CPU in a subprocess (TRITON_INTERPRET must be
set before Triton compiles anything) where Triton is installed, and on a GPU in the gpu-marked
test. Under the interpreter a conversion to bfloat16 truncates where the GPU rounds to nearest,
so bfloat16 is compared there within one step of its precision.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from cosyvoice_runtime.kernels import add_layer_norm, add_rms_norm

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _norm(dim: int, dtype: torch.dtype = torch.float32) -> nn.LayerNorm:
    norm = nn.LayerNorm(dim).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    return norm


def test_composite_adds_normalises_and_fills_the_slot():
    torch.manual_seed(0)
    norm = _norm(16)
    x, delta = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    cache = torch.zeros(2, 9, 16)
    s, normed = add_layer_norm(x, delta, norm, slot=cache[:, 4:])
    torch.testing.assert_close(s, x + delta)
    torch.testing.assert_close(normed, norm(x + delta))
    torch.testing.assert_close(cache[:, 4:], normed)
    assert not cache[:, :4].any()  # the cached frames' part is left alone
    same, alone = add_layer_norm(x, None, norm)
    assert same is x
    torch.testing.assert_close(alone, norm(x))


def test_rms_composite_is_the_add_then_f_rms_norm():
    torch.manual_seed(1)
    x, delta, w = torch.randn(3, 1, 24), torch.randn(3, 1, 24), torch.randn(24)
    s, normed = add_rms_norm(x, delta, w, 1e-6)
    torch.testing.assert_close(s, x + delta)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(x + delta, (24,), w, 1e-6))


# Run in a subprocess under the interpreter: the fused kernel against the composite, printed as JSON.
_KERNEL_CHECK = """
import json, torch
from torch import nn
from cosyvoice_runtime.kernels import add_layer_norm, add_rms_norm
torch.manual_seed(0)
out = {}
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    norm = nn.LayerNorm(96).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(); norm.bias.normal_()
    x, delta = torch.randn(2, 7, 96, dtype=dtype), torch.randn(2, 7, 96, dtype=dtype)
    cache = torch.zeros(2, 11, 96, dtype=dtype)
    s1, n1 = add_layer_norm(x, delta, norm, slot=cache[:, 4:], fused=True)
    s0, n0 = add_layer_norm(x, delta, norm)
    _, alone1 = add_layer_norm(x, None, norm, fused=True)
    err = lambda a, b: float(((a.float() - b.float()).abs() / b.float().abs().clamp_min(1.0)).max())
    w = torch.randn(96, dtype=dtype)
    rs1, rn1 = add_rms_norm(x[:, 1:], delta[:, 1:], w, 1e-6, fused=True)  # a non-contiguous x, as a prefill's
    rs0, rn0 = add_rms_norm(x[:, 1:], delta[:, 1:], w, 1e-6)
    out[name] = {"sum": err(s1, s0), "normed": err(n1, n0), "slot": err(cache[:, 4:], n0),
                 "untouched": float(cache[:, :4].abs().max()), "alone": err(alone1, norm(x)),
                 "rms_sum": err(rs1, rs0), "rms": err(rn1, rn0)}
print(json.dumps(out))
"""

# The incremental CosyVoice2 pass of the tiny model with and without the fused kernels.
_PASS_CHECK = """
import json, torch
from bench.random_model import make_model
from cosyvoice_runtime.flow.flow_cache import FlowCache
from cosyvoice_runtime.flow.incremental import IncrementalStepper
model = make_model("cosyvoice2", "tiny", "cpu")
with torch.no_grad():  # LayerNorms start as ones and zeros: random ones, so that a kernel that skipped them would show
    for name, p in model.flow.decoder.estimator.named_parameters():
        if "norm" in name:
            p.normal_(1.0 if name.endswith("weight") else 0.0, 0.5)
out = {}
for fused in (False, True):
    torch.manual_seed(3)
    st = IncrementalStepper(model.flow.decoder, fused_norms=fused)
    cache, mels = FlowCache(), []
    for new, keep in ((60, 50), (40, 0)):  # a first job, then a final one over its cache
        row = st.new_row(torch.randn(80, new), torch.randn(80, new), torch.randn(80), cache, keep=keep)
        st.solve([row])
        row.commit()
        mels.append(row.x)
    out[str(fused)] = torch.cat(mels, dim=-1).tolist()
a, b = torch.tensor(out["False"]), torch.tensor(out["True"])
print(json.dumps({"max_err": float((a - b).abs().max()), "scale": float(a.abs().max())}))
"""


# The tiny CosyVoice2 LLM's forward over a prompt with and without the fused kernels.
_LLM_CHECK = """
import json, tempfile, torch
from cosyvoice_runtime.llm.model import build_llm
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir
spec = write_config_dir(tempfile.mkdtemp(), "cosyvoice2", TINY_DIMS["cosyvoice2"])
torch.manual_seed(0)
llm = build_llm(spec.llm).eval()
with torch.no_grad():  # norms start as ones: random gains, so that a kernel that skipped them would show
    for name, p in llm.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.5)
x = torch.randn(2, 9, spec.llm.llm_input_size)
with torch.no_grad():
    plain = llm.backbone(x)
    llm.use_fused_norms(True)
    fused = llm.backbone(x)
print(json.dumps({"max_err": float((plain - fused).abs().max()), "scale": float(plain.abs().max())}))
"""


def _interpreted(script: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, env=env,
                          timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CPU wheel of torch does not bring it)")
def test_fused_kernel_matches_the_composite_under_the_interpreter():
    got = _interpreted(_KERNEL_CHECK)
    assert got["fp32"]["sum"] == 0.0 and got["fp32"]["rms_sum"] == 0.0  # a float32 add rounds once either way
    for key in ("normed", "slot", "alone", "rms"):
        assert got["fp32"][key] < 1e-5, key
    assert got["bf16"]["sum"] <= 2 ** -7 and got["bf16"]["rms_sum"] <= 2 ** -7  # one step: the interpreter truncates
    for key in ("normed", "slot", "alone", "rms"):  # that step of the sum, then the output's own
        assert got["bf16"][key] <= 2 ** -5, key
    assert got["fp32"]["untouched"] == 0.0 and got["bf16"]["untouched"] == 0.0


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CPU wheel of torch does not bring it)")
def test_incremental_pass_with_fused_kernels_matches_under_the_interpreter():
    """Two jobs of a stream (the second over the first's cache): the slots the kernel writes are
    the keys and values of the later job, so a wrong slot would show there."""
    got = _interpreted(_PASS_CHECK)
    assert got["max_err"] < 1e-4 * max(1.0, got["scale"])


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the CPU wheel of torch does not bring it)")
def test_llm_layers_with_fused_norms_match_under_the_interpreter():
    got = _interpreted(_LLM_CHECK)
    assert got["max_err"] < 1e-4 * max(1.0, got["scale"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs a CUDA GPU and Triton")
def test_fused_kernel_on_the_gpu_matches_the_composite():
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):  # bf16: one step (reduction order)
        norm = _norm(256, dtype).cuda()
        x, delta = torch.randn(4, 50, 256, dtype=dtype, device="cuda"), torch.randn(4, 50, 256, dtype=dtype,
                                                                                    device="cuda")
        cache = torch.zeros(4, 200, 256, dtype=dtype, device="cuda")
        s1, n1 = add_layer_norm(x, delta, norm, slot=cache[:, 150:], fused=True)
        s0, n0 = add_layer_norm(x, delta, norm)
        torch.testing.assert_close(s1, s0, rtol=0, atol=0)  # the same rounding of one add
        rel = ((n1.float() - n0.float()).abs() / n0.float().abs().clamp_min(1.0)).max()
        assert float(rel) <= tol
        torch.testing.assert_close(cache[:, 150:], n1, rtol=0, atol=0)
