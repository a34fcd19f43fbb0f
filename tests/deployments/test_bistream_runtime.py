"""The production bistream path below the synthesizer: RuntimeTokenEngine's bistream requests
(over LLMEngine) driven by the EngineLoop, on the tiny random-weight LLM. Text arrives through an
async source whose end is held back until the first tokens came out; the tokens equal
``bistream_decode``'s (default RAS sampler, same seed, one id per chunk; CosyVoice3's silent-token
filter applied to the reference), beside a plain request in the same batch."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID
from cosyvoice_runtime.llm.bistream import BistreamState, bistream_decode
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.model import build_llm
from cosyvoice_runtime.llm.sampling import SamplingParams
from cosyvoice_runtime.llm.silent_tokens import SilentTokenFilter
from cosyvoice_runtime.lm_messages import BistreamLMRequest, LMRequest
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir
from deployments.compute import ComputeExecutor
from deployments.engine_loop import EngineLoop
from deployments.runtime_adapter import RuntimeTokenEngine
from deployments.text_marks import TextMarker

TEXT = [300 + 11 * i for i in range(14)]
SEED = 77


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_bistream_through_the_engine_loop_matches_the_reference(family, tmp_path):
    spec = write_config_dir(tmp_path, family, TINY_DIMS[family])
    torch.manual_seed(0)
    llm = build_llm(spec.llm).eval().requires_grad_(False)
    prompt_text = np.array([5, 6, 7] if family == "cosyvoice2" else [5, ENDOFPROMPT_TOKEN_ID, 6, 7], np.int32)
    prompt_speech = np.arange(40, 60, dtype=np.int32)

    state = BistreamState(params=SamplingParams.from_spec(spec.llm, seed=SEED),
                          generator=torch.Generator().manual_seed(SEED))
    want = list(bistream_decode(llm, KVCache.for_model(llm, 1, 2048), ([t] for t in TEXT), prompt_text,
                                prompt_speech, state))
    silent = SilentTokenFilter(spec)
    want = [t for t in want if silent.keep(t)]

    engine = RuntimeTokenEngine(SimpleNamespace(spec=spec, llm=llm), max_running=2, max_model_len=2048)
    loop = EngineLoop(engine, ComputeExecutor())

    reads: list[int] = []

    async def main():
        spoke = asyncio.Event()

        async def text():
            for t in TEXT[:-1]:
                yield [t], False
            await spoke.wait()  # the end of the text only once speech came out
            yield [TEXT[-1]], True

        async def bistream():
            got = []
            async for ev in loop.generate("b", BistreamLMRequest(prompt_text, prompt_speech, SEED), text=text()):
                got += ev.tokens
                reads.extend(ev.text_read)  # kept beside the tokens the silent-token filter keeps
                if got and not spoke.is_set():
                    spoke.set()
                    before_end = len(got)
            return got, before_end

        async def plain():
            req = LMRequest(text_ids=np.arange(1, 9, dtype=np.int32), prompt_text_ids=prompt_text,
                            prompt_speech_ids=prompt_speech, seed=1)
            events = [ev async for ev in loop.generate("p", req)]
            assert all(ev.text_read is None for ev in events)  # a piece reads its text before speaking
            return [t for ev in events for t in ev.tokens]

        try:
            return await asyncio.gather(bistream(), plain())
        finally:
            await loop.close()

    (got, before_end), plain_tokens = asyncio.run(main())
    assert got == want and 0 < before_end < len(got)
    assert len(reads) == len(got) and reads == sorted(reads) and reads[-1] == len(TEXT)
    marker = TextMarker(None)  # the synthesizer's marks from them: every text token once, in order
    marker.add(len(got), reads)
    marks = [marker.chunk(end, end == len(got), True) for end in [*range(25, len(got), 25), len(got)]]
    starts = [f for m in marks if m is not None for f in m.starts]
    assert len(starts) == len(TEXT) and all(0.0 <= f <= 1.0 for f in starts)
    assert plain_tokens and loop.finished == 2 and engine.num_running() == 0
