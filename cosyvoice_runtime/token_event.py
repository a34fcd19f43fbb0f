"""The one token-event type, from the engine's step to the serving layer's consumer.

:meth:`LLMEngine.step <cosyvoice_runtime.llm.engine.LLMEngine.step>` returns one per request it
advanced (at most one token each); the serving adapter passes them on with its silent-token
filter applied and a failure turned into ``error``; the replica's engine loop hands a consumer
every token since it last looked, as one event. Torch-free (``logits`` is only annotated), so the
serving layer's protocol module imports it without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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
    """

    request_id: str
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logits: torch.Tensor | None = None
