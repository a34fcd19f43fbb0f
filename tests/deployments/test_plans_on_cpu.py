"""The CUDA replica's default plan and the CPU replica's, through the real synthesizer on the CPU
(issue 42, ask 7; the plans: tests/deployments/plans.py).

The two plans differ in how token2wav is scheduled (passes over rows deadline-first against
whole batched solves), how a streamed flow call is solved (only its new frames over the stream's
cache against the whole prefix again), and threads (two stages against one); none of it changes
the math, so both stream each request's audio to the same samples within float noise: the
incremental flow's matmul rounding, which the random-weight tiny vocoder amplifies to ~1.4e-4
(tests/runtime/test_flow_incremental.py). The Ray version, over HTTP: tests/integration/test_plans_ray.py.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID
from deployments.model_source import ModelSource
from deployments.protocol import PreparedRequest, TextPiece, VoicePrompt
from deployments.synthesizer import Synthesizer
from tests.deployments import plans


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def model_dir(request, tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    return request.param, str(write_tiny_model(tmp_path_factory.mktemp("tiny") / request.param, request.param))


def _req(synth: Synthesizer, family: str, rid: str, n_text: int, seed: int) -> PreparedRequest:
    g = np.random.default_rng(seed)
    prompt = VoicePrompt(family=family, text_tokens=np.arange(5, dtype=np.int32),
                         speech_tokens=g.integers(0, 100, 30).astype(np.int32),
                         mel=g.standard_normal((60, synth.t2w.n_mels)).astype(np.float32),
                         embedding=g.standard_normal(synth.t2w.embedding_dim).astype(np.float32))
    # CosyVoice3's LLM reads its prompt text up to <|endofprompt|> (cosyvoice_runtime.llm.inputs)
    llm_prompt = np.append(np.arange(4), ENDOFPROMPT_TOKEN_ID if family == "cosyvoice3" else 4).astype(np.int32)
    return PreparedRequest(request_id=rid, pieces=[TextPiece("x", g.integers(100, 1000, n_text).astype(np.int32))],
                           prompt=prompt, llm_prompt_text_ids=llm_prompt,
                           llm_use_prompt_speech=True, stream=True, seed=seed)


def _speak(synth: Synthesizer, family: str) -> list[list[np.ndarray]]:
    """Three concurrent streams of different lengths: each one's chunks."""
    reqs = [_req(synth, family, f"r{i}", n, seed=i) for i, n in enumerate((6, 11, 3))]

    async def one(req):
        return [c.samples async for c in synth.synthesize(req)]

    async def main():
        return await asyncio.gather(*(one(r) for r in reqs))

    return asyncio.run(main())


def _replica(plan: str, model_dir: str) -> Synthesizer:
    synth = Synthesizer(plans.synthesizer_config(plan, warmup=False, max_model_len=512), ModelSource(model_dir))
    synth.outside_serve()  # no @serve.batch outside a replica (the stepped scheduler batches by itself)
    return synth


def test_the_cuda_default_plan_streams_the_cpu_plans_audio(model_dir):
    family, path = model_dir
    out, shown = {}, {}
    for plan in ("cpu", "cuda-default"):
        synth = _replica(plan, path)
        out[plan] = _speak(synth, family)
        shown[plan] = synth.health().detail["plan"]
        stats = synth.stats()
        assert stats["failed_requests_total"] == 0
        if plan == "cuda-default":  # the stepped driver ran the passes, shared between streams
            assert stats["token2wav_scheduler"] == "steps" and stats["flow_passes_total"] > 0
            assert stats["flow_rows_in_passes_total"] > stats["flow_passes_total"]
    flow = "cv2" if family == "cosyvoice2" else "cv3"
    assert shown["cpu"]["token2wav"]["scheduler"] == "batch" and shown["cpu"]["token2wav"][flow]["streamed"] == "recompute"
    expected = plans.without_gpu(plans.cuda_default_plan()).as_dict()
    assert shown["cuda-default"] == {**expected, "mode_source": shown["cuda-default"]["mode_source"]}
    for ref, got in zip(out["cpu"], out["cuda-default"]):
        assert len(ref) == len(got) > 1  # streamed in the same chunks
        for a, b in zip(ref, got):
            assert a.shape == b.shape and a.size > 0
            assert float(np.abs(a - b).max()) < plans.AUDIO_TOL
