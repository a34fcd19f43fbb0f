"""Incremental CosyVoice2 flow for streaming: solve only the frames past a cached boundary.

The official streaming schedule (spec §6.1) recomputes the prompt and every earlier token on each
flow call, so a late chunk of a long utterance costs a solve over the whole sequence. With chunk
attention masks the frames before an attention-chunk boundary never see a frame after it, and
everything else in the estimator is per frame or causal:

* the U-Net (:class:`~cosyvoice_runtime.flow.unet.CausalUNet`) has only causal k=3 convolutions,
  per-frame LayerNorm / Mish / 1x1 convolutions / feed-forwards, and self-attention where a query
  sees the keys of its own and earlier 50-frame chunks (:func:`~cosyvoice_runtime.flow.masks.chunk_mask`);
* the CFM solver uses the fixed noise indexed by absolute frame, one time grid for all frames,
  per-frame Euler updates and per-frame classifier-free guidance;
* the streaming encoder's output ``mu`` (and ``cond``) of frames before a boundary does not change
  when tokens are appended (chunk masks; its look-ahead tokens are real tokens in later calls).

So every estimator activation of a frame before the boundary, at every ODE step and in both CFG
rows, is the same in the next call. :class:`FlowCache` keeps what later frames read of them: for
each k=3 convolution its last two input frames, for each transformer block the normed block input
(``store="input"``, keys/values recomputed from it each call) or the keys and values themselves
(``store="kv"``, 4x the memory); one set per ODE step, both CFG rows as a batch of two. A call
solves frames ``[P, T)`` against the cache of frames ``[0, P)`` and, for a non-final call, advances
the cache to the last attention-chunk boundary at or before ``T`` (frames past it are computed
again next call, as they may see frames that do not exist yet).

Why ``"input"`` is the default: memory decides capacity. In bf16 the normed inputs are 560 KiB per
cached frame per stream (56 blocks x 256 channels x 2 rows x 10 steps x 2 bytes), keys and values
2.2 MiB: 48 streams of 20 s answers after a 3.5 s prompt (~1180 frames each) hold ~31 GiB against
~121 GiB, which does not fit next to the model on one H200. Recomputing keys/values costs one
256 -> 1024 GEMM over the cached frames per block and step: on the 2-core VM (full-size U-Net,
fp32, one thread, one pass of 100 new frames over 400 cached; a loaded machine, two runs of three)
1.5-2.7 s against 0.9-3.4 s with cached keys/values, within the noise of each other, and 9-11 s
for the full recompute of the 500 frames.

One request per call (no batch, no padding): every frame is valid, so the padding-mask products of
the full path (multiplications by exactly 1) are left out. Runs eagerly (no CUDA graphs: the cached
length changes every call). On a GPU the eager estimator is launch-bound at small shapes (docs/tuning.md:
20 ms eager against 3.7 ms graphed for 2 x 256 frames), so this path is to be timed against the graphed
recompute before it is turned on; graphs per (new frames, cached-length bucket) with masked padding
keys would be the next step.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.flow.cfm import CFMSolver, euler_update, step_schedule
from cosyvoice_runtime.flow.flow import Flow, FlowItem
from cosyvoice_runtime.flow.masks import to_bias
from cosyvoice_runtime.flow.unet import (
    CausalBlock1D,
    CausalResnetBlock1D,
    CausalUNet,
    TransformerBlock,
    sinusoidal_embedding,
)
from cosyvoice_runtime.fused import fused_linear

CACHE_STORES = ("input", "kv")
# to_k and to_v of each attention module as one weight (fused_linear's cache, per module; the
# module's own q/k/v cache serves the full path)
_KV_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class StepCache:
    """Estimator state of frames ``[0, P)`` at one ODE step, both CFG rows (batch dim 2).

    Attributes:
        convs: per k=3 causal convolution, in call order: its last ``k - 1`` input frames (2, C, 2).
        attn: per transformer block, in call order: the normed block input (2, P, C) for
            ``store="input"``, or the (keys, values) pair, each (2, heads, P, head_dim), for ``"kv"``.
    """

    convs: list[torch.Tensor] = field(default_factory=list)
    attn: list = field(default_factory=list)


@dataclass
class FlowCache:
    """Per-request incremental flow state: ``frames`` cached frames, one :class:`StepCache` per step."""

    store: str = "input"
    frames: int = 0
    steps: list[StepCache] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.store not in CACHE_STORES:
            raise ValueError(f"flow cache store must be one of {CACHE_STORES}, got {self.store!r}")

    def nbytes(self) -> int:
        """Bytes the cached tensors hold."""
        total = 0
        for step in self.steps:
            tensors = list(step.convs)
            for entry in step.attn:
                tensors += list(entry) if isinstance(entry, tuple) else [entry]
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total


class _Pass:
    """One estimator pass over new frames ``[P, P + n)``: reads the old step cache (None: no frames
    cached yet), builds the new one, keeping the first ``keep`` new frames."""

    def __init__(self, old: StepCache | None, keep: int, store: str) -> None:
        self.old, self.keep, self.store = old, keep, store
        self.new = StepCache()
        self._conv = self._attn = 0

    def conv(self, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        """A causal convolution (``CausalConv1d``) of new frames (B, C, n), left context cached."""
        k = conv.kernel_size[0] - 1
        if self.old is None:
            hist = x.new_zeros(x.shape[0], x.shape[1], k)  # the causal zero padding at frame 0
        else:
            hist = self.old.convs[self._conv]
        self._conv += 1
        full = torch.cat([hist, x], dim=-1)
        self.new.convs.append(full[:, :, self.keep: self.keep + k].clone())
        return nn.Conv1d.forward(conv, full)

    def attention(self, block: TransformerBlock, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """A transformer block over new frames h (B, n, C); bias (1, n, P + n) additive."""
        attn = block.attn1
        normed = block.norm1(h)
        b, n, _ = normed.shape
        old = self.old.attn[self._attn] if self.old is not None else None
        self._attn += 1
        if self.store == "kv":
            qkv = fused_linear(normed, (attn.to_q, attn.to_k, attn.to_v), attn._fused)
            q, k, v = qkv.view(b, n, 3, attn.heads, attn.head_dim).permute(2, 0, 3, 1, 4)
            if old is not None:
                k, v = torch.cat([old[0], k], dim=2), torch.cat([old[1], v], dim=2)
            cut = k.shape[2] - n + self.keep
            self.new.attn.append((k[:, :, :cut].contiguous(), v[:, :, :cut].contiguous()))
        else:
            # keys/values of cached and new frames in one GEMM, queries of the new frames only
            normed_all = normed if old is None else torch.cat([old, normed], dim=1)
            q = attn.to_q(normed).view(b, n, attn.heads, attn.head_dim).transpose(1, 2)
            kv = fused_linear(normed_all, (attn.to_k, attn.to_v), _KV_FUSED.setdefault(attn, {}))
            k, v = kv.view(b, -1, 2, attn.heads, attn.head_dim).permute(2, 0, 3, 1, 4)
            cut = normed_all.shape[1] - n + self.keep
            self.new.attn.append(normed_all if cut == normed_all.shape[1] else normed_all[:, :cut].contiguous())
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None])
        h = h + attn.to_out[0](out.transpose(1, 2).reshape(b, n, -1))
        return h + block.ff(block.norm3(h))

    def check_consumed(self) -> None:
        if self.old is not None and (self._conv, self._attn) != (len(self.old.convs), len(self.old.attn)):
            raise RuntimeError("incremental flow cache does not match the estimator's layers")


def _block(block: CausalBlock1D, x: torch.Tensor, p: _Pass) -> torch.Tensor:
    return block.block[1:](p.conv(block.block[0], x))


def _resnet(resnet: CausalResnetBlock1D, x: torch.Tensor, temb: torch.Tensor, p: _Pass) -> torch.Tensor:
    h = _block(resnet.block1, x, p) + resnet.mlp(temb).unsqueeze(-1)
    return _block(resnet.block2, h, p) + resnet.res_conv(x)


def _attend(x: torch.Tensor, blocks: nn.ModuleList, bias: torch.Tensor, p: _Pass) -> torch.Tensor:
    h = x.transpose(1, 2)
    for block in blocks:
        h = p.attention(block, h, bias)
    return h.transpose(1, 2)


def estimator_step(unet: CausalUNet, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                   cond: torch.Tensor, bias: torch.Tensor, p: _Pass) -> torch.Tensor:
    """:meth:`CausalUNet.forward` (streaming) of new frames x, mu, cond (B, 80, n) -> (B, 80, n)."""
    temb = unet.time_mlp(sinusoidal_embedding(t, unet.spec.in_channels).to(t.dtype))
    h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.shape[-1]), cond], dim=1)
    resnet, blocks, down = unet.down_blocks[0]
    h = _attend(_resnet(resnet, h, temb, p), blocks, bias, p)
    skip = h
    h = p.conv(down, h)
    for resnet, blocks in unet.mid_blocks:
        h = _attend(_resnet(resnet, h, temb, p), blocks, bias, p)
    resnet, blocks, up = unet.up_blocks[0]
    h = torch.cat([h, skip], dim=1)
    h = p.conv(up, _attend(_resnet(resnet, h, temb, p), blocks, bias, p))
    h = _block(unet.final_block, h, p)
    p.check_consumed()
    return unet.final_proj(h)


def chunk_bias(start: int, end: int, chunk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(1, end - start, end) additive bias: rows ``[start, end)`` of the block-causal chunk mask."""
    keys = torch.arange(end, device=device)
    limit = (torch.arange(start, end, device=device) // chunk + 1) * chunk
    return to_bias((keys[None, :] < limit[:, None])[None], dtype)


def solve_incremental(solver: CFMSolver, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                      cache: FlowCache, keep: int) -> torch.Tensor:
    """:meth:`CFMSolver.forward` (streaming) of frames ``[P, P + n)`` given the cache of ``[0, P)``.

    Args:
        mu, cond: (1, 80, n) of the new frames; spks: (1, 80).
        keep: how many of the new frames to add to the cache (a chunk boundary; 0 for a final call).

    Returns:
        (1, 80, n) float32; the cache then holds ``P + keep`` frames.
    """
    unet = solver.estimator
    b, c, n = mu.shape
    dtype = spks.dtype
    start = cache.frames
    x = solver.noise(n, spks, offset=start).expand(b, -1, -1).clone()
    t_steps, dts = step_schedule(solver.spec.n_timesteps, solver.spec.t_scheduler, dtype, mu.device)
    mu_in = torch.zeros(2 * b, c, n, device=mu.device, dtype=dtype)
    cond_in = torch.zeros_like(mu_in)
    spks_in = torch.zeros(2 * b, spks.shape[1], device=mu.device, dtype=dtype)
    t_in = torch.zeros(2 * b, device=mu.device, dtype=dtype)
    mu_in[:b], spks_in[:b], cond_in[:b] = mu, spks, cond
    bias = chunk_bias(start, start + n, unet.spec.static_chunk_size, dtype, mu.device)
    rate = solver.spec.inference_cfg_rate
    steps = len(t_steps)
    if cache.steps and len(cache.steps) != steps:
        raise RuntimeError(f"flow cache has {len(cache.steps)} steps, the solver {steps}")
    new_steps = []
    for step in range(steps):
        t_in[:] = t_steps[step]
        p = _Pass(cache.steps[step] if cache.steps else None, keep, cache.store)
        v = estimator_step(unet, torch.cat([x, x]), mu_in, t_in, spks_in, cond_in, bias, p)
        new_steps.append(p.new)
        x = euler_update(x, v, dts[step], 1.0, rate)
    cache.steps, cache.frames = new_steps, start + keep
    return x.float()


def supports_incremental(flow: Flow, item: FlowItem) -> bool:
    """Whether ``item`` can be solved incrementally: a CosyVoice2 U-Net with chunk masks in use."""
    return (flow.spec.family == "cosyvoice2" and isinstance(flow.estimator, CausalUNet)
            and flow.spec.unet.static_chunk_size > 0 and bool(item.streaming))


@torch.inference_mode()
def incremental_mel(flow: Flow, item: FlowItem, cache: FlowCache) -> torch.Tensor:
    """Mel of frames ``[cache.frames, T)`` (absolute, prompt included) of one streamed job.

    The encoder still runs over the whole sequence (one pass; the estimator's 2 x n_timesteps
    passes are what the cache saves). A non-final job advances the cache to the last
    attention-chunk boundary at or before its end.

    Returns:
        (1, 80, T - P) float32, P = ``cache.frames`` before the call.
    """
    if not supports_incremental(flow, item):
        raise InvalidInputError("the incremental flow needs a CosyVoice2 job with streaming chunk masks")
    dtype = flow.spk_embed_affine_layer.weight.dtype
    dev = flow.spk_embed_affine_layer.weight.device
    spks = flow.spk_embed_affine_layer(F.normalize(item.embedding.reshape(1, -1).to(dev, dtype), dim=1))
    mu, frames = flow.encode([item])
    total = int(frames[0])
    start = cache.frames
    if start > total:
        raise InvalidInputError(f"flow cache holds {start} frames, the job has {total}")
    n_prompt = item.prompt_feat.shape[1]
    if n_prompt > total:
        raise InvalidInputError(f"prompt mel of {n_prompt} frames is longer than the {total} flow frames")
    cond = torch.zeros(1, flow.spec.output_size, total, device=dev, dtype=mu.dtype)
    cond[0, :, :n_prompt] = item.prompt_feat[0].transpose(0, 1).to(mu)
    chunk = flow.spec.unet.static_chunk_size
    keep = 0 if item.finalize else max(0, total // chunk * chunk - start)
    return solve_incremental(flow.decoder, mu[:, :, start:total], spks, cond[:, :, start:], cache, keep)
