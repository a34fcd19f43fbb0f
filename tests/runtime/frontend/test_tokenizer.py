"""Text tokenizer and the tiny asset writers (tokenizer directory, ONNX stand-ins)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cosyvoice_runtime import tiny_assets
from cosyvoice_runtime.errors import ModelLoadError
from cosyvoice_runtime.frontend.special_tokens import CV2_SPECIALS, CV3_SPECIALS, EXPECTED_VOCAB_SIZE
from cosyvoice_runtime.frontend.tokenizer import TextTokenizer


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def tok(request, model_dirs):
    return TextTokenizer(model_dirs[request.param] / "CosyVoice-BlankEN", request.param)


def test_special_token_ids_read_from_tokenizer(tok):
    ids = tok.special_token_ids
    assert ids["<|endoftext|>"] == 151643 and ids["<|im_start|>"] == 151644 and ids["<|im_end|>"] == 151645
    assert ids["<|endofprompt|>"] == 151646 == tok.endofprompt_id
    assert ids["[breath]"] == 151647 and ids["[mn]"] == 151662
    assert len(tok) == EXPECTED_VOCAB_SIZE[tok.family]
    if tok.family == "cosyvoice3":
        assert ids["<|endofsystem|>"] == 151663 and ids["[AA]"] == 151664 and ids["[ZH]"] == 151747
        assert ids["[a]"] == 151748 and ids["[ǜ]"] == 151923


def test_encode_specials_unsplit_and_no_unknowns(tok):
    text = "You are a helpful assistant.<|endofprompt|>你好[laughter]世界 😀 <strong>Zürich</strong>"
    ids = tok.encode(text)
    assert 151646 in ids and tok.special_token_ids["[laughter]"] in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < len(tok) for i in ids)
    assert tok.encode("") == []
    assert tok.count("the the") == len(tok.encode("the the"))


def test_released_layout_gets_specials_registered(tmp_path):
    """The released BlankEN has only the Qwen2 specials: the runtime registers the rest in order."""
    for family, specials in (("cosyvoice2", CV2_SPECIALS), ("cosyvoice3", CV3_SPECIALS)):
        d = tiny_assets.write_tokenizer(tmp_path / family, family, with_cosyvoice_specials=False)
        t = TextTokenizer(d, family)
        assert len(t) == EXPECTED_VOCAB_SIZE[family]
        assert [t.special_token_ids[s] for s in specials] == list(range(151646, 151646 + len(specials)))


def test_wrong_family_is_a_load_error(model_dirs):
    with pytest.raises(ModelLoadError, match="expected 151663"):
        TextTokenizer(model_dirs["cosyvoice3"] / "CosyVoice-BlankEN", "cosyvoice2")
    with pytest.raises(ModelLoadError):
        TextTokenizer(model_dirs["cosyvoice2"] / "missing", "cosyvoice2")


def test_tiny_campplus_signature(tmp_path):
    import onnxruntime as ort

    path = tiny_assets.write_campplus_onnx(tmp_path / "c.onnx", seed=3)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (inp,), (_,) = sess.get_inputs(), sess.get_outputs()
    assert inp.name == "input" and inp.type == "tensor(float)" and inp.shape[0] == 1 and inp.shape[2] == 80
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((1, t, 80)).astype(np.float32) for t in (50, 120))
    ea, ea2, eb = (sess.run(None, {"input": x})[0] for x in (a, a, b))
    assert ea.shape == (1, 192) and ea.dtype == np.float32
    assert np.array_equal(ea, ea2) and not np.allclose(ea, eb)


def test_tiny_speech_tokenizer_signature(tmp_path):
    import onnxruntime as ort

    path = tiny_assets.write_speech_tokenizer_onnx(tmp_path / "s.onnx", seed=3)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    i0, i1 = sess.get_inputs()
    assert i0.type == "tensor(float)" and i0.shape[:2] == [1, 128] and i1.type == "tensor(int32)"
    rng = np.random.default_rng(0)
    seen = set()
    for t in (1, 2, 3, 4, 5, 7, 100, 301, 3000):
        x = rng.standard_normal((1, 128, t)).astype(np.float32)
        ids = sess.run(None, {i0.name: x, i1.name: np.array([t], np.int32)})[0]
        assert ids.shape == (1, math.ceil(math.ceil(t / 2) / 2)) and ids.dtype.kind == "i"
        assert ids.min() >= 0 and ids.max() <= 6560
        assert np.array_equal(ids, sess.run(None, {i0.name: x, i1.name: np.array([t], np.int32)})[0])
        seen.update(ids.ravel().tolist())
    assert len(seen) > 100  # input-dependent, spread over the code space
