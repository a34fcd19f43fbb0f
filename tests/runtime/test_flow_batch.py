"""Batched flow inference (spec §6.2 C): jobs of different requests in ONE CFM solve give, per
item, the mel the item gets alone (right padding, per-item masks, CV2 re-zeroing after
``embed``, context tokens of non-final items, per-item noise / cond / spks, per-item streaming
vs full attention)."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from cosyvoice_runtime.flow.flow import Flow, FlowItem, build_flow
from cosyvoice_runtime.weights import load_checkpoint
from cosyvoice_runtime.yaml_config import read_model_spec
from tests.runtime.parity.common import parity_dir

BATCH_TOL = 1e-4
FAMILIES = ["cosyvoice2", "cosyvoice3"]
# Batching exactness does not depend on the number of Euler steps; fewer keep the test fast.
TEST_STEPS = 3


@functools.lru_cache(maxsize=2)
def _flow(family: str) -> Flow:
    model_dir = parity_dir() / family / "model"
    spec = read_model_spec(model_dir)
    flow = build_flow(dataclasses.replace(spec.flow, n_timesteps=TEST_STEPS))
    load_checkpoint(flow, model_dir / spec.files["flow"])
    return flow.eval()


def _item(gen: torch.Generator, flow: Flow, n_prompt: int, n_tokens: int, streaming: bool, finalize: bool) -> FlowItem:
    spec = flow.spec
    ratio = spec.token_mel_ratio
    return FlowItem(
        token=torch.randint(0, spec.vocab_size, (1, n_tokens), generator=gen, dtype=torch.int32),
        prompt_token=torch.randint(0, spec.vocab_size, (1, n_prompt), generator=gen, dtype=torch.int32),
        prompt_feat=torch.randn(1, ratio * n_prompt, spec.output_size, generator=gen),
        embedding=torch.randn(1, spec.spk_embed_dim, generator=gen),
        streaming=streaming,
        finalize=finalize,
    )


# (prompt tokens, tokens, streaming, finalize): lengths differ so every item but the longest
# is right-padded; non-final items carry 3 context tokens; streaming and offline items mix.
JOBS = [
    (20, 40, True, False),
    (13, 9, False, True),
    (25, 30, True, True),
    (7, 52, False, True),
    (11, 28, True, False),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_unbatched(family):
    flow = _flow(family)
    gen = torch.Generator().manual_seed(7)
    items = [_item(gen, flow, *job) for job in JOBS]
    alone = [flow.inference_batch([it])[0] for it in items]
    together = flow.inference_batch(items)
    la, ratio = flow.spec.pre_lookahead_len, flow.spec.token_mel_ratio
    for (n_prompt, n_tokens, _, finalize), a, b in zip(JOBS, alone, together):
        expected_frames = ratio * (n_tokens - (0 if finalize else la))
        assert a.shape == b.shape == (1, flow.spec.output_size, expected_frames)
        assert a.dtype == b.dtype == torch.float32
        err = (a - b).abs().max().item()
        assert err <= BATCH_TOL, f"{family} job {(n_prompt, n_tokens, finalize)}: batched vs alone max err {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_single_item_batch_is_inference(family):
    """``inference`` is the one-item batch, and the context tokens only shape the look-ahead."""
    flow = _flow(family)
    gen = torch.Generator().manual_seed(3)
    it = _item(gen, flow, 20, 40, streaming=True, finalize=False)
    mel = flow.inference(it.token, it.prompt_token, it.prompt_feat, it.embedding, streaming=True, finalize=False)
    torch.testing.assert_close(mel, flow.inference_batch([it])[0], rtol=0, atol=0)
    # Changing a context token changes the last frames (look-ahead) but leaves early ones alone.
    other = FlowItem(it.token.clone(), it.prompt_token, it.prompt_feat, it.embedding, True, False)
    other.token[0, -1] = (int(other.token[0, -1]) + 1) % flow.spec.vocab_size
    mel2 = flow.inference_batch([other])[0]
    assert mel2.shape == mel.shape
    assert not torch.allclose(mel2[..., -4:], mel[..., -4:], atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_streaming_flag_is_per_item(family):
    """The same job in one batch, once with chunk masks and once with full attention: each row
    equals its own single-item result, and the two differ (the masks really are per item)."""
    flow = _flow(family)
    gen = torch.Generator().manual_seed(11)
    base = _item(gen, flow, 20, 60, streaming=True, finalize=True)
    full = FlowItem(base.token, base.prompt_token, base.prompt_feat, base.embedding, False, True)
    both = flow.inference_batch([base, full])
    for got, it in zip(both, [base, full]):
        assert (got - flow.inference_batch([it])[0]).abs().max().item() <= BATCH_TOL
    assert (both[0] - both[1]).abs().max().item() > 1e-3
