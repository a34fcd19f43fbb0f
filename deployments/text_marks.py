"""Where each text token's speech starts, from the LLM's own text-to-speech-token correspondence
(``AudioChunk.text_marks``; serve_app turns the marks into character times).

A sentence piece's LLM sequence reads its whole text before its first speech token, so all the
model tells is how many speech tokens the piece takes (``S``, known once the sequence has ended):
text token ``j`` of ``T`` starts at speech token ``j * S / T``. While the sequence still runs, the
model's trained rate stands in for ``S / T``: ``SPEECH_PER_TEXT`` speech tokens per text token
(CosyVoice2 and 3 interleave 5 text tokens with 15 speech tokens, spec §3.8).

A bistream sequence reads its text while it speaks: with each speech token the engine reports how
many of the request's own text tokens the model had read (``TokenEvent.text_read``). Text token
``j`` cannot be said before the first speech token produced after it was read (``a_j``); it starts
at ``p_j = max(a_j, p_{j-1} + SPEECH_PER_TEXT)`` (read, then said at the trained rate) while the
sequence runs, and once it has ended (``S`` known) the tokens not yet marked share what is left
evenly from the first of them, ``k``, on: ``p_j = max(a_j, s + (j - k) (S - s) / (N - k))`` with
``s = max(a_k, p_{k-1} + SPEECH_PER_TEXT)`` (at most ``S``).

A chunk made of speech tokens ``[lo, hi)`` marks each text token whose start is before ``hi`` and
that the model had read by then; the sequence's last chunk marks every one left. A mark is the
start's place in the chunk as a fraction of it (its speech tokens spread evenly over its audio).
With random weights the speech says nothing, so only this mechanism can be tested.
"""
from __future__ import annotations

import bisect

from deployments.protocol import TextMarks

SPEECH_PER_TEXT = 3.0  # the LLM's training interleave: 15 speech tokens per 5 text tokens


class TextMarker:
    """The marks of one LLM sequence's chunks (module docstring).

    Args:
        piece_tokens: a sentence piece's text tokens; None for a bistream sequence (its speech
            tokens come with ``text_read``).
    """

    def __init__(self, piece_tokens: int | None) -> None:
        self.piece_tokens = piece_tokens
        self.read: list[int] = []  # per speech token: text tokens read before it
        self.known = True  # False: a bistream runtime that does not report text_read
        self.spoken = 0  # speech tokens of the chunks marked so far
        self.marked = 0  # text tokens marked so far
        self._last = 0.0  # start of the last marked text token, in speech tokens

    def add(self, n_tokens: int, text_read: list[int] | None) -> None:
        if self.piece_tokens is not None:
            self.read += [self.piece_tokens] * n_tokens
        elif text_read is None or len(text_read) != n_tokens:
            self.known = False
        else:
            self.read += text_read

    def chunk(self, end: int, last: bool, done: bool) -> TextMarks | None:
        """The marks of the chunk of speech tokens ``[spoken, end)``; ``last``: the sequence's last
        chunk; ``done``: the sequence has ended (all its speech tokens are in ``read``)."""
        lo, hi = self.spoken, max(end, self.spoken)
        self.spoken = hi
        if not self.known:
            return None
        n = len(self.read)
        total = self.piece_tokens if self.piece_tokens is not None else (self.read[-1] if self.read else 0)
        readable = total if last else (self.read[min(hi, n) - 1] if min(hi, n) > 0 else 0)
        first, starts, prev = self.marked, [], self._last
        base = step = 0.0
        span = max(hi - lo, 1)
        for j in range(first, readable):
            a = bisect.bisect_right(self.read, j)  # the first speech token made after j was read
            if done:
                if j == first:
                    base = min(float(n), max(a, prev + SPEECH_PER_TEXT if j else 0.0))
                    step = (n - base) / (total - first)
                p = max(a, base + (j - first) * step)
            else:
                p = max(a, prev + SPEECH_PER_TEXT if j else 0.0)
            if p >= hi and not last:
                break
            starts.append(min(max((p - lo) / span, 0.0), 1.0))
            prev = p
        self.marked, self._last = first + len(starts), prev
        return TextMarks(first, starts) if starts else None
