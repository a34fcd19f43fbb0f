"""The ``text_rate`` speech length (cosyvoice_runtime/speech_length.py): the rate table, the
jitter, and a bistream request in the engine ending at the length its whole text is given."""
from __future__ import annotations

import pytest
import torch

from cosyvoice_runtime.llm.bistream import BistreamState
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.model import build_llm
from cosyvoice_runtime.speech_length import (
    SpeakingRate,
    TextRateLength,
    jitter_factor,
    target_tokens,
)
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir

LETTER_S = 1 / 11.75  # 150 words/min x 4.7 letters a word
HAN_S = 1 / 4.5


@pytest.mark.parametrize(("text", "letters", "syllables"), [
    ("Hello world.", 10, 0),
    ("It's 2 o'clock, isn't it?", 16, 0),  # apostrophes, spaces and marks count nothing
    ("今天天气很好。", 0, 6),
    ("我用 Python 写代码", 6, 5),  # mixed text: both parts add
    ("Ünïcödé façade", 13, 0),  # any alphabetic script at the letter rate
    ("こんにちは", 0, 5),  # kana read as syllables (the Mandarin rate, an approximation)
    ("안녕하세요", 0, 5),
    ("...!?", 0, 0),
])
def test_seconds_count_letters_and_syllables_at_their_rates(text, letters, syllables):
    assert SpeakingRate().seconds(text) == pytest.approx(letters * LETTER_S + syllables * HAN_S)


@pytest.mark.parametrize(("text", "tokens"), [
    ("Hello world.", 21),  # 10 letters: 0.851 s x 25 Hz = 21.3
    ("The quick brown fox jumps over the lazy dog.", 74),  # 35 letters: 2.979 s = 74.5 -> 74
    ("今天天气很好。", 33),  # 6 characters: 1.333 s = 33.3
    ("", 1),  # never 0: a request decodes at least one token
])
def test_target_tokens_without_jitter(text, tokens):
    assert target_tokens(text, 25, jitter=0.0) == tokens


def test_jitter_is_fixed_by_seed_and_text_and_bounded():
    key = [101, 202, 303]
    assert jitter_factor(7, key, 0.1) == jitter_factor(7, key, 0.1)  # reproducible
    draws = {jitter_factor(seed, key, 0.1) for seed in range(200)}
    assert len(draws) == 200 and all(0.9 <= f <= 1.1 for f in draws)
    assert min(draws) < 0.92 and max(draws) > 1.08  # spread over the whole band
    assert jitter_factor(7, key, 0.1) != jitter_factor(7, [101, 202, 304], 0.1)  # pieces of a request differ
    assert jitter_factor(7, key, 0.0) == 1.0
    text = "The quick brown fox jumps over the lazy dog."
    for seed in range(50):
        n = target_tokens(text, 25, seed=seed, key=key)
        assert 0.9 * 74.47 - 1 <= n <= 1.1 * 74.47 + 1


def test_the_rule_decodes_the_ids_it_is_given():
    seen = []

    def decode(ids):
        seen.append(ids)
        return "x" * len(ids)

    rule = TextRateLength(decode, token_rate=25, jitter=0.0)
    assert rule([1, 2, 3, 4], seed=None) == round(4 * LETTER_S * 25)
    assert seen == [[1, 2, 3, 4]]


# ------------------------------------------------------------------ bistream in the engine
TEXT = [1000 + 37 * i for i in range(23)]
PROMPT_SPEECH = list(range(100, 120))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    spec = write_config_dir(tmp_path_factory.mktemp("cv2"), "cosyvoice2", TINY_DIMS["cosyvoice2"])
    torch.manual_seed(0)
    return build_llm(spec.llm).eval()


def eos_when_allowed(spec):
    """Greedy over speech ids before the text ends (fills forced by the protocol); in the final
    stage eos whenever it is not masked: a model that would end at once."""
    def fn(logp: torch.Tensor, state: BistreamState) -> int:
        if state.final and logp[spec.eos] > -float("inf"):
            return spec.eos
        return int(logp[:spec.speech_token_size].argmax())
    return fn


def _bistream(llm, length: int | None) -> tuple[int, str]:
    engine = LLMEngine(llm, max_batch_size=2, max_seq_len=1024)
    engine.add_bistream_request("b", [11, 12, 13], PROMPT_SPEECH, sample_fn=eos_when_allowed(llm.spec))
    engine.feed_text("b", [[i] for i in TEXT], end=True, length=length)
    emitted, reason = 0, None
    while engine.has_unfinished():
        for ev in engine.step():
            emitted += len(ev.tokens)
            if ev.finished:
                reason = ev.finish_reason
    return emitted, reason


def test_bistream_ends_at_the_length_its_text_is_given(llm):
    interleaved, reason = _bistream(llm, None)  # the model's own end: eos as soon as the text ended
    assert reason == "stop" and interleaved > 0
    longer, reason = _bistream(llm, interleaved + 17)
    assert (longer, reason) == (interleaved + 17, "length")  # eos masked until the length, then the end
    # a length the interleaved stage already passed: the request ends when its text has
    assert _bistream(llm, 1) == (interleaved, "length")
