"""The padded, fixed-window decode step (what the CUDA graphs capture) equals the eager decode."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cosyvoice_runtime.graph_capture import GraphOwner, batch_buckets, missed_total
from cosyvoice_runtime.llm.cuda_graph import DecodeRunner, default_key_buckets
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.sampling import SamplingParams, min_len_mask_ids
from tests.runtime.test_llm_engine import S, assert_matches_reference, prompts, reference, run_engine, tiny_model


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(1) == [1]
    assert default_key_buckets(1000) == [128, 256, 512, 1000]
    assert default_key_buckets(100) == [100]


def test_an_eager_call_is_a_graph_miss_only_on_cuda_with_graphs_on(caplog):
    """What a replica's tts_cuda_graph_misses_total counts: eager calls that a captured shape
    would have replayed, not the CPU's or a graphs-off owner's eager work; the log names the
    misses at 1, 2, 4, ... of them."""
    on, off = GraphOwner(), GraphOwner()
    on.use_graphs = True
    before = missed_total()
    with caplog.at_level(logging.WARNING, logger="cosyvoice_runtime.graph_capture"):
        on._ran_eagerly(on_cuda=True)
        on._ran_eagerly(on_cuda=False)
        off._ran_eagerly(on_cuda=True)
        for _ in range(7):
            on._ran_eagerly(on_cuda=True)
    assert (on.eager_calls, off.eager_calls) == (9, 1)
    assert missed_total() - before == 8
    counts = [int(r.getMessage().split()[0]) for r in caplog.records]
    assert counts and all(n & (n - 1) == 0 for n in counts) and "flow_graph_max_s" in caplog.records[-1].getMessage()
    assert len(counts) == sum(1 for n in range(before + 1, before + 9) if n & (n - 1) == 0)


def _filled_cache(model, lengths, num_slots, max_len, slots):
    cache = KVCache.for_model(model, num_slots, max_len)
    for x, s in zip(prompts(lengths, seed=11), slots):
        model.prefill(x, cache, s)
    return cache


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
@pytest.mark.parametrize("window", [None, 128])
def test_static_decode_equals_eager_decode_for_a_mixed_batch(family, window):
    model = tiny_model(family)
    slots, lengths = [3, 0, 5, 1], [4, 33, 17, 60]
    tokens = torch.tensor([1, 7, S - 1, 12])
    with torch.inference_mode():
        eager_cache = _filled_cache(model, lengths, 7, 128, slots)
        static_cache = copy.deepcopy(eager_cache)
        ref = model.logits(model.decode(model.embed_speech(tokens), eager_cache, slots))
        # Pad to a bucket of 6 rows: two padding rows write into scratch slot 6 at position 0.
        pad = 6
        slot_index = torch.tensor(slots + [pad, pad])
        positions = torch.tensor(lengths + [0, 0])
        win = window or max(lengths) + 1  # the tightest window, and a wider bucket
        got = model.decode_static(torch.cat([tokens, torch.zeros(2, dtype=torch.long)]), static_cache, slot_index,
                                  positions, win)[:4]
    assert (got - ref).abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    for layer in range(len(eager_cache.k)):  # the new keys/values landed at each row's position
        for s, n in zip(slots, lengths):
            for a, b in ((eager_cache.k, static_cache.k), (eager_cache.v, static_cache.v)):
                assert (a[layer][s, :, :n + 1] - b[layer][s, :, :n + 1]).abs().max() < 1e-5


class _CacheOps(TorchDispatchMode):
    """The dtypes of the index_select calls made under it, and how many index_put calls."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []
        self.puts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index_select.default:
            self.dtypes.append(args[0].dtype)
        self.puts += func in (torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default)
        return func(*args, **(kwargs or {}))


def test_the_static_step_writes_and_gathers_keys_and_values_once_per_layer():
    # The slot gather was the top kernel of a loaded H100 decode step (two bf16 gathers a layer),
    # and keys and values were written with one index_put each (H100 trace, 2026-12-05).
    model = tiny_model("cosyvoice2")
    with torch.inference_mode():
        cache = _filled_cache(model, [4, 9], 4, 64, [2, 0])
        with _CacheOps() as seen:
            model.decode_static(torch.tensor([1, 7]), cache, torch.tensor([2, 0]), torch.tensor([4, 9]), 16)
    layers = model.backbone_spec.num_layers
    assert seen.dtypes == [torch.int64] * layers  # one gather of 8-byte words a layer
    assert seen.puts == layers


@pytest.mark.parametrize("head_dim, dtype", [(3, torch.float32), (6, torch.bfloat16), (4, torch.float32)])
def test_the_window_gather_equals_the_slots_slices_at_any_row_width(head_dim, dtype):
    # 12 and 12 bytes a row cannot be read as 8-byte words (element gather); 16 bytes can.
    cache = KVCache(num_layers=1, num_slots=5, max_len=8, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    cache.kv[0].copy_(torch.randn(cache.kv[0].shape))
    slot_index, positions = torch.tensor([3, 1, 3]), torch.tensor([2, 5, 2])
    kv = torch.randn(3, 2, 2, 1, head_dim).to(dtype)  # (rows, key/value, heads, 1, dim)
    k, v = kv[:, 0], kv[:, 1]
    keys, values = cache.write_at(0, slot_index, positions, kv, window=6)
    assert keys.shape == values.shape == (3, 2, 6, head_dim)
    assert torch.equal(keys[1], cache.k[0][1, :, :6]) and torch.equal(values[0], cache.v[0][3, :, :6])
    assert torch.equal(cache.k[0][1, :, 5], k[1, :, 0]) and torch.equal(cache.v[0][1, :, 5], v[1, :, 0])


def test_runner_step_eagerly_advances_lengths_and_returns_the_batch():
    model = tiny_model()
    with torch.inference_mode():
        cache = _filled_cache(model, [5, 9], 3, 64, [0, 1])
    runner = DecodeRunner(model, cache, 2, pad_slot=2, stop_mask_ids=min_len_mask_ids(model.spec),
                          use_graphs=False)
    assert not runner.use_graphs
    from cosyvoice_runtime.llm.generate import DecodeState

    states = [DecodeState(min_len=0, max_len=10, params=SamplingParams(method="greedy"), tokens=[3]),
              DecodeState(min_len=5, max_len=10, params=SamplingParams(method="greedy"), tokens=[4])]
    with torch.inference_mode():
        ref_cache = copy.deepcopy(cache)
        ref = model.logits(model.decode(model.embed_speech(torch.tensor([3, 4])), ref_cache, [0, 1]))
        ids, logits = runner.step([3, 4], [0, 1], states)
    assert cache.lengths == [6, 10, 0]  # the scratch slot's length never moves
    assert (logits - ref).abs().max() < 1e-4
    masked = ref.float().log_softmax(-1)
    masked[1, list(min_len_mask_ids(model.spec))] = -float("inf")  # row 1 is below its min length
    assert ids == masked.argmax(-1).tolist()


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_static_engine_equals_reference_for_joining_requests(family):
    model = tiny_model(family)
    greedy = SamplingParams(method="greedy")
    xs = prompts([5, 11, 8, 21, 2, 3], seed=3)
    schedule = {
        0: [("a", xs[0], 6, 6, greedy), ("b", xs[1], 15, 15, SamplingParams(seed=4)),
            ("c", xs[2], 9, 9, greedy)],
        3: [("d", xs[3], 10, 10, SamplingParams(seed=9)), ("e", xs[4], 0, 20, greedy)],
        5: [("f", xs[5], 4, 12, SamplingParams(method="top_k_top_p", top_k=5, top_p=0.9, temperature=0.7,
                                                seed=2))],
    }
    engine = LLMEngine(model, max_batch_size=3, max_seq_len=48, return_logits=True, static_decode=True)
    assert engine.runner is not None and engine.cache.num_slots == 4
    assert_matches_reference(model, schedule, *run_engine(engine, schedule))


def test_compiled_static_step_equals_reference():
    # Mode torchscript's decode step: dynamo traces the model part (eager backend on the CPU, so
    # the check is the tracing itself: cache writes, per-row positions, dynamic batch and window).
    model = tiny_model("cosyvoice2")
    greedy = SamplingParams(method="greedy")
    xs = prompts([5, 11, 8], seed=5)
    schedule = {0: [("a", xs[0], 6, 6, greedy), ("b", xs[1], 12, 12, SamplingParams(seed=4))],
                2: [("c", xs[2], 9, 9, greedy)]}
    engine = LLMEngine(model, max_batch_size=3, max_seq_len=48, return_logits=True, static_decode=True,
                       compile_backend="eager")
    assert type(engine.runner._decode).__name__ != "method"  # the compiled wrapper, not the bound method
    assert_matches_reference(model, schedule, *run_engine(engine, schedule))


def test_compiled_decode_step_is_one_graph_over_every_bucket():
    """The decode step compiles whole (fullgraph: a graph break raises) and, with dynamic shapes,
    into at most two graphs over every (batch, key window) bucket: batch 1 and the rest. The
    rotation's out= broke the graph in each of the 24 layers, and the lazily built mask bias made
    every bucket recompile: the compiled step hit dynamo's recompile limit and never started on
    an H100 (2026-12-06)."""
    from torch._dynamo.utils import counters

    model = tiny_model("cosyvoice2")
    cache = KVCache.for_model(model, 9, 512)
    runner = DecodeRunner(model, cache, 8, pad_slot=8, stop_mask_ids=min_len_mask_ids(model.spec), use_graphs=False)
    runner._decode = torch.compile(model.decode_static, dynamic=True, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        for b in runner.batch_buckets:
            for window in runner.key_buckets:
                runner._rows[:b].copy_(runner._pad_row.expand(b, -1))
                runner._body(b, window)
    assert len(runner.batch_buckets) * len(runner.key_buckets) == 12
    assert counters["stats"]["unique_graphs"] <= 2
    assert not counters["graph_break"]


def test_static_engine_hands_official_rng_and_custom_samplers_to_the_eager_path():
    model = tiny_model("cosyvoice3")
    xs = prompts([4, 7, 6], seed=8)
    calls = []

    def always_three(logp, state):
        calls.append(state.step)
        return 3

    official = SamplingParams(seed=5, official_rng=True)
    wide = SamplingParams(seed=6, win_size=40)  # wider than the in-step history
    engine = LLMEngine(model, max_batch_size=3, max_seq_len=32, static_decode=True)
    engine.add_request("o", xs[0], 8, 8, official)
    engine.add_request("w", xs[1], 8, 8, wide)
    engine.add_request("c", xs[2], 5, 5, sample_fn=always_three)
    got = {"o": [], "w": [], "c": []}
    while engine.has_unfinished():
        for ev in engine.step():
            got[ev.request_id].extend(ev.tokens)
    assert got["c"] == [3] * 5 and calls == list(range(5))
    assert got["o"] == reference(model, xs[0], 8, 8, official)[0]
    assert got["w"] == reference(model, xs[1], 8, 8, wide)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,backend", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "inductor")])
def test_cuda_graph_engine_equals_eager_engine(dtype, backend):
    model = tiny_model().to("cuda", dtype)
    xs = [x.cuda() for x in prompts([5, 40, 17, 130], seed=2)]
    greedy = SamplingParams(method="greedy")
    reqs = [(f"r{i}", x, 30, 30, greedy if i % 2 else SamplingParams(seed=i)) for i, x in enumerate(xs)]
    out = []
    for graphs in (False, True):  # backend: the graphed step compiled first (mode torchscript)
        engine = LLMEngine(model, max_batch_size=4, max_seq_len=256, return_logits=True, use_cuda_graphs=graphs,
                           compile_backend=backend if graphs else None)
        assert (engine.runner is not None) == graphs
        if graphs:
            prefill = engine.prefill_runner
            assert engine.capture_graphs() == (len(engine.runner.batch_buckets) * len(engine.runner.key_buckets)
                                               + len(prefill.batch_buckets) * len(prefill.length_buckets))
        out.append(run_engine(engine, {0: reqs[:2], 3: reqs[2:]}))
    (tok_e, log_e, _), (tok_g, log_g, _) = out
    tol = 1e-3 if dtype == torch.float32 else 0.1
    for rid in tok_e:
        assert tok_e[rid] == tok_g[rid], rid
        assert (log_e[rid].float() - log_g[rid].float()).abs().max() < tol, rid


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_the_gathered_key_value_views_equals_contiguous_copies(dtype):
    # The gathered window's keys and values are views into one (B, 2, heads, window, dim) buffer
    # (batch stride twice a contiguous tensor's); several SDPA backends have mishandled strides.
    # The model's real shapes: 14 query heads over 2 kv heads, head_dim 64, an additive key mask.
    cache = KVCache(num_layers=1, num_slots=9, max_len=512, num_kv_heads=2, head_dim=64, device="cuda", dtype=dtype)
    cache.kv[0].normal_()
    slot_index = torch.tensor([5, 0, 8, 3, 8], device="cuda")
    positions = torch.tensor([300, 17, 0, 255, 0], device="cuda")
    new = torch.randn(5, 2, 2, 1, 64, device="cuda", dtype=dtype)
    k, v = cache.write_at(0, slot_index, positions, new, window=512)
    assert k.stride(0) == 2 * k[0].numel()
    q = torch.randn(5, 2, 7, 64, device="cuda", dtype=dtype)
    hidden = torch.arange(512, device="cuda")[None, :] > positions[:, None]
    bias = torch.zeros(5, 1, 7, 512, device="cuda", dtype=dtype).masked_fill_(hidden[:, None, None], float("-inf"))
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), attn_mask=bias)
    # Strides may steer SDPA to another kernel: equal up to rounding, not bit for bit.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_over_views_of_the_projection_equals_contiguous_copies(dtype):
    # A prompt's keys and values are views of the q/k/v projection's output (B, T, heads, d)
    # transposed (the rotation writes in place; the cache write takes them side by side).
    qkv = torch.randn(3, 40, 14 + 2 * 2, 64, device="cuda", dtype=dtype).transpose(1, 2)
    q = qkv[:, :14].reshape(3, 2, 7 * 40, 64)
    k, v = qkv[:, 14:16], qkv[:, 16:]
    mask = torch.ones(40, 40, dtype=torch.bool, device="cuda").tril().repeat(7, 1)
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), attn_mask=mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", [None, "eager"])
def test_a_compiled_step_warms_up_on_the_buffers_it_is_captured_with(backend, monkeypatch):
    """A graphed step warms up on scratch buffers (a background capture must not write the
    engine's); a compiled one (captured before ready, on one thread) on its own buffers: traced on
    scratch tensors, torch.compile traced again inside the capture and the capture failed (five GPU
    tests, H100 2026-12-07; on the CPU, with the eager backend, the scratch buffers of batches 1
    and 2 at the widest key window compiled graphs of their own after the real ones)."""
    model = tiny_model("cosyvoice2")
    cache = KVCache.for_model(model, 9, 512)
    runner = DecodeRunner(model, cache, 8, pad_slot=8, stop_mask_ids=min_len_mask_ids(model.spec), use_graphs=False,
                          compile_backend=backend)
    warms = []

    def capture(fn, device, warm=None):
        warms.append(warm)
        return object(), None

    monkeypatch.setattr(runner, "_capture", capture)
    runner._graph(1, runner.key_buckets[0])
    assert runner.background_safe is (backend is None)
    assert (warms[0] is None) is (backend is not None)


def test_the_step_buffers_hold_padding_rows_before_the_first_step():
    """A compiled step warms up on its own buffers before any step packed them: they hold padding
    rows (the scratch slot, greedy), not zeros (slot 0, temperature 0: NaN in the sampler)."""
    model = tiny_model("cosyvoice2")
    cache = KVCache.for_model(model, 9, 512)
    runner = DecodeRunner(model, cache, 8, pad_slot=8, stop_mask_ids=min_len_mask_ids(model.spec), use_graphs=False)
    assert torch.equal(runner._rows, runner._pad_row.expand_as(runner._rows))
    runner._body(8, runner.key_buckets[0])
    assert ((runner._ids >= 0) & (runner._ids < model.llm_decoder.out_features)).all()
