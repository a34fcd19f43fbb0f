"""Character times of the ElevenLabs routes' text, from the synthesizer's text marks.

Each audio chunk comes with its :class:`~deployments.protocol.TextMarks`: where each text token
it starts to say begins, from the model's own text-to-speech-token correspondence
(deployments/text_marks.py). Here:

* a text token's characters: a sentence piece's characters spread evenly over its tokens (the
  tokenizer's own offsets are not sent); a bistream fragment's over its tokens;
* a token lasts from its start to the next token's start when the same chunk marks that one, else
  to the end of the chunk's audio; its characters share that span equally; characters between
  tokens (the space joining two pieces) take no time;
* the characters the client sent map onto the normalised text (what the model read) through a
  character alignment of the two (:func:`char_spans`, one bounded pass; a run that
  normalisation rewrote, "$5" -> "five dollars", shares the rewritten span in order); a character
  is released once its span's characters are;
* on the text-in WebSockets (bistream) the text is read as sent, except where the session's
  pronunciation aliases rewrote it: :class:`TextIn` follows each character sent to the characters
  read that say it (exactly, from the aliases' own matches) and hands them to the turn that reads
  them; the whitespace a session opens with (ElevenLabs' first ``" "``) is no text.

Times are monotonic, every character is released once, and nothing ends after the audio. A chunk
without marks (a runtime that reports none) leaves its text to the sequence's last chunk, which
spreads what is left over the audio since the last mark.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments.protocol import TextMarks

RESYNC_CHARS = 3  # characters both texts must share to agree again after a rewrite
RESYNC_WINDOW = 48  # how far ahead (characters) a rewrite may end in either text
MAX_RESYNCS = 2000  # differences mapped one by one per text; past them the rest is proportional


@dataclass
class CharSpans:
    """Characters with start and end times in seconds (one alignment object)."""

    chars: list[str]
    starts: list[float]
    ends: list[float]

    def http(self) -> dict:
        return {"characters": self.chars, "character_start_times_seconds": [round(t, 3) for t in self.starts],
                "character_end_times_seconds": [round(t, 3) for t in self.ends]}

    def ws(self, origin_s: float) -> dict:
        """ElevenLabs' WebSocket shape: ms from ``origin_s`` (the message's audio start), durations."""
        starts = [round((t - origin_s) * 1000) for t in self.starts]
        return {"chars": self.chars, "charStartTimesMs": starts,
                "charDurationsMs": [max(round((e - origin_s) * 1000) - s, 0) for s, e in zip(starts, self.ends)]}

    def __bool__(self) -> bool:
        return bool(self.chars)


def joined(spans: list[CharSpans]) -> CharSpans:
    return CharSpans([c for s in spans for c in s.chars], [t for s in spans for t in s.starts],
                     [t for s in spans for t in s.ends])


def char_spans(original: str, normalized: str) -> list[tuple[int, int]]:
    """For each character of ``original``, the span ``[lo, hi)`` of ``normalized`` that says it
    (empty where normalisation dropped it); both bounds are non-decreasing.

    Normalisation keeps the order of the text, so one pass suffices: equal characters (ignoring
    case) map one to one; at a difference, the nearest place where both texts agree again on
    ``RESYNC_CHARS`` characters (each text at most ``RESYNC_WINDOW`` ahead) closes the rewritten
    runs, which share their span in order ("$5" -> "five dollars"). Work is bounded: past
    ``MAX_RESYNCS`` differences, or without a place to agree again, the rest maps proportionally.
    """
    a, b = _folded(original), _folded(normalized)
    n, m = len(a), len(b)
    spans: list[tuple[int, int]] = []
    i = j = resyncs = 0
    while i < n and j < m:
        if a[i] == b[j]:
            spans.append((j, j + 1))
            i, j = i + 1, j + 1
            continue
        resyncs += 1
        skip = _resync(a, b, i, j) if resyncs <= MAX_RESYNCS else None
        if skip is None:
            break
        spans += _proportional(i, i + skip[0], j, j + skip[1])
        i, j = i + skip[0], j + skip[1]
    return spans + (_proportional(i, n, j, m) if i < n else [])


def _folded(text: str) -> str:
    return "".join(low if len(low := c.lower()) == 1 else c for c in text)


def _resync(a: str, b: str, i: int, j: int) -> tuple[int, int] | None:
    """(skip in a, skip in b) to the nearest place past (i, j) where both agree again, or None."""
    best = None
    for di in range(min(RESYNC_WINDOW, len(a) - i) + 1):
        if best is not None and di >= sum(best):
            break
        key = a[i + di:i + di + RESYNC_CHARS]
        if i + di == len(a):
            dj = len(b) - j  # both ends agree
        else:
            found = b.find(key, j, j + RESYNC_WINDOW + len(key))
            if found < 0 or (len(key) < RESYNC_CHARS and found + len(key) != len(b)):
                continue
            dj = found - j
        if (di or dj) and (best is None or di + dj < sum(best)):
            best = (di, dj)
    return best


def spread(n_chars: int, n_tokens: int) -> list[int]:
    """Characters of each of ``n_tokens`` tokens sharing ``n_chars`` in order (the first may get none)."""
    return [(k + 1) * n_chars // n_tokens - k * n_chars // n_tokens for k in range(n_tokens)] if n_tokens else []


def _proportional(i1: int, i2: int, j1: int, j2: int) -> list[tuple[int, int]]:
    n, m = i2 - i1, j2 - j1
    return [(j1 + k * m // n, j1 + (k + 1) * m // n) for k in range(n)]


class Aligner:
    """The alignment of one response (an HTTP request, a WebSocket stream of calls).

    ``sequence(char_counts)`` starts the next LLM sequence (a piece, a bistream turn): the
    normalised characters of each of its text tokens, in order; ``extend`` adds tokens to it
    (bistream text as it is pushed). ``chunk`` takes a chunk's marks and the span of its audio
    and returns the (original, normalised) characters it releases; ``finish`` the rest.
    """

    def __init__(self, original: str, normalized: str | None = None) -> None:
        self.original = original
        self.normalized = original if normalized is None else normalized
        self._map = None if normalized is None else char_spans(original, normalized)
        self._token_ends: list[int] = []  # normalised offset where each token of the sequence ends
        self._seq_start = 0  # normalised offset where the sequence starts
        self._n_starts: list[float] = []  # released normalised characters
        self._n_ends: list[float] = []
        self._o_done = 0  # released original characters
        self._o_last = (0.0, 0.0)  # start and end of the last released original character
        self._unmarked_since: float | None = None  # audio start of the chunks since the last mark
        self._marked = 0  # tokens of the sequence released

    # ---------------------------------------------------------------- text
    def sequence(self, char_counts: list[int], start: int | None = None) -> None:
        """The next sequence from normalised offset ``start`` (default: where the last one ended);
        characters skipped before it are said by no token."""
        self._seq_start = start if start is not None else (self._token_ends[-1] if self._token_ends else self._seq_start)
        self._token_ends, self._marked = [], 0
        self.extend(char_counts)

    def extend(self, char_counts: list[int]) -> None:
        end = self._token_ends[-1] if self._token_ends else self._seq_start
        for n in char_counts:
            end += n
            self._token_ends.append(end)

    def push(self, text: str, n_tokens: int, sent: str | None = None,
             spans: list[tuple[int, int]] | None = None) -> None:
        """Text not normalised (bistream) joins the text and the sequence: ``n_tokens`` tokens
        (none: its characters join the next push's tokens). ``sent``: the characters sent that it
        completes, ``spans`` where each is said in the sequence's text (an aligner made with a
        normalised text, ``Aligner("", "")``); without them ``text`` is what was sent."""
        self.normalized += text
        if sent is None or self._map is None:
            self.original += text
            if self._map is not None:
                end = len(self.normalized)
                self._map += [(k, k + 1) for k in range(end - len(text), end)]
        else:
            self.original += sent
            self._map += spans or []
        end = self._token_ends[-1] if self._token_ends else self._seq_start
        self.extend(spread(len(self.normalized) - end, n_tokens))

    # ---------------------------------------------------------------- time
    def chunk(self, marks: TextMarks | None, start_s: float, end_s: float, last: bool) -> tuple[CharSpans, CharSpans]:
        n0, o0 = len(self._n_starts), self._o_done
        if self._unmarked_since is None:
            self._unmarked_since = start_s
        if marks is not None:
            times = [start_s + f * (end_s - start_s) for f in marks.starts]
            for k, t in enumerate(times):
                token = marks.first + k
                if token >= len(self._token_ends) or token < self._marked:
                    continue  # a mark for text this side does not know (cannot happen unless a runtime errs)
                self._release_token(token, t, times[k + 1] if k + 1 < len(times) else end_s)
            self._unmarked_since = None
        if last:
            self._release_rest(self._unmarked_since if self._unmarked_since is not None else end_s, end_s)
            self._unmarked_since = None
        return self._original_since(o0), self._normalized_since(n0)

    def finish(self, end_s: float) -> tuple[CharSpans, CharSpans]:
        """Every character not yet released, at ``end_s`` (text that made no audio)."""
        n0, o0 = len(self._n_starts), self._o_done
        self._release_to(len(self.normalized), end_s, end_s)
        return self._original_since(o0, final=True), self._normalized_since(n0)

    def _release_token(self, token: int, start_s: float, end_s: float) -> None:
        for j in range(self._marked, token):  # tokens skipped (no mark): no time, at this start
            self._release_to(self._token_ends[j], start_s, start_s)
        own = self._token_ends[token - 1] if token else self._seq_start
        self._release_to(own, start_s, start_s)
        self._release_to(self._token_ends[token], start_s, max(end_s, start_s))
        self._marked = token + 1

    def _release_rest(self, start_s: float, end_s: float) -> None:
        if self._marked < len(self._token_ends):
            self._release_to(self._token_ends[-1], max(start_s, self._last_end()), end_s)
            self._marked = len(self._token_ends)

    def _last_end(self) -> float:
        return self._n_ends[-1] if self._n_ends else 0.0

    def _release_to(self, end: int, start_s: float, end_s: float) -> None:
        """Normalised characters up to offset ``end``, sharing ``[start_s, end_s]`` equally."""
        lo = len(self._n_starts)
        n = min(end, len(self.normalized)) - lo
        if n <= 0:
            return
        start_s = max(start_s, self._last_end())
        end_s = max(end_s, start_s)
        step = (end_s - start_s) / n
        self._n_starts += [start_s + k * step for k in range(n)]
        self._n_ends += [start_s + (k + 1) * step for k in range(n)]

    def _normalized_since(self, n0: int) -> CharSpans:
        return CharSpans(list(self.normalized[n0:len(self._n_starts)]), self._n_starts[n0:], self._n_ends[n0:])

    def _original_since(self, o0: int, final: bool = False) -> CharSpans:
        if self._map is None:  # the text was not normalised: the same characters
            self._o_done = len(self._n_starts)
            return CharSpans(list(self.original[o0:self._o_done]), self._n_starts[o0:self._o_done],
                             self._n_ends[o0:self._o_done])
        done = len(self._n_starts)
        chars, starts, ends = [], [], []
        while self._o_done < len(self.original):
            lo, hi = self._map[self._o_done]
            if not final and (hi > done or not done):  # before any is said, one said by none has no time
                break
            if hi > lo:
                start, end = self._n_starts[lo], self._n_ends[hi - 1]
            else:  # dropped by normalisation: no time, where its neighbour ends
                start = end = self._n_ends[lo - 1] if 0 < lo <= done else (self._n_starts[lo] if lo < done else
                                                                            self._last_end())
            start, end = max(start, self._o_last[0]), max(end, self._o_last[1])
            self._o_last = (start, max(end, start))
            chars.append(self.original[self._o_done])
            starts.append(start)
            ends.append(max(end, start))
            self._o_done += 1
        return CharSpans(chars, starts, ends)


class PieceAligner(Aligner):
    """An :class:`Aligner` over normalised sentence pieces (the HTTP routes, stream-input's
    sentence mode): ``pieces`` are (text, text tokens) in the order spoken, joined by one space."""

    def __init__(self, original: str, pieces: list[tuple[str, int]]) -> None:
        super().__init__(original, " ".join(text for text, _ in pieces))
        self._pieces = pieces
        self._offsets = [sum(len(t) + 1 for t, _ in pieces[:p]) for p in range(len(pieces))]
        self._piece = -1

    def piece_chunk(self, piece: int, marks: TextMarks | None, start_s: float, end_s: float,
                    last: bool) -> tuple[CharSpans, CharSpans]:
        if piece != self._piece:
            self._piece = piece
            text, n_tokens = self._pieces[piece]
            self.sequence(spread(len(text), n_tokens), self._offsets[piece])
        return self.chunk(marks, start_s, end_s, last)


class TextIn:
    """A text-in session's text: the pieces the model reads (the text sent, through the session's
    aliases, then cut into words), each with the characters sent that it completes.

    A character sent goes with the piece that ends its span, at its span in that piece's turn (a
    span begun in an earlier turn, an alias cut by a turn bound, is cut to this turn). Characters
    said by nothing a turn reads (whitespace between turns, an empty alias) go with the next turn,
    at its start, taking no time; the whitespace the session opens with is no text.

    Args:
        cutter: ``feed(text) -> piece`` / ``flush() -> piece`` (serve_app/stream_input.py
            ``WordCutter``).
        aliases: the session's :class:`~cosyvoice_runtime.frontend.aliases.AliasStream`, or None.
    """

    def __init__(self, cutter: Any, aliases: Any | None = None) -> None:
        self.cutter, self.aliases = cutter, aliases
        self._unmapped = ""  # sent, not yet through the aliases
        self._pending: list[tuple[str, int, int]] = []  # (character sent, span read) not yet in a piece
        self._read = 0  # characters read (through the aliases) so far
        self._cut = 0  # of them, in pieces so far
        self._turn = 0  # where the turn's text starts
        self._text = False  # a non-blank character was sent

    def piece(self, text: str | None, new_turn: bool) -> tuple[str, str, list[tuple[int, int]]]:
        """The next piece for ``text`` sent (None: the end or a flush: all that is held), the
        first of a turn when ``new_turn`` (no leading whitespace): (piece, characters sent it
        completes, their spans in the turn's text). An empty piece completes none."""
        self._unmapped += text or ""
        if self.aliases is None:
            read, spans = self._unmapped, [(self._read + k, self._read + k + 1) for k in range(len(self._unmapped))]
        else:
            read, spans = self.aliases.feed_mapped(text) if text is not None else self.aliases.flush_mapped()
        self._map(spans, len(read))
        piece = self.cutter.feed(read) + (self.cutter.flush() if text is None else "")
        self._cut += len(piece)
        if new_turn:
            piece = piece.lstrip()
            self._turn = self._cut - len(piece)
        if not piece:
            return "", "", []
        done = 0
        while done < len(self._pending) and self._pending[done][2] <= self._cut:
            done += 1
        taken, self._pending = self._pending[:done], self._pending[done:]
        turn = self._turn
        return (piece, "".join(c for c, _, _ in taken),
                [(max(lo - turn, 0), max(hi - turn, 0)) for _, lo, hi in taken])

    def _map(self, spans: list[tuple[int, int]], n_read: int) -> None:
        sent, self._unmapped = self._unmapped[:len(spans)], self._unmapped[len(spans):]
        for c, (lo, hi) in zip(sent, spans):
            if self._text or not c.isspace():
                self._text = True
                self._pending.append((c, lo, hi))
        self._read += n_read
