"""The tiny-model writer: official layout, loads through the normal path, synthesises audio."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cosyvoice_runtime.model import load_model
from cosyvoice_runtime.pipeline import Pipeline
from cosyvoice_runtime.tiny_model import sha256_file, write_tiny_model
from cosyvoice_runtime.voice_prompt import VoicePrompt

OFFICIAL_FILES = {
    "cosyvoice2": ["cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx",
                   "CosyVoice-BlankEN/config.json"],
    "cosyvoice3": ["cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v3.onnx",
                   "CosyVoice-BlankEN/config.json"],
}


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def tiny(request, tmp_path_factory):
    return request.param, write_tiny_model(tmp_path_factory.mktemp("tiny") / request.param, request.param)


def test_layout_and_checksums(tiny):
    family, path = tiny
    for name in OFFICIAL_FILES[family]:
        assert (path / name).is_file(), name
    sums = json.loads((path / "checksums.json").read_text())
    assert set(OFFICIAL_FILES[family]) <= set(sums)
    assert all(sha256_file(path / name) == digest for name, digest in sums.items())


def test_writer_is_deterministic_and_keeps_existing(tiny, tmp_path):
    family, path = tiny
    again = write_tiny_model(tmp_path / "again", family)
    a = torch.load(path / "flow.pt", weights_only=True)
    b = torch.load(again / "flow.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    before = (path / "llm.pt").stat().st_mtime_ns
    write_tiny_model(path, family)  # exists: left alone
    assert (path / "llm.pt").stat().st_mtime_ns == before


def test_synthesises_audio_of_the_right_length(tiny):
    family, path = tiny
    model = load_model(path)
    spec = model.spec
    g = torch.Generator().manual_seed(0)
    n_prompt = 20
    voice = VoicePrompt(
        family=family, text_tokens=np.array([151646] if family == "cosyvoice3" else [100, 200], np.int32),
        speech_tokens=torch.randint(0, spec.llm.speech_token_size, (n_prompt,), generator=g, dtype=torch.int32).numpy(),
        mel=torch.randn(2 * n_prompt, 80, generator=g).numpy(), embedding=torch.randn(192, generator=g).numpy(),
    )
    n_tokens = 40

    def forced(logp, state):  # same work every run: n_tokens speech ids, then eos
        return spec.llm.eos if state.step >= n_tokens else int(torch.argmax(logp[: spec.llm.speech_token_size]))

    pipe = Pipeline(model)
    text = torch.arange(1000, 1010)
    whole = torch.cat(list(pipe.tts(text, voice, stream=False, sample_fn=forced)))
    chunks = list(pipe.tts(text, voice, stream=True, sample_fn=forced))
    per_token = spec.hift.samples_per_frame * spec.flow.token_mel_ratio
    assert whole.numel() == n_tokens * per_token
    assert sum(c.numel() for c in chunks) == n_tokens * per_token and len(chunks) >= 2
    assert whole.abs().max() <= spec.hift.audio_limit and torch.isfinite(whole).all() and whole.std() > 0


def test_full_size_writer_builds_the_official_architecture_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    """size="full" builds the modules from the full-size spec; a failure leaves no directory behind.

    (The ~2 GB checkpoints themselves are written on the GPU machine only: bench/device_serve.sh.)
    """
    import cosyvoice_runtime.model as model_mod
    from cosyvoice_runtime.tiny_model import write_tiny_model

    seen = {}

    def capture(spec, device="cpu"):
        seen["spec"] = spec
        raise RuntimeError("stop before building 0.5B parameters")

    monkeypatch.setattr(model_mod, "build_modules", capture)
    with pytest.raises(RuntimeError, match="stop before"):
        write_tiny_model(tmp_path / "full", "cosyvoice2", size="full")
    spec = seen["spec"]
    assert (spec.llm.llm_input_size, spec.flow.output_size, spec.llm.speech_token_size) == (896, 80, 6561)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="size"):
        write_tiny_model(tmp_path / "x", "cosyvoice2", size="huge")
