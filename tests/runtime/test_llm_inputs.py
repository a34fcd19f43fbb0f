"""lm_input layout, length limits and the CosyVoice3 <|endofprompt|> check."""
from __future__ import annotations

import pytest
import torch

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID, LLMSpec, Qwen2Spec
from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.llm.inputs import build_lm_input, length_limits
from cosyvoice_runtime.llm.model import build_llm


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    out = {}
    for family in ("cosyvoice2", "cosyvoice3"):
        backbone = Qwen2Spec(8, 1, 2, 1, 16, ENDOFPROMPT_TOKEN_ID + 10, 1e-6, 1e6, True)
        out[family] = build_llm(LLMSpec(family=family, backbone=backbone, speech_token_size=20,
                                        llm_input_size=8, llm_output_size=8)).eval()
    return out


def test_layout_and_limits(models):
    model = models["cosyvoice3"]
    text, prompt_text, prompt_speech = [5, 6, 7], [1, ENDOFPROMPT_TOKEN_ID], [3, 4, 19, 0]
    inp = build_lm_input(model, torch.tensor([text]), prompt_text, prompt_speech)
    e = inp.embeds
    assert e.shape == (1 + 2 + 3 + 1 + 4, 8)
    assert torch.equal(e[0], model.speech_embedding.weight[20])  # sos = S
    assert torch.equal(e[1:6], model.backbone.embed_tokens.weight[prompt_text + text])
    assert torch.equal(e[6], model.speech_embedding.weight[22])  # task_id = S + 2
    assert torch.equal(e[7:], model.speech_embedding.weight[prompt_speech])
    assert (inp.min_len, inp.max_len) == (6, 60)  # prompt text excluded


def test_cv2_without_prompt(models):
    model = models["cosyvoice2"]
    inp = build_lm_input(model, [9, 10, 11, 12, 13])
    assert inp.embeds.shape == (7, 8)
    assert torch.equal(inp.embeds[0], model.llm_embedding.weight[0])
    assert torch.equal(inp.embeds[-1], model.llm_embedding.weight[1])
    assert length_limits(model.spec, 7) == (14, 140)


def test_cv3_requires_endofprompt_and_inputs_are_validated(models):
    with pytest.raises(InvalidInputError, match="endofprompt"):
        build_lm_input(models["cosyvoice3"], [5, 6], [1, 2], [3])
    build_lm_input(models["cosyvoice3"], [5, ENDOFPROMPT_TOKEN_ID, 6])  # may sit in the text too
    build_lm_input(models["cosyvoice2"], [5, 6], [1, 2], [3])  # CV2 has no such rule
    with pytest.raises(InvalidInputError):
        build_lm_input(models["cosyvoice2"], [])
    with pytest.raises(InvalidInputError):
        build_lm_input(models["cosyvoice2"], [5], None, [20])  # 20 is not a speech token
