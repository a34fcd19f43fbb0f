"""TextFrontend over the real runtime frontend and voice registry (tiny model)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deployments.frontend import FrontendConfig, TextFrontend
from deployments.model_source import ModelSource
from deployments.protocol import (
    InvalidInputError,
    PayloadTooLargeError,
    SynthesisMode,
    SynthesisRequest,
    VoiceExistsError,
    VoiceNotFoundError,
)

SR = 16000


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-cosyvoice2", "cosyvoice2")
    cfg = FrontendConfig(voices_dir=str(tmp_path_factory.mktemp("voices")))
    return TextFrontend(cfg, ModelSource(str(model_dir)))


def _tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def test_register_prepare_delete(frontend):
    async def main():
        info = await frontend.register_voice("v1", "Hello, this is my voice.", _tone(3.0), SR)
        assert info.family == "cosyvoice2" and info.num_prompt_tokens == 75  # 25 tokens/s
        with pytest.raises(VoiceExistsError):
            await frontend.register_voice("v1", "again", _tone(3.0), SR)
        req = SynthesisRequest(request_id="r", text="Hello world. It costs 5 dollars!", voice_id="v1")
        prepared = await frontend.prepare(req)
        assert prepared.llm_use_prompt_speech and prepared.prompt.mel.shape == (150, 80)
        assert len(prepared.llm_prompt_text_ids) > 0
        assert all(p.text_ids.dtype == np.int32 and p.text_ids.size for p in prepared.pieces)
        assert "five" in " ".join(p.text for p in prepared.pieces).lower()  # normalised
        cross = await frontend.prepare(
            SynthesisRequest(request_id="c", text="Bonjour.", mode=SynthesisMode.CROSS_LINGUAL, voice_id="v1"))
        assert cross.llm_prompt_text_ids.size == 0 and not cross.llm_use_prompt_speech
        instruct = await frontend.prepare(SynthesisRequest(request_id="i", text="Hi.", mode=SynthesisMode.INSTRUCT,
                                                           voice_id="v1", instruct_text=" Speak slowly. "))
        # the instruction verbatim, closed by <|endofprompt|>, instead of the transcript; no prompt speech
        assert instruct.llm_prompt_text_ids.tolist() == frontend.rt.tokenize("Speak slowly.<|endofprompt|>").tolist()
        assert not instruct.llm_use_prompt_speech
        assert [v.voice_id for v in await frontend.list_voices()] == ["default", "v1"]  # + the tiny demo voice
        await frontend.delete_voice("v1")
        with pytest.raises(VoiceNotFoundError):
            await frontend.get_voice("v1")

    asyncio.run(main())


@pytest.mark.parametrize("audio, error", [(_tone(0.2), InvalidInputError), (_tone(31.0), PayloadTooLargeError),
                                          (np.zeros(SR * 2, np.float32), InvalidInputError)])
def test_bad_prompts(frontend, audio, error):
    req = SynthesisRequest(request_id="z", text="Hi.", mode=SynthesisMode.ZERO_SHOT, prompt_text="hi",
                           prompt_audio=audio, prompt_sample_rate=SR)
    with pytest.raises(error):
        asyncio.run(frontend.prepare(req))


def test_tiny_model_serves_a_default_voice(frontend):
    """The printed curl example uses voice 'default': it exists on a fresh tiny-model start."""
    async def main():
        voices = await frontend.list_voices()
        assert "default" in [v.voice_id for v in voices]
        info = await frontend.get_voice("default")
        assert info.family == "cosyvoice2" and info.num_prompt_tokens == 100  # 4 s at 25 tokens/s
        prepared = await frontend.prepare(SynthesisRequest(request_id="d", text="Hello world.", voice_id="default"))
        assert prepared.prompt.mel.shape == (200, 80)

    asyncio.run(main())
