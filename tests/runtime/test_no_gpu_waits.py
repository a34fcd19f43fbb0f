"""The token2wav thread never waits for the GPU inside a streamed chunk's host work.

A host -> device copy from pageable memory, ``.tolist()`` or ``.item()`` of a CUDA tensor each
synchronize the stream: the thread stalls until the flow pass in flight (and the one queued behind
it) has run, and the GPU's token2wav lane then idles until the next launch
(:mod:`cosyvoice_runtime.host_copy`). PyTorch's sync debug mode raises on every such call, so a
chunk's start (encoder, rows), passes and finish (vocoder, caches) run under it here, after a
first chunk that makes the one-time copies (fixed noise, pinned buffers).
Eager passes and vocoder: a replay cannot wait, the host code around it is what is checked.
The last copy of the audio to the host (deployments.runtime_adapter) is outside, by design.
GPU only."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cosyvoice_runtime.flow.graph_setup import enable_flow_graphs
from cosyvoice_runtime.model import load_model
from cosyvoice_runtime.tiny_model import write_tiny_model
from cosyvoice_runtime.token2wav import Token2Wav
from tests.runtime.test_flow_incremental_batch import _prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
@pytest.mark.parametrize("flow_mode", ["incremental", "recompute"])
def test_a_streamed_chunk_never_waits_for_the_gpu(family, flow_mode, tmp_path):
    model = load_model(write_tiny_model(tmp_path / "model", family=family), device="cuda")
    enable_flow_graphs(model.flow, max_batch=4, max_frames=1024, use_graphs=False, stepper=True,
                       incremental=flow_mode == "incremental")
    t2w = Token2Wav(model.spec, model.flow, model.hift, min_first_hop=10, cv2_flow=flow_mode, cv3_flow=flow_mode,
                    cv3_vocoder="incremental")
    states = [t2w.new_stream(dataclasses.replace(_prompt(20 + 7 * i, i), family=family), stream=True,
                             generator=torch.Generator(device="cuda").manual_seed(i)) for i in range(3)]
    tokens = [torch.randint(0, 6561, (200,), generator=torch.Generator().manual_seed(10 + i)).tolist() for i in range(3)]
    lane = torch.cuda.Stream()  # the replica's token2wav lane has a stream of its own

    def chunk() -> list[torch.Tensor]:
        rows = t2w.start_solves([t2w.next_job(st, tk, llm_done=False) for st, tk in zip(states, tokens)])
        while any(r.step < t2w.n_steps for r in rows):
            t2w.advance([r for r in rows if r.step < t2w.n_steps])
        return t2w.finish(rows)

    with torch.cuda.stream(lane):
        first = chunk()  # one-time copies and allocations happen here
        torch.cuda.set_sync_debug_mode("error")
        try:
            second = chunk()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lane.synchronize()
    assert all(a.numel() > 0 and a.is_cuda for a in first + second)
    assert all(bool(torch.isfinite(a).all()) for a in second)
