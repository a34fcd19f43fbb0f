"""CPU frontend: text normalisation/splitting/tokenisation, prompt features, voice registry.

Exports resolve lazily so that importing the package never loads transformers or onnxruntime.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Frontend": "frontend", "FrontendLimits": "frontend", "TextSegment": "frontend", "check_text": "frontend",
    "TextNormalizer": "normalize", "ParagraphSplitter": "split", "SplitParams": "split",
    "split_paragraph": "split", "TextTokenizer": "tokenizer", "Waveform": "audio", "decode_audio": "audio",
    "to_waveform": "audio", "resample": "audio", "PromptEncoder": "prompt", "PromptLimits": "prompt",
    "align_prompt": "prompt", "VoiceRegistry": "voices",
    "import_spk2info": "spk2info", "content_voice_id": "voices", "check_voice_id": "voices",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 - lazy exports (PEP 562 __getattr__): the keys of _EXPORTS


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
