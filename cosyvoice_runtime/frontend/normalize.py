"""Text normalisation (spec §2.1) with wetext 0.1.8, streamed block by block.

Semantics are those of the reference ``text_normalize`` (wetext backend) with these deliberate
differences, each documented where it is implemented:

* our pre/post rules (:mod:`rules`) fix what wetext gets wrong (thousands separators, money,
  English ordinals/decades in Chinese text) and clean invisible characters;
* wetext never raises through us: a failing call is retried on script runs and, where it still
  fails, the raw run is kept (and logged) -- text is never lost;
* the text is processed in blocks cut at sentence boundaries, so a 20,000-character input yields
  its first segments after normalising only its first blocks (:meth:`TextNormalizer.iter_segments`).
  Context-dependent steps (the zh space rule) see the neighbouring blocks' characters, so the
  result equals processing the whole text at once.

wetext is only invoked on blocks that contain a digit, as in the reference (wetext 0.0.4's
``normalize`` is a no-op otherwise; 0.1.8's English grammar would also rewrite abbreviations).
"""
from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator

from cosyvoice_runtime.frontend import rules
from cosyvoice_runtime.frontend.split import Lang, ParagraphSplitter, SplitParams

logger = logging.getLogger(__name__)

DEFAULT_SPLIT_PARAMS = SplitParams()  # immutable: safe as a shared default

# Blocks end after one of these (plus closing quotes and whitespace); a cut never lands next to
# '-' or '—' so the multi-character zh rules (" - ", "——") never straddle two blocks.
_STRONG_END = frozenset("。！？；!?;\n")
_WEAK_END = frozenset(".:：")  # only followed by whitespace (not "3.5", not "10:30")
_TRAILERS = frozenset('"”’\'）)】」』')
_NO_CUT_BEFORE = frozenset("-—")
MAX_BLOCK_CHARS = 400
_LATIN_LIMIT = 0x250  # Basic Latin .. Latin Extended-B: what the English grammar accepts
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
_DIGIT = re.compile(r"\d")


def _wetext_engines() -> tuple[object, object] | None:
    try:
        from wetext import Normalizer
    except Exception as exc:  # noqa: BLE001 - wetext is a hard dependency in production  # pragma: no cover
        logger.warning("wetext unavailable (%s): only the rule-based normalisation runs", exc)
        return None
    # Explicit languages: the zh branch uses the zh grammar for the whole text, as the
    # reference's whole-text call does, even for blocks without CJK characters.
    return (Normalizer(lang="zh", operator="tn", remove_erhua=False), Normalizer(lang="en", operator="tn"))


def is_only_punctuation(text: str) -> bool:
    """True for pieces the reference drops: empty, or only punctuation/symbols (and whitespace)."""
    return all(unicodedata.category(c)[0] in "PSZ" or c.isspace() for c in text)


def iter_blocks(text: str, max_chars: int = MAX_BLOCK_CHARS) -> Iterator[str]:
    """Cut ``text`` into consecutive blocks at sentence boundaries (``"".join`` gives ``text``)."""
    n, st, i = len(text), 0, 0
    while i < n:
        c = text[i]
        end = None
        if c in _STRONG_END or (c in _WEAK_END and (i + 1 >= n or text[i + 1].isspace())):
            end = i + 1
            while end < n and text[end] in _TRAILERS:
                end += 1
            while end < n and text[end].isspace():
                end += 1
            if end < n and text[end] in _NO_CUT_BEFORE:
                end = None
        elif i - st + 1 >= max_chars:
            end = _soft_cut(text, st, i + 1)
        if end is not None:
            yield text[st:end]
            st = i = end
            continue
        i += 1
    if st < n:
        yield text[st:]


def _soft_cut(text: str, st: int, hard: int) -> int:
    """Cut position in (st, hard]: after the last whitespace/comma, never inside a number."""
    for p in range(hard, st + max(1, (hard - st) // 2), -1):
        left, right = text[p - 1], text[p] if p < len(text) else ""
        if (left.isspace() or left in "，,、") and right not in _NO_CUT_BEFORE and not right.isspace():
            return p
    for p in range(hard, st, -1):  # no soft break: any cut that does not split digits
        right = text[p] if p < len(text) else ""
        if not (text[p - 1].isdigit() or text[p - 1] in ".,") or not right.isdigit():
            return p
    return hard


def zh_blank_rule(block: str, left: str, right: str) -> str:
    """Reference ``replace_blank``: keep a space only between two ASCII non-space characters.

    ``left``/``right`` are the characters just outside the block ('' at the text edges).
    """
    w = left + block + right
    off = len(left)
    out = []
    for i in range(off, off + len(block)):
        c = w[i]
        if c == " ":
            prev = w[i - 1] if i > 0 else ""
            nxt = w[i + 1] if i + 1 < len(w) else ""
            if not (prev.isascii() and prev not in ("", " ") and nxt.isascii() and nxt not in ("", " ")):
                continue
        out.append(c)
    return "".join(out)


def zh_local_rules(text: str) -> str:
    """Reference steps 6.4-6.7 (character-local; blocks never split their patterns)."""
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    for ch in ("（", "）", "【", "】", "`"):
        text = text.replace(ch, "")
    return text.replace("——", " ")


class TextNormalizer:
    """Normalise and split text for synthesis. Never raises on a string input.

    Args:
        use_wetext: run the wetext grammars (else only the rule-based steps, the reference's
            "none" backend).
        split_params: sentence-splitting constants (§2.2) plus our ``max_piece_len``.
        en_length: length measure of English pieces (reference: number of Qwen2 tokens); the
            frontend passes its tokenizer's. Defaults to a word+punctuation count.
    """

    def __init__(self, use_wetext: bool = True, split_params: SplitParams = DEFAULT_SPLIT_PARAMS,
                 en_length: Callable[[str], int] | None = None) -> None:
        self._engines = _wetext_engines() if use_wetext else None
        self.split_params = split_params
        self.en_length = en_length or _approx_en_length

    # -- public API -------------------------------------------------------------------------
    def normalize(self, text: str | Iterable[str], split: bool = True, text_frontend: bool = True):
        """Reference ``text_normalize``: a list of segments (``split``) or one string."""
        if not isinstance(text, str):
            return [text] if split else text  # bistream generator input: untouched (step 1)
        if split:
            return list(self.iter_segments(text, text_frontend))
        if not self._frontend_applies(text, text_frontend):
            return text
        lang = self.language(text)
        return "".join(self._iter_normalized_blocks(text.strip(), lang))

    def iter_segments(self, text: str, text_frontend: bool = True) -> Iterator[str]:
        """Yield synthesis segments as soon as they are final (streaming over long texts)."""
        if not self._frontend_applies(text, text_frontend):
            if not is_only_punctuation(text):
                yield text
            return
        lang = self.language(text)
        splitter = ParagraphSplitter(lang, len if lang == "zh" else self.en_length, self.split_params)
        for block in self._iter_normalized_blocks(text.strip(), lang):
            yield from (s for s in splitter.feed(block) if not is_only_punctuation(s))
        yield from (s for s in splitter.finish() if not is_only_punctuation(s))

    @staticmethod
    def language(text: str) -> Lang:
        """Branch selection (step 6): any CJK ideograph -> zh, else en."""
        return "zh" if rules.contains_cjk(text) else "en"

    # -- internals --------------------------------------------------------------------------
    @staticmethod
    def _frontend_applies(text: str, text_frontend: bool) -> bool:
        if "<|" in text and "|>" in text:  # special tokens inline: bypass (step 2)
            return False
        return bool(text_frontend and text.strip())

    def _iter_normalized_blocks(self, text: str, lang: Lang) -> Iterator[str]:
        text = rules.clean_invisible(text)
        if lang == "en":
            for block in iter_blocks(text):
                yield self._guarded(self._en_block, block)
            return
        # zh: wetext + newline removal per block, then the space rule with one block of lookahead
        # so that it sees the same neighbours as on the whole text.
        prev_tail = ""
        pending: str | None = None
        for block in iter_blocks(text):
            cur = self._guarded(self._zh_block, block)
            if pending is not None:
                yield self._guarded(self._zh_finish, pending, prev_tail, cur[:1])
                prev_tail = pending[-1:] or prev_tail
            pending = cur
        if pending is not None:
            out = self._guarded(self._zh_finish, pending, prev_tail, "")
            yield _TRAILING_COMMAS.sub("。", out)

    def _guarded(self, fn, block: str, *args) -> str:
        try:
            return fn(block, *args)
        except Exception:  # our own rules must not fail a request either: keep the raw block
            logger.exception("text normalisation failed on %r; keeping the raw text", block[:80])
            return block

    def _en_block(self, block: str) -> str:
        text = rules.en_pre(block)
        if self._engines is not None:
            text = self._wetext(self._engines[1], text, _is_latin)
        return rules.en_digits_to_words(text)

    def _zh_block(self, block: str) -> str:
        text = rules.zh_pre(block)
        if self._engines is not None:
            text = self._wetext(self._engines[0], text, lambda c: True)
        text = rules.zh_digits_to_words(text)  # only digits a failed wetext call left behind
        return text.replace("\n", "")

    @staticmethod
    def _zh_finish(block: str, left: str, right: str) -> str:
        return zh_local_rules(zh_blank_rule(block, left, right))

    def _wetext(self, engine, text: str, accepts: Callable[[str], bool]) -> str:
        """wetext on ``text`` keeping its edge whitespace; on failure retry per script run."""
        if not _DIGIT.search(text):
            return text
        try:
            return _keep_edges(text, engine.normalize(text))
        except Exception as exc:  # noqa: BLE001 - any wetext failure falls back, never fails the request
            logger.warning("wetext failed on %r (%s: %s); retrying per script run",
                           text[:80], type(exc).__name__, exc)
        out = []
        for run, ok in _script_runs(text, accepts):
            if not ok or not _DIGIT.search(run):
                out.append(run)
                continue
            try:
                out.append(_keep_edges(run, engine.normalize(run)))
            except Exception as exc:  # noqa: BLE001 - as above, per script run
                logger.warning("wetext failed on run %r (%s); keeping it raw", run[:80], type(exc).__name__)
                out.append(run)
        return "".join(out)


def _is_latin(c: str) -> bool:
    return ord(c) < _LATIN_LIMIT or unicodedata.category(c)[0] in "PSZ"


def _script_runs(text: str, accepts: Callable[[str], bool]) -> list[tuple[str, bool]]:
    runs: list[tuple[str, bool]] = []
    for c in text:
        ok = accepts(c) and unicodedata.category(c) != "Cf"
        if runs and runs[-1][1] == ok:
            runs[-1] = (runs[-1][0] + c, ok)
        else:
            runs.append((c, ok))
    return runs


def _keep_edges(raw: str, normalized: str) -> str:
    """wetext strips its output; put the input's edge whitespace back (it separates words)."""
    lead = raw[: len(raw) - len(raw.lstrip())]
    trail = raw[len(raw.rstrip()):]
    return lead + normalized.strip() + trail


_EN_UNITS = re.compile(r"\w+|[^\w\s]")


def _approx_en_length(text: str) -> int:
    """Stand-in for the Qwen2 token count when no tokenizer is given (words + punctuation)."""
    return len(_EN_UNITS.findall(text))
