"""The replica's view of the incremental flow (deployments.runtime_adapter.RuntimeToken2Wav.flow_stats):
live cache bytes, budget fallbacks and prompt-prefix hits/misses, which the synthesizer's stats and
/metrics carry (tts_flow_*)."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch

from cosyvoice_runtime.model import load_model
from deployments import assembler
from deployments.assembler import flow_cache_budget
from deployments.execution_plan import Token2WavPlan, resolve_plan
from deployments.protocol import VoicePrompt
from deployments.runtime_adapter import RuntimeToken2Wav
from deployments.runtime_protocol import FLOW_STATS
from deployments.synthesizer_config import SynthesizerConfig
from tests.runtime.parity.common import parity_dir


def _voice(n: int, seed: int) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    return VoicePrompt(family="cosyvoice2", text_tokens=np.zeros(0, np.int32),
                       speech_tokens=torch.randint(0, 6561, (n,), generator=g, dtype=torch.int32).numpy(),
                       mel=torch.randn(2 * n, 80, generator=g).numpy(), embedding=torch.randn(192, generator=g).numpy())


def cpu_token2wav_plan(**knobs) -> Token2WavPlan:
    """The token2wav plan of a CPU replica with these ``token2wav`` knobs."""
    cfg = SynthesizerConfig(device="cpu", token2wav=knobs)
    return resolve_plan(cfg, "pytorch", "cpu", triton=False).token2wav


def test_the_replica_reports_the_flow_caches():
    base = load_model(parity_dir() / "cosyvoice2" / "model")
    model = dataclasses.replace(base, flow=copy.deepcopy(base.flow))
    rt = RuntimeToken2Wav(model, cpu_token2wav_plan(cv2_flow="incremental", cv2_prompt_cache_bytes=1 << 30))
    assert set(rt.flow_stats()) == set(FLOW_STATS)
    assert rt.flow_stats() == {**dict.fromkeys(FLOW_STATS, 0.0), "flow_prompt_cache_budget_bytes": float(1 << 30)}
    voice = _voice(30, 70)
    tokens = torch.randint(0, 6561, (80,), generator=torch.Generator().manual_seed(71)).tolist()
    states = []
    for seed in range(2):
        state = rt.new_stream(voice, stream=True, speed=1.0, seed=seed)
        rt.run_batch([rt.next_job(state, tokens, llm_done=False)])  # a first chunk each, streams left open
        states.append(state)
    stats = rt.flow_stats()
    assert stats["flow_prompt_prefix_misses_total"] == 1 and stats["flow_prompt_prefix_hits_total"] == 1
    assert stats["flow_cache_bytes"] > 0 and stats["flow_cache_fallbacks_total"] == 0
    states.clear()
    del state
    assert rt.flow_stats()["flow_cache_bytes"] == 0  # abandoned streams take their caches with them


def test_without_the_incremental_flow_every_figure_is_zero():
    base = load_model(parity_dir() / "cosyvoice2" / "model")
    rt = RuntimeToken2Wav(dataclasses.replace(base, flow=copy.deepcopy(base.flow)), cpu_token2wav_plan())
    state = rt.new_stream(_voice(30, 72), stream=True, speed=1.0, seed=0)
    rt.run_batch([rt.next_job(state, list(range(40)), llm_done=False)])
    assert rt.flow_stats() == dict.fromkeys(FLOW_STATS, 0.0)


def test_the_flow_cache_budget_stays_under_half_the_free_gpu_memory_and_the_replicas_budget(monkeypatch, caplog):
    gib = 1 << 30
    free = {"bytes": 40 * gib}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 141 * gib))
    assert flow_cache_budget(16 * gib, "cuda:0") == 16 * gib  # an H200 after start: the configured budget
    free["bytes"] = 20 * gib  # what an RTX 5090 may have left
    with caplog.at_level("INFO", logger=assembler.__name__):
        assert flow_cache_budget(16 * gib, "cuda:0") == 10 * gib
    assert "flow cache budget 10.0 GiB (20.0 GiB free on the GPU" in caplog.text
    assert flow_cache_budget(16 * gib, "cpu") == 16 * gib  # host memory: the configured budget
    # two replicas on one GPU, each with max_mem_gb 14: this one holds 9 GiB already
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 9 * gib)
    assert flow_cache_budget(16 * gib, "cuda:0", max_mem_gb=14) == 5 * gib
    assert flow_cache_budget(16 * gib, "cuda:0", max_mem_gb=8) == 0  # over its budget already: no cache
