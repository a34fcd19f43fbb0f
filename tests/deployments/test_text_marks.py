"""deployments/text_marks.py: where each text token's speech starts, chunk by chunk."""
from __future__ import annotations

import pytest

from deployments.text_marks import SPEECH_PER_TEXT, TextMarker


def _positions(marks, chunks):
    """Absolute speech-token positions of the marks of ``chunks`` [(lo, hi), ...]."""
    return [lo + f * (hi - lo) for m, (lo, hi) in zip(marks, chunks) if m is not None for f in m.starts]


def test_a_piece_is_said_at_the_trained_rate_until_its_length_is_known():
    marker = TextMarker(piece_tokens=10)
    marker.add(12, None)
    m1 = marker.chunk(12, last=False, done=False)  # tokens at 0, 3, 6, 9 start before 12
    assert m1.first == 0 and [round(f * 12, 6) for f in m1.starts] == [k * SPEECH_PER_TEXT for k in range(4)]
    marker.add(8, None)  # the piece ended after 20 speech tokens: the 6 left share [12, 20)
    m2 = marker.chunk(20, last=True, done=True)
    assert m2.first == 4 and len(m2.starts) == 6
    pos = _positions([m1, m2], [(0, 12), (12, 20)])
    assert pos == sorted(pos) and pos[-1] < 20


def test_whole_piece_spreads_its_tokens_over_its_speech():
    marker = TextMarker(piece_tokens=4)
    marker.add(20, None)
    m = marker.chunk(20, last=True, done=True)
    assert m.first == 0 and m.starts == pytest.approx([0.0, 0.25, 0.5, 0.75])


def test_bistream_text_is_never_marked_before_the_model_read_it():
    marker = TextMarker(piece_tokens=None)
    marker.add(15, [4] * 15)  # 4 ids read, then 15 speech tokens
    m1 = marker.chunk(10, last=False, done=False)
    assert m1.first == 0 and len(m1.starts) == 4  # 0, 3, 6, 9: all four before 10
    marker.add(15, [9] * 15)  # a fill, 5 more read at speech token 15
    m2 = marker.chunk(20, last=False, done=False)
    assert m2.first == 4 and m2.starts[0] == pytest.approx(0.5)  # not before token 15, read there
    marker.add(6, [12] * 6)  # the final stage read the last 3 and the sequence ended at 36
    m3 = marker.chunk(36, last=True, done=True)
    pos = _positions([m1, m2, m3], [(0, 10), (10, 20), (20, 36)])
    assert len(pos) == 12 and pos == sorted(pos) and pos[4] >= 15 and pos[9] >= 30 and pos[-1] <= 36


def test_a_runtime_without_text_read_gives_no_marks():
    marker = TextMarker(piece_tokens=None)
    marker.add(5, None)
    assert marker.chunk(5, last=True, done=True) is None
