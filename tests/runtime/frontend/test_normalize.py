"""Text normalisation: the zh/en/mixed table, our wetext fixes, robustness, streaming."""
from __future__ import annotations

import itertools
import logging
import random

import pytest

from cosyvoice_runtime.frontend import rules
from cosyvoice_runtime.frontend.normalize import TextNormalizer, iter_blocks, zh_blank_rule

# (input, expected normalize(split=False)). Reviewed by hand; "fix" marks our own rules.
TABLE = [
    # Chinese (wetext zh + reference post-steps)
    ("今天是2024年3月5日。", "今天是二零二四年三月五日。"),
    ("气温-3.5度", "气温负三点五度"),
    ("50%的人同意", "百分之五十的人同意"),
    ("电话13812345678", "电话幺三八幺二三四五六七八"),
    ("10:30开会", "十点三十分开会"),
    ("1/3的蛋糕", "三分之一的蛋糕"),
    ("跑了3km", "跑了三公里"),
    ("第3章", "第三章"),
    ("面积是5m²", "面积是五平方米"),
    ("体积是2m³", "体积是两立方米"),
    ("价格（含税）是【100】元", "价格含税是一百元"),
    ("收到了 10 个 包裹", "收到了十个包裹"),
    ("你好\n世界", "你好世界"),
    ("他说——走吧", "他说 走吧"),
    ("今天天气很好，", "今天天气很好。"),
    ("一、二、", "一、二。"),
    ("好的 - 没问题", "好的-没问题"),  # reference order: the space rule runs before " - " -> "，"
    # Chinese, our fixes
    ("价格是$1,234.50", "价格是一千二百三十四点五零美元"),  # fix: separator (wetext: 一美元,两百...)
    ("共有1,234,567人", "共有一百二十三万四千五百六十七人"),
    ("他花了1,299元", "他花了一千二百九十九元"),
    ("我有1,234个苹果", "我有一千二百三十四个苹果"),
    ("上世纪90s的音乐", "上世纪九十年代的音乐"),  # fix: wetext reads "s" as 秒
    ("共计1,000元，折合$150。", "共计一千元，折合一百五十美元。"),
    # mixed zh/en (zh branch: whole text uses the zh grammar, spaces next to CJK dropped)
    ("我喜欢iPhone 15 Pro", "我喜欢iPhone十五Pro"),
    ("他在21st Century Fox工作", "他在第二十一Century Fox工作"),  # fix: wetext: 二十一秒t
    ("你好，world！", "你好，world！"),
    ("价格：$100", "价格：一百美元"),
    # English (wetext en + digits -> words)
    ("He was born in 1990.", "He was born in nineteen ninety."),
    ("the 4th of July", "the fourth of July"),
    ("The 21st century", "The twenty first century"),
    ("There are 2 cats and 3 dogs.", "There are two cats and three dogs."),
    ("It weighs 3.5 kg.", "It weighs three point five kilograms."),
    ("About 10% of people.", "About ten percent of people."),
    ("Room 101, floor 3.", "Room one hundred and one, floor three."),
    ("Hello world", "Hello world"),
    ("2 + 2 = 4", "two plus two equals four"),
    ("Version 2 is out.", "Version two is out."),
    ("Meet at 12:30pm.", "Meet at twelve thirty PM."),
    ("The meeting is at 10:30.", "The meeting is at ten thirty."),
    ("Temperature: -5 degrees.", "Temperature: negative five degrees."),
    ("She paid €20.", "She paid twenty euros."),
    ("I bought 1,2,3 items.", "I bought one,two,three items."),  # a list, not a separator
    # English, our fixes
    ("I have 1,234 apples.", "I have one thousand two hundred and thirty-four apples."),  # wetext drops "one"
    ("It costs $1,234.50 today.", "It costs one thousand two hundred and thirty-four dollars and fifty cents today."),
    ("I paid $5.99.", "I paid five dollars and ninety-nine cents."),
    ("The price is £3.05.", "The price is three pounds and five pence."),
    ("It is 1,000,000 dollars.", "It is one million dollars."),
    ("The 1990s were great.", "The nineteen nineties were great."),
    # English grammar raises on other scripts: run-wise retry, the rest kept raw
    ("カタカナ3つ", "カタカナthreeつ"),
    ("한국어 3개", "한국어 three개"),
    ("zero\u200bwidth 3", "zerowidth three"),  # invisible characters removed
]


@pytest.fixture(scope="module")
def norm():
    return TextNormalizer()


def test_table_is_large_enough():
    assert len(TABLE) >= 40
    langs = {TextNormalizer.language(t) for t, _ in TABLE}
    assert langs == {"zh", "en"}


@pytest.mark.parametrize("text,expected", TABLE, ids=[t for t, _ in TABLE])
def test_normalization_table(norm, text, expected):
    assert norm.normalize(text, split=False) == expected


def test_split_result_appends_final_mark(norm):
    assert norm.normalize("Hello world") == ["Hello world."]
    assert norm.normalize("今天是2024年") == ["今天是二零二四年。"]


def test_special_tokens_bypass_normalisation_and_splitting(norm):
    text = "You are a helpful assistant.<|endofprompt|>I have 3 cats. And 2 dogs."
    assert norm.normalize(text) == [text]
    assert norm.normalize(text, split=False) == text


def test_text_frontend_off_and_generators_are_untouched(norm):
    assert norm.normalize("I have 3 cats.", text_frontend=False) == ["I have 3 cats."]
    gen = iter(["a", "b"])
    assert norm.normalize(gen) == [gen]


def test_punctuation_only_pieces_are_dropped(norm):
    assert norm.normalize("。。。！") == []
    assert norm.normalize("   ") == []
    assert norm.normalize("你好。。。世界") == ["你好。世界。"]  # empty spans emit nothing (reference)


def test_wetext_crash_falls_back_to_raw_and_logs(norm, caplog):
    class Boom:
        def normalize(self, text):
            raise RuntimeError("grammar exploded")

    broken = TextNormalizer()
    broken._engines = (Boom(), Boom())
    with caplog.at_level(logging.WARNING, logger="cosyvoice_runtime.frontend.normalize"):
        en = broken.normalize("I have 3 cats and 12 dogs.", split=False)
        zh = broken.normalize("我有3只猫", split=False)
    # wetext failed: the text is kept and only the rule-based digit readings apply
    assert en == "I have three cats and twelve dogs."
    assert zh == "我有三只猫"
    assert any("wetext failed" in r.message for r in caplog.records)


def test_own_rule_crash_keeps_raw_block(norm, monkeypatch, caplog):
    monkeypatch.setattr(rules, "en_pre", lambda text: 1 / 0)
    with caplog.at_level(logging.ERROR):
        assert norm.normalize("Keep me 3 times.", split=False) == "Keep me 3 times."
    assert any("keeping the raw text" in r.message for r in caplog.records)


def test_never_raises_on_random_strings(norm):
    rng = random.Random(7)
    pool = [chr(c) for c in (*range(0x80), *range(0x4E00, 0x4E30), *range(0x3040, 0x3050),
                              *range(0xAC00, 0xAC08), 0x200B, 0xFEFF, 0x1F600, 0xD800, 0x2028, 0xFF0C,
                              0x3002, 0xB2, 0x2014, 0x201D)]
    for _ in range(150):
        s = "".join(rng.choice(pool) for _ in range(rng.randint(0, 50)))
        out = norm.normalize(s)
        assert isinstance(out, list) and all(isinstance(p, str) for p in out)
        assert isinstance(norm.normalize(s, split=False), str)


def _letters(s: str) -> str:
    return "".join(c for c in s if c.isalpha())


def test_never_loses_text_without_digits(norm):
    rng = random.Random(3)
    words = ["你好", "世界", "hello", "world", "测试", "Zürich", "中文", "text", "한국", "カナ"]
    seps = [" ", "，", "。", "! ", "? ", "、", "\n", "（", "）", "——", " - "]
    for _ in range(100):
        s = "".join(rng.choice(words) + rng.choice(seps) for _ in range(rng.randint(1, 30)))
        assert _letters("".join(norm.normalize(s))) == _letters(s)


def test_blocks_cover_text_and_never_split_numbers():
    text = "第一句。Second one! 3.5 kg; 10:30 ok. " * 20 + "x" * 1000 + "1234567" * 100
    blocks = list(iter_blocks(text, max_chars=100))
    assert "".join(blocks) == text
    assert all(len(b) <= 100 for b in blocks)
    assert not any(a[-1:].isdigit() and b[:1].isdigit() for a, b in itertools.pairwise(blocks) if "1234567" not in a)


def test_blockwise_equals_whole_text():
    # The zh space rule sees neighbouring blocks: compare against a one-block run.
    text = "我们 today 开会。 The plan 是 3 步！ OK ok 好的。" * 5
    streamed = TextNormalizer().normalize(text, split=False)
    whole = "".join(zh_blank_rule(b, "", "") for b in [text.replace("3", "三")])
    whole = whole.replace(".", "。")
    assert streamed == whole


def test_long_text_streams_segment_by_segment():
    norm = TextNormalizer()
    calls = []
    orig = norm._zh_block
    norm._zh_block = lambda block: calls.append(block) or orig(block)
    sentence = "今天是2024年3月5日，我们一起去公园散步，看到了很多美丽的花朵和小鸟。"
    text = sentence * (20_000 // len(sentence) + 1)
    assert len(text) >= 20_000
    gen = norm.iter_segments(text)
    first = next(gen)
    n_first = len(calls)
    rest = list(gen)
    # one sentence per block; the splitter holds back one piece and one segment (merge rules)
    assert n_first <= 10 and n_first < len(calls) / 50, "the first segment must not wait for the whole text"
    assert len(rest) > 100
    assert all(len(s) <= 80 + 80 for s in [first, *rest])
    assert "".join([first, *rest]) == norm.normalize(sentence, split=False) * (len(text) // len(sentence))
