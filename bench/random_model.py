"""Random-weight models for the benchmarks that time runtime pieces, not replicas.

``bench/profile_stages.py``, ``bench/kernel_profile.py`` and ``bench/stepper_check.py`` time one
stage (a decode step, a flow pass) of a model built here in memory: full-size or tiny
architectures with PyTorch's initialisation, no files. Replicas are built only by the product
(``bench/replica.py``: the execution plan and the assembler), never from these.

The shapes are the official baseline's zero-shot request: 87 prompt speech tokens, 14 prompt
text tokens, 40 text tokens (docs/tuning.md §6).
"""
from __future__ import annotations

import copy
import tempfile

import torch

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID
from cosyvoice_runtime.model import CosyVoiceModel, build_modules
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir
from cosyvoice_runtime.voice_prompt import VoicePrompt

PROMPT_SPEECH, PROMPT_TEXT, TEXT = 87, 14, 40  # the official baseline's zero-shot shapes
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the GPU's queued work (a timer's end); nothing on the CPU."""
    device = torch.device(device) if device is not None else None
    if device is None and torch.cuda.is_available():
        torch.cuda.synchronize()
    elif device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(family: str, size: str, device: str, seed: int = 0) -> CosyVoiceModel:
    """A ``full`` or ``tiny`` architecture of ``family`` with random weights on ``device``, in eval mode."""
    spec = write_config_dir(tempfile.mkdtemp(prefix="bench-spec-"), family, None if size == "full" else TINY_DIMS[family])
    torch.manual_seed(seed)
    mods = build_modules(spec, device=device)
    for m in mods.values():
        fold = getattr(m, "remove_weight_norm", None)
        if callable(fold):
            fold()
        m.eval().requires_grad_(False)
    return CosyVoiceModel(spec=spec, **mods)


def cast(model: CosyVoiceModel, dtype: torch.dtype) -> CosyVoiceModel:
    """Copies of the LLM and flow in ``dtype``; the vocoder stays float32 (phase accumulation).

    ``Module.to`` works in place: copying keeps the fp32 base intact, so a stage timed after a
    bf16 one does not run on weights rounded to bf16.
    """
    return CosyVoiceModel(spec=model.spec, llm=copy.deepcopy(model.llm).to(dtype),
                          flow=copy.deepcopy(model.flow).to(dtype), hift=model.hift)


def make_voice(model: CosyVoiceModel, seed: int = 1) -> tuple[VoicePrompt, torch.Tensor]:
    """A random voice (zero-shot: the LLM and the flow read its speech tokens) and text ids on the device."""
    g = torch.Generator().manual_seed(seed)
    s = model.spec
    voice = VoicePrompt(
        family=s.family,
        text_tokens=torch.randint(0, 150000, (PROMPT_TEXT,), generator=g, dtype=torch.int32).numpy(),
        speech_tokens=torch.randint(0, s.llm.speech_token_size, (PROMPT_SPEECH,), generator=g,
                                    dtype=torch.int32).numpy(),
        mel=torch.randn(2 * PROMPT_SPEECH, s.flow.output_size, generator=g).numpy(),
        embedding=torch.randn(s.flow.spk_embed_dim, generator=g).numpy(),
    )
    text = torch.randint(0, 150000, (TEXT,), generator=g).to(model.device)
    if s.family == "cosyvoice3":
        text[0] = ENDOFPROMPT_TOKEN_ID  # CosyVoice3's LLM needs it in prompt text + text
    return voice, text
