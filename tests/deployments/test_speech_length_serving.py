"""``synthesizer.speech_length`` on the real tiny random-weight model: "auto" ends each utterance
at its text's speaking-rate length (English and Chinese, within the jitter, the same for the same
seed), "model" keeps the LLM's own end and the official limits, and a bistream request gets its
length from its whole text."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cosyvoice_runtime.lm_messages import BistreamLMRequest, LMRequest
from cosyvoice_runtime.speech_length import SpeakingRate
from deployments.assembler import speech_length_rule
from deployments.frontend import FrontendConfig, TextFrontend
from deployments.model_source import ModelSource
from deployments.protocol import SynthesisRequest
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig

TEXTS = {"en": "The weather is lovely today. Shall we take a walk in the park after lunch?",
         "zh": "今天天气很好。我们吃完午饭去公园散步吧？"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "cv2", "cosyvoice2"))


@pytest.fixture(scope="module")
def frontend(model_dir, tmp_path_factory):
    return TextFrontend(FrontendConfig(voices_dir=str(tmp_path_factory.mktemp("voices"))), ModelSource(model_dir))


def _synth(model_dir, **knobs) -> Synthesizer:
    synth = Synthesizer(SynthesizerConfig(device="cpu", warmup=False, max_model_len=1024, **knobs),
                        ModelSource(model_dir))

    synth.outside_serve()  # no @serve.batch outside a replica
    return synth


def _speak(synth, frontend, text: str, seed: int):
    """(the prepared request, its audio joined)."""
    async def main():
        prepared = await frontend.prepare(SynthesisRequest(request_id=f"r{seed}", text=text, voice_id="default",
                                                           seed=seed))
        return prepared, np.concatenate([c.samples async for c in synth.synthesize(prepared)])
    return asyncio.run(main())


def test_auto_is_text_rate_for_random_weights_only(model_dir, tmp_path):
    assert speech_length_rule("auto", model_dir) == "text_rate"
    real = tmp_path / "real"
    real.mkdir()
    (real / "cosyvoice2.yaml").write_text("# an official config\n")
    assert speech_length_rule("auto", str(real)) == "model"
    assert speech_length_rule("text_rate", str(real)) == "text_rate"
    assert speech_length_rule("model", model_dir) == "model"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_each_piece_lasts_its_texts_reading_time_within_the_jitter(model_dir, frontend, lang):
    synth = _synth(model_dir)  # speech_length "auto" on the tiny model
    assert synth.runtime.details["speech_length"] == "text_rate"
    rate = synth.runtime.engine.spec.token_frame_rate
    prepared, audio = _speak(synth, frontend, TEXTS[lang], seed=5)
    assert prepared.pieces  # one LLM sequence per piece (the splitter merges short sentences)
    per_token = synth.sample_rate // rate
    expected_s = sum(SpeakingRate().seconds(p.text) for p in prepared.pieces)
    assert 0.9 * expected_s - 0.1 <= len(audio) / synth.sample_rate <= 1.1 * expected_s + 0.1
    rule = synth.runtime.engine.length_rule
    assert len(audio) == per_token * sum(rule(p.text_ids, 5) for p in prepared.pieces)  # exact tokens
    again = _speak(_synth(model_dir), frontend, TEXTS[lang], seed=5)[1]
    assert len(again) == len(audio)  # the seed fixes the jitter


def test_model_keeps_the_llms_own_end_within_the_official_limits(model_dir):
    """Off: a request decodes as before the option (the official 2x-20x limits, capped by the KV slot)."""
    synth = _synth(model_dir, speech_length="model")
    engine = synth.runtime.engine
    assert engine.length_rule is None and synth.runtime.details["speech_length"] == "model"
    text = np.arange(300, 340, dtype=np.int32)
    engine.add("r", LMRequest(text, np.zeros(0, np.int32), np.zeros(0, np.int32), seed=1))
    state = engine.engine.state_of("r")
    assert (state.min_len, state.max_len) == (2 * 40, 20 * 40)  # cosyvoice2's min/max_token_text_ratio
    engine.abort("r")


def test_bistream_length_comes_from_its_whole_text(model_dir, monkeypatch):
    synth = _synth(model_dir)
    engine = synth.runtime.engine
    from cosyvoice_runtime.frontend.tokenizer import TextTokenizer

    lengths = []
    feed = engine.engine.feed_text
    monkeypatch.setattr(engine.engine, "feed_text",
                        lambda rid, chunks, end=False, length=None: lengths.append(length) or feed(rid, chunks, end, length))
    ids = TextTokenizer(f"{model_dir}/CosyVoice-BlankEN", "cosyvoice2").encode(TEXTS["zh"])
    engine.add_bistream("b", BistreamLMRequest(np.arange(5, 10, dtype=np.int32), np.zeros(0, np.int32), seed=9))
    half = len(ids) // 2
    engine.feed_text("b", ids[:half], end=False)
    engine.feed_text("b", ids[half:], end=True)
    emitted, reason = 0, None
    while engine.has_unfinished():
        for ev in engine.step():
            emitted += len(ev.tokens)
            reason = ev.finish_reason if ev.finished else reason
    target = engine.length_rule(ids, 9)
    assert lengths == [None, target]  # the rule over the whole text, given with its end
    assert abs(target - 25 * SpeakingRate().seconds(TEXTS["zh"])) <= 0.1 * 25 * SpeakingRate().seconds(TEXTS["zh"]) + 1
    # ended by the length, never by eos; the byte-level tiny tokenizer's 3 ids per character make
    # the interleaved stage (3 speech tokens per text id) outrun the target: it ends with the text
    assert reason == "length" and emitted >= target
    assert "b" not in engine._bistream_text
