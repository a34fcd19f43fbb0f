"""Our own pre/post rules around wetext (what wetext 0.1.8 gets wrong or refuses).

Measured wetext failures these rules exist for (kept as tests in ``test_normalize.py``):

* thousands separators: en ``1,234`` -> "thousand two hundred ..." (the leading "one" is lost);
  zh tagger inside English text reads ``1,234`` as "一,两百三十四";
* money with separators: ``$1,234.50`` -> "一美元,两百三十四点五零" (zh) / "thousand ... dollars" (en);
* English ordinals and decades inside Chinese text: ``21st`` -> "二十一秒t", ``1990s`` -> "...秒";
* the English normaliser raises ``AssertionError`` on characters outside its alphabet (kana,
  hangul, zero-width space...): handled by :func:`TextNormalizer._wetext` (run-wise retry).

Every rule is a pure ``str -> str`` function; none of them drops non-numeric text.
"""
from __future__ import annotations

import re
import unicodedata

from cosyvoice_runtime.frontend import numbers

# Characters that carry no text: C0/C1 controls (except newline/tab) and zero-width formatting.
_INVISIBLE = re.compile("[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u200b-\u200f\u2028\u2029\u2060-\u2064\ufeff]")
_THOUSANDS = re.compile(r"(?<![\d.,])(\d{1,3}(?:,\d{3})+)(?![\d]|,\d)((?:\.\d+)?)")
_CURRENCY = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
             "£": ("pound", "pounds", "penny", "pence")}
_MONEY = re.compile(r"([$€£])\s?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d{1,2}))?(?!\d|\.\d)")
_EN_ORDINAL = re.compile(r"(?<![A-Za-z0-9.])(\d+)(st|nd|rd|th)(?![A-Za-z])", re.IGNORECASE)
_DECADE = re.compile(r"(?<![A-Za-z0-9.])(\d{1,3}0)'?s(?![A-Za-z])")
_DIGITS = re.compile(r"\d+")
_ZH_DIGITS = "零一二三四五六七八九"


def is_cjk(ch: str) -> bool:
    return "\u4e00" <= ch <= "\u9fff"


def contains_cjk(text: str) -> bool:
    return any(is_cjk(c) for c in text)


def clean_invisible(text: str) -> str:
    """Drop control and zero-width characters; tabs become spaces."""
    return _INVISIBLE.sub("", text.replace("\t", " "))


def strip_thousands(text: str) -> str:
    """``1,234,567.5`` -> ``1234567.5`` (only well-formed 3-digit groups; ``1,2,3`` is a list)."""
    return _THOUSANDS.sub(lambda m: m.group(1).replace(",", "") + m.group(2), text)


# -- English ------------------------------------------------------------------------------------
def en_money(text: str) -> str:
    """``$1,234.50`` -> ``one thousand two hundred and thirty-four dollars and fifty cents``."""

    def repl(m: re.Match) -> str:
        one, many, sub_one, sub_many = _CURRENCY[m.group(1)]
        whole = int(m.group(2).replace(",", ""))
        frac = m.group(3)
        words = f"{numbers.cardinal(whole)} {one if whole == 1 else many}"
        if frac:
            cents = int(frac.ljust(2, "0"))
            if cents:
                words += f" and {numbers.cardinal(cents)} {sub_one if cents == 1 else sub_many}"
        return words

    return _MONEY.sub(repl, text)


def en_thousands(text: str) -> str:
    """Separated numbers are quantities, never years: ``1,234`` -> ``one thousand two hundred ...``."""

    def repl(m: re.Match) -> str:
        words = numbers.cardinal(m.group(1).replace(",", ""))
        if m.group(2):
            words += " point " + numbers.digits_to_words(m.group(2)[1:])
        return words

    return _THOUSANDS.sub(repl, text)


def en_decades(text: str) -> str:
    """``1990s`` -> ``nineteen nineties``; ``80s`` -> ``eighties``."""
    return _DECADE.sub(lambda m: numbers.plural(numbers.year(int(m.group(1))) if len(m.group(1)) == 4
                                                else numbers.cardinal(m.group(1))), text)


def en_digits_to_words(text: str) -> str:
    """Reference post-step of the English branch: any remaining digit run becomes cardinal words."""
    return _DIGITS.sub(lambda m: numbers.cardinal(m.group(0)) if m.group(0).isascii() else m.group(0), text)


def en_pre(text: str) -> str:
    return en_thousands(en_decades(en_money(text)))


# -- Chinese ------------------------------------------------------------------------------------
def zh_pre(text: str) -> str:
    """Before the zh tagger: drop separators, turn English ordinals/decades into zh forms."""
    text = strip_thousands(text)
    text = _EN_ORDINAL.sub(lambda m: f"第{m.group(1)}", text)
    text = _DECADE.sub(lambda m: f"{m.group(1)}年代", text)
    return text


def zh_digits_to_words(text: str) -> str:
    """Post-step for digits wetext left (only after a fallback): read them digit by digit."""
    return _DIGITS.sub(lambda m: "".join(_ZH_DIGITS[unicodedata.digit(c)] for c in m.group(0)), text)
