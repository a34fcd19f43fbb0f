"""Bistream (text-in streaming) requests at the engine seam: the request type and the engine side.

A bistream request's text arrives while it decodes (spec §3.8). :class:`BistreamLMRequest` is
what the synthesizer queues in the engine loop instead of an
:class:`~deployments.runtime_protocol.LMRequest` (the prompt only; the text follows through
``EngineLoop.generate(..., text=...)``), and :class:`BistreamTokenEngine` adds the two calls
that need (``add_bistream``, ``feed_text``) to the production token engine, on top of
``LLMEngine.add_bistream_request`` / ``feed_text``.

Text ids are fed one id per chunk, as the official frontend streams them: the engine consumes
one chunk each time the model asks for text (a ``fill``), so a many-id chunk would be read 5 ids
at a time with its surplus left until the end of the text
(:mod:`cosyvoice_runtime.llm.bistream_seq`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deployments.runtime_protocol import LMRequest, TokenEvent


@dataclass
class BistreamLMRequest:
    """The prompt of one bistream sequence; its text is fed while it runs."""

    prompt_text_ids: np.ndarray
    prompt_speech_ids: np.ndarray
    seed: int | None = None


def one_id_per_chunk(ids: Sequence[int]) -> list[list[int]]:
    return [[int(i)] for i in ids]


class BistreamTokenEngine:
    """The production :class:`~deployments.runtime_protocol.TokenEngine` plus bistream requests.

    Wraps a ``RuntimeTokenEngine`` (its ``engine`` is the ``LLMEngine``): plain requests and
    the stepping go through it unchanged; bistream requests get CosyVoice3's silent-token filter
    here, as plain ones get it there, and a finish the engine reports as a protocol failure
    (official-quirk mode only) becomes this request's error.
    """

    def __init__(self, inner) -> None:
        from cosyvoice_runtime.llm.bistream_seq import FINISH_PROTOCOL
        from cosyvoice_runtime.llm.silent_tokens import SilentTokenFilter

        self.inner = inner
        self._protocol = FINISH_PROTOCOL
        self._filter_cls = SilentTokenFilter
        self._filters: dict[str, object] = {}

    @property
    def max_running(self) -> int:
        return self.inner.max_running

    def add(self, request_id: str, request: LMRequest) -> None:
        self.inner.add(request_id, request)

    def add_bistream(self, request_id: str, request: BistreamLMRequest) -> None:
        from cosyvoice_runtime.llm.sampling import SamplingParams

        spec = self.inner.spec
        params = SamplingParams.from_spec(spec.llm, seed=request.seed)
        self.inner.engine.add_bistream_request(request_id, request.prompt_text_ids, request.prompt_speech_ids, params)
        self._filters[request_id] = self._filter_cls(spec)

    def feed_text(self, request_id: str, ids: Sequence[int], end: bool) -> bool:
        return self.inner.engine.feed_text(request_id, one_id_per_chunk(ids), end)

    def step(self) -> list[TokenEvent]:
        events = self.inner.step()
        for ev in events:
            keep = self._filters.get(ev.request_id)
            if keep is None:
                continue
            ev.new_tokens = [t for t in ev.new_tokens if keep.keep(t)]
            if ev.finish_reason == self._protocol:
                ev.error = "the model produced a control id the bistream protocol does not allow"
            if ev.finished:
                del self._filters[ev.request_id]
        return events

    def abort(self, request_id: str) -> None:
        self.inner.abort(request_id)
        self._filters.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def num_running(self) -> int:
        return self.inner.num_running()

    def num_waiting(self) -> int:
        return self.inner.num_waiting()
