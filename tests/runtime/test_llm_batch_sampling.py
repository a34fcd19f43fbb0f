"""Batched sampler: the single-row §3.6 rules, vectorised, with counter-based seeded draws."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice_runtime.llm import batch_sampling as bs
from cosyvoice_runtime.llm.sampling import SamplingParams, nucleus_keep_count

V = 300


def random_logp(b, seed=0, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, V, generator=g) * sharp).log_softmax(-1)


def pack(params, histories=None, steps=None, seeds=None, masked=None, width=16):
    n = len(params)
    return torch.from_numpy(bs.pack_rows(params, histories or [[]] * n, steps or [0] * n,
                                         seeds or list(range(n)), masked or [False] * n, width))


def test_kept_set_equals_the_single_row_rule():
    g = torch.Generator().manual_seed(3)
    top_p = torch.tensor([0.8, 0.5, 0.95, 1.0, 0.3, 0.8], dtype=torch.float32)
    top_k = torch.tensor([25, 3, 300, 7, 25, 1])
    for sharp in (0.5, 2.0, 6.0):
        probs = (torch.randn(6, V, generator=g) * sharp).softmax(-1).sort(dim=-1, descending=True).values
        kept = bs.kept_mask(probs, top_p, top_k)
        for i in range(6):
            n = nucleus_keep_count(probs[i], float(top_p[i]), int(top_k[i]))
            assert kept[i].tolist() == [True] * n + [False] * (V - n), (sharp, i)


def test_counter_uniforms_are_deterministic_uniform_and_seed_dependent():
    u = bs.counter_uniforms([7] * 20000, np.arange(20000))
    assert u.dtype == np.float32 and 0.0 <= u.min() and u.max() < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert np.array_equal(u[:50], bs.counter_uniforms([7] * 50, np.arange(50)))
    assert not np.array_equal(u[:50], bs.counter_uniforms([8] * 50, np.arange(50)))
    big = bs.counter_uniforms([2**64 - 1, 0], [2**40, 0])  # full 64-bit range, no overflow errors
    assert big.shape == (2,)


def test_draws_stay_in_the_kept_set_and_follow_its_probabilities():
    probs = torch.tensor([0.05, 0.5, 0.1, 0.2, 0.15] + [0.0] * 5)
    logp = probs.clamp_min(1e-30).log()[None].expand(4000, -1).contiguous()
    params = [SamplingParams(top_p=0.8, top_k=25)] * 4000
    ids = bs.sample_rows(logp, pack(params, steps=list(range(4000)), seeds=[1] * 4000))
    counts = torch.bincount(ids, minlength=10).float() / 4000
    assert set(ids.tolist()) == {1, 3, 4}  # the kept set of 0.5, 0.2, 0.15
    expected = torch.tensor([0.5, 0.2, 0.15]) / 0.85
    assert (counts[[1, 3, 4]] - expected).abs().max() < 0.03


def test_ras_fallback_masks_the_repeated_pick_and_only_counts_the_window():
    logp = torch.tensor([0.97, 0.01, 0.01, 0.01]).log()
    n = 300
    ras = [SamplingParams()] * n
    rows = lambda hist: pack(ras, histories=[hist] * n, steps=list(range(n)), seeds=[3] * n)
    x = logp[None].expand(n, -1).contiguous()
    assert set(bs.sample_rows(x, rows([5, 6])).tolist()) == {0}  # 0 not recent
    assert set(bs.sample_rows(x, rows([0])).tolist()) == {1, 2, 3}  # 0 repeated -> masked redraw
    assert set(bs.sample_rows(x, rows([0] + [7] * 10)).tolist()) == {0}  # 0 left the 10-id window
    strict = [SamplingParams(win_size=10, tau_r=0.2)] * n  # needs 2 repeats
    two = pack(strict, histories=[[0, 0]] * n, steps=list(range(n)), seeds=[3] * n)
    one = pack(strict, histories=[[0, 5]] * n, steps=list(range(n)), seeds=[3] * n)
    assert 0 not in bs.sample_rows(x, two).tolist() and set(bs.sample_rows(x, one).tolist()) == {0}


def test_greedy_top_k_top_p_and_min_len_rows_side_by_side():
    logp = random_logp(3, seed=1)
    params = [SamplingParams(method="greedy"), SamplingParams(method="top_k_top_p", top_k=3, top_p=1.0, temperature=3.0),
              SamplingParams(method="greedy")]
    stop = torch.zeros(V, dtype=torch.bool)
    stop[logp[2].argmax()] = True  # row 2's best id is a "stop id" it may not pick yet
    rows = pack(params, masked=[False, False, True])
    ids = bs.sample_rows(bs.mask_min_len(logp, rows, stop), rows)
    assert ids[0] == logp[0].argmax() and ids[2] == logp[2].topk(2).indices[1]
    top3 = set(logp[1].topk(3).indices.tolist())
    many = pack([params[1]] * 500, steps=list(range(500)), seeds=[0] * 500)
    picks = bs.sample_rows(logp[1:2].expand(500, -1).contiguous(), many).tolist()
    assert set(picks) == top3  # all of the top-3 and nothing else


def test_seeded_rows_do_not_depend_on_batch_composition():
    logp = random_logp(8, seed=4, sharp=1.0)
    params = [SamplingParams(seed=s) for s in range(8)]
    hists = [[i, i + 1] for i in range(8)]
    full = bs.sample_rows(logp, pack(params, hists, [5] * 8, list(range(100, 108)))).tolist()
    for order in ([3], [7, 0, 5], [6, 5, 4, 3, 2, 1, 0]):
        sub = bs.sample_rows(logp[order], pack([params[i] for i in order], [hists[i] for i in order], [5] * len(order),
                                               [100 + i for i in order])).tolist()
        assert sub == [full[i] for i in order]
    # another step or seed gives other draws
    later = bs.sample_rows(logp, pack(params, hists, [6] * 8, list(range(100, 108)))).tolist()
    assert later != full


def test_pack_rows_layout_and_window_check():
    arr = bs.pack_rows([SamplingParams(top_k=7, top_p=0.5, win_size=4)], [[1, 2, 3]], [4], [9], [True], width=5)
    assert arr.shape == (1, bs.num_cols(5))
    assert arr[0, bs.C_HIST:].tolist() == [-1, -1, 1, 2, 3]
    assert arr[0, [bs.C_METHOD, bs.C_TOPK, bs.C_WIN, bs.C_REPMIN, bs.C_MINLEN]].tolist() == [bs.RAS, 7, 4, 1, 1]
    assert np.int32(arr[0, bs.C_TOPP]).view(np.float32) == np.float32(0.5)
    assert np.int32(arr[0, bs.C_U0]).view(np.float32) == bs.counter_uniforms([9], [8])[0]
    with pytest.raises(ValueError):
        bs.pack_rows([SamplingParams(win_size=20)], [[]], [0], [0], [False], width=16)


def test_a_row_with_nothing_to_draw_gets_an_index_in_range():
    """All-zero or NaN weights (a zero-filled row: temperature 0) drew -1, which a gather inside a
    CUDA graph turns into a device-side assert (H100 2026-12-07, the compiled decode step's warm-up)."""
    weights = torch.zeros(3, 5)
    weights[1, 2] = 1.0
    weights[2] = float("nan")
    assert bs.inverse_cdf(weights, torch.full((3,), 0.5)).tolist() == [0, 2, 0]
    zero_rows = torch.zeros(2, pack([SamplingParams()]).shape[1], dtype=torch.long)  # temperature 0, top_k 0
    ids = bs.choose_ids(random_logp(2), zero_rows, torch.zeros(V, dtype=torch.bool))
    assert ((ids >= 0) & (ids < V)).all()
