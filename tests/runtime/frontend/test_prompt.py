"""Prompt features end to end (tiny ONNX models), alignment rule, typed input errors."""
from __future__ import annotations

import numpy as np
import pytest

from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.frontend import Waveform, align_prompt, check_text
from cosyvoice_runtime.frontend.errors import (
    EmptyTextError,
    InvalidAudioError,
    PromptTooLongError,
    PromptTooShortError,
    TextTooLongError,
)
from tests.runtime.frontend.conftest import FAMILIES, encode, tone


def test_alignment_rule():
    mel, tok = np.zeros((151, 80)), np.arange(80)
    m, t = align_prompt(mel, tok, 2)
    assert m.shape == (150, 80) and t.shape == (75,)
    m, t = align_prompt(np.zeros((150, 80)), np.arange(70), 2)
    assert m.shape == (140, 80) and np.array_equal(t, np.arange(70))


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_features_shapes_and_determinism(frontends, family):
    fe = frontends[family]
    audio = encode(tone(3.0, 44100, channels=2), 44100, "WAV")
    p = fe.prompt(audio, "希望你以后能够做的比我还好呦。")
    # 3 s -> 300 Whisper frames -> 75 tokens; 24 kHz mel 150 frames; L = 75
    assert p.speech_tokens.shape == (75,) and p.speech_tokens.dtype == np.int32
    assert p.mel.shape == (150, 80) and p.mel.dtype == np.float32
    assert p.embedding.shape == (192,) and p.text_tokens.dtype == np.int32 and p.text_tokens.size > 0
    assert p.speech_tokens.min() >= 0 and p.speech_tokens.max() <= 6560
    assert p.family == family
    q = fe.prompt(audio, "希望你以后能够做的比我还好呦。")
    assert np.array_equal(p.speech_tokens, q.speech_tokens) and np.array_equal(p.embedding, q.embedding)
    other = fe.prompt(encode(tone(3.0, 44100, freqs=(150.0, 900.0)), 44100, "FLAC"), "")
    assert not np.allclose(other.embedding, p.embedding)
    assert p.n_tokens == 75 and p.text == fe.prompt_text_tokens("希望你以后能够做的比我还好呦。")[0]


def test_prompt_mel_uses_the_family_fmax(frontends):
    audio = encode(tone(2.0, 48000, freqs=(10000.0,), amps=(0.5,)), 48000, "WAV")
    m2 = frontends["cosyvoice2"].prompt(audio).mel
    m3 = frontends["cosyvoice3"].prompt(audio).mel
    assert m2[2:-2].max() < -8 < -2 < m3[2:-2].max()  # CV3 keeps 8-12 kHz (resampled from 48 kHz directly)


@pytest.mark.parametrize("seconds,sr,err", [(0.3, 16000, PromptTooShortError), (31.0, 16000, PromptTooLongError),
                                            (2.0, 8000, InvalidAudioError)])
def test_prompt_audio_limits(frontends, seconds, sr, err):
    with pytest.raises(err):
        frontends["cosyvoice2"].prompt(encode(tone(seconds, sr), sr, "WAV"))


def test_bad_prompt_inputs_are_typed(frontends):
    fe = frontends["cosyvoice2"]
    with pytest.raises(InvalidAudioError):
        fe.prompt(b"hello, not audio")
    with pytest.raises(InvalidAudioError, match="silent"):
        fe.prompt(encode(np.zeros(32000, np.float32), 16000, "WAV"))
    with pytest.raises(InvalidAudioError, match="sample rate"):
        fe.prompt_from_samples(np.zeros(16000, np.float32), 0)
    x = tone(2.0, 16000)
    x[100] = np.nan
    with pytest.raises(InvalidAudioError, match="NaN"):
        fe.prompt_from_samples(x, 16000)
    with pytest.raises(InvalidInputError):
        fe.prompt("a string", "")


def test_text_validation(frontends):
    fe = frontends["cosyvoice2"]
    for bad in ("", "   \n\t"):
        with pytest.raises(EmptyTextError):
            list(fe.text_segments(bad))
    with pytest.raises(EmptyTextError, match="nothing to speak"):
        list(fe.text_segments("。。！！"))
    with pytest.raises(TextTooLongError):
        list(fe.text_segments("字" * (fe.limits.max_text_chars + 1)))
    with pytest.raises(InvalidInputError):
        check_text(None, 10)
    assert all(issubclass(e, InvalidInputError) for e in (EmptyTextError, TextTooLongError))


def test_text_segments_tokens(frontends):
    fe = frontends["cosyvoice3"]
    segs = list(fe.text_segments("I have 3 cats. 我有2只狗。"))
    assert [s.text for s in segs] == ["I have三cats。我有两只狗。"]
    assert np.array_equal(segs[0].tokens, fe.tokens(segs[0].text))
    instruct = "You are a helpful assistant. 请用广东话表达。<|endofprompt|>"
    assert fe.tokens(instruct)[-1] == 151646


def test_waveform_input(frontends):
    wav = Waveform(tone(2.0, 24000), 24000)
    p = frontends["cosyvoice2"].prompt(wav, "")
    assert p.speech_tokens.shape == (50,) and p.mel.shape == (100, 80) and p.text_tokens.size == 0


def test_prompt_sample_rate_is_bounded_before_resampling(frontends):
    fe = frontends["cosyvoice2"]
    x = tone(2.0, 1_000_000)
    with pytest.raises(InvalidAudioError, match="at most 192000 Hz"):
        fe.prompt(Waveform(x, 1_000_000), "")
    with pytest.raises(InvalidAudioError, match="at most 192000 Hz"):
        fe.prompt_from_samples(x, 1_000_000)
    with pytest.raises(InvalidAudioError, match="Hz"):  # refused from the file header
        fe.prompt(encode(tone(2.0, 200_000), 200_000, "WAV"))


def test_odd_rate_prompt_gives_the_same_shapes(frontends):
    fe = frontends["cosyvoice2"]
    p = fe.prompt(encode(tone(3.0, 44101), 44101, "WAV"), "")
    assert p.speech_tokens.shape == (75,) and p.mel.shape == (150, 80)


def test_compression_bomb_prompt_is_refused_before_decoding(frontends):
    import io

    import soundfile as sf

    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", 16000, 1, format="FLAC") as f:
        for _ in range(600):
            f.write(np.zeros(16000, np.float32))
    with pytest.raises(PromptTooLongError, match="600.00 s"):
        frontends["cosyvoice2"].prompt(buf.getvalue())
