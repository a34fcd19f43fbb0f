"""The protocols between the deployments and :mod:`cosyvoice_runtime`.

Deployments talk to three small protocols only (:class:`FrontendRuntime`,
:class:`TokenEngine`, :class:`Token2WavRuntime`); :mod:`deployments.assembler` builds the
production implementations (:mod:`deployments.runtime_adapter`) from the replica's execution
plan, and unit tests inject fakes of the same protocols through the deployments'
``runtime_factory`` constructor argument (house style §2.3 rule 9, §2.8 rule 30).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from cosyvoice_runtime.lm_messages import LMRequest, TokenEvent
from deployments.protocol import VoicePrompt


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
    n_mels: int  # prompt mel width
    embedding_dim: int  # speaker embedding width

    def new_stream(self, prompt: VoicePrompt, stream: bool, speed: float, seed: int | None) -> Any: ...
    def next_job(self, state: Any, tokens: Sequence[int], llm_done: bool) -> Any | None: ...
    # Tokens in all at which next_job has the next streamed job; None: the next is the final one.
    def tokens_needed(self, state: Any) -> int | None: ...
    # A job that solves the stream's voice prompt prefix alone while the LLM makes its first chunk
    # (the stepped token2wav runs it; no audio), or None: no prefix to solve.
    def prefix_job(self, state: Any) -> Any | None: ...
    def run_batch(self, jobs: list[Any]) -> list[np.ndarray]: ...
    # Counters and sizes of the incremental flow's caches (FLOW_STATS keys; zeros without it).
    def flow_stats(self) -> dict[str, float]: ...


FLOW_STATS = ("flow_cache_bytes", "flow_cache_fallbacks_total", "flow_prompt_prefix_hits_total",
              "flow_prompt_prefix_misses_total", "flow_prompt_prefix_primed_total", "flow_prompt_cache_budget_bytes")


class FrontendRuntime(Protocol):
    """Text normalisation/splitting/tokenisation, prompt features and the voice store."""

    family: str
    sample_rate: int

    def split(self, text: str) -> list[str]: ...
    def tokenize(self, text: str) -> np.ndarray: ...
    def prompt_from_audio(self, audio: np.ndarray, sample_rate: int, prompt_text: str) -> VoicePrompt: ...
    def save_voice(self, voice_id: str, prompt: VoicePrompt, overwrite: bool = True) -> None: ...
    def load_voice(self, voice_id: str) -> VoicePrompt: ...
    def list_voices(self) -> list[str]: ...
    def delete_voice(self, voice_id: str) -> None: ...
    def voice_store_status(self) -> tuple[str, str | None]: ...  # (where, why it refuses writes or None)


@dataclass
class SynthesisRuntime:
    """What a synthesizer replica holds: the token engine and token2wav over one model."""

    engine: TokenEngine
    token2wav: Token2WavRuntime
    device: str
    # what was loaded and built, for /health and reports (decisions come from the ExecutionPlan)
    details: dict = field(default_factory=dict)
    # the flow batch and the voice prompt this replica accepts once fitted to max_mem_gb (None: as configured)
    max_flow_batch: int | None = None
    max_prompt_tokens: int | None = None
    # CUDA graphs captured in the replica's process so far (start-up and later; 0 without graphs)
    graph_captures: Callable[[], int] = lambda: 0
    # calls of a graphed stage that ran eagerly on CUDA: shapes beyond the captured buckets
    graph_misses: Callable[[], int] = lambda: 0
    # the replica's graphs captured before ready and in the background after
    # (cosyvoice_runtime.graph_schedule.GraphSchedule: start_background, stop, busy, snapshot); None: no graphs
    graph_schedule: Any = None
