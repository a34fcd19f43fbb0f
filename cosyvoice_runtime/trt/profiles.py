"""Optimisation-profile shapes of the flow estimator, derived from the spec and a replica's limits.

The estimator sees ``rows = 2 x flow batch`` (the CFG pair of every job, spec §4.5) and
``T = token_mel_ratio x (prompt tokens + output tokens)`` mel frames: every streamed flow call
recomputes the prompt and all tokens so far, and the look-ahead context tokens produce no
frames (spec §4.4, §6.1). So:

* min: one job of one output token (``T = token_mel_ratio``), one CFG pair;
* opt: the latency-critical call, the first streamed chunk after the longest prompt
  (``ceil(Lp / hop) x hop + hop`` tokens: prompt + first hop + alignment pad), at half the
  largest flow batch;
* max: the longest call (prompt + generated audio of one flow job, ``max_total_s``) at the
  largest flow batch.

A memory budget (:func:`fit_to_memory`) lowers the largest flow batch, then the longest call,
until the replica's estimate fits; the result is what a replica accepts.

Everything here is pure arithmetic (no torch, no tensorrt) so it is unit-tested on CPU.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass

from cosyvoice_runtime.config import FlowSpec, ModelSpec

GIB = 1 << 30
# The official profile (spec §7.3) allows 60 s per flow call including the prompt; the speech
# tokenizer accepts prompts up to 30 s (frontend limit).
DEFAULT_MAX_TOTAL_S = 60.0
DEFAULT_MAX_PROMPT_S = 30.0
DEFAULT_MAX_FLOW_BATCH = 8
# Activation estimate of the estimator (an upper bound, to be calibrated on a GPU): live
# (rows, width, T) tensors at the widest layer, and attention score copies (scores + softmax)
# of one layer when the attention kernel materialises them.
LIVE_WIDE_TENSORS = 8
ATTENTION_SCORE_COPIES = 2
# CUDA context, allocator slack, vocoder and frontend buffers not counted elsewhere.
DEFAULT_RESERVE_GB = 1.5


@dataclass(frozen=True)
class ReplicaLimits:
    """What one replica accepts: the inputs of the profile derivation.

    Attributes:
        max_flow_batch: flow jobs solved in one CFM batch (the token2wav ``max_batch_size``).
        max_prompt_s: longest prompt (seconds of prompt speech tokens).
        max_total_s: longest flow call: prompt + generated audio of one text piece.
    """

    max_flow_batch: int = DEFAULT_MAX_FLOW_BATCH
    max_prompt_s: float = DEFAULT_MAX_PROMPT_S
    max_total_s: float = DEFAULT_MAX_TOTAL_S

    def __post_init__(self) -> None:
        if self.max_flow_batch < 1:
            raise ValueError(f"max_flow_batch must be >= 1, got {self.max_flow_batch}")
        if not 0 < self.max_prompt_s < self.max_total_s:
            raise ValueError(f"need 0 < max_prompt_s ({self.max_prompt_s}) < max_total_s ({self.max_total_s})")


@dataclass(frozen=True)
class EstimatorProfile:
    """min/opt/max of the two dynamic axes: estimator rows (2 x flow batch) and mel frames."""

    rows: tuple[int, int, int]
    frames: tuple[int, int, int]
    n_mels: int
    spk_dim: int

    def __post_init__(self) -> None:
        for name, (lo, opt, hi) in (("rows", self.rows), ("frames", self.frames)):
            if not 1 <= lo <= opt <= hi:
                raise ValueError(f"{name} profile must satisfy 1 <= min <= opt <= max, got {(lo, opt, hi)}")

    @property
    def max_flow_batch(self) -> int:
        return self.rows[2] // 2

    def shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """Input name -> (min, opt, max) shape, for ``IOptimizationProfile.set_shape``."""
        out = {}
        for name, per_frame in (("x", self.n_mels), ("mask", 1), ("mu", self.n_mels), ("cond", self.n_mels)):
            out[name] = tuple((b, per_frame, t) for b, t in zip(self.rows, self.frames))
        out["t"] = tuple((b,) for b in self.rows)
        out["spks"] = tuple((b, self.spk_dim) for b in self.rows)
        return out

    def covers(self, rows: int, frames: int) -> bool:
        return self.rows[0] <= rows <= self.rows[2] and self.frames[0] <= frames <= self.frames[2]

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "frames": list(self.frames), "n_mels": self.n_mels, "spk_dim": self.spk_dim}

    @classmethod
    def from_dict(cls, d: dict) -> EstimatorProfile:
        return cls(rows=tuple(d["rows"]), frames=tuple(d["frames"]), n_mels=int(d["n_mels"]), spk_dim=int(d["spk_dim"]))

    def digest(self) -> str:
        """Stable short hash of the profile (part of the engine cache key)."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def table(self) -> str:
        """Human-readable summary (the build prints it)."""
        lines = ["input   min              opt              max"]
        for name, (lo, opt, hi) in self.shapes().items():
            lines.append(f"{name:<7} {lo!s:<16} {opt!s:<16} {hi}")
        return "\n".join(lines)


def estimator_dims(flow: FlowSpec) -> tuple[int, int]:
    """(mel channels, width of the ``spks`` input): CV2 projects the speaker vector to the mel width."""
    if flow.dit is not None:
        return flow.dit.mel_dim, flow.dit.spk_dim
    return flow.output_size, flow.output_size


def first_chunk_tokens(spec: ModelSpec, prompt_tokens: int) -> int:
    """LLM tokens needed before the first flow call: hop + alignment pad + look-ahead (spec §6.1)."""
    hop = spec.stream.token_hop_len
    pad = math.ceil(prompt_tokens / hop) * hop - prompt_tokens
    return hop + pad + spec.flow.pre_lookahead_len


def stream_call_frames(spec: ModelSpec, prompt_tokens: int, total_tokens: int) -> list[int]:
    """Estimator frames of every flow call of a streamed utterance (hop grows to the max hop).

    ``total_tokens`` generated tokens; the last entry is the final (full-length) call.
    """
    s = spec.stream
    ratio = spec.flow.token_mel_ratio
    la = spec.flow.pre_lookahead_len
    hop, offset, out = s.token_hop_len, 0, []
    while True:
        step = hop + (math.ceil(prompt_tokens / s.token_hop_len) * s.token_hop_len - prompt_tokens if offset == 0 else 0)
        if total_tokens < offset + step + la:
            break
        out.append(ratio * (prompt_tokens + offset + step))
        offset += step
        hop = min(s.token_max_hop_len, hop * s.stream_scale_factor)
    out.append(ratio * (prompt_tokens + total_tokens))
    return out


def derive_profile(spec: ModelSpec, limits: ReplicaLimits = ReplicaLimits()) -> EstimatorProfile:
    """The estimator profile of a replica with ``limits`` (see the module docstring)."""
    rate = spec.token_frame_rate
    ratio = spec.flow.token_mel_ratio
    hop = spec.stream.token_hop_len
    max_prompt = int(limits.max_prompt_s * rate)
    max_frames = int(limits.max_total_s * rate) * ratio
    opt_tokens = math.ceil(max_prompt / hop) * hop + hop  # prompt + first hop + pad (look-ahead makes no frames)
    opt_frames = min(max_frames, ratio * opt_tokens)
    n_mels, spk_dim = estimator_dims(spec.flow)
    b = limits.max_flow_batch
    return EstimatorProfile(rows=(2, 2 * max(1, (b + 1) // 2), 2 * b), frames=(ratio, opt_frames, max_frames),
                            n_mels=n_mels, spk_dim=spk_dim)


# ------------------------------------------------------------------------------- memory budget
def estimator_activation_bytes(flow: FlowSpec, rows: int, frames: int, dtype_bytes: int) -> int:
    """Upper-bound estimate of the estimator's peak activation memory for one call."""
    if flow.dit is not None:
        width, heads = flow.dit.dim * flow.dit.ff_mult, flow.dit.heads
    else:
        u = flow.unet
        width, heads = max(u.channels) * 4, u.num_heads  # the transformer feed-forward is 4x wide
    linear = LIVE_WIDE_TENSORS * width * frames
    scores = ATTENTION_SCORE_COPIES * heads * frames * frames
    return rows * (linear + scores) * dtype_bytes


def kv_cache_bytes(spec: ModelSpec, max_running: int, max_model_len: int, dtype_bytes: int) -> int:
    """K and V of every layer for ``max_running`` slots of ``max_model_len`` positions."""
    b = spec.llm.backbone
    return 2 * b.num_layers * b.num_kv_heads * b.head_dim * max_running * max_model_len * dtype_bytes


def replica_bytes(spec: ModelSpec, limits: ReplicaLimits, *, weights_bytes: int, max_running: int,
                  max_model_len: int, dtype_bytes: int, reserve_gb: float = DEFAULT_RESERVE_GB) -> int:
    """Estimated peak memory of a replica: weights + KV cache + the largest estimator call + reserve."""
    profile = derive_profile(spec, limits)
    act = estimator_activation_bytes(spec.flow, profile.rows[2], profile.frames[2], dtype_bytes)
    return int(weights_bytes + kv_cache_bytes(spec, max_running, max_model_len, dtype_bytes) + act + reserve_gb * GIB)


def fit_to_memory(spec: ModelSpec, max_mem_gb: float, limits: ReplicaLimits = ReplicaLimits(), *,
                  weights_bytes: int, max_running: int, max_model_len: int, dtype_bytes: int,
                  reserve_gb: float = DEFAULT_RESERVE_GB) -> ReplicaLimits:
    """The largest limits (at most ``limits``) whose estimate fits in ``max_mem_gb``.

    The flow batch is lowered first (it costs throughput only), then the longest flow call
    (which caps the text piece a replica accepts), down to 1 job of ``max_prompt_s + 1`` s.

    Raises:
        ValueError: even the smallest limits do not fit (the message gives the fixed costs).
    """
    budget = max_mem_gb * GIB
    kw = {"weights_bytes": weights_bytes, "max_running": max_running, "max_model_len": max_model_len,
          "dtype_bytes": dtype_bytes, "reserve_gb": reserve_gb}
    for batch in range(limits.max_flow_batch, 0, -1):
        candidate = dataclasses.replace(limits, max_flow_batch=batch)
        if replica_bytes(spec, candidate, **kw) <= budget:
            return candidate
    floor = limits.max_prompt_s + 1.0
    total = limits.max_total_s
    while total > floor:
        total = max(floor, total * 0.8)
        candidate = dataclasses.replace(limits, max_flow_batch=1, max_total_s=total)
        if replica_bytes(spec, candidate, **kw) <= budget:
            return candidate
    fixed = weights_bytes + kv_cache_bytes(spec, max_running, max_model_len, dtype_bytes) + reserve_gb * GIB
    raise ValueError(f"max_mem_gb {max_mem_gb:g} is too small: weights + KV cache ({max_running} slots x "
                     f"{max_model_len} positions) + reserve need {fixed / GIB:.2f} GiB before any flow call; "
                     "lower max_running / max_model_len or raise max_mem_gb")
