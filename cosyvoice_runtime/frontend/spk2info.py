"""Import of an official ``spk2info.pt`` speaker table into the voice store (spec §2.9)."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from cosyvoice_runtime.frontend.errors import VoiceNotFoundError
from cosyvoice_runtime.frontend.voice_id import check_voice_id
from cosyvoice_runtime.frontend.voices import MEL_BINS, VoiceRegistry
from cosyvoice_runtime.voice_prompt import VoicePrompt

logger = logging.getLogger(__name__)


def _array(entry: dict, name: str, dtype) -> np.ndarray | None:
    return entry[name].detach().cpu().numpy().astype(dtype).reshape(-1) if name in entry else None


def import_spk2info(path: str | Path, family: str, registry: VoiceRegistry) -> list[str]:
    """Import an official ``spk2info.pt`` (both entry shapes of spec §2.9). Returns the ids.

    * SFT entries ``{'embedding': (1, 192)}`` become ``kind="sft"`` voices (embedding only).
    * zero-shot entries (``add_zero_shot_spk``) keep their aligned flow prompt tokens, prompt
      feature, prompt text ids and the raw flow embedding.
    Every key is validated before anything is written.
    """
    table = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(table, dict):
        raise VoiceNotFoundError(f"{path}: not a speaker table")
    for key in table:
        check_voice_id(str(key))
    ids = []
    for key, entry in table.items():
        if "flow_prompt_speech_token" in entry:
            mel = entry["prompt_speech_feat"].detach().cpu().numpy().astype(np.float32).reshape(-1, MEL_BINS)
            voice = VoicePrompt(family=family, text="", kind="zero_shot",
                                text_tokens=_array(entry, "prompt_text", np.int32),
                                speech_tokens=_array(entry, "flow_prompt_speech_token", np.int32), mel=mel,
                                embedding=_array(entry, "flow_embedding", np.float32), meta={"source": "spk2info"})
        elif "embedding" in entry:
            voice = VoicePrompt(family=family, text="", kind="sft", text_tokens=np.zeros(0, np.int32),
                                speech_tokens=np.zeros(0, np.int32), mel=np.zeros((0, MEL_BINS), np.float32),
                                embedding=_array(entry, "embedding", np.float32), meta={"source": "spk2info"})
        else:
            logger.warning("spk2info entry %r has neither shape of spec §2.9; skipped", key)
            continue
        registry.put(str(key), voice)
        ids.append(str(key))
    return ids
