"""Pronunciation aliases: matching rules (longest first, case, word boundaries, precedence) and
the streamed form agreeing with the whole-text form however the text is cut."""
from __future__ import annotations

import random

import pytest

from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.frontend.aliases import (
    MAX_GRAPHEME_CHARS,
    AliasOverflowError,
    AliasRule,
    AliasStream,
    Lexicon,
    is_word_char,
)


def lex(*rules, more=()):
    return Lexicon.compile([[AliasRule(*r) if isinstance(r, tuple) else r for r in rules], list(more)])


@pytest.mark.parametrize("rules, text, expected", [
    ([("NYC", "New York City")], "I love NYC.", "I love New York City."),
    ([("NYC", "New York City")], "NYCE and NYC", "NYCE and New York City"),  # word boundary after
    ([("NYC", "New York City")], "xNYC NYC", "xNYC New York City"),  # word boundary before
    ([("NYC", "New York City")], "nyc", "nyc"),  # case-sensitive by default
    ([("NYC", "New York City", False)], "nyc Nyc", "New York City New York City"),
    ([("New York", "Big Apple"), ("New", "Old")], "New York, New Delhi", "Big Apple, Old Delhi"),  # longest
    ([("a", "b"), ("b", "c")], "a b", "b c"),  # no chaining: an alias is not matched again
    ([("C++", "C plus plus")], "I like C++ a lot, C++.", "I like C plus plus a lot, C plus plus."),
    ([(".NET", "dot net")], "on .NET today", "on dot net today"),
    ([("ing", "ING", True, False)], "singing", "sINGING"),  # word_boundaries off: inside words
    ([("阿里", "阿 里")], "我在阿里巴巴工作", "我在阿 里巴巴工作"),  # Chinese: no word boundaries
    ([("Ünï", "uni", False)], "ÜNÏ und ünï", "uni und uni"),
    ([("don", "Don")], "don't", "Don't"),  # an apostrophe ends a word
    ([("x", "")], "a x b", "a  b"),  # an empty alias removes the text
])
def test_rules_match_as_documented(rules, text, expected):
    assert lex(*rules).apply(text) == expected


def test_earlier_rules_win_over_later_ones_for_the_same_text():
    request = [AliasRule("SQL", "sequel")]
    dictionary = [AliasRule("SQL", "S Q L"), AliasRule("sql", "ess queue ell", case_sensitive=False)]
    lexicon = Lexicon.compile([request, dictionary])
    assert lexicon.apply("SQL and sql") == "sequel and ess queue ell"
    assert Lexicon.compile([dictionary]).apply("SQL") == "S Q L"  # the exact rule, given first
    assert Lexicon.compile([dictionary[::-1]]).apply("SQL") == "ess queue ell"  # the case-free one, given first


def test_a_longer_rule_that_fails_its_boundary_leaves_the_shorter_one():
    lexicon = lex(("New York", "Big Apple"), ("New", "Old"))
    assert lexicon.apply("New Yorkers") == "Old Yorkers"


def test_word_characters():
    assert is_word_char("a") and is_word_char("7") and is_word_char("_") and is_word_char("é")
    assert is_word_char("\u0301")  # a combining mark continues its word
    assert not is_word_char(" ") and not is_word_char("'") and not is_word_char("") and not is_word_char("-")
    assert not is_word_char("中") and not is_word_char("か")


def test_rule_checks():
    AliasRule("ok", "fine").check()
    for bad in (AliasRule("", "x"), AliasRule("   ", "x"), AliasRule("a" * (MAX_GRAPHEME_CHARS + 1), "x"),
                AliasRule("a", "x" * 501)):
        with pytest.raises(InvalidInputError):
            bad.check()


def test_output_is_bounded():
    lexicon = lex(("a", "x" * 50))
    assert len(lexicon.apply("a a", max_chars=200)) == 101
    with pytest.raises(AliasOverflowError):
        lexicon.apply("a " * 10, max_chars=200)
    with pytest.raises(AliasOverflowError):  # the text copied after the last match counts too
        lexicon.apply("a" + " " * 200, max_chars=100)


def test_empty_lexicon_changes_nothing():
    lexicon = Lexicon.compile([[]])
    assert not lexicon and lexicon.apply("NYC") == "NYC"
    stream = AliasStream(lexicon)
    assert stream.feed("NY") + stream.feed("C") + stream.flush() == "NYC"


RULES = [AliasRule("NYC", "New York City"), AliasRule("New York", "Big Apple"), AliasRule("New", "Old"),
         AliasRule("ab", "<AB>", case_sensitive=False), AliasRule("abab", "<ABAB>"),
         AliasRule("b", "<b>", word_boundaries=False), AliasRule("中文", "汉语"), AliasRule("C++", "cpp")]


def test_a_stream_cut_anywhere_gives_the_whole_text_result():
    """Seeded random texts of the rules' pieces, cut at random places: the concatenated stream
    output is what the whole text gives, and no more than the longest rule is ever held back."""
    lexicon = Lexicon.compile([RULES])
    rng = random.Random(1234)
    atoms = ["NYC", "New", " York", "New York", "ab", "AB", "abab", "b", "中文", "C++", " ", ", ", "x", "Yorkers",
             ".", "中"]
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 5))))
        stream, out, last = AliasStream(lexicon), [], 0
        for c in [*cuts, len(text)]:
            out.append(stream.feed(text[last:c]))
            last = c
            assert len(stream._held) <= lexicon.max_len
        out.append(stream.flush())
        assert "".join(out) == lexicon.apply(text), (text, cuts)


def test_a_stream_maps_each_input_character_to_the_output_that_says_it():
    """feed_mapped: one span per input character, in order, tiling the output (a grapheme's
    characters share its alias in order), the same however the text is cut."""
    lexicon = Lexicon.compile([[*RULES, AliasRule("um", "")]])
    rng = random.Random(99)
    atoms = ["NYC", "New York", "abab", "b", "中文", "C++", " ", "um", "x", "."]
    for _ in range(200):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 10)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 5))))
        stream, out, spans, last = AliasStream(lexicon), "", [], 0
        for c in [*cuts, len(text)]:
            o, s = stream.feed_mapped(text[last:c])
            out, spans, last = out + o, spans + s, c
        o, s = stream.flush_mapped()
        out, spans = out + o, spans + s
        assert out == lexicon.apply(text) and len(spans) == len(text), (text, cuts)
        tiles = [0] + [hi for _, hi in spans]
        assert [lo for lo, _ in spans] == tiles[:-1] and tiles[-1] == len(out), (text, cuts)
        one = AliasStream(lexicon)
        assert one.feed_mapped(text)[1] + one.flush_mapped()[1] == spans, (text, cuts)
    stream = AliasStream(lexicon)
    assert stream.feed_mapped("I love NYC") == ("I ", [(0, 1), (1, 2)])  # "love NYC" is held: a rule may still match
    assert stream.flush_mapped() == ("love New York City", [(2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 11),
                                                            (11, 15), (15, 20)])  # N: "New ", Y: "York", C: " City"


def test_a_stream_releases_text_no_rule_can_still_change():
    stream = AliasStream(lex(("New York", "Big Apple")))
    assert stream.feed("I love New") == "I "  # 8 characters held: "New York" may still come
    assert stream.feed(" York and more") == "love Big Apple "
    assert stream.flush() == "and more"


def test_a_stream_output_is_bounded_over_its_life():
    stream = AliasStream(lex(("a", "x" * 50)), max_chars=120)
    stream.feed("a a ")
    with pytest.raises(AliasOverflowError):
        stream.feed("a a ")
