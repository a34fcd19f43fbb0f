"""LLM decode graphs, flow graphs (solve + encoder) and vocoder graphs replayed at the same time
from threads, each on its own CUDA stream (the layout of a GPU replica).
Captured on one shared stream they shared a cuBLAS workspace and hung at batch 16 on an H200
(2026-12-03); each owner now captures on a stream of its own (cosyvoice_runtime.graph_capture).
The vocoder lane captures lengths lazily while the LLM lane replays, as a replica does when it
meets a new first-chunk length. GPU only."""
from __future__ import annotations

import threading

import pytest
import torch

from cosyvoice_runtime.flow.flow import build_flow
from cosyvoice_runtime.flow.graph_setup import capture_flow_graphs, enable_flow_graphs
from cosyvoice_runtime.hift.generator import build_hift
from cosyvoice_runtime.hift.graphs import enable_graphs
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.sampling import SamplingParams
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir
from tests.runtime.test_flow_batch import JOBS, _item
from tests.runtime.test_llm_engine import prompts, run_engine, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda_items(flow):
    gen = torch.Generator().manual_seed(11)
    items = [_item(gen, flow, *job) for job in JOBS]
    return [type(it)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(it).items()})
            for it in items]


def test_owners_capture_on_own_streams_and_replay_together(tmp_path):
    spec = write_config_dir(tmp_path, "cosyvoice2", TINY_DIMS["cosyvoice2"])
    torch.manual_seed(0)
    flow = build_flow(spec.flow).eval().cuda()
    solver = enable_flow_graphs(flow, max_batch=8, max_frames=512)
    assert capture_flow_graphs(flow) == len(solver._buckets) + flow.graphed_encoder.num_graphs
    llm = tiny_model().cuda()
    engine = LLMEngine(llm, max_batch_size=4, max_seq_len=256, use_cuda_graphs=True)
    engine.capture_graphs()
    streams = (solver._capture_stream, engine.runner._capture_stream)
    assert None not in streams and streams[0] is not streams[1]
    assert torch.cuda.default_stream() not in streams

    items = _cuda_items(flow)
    with torch.inference_mode():
        want_mels = flow.inference_batch(items)
    greedy = SamplingParams(method="greedy")
    reqs = [(f"r{i}", x.cuda(), 40, 40, greedy) for i, x in enumerate(prompts([5, 40, 17, 30], seed=2))]
    want_tokens = run_engine(engine, {0: reqs})[0]

    hift = build_hift(spec.hift)
    hift.remove_weight_norm()
    hift = hift.eval().cuda()
    vocoder = enable_graphs(hift, max_batch=4, max_frames=256, capture_after=2)  # nothing captured yet
    gen = torch.Generator(device="cuda").manual_seed(3)
    voc_inputs = []
    with torch.inference_mode():
        for rows, frames in ((2, 58), (1, 70), (3, 108)):
            mel = torch.randn(rows, hift.spec.in_channels, frames, device="cuda", generator=gen)
            voc_inputs.append((mel, hift.source(hift.f0(mel), generator=gen)))
        want_audio = [hift.decode_eager(mel, src) for mel, src in voc_inputs]

    errors: list[BaseException] = []
    got: dict[str, object] = {}

    def vocoder_lane():
        try:
            with torch.cuda.stream(torch.cuda.Stream()), torch.inference_mode():
                for _ in range(4):  # the second round captures each length, later rounds replay
                    got["audio"] = [hift.decode(mel, src) for mel, src in voc_inputs]
                torch.cuda.current_stream().synchronize()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def flow_lane():
        try:
            with torch.cuda.stream(torch.cuda.Stream()), torch.inference_mode():
                for _ in range(20):
                    got["mels"] = flow.inference_batch(items)
                torch.cuda.current_stream().synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def llm_lane():
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(3):
                    got["tokens"] = run_engine(engine, {0: reqs})[0]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=f, daemon=True) for f in (flow_lane, llm_lane, vocoder_lane)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "concurrent graph replays did not finish (hang)"
    assert not errors, errors
    assert got["tokens"] == want_tokens
    for w, g in zip(want_mels, got["mels"]):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-3)
    for w, g in zip(want_audio, got["audio"]):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert vocoder.num_graphs == 3 and vocoder.replays == 3 * 3 and vocoder.eager_calls == 3


def test_a_capture_under_traffic_keeps_the_allocator_cache_and_other_streams_running():
    """A graph captured late (a shape first met under load) must not empty the caching allocator
    (the next allocations would be cudaMallocs, each a device-wide sync) nor wait for other
    streams' work; torch.cuda.graph() does both, graph_capture.capture neither."""
    from cosyvoice_runtime.graph_capture import capture, captured_total

    scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del scratch  # 64 MiB now cached, unused
    reserved = torch.cuda.memory_reserved()
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):  # other work in flight while the capture runs: ~1 s of spinning
        torch.cuda._sleep(2_000_000_000)
    done = torch.cuda.Event()
    done.record(busy)
    x = torch.arange(8.0, device="cuda")
    before = captured_total()
    graph, out = capture(lambda: x * 2 + 1, torch.cuda.Stream())
    assert not done.query()  # the capture did not wait for the busy stream (a device sync would have)
    assert torch.cuda.memory_reserved() >= reserved  # nothing given back to the driver
    assert captured_total() == before + 1
    x.copy_(torch.arange(8.0, 16.0, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [float(2 * v + 1) for v in range(8, 16)]
