"""Speech length from text at a typical speaking rate (the ``text_rate`` rule for random weights).

A model with random weights never predicts a sensible end of speech: its LLM stops at a random
step or runs to ``max_token_text_ratio`` (20 speech tokens per text token, far beyond any real
utterance). Under the ``text_rate`` rule a request decodes exactly :func:`target_tokens` speech
tokens instead: the seconds a speaker takes to read its text, at the token rate of the model,
with a small deterministic jitter.

The length is counted in characters of the decoded text, not in text tokens: the random-weight
models ship a byte-level stand-in of the ``CosyVoice-BlankEN`` tokenizer (one token per byte
but for ten merges, :mod:`cosyvoice_runtime.tiny_assets`), which cuts text into several times as
many tokens as the released Qwen2 BPE (docs/tuning.md, "Speech length of random weights"), so a
rate per text token would hold for one tokenizer only. Characters are the same under both.

Rates (no CosyVoice paper or model card publishes one; these are the usual speaking-rate
figures, converted here, docs/tuning.md shows the computation):

* English (and every alphabetic script, digits included): 150 words per minute = 2.5 words/s,
  times 4.7 letters per word (the Zen of Python's 143 words hold 677 letters and digits) =
  11.75 letters/s, i.e. 0.085 s and 2.13 speech tokens (25 Hz) per letter.
* Chinese (Han ideographs; kana and Hangul syllables are counted alike): 4.5 syllables =
  characters per second (the middle of the 4-5 usually quoted for Mandarin), i.e. 0.222 s and
  5.56 speech tokens per character.

Spaces, punctuation and symbols count nothing: the words-per-minute figure already holds the
pauses between words and sentences. Mixed text adds both parts.
"""
from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

EN_WORDS_PER_S = 2.5  # 150 words per minute
EN_LETTERS_PER_WORD = 4.7
ZH_CHARS_PER_S = 4.5
DEFAULT_JITTER = 0.1  # each length drawn uniformly within +-10 % of the rate's


def is_syllabic(ch: str) -> bool:
    """A character read as one syllable: CJK ideographs (with extension A and the compatibility
    block), kana, Hangul syllables."""
    o = ord(ch)
    return (0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0xF900 <= o <= 0xFAFF
            or 0x3040 <= o <= 0x30FF or 0xAC00 <= o <= 0xD7AF)


@dataclass(frozen=True)
class SpeakingRate:
    """Characters read per second: syllabic characters (:func:`is_syllabic`) and the other
    letters and digits."""

    syllables_per_s: float = ZH_CHARS_PER_S
    letters_per_s: float = EN_WORDS_PER_S * EN_LETTERS_PER_WORD

    def seconds(self, text: str) -> float:
        """Seconds of speech of ``text`` at this rate."""
        syllables = letters = 0
        for ch in text:
            if is_syllabic(ch):
                syllables += 1
            elif ch.isalnum():
                letters += 1
        return syllables / self.syllables_per_s + letters / self.letters_per_s


def jitter_factor(seed: int | None, key: Sequence[int], jitter: float) -> float:
    """A factor in [1 - jitter, 1 + jitter]: fixed by ``seed`` and ``key`` (the piece's text ids,
    so the pieces of one seeded request differ), random without a seed."""
    if jitter <= 0:
        return 1.0
    if seed is None:
        draw = random.random()
    else:
        digest = zlib.crc32(b"".join(int(i).to_bytes(4, "little", signed=True) for i in key))
        draw = random.Random((int(seed) << 32) ^ digest).random()
    return 1.0 + jitter * (2.0 * draw - 1.0)


def target_tokens(text: str, token_rate: float, *, seed: int | None = None, key: Sequence[int] = (),
                  jitter: float = DEFAULT_JITTER, rate: SpeakingRate = SpeakingRate()) -> int:
    """Speech tokens that say ``text`` at ``rate`` (``token_rate`` tokens per second of speech,
    the spec's ``token_frame_rate``), jittered (:func:`jitter_factor`); at least 1."""
    return max(1, round(rate.seconds(text) * token_rate * jitter_factor(seed, key, jitter)))


class TextRateLength:
    """The ``text_rate`` rule of one model: text ids -> speech tokens to decode.

    Args:
        decode: text ids -> text (the model's own tokenizer, special tokens skipped).
        token_rate: speech tokens per second (``spec.token_frame_rate``).
        jitter: the largest relative departure from the rate (0: none).
    """

    def __init__(self, decode, token_rate: float, jitter: float = DEFAULT_JITTER,
                 rate: SpeakingRate = SpeakingRate()) -> None:
        self.decode, self.token_rate, self.jitter, self.rate = decode, token_rate, jitter, rate

    def __call__(self, text_ids: Sequence[int], seed: int | None = None) -> int:
        ids = [int(i) for i in text_ids]
        return target_tokens(self.decode(ids), self.token_rate, seed=seed, key=ids, jitter=self.jitter,
                             rate=self.rate)

    @classmethod
    def for_model(cls, model_dir, family: str, token_rate: float, jitter: float = DEFAULT_JITTER) -> TextRateLength:
        """The rule over the model directory's own tokenizer (``CosyVoice-BlankEN``)."""
        from pathlib import Path

        from cosyvoice_runtime.frontend.tokenizer import TextTokenizer

        return cls(TextTokenizer(Path(model_dir) / "CosyVoice-BlankEN", family).decode, token_rate, jitter)
