"""The seam between the deployments and :mod:`cosyvoice_runtime`.

Deployments talk to three small protocols only (:class:`FrontendRuntime`,
:class:`TokenEngine`, :class:`Token2WavRuntime`), and this module builds the production
implementations from the runtime package. Swapping a runtime component is a change here, not
in a deployment; unit tests inject fakes of the same protocols through the deployments'
``runtime_factory`` constructor argument (house style §2.3 rule 9, §2.8 rule 30).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from deployments.protocol import VoicePrompt

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ protocols
@dataclass
class TokenEvent:
    """What one engine step produced for one request."""

    request_id: str
    new_tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class LMRequest:
    """Inputs of one LLM sequence (one sentence piece)."""

    text_ids: np.ndarray
    prompt_text_ids: np.ndarray
    prompt_speech_ids: np.ndarray
    seed: int | None = None


class TokenEngine(Protocol):
    """Continuous-batching speech-token generator (``cosyvoice_runtime.llm.engine.LLMEngine``)."""

    max_running: int

    def add(self, request_id: str, request: LMRequest) -> None: ...
    def step(self) -> list[TokenEvent]: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...
    def num_running(self) -> int: ...
    def num_waiting(self) -> int: ...


class Token2WavRuntime(Protocol):
    """Per-request stream state + batched flow/HiFT (``cosyvoice_runtime.token2wav``)."""

    sample_rate: int

    def new_stream(self, prompt: VoicePrompt, stream: bool, speed: float, seed: int | None) -> Any: ...
    def next_job(self, state: Any, tokens: Sequence[int], llm_done: bool) -> Any | None: ...
    def run_batch(self, jobs: list[Any]) -> list[np.ndarray]: ...


class FrontendRuntime(Protocol):
    """Text normalisation/splitting/tokenisation, prompt features and the voice store."""

    family: str
    sample_rate: int

    def split(self, text: str) -> list[str]: ...
    def tokenize(self, text: str) -> np.ndarray: ...
    def prompt_from_audio(self, audio: np.ndarray, sample_rate: int, prompt_text: str) -> VoicePrompt: ...
    def save_voice(self, voice_id: str, prompt: VoicePrompt) -> None: ...
    def load_voice(self, voice_id: str) -> VoicePrompt: ...
    def list_voices(self) -> list[str]: ...
    def delete_voice(self, voice_id: str) -> None: ...


@dataclass
class SynthesisRuntime:
    """What a synthesizer replica holds: the token engine and token2wav over one model."""

    engine: TokenEngine
    token2wav: Token2WavRuntime
    device: str
    details: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------ model directory
@dataclass(frozen=True)
class ModelSource:
    """Where a replica gets its model: resolved on the replica's own node (see resolve_model_dir)."""

    model_dir: str | None = None
    tiny_family: str = "cosyvoice2"

    def resolve(self) -> Path:
        return resolve_model_dir(self.model_dir, self.tiny_family)


def resolve_model_dir(model_dir: str | None, family: str) -> Path:
    """The configured model directory, else ``$FAST_COSY_MODEL_DIR``, else the tiny default.

    The tiny random-weight model (it does not speak) is written on first use, deterministically,
    so every node that needs it can generate the same one locally.
    """
    from deployments import constants

    chosen = model_dir or constants.model_dir_override()
    if chosen:
        return Path(chosen).expanduser()
    target = constants.tiny_model_dir(family)
    if not (target / f"{family}.yaml").exists():
        from cosyvoice_runtime.tiny_model import write_tiny_model

        logger.warning("no model directory configured: writing the tiny RANDOM-WEIGHT %s model to %s", family, target)
        try:
            write_tiny_model(target, family=family)
        except OSError:
            # Another replica on this node won the atomic rename; its directory is complete.
            if not (target / f"{family}.yaml").exists():
                raise
    return target
