"""Mode torchscript on a CUDA replica: the token2wav graphs captured over the compiled estimator,
encoder and vocoder body give the eager outputs. On the CPU the compiled modules (eager backend:
dynamo tracing without inductor) run through the graph buckets' padding eagerly; the GPU test
compiles with inductor and captures real graphs."""
from __future__ import annotations

import copy
import dataclasses
import types

import pytest
import torch

from cosyvoice_runtime.flow.flow import build_flow
from cosyvoice_runtime.flow.graph_setup import capture_flow_graphs, enable_flow_graphs
from cosyvoice_runtime.hift.generator import build_hift
from cosyvoice_runtime.hift.graphs import enable_graphs
from cosyvoice_runtime.modes import compile_model
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir
from tests.runtime.test_flow_batch import JOBS, _item
from tests.runtime.test_flow_incremental_batch import _caches_after, _prompt, _tokens
from tests.runtime.test_flow_incremental_batch import _item as _incremental_item


def _tiny(tmp_path, device: str):
    spec = write_config_dir(tmp_path, "cosyvoice2", TINY_DIMS["cosyvoice2"])
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


@pytest.mark.slow  # ~25 s on 2 cores of dynamo tracing (more with a cold inductor cache, as in CI); the torchscript
# mode's test below keeps a compiled pass through the buckets in the default run
def test_compiled_modules_through_the_graph_buckets_on_cpu(tmp_path):
    _check(tmp_path, "cpu", backend="eager", use_graphs=False, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_captured_over_compiled_modules_equal_eager(tmp_path):
    # inductor reorders fp32 reductions: a looser tolerance than graphs over eager modules
    _check(tmp_path, "cuda", backend="inductor", use_graphs=True, tol=2e-3)


def _incremental_passes(tmp_path, family: str, device: str, backend: str, use_graphs: bool, dtype=torch.float32):
    """Two requests' next jobs solved through padded incremental passes (staggered, so buckets of
    one and two rows) by an eager flow and by one whose estimator mode torchscript wrapped and whose
    pass walk is compiled with ``backend``: the rows' x and last convolution history of each."""
    torch.manual_seed(0)
    tiny = build_flow(write_config_dir(tmp_path, family, TINY_DIMS[family]).flow).eval()
    reqs = [(dataclasses.replace(p, family=family), t, e) for p, t, e in
            [(_prompt(20, 1), _tokens(120, 1), 0), (_prompt(25, 2), _tokens(150, 2), 25)]]
    la = tiny.spec.pre_lookahead_len
    out = []
    for compiled in (False, True):
        flow = copy.deepcopy(tiny).to(device, dtype)
        if compiled:  # what mode torchscript does to the estimator
            flow.decoder.estimator = torch.compile(flow.decoder.estimator, dynamic=True, backend=backend)
        enable_flow_graphs(flow, max_batch=4, max_frames=512, use_graphs=use_graphs and compiled, incremental=True,
                           incremental_compile=backend if compiled else None)
        assert flow.incremental is not None and flow.incremental.compiled == compiled
        if use_graphs and compiled:
            assert capture_flow_graphs(flow) > 0
        caches = _caches_after(flow, reqs)
        rows = flow.start_incremental_rows([_incremental_item(p, t[:70 + la], False) for p, t, _ in reqs], caches, [0, 1])
        flow.incremental.advance([rows[1]])
        flow.incremental.solve(rows)
        out.append([(r.x.float().cpu(), r.new_convs[-1].float().cpu()) for r in rows])
    return out, flow, reqs


# CosyVoice3's case under slow (~20 s of dynamo tracing on 2 cores): CosyVoice2's keeps the path in the default run
@pytest.mark.parametrize("family", ["cosyvoice2", pytest.param("cosyvoice3", marks=pytest.mark.slow)])
def test_mode_torchscript_keeps_the_incremental_flow_and_compiles_its_pass_on_cpu(family, tmp_path):
    """The estimator wrapped by torch.compile once hid the U-Net / DiT from the flow, which then
    recomputed every streamed chunk without a word; now the pass walks the module inside and is
    traced whole by dynamo (eager backend: no inductor on the CPU CI; no graph breaks, so inductor
    fuses the whole pass on a GPU)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    (eager, compiled), flow, reqs = _incremental_passes(tmp_path, family, "cpu", backend="eager", use_graphs=False)
    assert not counters["graph_break"]
    for (xa, ha), (xb, hb) in zip(eager, compiled):
        assert torch.equal(xa, xb) and torch.equal(ha, hb)  # the same ops, traced
    # two rows over another cached bucket (256 -> 512 frames) reuse the compiled walks: no compile
    # per cached length (a replica captures ~430 buckets; dynamo stops compiling after 8 per frame)
    graphs = counters["stats"]["unique_graphs"]
    later = [(p, t, e + 150) for p, t, e in reqs]
    rows = flow.start_incremental_rows([_incremental_item(p, t[:e + 20], False) for p, t, e in later],
                                       _caches_after(flow, later), [0, 1])
    assert flow.incremental.bucket_of(2, max(r.frames for r in rows), max(r.start for r in rows))[2] == 512
    flow.incremental.solve(rows)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_graphed_compiled_incremental_passes_equal_eager(family, tmp_path, monkeypatch):
    """CUDA: the incremental pass compiled by inductor and captured per bucket (``flow_compile``,
    mode torchscript) gives the eager padded passes' x and convolution history (float32; inductor
    reorders reductions, so not bit for bit)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    (eager, compiled), _, _ = _incremental_passes(tmp_path, family, "cuda", backend="inductor", use_graphs=True)
    for (xa, ha), (xb, hb) in zip(eager, compiled):
        torch.testing.assert_close(xb, xa, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(hb, ha, atol=1e-3, rtol=1e-3)


# under slow (~12 s each of dynamo tracing): the torchscript mode's test compiles the same pass in the default run
@pytest.mark.slow
@pytest.mark.parametrize("family,graphs", [("cosyvoice2", 2), ("cosyvoice3", 4)])
def test_compiled_incremental_pass_builds_a_few_graphs_for_every_bucket(family, graphs, tmp_path):
    """The compiled pass (flow_compile, mode torchscript) over 27 buckets builds at most 2
    (CosyVoice2) or 4 (CosyVoice3) graphs: a batch of one and nothing cached are specialised,
    nothing else. With duck sizing every coincidence of sizes among the buckets was a recompile
    (4 for CosyVoice2 here; minutes of inductor each on the real model, whose replica did not start
    in 280 s on an H100, 2026-12-05)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    flow = build_flow(write_config_dir(tmp_path, family, TINY_DIMS[family]).flow).eval()
    enable_flow_graphs(flow, max_batch=4, max_frames=512, use_graphs=False, incremental=True,
                       incremental_compile="eager")
    inc = flow.incremental
    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        for b in inc.batch_buckets:
            for new in (64, 128, 192):
                for cached in (0, 256, 512):
                    bucket = inc._new_bucket(b, new, cached, staged=True)
                    bucket.n_len.fill_(1)
                    inc._run(bucket)
    assert counters["stats"]["unique_graphs"] == graphs
    assert not counters["graph_break"]
