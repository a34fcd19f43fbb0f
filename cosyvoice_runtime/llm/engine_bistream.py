"""The bistream rows of the engine's batch (text-in streaming, spec §3.8).

Each bistream request of :class:`~cosyvoice_runtime.llm.engine.LLMEngine` is a
:class:`~cosyvoice_runtime.llm.bistream_seq.BistreamSequence` in :class:`BistreamRows`. Every
step routes the scheduled ones (:meth:`BistreamRows.route`): a row whose next input is its last
speech token joins the decode forward, one that must feed several positions (the prompt groups,
5 more text ids after a ``fill``, the final stage) the step's batched prefill forward as an
extension of its slot, one waiting for text is parked (it keeps its KV slot and takes no work
until :meth:`BistreamRows.feed`). After the forward, :meth:`BistreamRows.choose` picks each row's
next id from its logits with the sequence's own rules.
"""
from __future__ import annotations

import logging

import torch

from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.llm import token_choice
from cosyvoice_runtime.llm.bistream_seq import BistreamSequence
from cosyvoice_runtime.llm.generate import FINISH_LENGTH
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.scheduler import Scheduler
from cosyvoice_runtime.lm_messages import TokenEvent

logger = logging.getLogger(__name__)


class BistreamRows:
    """The engine's bistream requests by id, over its scheduler and KV cache.

    Args:
        scheduler: the engine's scheduler (slots, parking).
        cache: the engine's KV cache (a row whose next input does not fit its slot ends).
        return_logits: attach each chosen id's logits to its event.
    """

    def __init__(self, scheduler: Scheduler, cache: KVCache, return_logits: bool) -> None:
        self.scheduler, self.cache, self.return_logits = scheduler, cache, return_logits
        self.seqs: dict[str, BistreamSequence] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.seqs

    def add(self, request_id: str, seq: BistreamSequence) -> None:
        """Queue ``seq``; InvalidInputError when its prompt cannot fit in a KV slot."""
        try:
            self.scheduler.add(request_id, seq.prompt_positions + 1)
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from exc
        self.seqs[request_id] = seq

    def feed(self, request_id: str, chunks, end: bool, length: int | None) -> bool:
        """More text for a request (``BistreamSequence.feed``); False if it is unknown."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        seq.feed(chunks, end, length)
        self.scheduler.unpark(request_id)  # the next step advances it (or parks it again)
        return True

    def drop(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)

    def admit(self, prefill: list) -> list:
        """The scheduled prefills that are bistream prompts, given their slots; a prompt is fed
        once its text allows (:meth:`route`)."""
        admitted = [s for s in prefill if s.request_id in self.seqs]
        for s in admitted:
            self.seqs[s.request_id].state.slot = s.slot
            self.cache.reset(s.slot)
            self.scheduler.mark_prefilled(s.request_id)
        return admitted

    def route(self, scheduled: list, events: list[TokenEvent]) -> tuple[list, list]:
        """Bistream rows of this step: (one speech id to feed, several positions to feed);
        those waiting for text are parked, those that end now add their event."""
        feeds, extends = [], []
        for s in scheduled:
            seq = self.seqs[s.request_id]
            if not seq.decoding:
                seq.advance()
            if seq.finish_reason is not None:
                events.append(self.end(s.request_id, None))
            elif not seq.decoding:
                self.scheduler.park(s.request_id)
            elif self.cache.lengths[s.slot] + seq.num_pending() > self.cache.max_len:
                seq.finish_reason = FINISH_LENGTH  # the KV slot is full
                events.append(self.end(s.request_id, None))
            else:
                (feeds if seq.single_speech_feed() is not None else extends).append(s)
        return feeds, extends

    def choose(self, scheduled: list, seqs: list[BistreamSequence], logits: torch.Tensor,
               bad: set[int] | None = None) -> list[TokenEvent]:
        """Each bistream row's next id from its logits rows (bistream_decode's log-softmax and masks);
        ``bad``: the rows with NaN/Inf logits, when the static step marked them in its one copy to
        the host (else found here, one more reduction and sync)."""
        if not seqs:
            return []
        bad = token_choice.nonfinite_rows(logits) if bad is None else bad
        logp = logits.float().log_softmax(dim=-1)
        events = []
        for i, (s, seq) in enumerate(zip(scheduled, seqs)):
            if i in bad:
                logger.warning("request %s: non-finite logits (NaN/Inf); failing it alone", s.request_id)
                seq.finish_reason = token_choice.NONFINITE_LOGITS
                events.append(self.end(s.request_id, None))
                continue
            token = seq.choose(logp[i])
            kept = logits[i] if self.return_logits else None
            if seq.finish_reason is not None:
                events.append(self.end(s.request_id, token, kept))
            elif token is not None:
                events.append(TokenEvent(s.request_id, [token], logits=kept, text_read=[seq.text_read]))
        return events

    def end(self, request_id: str, token: int | None, logits: torch.Tensor | None = None) -> TokenEvent:
        seq = self.seqs.pop(request_id)
        seq.state.finished = True
        self.scheduler.finish(request_id)
        return TokenEvent(request_id, [] if token is None else [token], True, seq.finish_reason, logits=logits,
                         text_read=[] if token is None else [seq.text_read])
