"""Sentence splitting (`split_paragraph`, spec §2.2), incremental so long texts stream out.

:class:`ParagraphSplitter` is fed normalised text block by block and returns the segments that
are final so far; feeding a whole text at once and calling :meth:`finish` gives exactly the
reference ``split_paragraph`` result, with two deliberate additions:

* ``max_piece_len``: a sentence piece longer than this (in the length measure: zh characters, en
  tokens) is cut at its last soft break (comma, enumeration comma, space) within the limit, or
  hard at the limit. The reference has no such cap (a 20,000-character text without punctuation
  would be one LLM request); with it no segment exceeds ``token_max_n + max_piece_len``.
* a quote right after a sentence mark with no earlier piece (``'。"...'``) starts the next piece
  instead of crashing (the reference pops from an empty list).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Lang = Literal["zh", "en"]

ZH_SENTENCE_END = frozenset("。？！；：、.?!;")
EN_SENTENCE_END = frozenset(".?!;:")
COMMAS = frozenset("，,")
CLOSING_QUOTES = frozenset('"”')
SOFT_BREAKS = frozenset("，,、；; ")


@dataclass(frozen=True, slots=True)
class SplitParams:
    """Reference values (used by every official entry point)."""

    token_max_n: int = 80
    token_min_n: int = 60
    merge_len: int = 20
    comma_split: bool = False
    max_piece_len: int = 80


def sentence_marks(lang: Lang, comma_split: bool = False) -> frozenset[str]:
    marks = ZH_SENTENCE_END if lang == "zh" else EN_SENTENCE_END
    return marks | COMMAS if comma_split else marks


def cut_to_length(text: str, limit: int, length: Callable[[str], int]) -> tuple[str, str]:
    """Split ``text`` into (head, rest) with ``length(head) <= limit``, preferring a soft break.

    ``length`` must be monotone in the prefix length. The head is never empty.
    """
    if length(text) <= limit:
        return text, ""
    cuts = [i + 1 for i, c in enumerate(text[:-1]) if c in SOFT_BREAKS]
    # Largest soft-break cut whose prefix fits (binary search: prefix length is monotone).
    k = _bsearch(cuts, text, limit, length)
    if k > 0:
        p = cuts[k - 1]
        return text[:p], text[p:]
    lo, hi = 1, len(text)  # hard cut: largest prefix that fits, at least one character
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length(text[:mid]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo], text[lo:]


def _bsearch(cuts: list[int], text: str, limit: int, length: Callable[[str], int]) -> int:
    lo, hi = 0, len(cuts)  # number of cuts whose prefix fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length(text[: cuts[mid - 1]]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ParagraphSplitter:
    """Incremental `split_paragraph`: ``feed(block) -> ready segments``, ``finish() -> the rest``.

    Holds back one sentence piece (a following quote may still attach to it) and one merged
    segment (a short final remainder is appended to the last segment).
    """

    def __init__(self, lang: Lang, length: Callable[[str], int] | None = None, params: SplitParams = SplitParams()):
        self.lang = lang
        self.params = params
        self.length = length if length is not None else len
        self.marks = sentence_marks(lang, params.comma_split)
        self._buf = ""  # text not yet scanned into pieces
        self._piece: str | None = None  # last emitted piece (may still receive a quote)
        self._cur = ""  # merge accumulator
        self._segment: str | None = None  # last flushed segment (may still receive the remainder)
        self._out: list[str] = []

    # -- scanning ---------------------------------------------------------------------------
    def feed(self, text: str) -> list[str]:
        self._buf += text
        self._scan(final=False)
        return self._take()

    def finish(self) -> list[str]:
        # The reference appends a sentence mark when the text does not end with one; if the
        # buffer is empty the text ended with a (scanned) mark and a quote, where it is a no-op.
        if self._buf and self._buf[-1] not in self.marks:
            self._buf += "。" if self.lang == "zh" else "."
        self._scan(final=True)
        if self._piece is not None:
            self._merge(self._piece)
            self._piece = None
        p = self.params
        if self._cur:
            if self._segment is not None and self.length(self._cur) < p.merge_len:
                self._segment += self._cur
            else:
                self._flush_segment(self._cur)
            self._cur = ""
        if self._segment is not None:
            self._out.append(self._segment)
            self._segment = None
        return self._take()

    def _scan(self, final: bool) -> None:
        buf, st, i = self._buf, 0, 0
        n = len(buf)
        while i < n:
            c = buf[i]
            if c in self.marks:
                if i + 1 >= n and not final:
                    break  # need the next character to know whether a quote follows
                if i > st:
                    self._emit_piece(buf[st:i] + c)
                if i + 1 < n and buf[i + 1] in CLOSING_QUOTES:
                    if self._piece is not None:
                        self._piece += buf[i + 1]
                        st = i + 2
                    else:
                        st = i + 1  # no piece to attach it to: the quote opens the next one
                    i += 2
                    continue
                st = i + 1
            i += 1
        rest = buf[st:]
        # A long run without sentence marks: cut pieces off its head so the text keeps streaming.
        limit = self.params.max_piece_len
        while len(rest) > limit and self.length(rest) > limit:
            head, rest = cut_to_length(rest, limit, self.length)
            if not rest:
                rest = head
                break
            self._emit_piece(head)
        self._buf = rest

    # -- pieces -> segments -----------------------------------------------------------------
    def _emit_piece(self, piece: str) -> None:
        limit = self.params.max_piece_len
        while self.length(piece) > limit:
            head, piece = cut_to_length(piece, limit, self.length)
            self._push_piece(head)
            if not piece:
                return
        self._push_piece(piece)

    def _push_piece(self, piece: str) -> None:
        if self._piece is not None:
            self._merge(self._piece)
        self._piece = piece

    def _merge(self, piece: str) -> None:
        p = self.params
        if self.length(self._cur + piece) > p.token_max_n and self.length(self._cur) > p.token_min_n:
            self._flush_segment(self._cur)
            self._cur = ""
        self._cur += piece

    def _flush_segment(self, segment: str) -> None:
        if self._segment is not None:
            self._out.append(self._segment)
        self._segment = segment

    def _take(self) -> list[str]:
        out, self._out = self._out, []
        return out


def split_paragraph(text: str, lang: Lang, length: Callable[[str], int] | None = None,
                    params: SplitParams = SplitParams()) -> list[str]:
    """One-shot form of :class:`ParagraphSplitter` (the reference function's signature, roughly)."""
    if not text:
        return []
    splitter = ParagraphSplitter(lang, length, params)
    return splitter.feed(text) + splitter.finish()
