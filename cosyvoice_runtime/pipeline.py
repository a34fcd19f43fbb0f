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

import torch
from numpy.typing import ArrayLike

from cosyvoice_runtime.llm.generate import DecodeState, SampleFn, decode, default_sample_fn
from cosyvoice_runtime.llm.inputs import build_lm_input
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.sampling import SamplingParams
from cosyvoice_runtime.llm.silent_tokens import SilentTokenFilter
from cosyvoice_runtime.model import CosyVoiceModel
from cosyvoice_runtime.token2wav import Token2Wav
from cosyvoice_runtime.voice_prompt import VoicePrompt

logger = logging.getLogger(__name__)


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

    def speech_tokens(self, text_ids: ArrayLike, prompt: VoicePrompt, llm_prompt_text_ids: ArrayLike | None = None,
                      llm_use_prompt_speech: bool = True, sampling: SamplingParams | None = None,
                      seed: int | None = None, sample_fn: SampleFn = default_sample_fn) -> Iterator[int]:
        """Speech tokens for one text piece, after the silent-token filter.

        Args:
            text_ids: (Lt,) text ids of the piece.
            prompt: the voice.
            llm_prompt_text_ids / llm_use_prompt_speech: what the LLM reads of the prompt in this
                mode (spec §1.2, as ``PreparedRequest`` carries it): the text ids before the piece
                (None: the prompt's transcript, zero-shot) and whether the prompt speech tokens
                follow them (cross-lingual and instruct: no).
        """
        text_prompt = prompt.text_tokens if llm_prompt_text_ids is None else llm_prompt_text_ids
        speech_prompt = prompt.speech_tokens if llm_use_prompt_speech else None
        lm = build_lm_input(self.model.llm, text_ids, text_prompt, speech_prompt)
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

    def tts(self, text_ids: ArrayLike, prompt: VoicePrompt, llm_prompt_text_ids: ArrayLike | None = None,
            llm_use_prompt_speech: bool = True, stream: bool = False, speed: float = 1.0,
            sampling: SamplingParams | None = None, seed: int | None = None,
            sample_fn: SampleFn = default_sample_fn) -> Iterator[torch.Tensor]:
        """Audio chunks (each (samples,) float32 at ``spec.sample_rate``) for one text piece; the
        LLM arguments are :meth:`speech_tokens`'s, the flow always gets the whole prompt."""
        state = self.token2wav.new_stream(prompt, stream=stream, speed=speed)
        tokens: list[int] = []
        for token in self.speech_tokens(text_ids, prompt, llm_prompt_text_ids, llm_use_prompt_speech, sampling, seed,
                                        sample_fn):
            tokens.append(token)
            if stream and (job := self.token2wav.next_job(state, tokens, llm_done=False)) is not None:
                yield self.token2wav.run(job)
        while (job := self.token2wav.next_job(state, tokens, llm_done=True)) is not None:
            yield self.token2wav.run(job)
