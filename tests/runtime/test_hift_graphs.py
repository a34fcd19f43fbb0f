"""CV2 vocoder graphs (cosyvoice_runtime.hift.graphs), the CV3 body's (hift.causal_graphs) and the
graph-safe iSTFT.

On CPU the graph buckets run eagerly (``use_graphs=False``): that checks the batch padding,
the static buffers, the capture policy and the streamed audio end to end against the plain
vocoder (parity fixture weights). The marked GPU test checks captured graphs on random tiny
weights (the GPU machine has no ../shared data).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from cosyvoice_runtime import graph_capture
from cosyvoice_runtime.hift.batch import causal_decode_batch
from cosyvoice_runtime.hift.causal_graphs import graph_causal_body
from cosyvoice_runtime.hift.generator import build_hift, overlap_add_istft
from cosyvoice_runtime.hift.graphs import enable_graphs
from cosyvoice_runtime.hift.streaming import VocoderStream
from cosyvoice_runtime.stream_schedule import streaming_lengths
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir
from tests.runtime.parity.hift_cases import load_hift
from tests.runtime.test_hift_batch import _mels, _split, batch

TOL = 1e-5  # fp32 CPU: a padded batch changes only the convolution's summation blocking


@pytest.mark.parametrize("frames", [2, 3, 7, 121, 2001])
def test_overlap_add_istft_equals_torch_istft(frames):
    gen = torch.Generator().manual_seed(frames)
    window = torch.hann_window(16, periodic=True)
    spec = torch.complex(torch.randn(3, 9, frames, generator=gen), torch.randn(3, 9, frames, generator=gen))
    want = torch.istft(spec, 16, 4, 16, window=window)
    got = overlap_add_istft(spec, 16, 4, window)
    assert got.shape == want.shape == (3, 4 * (frames - 1))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_streaming_lengths_of_the_released_spec():
    # CosyVoice2: mel cache 8 frames, hop 25 tokens doubling up to 100, 2 frames per token.
    assert streaming_lengths(8, 25, 100, 2, 2) == [58, 108, 208]
    assert streaming_lengths(8, 25, 25, 2, 2) == [58]
    assert streaming_lengths(0, 10, 40, 1, 2) == [20]  # no growth


def _cv2():
    case, mels = _mels("cosyvoice2")
    spec, hift = load_hift(case.model_dir)
    return spec, hift, mels


def _sources(hift, mels, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [hift.source(hift.f0(m), generator=gen) for m in mels]


def test_padded_buckets_equal_eager_decode_and_capture_policy():
    _, hift, mels = _cv2()
    graphed = copy.deepcopy(hift)
    g = enable_graphs(graphed, max_batch=4, max_frames=150, capture_after=2, max_graphs=2, use_graphs=False)
    mel = mels[1]  # 113 frames
    batch = torch.cat([mel, torch.flip(mel, dims=[2])], dim=0)  # 2 rows: bucket 2
    src = torch.cat(_sources(hift, [mel, torch.flip(mel, dims=[2])]), dim=0)
    want = hift.decode(batch, src)
    short = mel[:, :, :90]  # other lengths
    shorter = mel[:, :, :70]
    with torch.inference_mode():
        first = graphed.decode(batch, src)  # seen once: eager, no graph yet
        assert (g.eager_calls, g.replays, g.num_graphs) == (1, 0, 0)
        second = graphed.decode(batch, src)  # seen twice: this length gets its bucket
        assert (g.eager_calls, g.replays, g.num_graphs) == (1, 1, 1)
        # batch buckets this length has no graph of: the captured one replays over the rows
        one = graphed.decode(batch[:1], src[:1])  # bucket 2, padded: one replay
        three = graphed.decode(torch.cat([batch, batch[:1]]), torch.cat([src, src[:1]]))  # 2 + 1 rows
        assert (g.eager_calls, g.replays, g.num_graphs) == (1, 4, 1)
        for _ in range(2):  # a second length is captured on its second sight
            graphed.decode(short, _sources(hift, [short])[0])
        assert (g.eager_calls, g.num_graphs) == (2, 2)
        for _ in range(2):  # a third would exceed max_graphs: stays eager
            graphed.decode(shorter, _sources(hift, [shorter])[0])
        assert (g.eager_calls, g.num_graphs) == (4, 2)
        too_long = graphed.decode(mels[0], _sources(hift, [mels[0]])[0])  # 160 frames > 150: eager
    assert too_long.shape == (1, 480 * mels[0].shape[2])
    for got in (first, second):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    torch.testing.assert_close(one, want[:1], atol=TOL, rtol=TOL)
    torch.testing.assert_close(three[:2], want, atol=TOL, rtol=TOL)
    torch.testing.assert_close(three[2:], want[:1], atol=TOL, rtol=TOL)


def test_a_batch_size_not_captured_replays_the_captured_ones_of_its_length():
    """Start-up captures first-chunk lengths for batches of 1 and 2 only: five first chunks of one
    length in a pass run as 2 + 2 + 1 replays (bucket 4 and 8 exist for no length here), equal
    to the eager decode row for row; nothing eager, nothing captured under traffic."""
    _, hift, mels = _cv2()
    graphed = copy.deepcopy(hift)
    g = enable_graphs(graphed, max_batch=8, max_frames=150, use_graphs=False)
    mel = mels[1]
    g.capture([mel.shape[2]], batch_sizes=[1, 2])
    rows = torch.cat([mel, torch.flip(mel, dims=[2]), mel * 0.5, mel.roll(7, dims=2), mel * 0.25])
    src = torch.cat(_sources(hift, list(rows.split(1))), dim=0)
    with torch.inference_mode():
        want = hift.decode(rows, src)
        got = graphed.decode(rows, src)
    assert (g.eager_calls, g.replays, g.num_graphs) == (0, 3, 2)
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def test_graphed_streams_equal_plain_streams():
    """Three requests streamed through one vocoder batch per call: same audio with and without the graphs."""
    spec, hift, mels = _cv2()
    graphed = copy.deepcopy(hift)
    g = enable_graphs(graphed, max_batch=4, max_frames=256, capture_frames=[60, 58, 68], use_graphs=False)
    assert g.num_graphs == 3 * 3  # three lengths x buckets 1, 2, 4
    schedules = [_split(mels[0], [60, 50]), _split(mels[0][:, :, 5:], [60, 50]), _split(mels[1], [60, 25])]
    plain_states = [VocoderStream.create(spec, seed=10 + i) for i in range(3)]
    graph_states = [VocoderStream.create(spec, seed=10 + i) for i in range(3)]
    for c in range(len(schedules[0])):
        final = c == len(schedules[0]) - 1
        chunks = [s[c] for s in schedules]
        want = batch(hift, plain_states, chunks, [final] * 3)
        got = batch(graphed, graph_states, chunks, [final] * 3)
        for w, x in zip(want, got):
            assert x.shape == w.shape
            torch.testing.assert_close(x, w, atol=TOL, rtol=TOL)
    # mels of 170, 165 and 113 frames. Replayed: the three 60-frame first chunks (bucket 4), the
    # two 58-frame second chunks (8 cached + 50; bucket 2), one 68-frame last chunk (8 + 60;
    # bucket 1); eager: the 33-frame second chunk, the 63- and 36-frame last chunks.
    assert g.replays == 3 and g.eager_calls == 3


def _cuda_hift_and_copy(tmp_path, family: str):
    """The tiny random-weight vocoder of ``family`` on CUDA and a copy to graph (the GPU machine
    has no parity fixtures); skips without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    spec = write_config_dir(tmp_path, family, TINY_DIMS[family])
    torch.manual_seed(0)
    hift = build_hift(spec.hift, spec.flow)
    hift.remove_weight_norm()
    hift = hift.eval().cuda()
    return spec, hift, copy.deepcopy(hift)


@pytest.mark.gpu
def test_cuda_graphs_equal_eager(tmp_path):
    spec, hift, graphed = _cuda_hift_and_copy(tmp_path, "cosyvoice2")
    g = enable_graphs(graphed, max_batch=4, max_frames=256, capture_frames=[58])
    gen = torch.Generator(device="cuda").manual_seed(1)
    for rows, frames in ((3, 58), (1, 58), (2, 90), (2, 90), (2, 90)):
        mel = torch.randn(rows, spec.hift.in_channels, frames, device="cuda", generator=gen)
        with torch.inference_mode():
            src = hift.source(hift.f0(mel), generator=gen)
            want = hift.decode_eager(mel, src)
            got = graphed.decode(mel, src)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert g.num_graphs == 3 + 1  # 58 frames x 3 buckets at start, 90 frames at its second call
    assert g.replays == 4 and g.eager_calls == 1


@pytest.mark.gpu
def test_cv3_body_graphs_over_padded_buckets_equal_the_eager_batched_decode(tmp_path):
    """CUDA: the CosyVoice3 body replayed over zero-padded (batch, frames) buckets gives the eager
    batched decode's samples (random tiny weights); a window past the largest bucket runs eagerly."""
    spec, hift, graphed = _cuda_hift_and_copy(tmp_path, "cosyvoice3")
    body = graph_causal_body(graphed, max_batch=4, max_frames=128)
    assert body.num_graphs == 3 * 8  # batch buckets 1, 2, 4 x frames 16..128
    gen = torch.Generator(device="cuda").manual_seed(1)
    for lengths in ((37,), (50, 61, 44), (120, 9), (130, 20)):
        mels = [torch.randn(1, spec.hift.in_channels, t, device="cuda", generator=gen) for t in lengths]
        with torch.inference_mode():
            want = causal_decode_batch(hift, mels)
            got = causal_decode_batch(graphed, mels)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert body.replays == 3 and body.eager_calls == 1  # 130 frames: past the largest bucket


def test_a_cv3_vocoder_miss_names_the_vocoder_not_the_flow_graphs(tmp_path, caplog, monkeypatch):
    """CosyVoice3's vocoder buckets end at the longest streamed window, not at flow_graph_max_s: the
    log line of its misses (speed-changed requests re-vocoding whole mels) must not send an operator
    to the flow's knob."""
    spec = write_config_dir(tmp_path, "cosyvoice3", TINY_DIMS["cosyvoice3"])
    body = graph_causal_body(build_hift(spec.hift, spec.flow), max_batch=2, max_frames=32, capture=False)
    monkeypatch.setattr(graph_capture, "_missed", 0)  # the next miss is the first: logged
    with caplog.at_level(logging.WARNING, logger="cosyvoice_runtime.graph_capture"):
        body._ran_eagerly(on_cuda=True)
    (record,) = caplog.records
    assert "GraphedCausalBody" in record.getMessage() and "cv3_vocoder" in record.getMessage()
    assert "flow_graph_max_s" not in record.getMessage()
