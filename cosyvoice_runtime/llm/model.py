"""The speech-token LM: a Qwen2 decoder used over input embeddings, plus speech tables.

Module tree (= the official ``llm.pt`` keys, spec §3.10)::

    SpeechLM
      llm: Qwen2Encoder
        model: Qwen2ForCausalLM
          model: Qwen2Model      embed_tokens, layers.{i}.{self_attn,mlp,*_layernorm}, norm
          lm_head                text head, unused; tied to embed_tokens when configured
      llm_embedding              CV2 only: rows sos, task_id
      speech_embedding           S + 3 (CV2) / S + 200 (CV3) rows
      llm_decoder                Linear H -> S + 3 (bias, CV2) / S + 200 (no bias, CV3)

Attention is causal over (cached positions + new tokens) with per-sequence positions, so the
same forward serves a one-sequence prefill and one decode step for a batch of sequences of
different lengths (see :class:`~cosyvoice_runtime.llm.kv_cache.KVCache`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_runtime.config import LLMSpec, Qwen2Spec
from cosyvoice_runtime.fused import fused_linear
from cosyvoice_runtime.kernels import add_rms_norm
from cosyvoice_runtime.llm.kv_cache import KVCache


class RMSNorm(nn.Module):
    """Qwen2 RMSNorm through ``F.rms_norm``: statistics in float32.

    HF's Qwen2 casts the normalised value back to the input dtype before the gain; the fused
    kernel applies the gain in float32 and rounds once. Equal in float32 (tested against the
    official composite), within one bf16 ulp in bf16. Why: on CUDA it is one kernel where the
    composite is eight, and 49 norms were ~40 % of a decode step's ~1,000 kernel-launching ops
    (aten ops of the full-size spec counted with the profiler on the CPU; with the fused q/k/v
    below, ~550 remain). Its own gain was not timed apart; what a decode step's kernels cost on a
    GPU, with the fused add + norm of :class:`Qwen2Model` on and off: docs/tuning.md, ``fused_norms``.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE; cos/sin computed in float32 from absolute positions.

    HF applies it as ``x·cos + rotate_half(x)·sin`` with ``rotate_half(x) = cat(-x2, x1)``: a
    negation, a concatenation, two products and a sum, per layer. ``rotate_half(x)`` is
    ``roll(x, half)`` with its first half negated, so with that sign folded into ``sin`` once per
    forward (:meth:`forward` returns it so) each layer runs a product, a roll and one fused
    multiply-add (:func:`apply_rotary`): two kernels fewer per layer of a launch-bound decode step.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) long -> cos, signed sin (B, 1, T, head_dim): sin with its first half
        negated (:func:`apply_rotary`)."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[..., :freqs.shape[-1]].neg_()
        return emb.cos().to(dtype)[:, None], sin.to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``x·cos + rotate_half(x)·sin`` as ``x·cos + roll(x, half)·signed_sin`` (:class:`RotaryEmbedding`);
    ``out`` may be ``x`` itself (both products are taken before it is written)."""
    if out is not None and torch.compiler.is_compiling():
        # Dynamo cannot trace out= here (a graph break in every layer: 24 per decode step, each
        # resume a recompile, and a replica with the compiled step never finished starting);
        # compiled, the copy into ``out`` is fused with the rotation anyway.
        return out.copy_(torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin))
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin, out=out)


class Qwen2Attention(nn.Module):
    """GQA self-attention with q/k/v biases (no bias on o_proj)."""

    def __init__(self, spec: Qwen2Spec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=True)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=True)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=True)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=False)
        self._fused: dict = {}  # q/k/v as one weight (cosyvoice_runtime.fused; checkpoint keys unchanged)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, attn: _AttnContext) -> torch.Tensor:
        """x (B, T, H) -> (B, T, H); cos and signed sin from :class:`RotaryEmbedding`."""
        b, t, _ = x.shape
        nq, nkv = self.num_heads, self.num_kv_heads
        # One GEMM for q, k and v, and one rotation for q and k together: 4 kernels fewer per layer
        # than three projections and two rotations (launch-bound decode steps).
        qkv = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj), self._fused)
        qkv = qkv.view(b, t, nq + 2 * nkv, self.head_dim).transpose(1, 2)
        # q and k rotated in place, so that the new keys and values stay side by side in qkv and
        # reach the cache in one write (one kernel per layer fewer than a write each).
        qk = qkv[:, : nq + nkv]
        apply_rotary(qk, cos, signed_sin, out=qk)
        q, kv = qkv[:, :nq], qkv[:, nq:].unflatten(1, (2, nkv))  # kv: (B, 2, kv heads, T, d)
        if attn.cache is not None:
            k, v = attn.store(kv)
        else:
            k, v = kv[:, 0], kv[:, 1]
        group = self.num_heads // self.num_kv_heads
        # Query head j uses kv head j // group: fold the group into the query-length axis so the
        # kv heads are never repeated in memory. Row g*T + t of the folded query is (g, t).
        q = q.reshape(b, self.num_kv_heads, group * t, self.head_dim)
        if attn.mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True) if group == 1 else \
                F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(t, x.device).repeat(group, 1))
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn.bias)
        out = out.reshape(b, self.num_heads, t, self.head_dim).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


KEY_BUCKET = 64  # granularity of the attended key window when decoding with a cache


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _causal(t: int, device) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


class _AttnContext:
    """What every layer of one forward shares: cache, slots, positions, key mask."""

    def __init__(self, cache: KVCache | None, slots: list[int] | None, positions: torch.Tensor,
                 mask: torch.Tensor | None, slot_index: torch.Tensor | None, total: int = 0,
                 fresh: bool = False) -> None:
        self.cache, self.slots, self.positions, self.mask, self.slot_index = cache, slots, positions, mask, slot_index
        self.total = total
        self.fresh = fresh  # tensor-only prefill of empty slots: keys are written from position 0
        self.layer = 0
        self.bias: torch.Tensor | None = None  # the mask as attention takes it (fold_mask)

    def fold_mask(self, group: int, dtype: torch.dtype) -> None:
        """``bias``: the key mask as an additive bias (0 visible, -inf hidden) repeated for the
        query rows of a kv head's group, built once per forward before the layers (every layer
        shares it; built lazily by the first layer, it made dynamo recompile the compiled step).
        Given the boolean mask, attention turned it into that bias in every layer: three kernels
        per layer of a decode step. Every row sees at least key 0, so no
        row is all -inf."""
        if self.mask is not None:
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self.bias = bias.masked_fill_(~self.mask, float("-inf")).repeat(1, 1, group, 1)

    def store(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new keys/values (B, 2, kv heads, T, d) into the cache; return the
        attended keys and values."""
        if self.fresh:  # tensor-only prefill (CUDA-graph capturable): attend to its own keys only
            return self.cache.write_prefix(self.layer, self.slot_index, kv)
        if self.slots is None:  # tensor-only decode step (CUDA-graph capturable)
            return self.cache.write_at(self.layer, self.slot_index, self.positions[:, 0], kv, self.total)
        return self.cache.write(self.layer, self.slots, self.slot_index, self.positions, kv, self.total)


class Qwen2MLP(nn.Module):
    def __init__(self, spec: Qwen2Spec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self._fused: dict = {}  # gate/up as one weight (cosyvoice_runtime.fused; checkpoint keys unchanged)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up as one GEMM: a kernel fewer per layer in a launch-bound decode step (its
        # kernel count: docs/tuning.md §1)
        gate, up = fused_linear(x, (self.gate_proj, self.up_proj), self._fused).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Qwen2DecoderLayer(nn.Module):
    """One layer's modules; :meth:`Qwen2Model._layers` runs them (HF's ``x + attn(norm(x))``, then
    ``x + mlp(norm(x))``, with each residual add joined to the norm that follows it)."""

    def __init__(self, spec: Qwen2Spec) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(spec)
        self.mlp = Qwen2MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Qwen2Model(nn.Module):
    """Embedding table, decoder layers and final norm (HF ``Qwen2Model`` key layout)."""

    def __init__(self, spec: Qwen2Spec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(spec.head_dim, spec.rope_theta)
        # Each residual add and the RMSNorm after it as one Triton kernel where one can run
        # (cosyvoice_runtime.kernels.add_rms_norm: 48 kernels fewer of a decode step's 521);
        # chosen through SpeechLM.use_fused_norms (the engine's fused_norms argument).
        self.fused_norms = False

    def forward(self, inputs_embeds: torch.Tensor, cache: KVCache | None = None,
                slots: list[int] | None = None) -> torch.Tensor:
        """Run new input embeddings through the decoder.

        Args:
            inputs_embeds: (B, T, H). Without a cache: B full sequences, positions 0..T-1,
                causal attention. With a cache: T new tokens for each of the B ``slots``, at
                positions ``cache.lengths[slot] + 0..T-1``, attending causally to the slot's
                cached positions and to each other; the cache is written in place and the
                slots' lengths advance by T.
            slots: one KV slot per batch row (required with a cache).

        Returns:
            (B, T, H) final-norm hidden states.
        """
        b, t, _ = inputs_embeds.shape
        device = inputs_embeds.device
        steps = torch.arange(t, device=device)
        if cache is None:
            positions = steps.expand(b, t)
            attn = _AttnContext(None, None, positions, None, None)
        else:
            if slots is None or len(slots) != b:
                raise ValueError(f"need one KV slot per batch row, got {slots} for batch {b}")
            cache.check_room(slots, t)
            past = torch.tensor([cache.lengths[s] for s in slots], device=device)
            positions = past[:, None] + steps
            # NOTE the key window is rounded up to a bucket so that attention sees few distinct
            # shapes (cuDNN attention builds a plan per shape); the extra keys are masked.
            total = min(_round_up(max(cache.lengths[s] for s in slots) + t, KEY_BUCKET), cache.max_len)
            # Key j is visible to the query at absolute position p iff j <= p: causal over
            # cache + new, and stale positions beyond a shorter sequence's end are hidden.
            mask = (torch.arange(total, device=device)[None, None, :] <= positions[:, :, None])[:, None]
            slot_index = torch.tensor(slots, device=device) if b > 1 else None
            attn = _AttnContext(cache, list(slots), positions, mask, slot_index, total)
        hidden = self._layers(inputs_embeds, attn)
        if cache is not None:
            cache.advance(slots, t)
        return hidden

    @torch.no_grad()  # inference only: attention rotates q and k in place (out= takes no gradient)
    def _layers(self, x: torch.Tensor, attn: _AttnContext) -> torch.Tensor:
        """(B, T, H) embeddings through every decoder layer at ``attn.positions``, then the final norm."""
        cos, sin = self.rotary_emb(attn.positions, x.dtype)
        attn.fold_mask(self.spec.num_heads // self.spec.num_kv_heads, x.dtype)
        # x + attn(input_norm(x)), then x + mlp(post_norm(x)) per layer, each residual add taken
        # with the norm that follows it (the next layer's input norm, the final norm after the last)
        normed = self.layers[0].input_layernorm(x)
        for i, layer in enumerate(self.layers):
            attn.layer = i
            post = layer.post_attention_layernorm
            x, normed = add_rms_norm(x, layer.self_attn(normed, cos, sin, attn), post.weight, post.eps,
                                     fused=self.fused_norms)
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, normed = add_rms_norm(x, layer.mlp(normed), after.weight, after.eps, fused=self.fused_norms)
        return normed

    def decode_static(self, inputs_embeds: torch.Tensor, cache: KVCache, slot_index: torch.Tensor,
                      positions: torch.Tensor, window: int) -> torch.Tensor:
        """One decode step from tensors only (the computation a CUDA graph captures).

        Args:
            inputs_embeds: (B, H) one new embedding per row.
            slot_index: (B,) long KV slot of each row; padding rows point at a scratch slot.
            positions: (B,) long position of each new token (= the slot's current length).
            window: attended key positions, > every position of the batch, <= ``cache.max_len``.

        Returns:
            (B, H) final-norm hidden. The cache is written at (slot, position) per row; the
            host-side ``cache.lengths`` are NOT advanced (the caller owns them).
        """
        pos = positions[:, None]
        keys = torch.arange(window, device=inputs_embeds.device)
        mask = (keys[None, None, :] <= pos[:, :, None])[:, None]  # (B, 1, 1, window)
        attn = _AttnContext(cache, None, pos, mask, slot_index, window)
        return self._layers(inputs_embeds[:, None], attn)[:, 0]

    def prefill_static(self, inputs_embeds: torch.Tensor, cache: KVCache, slot_index: torch.Tensor) -> torch.Tensor:
        """The prompts of empty slots from tensors only (what a prefill CUDA graph captures).

        Args:
            inputs_embeds: (B, T, H), right-padded; row b goes to slot ``slot_index[b]`` at
                positions 0..T-1 (padding rows point at a scratch slot).

        Returns:
            (B, T, H) final-norm hidden. Causal attention keeps every valid position blind to
            the padding after it; the caller sets ``cache.lengths`` (the padded keys past a
            row's end are overwritten by its next tokens, as in :meth:`forward`).
        """
        b, t, _ = inputs_embeds.shape
        pos = torch.arange(t, device=inputs_embeds.device).expand(b, t)
        return self._layers(inputs_embeds, _AttnContext(cache, None, pos, None, slot_index, t, fresh=True))


class Qwen2ForCausalLM(nn.Module):
    """Body + text LM head (the head is only there so that ``llm.pt`` loads strictly)."""

    def __init__(self, spec: Qwen2Spec) -> None:
        super().__init__()
        self.model = Qwen2Model(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class Qwen2Encoder(nn.Module):
    """The official ``Qwen2Encoder`` wrapper level (key prefix ``llm.``)."""

    def __init__(self, spec: Qwen2Spec) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(spec)


class SpeechLM(nn.Module):
    """``Qwen2LM`` (CV2) / ``CosyVoice3LM`` (CV3) inference module.

    Special ids come from :class:`LLMSpec` (``sos``, ``task_id``, ``eos``, ``fill``,
    ``stop_ids``); CV2 keeps sos/task_id in the separate 2-row ``llm_embedding``.
    """

    def __init__(self, spec: LLMSpec) -> None:
        super().__init__()
        backbone = spec.backbone
        if spec.llm_input_size != backbone.hidden_size or spec.llm_output_size != backbone.hidden_size:
            raise ValueError(f"llm_input/output_size {spec.llm_input_size}/{spec.llm_output_size} "
                             f"!= Qwen2 hidden_size {backbone.hidden_size}")
        self.spec = spec
        self.llm = Qwen2Encoder(backbone)
        if spec.family == "cosyvoice2":
            self.llm_embedding = nn.Embedding(2, spec.llm_input_size)
        self.speech_embedding = nn.Embedding(spec.vocab_out, spec.llm_input_size)
        self.llm_decoder = nn.Linear(spec.llm_output_size, spec.vocab_out, bias=spec.decoder_bias)

    @property
    def backbone(self) -> Qwen2Model:
        return self.llm.model.model

    @property
    def backbone_spec(self) -> Qwen2Spec:
        return self.spec.backbone

    def use_fused_norms(self, on: bool) -> None:
        """Each residual add and the RMSNorm after it as one Triton kernel (where one can run)
        or as PyTorch's ops; choose before a step is traced or captured."""
        self.backbone.fused_norms = bool(on)

    # -- embeddings ------------------------------------------------------------------------
    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Text ids (..., T) -> (..., T, H) from the Qwen2 input table."""
        return self.backbone.embed_tokens(ids.long())

    def embed_speech(self, ids: torch.Tensor) -> torch.Tensor:
        """Speech ids (..., T) -> (..., T, H); also the fed-back embedding of generated ids."""
        return self.speech_embedding(ids.long())

    def _special_row(self, cv2_row: int, cv3_id: int) -> torch.Tensor:
        if self.spec.family == "cosyvoice2":
            return self.llm_embedding.weight[cv2_row]
        return self.speech_embedding.weight[cv3_id]

    def sos_embedding(self) -> torch.Tensor:
        """(H,) start-of-sequence input."""
        return self._special_row(self.spec.sos, self.spec.sos)

    def task_id_embedding(self) -> torch.Tensor:
        """(H,) end-of-text / start-of-speech input."""
        return self._special_row(self.spec.task_id, self.spec.task_id)

    # -- network ---------------------------------------------------------------------------
    def forward(self, inputs_embeds: torch.Tensor, cache: KVCache | None = None,
                slots: list[int] | None = None) -> torch.Tensor:
        """(B, T, H) input embeddings -> (B, T, H) final-norm hidden (see ``Qwen2Model``)."""
        return self.backbone(inputs_embeds, cache=cache, slots=slots)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., vocab_out) speech logits (before log-softmax)."""
        return self.llm_decoder(hidden)

    def prefill(self, lm_input: torch.Tensor, cache: KVCache, slot: int) -> torch.Tensor:
        """Append T input embeddings (T, H) to one slot; returns the last position's hidden (H,)."""
        return self.forward(lm_input[None], cache=cache, slots=[slot])[0, -1]

    def prefill_batch(self, lm_inputs: list[torch.Tensor], cache: KVCache, slots: list[int]) -> torch.Tensor:
        """:meth:`prefill` of several requests as one forward; returns (B, H) last hidden states.

        The inputs are right-padded to the longest. Causal attention keeps padding out of every
        valid position (a query at p sees keys <= p), and each slot's length is set back to its
        own end afterwards, so the padded keys written past it are overwritten by its next
        tokens. One forward instead of one per request: a prefill of the benchmark's prompt is
        ~600 launch-bound kernels, the same count for 1 or 16 rows.
        """
        if len(lm_inputs) == 1:
            return self.prefill(lm_inputs[0], cache, slots[0])[None]
        lengths = [int(x.shape[0]) for x in lm_inputs]
        past = [cache.lengths[s] for s in slots]
        x = lm_inputs[0].new_zeros(len(lm_inputs), max(lengths), lm_inputs[0].shape[1])
        for i, inp in enumerate(lm_inputs):
            x[i, : lengths[i]] = inp
        hidden = self.forward(x, cache=cache, slots=slots)
        for s, p, n in zip(slots, past, lengths):
            cache.lengths[s] = p + n
        last = torch.tensor([n - 1 for n in lengths], device=hidden.device)
        return hidden[torch.arange(len(lengths), device=hidden.device), last]

    def decode(self, inputs_embeds: torch.Tensor, cache: KVCache, slots: list[int]) -> torch.Tensor:
        """One step for a batch: (B, H) one new embedding per slot -> (B, H) hidden."""
        return self.forward(inputs_embeds[:, None], cache=cache, slots=slots)[:, 0]

    def decode_static(self, tokens: torch.Tensor, cache: KVCache, slot_index: torch.Tensor, positions: torch.Tensor,
                      window: int) -> torch.Tensor:
        """Fed speech ids (B,) -> (B, vocab_out) logits, tensors only (see ``Qwen2Model.decode_static``)."""
        hidden = self.backbone.decode_static(self.embed_speech(tokens), cache, slot_index, positions, window)
        return self.logits(hidden)


def build_llm(spec: LLMSpec) -> SpeechLM:
    """The LLM module for ``spec`` (random init; load ``llm.pt`` with ``weights.load_checkpoint``)."""
    return SpeechLM(spec)
