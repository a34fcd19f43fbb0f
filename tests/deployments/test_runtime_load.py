"""load_synthesis_runtime on the tiny model: the replica knobs that reach the runtime
(early first chunk, CUDA graphs of the LLM decode and of the flow solve)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice_runtime.lm_messages import LMRequest
from deployments.assembler import load_synthesis_runtime
from deployments.protocol import VoicePrompt
from deployments.synthesizer_config import SynthesizerConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "cv2", "cosyvoice2"))


def _voice(rt, n_tokens: int = 30) -> VoicePrompt:
    g = np.random.default_rng(0)
    return VoicePrompt(family="cosyvoice2", text_tokens=np.arange(5, dtype=np.int32),
                       speech_tokens=g.integers(0, 100, n_tokens).astype(np.int32),
                       mel=g.standard_normal((2 * n_tokens, rt.token2wav.n_mels)).astype(np.float32),
                       embedding=g.standard_normal(rt.token2wav.embedding_dim).astype(np.float32))


def _first_job_tokens(rt, voice: VoicePrompt) -> int:
    state = rt.token2wav.new_stream(voice, stream=True, speed=1.0, seed=0)
    job = rt.token2wav.next_job(state, list(range(200)), llm_done=False)
    return int(job.tokens.shape[1])


def test_early_first_chunk_is_the_default_and_can_be_turned_off(model_dir):
    early = load_synthesis_runtime(SynthesizerConfig(device="cpu", warmup=False), model_dir)
    official = load_synthesis_runtime(
        SynthesizerConfig(device="cpu", warmup=False, token2wav={"early_first_chunk": False}), model_dir)
    voice = _voice(early)  # 30 prompt tokens: the next 25-token attention boundary is 20 tokens on
    # 3 look-ahead tokens follow the chunk's own tokens; official = one hop (25) + the 20-token pad.
    assert _first_job_tokens(early, voice) == 20 + 3
    assert _first_job_tokens(official, voice) == 25 + 20 + 3
    # 49 prompt tokens: the next boundary is 1 token on, shorter than first_chunk_min_tokens (10):
    # the chunk ends at the boundary after it (1 + 25), so its 1 s of audio covers making the next.
    assert _first_job_tokens(early, _voice(early, n_tokens=49)) == 1 + 25 + 3
    short = load_synthesis_runtime(
        SynthesizerConfig(device="cpu", warmup=False, token2wav={"first_chunk_min_tokens": 1}), model_dir)
    assert _first_job_tokens(short, _voice(short, n_tokens=49)) == 1 + 3
    for rt in (early, official):  # CPU: never graphed
        assert rt.details["flow_graphs"] == 0 and rt.details["vocoder_graphs"] == 0
    # /health says which size of LLM was loaded (the tiny model's, far below the 0.5B release)
    params = sum(p.numel() for p in early.engine.engine.model.parameters())
    assert early.details["llm_params_m"] == round(params / 1e6, 1) and 0 < params < 50e6


def _two_cv3_streams(rt) -> list[np.ndarray]:
    """Two CosyVoice3 utterances (120 and 90 tokens) streamed chunk by chunk, batched together."""
    voice = VoicePrompt(**{**_voice(rt).__dict__, "family": "cosyvoice3"})
    states = [rt.token2wav.new_stream(voice, stream=True, speed=1.0, seed=0) for _ in range(2)]
    tokens = [list(range(7, 127)), list(range(40, 130))]
    audio = [[], []]
    while not all(st.finished for st in states):
        jobs = [(k, rt.token2wav.next_job(st, tokens[k], llm_done=True)) for k, st in enumerate(states)]
        jobs = [(k, j) for k, j in jobs if j is not None]
        for (k, _), a in zip(jobs, rt.token2wav.run_batch([j for _, j in jobs])):
            audio[k].append(a)
    assert min(len(a) for a in audio) >= 3  # streamed in several chunks
    return [np.concatenate(a) for a in audio]


def test_cosyvoice3_replicas_vocode_incrementally_with_the_same_audio(tmp_path):
    """token2wav.cv3_vocoder reaches the runtime: the default (incremental) and the official full
    recompute stream the same utterance to the same samples (float noise), two streams batched."""
    from cosyvoice_runtime.tiny_model import write_tiny_model

    cv3 = str(write_tiny_model(tmp_path / "cv3", "cosyvoice3"))
    runs = {}
    for strategy in ("incremental", "recompute"):
        knobs = {} if strategy == "incremental" else {"cv3_vocoder": "recompute"}
        rt = load_synthesis_runtime(SynthesizerConfig(device="cpu", warmup=False, token2wav=knobs), cv3)
        assert rt.token2wav.t2w.cv3_vocoder == strategy
        runs[strategy] = _two_cv3_streams(rt)
    for inc, ref in zip(runs["incremental"], runs["recompute"]):
        assert inc.shape == ref.shape and inc.size > 0
        assert float(np.abs(inc - ref).max()) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_cosyvoice3_replica_vocodes_through_graphs_with_the_eager_audio(tmp_path):
    """A CUDA CosyVoice3 replica captures its vocoder body's graphs (hift.causal_graphs) and
    streams the samples of a replica without graphs."""
    from cosyvoice_runtime.tiny_model import write_tiny_model

    cv3 = str(write_tiny_model(tmp_path / "cv3", "cosyvoice3"))
    cfg = {"device": "cuda", "warmup": False, "flow_graph_max_s": 8.0}
    graphed = load_synthesis_runtime(SynthesizerConfig(**cfg), cv3)
    eager = load_synthesis_runtime(SynthesizerConfig(**cfg, cuda_graphs=False), cv3)
    assert graphed.details["vocoder_graphs"] > 0 and eager.details["vocoder_graphs"] == 0
    for a, b in zip(_two_cv3_streams(graphed), _two_cv3_streams(eager)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-3, rtol=1e-3)


def test_a_cpu_replica_compiles_no_graphed_stage(model_dir):
    """flow_compile (like mode torchscript's LLM step) compiles a graphed stage: none on the CPU
    (which stages compile where: tests/deployments/test_execution_plan.py)."""
    runtime = load_synthesis_runtime(SynthesizerConfig(device="cpu", warmup=False, flow_compile=True,
                                                       token2wav={"cv2_flow": "incremental"}), model_dir)
    assert runtime.details["flow"] == "incremental"
    assert "llm decode step" not in runtime.details["compiled"]
    assert "incremental flow pass" not in runtime.details["compiled"]


def test_fused_norms_are_reported_only_where_they_run(model_dir):
    """``fused_norms`` asks for the Triton kernels of the LLM and the incremental flow pass; a CPU
    replica runs PyTorch's ops, and /health's details say so."""
    runtime = load_synthesis_runtime(SynthesizerConfig(device="cpu", warmup=False, fused_norms=True), model_dir)
    assert runtime.details["fused_norms"] == []
    assert runtime.engine.engine.model.backbone.fused_norms is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_replica_with_fused_norms_streams_the_same_audio(model_dir):
    cfg = {"device": "cuda", "warmup": False, "flow_graph_max_s": 8.0,
           "token2wav": {"scheduler": "steps", "cv2_flow": "incremental"}}
    fused = load_synthesis_runtime(SynthesizerConfig(**cfg, fused_norms=True), model_dir)
    plain = load_synthesis_runtime(SynthesizerConfig(**cfg, fused_norms=False), model_dir)
    assert fused.details["fused_norms"] == ["llm", "incremental flow pass"] and plain.details["fused_norms"] == []
    voice = _voice(plain)
    outs = []
    for rt in (fused, plain):
        state = rt.token2wav.new_stream(voice, stream=True, speed=1.0, seed=0)
        job = rt.token2wav.next_job(state, list(range(60)), llm_done=False)
        outs.append(rt.token2wav.run_batch([job])[0])
    assert outs[0].shape == outs[1].shape
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-3, rtol=1e-3)


def test_llm_run_ahead_is_reported_only_where_it_runs(model_dir):
    """``llm_run_ahead`` needs the static (graphed) decode step: a CPU replica steps as without it."""
    runtime = load_synthesis_runtime(SynthesizerConfig(device="cpu", warmup=False, llm_run_ahead=True), model_dir)
    assert runtime.details["llm_run_ahead"] is False and runtime.engine.engine.run_ahead is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_replica_running_ahead_makes_the_same_tokens(model_dir):
    """The replica's engine with ``llm_run_ahead`` (graphs fed on the device) against without it."""
    cfg = {"device": "cuda", "warmup": False, "flow_graph_max_s": 8.0}
    ahead = load_synthesis_runtime(SynthesizerConfig(**cfg, llm_run_ahead=True), model_dir)
    plain = load_synthesis_runtime(SynthesizerConfig(**cfg, llm_run_ahead=False), model_dir)
    assert ahead.details["llm_run_ahead"] is True and plain.details["llm_run_ahead"] is False
    got = []
    for rt in (ahead, plain):
        voice = _voice(rt)
        tokens: dict[str, list[int]] = {}
        for i in range(3):
            rid = f"r{i}"
            rt.engine.add(rid, LMRequest(text_ids=np.arange(3 + 4 * i), prompt_text_ids=voice.text_tokens,
                                         prompt_speech_ids=voice.speech_tokens, seed=i))
            tokens[rid] = []
        while rt.engine.has_unfinished():
            for ev in rt.engine.step():
                tokens[ev.request_id] += ev.tokens
        got.append(tokens)
    assert got[0] == got[1] and all(got[0].values())


def test_unknown_knob_is_rejected():
    with pytest.raises(ValueError):
        SynthesizerConfig(token2wav={"early_first_chunks": True})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_replica_captures_flow_graphs_and_matches_eager(model_dir):
    cfg = {"device": "cuda", "warmup": False, "flow_graph_max_s": 8.0}
    graphed = load_synthesis_runtime(SynthesizerConfig(**cfg), model_dir)
    eager = load_synthesis_runtime(SynthesizerConfig(**cfg, cuda_graphs=False), model_dir)
    assert graphed.details["flow_graphs"] > 0 and eager.details["flow_graphs"] == 0
    # the tiny CV2 model streams 58-, 108- and 208-frame vocoder calls after the first
    assert graphed.details["vocoder_graphs"] > 0 and eager.details["vocoder_graphs"] == 0
    voice = _voice(graphed)
    tokens = list(range(60))
    outs = []
    for rt in (graphed, eager):
        state = rt.token2wav.new_stream(voice, stream=True, speed=1.0, seed=0)
        job = rt.token2wav.next_job(state, tokens, llm_done=False)
        outs.append(rt.token2wav.run_batch([job])[0])
    assert outs[0].shape == outs[1].shape
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_replica_decodes_on_a_higher_priority_stream_than_token2wav(model_dir):
    rt = load_synthesis_runtime(SynthesizerConfig(device="cuda", warmup=False, flow_graph_max_s=8.0), model_dir)
    assert rt.engine._stream.priority < rt.token2wav._stream.priority  # lower number = higher priority
