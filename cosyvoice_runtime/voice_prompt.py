"""The one voice-prompt type, from the voice store to the flow (spec §6.2 F).

A :class:`VoicePrompt` is computed once per voice (:meth:`Frontend.prompt
<cosyvoice_runtime.frontend.frontend.Frontend.prompt>`), stored by the voice registry, carried
through Ray handle calls in a ``deployments.protocol.PreparedRequest`` and turned into device
tensors by ``Token2Wav.new_stream`` (private to the stream). Numpy only, so the serving layer's
message module imports it without torch.

What the LLM reads of a prompt depends on the synthesis mode (spec §1.2), not on the voice: the
transcript, an instruction or nothing, with or without the prompt speech tokens. Callers pass that
next to the prompt (``PreparedRequest.llm_prompt_text_ids`` / ``llm_use_prompt_speech``, the same
arguments of ``Pipeline.tts``); the flow always gets the whole prompt.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class VoicePrompt:
    """A speaker's prompt features, already aligned (2 mel frames per speech token).

    Attributes:
        family: model family the features belong to (tokens are not interchangeable).
        text_tokens: (Lp,) int32 text ids of the transcript (empty when there is none).
        speech_tokens: (L,) int32 prompt speech tokens.
        mel: (2 * L, n_mels) float32 prompt mel, frames-major.
        embedding: (spk_dim,) float32 raw speaker embedding (CAM++ output).
        text: the normalised transcript.
        kind: "zero_shot", or "sft" for imported SFT speakers, which carry only the embedding.
        meta: what the store keeps beside the arrays (e.g. the content id of a registration).
    """

    family: str
    text_tokens: np.ndarray
    speech_tokens: np.ndarray
    mel: np.ndarray
    embedding: np.ndarray
    text: str = ""
    kind: str = "zero_shot"
    meta: dict = field(default_factory=dict)


    @property
    def n_tokens(self) -> int:
        """Prompt speech tokens (L)."""
        return int(np.asarray(self.speech_tokens).size)
