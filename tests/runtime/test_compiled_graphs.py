"""Mode torchscript on a CUDA replica: the token2wav graphs captured over the compiled estimator,
encoder and vocoder body give the eager outputs. On the CPU the compiled modules (eager backend:
dynamo tracing without inductor) run through the graph buckets' padding eagerly; the GPU test
compiles with inductor and captures real graphs."""
from __future__ import annotations

import types

import pytest
import torch

from cosyvoice_runtime.flow.flow import build_flow
from cosyvoice_runtime.flow.graph_setup import capture_flow_graphs, enable_flow_graphs
from cosyvoice_runtime.hift.generator import build_hift
from cosyvoice_runtime.hift.graphs import enable_graphs
from cosyvoice_runtime.modes import compile_model
from cosyvoice_runtime.tiny_model import _TINY, write_config_dir
from tests.runtime.test_flow_batch import JOBS, _item


def _tiny(tmp_path, device: str):
    spec = write_config_dir(tmp_path, "cosyvoice2", _TINY["cosyvoice2"])
    torch.manual_seed(0)
    flow = build_flow(spec.flow).eval().to(device)
    hift = build_hift(spec.hift)
    hift.remove_weight_norm()
    gen = torch.Generator().manual_seed(11)
    items = [_item(gen, flow, *job) for job in JOBS]
    items = [type(it)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(it).items()})
             for it in items]
    return spec, flow, hift.eval().to(device), items


def _vocoder_inputs(hift, device: str):
    gen = torch.Generator(device=device).manual_seed(3)
    out = []
    with torch.inference_mode():
        for rows, frames in ((2, 58), (1, 70)):
            mel = torch.randn(rows, hift.spec.in_channels, frames, device=device, generator=gen)
            out.append((mel, hift.source(hift.f0(mel), generator=gen)))
    return out


def _check(tmp_path, device: str, backend: str, use_graphs: bool, tol: float) -> None:
    _, flow, hift, items = _tiny(tmp_path, device)
    voc_in = _vocoder_inputs(hift, device)
    with torch.inference_mode():
        want_mels = flow.inference_batch(items)
        want_audio = [hift.decode_eager(mel, src) for mel, src in voc_in]
    done = compile_model(types.SimpleNamespace(flow=flow, hift=hift), backend=backend)
    assert done == ["flow.decoder.estimator", "flow.encoder", "hift.body"]
    enable_flow_graphs(flow, max_batch=8, max_frames=512, use_graphs=use_graphs)
    vocoder = enable_graphs(hift, max_batch=4, max_frames=256, capture_after=1, use_graphs=use_graphs)
    if use_graphs:
        assert capture_flow_graphs(flow) > 0
    with torch.inference_mode():
        for _ in range(2):  # the second round replays (or reruns) what the first captured
            got_mels = flow.inference_batch(items)
            got_audio = [hift.decode(mel, src) for mel, src in voc_in]
    for w, g in zip(want_mels, got_mels):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)
    for w, g in zip(want_audio, got_audio):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)
    if use_graphs:
        assert vocoder.num_graphs == 2 and vocoder.replays >= 2


def test_compiled_modules_through_the_graph_buckets_on_cpu(tmp_path):  # ~25 s on 2 cores: dynamo tracing
    _check(tmp_path, "cpu", backend="eager", use_graphs=False, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_captured_over_compiled_modules_equal_eager(tmp_path):
    # inductor reorders fp32 reductions: a looser tolerance than graphs over eager modules
    _check(tmp_path, "cuda", backend="inductor", use_graphs=True, tol=2e-3)
