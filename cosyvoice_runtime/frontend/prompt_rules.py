"""What the LLM reads before the text, per inference mode (spec §1.2), and CosyVoice3's prefix.

The mode table: zero-shot and registered-voice synthesis give the LLM the prompt's transcript and
its speech tokens; cross-lingual gives neither (the flow still gets the whole prompt); instruct
gives the instruction, verbatim and closed by ``<|endofprompt|>``, instead of the transcript.
CosyVoice3 expects every LLM text to start with a system prompt closed by ``<|endofprompt|>``
(the official frontend adds it); a text that already holds the marker is left alone.

Standard library only: the serving frontend (``deployments/frontend.py``) applies these rules on
CPU replicas without importing torch.
"""
from __future__ import annotations

from typing import NamedTuple

from cosyvoice_runtime.frontend.special_tokens import ENDOFPROMPT

CV3_SYSTEM_PROMPT = "You are a helpful assistant."


class LLMPrompt(NamedTuple):
    """Which parts of the voice prompt the LLM sees in a mode."""

    transcript: bool  # the prompt's transcript ids before the text (else nothing, or the instruction)
    speech: bool  # the prompt's speech tokens


MODES = {
    "zero_shot": LLMPrompt(transcript=True, speech=True),
    "voice": LLMPrompt(transcript=True, speech=True),
    "cross_lingual": LLMPrompt(transcript=False, speech=False),
    "instruct": LLMPrompt(transcript=False, speech=False),
}


def with_cv3_prefix(family: str, text: str, system_prompt: str = CV3_SYSTEM_PROMPT) -> str:
    """``text`` as CosyVoice3's LLM expects it (system prompt + ``<|endofprompt|>`` first)."""
    if family == "cosyvoice3" and ENDOFPROMPT not in text:
        return f"{system_prompt}{ENDOFPROMPT}{text}"
    return text


def instruct_prompt(instruction: str) -> str:
    """The instruction as the LLM reads it in instruct mode: verbatim, closed by ``<|endofprompt|>``."""
    instruction = instruction.strip()
    return instruction if ENDOFPROMPT in instruction else instruction + ENDOFPROMPT
