"""cosyvoice_runtime.fused: q/k/v-style projections as one GEMM, following weight changes, and
traceable as one graph by torch.compile (mode torchscript)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from cosyvoice_runtime.fused import causal_conv_gemm, fused_linear


class _Three(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8, bias=bias), nn.Linear(8, 4, bias=bias), nn.Linear(8, 4, bias=bias)
        self.cache: dict = {}

    def forward(self, x):
        return fused_linear(x, (self.a, self.b, self.c), self.cache)

    def plain(self, x):
        return torch.cat([self.a(x), self.b(x), self.c(x)], dim=-1)


def test_equals_the_separate_layers_and_follows_new_weights():
    torch.manual_seed(0)
    for bias in (True, False):
        m = _Three(bias).requires_grad_(False)
        x = torch.randn(2, 5, 8)
        torch.testing.assert_close(m(x), m.plain(x))
        first = m.cache["weight"]
        m.b.weight.mul_(2.0)  # in place: the version changes
        torch.testing.assert_close(m(x), m.plain(x))
        assert m.cache["weight"] is not first
        m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()})
        torch.testing.assert_close(m(x), m.plain(x))
        m.double()
        torch.testing.assert_close(m(x.double()), m.plain(x.double()))


def test_compiles_without_graph_breaks():
    torch.manual_seed(0)
    m = _Three(True).requires_grad_(False)
    x = torch.randn(3, 8)
    compiled = torch.compile(m, backend="eager", fullgraph=True)  # a graph break would raise
    torch.testing.assert_close(compiled(x), m.plain(x))


@pytest.mark.parametrize("kernel,groups", [(3, 1), (31, 1), (31, 4), (5, 2)])
def test_causal_conv_gemm_is_the_convolution_of_history_then_new_frames(kernel, groups):
    """Channels-last frames with their k - 1 history frames in front (a strided slice of a wider
    buffer): the same output as ``Conv1d`` over the channels-first sequence (float32, GEMM
    rounding), before and after an in-place weight update; grouped ones (CosyVoice3's position
    convolutions) as one batched GEMM over the groups."""
    torch.manual_seed(0)
    conv = nn.Conv1d(12, 20, kernel, groups=groups)
    wide = torch.randn(3, kernel - 1 + 9, 30)
    full = wide[:, :, 5:17]  # a slice of a wider channels-last buffer, as the incremental pass hands it
    want = conv(full.transpose(1, 2)).transpose(1, 2)
    got = causal_conv_gemm(full, conv)
    assert got.shape == (3, 9, 20)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        conv.weight.mul_(-2.0)
    torch.testing.assert_close(causal_conv_gemm(full, conv), conv(full.transpose(1, 2)).transpose(1, 2),
                               rtol=1e-5, atol=1e-5)
