"""bench.profile_stages' execution variants run on the CPU too (the GPU lease has no time for a
script that fails): every variant of a module method and of a plain function is timed and
matches eager."""
from __future__ import annotations

import pytest
import torch

from bench.profile_stages import execution_variants


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def decode(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + y


@pytest.mark.slow  # ~18 s on 2 cores, most of it torch.compile of the two variants
def test_variants_of_a_method_and_a_function():
    torch.manual_seed(0)
    net = _Net().eval().requires_grad_(False)  # as the bench builds its models
    args = (torch.randn(3, 8), torch.randn(3, 8))
    for fn in (net.decode, lambda x, y: net.decode(x, y) * 2):
        out = execution_variants(fn, args, reps=2, device=torch.device("cpu"))
        assert not [k for k in out if k.endswith("_error")], out
        for variant in ("eager", "graph", "jit_trace", "compile", "compile_graph"):
            assert out[variant]["wall_ms"] > 0 and out[variant]["gpu_ms"] is None
        assert out["jit_trace_maxdiff"] < 1e-6 and out["compile_maxdiff"] < 1e-5
