"""RuntimeTokenEngine (the adapter over cosyvoice_runtime.llm.engine.LLMEngine) driven by the
EngineLoop, on the tiny official-layout parity model: continuous batching, length limits, abort."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

PARITY = Path("/work/shared/parity")


@functools.lru_cache(maxsize=2)
def _model(family: str):
    from cosyvoice_runtime.llm.model import build_llm
    from cosyvoice_runtime.weights import load_checkpoint
    from cosyvoice_runtime.yaml_config import read_model_spec

    model_dir = PARITY / family / "model"
    if not model_dir.exists():
        pytest.skip("parity fixtures not available")
    spec = read_model_spec(model_dir)
    llm = build_llm(spec.llm)
    load_checkpoint(llm, model_dir / spec.files["llm"])
    return SimpleNamespace(spec=spec, llm=llm.eval().requires_grad_(False))


def test_engine_loop_over_real_llm_engine():
    # CosyVoice2 only: the CV3 parity fixture's text vocabulary is too small for <|endofprompt|>.
    from cosyvoice_runtime.lm_messages import LMRequest
    from deployments.compute import ComputeExecutor
    from deployments.engine_loop import EngineLoop
    from deployments.runtime_adapter import RuntimeTokenEngine

    model = _model("cosyvoice2")
    engine = RuntimeTokenEngine(model, max_running=2, max_model_len=256)
    loop = EngineLoop(engine, ComputeExecutor())
    text = np.array([100, 200, 300, 400], np.int32)
    abort, aborted = engine.abort, threading.Event()

    def abort_and_tell(request_id):  # the step thread applies the abandoned request's abort
        abort(request_id)
        aborted.set()

    engine.abort = abort_and_tell

    def request(seed):
        return LMRequest(text_ids=text, prompt_text_ids=np.zeros(0, np.int32),
                         prompt_speech_ids=np.arange(5, dtype=np.int32), seed=seed)

    async def collect(rid, seed):
        tokens, last = [], None
        async for ev in loop.generate(rid, request(seed)):
            tokens.extend(ev.tokens)
            last = ev
        return tokens, last

    async def abandoned():
        async for _ in loop.generate("gone", request(9)):
            break  # consumer leaves after the first event

    async def main():
        results = await asyncio.gather(collect("a", 1), collect("b", 2), collect("c", 3), abandoned())
        assert await asyncio.to_thread(aborted.wait, 60)  # 60 s: a failure guard, not a synchronisation
        return results

    (ta, ea), (tb, eb), (tc, ec), _ = asyncio.run(main())
    max_len = int(len(text) * model.spec.llm.max_token_text_ratio)
    for tokens, ev in ((ta, ea), (tb, eb), (tc, ec)):
        assert ev.finished and ev.finish_reason in ("stop", "length")
        assert 0 < len(tokens) <= max_len
        assert all(0 <= t < model.spec.llm.speech_token_size for t in tokens)
    stats = loop.stats()
    assert stats.finished == 3 and stats.aborted == 1 and stats.running == 0 and stats.waiting == 0
    assert max(loop.step_batch_sizes) == 2  # two slots, shared by the requests over time
    # Same seed, same tokens: sampling is per request, not disturbed by batching.
    engine2 = RuntimeTokenEngine(model, max_running=1, max_model_len=256)
    loop2 = EngineLoop(engine2, ComputeExecutor())

    async def alone():
        tokens = []
        async for ev in loop2.generate("a", request(1)):
            tokens.extend(ev.tokens)
        return tokens

    assert asyncio.run(alone()) == ta


def test_length_bound_is_capped_to_the_slot_and_tiny_slots_refuse():
    from cosyvoice_runtime.errors import InvalidInputError
    from cosyvoice_runtime.lm_messages import LMRequest
    from deployments.runtime_adapter import RuntimeTokenEngine

    model = _model("cosyvoice2")
    req = LMRequest(text_ids=np.array([100, 200, 300, 400], np.int32), prompt_text_ids=np.zeros(0, np.int32),
                    prompt_speech_ids=np.arange(5, dtype=np.int32), seed=0)
    prefill = 1 + 4 + 1 + 5  # sos, text, task id, prompt speech
    engine = RuntimeTokenEngine(model, max_running=1, max_model_len=prefill + 19)  # 20 < 20x bound of 80
    engine.add("a", req)
    tokens = []
    while engine.has_unfinished():
        for ev in engine.step():
            tokens.extend(ev.tokens)
    assert 0 < len(tokens) <= 20
    with pytest.raises(InvalidInputError, match="too long for a decode slot"):
        RuntimeTokenEngine(model, max_running=1, max_model_len=prefill + 2).add("b", req)  # min_len is 8


def test_the_engine_takes_its_norms_from_the_llm_plan():
    """The LLM's fused_norms reach the model through the engine's constructor (no attribute set
    from the deployments); without a plan the model keeps what it has."""
    from cosyvoice_runtime.llm.model import build_llm
    from deployments.execution_plan import LLMPlan
    from deployments.runtime_adapter import RuntimeTokenEngine

    spec = _model("cosyvoice2").spec
    model = SimpleNamespace(spec=spec, llm=build_llm(spec.llm).eval())
    plan = LLMPlan(cuda_graphs=False, prefill_graphs=False, compile_backend=None, fused_norms=True, run_ahead=False)
    RuntimeTokenEngine(model, max_running=1, max_model_len=64, plan=plan)
    assert model.llm.backbone.fused_norms is True
    RuntimeTokenEngine(model, max_running=1, max_model_len=64)
    assert model.llm.backbone.fused_norms is True
    RuntimeTokenEngine(model, max_running=1, max_model_len=64, plan=dataclasses.replace(plan, fused_norms=False))
    assert model.llm.backbone.fused_norms is False
