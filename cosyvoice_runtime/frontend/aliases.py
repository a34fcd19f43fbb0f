"""Pronunciation aliases: rules that replace a written form (a grapheme: a word, an acronym, a
name) by the text to read instead, applied to a request's text BEFORE normalisation.

A rule (:class:`AliasRule`, ElevenLabs' alias rule) has ``grapheme`` (``string_to_replace``),
``alias``, ``case_sensitive`` (default true) and ``word_boundaries`` (default true).

Matching (one pass over the text, :meth:`Lexicon.apply`):

* left to right; at each position the LONGEST rule that matches wins, and the text it matched is
  replaced; matching goes on after it (an alias is never matched again, rules do not chain);
* of two rules matching the same text, the one given first wins (request rules before
  dictionaries, dictionaries in the order named; :meth:`Lexicon.compile`);
* ``case_sensitive: false`` compares characters by their lower-case form (one character to one;
  a character whose lower case is several characters compares as itself);
* ``word_boundaries: true``: where the grapheme starts (ends) with a word character, the text
  before (after) the match must not be one. Word characters are letters, digits, ``_`` and
  combining marks, except Chinese characters and kana, which have no word boundaries (Chinese and
  Japanese text has no spaces: a rule for them matches inside a sentence). So ``NYC`` does not
  match in ``NYCE``, ``C++`` matches before a space, and ``.NET`` after one.

Cost: building is one dictionary entry per rule; applying looks, at each position whose
character starts some rule, at the distinct rule lengths of that character, longest first (a
slice and a hash each); inside a word only at those of rules that may match there. Text whose
characters start no rule costs one dictionary lookup per character. At most (text length x
distinct lengths <= ``MAX_GRAPHEME_CHARS``) lookups.
The output is bounded (``max_chars``): nothing is built past it.

:class:`AliasStream` applies a lexicon to text that arrives in pieces (a WebSocket's text),
holding back only what a longer rule could still match; :meth:`AliasStream.feed_mapped` also says
which output characters say each input character (a WebSocket's timestamps are of the text sent).
"""
from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cosyvoice_runtime.errors import InvalidInputError

MAX_GRAPHEME_CHARS = 100  # a rule's grapheme (ElevenLabs leaves it unbounded; a bound keeps matching cheap)
MAX_ALIAS_CHARS = 500


class AliasOverflowError(InvalidInputError):
    """The aliases would make the text longer than allowed."""


@dataclass(frozen=True, slots=True)
class AliasRule:
    grapheme: str
    alias: str
    case_sensitive: bool = True
    word_boundaries: bool = True

    def check(self) -> AliasRule:
        """``self`` if it is a usable rule; InvalidInputError saying why not."""
        if not isinstance(self.grapheme, str) or not self.grapheme.strip():
            raise InvalidInputError("a rule's string_to_replace must be a non-blank string")
        if len(self.grapheme) > MAX_GRAPHEME_CHARS:
            raise InvalidInputError(f"string_to_replace has {len(self.grapheme)} characters; the limit is "
                                    f"{MAX_GRAPHEME_CHARS}")
        if not isinstance(self.alias, str) or len(self.alias) > MAX_ALIAS_CHARS:
            raise InvalidInputError(f"a rule's alias must be a string of at most {MAX_ALIAS_CHARS} characters")
        return self


def _no_boundary(c: str) -> bool:
    """Chinese characters and kana: scripts written without spaces between words."""
    o = ord(c)
    return (0x3040 <= o <= 0x30FF or 0x3400 <= o <= 0x4DBF or 0x4E00 <= o <= 0x9FFF or 0xF900 <= o <= 0xFAFF
            or 0x20000 <= o <= 0x3FFFF)


def is_word_char(c: str) -> bool:
    """A character that continues a word (module docstring); ``""`` (the text's edge) is none."""
    if not c:
        return False
    if c.isalnum():
        return not _no_boundary(c)
    return c == "_" or unicodedata.category(c).startswith("M")


def fold(c: str) -> str:
    """One character's case-insensitive form (its lower case when that is one character)."""
    low = c.lower()
    return low if len(low) == 1 else c


def fold_text(text: str) -> str:
    """``text`` folded character by character: same length, so positions match."""
    return "".join(map(fold, text))


@dataclass(slots=True)
class Lexicon:
    """Compiled rules (:meth:`compile`); :meth:`apply` rewrites a text."""

    exact: dict[str, tuple[int, AliasRule]] = field(default_factory=dict)  # grapheme -> (order, rule)
    folded: dict[str, tuple[int, AliasRule]] = field(default_factory=dict)  # folded grapheme -> (order, rule)
    lengths: dict[str, tuple[int, ...]] = field(default_factory=dict)  # folded first char -> lengths, longest first
    # the same for the rules that may match inside a word (no word boundaries, or no word character first)
    inner: dict[str, tuple[int, ...]] = field(default_factory=dict)
    max_len: int = 0

    @classmethod
    def compile(cls, rule_lists: Iterable[Sequence[AliasRule]]) -> Lexicon:
        """Rules of several lists (request rules, then each dictionary), earlier ones first."""
        lex, lengths, inner, order = cls(), {}, {}, 0
        for rules in rule_lists:
            for rule in rules:
                table, key = (lex.exact, rule.grapheme) if rule.case_sensitive else (lex.folded,
                                                                                    fold_text(rule.grapheme))
                if key in table:
                    continue  # an earlier rule for the same text wins
                table[key] = (order, rule)
                order += 1
                n = len(rule.grapheme)
                first = fold(rule.grapheme[0])
                lengths.setdefault(first, set()).add(n)
                if not rule.word_boundaries or not is_word_char(rule.grapheme[0]):
                    inner.setdefault(first, set()).add(n)
                lex.max_len = max(lex.max_len, n)
        lex.lengths = {c: tuple(sorted(ns, reverse=True)) for c, ns in lengths.items()}
        lex.inner = {c: tuple(sorted(ns, reverse=True)) for c, ns in inner.items()}
        return lex

    def __bool__(self) -> bool:
        return bool(self.exact or self.folded)

    def __len__(self) -> int:
        return len(self.exact) + len(self.folded)

    def apply(self, text: str, max_chars: int | None = None) -> str:
        """``text`` with every match replaced by its alias (module docstring).

        Raises:
            AliasOverflowError: the result would pass ``max_chars``.
        """
        if not self:
            return text
        out, _, _ = self._scan(text, fold_text(text), "", len(text), True, max_chars)
        return out

    def _scan(self, text: str, folded: str, before: str, stop: int, final: bool,
              max_chars: int | None, matches: list[tuple[int, int, int]] | None = None) -> tuple[str, int, int]:
        """Rewrite ``text`` from its start; a match may start only before ``stop``. ``before``: the
        character preceding ``text`` ("" at the start). ``final``: ``text`` ends the stream (its
        end is a boundary). ``matches``, when given, gets (start, length, alias length) of each
        match. Returns (output, characters consumed, output length)."""
        parts, size, copied, i = [], 0, 0, 0
        n, lengths, inner = len(text), self.lengths, self.inner
        while i < stop:
            ns = lengths.get(folded[i])
            if ns:
                prev = before if i == 0 else text[i - 1]
                if is_word_char(prev) and is_word_char(text[i]):  # inside a word: only rules that may match there
                    ns = inner.get(folded[i])
            hit = self._longest(text, folded, i, prev, ns) if ns else None
            if hit is None:
                i += 1
                continue
            length, alias = hit
            size += i - copied + len(alias)
            if max_chars is not None and size > max_chars:
                raise AliasOverflowError(f"pronunciation aliases make the text longer than {max_chars} characters")
            parts.append(text[copied:i])
            parts.append(alias)
            if matches is not None:
                matches.append((i, length, len(alias)))
            i += length
            copied = i
        if final:
            size += n - copied
            if max_chars is not None and size > max_chars:
                raise AliasOverflowError(f"pronunciation aliases make the text longer than {max_chars} characters")
            parts.append(text[copied:])
            return "".join(parts), n, size
        parts.append(text[copied:i])
        return "".join(parts), i, size + i - copied

    def _longest(self, text: str, folded: str, i: int, prev: str, ns: tuple[int, ...]) -> tuple[int, str] | None:
        n = len(text)
        starts_word = is_word_char(text[i])
        for length in ns:
            j = i + length
            if j > n:
                continue
            best = None
            for table, key in ((self.exact, text[i:j]), (self.folded, folded[i:j])):
                found = table.get(key)
                if found is not None and (best is None or found[0] < best[0]):
                    rule = found[1]
                    if rule.word_boundaries and not _bounded(text, i, j, prev, starts_word):
                        continue
                    best = found
            if best is not None:
                return length, best[1].alias
        return None


def _bounded(text: str, i: int, j: int, prev: str, starts_word: bool) -> bool:
    if starts_word and is_word_char(prev):
        return False
    after = text[j] if j < len(text) else ""
    return not (is_word_char(text[j - 1]) and is_word_char(after))


class AliasStream:
    """A lexicon applied to text arriving in pieces: :meth:`feed` returns what is final (no rule
    could match differently once more text comes), :meth:`flush` the rest. The concatenated
    output equals ``lexicon.apply`` of the concatenated input. At most ``lexicon.max_len``
    characters are held back.

    Args:
        lexicon: the compiled rules.
        max_chars: most characters of output over the stream's life (AliasOverflowError past it).
    """

    def __init__(self, lexicon: Lexicon, max_chars: int | None = None) -> None:
        self.lexicon, self.max_chars = lexicon, max_chars
        self._held = ""
        self._before = ""  # the last character consumed (the start boundary of what is held)
        self._out = 0

    def feed(self, text: str) -> str:
        return self.feed_mapped(text)[0]

    def flush(self) -> str:
        return self.flush_mapped()[0]

    def feed_mapped(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """:meth:`feed`, and for each input character it consumed (the held ones come later), in
        order, the span ``[lo, hi)`` of the output that says it, as offsets over the stream's life:
        a copied character its own; a matched grapheme's characters share its alias in order
        (``NYC`` -> ``New York City``: ``N`` says ``New ``), an empty alias gives empty spans."""
        self._held += text
        # A match starting at i needs its longest candidate and the character after it: decided
        # only for i + max_len < len(held).
        return self._run(max(len(self._held) - self.lexicon.max_len, 0), final=False)

    def flush_mapped(self) -> tuple[str, list[tuple[int, int]]]:
        return self._run(len(self._held), final=True)

    def _run(self, stop: int, final: bool) -> tuple[str, list[tuple[int, int]]]:
        held = self._held
        if not self.lexicon:
            stop = len(held)
        if not held or (stop == 0 and not final):
            return "", []
        left = None if self.max_chars is None else self.max_chars - self._out
        matches: list[tuple[int, int, int]] = []
        out, used, size = self.lexicon._scan(held, fold_text(held), self._before, stop, final or not self.lexicon,
                                             left, matches)
        if used:
            self._before = held[used - 1]
        self._held = held[used:]
        spans = _spans(matches, used, self._out)
        self._out += size
        return out, spans


def _spans(matches: list[tuple[int, int, int]], used: int, out: int) -> list[tuple[int, int]]:
    """The output span of each of ``used`` input characters whose output starts at ``out``."""
    spans: list[tuple[int, int]] = []
    i = 0
    for at, length, n_alias in matches:
        spans += [(out + k, out + k + 1) for k in range(at - i)]
        out += at - i
        spans += [(out + k * n_alias // length, out + (k + 1) * n_alias // length) for k in range(length)]
        out += n_alias
        i = at + length
    spans += [(out + k, out + k + 1) for k in range(used - i)]
    return spans
