"""Speech tokens -> waveform: the streaming chunk schedule, flow calls and vocoder glue.

A request owns a :class:`StreamState` (hop length, token offset, vocoder caches); the
:class:`Token2Wav` object holds only the shared models, so any replica can serve any chunk
and chunks of different requests can be batched.

Schedule (spec §6.1): the first chunk is ``token_hop_len + pad`` tokens with
``pad = ceil(Lp / hop) * hop - Lp`` so that chunk boundaries fall on the flow's 25-token
attention chunks counted from the prompt start; every flow call recomputes all tokens up to
``offset + hop + lookahead`` and keeps the mel from ``2 * offset``; the hop then grows by
``stream_scale_factor`` up to ``token_max_hop_len``. The official code keeps the hop on the
shared model object (so later requests start at the maximum hop); here it is per request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.flow.flow import FlowItem
from cosyvoice_runtime.hift.streaming import VocoderStream, vocode_chunk


@dataclass
class FlowPrompt:
    """Prompt conditioning of the flow for one voice.

    Attributes:
        tokens: (1, Lp) int32 prompt speech tokens (aligned to ``feat``: 2 frames per token).
        feat: (1, 2 * Lp, n_mels) float32 prompt mel, frames-major.
        embedding: (1, spk_dim) float32 raw speaker embedding.
    """

    tokens: torch.Tensor
    feat: torch.Tensor
    embedding: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[1])


@dataclass
class StreamState:
    """Per-request token2wav state, owned by the caller and passed in on every call."""

    prompt: FlowPrompt
    stream: bool
    speed: float
    hop_len: int
    vocoder: VocoderStream
    generator: torch.Generator | None = None
    token_offset: int = 0
    calls: int = 0
    finished: bool = False
    samples_out: int = 0


@dataclass
class Token2WavJob:
    """One flow + vocoder call: tokens ``[0, n_tokens)`` of a request."""

    state: StreamState
    tokens: torch.Tensor  # (1, n_tokens) int32
    finalize: bool
    hop: int  # tokens this call advances the offset by (0 for the final call)
    source_override: torch.Tensor | None = field(default=None, repr=False)


def prompt_token_pad(n_prompt_tokens: int, hop: int) -> int:
    """Extra first-chunk tokens that align chunk ends to the flow's attention chunks."""
    return math.ceil(n_prompt_tokens / hop) * hop - n_prompt_tokens


class Token2Wav:
    """Flow + HiFT over per-request :class:`StreamState` objects.

    Args:
        spec: the model spec.
        flow: the token-to-mel module (:class:`~cosyvoice_runtime.flow.flow.Flow`; its
            ``inference_batch`` solves the jobs of several requests at once).
        hift: the vocoder module.
        official_final_full_attention: the official code runs the last streamed flow call with
            full attention although all earlier calls used chunk masks (spec §4.8); by default we
            keep the chunk masks so the final frames are computed like the ones before them.
    """

    def __init__(self, spec: ModelSpec, flow: torch.nn.Module, hift: torch.nn.Module,
                 official_final_full_attention: bool = False) -> None:
        self.spec = spec
        self.flow = flow
        self.hift = hift
        self.official_final_full_attention = official_final_full_attention
        self.lookahead = spec.flow.pre_lookahead_len
        self.ratio = spec.flow.token_mel_ratio

    def new_stream(self, prompt: FlowPrompt, stream: bool, speed: float = 1.0,
                   generator: torch.Generator | None = None) -> StreamState:
        if not (0.5 <= speed <= 2.0) or not math.isfinite(speed):
            raise InvalidInputError(f"speed must be within [0.5, 2.0], got {speed}")
        if stream and speed != 1.0:
            raise InvalidInputError("speed != 1 is only supported without streaming")
        return StreamState(
            prompt=prompt, stream=stream, speed=speed, hop_len=self.spec.stream.token_hop_len,
            vocoder=VocoderStream.create(self.spec), generator=generator,
        )

    def next_job(self, state: StreamState, tokens: Sequence[int] | torch.Tensor, llm_done: bool) -> Token2WavJob | None:
        """The job to run now for ``tokens`` generated so far, or None to wait for more tokens."""
        if state.finished:
            return None
        ids = torch.as_tensor(tokens, dtype=torch.int32).reshape(1, -1)
        n = ids.shape[1]
        if state.stream:
            hop = state.hop_len
            if state.token_offset == 0:
                hop += prompt_token_pad(state.prompt.n_tokens, self.spec.stream.token_hop_len)
            end = state.token_offset + hop + self.lookahead
            if n >= end:
                return Token2WavJob(state, ids[:, :end], finalize=False, hop=hop)
        if llm_done:
            return Token2WavJob(state, ids, finalize=True, hop=0)
        return None

    def _flow_item(self, job: Token2WavJob) -> FlowItem:
        state = job.state
        p = state.prompt
        streaming_masks = state.stream and not (job.finalize and self.official_final_full_attention)
        return FlowItem(token=job.tokens, prompt_token=p.tokens, prompt_feat=p.feat, embedding=p.embedding,
                        streaming=streaming_masks, finalize=job.finalize)

    @torch.inference_mode()
    def flow_mels(self, jobs: list[Token2WavJob]) -> list[torch.Tensor]:
        """New mel frames of each job, (1, n_mels, frames) from its token offset on; one CFM solve."""
        mels = self.flow.inference_batch([self._flow_item(job) for job in jobs])
        return [mel[:, :, job.state.token_offset * self.ratio:] for mel, job in zip(mels, jobs)]

    def flow_mel(self, job: Token2WavJob) -> torch.Tensor:
        return self.flow_mels([job])[0]

    @torch.inference_mode()
    def vocode(self, job: Token2WavJob, mel: torch.Tensor) -> torch.Tensor:
        """Vocode a job's new mel frames and advance its state. Returns (samples,) float32."""
        state = job.state
        audio = vocode_chunk(self.hift, state.vocoder, mel, finalize=job.finalize, generator=state.generator,
                             source_override=job.source_override, speed=state.speed)
        state.calls += 1
        if job.finalize:
            state.finished = True
        else:
            state.token_offset += job.hop
            state.hop_len = min(self.spec.stream.token_max_hop_len,
                                state.hop_len * self.spec.stream.stream_scale_factor)
        audio = audio.reshape(-1)
        state.samples_out += audio.numel()
        return audio

    def run(self, job: Token2WavJob) -> torch.Tensor:
        """Flow + vocoder for one job; returns the (samples,) audio to emit."""
        return self.vocode(job, self.flow_mel(job))

    def run_batch(self, jobs: list[Token2WavJob], max_batch: int = 16) -> list[torch.Tensor]:
        """Run jobs of different requests (at most one per request); the audio of each, in order.

        The flow runs as one batched solve per group of ``max_batch`` jobs; the vocoder glue is per
        request (its caches are per request and cheap next to the flow).
        """
        if len({id(job.state) for job in jobs}) != len(jobs):
            raise ValueError("a batch may hold at most one job per request (jobs of a request are sequential)")
        out: list[torch.Tensor] = []
        for start in range(0, len(jobs), max_batch):
            group = jobs[start:start + max_batch]
            out += [self.vocode(job, mel) for job, mel in zip(group, self.flow_mels(group))]
        return out

    def synthesize(self, prompt: FlowPrompt, tokens: Sequence[int] | torch.Tensor, stream: bool = False,
                   speed: float = 1.0, generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """All chunks of an utterance whose tokens are already known (VC path, tests)."""
        state = self.new_stream(prompt, stream=stream, speed=speed, generator=generator)
        chunks = []
        while (job := self.next_job(state, tokens, llm_done=True)) is not None:
            chunks.append(self.run(job))
        return chunks
