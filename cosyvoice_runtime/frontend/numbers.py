"""English number verbalisation (the reference uses ``inflect.number_to_words``; this is our own).

Style follows inflect's defaults: ``"and"`` after hundreds and before a final group below 100
(``2024`` -> ``two thousand and twenty-four``), hyphenated tens (``forty-two``).
"""
from __future__ import annotations

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ("", "thousand", "million", "billion", "trillion", "quadrillion", "quintillion",
           "sextillion", "septillion", "octillion", "nonillion", "decillion")
# Above this, reading group by group is no longer meaningful: spell digits instead.
_MAX_GROUPS = len(_SCALES)


def _below_100(n: int) -> str:
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")


def _below_1000(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    if not hundreds:
        return _below_100(rest)
    head = f"{_ONES[hundreds]} hundred"
    return f"{head} and {_below_100(rest)}" if rest else head


def digits_to_words(digits: str) -> str:
    """Spell a digit string one digit at a time: ``"007"`` -> ``"zero zero seven"``."""
    return " ".join(_ONES[int(d)] for d in digits if d.isdigit())


def cardinal(n: int | str) -> str:
    """Cardinal words of a non-negative integer (given as int or a string of ASCII digits)."""
    s = str(n).lstrip("0") or "0"
    if not s.isdigit():
        raise ValueError(f"not a non-negative integer: {n!r}")
    value = int(s)
    if value == 0:
        return "zero"
    groups: list[int] = []
    while value:
        value, g = divmod(value, 1000)
        groups.append(g)
    if len(groups) > _MAX_GROUPS:
        return digits_to_words(s)
    words = []
    for idx in range(len(groups) - 1, -1, -1):
        g = groups[idx]
        if not g:
            continue
        part = _below_1000(g)
        if idx == 0 and g < 100 and len(groups) > 1:
            part = f"and {part}"
        words.append(f"{part} {_SCALES[idx]}".strip())
    return " ".join(words)


def decimal(integer: str, fraction: str) -> str:
    """``("3", "14")`` -> ``"three point one four"``."""
    return f"{cardinal(integer)} point {digits_to_words(fraction)}"


def year(n: int) -> str:
    """Year reading: 1990 -> nineteen ninety, 2005 -> two thousand and five, 1900 -> nineteen hundred."""
    if n < 1000 or n >= 10000 or (2000 <= n < 2010):
        return cardinal(n)
    hi, lo = divmod(n, 100)
    if lo == 0:
        return f"{_below_100(hi)} hundred"
    return f"{_below_100(hi)} {'oh ' + _ONES[lo] if lo < 10 else _below_100(lo)}"


def plural(words: str) -> str:
    """Plural of a spelled number (for decades): ``nineteen ninety`` -> ``nineteen nineties``."""
    if words.endswith("y"):
        return words[:-1] + "ies"
    if words.endswith("x"):
        return words + "es"
    return words + "s"
