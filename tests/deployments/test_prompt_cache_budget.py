"""token2wav.cv2_prompt_cache_bytes "auto": the plan leaves it to CUDA replicas' assembler, which
sizes the voice prompt prefix cache from the GPU memory free after start
(deployments.assembler.prompt_cache_budget, the free reading injected here); an explicit size wins;
the CPU keeps 1 GiB. The resolved size reaches PromptPrefixes, /health's details and the stats."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from cosyvoice_runtime.model import load_model
from deployments.assembler import (
    PROMPT_CACHE_CAP_BYTES,
    PROMPT_CACHE_FLOOR_BYTES,
    PROMPT_CACHE_FREE_SHARE,
    load_synthesis_runtime,
    prompt_cache_budget,
)
from deployments.execution_plan import resolve_plan
from deployments.runtime_adapter import RuntimeToken2Wav
from deployments.synthesizer_config import SynthesizerConfig
from tests.runtime.parity.common import parity_dir

GIB = 1 << 30


def _plan(device: str, **knobs):
    return resolve_plan(SynthesizerConfig(device=device, token2wav=knobs), "pytorch", device, triton=False).token2wav


def test_auto_is_left_to_the_assembler_on_cuda_and_is_one_gib_on_the_cpu():
    assert SynthesizerConfig().token2wav.cv2_prompt_cache_bytes == "auto"
    assert _plan("cuda:0").prompt_cache_bytes == "auto"
    assert _plan("cpu").prompt_cache_bytes == GIB
    # an explicit size wins on both
    assert _plan("cuda:0", cv2_prompt_cache_bytes=3 * GIB).prompt_cache_bytes == 3 * GIB
    assert _plan("cpu", cv2_prompt_cache_bytes=0).prompt_cache_bytes == 0
    with pytest.raises(ValueError):
        SynthesizerConfig(token2wav={"cv2_prompt_cache_bytes": "big"})


def test_auto_takes_a_share_of_the_free_memory_past_the_flow_cache_within_floor_and_cap():
    assert 0 < PROMPT_CACHE_FREE_SHARE < 1 and PROMPT_CACHE_FLOOR_BYTES < PROMPT_CACHE_CAP_BYTES
    # an H100 after start: 64 GiB free, 16 GiB of it the flow caches' budget
    assert prompt_cache_budget("auto", 16 * GIB, lambda: 64 * GIB) == int(48 * GIB * PROMPT_CACHE_FREE_SHARE)
    # little left: the floor (the fixed size "auto" replaced)
    assert prompt_cache_budget("auto", 10 * GIB, lambda: 12 * GIB) == PROMPT_CACHE_FLOOR_BYTES
    assert prompt_cache_budget("auto", 16 * GIB, lambda: 8 * GIB) == PROMPT_CACHE_FLOOR_BYTES
    # a very large GPU: the cap
    assert prompt_cache_budget("auto", 16 * GIB, lambda: 400 * GIB) == PROMPT_CACHE_CAP_BYTES


def test_an_explicit_size_never_reads_the_free_memory():
    def unread() -> int:
        raise AssertionError("an explicit size needs no free-memory reading")

    assert prompt_cache_budget(5 * GIB, 16 * GIB, unread) == 5 * GIB
    assert prompt_cache_budget(0, 16 * GIB, unread) == 0


def test_the_resolved_size_reaches_the_prompt_prefixes_and_the_stats():
    base = load_model(parity_dir() / "cosyvoice2" / "model")
    model = dataclasses.replace(base, flow=copy.deepcopy(base.flow))
    cuda_plan = _plan("cuda:0")  # the incremental flow, the prompt cache "auto"
    assert cuda_plan.cv2.streamed == "incremental"
    with pytest.raises(TypeError, match="not resolved"):
        RuntimeToken2Wav(model, cuda_plan)
    size = prompt_cache_budget(cuda_plan.prompt_cache_bytes, 16 * GIB, lambda: 60 * GIB)
    rt = RuntimeToken2Wav(model, cuda_plan, prompt_cache_bytes=size)
    assert rt.t2w.prompt_prefixes.max_bytes == size == rt.prompt_cache_bytes
    assert rt.flow_stats()["flow_prompt_cache_budget_bytes"] == size
    # the recompute keeps no prefixes: the budget shows 0
    plain = RuntimeToken2Wav(model, _plan("cpu"))
    assert plain.t2w.prompt_prefixes is None and plain.flow_stats()["flow_prompt_cache_budget_bytes"] == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "cv2", "cosyvoice2"))


def test_a_cpu_replica_shows_its_prompt_cache_in_the_health_details(model_dir):
    """What /health?detail=1 carries (Synthesizer.health spreads the runtime's details)."""
    incremental = load_synthesis_runtime(
        SynthesizerConfig(device="cpu", warmup=False, token2wav={"cv2_flow": "incremental"}), model_dir)
    assert incremental.details["prompt_cache_bytes"] == GIB
    assert incremental.token2wav.t2w.prompt_prefixes.max_bytes == GIB
    explicit = load_synthesis_runtime(SynthesizerConfig(
        device="cpu", warmup=False, token2wav={"cv2_flow": "incremental", "cv2_prompt_cache_bytes": 3 * GIB}), model_dir)
    assert explicit.details["prompt_cache_bytes"] == 3 * GIB
    recompute = load_synthesis_runtime(SynthesizerConfig(device="cpu", warmup=False), model_dir)
    assert recompute.details["prompt_cache_bytes"] == 0  # the CPU's default flow recomputes: nothing kept
