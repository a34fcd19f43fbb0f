"""Warm-up of a synthesizer replica: one tiny request through the LLM, flow and HiFT before serving."""
from __future__ import annotations

import logging
import time

import numpy as np

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID
from cosyvoice_runtime.lm_messages import LMRequest
from deployments import constants
from deployments.protocol import VoicePrompt
from deployments.runtime_protocol import SynthesisRuntime

logger = logging.getLogger(__name__)


def warm_up(runtime: SynthesisRuntime) -> None:
    """Drive one tiny request through the engine and token2wav synchronously (before serving)."""
    t2w = runtime.token2wav
    n_prompt = 2 * constants.WARMUP_TEXT_TOKENS
    prompt = VoicePrompt(family="warmup", text_tokens=np.zeros(0, np.int32),
                         speech_tokens=np.zeros(n_prompt, np.int32),
                         mel=np.zeros((2 * n_prompt, t2w.n_mels), np.float32),
                         embedding=np.zeros(t2w.embedding_dim, np.float32))
    engine = runtime.engine
    # <|endofprompt|> first: CosyVoice3 refuses text without it; for CosyVoice2 it is a plain id.
    text_ids = np.array([ENDOFPROMPT_TOKEN_ID, *range(1, constants.WARMUP_TEXT_TOKENS)], dtype=np.int32)
    lm = LMRequest(text_ids=text_ids,
                   prompt_text_ids=np.zeros(0, np.int32), prompt_speech_ids=prompt.speech_tokens, seed=0)
    started = time.perf_counter()
    engine.add("__warmup__", lm)
    tokens, done = [], False
    while not done and engine.has_unfinished():
        for event in engine.step():
            tokens.extend(event.tokens)
            done = done or event.finished
    state = t2w.new_stream(prompt, stream=False, speed=1.0, seed=0)
    if tokens:
        while (job := t2w.next_job(state, tokens, llm_done=True)) is not None:
            t2w.run_batch([job])
    logger.info("warmup: %d tokens in %.2f s", len(tokens), time.perf_counter() - started)
