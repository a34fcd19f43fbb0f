"""Unit behaviour of the flow pieces: chunk masks, per-item mask selection, head-0-only rotary,
chunk causality of both estimators (the streaming guarantee of spec §4.8), input errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.flow.dit import rotary_tables, rotate_
from cosyvoice_runtime.flow.flow import FlowItem, build_flow
from cosyvoice_runtime.flow.masks import attention_mask, chunk_mask
from tests.runtime.test_flow_batch import _flow


def test_chunk_mask_counts_chunks_from_position_zero():
    m = chunk_mask(5, 2, torch.device("cpu"))
    expected = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(m, expected.bool())


def test_attention_mask_per_item_flags():
    pad = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)[:, None]
    chunked = attention_mask(pad, 2, True)
    full = attention_mask(pad, 2, False)
    mixed = attention_mask(pad, 2, torch.tensor([True, False]))
    assert torch.equal(mixed[0], chunked[0]) and torch.equal(mixed[1], full[1])
    # padded keys are never attended from a valid query
    assert not full[1, :3, 3:].any() and full[1, :3, :3].all()


def test_rotary_touches_only_the_first_head():
    """[quirk] rotary on the (B, T, heads*dim_head) projection rotates head 0 only, in pairs."""
    heads, dim_head, t = 3, 4, 6
    x = torch.randn(1, t, heads * dim_head)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim_head, 2).float() / dim_head))
    freqs = torch.outer(torch.arange(t).float(), inv_freq)
    freqs = torch.stack((freqs, freqs), dim=-1).flatten(-2)[None]
    y = rotate_(x.clone(), *rotary_tables(freqs))
    assert torch.equal(y[..., dim_head:], x[..., dim_head:])
    assert torch.allclose(y[:, 0], x[:, 0])  # position 0: angle 0
    # pair (0, 1) at position 1 rotates by inv_freq[0] = 1 rad
    c, s = torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))
    a, b = x[0, 1, 0], x[0, 1, 1]
    torch.testing.assert_close(y[0, 1, :2], torch.stack([a * c - b * s, b * c + a * s]))
    # norms per pair are preserved
    torch.testing.assert_close(y[..., :dim_head].norm(dim=-1), x[..., :dim_head].norm(dim=-1))


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_estimator_chunks_do_not_see_the_future(family):
    """With chunk masks, frames of a completed chunk do not depend on any later frame."""
    est = _flow(family).decoder.estimator
    chunk = est.spec.static_chunk_size
    g = torch.Generator().manual_seed(0)
    b, t = 2, 2 * chunk + 17
    args = [torch.randn(b, 80, t, generator=g), torch.ones(b, 1, t), torch.randn(b, 80, t, generator=g),
            torch.rand(b, generator=g), torch.randn(b, 80, generator=g), torch.randn(b, 80, t, generator=g)]
    changed = [a.clone() for a in args]
    for i in (0, 2, 5):  # x, mu, cond after the first chunk
        changed[i][:, :, chunk:] = torch.randn(b, 80, t - chunk, generator=g)
    with torch.inference_mode():
        ref = est(*args, streaming=True)
        out = est(*changed, streaming=True)
        full = est(*changed, streaming=False)
    torch.testing.assert_close(out[..., :chunk], ref[..., :chunk], rtol=0, atol=1e-5)
    assert (out[..., chunk:] - ref[..., chunk:]).abs().max() > 1e-3
    # full attention does see the future
    assert (full[..., :chunk] - ref[..., :chunk]).abs().max() > 1e-3


def _job(flow, n_prompt, n_tokens, finalize=True):
    return FlowItem(torch.zeros(1, n_tokens, dtype=torch.int32), torch.zeros(1, n_prompt, dtype=torch.int32),
                    torch.zeros(1, 2 * n_prompt, 80), torch.ones(1, flow.spec.spk_embed_dim), False, finalize)


def test_input_errors():
    flow = _flow("cosyvoice3")
    with pytest.raises(InvalidInputError, match="look-ahead"):
        flow.inference_batch([_job(flow, 0, 3, finalize=False)])
    assert flow.inference_batch([]) == []
    short = build_flow(dataclasses.replace(flow.spec, noise_frames=100))
    short.load_state_dict(flow.state_dict())
    with pytest.raises(InvalidInputError, match="noise buffer"):
        short.inference_batch([_job(short, 10, 41)])  # 2 * 51 = 102 frames > 100
    assert short.inference_batch([_job(short, 10, 40)])[0].shape == (1, 80, 80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_rotate_exactly_as_the_pairwise_formula(dtype):
    """rotate_() with rotary_tables (cos and a signed sin made once per forward) equals the
    pairwise form x * cos + (-x2, x1) * sin bit for bit: the signed sin's negation rounds nothing.
    It turns x in place, also where x is a slice of a wider tensor (q and k in one projection)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 24, generator=g).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    freqs = torch.outer(torch.arange(9).float() + 37.0, inv_freq)
    freqs = torch.stack((freqs, freqs), dim=-1).flatten(-2)[None]
    head = x[..., :8].float()
    x1, x2 = head.unflatten(-1, (-1, 2)).unbind(-1)
    pairwise = head * freqs.cos() + torch.stack((-x2, x1), dim=-1).flatten(-2) * freqs.sin()
    want = torch.cat((pairwise.to(dtype), x[..., 8:]), dim=-1)
    y = x.clone()
    assert rotate_(y, *rotary_tables(freqs)) is y and torch.equal(y, want)
    qk = torch.stack((x, 2 * x), dim=-2)  # (2, 9, 2, 24): two projections side by side
    wider = torch.cat((qk, x[..., None, :]), dim=-2)  # a third one after them stays untouched
    rotate_(wider[..., :2, :], *(table[..., None, :] for table in rotary_tables(freqs)))
    assert torch.equal(wider[..., 0, :], want) and torch.equal(wider[..., 2, :], x)
    head2 = (2 * x)[..., :8].float()
    y1, y2 = head2.unflatten(-1, (-1, 2)).unbind(-1)
    want2 = (head2 * freqs.cos() + torch.stack((-y2, y1), dim=-1).flatten(-2) * freqs.sin()).to(dtype)
    assert torch.equal(wider[..., 1, :8], want2) and torch.equal(wider[..., 1, 8:], (2 * x)[..., 8:])
