"""Qwen2 backbone + KV cache: incremental decoding equals the full causal forward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cosyvoice_runtime.config import LLMSpec, Qwen2Spec
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.model import RotaryEmbedding, _AttnContext, apply_rotary, build_llm


def tiny(num_heads=4, num_kv_heads=2, family="cosyvoice2", tie=True):
    torch.manual_seed(0)
    backbone = Qwen2Spec(hidden_size=32, num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         intermediate_size=48, vocab_size=64, rms_norm_eps=1e-6, rope_theta=1e6,
                         tie_word_embeddings=tie)
    return build_llm(LLMSpec(family=family, backbone=backbone, speech_token_size=30, llm_input_size=32,
                             llm_output_size=32)).eval()


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)])
def test_prefill_plus_decode_equals_full_forward(heads):
    model = tiny(*heads)
    x = torch.randn(1, 20, 32)
    with torch.inference_mode():
        full = model(x)[0]
        cache = KVCache.for_model(model, 2, 32)
        parts = [model.forward(x[:, :7], cache, [1])[0], model.forward(x[:, 7:12], cache, [1])[0]]
        parts += [model.decode(x[0, i:i + 1], cache, [1]) for i in range(12, 20)]
    assert cache.lengths == [0, 20]
    assert (torch.cat(parts) - full).abs().max() < 1e-5


def test_batched_decode_of_sequences_at_different_lengths():
    model = tiny()
    seqs = [torch.randn(n, 32) for n in (3, 11, 6)]
    nxt = torch.randn(3, 32)
    with torch.inference_mode():
        cache = KVCache.for_model(model, 4, 16)
        slots = [2, 0, 3]
        for s, x in zip(slots, seqs):
            model.prefill(x, cache, s)
        batched = model.decode(nxt, cache, slots)
        for i, x in enumerate(seqs):
            alone = model(torch.cat([x, nxt[i:i + 1]])[None])[0, -1]
            assert (batched[i] - alone).abs().max() < 1e-5
    assert [cache.lengths[s] for s in slots] == [4, 12, 7]


def test_cache_overflow_is_refused_and_reset_reuses_a_slot():
    model = tiny()
    cache = KVCache.for_model(model, 1, 8)
    with torch.inference_mode():
        model.prefill(torch.randn(8, 32), cache, 0)
        with pytest.raises(ValueError):
            model.decode(torch.randn(1, 32), cache, [0])
        cache.reset(0)
        x = torch.randn(5, 32)
        assert (model.prefill(x, cache, 0) - model(x[None])[0, -1]).abs().max() < 1e-5


def test_keys_tied_head_and_special_rows():
    cv2, cv3 = tiny(family="cosyvoice2"), tiny(family="cosyvoice3")
    k2, k3 = set(cv2.state_dict()), set(cv3.state_dict())
    assert {"llm_embedding.weight", "llm_decoder.bias"} <= k2 and not {"llm_embedding.weight", "llm_decoder.bias"} & k3
    assert "llm.model.lm_head.weight" in k2 and "llm.model.model.layers.1.self_attn.q_proj.bias" in k2
    assert "llm.model.model.layers.0.self_attn.o_proj.bias" not in k2
    assert cv2.llm.model.lm_head.weight is cv2.backbone.embed_tokens.weight
    assert tiny(tie=False).llm.model.lm_head.weight is not tiny(tie=False).backbone.embed_tokens.weight
    assert cv2.speech_embedding.num_embeddings == 33 and cv3.speech_embedding.num_embeddings == 230
    assert torch.equal(cv2.sos_embedding(), cv2.llm_embedding.weight[0])
    assert torch.equal(cv2.task_id_embedding(), cv2.llm_embedding.weight[1])
    assert torch.equal(cv3.sos_embedding(), cv3.speech_embedding.weight[30])
    assert torch.equal(cv3.task_id_embedding(), cv3.speech_embedding.weight[32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_official_composite(dtype):
    """HF Qwen2RMSNorm (fp32 statistics, cast back, then the gain) against the fused F.rms_norm:
    equal in float32, within one bf16 ulp in bf16."""
    from cosyvoice_runtime.llm.model import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(896, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(896, generator=g) + 0.5)
    norm = norm.to(dtype).requires_grad_(False)
    x = (torch.randn(8, 5, 896, generator=g) * 3).to(dtype)
    h = x.float()
    official = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = norm(x)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, official, atol=1e-6, rtol=1e-6)
    else:
        ulp = 2.0 ** -7  # bf16 has 8 significand bits
        assert float(((got.float() - official.float()).abs() / official.float().abs().clamp_min(1e-2)).max()) <= ulp


def test_fused_qkv_follows_new_weights_and_dtype():
    """The concatenated q/k/v weight is rebuilt when the projections change (a checkpoint loaded
    after a first forward, a dtype cast), so the model always computes with its current weights."""
    model, other = tiny(), tiny()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(1, 7, 32)
    with torch.inference_mode():
        before = model(x)
        model.load_state_dict(other.state_dict())
        after, want = model(x), other(x)
        assert not torch.allclose(before, after)
        torch.testing.assert_close(after, want, atol=0, rtol=0)
        model.to(torch.float64)
        other.to(torch.float64)
        torch.testing.assert_close(model(x.double()), other(x.double()), atol=0, rtol=0)


def test_rotary_as_a_roll_and_a_signed_sin_equals_rotate_half():
    """RoPE applied as x·cos + roll(x, half)·signed_sin (two kernels fewer per layer) is HF's
    x·cos + cat(-x2, x1)·sin: to float64 rounding in float64 (the fused multiply-add may round
    once where the composite rounds twice), within float32 rounding in float32."""
    rope = RotaryEmbedding(head_dim=16, theta=10000.0)
    positions = torch.tensor([[0, 1, 5, 300], [7, 8, 9, 2000]])
    freqs = positions.float()[..., None] * rope.inv_freq.float()  # HF's angles, in float32
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    got_cos, signed = rope(positions, torch.float32)
    assert torch.equal(got_cos, cos) and torch.equal(signed[..., 8:], sin[..., 8:])
    assert torch.equal(signed[..., :8], -sin[..., :8])
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        x = torch.randn(2, 3, 4, 16, dtype=dtype)
        c, s_, ss = cos.to(dtype), sin.to(dtype), signed.to(dtype)
        want = x * c + torch.cat((-x[..., 8:], x[..., :8]), dim=-1) * s_
        torch.testing.assert_close(apply_rotary(x, c, ss), want, atol=tol, rtol=tol)


def test_the_folded_attention_bias_gives_the_boolean_masks_attention():
    """The decode mask goes to attention as an additive bias built once per forward (attention
    converted the boolean mask in every layer, three kernels each): the same output, exactly."""
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 1, 1, 40, generator=g) > 0.4
    mask[..., 0] = True  # every row sees key 0, as the decode step's positions guarantee
    group, heads, d = 3, 2, 16
    q = torch.randn(3, heads, group, d, generator=g)
    k, v = torch.randn(3, heads, 40, d, generator=g), torch.randn(3, heads, 40, d, generator=g)
    ctx = _AttnContext(None, None, torch.zeros(3, 1, dtype=torch.long), mask, None)
    assert ctx.bias is None  # built by the forward before its layers, not lazily by the first one
    ctx.fold_mask(group, q.dtype)
    bias = ctx.bias
    assert bias.dtype == q.dtype
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(1, 1, group, 1))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=bias), want)
