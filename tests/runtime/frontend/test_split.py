"""Sentence splitting (spec §2.2) and our maximum piece length."""
from __future__ import annotations

import random

from cosyvoice_runtime.frontend.split import ParagraphSplitter, SplitParams, cut_to_length, split_paragraph

NO_CAP = SplitParams(max_piece_len=10**9)


def reference_split(text, length, lang, max_n=80, min_n=60, merge_len=20):
    """Spec §2.2 transcribed literally (inputs avoid the empty-pop crash)."""
    marks = "。？！；：、.?!;" if lang == "zh" else ".?!;:"
    if text[-1] not in marks:
        text += "。" if lang == "zh" else "."
    st, utts = 0, []
    for i, c in enumerate(text):
        if c in marks:
            if text[st:i]:
                utts.append(text[st:i] + c)
            if i + 1 < len(text) and text[i + 1] in '"”':
                utts[-1] += text[i + 1]
                st = i + 2
            else:
                st = i + 1
    out, cur = [], ""
    for u in utts:
        if length(cur + u) > max_n and length(cur) > min_n:
            out.append(cur)
            cur = ""
        cur += u
    if cur:
        if length(cur) < merge_len and out:
            out[-1] += cur
        else:
            out.append(cur)
    return out


def _random_text(rng, alphabet, marks, n):
    s = "".join(rng.choice(alphabet) if rng.random() < 0.88 else rng.choice(marks) for _ in range(n))
    return "x" + s


def test_matches_reference_zh_and_streaming():
    rng = random.Random(0)
    for _ in range(400):
        t = _random_text(rng, "的是了我你他一二三四", "。，？！、\"”", rng.randint(1, 400))
        try:
            ref = reference_split(t, len, "zh")
        except IndexError:
            continue
        assert split_paragraph(t, "zh", params=NO_CAP) == ref
        sp, out, i = ParagraphSplitter("zh", params=NO_CAP), [], 0
        while i < len(t):
            j = i + rng.randint(1, 40)
            out += sp.feed(t[i:j])
            i = j
        assert out + sp.finish() == ref


def test_matches_reference_en_with_token_length():
    rng = random.Random(1)
    words = lambda s: len(s.split())  # any monotone length measure works
    for _ in range(200):
        t = "".join(rng.choice(["word ", "two ", "x", ". ", "? ", "! ", "; ", ": ", ", "]) for _ in range(rng.randint(1, 200)))
        t = "a" + t.strip()
        assert split_paragraph(t, "en", words, NO_CAP) == reference_split(t, words, "en")


def test_quote_follows_mark():
    assert split_paragraph('他说：“好。”然后走了。', "zh") == ['他说：“好。”然后走了。']
    assert split_paragraph("a" * 70 + '。”' + "b" * 70 + "。", "zh") == ["a" * 70 + '。”', "b" * 70 + "。"]


def test_leading_quote_after_mark_does_not_crash():
    assert split_paragraph('。"你好', "zh") == ['"你好。']


def test_merge_rules():
    s = "一" * 59 + "。"
    # 60-char pieces: flush happens only when cur > 60 and cur + next > 80
    assert split_paragraph(s * 3, "zh") == [s * 2, s]
    # a short tail (< 20) is appended to the previous segment
    tail = "二" * 5 + "。"
    assert split_paragraph(s * 2 + tail, "zh") == [s * 2 + tail]


def test_max_piece_len_cuts_at_soft_breaks():
    text = ("这是一个很长的句子，" * 30)  # 300 chars, commas only
    out = split_paragraph(text, "zh")
    assert "".join(out) == text + "。"
    assert all(len(s) <= 160 for s in out) and len(out) >= 2
    hard = "字" * 500
    out = split_paragraph(hard, "zh")
    assert "".join(out) == hard + "。" and max(len(s) for s in out) <= 160


def test_unpunctuated_stream_emits_early():
    sp = ParagraphSplitter("zh")
    ready = []
    for _ in range(50):
        ready += sp.feed("没有标点的文字" * 10)
    assert len(ready) > 10  # emitted while feeding, not at finish


def test_cut_to_length():
    head, rest = cut_to_length("ab, cd, ef", 6, len)
    assert (head, rest) == ("ab, ", "cd, ef")
    assert cut_to_length("abcdef", 4, len) == ("abcd", "ef")
    assert cut_to_length("abc", 5, len) == ("abc", "")
