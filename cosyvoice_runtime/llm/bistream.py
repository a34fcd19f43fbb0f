"""Bistream decoding: text arrives as a stream, speech starts before it ends (spec §3.8).

The model was trained on sequences that interleave ``mix_ratio = (5, 15)`` groups: 5 text
embeddings, 15 speech embeddings, and after every complete speech group the target ``fill``
("give me more text"). At inference the prompt text and prompt speech are interleaved first;
then each time 5 more text tokens are available the model generates until it produces (or is
forced to produce) ``fill``. When the text ends, the remaining text and ``task_id`` are fed and
decoding runs until eos.

``official_quirks=True`` reproduces three behaviours of the official ``inference_bistream``:
the final stage re-feeds the last already-cached input, a prompt of a multiple of 15 speech
tokens schedules the first forced fill 15 tokens late, and only index S is masked in the
interleaved phase (so CV2 can sample its unused id S+1 and abort). The defaults fix all three.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID, LLMSpec
from cosyvoice_runtime.errors import CosyVoiceError, InvalidInputError
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.sampling import SamplingParams, mask_ids_, sample

logger = logging.getLogger(__name__)


class BistreamError(CosyVoiceError):
    """The model produced a control id that the bistream protocol does not allow there."""


@dataclass
class BistreamState:
    """One bistream request. ``tokens`` includes fill ids (they are visible to RAS)."""

    slot: int = 0
    generator: torch.Generator | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    tokens: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    next_fill: int = 0
    final: bool = False  # in the last stage (text ended; eos allowed)
    text_seen: int = 0  # target-text tokens received
    finished: bool = False


SampleFn = Callable[[torch.Tensor, BistreamState], int]
# Observer of every forward: (fed embeddings (n, H), hidden at the last position (H,)).
ForwardHook = Callable[[torch.Tensor, torch.Tensor], None]


def default_sample_fn(logp: torch.Tensor, state: BistreamState) -> int:
    return sample(logp, state.params, state.tokens, state.generator)


def first_fill_index(num_prompt_speech: int, group: int, official_quirks: bool) -> int:
    """Generated-token index of the first forced fill, re-synchronising the last prompt group.

    The last prompt group holds ``P % group`` speech tokens, so ``group - P % group`` more
    complete it. A prompt of whole groups needs a fill right away (index 0); the official
    formula gives ``group`` there (**[quirk]**). Without a prompt the first group is generated
    in full (index ``group``) either way.
    """
    rest = num_prompt_speech % group
    if rest == 0 and num_prompt_speech > 0 and not official_quirks:
        return 0
    return group - rest


def interleaved_mask_ids(spec: LLMSpec, official_quirks: bool) -> tuple[int, ...]:
    """Ids forbidden before the text ends: the official masks index S only; we allow only fill."""
    if official_quirks:
        return (spec.official_min_len_masked_id,)
    return tuple(i for i in spec.stop_ids if i != spec.fill)


def final_mask_ids(spec: LLMSpec, official_quirks: bool) -> tuple[int, ...]:
    """Ids forbidden once the text ended: the official masks none; we allow eos only."""
    return () if official_quirks else tuple(i for i in spec.stop_ids if i != spec.eos)


def bistream_decode(model, cache: KVCache, text_chunks: Iterable, prompt_text_ids, prompt_speech_ids,
                    state: BistreamState | None = None, sample_fn: SampleFn = default_sample_fn, *,
                    official_quirks: bool = False, on_forward: ForwardHook | None = None,
                    max_tokens: int | None = None) -> Iterator[int]:
    """Generate speech ids while text ids arrive.

    Args:
        model: :class:`~cosyvoice_runtime.llm.model.SpeechLM`.
        cache: KV cache; ``state.slot`` is reset and used.
        text_chunks: iterable of text-id sequences (the frontend yields one id at a time).
        prompt_text_ids / prompt_speech_ids: (T,) or (1, T) ids (may be empty).
        max_tokens: cap on emitted tokens; default (not with quirks) ``max_token_text_ratio`` x
            the target text length, checked in the final stage.

    Yields:
        Emitted speech ids (fill and eos are not emitted).

    Raises:
        InvalidInputError: CV3 prompt text without ``<|endofprompt|>``.
        BistreamError: a control id other than fill/eos was produced (official-quirk mode).
    """
    spec: LLMSpec = model.spec
    state = state or BistreamState()
    n_text, n_speech = spec.mix_ratio
    device = model.speech_embedding.weight.device
    empty = model.speech_embedding.weight[:0]

    def ids(x) -> torch.Tensor:
        t = torch.as_tensor(x if x is not None else [], dtype=torch.long, device=device)
        return t.reshape(-1)

    prompt_text = ids(prompt_text_ids)
    prompt_speech_tokens = ids(prompt_speech_ids)
    pending = model.sos_embedding()[None]  # appended but not yet fed
    if spec.family == "cosyvoice3":
        hits = (prompt_text == ENDOFPROMPT_TOKEN_ID).nonzero()
        if hits.numel() == 0:
            raise InvalidInputError(f"CosyVoice3 bistream needs <|endofprompt|> (id {ENDOFPROMPT_TOKEN_ID}) "
                                    "in the prompt text")
        # The instruction prefix up to <|endofprompt|> is not interleaved.
        cut = int(hits[0, 0]) + 1
        pending = torch.cat([pending, model.embed_text(prompt_text[:cut])])
        prompt_text = prompt_text[cut:]
    text_cache = model.embed_text(prompt_text)
    prompt_speech = model.embed_speech(prompt_speech_tokens)
    state.next_fill = first_fill_index(prompt_speech_tokens.numel(), n_speech, official_quirks)
    groups_appended = False
    last_fed = empty
    cache.reset(state.slot)

    def forward(x: torch.Tensor) -> torch.Tensor:
        nonlocal last_fed
        hidden = model.prefill(x, cache, state.slot)
        last_fed = x
        if on_forward is not None:
            on_forward(x, hidden)
        return model.logits(hidden).float().log_softmax(dim=-1)

    with torch.inference_mode():
        for chunk in text_chunks:
            new = ids(chunk)
            state.text_seen += new.numel()
            text_cache = torch.cat([text_cache, model.embed_text(new)])
            while prompt_speech.shape[0] and text_cache.shape[0] >= n_text:
                pending = torch.cat([pending, text_cache[:n_text], prompt_speech[:n_speech]])
                text_cache, prompt_speech = text_cache[n_text:], prompt_speech[n_speech:]
                groups_appended = True
            if prompt_speech.shape[0]:
                continue  # wait for text to pair with the remaining prompt speech
            at_start = not state.tokens and not groups_appended
            if at_start or (state.tokens and state.tokens[-1] == spec.fill):
                if text_cache.shape[0] < n_text:
                    continue
                pending = torch.cat([pending, text_cache[:n_text]])
                text_cache = text_cache[n_text:]
            while True:
                logp = forward(pending)
                pending = empty
                if len(state.tokens) == state.next_fill:
                    token = spec.fill
                    state.next_fill += n_speech + 1
                else:
                    token = sample_fn(mask_ids_(logp, interleaved_mask_ids(spec, official_quirks)), state)
                if token == spec.fill:
                    state.next_fill = len(state.tokens) + n_speech + 1
                state.tokens.append(token)
                if token >= spec.speech_token_size:
                    if token == spec.fill:
                        break
                    raise BistreamError(f"bistream: control id {token} sampled before the text ended")
                state.emitted.append(token)
                yield token
                pending = model.embed_speech(torch.tensor([token], device=device))

        # Text ended: remaining text, task_id, then decode until eos.
        state.final = True
        head = pending if (pending.shape[0] or not official_quirks) else last_fed
        # Prompt speech still unpaired (too little text) follows task_id, as in the unistream
        # layout; the official code drops it.
        tail = [] if official_quirks else [prompt_speech]
        pending = torch.cat([head, text_cache, model.task_id_embedding()[None], *tail])
        if max_tokens is None and not official_quirks:
            max_tokens = max(int(state.text_seen * spec.max_token_text_ratio), len(state.emitted) + 1)
        while max_tokens is None or len(state.emitted) < max_tokens:
            logp = forward(pending)
            token = sample_fn(mask_ids_(logp, final_mask_ids(spec, official_quirks)), state)
            state.tokens.append(token)
            if token >= spec.speech_token_size:
                if token == spec.eos:
                    break
                raise BistreamError(f"bistream: control id {token} sampled in the final stage")
            state.emitted.append(token)
            yield token
            pending = model.embed_speech(torch.tensor([token], device=device))
        state.finished = True
