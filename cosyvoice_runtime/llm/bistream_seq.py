"""One bistream request inside the batched engine: §3.8's state machine, turned inside out.

:func:`~cosyvoice_runtime.llm.bistream.bistream_decode` runs one request to its end and pulls
text chunks in its own loop, blocking when it needs text. The engine cannot block: it steps
many requests at once. :class:`BistreamSequence` keeps the same decisions as host-side state,
and the engine drives it:

* :meth:`feed` queues text chunks (and the end of the text, with the text's exact speech length
  under the ``text_rate`` rule) as they arrive;
* :meth:`advance` consumes queued chunks exactly as ``bistream_decode`` pulls them - one chunk
  each time the request needs text (at the start, and after every ``fill``), never merged - until
  there is input to feed (``decoding``), or no chunk is left (the engine parks the request: it
  keeps its KV slot but takes no decode work until :meth:`feed`), or the text has ended (the
  final stage starts);
* :meth:`take_input` hands out the input of the next forward, :meth:`choose` takes the
  log-probabilities that forward produced and applies the forced fills, the masks, the sampler,
  the final stage and the length cap.

Same chunks and the same sampler therefore give the same tokens as ``bistream_decode``,
whatever the timing of their arrival (tests/runtime/test_llm_engine_bistream.py). NOTE:
because a chunk is consumed per fill, a many-id chunk leaves its surplus in the text cache
until the text ends (as the official frontend, which yields one id at a time, never does): the
serving layer feeds one id per chunk.

Inputs are kept as id segments and embedded by the engine at forward time, so feeding text is
host work only (no device access off the engine's step).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import torch

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID, LLMSpec
from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.llm.bistream import (
    BistreamState,
    SampleFn,
    default_sample_fn,
    final_mask_ids,
    first_fill_index,
    interleaved_mask_ids,
)
from cosyvoice_runtime.llm.generate import FINISH_LENGTH, FINISH_STOP
from cosyvoice_runtime.llm.sampling import mask_ids_

SOS, TASK, TEXT, SPEECH = "sos", "task_id", "text", "speech"
Segment = tuple[str, tuple[int, ...]]  # (kind, ids); sos and task_id carry no ids
FINISH_PROTOCOL = "bistream_protocol"  # a control id other than fill/eos was produced (quirk mode only)


def segment_positions(segments: Sequence[Segment]) -> int:
    return sum(len(ids) if kind in (TEXT, SPEECH) else 1 for kind, ids in segments)


class BistreamSequence:
    """See the module docstring.

    Args:
        spec: the LLM spec (family, special ids, ``mix_ratio``).
        prompt_text_ids / prompt_speech_ids: the prompt (CV3: the text must hold
            ``<|endofprompt|>``; everything up to it is fed first, not interleaved).
        state: the request's :class:`BistreamState` (tokens include fills, as RAS sees them).
        official_quirks: bistream.py's three official behaviours (see its module docstring).
        max_tokens: cap on emitted tokens; None: as ``bistream_decode`` (``max_token_text_ratio``
            x the target text length, set when the final stage starts; none with quirks).

    Raises:
        InvalidInputError: CV3 prompt text without ``<|endofprompt|>``.
    """

    def __init__(self, spec: LLMSpec, prompt_text_ids: Iterable[int], prompt_speech_ids: Iterable[int],
                 state: BistreamState, *, official_quirks: bool = False, max_tokens: int | None = None,
                 sample_fn: SampleFn = default_sample_fn) -> None:
        self.spec, self.state, self.quirks = spec, state, official_quirks
        self.max_tokens, self.sample_fn = max_tokens, sample_fn
        self.n_text, self.n_speech = spec.mix_ratio
        prompt_text = [int(i) for i in prompt_text_ids]
        self.pending: list[Segment] = [(SOS, ())]  # input appended but not yet fed
        if spec.family == "cosyvoice3":
            if ENDOFPROMPT_TOKEN_ID not in prompt_text:
                raise InvalidInputError(f"CosyVoice3 bistream needs <|endofprompt|> (id {ENDOFPROMPT_TOKEN_ID}) "
                                        "in the prompt text")
            cut = prompt_text.index(ENDOFPROMPT_TOKEN_ID) + 1
            self.pending.append((TEXT, tuple(prompt_text[:cut])))
            prompt_text = prompt_text[cut:]
        self.text_cache: list[int] = prompt_text
        self._prompt_cached = len(prompt_text)  # prompt ids still at the head of text_cache
        self.text_read = 0  # the request's own text ids fed to the model (TokenEvent.text_read)
        self.prompt_speech: list[int] = [int(i) for i in prompt_speech_ids]
        self.prompt_positions = segment_positions(self.pending) + len(prompt_text) + len(self.prompt_speech)
        state.next_fill = first_fill_index(len(self.prompt_speech), self.n_speech, official_quirks)
        self.groups_appended = False
        self.last_fed: list[Segment] = []
        self.chunks: deque[list[int]] = deque()
        self.text_ended = False
        self.exact = False  # the final stage ends at max_tokens, never at eos (feed's length)
        self.decoding = False  # there is input to feed (or a forward's result to take)
        self.finish_reason: str | None = None

    # -- text side -------------------------------------------------------------------------
    def feed(self, chunks: Iterable[Sequence[int]], end: bool = False, length: int | None = None) -> None:
        """Queue text chunks (each as ``bistream_decode`` would receive it); ``end``: no more text.

        ``length`` (with ``end``): the speech tokens the whole text is said in (the ``text_rate``
        rule, :mod:`cosyvoice_runtime.speech_length`): the final stage masks eos until that many
        have been emitted and ends there; one whose interleaved stage (3 speech tokens per text
        token) already emitted more ends as soon as the text has ended.
        """
        if self.text_ended:
            raise InvalidInputError("bistream: text arrived after the end of the text")
        self.chunks.extend([int(i) for i in chunk] for chunk in chunks)
        self.text_ended = end
        if end and length is not None:
            self.max_tokens = max(1, length) if self.max_tokens is None else min(self.max_tokens, max(1, length))
            self.exact = True

    def advance(self) -> bool:
        """Consume queued chunks until there is input to feed; False: parked (waiting for text) or finished."""
        while not self.decoding and self.finish_reason is None:
            if self.chunks:
                self._take(self.chunks.popleft())
            elif self.text_ended:
                self._enter_final()
            else:
                return False
        return self.decoding

    def _take(self, chunk: list[int]) -> None:
        st, n_text, n_speech = self.state, self.n_text, self.n_speech
        st.text_seen += len(chunk)
        self.text_cache += chunk
        while self.prompt_speech and len(self.text_cache) >= n_text:
            self.pending += [(TEXT, tuple(self.text_cache[:n_text])), (SPEECH, tuple(self.prompt_speech[:n_speech]))]
            self.text_cache, self.prompt_speech = self.text_cache[n_text:], self.prompt_speech[n_speech:]
            self._read(n_text)
            self.groups_appended = True
        if self.prompt_speech:
            return  # wait for text to pair with the remaining prompt speech
        at_start = not st.tokens and not self.groups_appended
        if at_start or (st.tokens and st.tokens[-1] == self.spec.fill):
            if len(self.text_cache) < n_text:
                return
            self.pending.append((TEXT, tuple(self.text_cache[:n_text])))
            self.text_cache = self.text_cache[n_text:]
            self._read(n_text)
        self.decoding = True

    def _read(self, n: int) -> None:
        """``n`` ids left the head of the text cache for the model's input."""
        prompt = min(n, self._prompt_cached)
        self._prompt_cached -= prompt
        self.text_read += n - prompt

    def _enter_final(self) -> None:
        """Text ended: remaining text, task_id (and unpaired prompt speech), then decode until eos."""
        st = self.state
        st.final = True
        head = self.pending if (self.pending or not self.quirks) else self.last_fed
        tail = [(SPEECH, tuple(self.prompt_speech))] if self.prompt_speech and not self.quirks else []
        self.pending = [*head, (TEXT, tuple(self.text_cache)), (TASK, ()), *tail]
        self._read(len(self.text_cache))
        self.text_cache, self.prompt_speech = [], []
        if self.max_tokens is None and not self.quirks:
            self.max_tokens = max(int(st.text_seen * self.spec.max_token_text_ratio), len(st.emitted) + 1)
        if self.max_tokens is not None and len(st.emitted) >= self.max_tokens:
            self.finish_reason = FINISH_LENGTH
            return
        self.decoding = True

    # -- model side ------------------------------------------------------------------------
    def num_pending(self) -> int:
        return segment_positions(self.pending)

    def single_speech_feed(self) -> int | None:
        """The speech id when the next input is just the last emitted token (a plain decode row)."""
        if len(self.pending) == 1 and self.pending[0][0] == SPEECH and len(self.pending[0][1]) == 1:
            return self.pending[0][1][0]
        return None

    def take_input(self) -> list[Segment]:
        """The next forward's input; it becomes ``last_fed`` (the official final stage re-feeds it)."""
        fed, self.pending = self.pending, []
        self.last_fed = fed
        return fed

    def choose(self, logp: torch.Tensor) -> int | None:
        """The id after a forward, from its float32 log-probabilities (V,) (masked in place).

        Returns the emitted speech id, or None (fill: the request wants text; or it finished:
        ``finish_reason`` is set).
        """
        st, spec = self.state, self.spec
        if not st.final:
            if len(st.tokens) == st.next_fill:
                token = spec.fill
                st.next_fill += self.n_speech + 1
            else:
                token = self.sample_fn(mask_ids_(logp, interleaved_mask_ids(spec, self.quirks)), st)
            if token == spec.fill:
                st.next_fill = len(st.tokens) + self.n_speech + 1
        else:
            early = self.exact and len(st.emitted) < self.max_tokens  # eos too: the length is the rule's
            token = self.sample_fn(mask_ids_(logp, spec.stop_ids if early else final_mask_ids(spec, self.quirks)), st)
        st.tokens.append(token)
        if token >= spec.speech_token_size:
            if token == spec.fill and not st.final:
                self.decoding = False
            elif token == spec.eos and st.final:
                self._finish(FINISH_STOP)
            else:
                self._finish(FINISH_PROTOCOL)
            return None
        st.emitted.append(token)
        self.pending = [(SPEECH, (token,))]
        if st.final and self.max_tokens is not None and len(st.emitted) >= self.max_tokens:
            self._finish(FINISH_LENGTH)
        return token

    def _finish(self, reason: str) -> None:
        self.finish_reason, self.decoding = reason, False
        self.state.finished = True


def embed_segments(model, segments: Sequence[Segment], device: torch.device) -> torch.Tensor:
    """(T, H) input embeddings of id segments (the same lookups ``bistream_decode`` concatenates)."""
    parts = []
    for kind, ids in segments:
        if kind == SOS:
            parts.append(model.sos_embedding()[None])
        elif kind == TASK:
            parts.append(model.task_id_embedding()[None])
        elif ids:
            table = model.embed_text if kind == TEXT else model.embed_speech
            parts.append(table(torch.tensor(ids, dtype=torch.long, device=device)))
    return torch.cat(parts)
