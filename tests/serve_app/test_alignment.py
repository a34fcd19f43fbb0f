"""serve_app/alignment.py: the characters sent mapped onto the normalised text, and (text-in
WebSockets) through the session's aliases onto the pieces its turns read."""
from __future__ import annotations

from itertools import pairwise

from cosyvoice_runtime.frontend.aliases import AliasRule, AliasStream, Lexicon
from deployments.protocol import TextMarks
from serve_app.alignment import MAX_RESYNCS, Aligner, TextIn, char_spans
from serve_app.stream_input import WordCutter


def _check(spans, original, normalized):
    assert len(spans) == len(original)
    assert all(lo <= hi for lo, hi in spans) and spans[-1][1] <= len(normalized)
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in pairwise(spans))


def test_rewritten_runs_take_the_span_of_their_rewrite():
    original, normalized = "Pay $5 by 3 pm, OK?", "Pay five dollars by three pm, ok?"
    spans = char_spans(original, normalized)
    _check(spans, original, normalized)
    said = [normalized[lo:hi] for lo, hi in spans]
    assert "".join(said[4:6]) == "five dollars" and said[10] == "three" and said[-3:] == ["o", "k", "?"]
    assert char_spans("Hi!!", "Hi") == [(0, 1), (1, 2), (2, 2), (2, 2)]  # dropped: no span


def test_texts_that_never_agree_map_in_order_with_bounded_work():
    original = "".join("abcdefghij"[i * 7 % 10] for i in range(20_000))
    normalized = "".join("klmnopqrst"[i * 3 % 10] for i in range(15_000))
    _check(char_spans(original, normalized), original, normalized)
    many = "1 a " * (MAX_RESYNCS + 50)  # more rewrites than are mapped one by one: the rest proportional
    _check(char_spans(many, many.replace("1", "one")), many, many.replace("1", "one"))


def _pieces(text_in, steps):
    """TextIn's pieces for (text sent or None for a flush, starts a turn) steps, the empty ones left out."""
    return [got for text, new_turn in steps if (got := text_in.piece(text, new_turn))[0]]


def test_text_in_follows_each_character_sent_through_aliases_and_turns():
    """A text-in session's pieces carry the characters sent that they complete, once and in
    order, at their span in the turn's text: an alias cut by the word cutter finishes with the
    piece that ends it, one cut by a turn bound is cut to the new turn, text said by nothing
    (an empty alias, whitespace between turns) goes with the next turn's start, taking no time."""
    lexicon = Lexicon.compile([[AliasRule("NYC", "New York City"), AliasRule("um", "")]])
    got = _pieces(TextIn(WordCutter(), AliasStream(lexicon)), [
        (" ", True), ("I love NYC", True), (" ", False), (None, False),  # a flush ends the turn
        (" um ", True), ("ok", True), (None, True)])
    assert got == [("I love", "I love", [(k, k + 1) for k in range(6)]),
                   (" New York", " NY", [(6, 7), (7, 11), (11, 15)]),  # N says "New ", Y "York"
                   (" City ", "C ", [(15, 20), (20, 21)]),  # C (" City") ends in this piece
                   ("ok", " um ok", [(0, 0)] * 4 + [(0, 1), (1, 2)])]  # the next turn's text
    bound = _pieces(TextIn(WordCutter(), AliasStream(lexicon)), [
        ("a NYC", True), (" b", False), ("x", True), (None, True)])  # a turn bound after " New York"
    assert bound[-1] == ("City bx", "C bx", [(0, 4), (4, 5), (5, 6), (6, 7)])
    plain = _pieces(TextIn(WordCutter()), [(" ", True), ("Hi there ", True), (None, False), (" again", True),
                                           (None, True)])
    assert [(p, s) for p, s, _ in plain] == [("Hi there", "Hi there"), (" ", " "), ("again", " again")]
    assert plain[-1][2][0] == (0, 0)  # the space before the second turn: at its start


def test_characters_said_by_none_wait_for_the_turn_s_first_time():
    """A later turn's aligner (times are the session's): the characters before its text take no
    time at its first character's start, not at 0 s, even when its first chunk has no mark."""
    aligner = Aligner("", "")
    aligner.sequence([])
    aligner.push("ok", 1, " um ok", [(0, 0)] * 4 + [(0, 1), (1, 2)])
    original, normalized = aligner.chunk(None, 5.0, 6.0, last=False)  # no mark: nothing said yet
    assert not original and not normalized
    original, normalized = aligner.chunk(TextMarks(0, [0.5]), 6.0, 7.0, last=True)
    assert original.chars == list(" um ok") and normalized.chars == list("ok")
    assert original.starts == [6.5] * 5 + [6.75] and original.ends == [6.5] * 4 + [6.75, 7.0]
