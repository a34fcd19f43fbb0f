"""cosyvoice_runtime.fused: q/k/v-style projections as one GEMM, following weight changes, and
traceable as one graph by torch.compile (mode torchscript)."""
from __future__ import annotations

import torch
from torch import nn

from cosyvoice_runtime.fused import fused_linear


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
