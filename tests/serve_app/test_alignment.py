"""serve_app/alignment.py: the characters sent mapped onto the normalised text."""
from __future__ import annotations

from itertools import pairwise

from serve_app.alignment import MAX_RESYNCS, char_spans


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
