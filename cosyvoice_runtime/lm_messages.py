"""The speech-token engine's messages: what a caller asks for and what comes back.

An :class:`LMRequest` (ids of one sentence piece and the voice's prompt) or a
:class:`BistreamLMRequest` (the prompt only; text arrives while it runs) goes in; the runtime
turns a request into its prefill input (``cosyvoice_runtime.llm.inputs.LMInput``, embeddings and
length limits: the request prepared, not another request type). :class:`TokenEvent`s come out:
:meth:`LLMEngine.step <cosyvoice_runtime.llm.engine.LLMEngine.step>` returns one per request it
advanced (at most one token each); the serving adapter passes them on with its silent-token
filter applied and a failure turned into ``error``; the replica's engine loop hands a consumer
every token since it last looked, as one event. Numpy only (``logits`` is only annotated), so
the serving layer imports these without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass
class LMRequest:
    """Inputs of one LLM sequence (one sentence piece).

    ``prefix``: speech ids this sequence already emitted on another replica (every id the LLM
    chose, before any serving filter), to continue from: they are prefilled after the prompt and
    sampling goes on at draw ``len(prefix)`` (the counter-based sampler's draws depend on the seed
    and the step only), so a seeded sequence continues as it would have. ``prefix_done``: the
    sequence had already ended; nothing more is decoded. The engine's first event of such a
    request carries the prefix (``TokenEvent.raw``, and ``tokens`` as filtered)."""

    text_ids: np.ndarray
    prompt_text_ids: np.ndarray
    prompt_speech_ids: np.ndarray
    seed: int | None = None
    prefix: np.ndarray | None = None
    prefix_done: bool = False


@dataclass
class BistreamLMRequest:
    """The prompt of one bistream sequence (text-in streaming, spec §3.8); its text ids are fed
    while it runs (``EngineLoop.generate(..., text=...)``, ``add_bistream`` / ``feed_text``)."""

    prompt_text_ids: np.ndarray
    prompt_speech_ids: np.ndarray
    seed: int | None = None


@dataclass
class TokenEvent:
    """Speech tokens of one request since its previous event.

    Attributes:
        request_id: the request.
        tokens: emitted speech ids, oldest first; empty when the step ended the request with a
            stop id (never emitted) or its only token was filtered out.
        finished / finish_reason: the request ended (``stop``, ``length``, ...).
        error: the request failed alone (it is finished): the message for its client.
        logits: (V,) of the step, only from an engine built with ``return_logits=True`` (tests).
        raw: every id the LLM emitted, before the serving layer's silent-token filter (what a
            continuation on another replica prefills, ``LMRequest.prefix``); None: ``tokens``.
        text_read: bistream requests only, one per token of ``tokens``: how many of the request's
            own text tokens (the prompt's excluded) the model had read when it produced that token
            (the 5 text : 15 speech interleave, spec §3.8): the model's own text-to-speech-token
            correspondence. None for a sentence piece (its whole text is read before any speech).
    """

    request_id: str
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logits: torch.Tensor | None = None
    raw: list[int] | None = None
    text_read: list[int] | None = None
