"""What ``bench/capacity.py`` asks for: the requests of a probe (text, voice, the length it means).

Two named workloads; every report and ``latest.json`` figure names the one it ran:

* ``production`` (the default): real sentences from :mod:`bench.corpus` (English and Chinese,
  with the numbers, dates, amounts and abbreviations that make the service's normaliser work),
  1-4 per request; a pool of registered voices with 3-10 s prompts, one per session (distinct
  while there are no more sessions than voices; an open-loop arrival is a new caller with a voice
  drawn from the pool); and a share of requests whose voice is registered just before the
  request, so no replica has seen it (its prompt features and prefixes are computed cold). The
  length a request *means* (``drawn_s``) is its sentences' expected speech
  (:data:`bench.corpus.SPEAKING_RATE`); the length *served* is what the client receives, and the
  report compares the two.
* ``synthetic``: the tool's original workload, kept to compare with every figure measured before
  it: lengths from a mix of second ranges, one made-up word per request whose length the random
  model turns into audio (``capacity_targets.text_for``), one voice for every session.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import random
import statistics
import zlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from bench.corpus import LANGUAGES, SPEAKING_RATE, corpus
from bench.metrics import percentile

PROMPT_RATE = 16000  # prompt uploads' sample rate
DEFAULT_SENTENCES = "1:40,2:30,3:20,4:10"
DEFAULT_LANGUAGES = "en:50,zh:50"
VOICE_PREFIX = "capacity"
TARGET_PROMPT_S = 87 / 25  # the targets' own voice (bench/random_model.PROMPT_SPEECH tokens at 25 a second)


@dataclass(frozen=True)
class VoiceSpec:
    """A voice of the pool (or a cold one): its id, prompt length and transcript, and the seed of
    its prompt audio (distinct content per voice: the service's caches key prompts by content)."""

    voice_id: str
    prompt_s: float
    prompt_text: str
    content: str

    def audio(self) -> np.ndarray:
        """A voiced-sounding tone: a pitch that drifts, four harmonics, a syllable-rate envelope and
        a little noise, all drawn from the voice's seed (random weights hear no speech anyway)."""
        rng = np.random.default_rng(zlib.crc32(self.content.encode()))
        t = np.arange(int(self.prompt_s * PROMPT_RATE)) / PROMPT_RATE
        f0 = rng.uniform(90.0, 260.0) * (1 + 0.06 * np.sin(2 * np.pi * rng.uniform(0.3, 1.5) * t))
        phase = 2 * np.pi * np.cumsum(f0) / PROMPT_RATE
        tone = sum(rng.uniform(0.2, 1.0) / k * np.sin(k * phase) for k in range(1, 5))
        envelope = 0.55 + 0.45 * np.sin(2 * np.pi * rng.uniform(3.0, 5.0) * t)
        audio = tone * envelope + 0.02 * rng.standard_normal(t.size)
        return (0.5 * audio / np.max(np.abs(audio))).astype(np.float32)

    def wav(self) -> bytes:
        import soundfile as sf

        buf = io.BytesIO()
        sf.write(buf, self.audio(), PROMPT_RATE, format="WAV")
        return buf.getvalue()


@dataclass(frozen=True)
class Utterance:
    """One request: the length it means (``drawn_s``); its text and voice (None: the target's
    synthetic one-word text and its own voice); ``cold``: the voice is registered just before."""

    drawn_s: float
    text: str | None = None
    voice: VoiceSpec | None = None
    cold: bool = False
    sentences: int = 0  # corpus sentences in the text (0: synthetic)

    @classmethod
    def of(cls, request: float | Utterance) -> Utterance:
        return request if isinstance(request, Utterance) else cls(float(request))


class RequestSource(Protocol):
    name: str
    voices: tuple[VoiceSpec, ...]  # registered before the load (empty: the target's own voice)

    def draw(self, rng: random.Random, session: int | None) -> Utterance: ...

    @property
    def longest_s(self) -> float: ...

    @property
    def prompt_s_max(self) -> float: ...

    def describe(self) -> dict: ...


def parse_shares(text: str, keys: tuple[str, ...] | None = None) -> tuple[tuple[str, float], ...]:
    """``"1:40,2:30"`` -> (("1", 40.0), ("2", 30.0)); ``keys`` limits what may be named."""
    shares = []
    for part in text.split(","):
        key, _, weight = part.partition(":")
        try:
            w = float(weight)
        except ValueError:
            w = 0.0
        if not key.strip() or not w > 0 or (keys is not None and key.strip() not in keys):
            raise ValueError(f"bad share {part!r}: want KEY:WEIGHT with WEIGHT > 0"
                             + (f" and KEY one of {', '.join(keys)}" if keys else ""))
        shares.append((key.strip(), w))
    return tuple(shares)


def _pick(rng: random.Random, shares: tuple[tuple[str, float], ...]) -> str:
    return rng.choices([k for k, _ in shares], weights=[w for _, w in shares])[0]


def _percent(shares: tuple[tuple[str, float], ...]) -> dict[str, float]:
    total = sum(w for _, w in shares)
    return {k: round(100 * w / total, 1) for k, w in shares}


class SyntheticSource:
    """The original workload: lengths from a mix (``capacity_load.Mix``), no text, one voice."""

    name = "synthetic"
    voices: tuple[VoiceSpec, ...] = ()

    def __init__(self, mix, prompt_s: float = TARGET_PROMPT_S) -> None:
        self.mix = mix
        self.prompt_s = prompt_s  # the targets' one voice

    def draw(self, rng: random.Random, session: int | None) -> Utterance:
        return Utterance(self.mix.draw(rng))

    @property
    def longest_s(self) -> float:
        return self.mix.longest_s

    @property
    def prompt_s_max(self) -> float:
        return self.prompt_s

    def describe(self) -> dict:
        return {"name": self.name, "mix": self.mix.describe(), "prompt_s": round(self.prompt_s, 2),
                "text": {"source": "one made-up consonant word per request, its letters set so the random-weight "
                                   "model speaks about the drawn length (capacity_targets.text_for)"},
                "voices": {"count": 1, "prompt_s": [round(self.prompt_s, 2)] * 2}, "cold_voice_share": 0.0}


class ProductionSource:
    """Corpus sentences, a voice pool with one voice per session, and cold voices (module docstring)."""

    name = "production"

    def __init__(self, seed: int = 0, voices: int = 256, prompt_s: tuple[float, float] = (3.0, 10.0),
                 cold_share: float = 0.05, sentences: str = DEFAULT_SENTENCES, languages: str = DEFAULT_LANGUAGES,
                 prefix: str = VOICE_PREFIX) -> None:
        if voices < 1 or not 0.0 <= cold_share <= 1.0 or not 0 < prompt_s[0] <= prompt_s[1]:
            raise ValueError("want voices >= 1, 0 <= cold share <= 1 and 0 < shortest <= longest prompt")
        self.seed, self.prompt_range, self.cold_share, self.prefix = seed, prompt_s, cold_share, prefix
        self.sentences = parse_shares(sentences, keys=("1", "2", "3", "4"))
        self.languages = parse_shares(languages, keys=LANGUAGES)
        self.corpus = corpus()
        rng = random.Random(f"voices/{seed}")
        self.voices = tuple(self._voice(f"{prefix}-v{k:03d}", rng, f"{seed}/v{k}") for k in range(voices))
        self._order = list(range(voices))
        rng.shuffle(self._order)  # session i's voice: distinct for the first `voices` sessions
        self._cold = itertools.count()  # cold voices never repeat within a run, whichever probe draws them

    def _voice(self, voice_id: str, rng: random.Random, content: str) -> VoiceSpec:
        prompt_s = round(rng.uniform(*self.prompt_range), 2)
        lang = _pick(rng, self.languages)
        text, said = [], 0.0  # a transcript about as long as the prompt (it is prefilled with every request)
        for _ in range(32):  # bounded: no sentence may be short enough to fill the rest
            sentence = rng.choice(rng.choice(self.corpus[lang]))
            if not text or said + sentence.expected_s <= 1.25 * prompt_s:
                text.append(sentence.text)
                said += sentence.expected_s
            if said >= 0.8 * prompt_s:
                break
        return VoiceSpec(voice_id, prompt_s, (" " if lang == "en" else "").join(text), content)

    def session_voice(self, session: int) -> VoiceSpec:
        return self.voices[self._order[session % len(self.voices)]]

    def draw(self, rng: random.Random, session: int | None) -> Utterance:
        """A request of ``session`` (None: an open-loop arrival, a caller of its own)."""
        lang = _pick(rng, self.languages)
        picked = [rng.choice(rng.choice(self.corpus[lang])) for _ in range(int(_pick(rng, self.sentences)))]
        text = (" " if lang == "en" else "").join(s.text for s in picked)
        drawn = round(sum(s.expected_s for s in picked), 3)
        if rng.random() < self.cold_share:
            n = next(self._cold)
            cold = self._voice(f"{self.prefix}-cold-{n}", rng, f"{self.seed}/cold/{n}")
            return Utterance(drawn, text, cold, cold=True, sentences=len(picked))
        voice = rng.choice(self.voices) if session is None else self.session_voice(session)
        return Utterance(drawn, text, voice, sentences=len(picked))

    @property
    def longest_s(self) -> float:
        """The longest request the draws can make (four of the longest sentence)."""
        most = max(int(k) for k, _ in self.sentences)
        return most * max(s.expected_s for lang, _ in self.languages for g in self.corpus[lang] for s in g)

    @property
    def prompt_s_max(self) -> float:
        return self.prompt_range[1]

    def describe(self) -> dict:
        sentences = {lang: [s for g in self.corpus[lang] for s in g] for lang, _ in self.languages}
        return {"name": self.name,
                "text": {"source": "bench/corpus.py: voice-agent answers (banking, bookings, travel, weather, "
                                   "deliveries) written for this benchmark, templates filled by a seeded RNG",
                         "languages_pct": _percent(self.languages),
                         "sentences_per_request_pct": _percent(self.sentences),
                         "corpus_sentences": {lang: len(s) for lang, s in sentences.items()},
                         "changed_by_normalisation_pct": {lang: round(100 * sum(x.spoken != x.text for x in s) / len(s), 1)
                                                          for lang, s in sentences.items()},
                         "drawn_length": "the sentences' normalised text at "
                                         + ", ".join(f"{r:g} {'words' if lang == 'en' else 'characters'}/s ({lang})"
                                                     for lang, r in SPEAKING_RATE.items())},
                "voices": {"count": len(self.voices), "prompt_s": list(self.prompt_range),
                           "assignment": "one per session, distinct while sessions <= count; an open-loop "
                                         "arrival draws one"},
                "cold_voice_share": self.cold_share}


class LengthsOf:
    """Another source's drawn lengths sent as the target's synthetic one-word requests in its one
    voice: the workload of replicas that run no model (the live ramp's timed replicas take a
    token's time whatever its text), with the lengths of the workload their calibration measured."""

    voices: tuple[VoiceSpec, ...] = ()

    def __init__(self, source: RequestSource) -> None:
        self.source = source
        self.name = f"{source.name}-lengths"

    def draw(self, rng: random.Random, session: int | None) -> Utterance:
        return Utterance(self.source.draw(rng, session).drawn_s)

    @property
    def longest_s(self) -> float:
        return self.source.longest_s

    @property
    def prompt_s_max(self) -> float:
        return TARGET_PROMPT_S  # the requests go out in the target's own voice

    def describe(self) -> dict:
        return {"name": self.name, "lengths_of": self.source.describe(),
                "text": {"source": "one made-up consonant word per request, its letters set so the replica "
                                   "speaks about the drawn length (capacity_targets.text_for)"},
                "voices": {"count": 1}, "cold_voice_share": 0.0}


def length_summary(pairs: list[tuple[float, float]]) -> dict | None:
    """Served against drawn seconds over ``(drawn, served)`` pairs: p50 / p95 / mean of each and
    the p5 / p50 / p95 of their ratio (1.0: the service spoke what the text means)."""
    pairs = [(d, s) for d, s in pairs if d and d > 0]
    if not pairs:
        return None
    drawn, served = [d for d, _ in pairs], [s for _, s in pairs]
    ratio = [s / d for d, s in pairs]

    def stats(values: list[float]) -> dict:
        return {"p50": round(percentile(values, 50), 2), "p95": round(percentile(values, 95), 2),
                "mean": round(statistics.fmean(values), 2)}

    return {"requests": len(pairs), "drawn_s": stats(drawn), "served_s": stats(served),
            "served_over_drawn": {f"p{q}": round(percentile(ratio, q), 2) for q in (5, 50, 95)}}


async def register_pool(target, voices: tuple[VoiceSpec, ...], concurrency: int = 8) -> None:
    """Register every voice of the pool with ``target`` (``add_voice``), ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(spec: VoiceSpec) -> None:
        async with gate:
            await target.add_voice(spec)

    await asyncio.gather(*(one(v) for v in voices))


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workload", choices=["production", "production-lengths", "synthetic"], default="production",
                    help="production: corpus sentences, a voice pool, cold voices (bench/workload.py); "
                         "production-lengths: its drawn lengths as one made-up word, one voice (what a timed "
                         "replica, which makes 20 tokens a text id whatever the text, needs: --timed's default); "
                         "synthetic: the --mix lengths as one made-up word, one voice (every figure before it)")
    ap.add_argument("--voices", type=int, default=256, help="production: voices registered before the load")
    ap.add_argument("--prompt-s", default="3-10", help="production: prompt seconds of the voices, LO-HI")
    ap.add_argument("--cold-voice-share", type=float, default=0.05,
                    help="production: share of requests whose voice is registered just before (no replica saw it)")
    ap.add_argument("--sentences", default=DEFAULT_SENTENCES, help="production: sentences per request, N:WEIGHT")
    ap.add_argument("--languages", default=DEFAULT_LANGUAGES, help="production: language shares, LANG:WEIGHT")


def source_from_args(args: argparse.Namespace, mix) -> RequestSource:
    if args.workload == "synthetic":
        return SyntheticSource(mix)
    lo, _, hi = args.prompt_s.partition("-")
    source = ProductionSource(seed=args.seed, voices=args.voices, prompt_s=(float(lo), float(hi or lo)),
                              cold_share=args.cold_voice_share, sentences=args.sentences, languages=args.languages)
    return LengthsOf(source) if args.workload == "production-lengths" else source
