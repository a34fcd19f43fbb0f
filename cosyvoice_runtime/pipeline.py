"""Single-process reference synthesiser: text token ids + voice prompt -> audio chunks.

This is the whole model path in one place, without batching across requests: the LLM decodes
one sequence (:func:`cosyvoice_runtime.llm.generate.decode`), CosyVoice3's silent-token filter
runs on its output, and :class:`~cosyvoice_runtime.token2wav.Token2Wav` turns tokens into
audio as soon as a chunk is ready. Parity tests and the CLI use it directly; the serving layer
splits the same steps across replicas and batches them.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cosyvoice_runtime.llm.generate import DecodeState, SampleFn, decode, default_sample_fn
from cosyvoice_runtime.llm.inputs import build_lm_input
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.sampling import SamplingParams
from cosyvoice_runtime.llm.silent_tokens import SilentTokenFilter
from cosyvoice_runtime.model import CosyVoiceModel
from cosyvoice_runtime.token2wav import FlowPrompt, Token2Wav

logger = logging.getLogger(__name__)


@dataclass
class VoicePrompt:
    """Everything a voice contributes to one utterance (spec §1.2, zero-shot family).

    Attributes:
        prompt_text_ids: (Lpt,) text ids placed before the target text (transcript of the prompt
            audio, the instruct text for instruct2, or empty for cross-lingual).
        llm_prompt_speech_ids: (L,) prompt speech tokens fed to the LLM (empty for
            cross-lingual / instruct2).
        flow: the flow conditioning (prompt tokens, prompt mel, speaker embedding).
    """

    prompt_text_ids: torch.Tensor
    llm_prompt_speech_ids: torch.Tensor
    flow: FlowPrompt


class Pipeline:
    """One model, one request at a time.

    Args:
        model: the loaded model.
        official_quirks: reproduce the official code's known bugs (CV3 min-length masks the sos
            id; the last streamed flow call uses full attention) instead of the fixed behaviour.
    """

    def __init__(self, model: CosyVoiceModel, official_quirks: bool = False) -> None:
        self.model = model
        self.spec = model.spec
        self.official_quirks = official_quirks
        self.token2wav = Token2Wav(model.spec, model.flow, model.hift, official_final_full_attention=official_quirks)

    def speech_tokens(self, text_ids: torch.Tensor, voice: VoicePrompt, sampling: SamplingParams | None = None,
                      seed: int | None = None, sample_fn: SampleFn = default_sample_fn) -> Iterator[int]:
        """Speech tokens for one text piece, after the silent-token filter."""
        lm = build_lm_input(self.model.llm, text_ids, voice.prompt_text_ids, voice.llm_prompt_speech_ids)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(seed)
        state = DecodeState(min_len=lm.min_len, max_len=lm.max_len, generator=generator,
                            params=sampling or SamplingParams())
        cache = KVCache.for_model(self.model.llm, 1, lm.embeds.shape[0] + max(lm.max_len, 1))
        keep = SilentTokenFilter(self.spec)
        for token in decode(self.model.llm, cache, lm.embeds, state, sample_fn,
                            official_quirks=self.official_quirks):
            if keep.keep(token):
                yield token

    def tts(self, text_ids: torch.Tensor, voice: VoicePrompt, stream: bool = False, speed: float = 1.0,
            sampling: SamplingParams | None = None, seed: int | None = None,
            sample_fn: SampleFn = default_sample_fn) -> Iterator[torch.Tensor]:
        """Audio chunks (each (samples,) float32 at ``spec.sample_rate``) for one text piece."""
        state = self.token2wav.new_stream(voice.flow, stream=stream, speed=speed)
        tokens: list[int] = []
        for token in self.speech_tokens(text_ids, voice, sampling, seed, sample_fn):
            tokens.append(token)
            if stream and (job := self.token2wav.next_job(state, tokens, llm_done=False)) is not None:
                yield self.token2wav.run(job)
        while (job := self.token2wav.next_job(state, tokens, llm_done=True)) is not None:
            yield self.token2wav.run(job)
