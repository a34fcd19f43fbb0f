"""The bucketed flow solve (cosyvoice_runtime.flow.graphs): padding a batch to its (batch,
frames) bucket changes nothing on valid frames, so the graphed solve returns what the plain
solve returns. On CPU the buckets run eagerly (``use_graphs=False``): that checks the padding,
the static buffers and the fixed noise. The marked GPU test checks the captured graphs."""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from cosyvoice_runtime.flow.flow import build_flow
from cosyvoice_runtime.flow.graph_setup import enable_flow_graphs
from cosyvoice_runtime.flow.graphs import GraphedSolver
from cosyvoice_runtime.graph_capture import batch_buckets
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir
from tests.runtime.test_flow_batch import FAMILIES, JOBS, _flow, _item

# fp32 on CPU: padded and unpadded runs differ only by summation order in matmuls.
PAD_TOL = 1e-4


def _mels(flow, items):
    with torch.inference_mode():
        return flow.inference_batch(items)


def test_buckets():
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(6) == [1, 2, 4, 6]
    solver = GraphedSolver(_flow("cosyvoice2").decoder, max_batch=8, max_frames=300, frame_step=64, use_graphs=False)
    assert solver.max_frames == 320
    assert solver.bucket_of(3, 65) == (4, 128)
    assert solver.bucket_of(1, 64) == (1, 64)
    assert solver.bucket_of(9, 10) is None  # batch above the largest bucket: eager
    assert solver.bucket_of(2, 321) is None  # longer than the largest frame bucket: eager


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_buckets_equal_plain_solve(family):
    plain = _flow(family)
    flow = copy.deepcopy(plain)
    solver = enable_flow_graphs(flow, max_batch=8, max_frames=512, use_graphs=False)
    gen = torch.Generator().manual_seed(11)
    items = [_item(gen, flow, *job) for job in JOBS]
    want = _mels(plain, items)
    got = _mels(flow, items)
    assert solver.replays == 1 and solver.eager_calls == 0
    for w, g in zip(want, got):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=PAD_TOL, rtol=PAD_TOL)
    # a single item lands in a smaller bucket, the same frames again
    one = _mels(flow, items[:1])[0]
    torch.testing.assert_close(one, want[0], atol=PAD_TOL, rtol=PAD_TOL)
    assert len(solver._buckets) == 2


def test_encoder_buckets_equal_plain_encoder():
    """CosyVoice2's encoder graphs: padded rows and tokens change no valid frame, and the output
    length lands in the solve bucket the plain length would use."""
    plain = _flow("cosyvoice2")
    flow = copy.deepcopy(plain)
    enable_flow_graphs(flow, max_batch=8, max_frames=512, use_graphs=False)
    enc = flow.graphed_encoder
    assert enc.token_step == 32 and enc.max_tokens == 256
    assert enc.bucket_of(3, 33) == (4, 64) and enc.bucket_of(9, 10) is None and enc.bucket_of(1, 257) is None
    gen = torch.Generator().manual_seed(4)
    for jobs in (JOBS, JOBS[1:2], JOBS[:3]):
        items = [_item(gen, flow, *job) for job in jobs]
        with torch.inference_mode():
            (want, want_frames), (got, got_frames) = plain.encode(items), flow.encode(items)
        assert torch.equal(got_frames, want_frames)
        assert got.shape[2] % 64 == 0 and got.shape[2] == math.ceil(want.shape[2] / 64) * 64
        for i, n in enumerate(want_frames.tolist()):
            torch.testing.assert_close(got[i, :, :n], want[i, :, :n], atol=PAD_TOL, rtol=PAD_TOL)
    assert enc.replays == 3 and enc.eager_calls == 0 and enc.num_graphs == 3  # (8, 64), (1, 32), (4, 64)
    cv3 = copy.deepcopy(_flow("cosyvoice3"))
    enable_flow_graphs(cv3, use_graphs=False)
    assert cv3.graphed_encoder is None  # CV3 has no conformer encoder


def test_too_long_or_traced_runs_eagerly():
    plain = _flow("cosyvoice2")
    flow = copy.deepcopy(plain)
    solver = enable_flow_graphs(flow, max_batch=2, max_frames=64, use_graphs=False)
    gen = torch.Generator().manual_seed(5)
    item = _item(gen, flow, 20, 40, True, False)  # 2 * (20 + 37) = 114 frames > 64
    torch.testing.assert_close(_mels(flow, [item])[0], _mels(plain, [item])[0])
    assert solver.eager_calls == 1 and solver.replays == 0


def test_graph_owners_are_set_up_where_the_runtime_builds_them():
    """What the graph schedule reads of an owner comes from its constructor, so the assembler sets
    no attribute on the model (issue 42, ask 2): a stepped flow defers its whole-solve graphs for
    good (only the warm-up's run_batch calls it, eagerly, capturing nothing); a compiled
    incremental pass is captured before ready, never beside serving."""
    flow = copy.deepcopy(_flow("cosyvoice2"))
    enable_flow_graphs(flow, max_batch=2, max_frames=128, use_graphs=False, stepper=True, incremental=True,
                       incremental_compile="eager", defer_whole_solve=True)
    assert flow.graphed_solver.deferred and not flow.stepper.deferred
    assert not flow.incremental.background_safe and flow.stepper.background_safe
    item = _item(torch.Generator().manual_seed(5), flow, 20, 40, True, False)  # 114 frames: a bucket
    _mels(flow, [item])
    assert flow.graphed_solver.eager_calls == 1 and flow.graphed_solver.num_graphs == 0
    enable_flow_graphs(flow, max_batch=2, max_frames=128, use_graphs=False, incremental=True)
    assert not flow.graphed_solver.deferred and flow.incremental.background_safe
    _mels(flow, [item])
    assert flow.graphed_solver.replays == 1  # not deferred: its padded bucket serves the call


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graphs_equal_eager(family, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # The GPU machine has no ../shared parity data: random tiny weights from the project's writer.
    spec = write_config_dir(tmp_path, family, TINY_DIMS[family])
    torch.manual_seed(0)
    plain = build_flow(dataclasses.replace(spec.flow, n_timesteps=3)).eval().cuda()
    flow = copy.deepcopy(plain)
    solver = enable_flow_graphs(flow, max_batch=8, max_frames=512)
    gen = torch.Generator().manual_seed(11)
    items = [_item(gen, flow, *job) for job in JOBS]
    items = [type(it)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(it).items()})
             for it in items]
    want = _mels(plain, items)
    for _ in range(2):  # the second replay reuses the captured graph with fresh inputs
        got = _mels(flow, items)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-3)
    assert solver.replays == 2 and len(solver._buckets) == 1
    if family == "cosyvoice2":
        assert flow.graphed_encoder.replays == 2 and flow.graphed_encoder.num_graphs == 1
