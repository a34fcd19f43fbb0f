"""Building the LLM input sequence and the generation length limits (spec §3.3).

Unistream layout (zero_shot, cross_lingual, instruct2, sft)::

    lm_input = [sos] ++ embed_text(prompt_text ++ text) ++ [task_id] ++ embed_speech(prompt_speech)
    min_len  = int(len(text) * min_token_text_ratio)     # prompt text excluded
    max_len  = int(len(text) * max_token_text_ratio)

CosyVoice3 requires ``<|endofprompt|>`` somewhere in ``prompt_text ++ text``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID, LLMSpec
from cosyvoice_runtime.errors import InvalidInputError


@dataclass(frozen=True)
class LMInput:
    """A prepared unistream request: prefill embeddings and length limits."""

    embeds: torch.Tensor  # (T0, H)
    min_len: int
    max_len: int


def _as_ids(ids) -> torch.Tensor:
    """Accept (T,), (1, T), lists or None; return (T,) long on the host (checked there: a check of
    ids on the GPU is a kernel, a copy back and a sync per bound)."""
    if ids is None:
        return torch.zeros(0, dtype=torch.long)
    t = torch.as_tensor(ids).cpu()
    if t.dim() == 2:
        if t.shape[0] != 1:
            raise InvalidInputError(f"expected one id sequence, got shape {tuple(t.shape)}")
        t = t[0]
    if t.dim() != 1:
        raise InvalidInputError(f"expected a 1-D id sequence, got shape {tuple(t.shape)}")
    return t.long()


def check_endofprompt(spec: LLMSpec, prompt_text_ids: torch.Tensor, text_ids: torch.Tensor) -> None:
    """CosyVoice3 only: ``<|endofprompt|>`` must occur in ``prompt_text ++ text``.

    Raises:
        InvalidInputError: it does not (CV3 was trained with the prefix it closes).
    """
    if spec.family != "cosyvoice3":
        return
    if not bool((prompt_text_ids == ENDOFPROMPT_TOKEN_ID).any() or (text_ids == ENDOFPROMPT_TOKEN_ID).any()):
        raise InvalidInputError(
            f"CosyVoice3 needs the <|endofprompt|> token (id {ENDOFPROMPT_TOKEN_ID}) in the prompt text or text, "
            "e.g. prompt text 'You are a helpful assistant.<|endofprompt|>...'"
        )


def length_limits(spec: LLMSpec, num_text_tokens: int) -> tuple[int, int]:
    """(min_len, max_len) in generated speech tokens for ``num_text_tokens`` (prompt text excluded)."""
    return int(num_text_tokens * spec.min_token_text_ratio), int(num_text_tokens * spec.max_token_text_ratio)


def build_lm_input(model, text_ids, prompt_text_ids=None, prompt_speech_ids=None) -> LMInput:
    """Embeddings and length limits of one unistream request.

    Args:
        model: a :class:`~cosyvoice_runtime.llm.model.SpeechLM`.
        text_ids: target text ids (T,) or (1, T).
        prompt_text_ids: transcript of the prompt audio, placed before the text (may be empty).
        prompt_speech_ids: speech tokens of the prompt audio (may be empty).

    Returns:
        :class:`LMInput` with ``embeds`` of shape (1 + Lpt + Lt + 1 + Lps, H).

    Raises:
        InvalidInputError: empty text, out-of-range ids, or (CV3) no ``<|endofprompt|>``.
    """
    spec: LLMSpec = model.spec
    device = model.speech_embedding.weight.device
    text = _as_ids(text_ids)
    prompt_text = _as_ids(prompt_text_ids)
    prompt_speech = _as_ids(prompt_speech_ids)
    if text.numel() == 0:
        raise InvalidInputError("text has no tokens")
    all_text = torch.cat([prompt_text, text])
    _check_range("text", all_text, spec.backbone.vocab_size)
    _check_range("prompt speech token", prompt_speech, spec.speech_token_size)
    check_endofprompt(spec, prompt_text, text)
    # One copy to the device for both id kinds (each pageable copy waits for the stream).
    ids = torch.cat([all_text, prompt_speech]).to(device)
    embeds = torch.cat([
        model.sos_embedding()[None],
        model.embed_text(ids[:all_text.numel()]),
        model.task_id_embedding()[None],
        model.embed_speech(ids[all_text.numel():]),
    ])
    min_len, max_len = length_limits(spec, text.numel())
    return LMInput(embeds=embeds, min_len=min_len, max_len=max_len)


def _check_range(what: str, ids: torch.Tensor, limit: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise InvalidInputError(f"{what} ids must lie in [0, {limit}), got [{int(ids.min())}, {int(ids.max())}]")


def with_prefix(model, lm_input: torch.Tensor, prefix, max_len: int) -> tuple[torch.Tensor, list[int]]:
    """``lm_input`` followed by the fed-back embeddings of ``prefix``, the speech ids a sequence
    already emitted (its continuation on another replica), and those ids as a list.

    Raises:
        InvalidInputError: ids out of range, or as many as ``max_len`` (nothing would be left).
    """
    done = [int(t) for t in prefix]
    if len(done) >= max_len or max(done) >= model.spec.speech_token_size or min(done) < 0:
        raise InvalidInputError(f"a continuation's {len(done)} speech ids do not fit this request")
    ids = torch.as_tensor(done, dtype=torch.long, device=model.speech_embedding.weight.device)
    with torch.inference_mode():
        fed = model.embed_speech(ids).to(lm_input.device, lm_input.dtype)
    return torch.cat([lm_input, fed]), done
