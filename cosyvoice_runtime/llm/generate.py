"""Single-request reference decoding (spec §3.4-§3.5), used by parity tests and the engine.

The per-request state is an explicit :class:`DecodeState`; the loop itself is stateless.
:func:`select_tokens` (mask + sample) and :func:`commit_token` (stop / length rules) are the
two halves of one decoding step and are shared with the batched engine, so the single and
batched paths cannot drift apart.

Bistream (text-in streaming, §3.8) lives in :mod:`cosyvoice_runtime.llm.bistream` and is
re-exported here.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from cosyvoice_runtime.config import LLMSpec
from cosyvoice_runtime.llm import batch_sampling as bs
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.sampling import SamplingParams, min_len_mask_ids, sample

logger = logging.getLogger(__name__)

FINISH_STOP = "stop"  # a stop id was sampled (not emitted)
FINISH_LENGTH = "length"  # max_len tokens emitted
FINISH_ABORT = "abort"


@dataclass
class DecodeState:
    """Everything that belongs to one request while it decodes."""

    min_len: int
    max_len: int
    slot: int = 0
    generator: torch.Generator | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    tokens: list[int] = field(default_factory=list)  # emitted speech ids
    step: int = 0  # sampler calls so far (== len(tokens) until finished by a stop id)
    finished: bool = False
    finish_reason: str | None = None
    stop_token: int | None = None
    rng_seed: int | None = None  # counter-based sampler seed (see ``seed``)

    @property
    def seed(self) -> int:
        """The request's sampler seed: its generator's seed, else ``params.seed``, else random (fixed once drawn)."""
        if self.rng_seed is None:
            if self.generator is not None:
                self.rng_seed = self.generator.initial_seed()
            elif self.params.seed is not None:
                self.rng_seed = int(self.params.seed)
            else:
                self.rng_seed = bs.random_seed()
        return self.rng_seed

    def finish(self, reason: str, stop_token: int | None = None) -> None:
        self.finished, self.finish_reason, self.stop_token = True, reason, stop_token


# A sampler sees the masked (V,) log-probabilities and the request state and returns an id.
SampleFn = Callable[[torch.Tensor, DecodeState], int]
# Observer of every step: (step, hidden (H,), logits (V,), chosen id).
StepHook = Callable[[int, torch.Tensor, torch.Tensor, int], None]


def uses_batch_sampler(state: DecodeState, sample_fn: SampleFn) -> bool:
    """True when the request's token comes from :func:`batch_sampling.sample_rows`."""
    return sample_fn is default_sample_fn and not state.params.official_rng


def pack_states(states: list[DecodeState], width: int | None = None, out=None, ahead=None):
    """:func:`batch_sampling.pack_rows` for decode states (``width`` default: the largest window).
    ``ahead``: per row, whether its state is one step behind the step packed (its last id is still
    on the GPU, ``DecodeRunner.launch``): its draw counter and min-length mask are taken one on."""
    if width is None:
        width = max(s.params.win_size for s in states)
    steps = [s.step + (int(ahead[i]) if ahead is not None else 0) for i, s in enumerate(states)]
    return bs.pack_rows([s.params for s in states], [s.tokens for s in states], steps,
                        [s.seed for s in states], [step < s.min_len for step, s in zip(steps, states)], width, out)


def default_sample_fn(logp: torch.Tensor, state: DecodeState) -> int:
    """The request's own rule: official-RNG-exact per row, else the counter-based batch sampler."""
    if state.params.official_rng:
        return sample(logp, state.params, state.tokens, state.generator)
    rows = torch.from_numpy(pack_states([state])).to(logp.device)
    return int(bs.sample_rows(logp[None], rows)[0])


def select_tokens(spec: LLMSpec, logits: torch.Tensor, states: list[DecodeState], sample_fns: list[SampleFn],
                  official_quirks: bool = False) -> list[int]:
    """Log-softmax (float32), min-length mask, sample: one id per request of a batch.

    Args:
        logits: (B, V) ``llm_decoder`` outputs at the predicting positions.
        states / sample_fns: the B requests and their samplers.
        official_quirks: mask only index S before ``min_len`` (the official rule, wrong eos for
            CV3) instead of every stop id.
    """
    logp = logits.float().log_softmax(dim=-1)
    rows = [i for i, s in enumerate(states) if s.step < s.min_len]
    if rows:
        ids = torch.tensor(min_len_mask_ids(spec, official_quirks), device=logp.device)
        logp[torch.tensor(rows, device=logp.device)[:, None], ids[None]] = -float("inf")
    if all(fn is default_sample_fn and s.params.method == "greedy" for fn, s in zip(sample_fns, states)):
        return logp.argmax(dim=-1).tolist()  # one device sync for the whole batch
    batched = [i for i, (fn, s) in enumerate(zip(sample_fns, states)) if uses_batch_sampler(s, fn)]
    out: list[int | None] = [None] * len(states)
    if batched:  # every default-sampled row in one call and one sync
        rows = torch.from_numpy(pack_states([states[i] for i in batched])).to(logp.device)
        sub = logp if len(batched) == len(states) else logp[torch.tensor(batched, device=logp.device)]
        for i, tok in zip(batched, bs.sample_rows(sub, rows).tolist()):
            out[i] = tok
    for i, (fn, s) in enumerate(zip(sample_fns, states)):
        if out[i] is None:
            out[i] = fn(logp[i], s)
    return out


def select_token(spec: LLMSpec, logits: torch.Tensor, state: DecodeState, sample_fn: SampleFn = default_sample_fn,
                 official_quirks: bool = False) -> int:
    """:func:`select_tokens` for one request; ``logits`` is (V,)."""
    return select_tokens(spec, logits[None], [state], [sample_fn], official_quirks)[0]


def commit_token(spec: LLMSpec, state: DecodeState, token: int) -> bool:
    """Apply the stop and length rules to a chosen id; True when it is emitted."""
    state.step += 1
    if token >= spec.speech_token_size:  # every id past the real speech tokens is a stop id
        state.finish(FINISH_STOP, token)
        return False
    state.tokens.append(token)
    if len(state.tokens) >= state.max_len:
        state.finish(FINISH_LENGTH)
    return True


def decode(model, cache: KVCache, lm_input: torch.Tensor, state: DecodeState, sample_fn: SampleFn = default_sample_fn,
           *, official_quirks: bool = False, on_step: StepHook | None = None) -> Iterator[int]:
    """Generate speech ids for one request in ``state.slot`` of ``cache``.

    Args:
        model: :class:`~cosyvoice_runtime.llm.model.SpeechLM`.
        lm_input: (T0, H) prefill embeddings (:func:`~cosyvoice_runtime.llm.inputs.build_lm_input`).
        state: fresh request state (its slot is reset here).

    Yields:
        Emitted speech ids, one per step; ``state`` records why decoding ended.
    """
    spec: LLMSpec = model.spec
    cache.reset(state.slot)
    if state.max_len <= 0:
        state.finish(FINISH_LENGTH)
        return
    with torch.inference_mode():
        hidden = model.prefill(lm_input, cache, state.slot)
        while True:
            logits = model.logits(hidden)
            token = select_token(spec, logits, state, sample_fn, official_quirks)
            if on_step is not None:
                on_step(state.step, hidden, logits, token)
            if commit_token(spec, state, token):
                yield token
            if state.finished:
                return
            feed = model.embed_speech(torch.tensor([token], device=lm_input.device))
            hidden = model.decode(feed, cache, [state.slot])[0]


def decode_all(model, lm_input: torch.Tensor, state: DecodeState, sample_fn: SampleFn = default_sample_fn,
               *, official_quirks: bool = False, on_step: StepHook | None = None) -> list[int]:
    """:func:`decode` with a private one-slot cache sized for this request."""
    cache = KVCache.for_model(model, 1, lm_input.shape[0] + max(state.max_len, 1))
    state.slot = 0
    return list(decode(model, cache, lm_input, state, sample_fn, official_quirks=official_quirks, on_step=on_step))


from cosyvoice_runtime.llm.bistream import BistreamState, bistream_decode  # noqa: F401  (re-export)
