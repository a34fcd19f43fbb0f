"""Failover mid-stream in one process (serve_app/failover.py, deployments/resume.py): a stream whose
replica "dies" after some chunks is continued by another replica from what the client has, and the
client's audio is the unbroken run's: same length, samples equal within float noise; without a
continuation left, :class:`StreamLostError`.

Two in-process synthesizer replicas over the real tiny random-weight models (both families) stand
behind a fake handle that raises Ray's ``ActorDiedError`` where a dead replica's stream would; the
same over real local Ray, killing the replica: tests/integration/test_failover_ray.py.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from ray.exceptions import ActorDiedError

from deployments.frontend import FrontendConfig, TextFrontend
from deployments.model_source import ModelSource
from deployments.protocol import AudioChunk, PreparedRequest, SynthesisMode, SynthesisRequest
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from serve_app import failover
from serve_app.failover import FailoverStream, StreamLostError, with_seed
from serve_app.ingress import IngressConfig, TTSIngress
from tests.deployments import fakes
from tests.integration import held_runtime

# Two sentence pieces (the splitter's pieces are independent LLM sequences): a continuation may
# start in either, or at the border between them.
TEXT = ("The weather is lovely today, and the park is full of people walking their dogs in the sun. "
        "Shall we take a long walk along the river after lunch and come back before the rain starts?")
# Float noise: a continuation prefills the ids an unbroken run decoded one by one, and its
# token2wav batches differ; a different id or a misplaced seam would differ by far more. (On this
# CPU the audio came out bit-identical; the bound leaves room for other kernels' rounding.)
ATOL = 1e-4
GRAPHS_STOP_S = 120  # a guard: stop() ends the background capture after the graph in progress


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def setup(family, tmp_path_factory):
    return _setup(family, tmp_path_factory, "cpu")


def _setup(family: str, tmp_path_factory, device: str):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    model_dir = str(write_tiny_model(tmp_path_factory.mktemp("tiny") / family, family))
    frontend = TextFrontend(FrontendConfig(voices_dir=str(tmp_path_factory.mktemp("voices"))), ModelSource(model_dir))
    replicas = [_synth(model_dir, device), _synth(model_dir, device)]
    # A prompt upload (the frontend adds CosyVoice3's prefix to its transcript).
    audio = (0.1 * np.random.default_rng(3).standard_normal(2 * 16000)).astype(np.float32)
    prepared = asyncio.run(frontend.prepare(SynthesisRequest(
        request_id="r", text=TEXT, mode=SynthesisMode.ZERO_SHOT, prompt_audio=audio, prompt_sample_rate=16000,
        prompt_text="A voice for the test.", stream=True)))
    assert len(prepared.pieces) == 2, [p.text for p in prepared.pieces]
    return replicas, with_seed(prepared)


def _synth(model_dir: str, device: str = "cpu") -> Synthesizer:
    # on CUDA the default plan: graphed LLM decode run ahead, stepped incremental flow, graphed vocoder
    synth = Synthesizer(SynthesizerConfig(device=device, warmup=False, max_model_len=1024, flow_graph_max_s=8.0),
                        ModelSource(model_dir))

    synth.outside_serve()  # no @serve.batch outside a replica
    return synth


class _Handle:
    """A Synthesizer handle over in-process replicas: call ``n`` goes to replica ``n % 2`` and, if
    ``deaths`` names it, raises ``ActorDiedError`` after that many chunks (its replica died)."""

    def __init__(self, replicas, deaths: dict[int, int]) -> None:
        self.replicas, self.deaths, self.calls = replicas, deaths, []

    def options(self, stream: bool):
        assert stream
        return self

    @property
    def synthesize(self):
        return self

    def remote(self, prepared):
        n = len(self.calls)
        self.calls.append(prepared)
        return _Call(self.replicas[n % 2].synthesize(prepared), self.deaths.get(n))


class _Call:
    def __init__(self, gen, die_after: int | None) -> None:
        self.gen, self.left = gen, die_after
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.left == 0:
            await self.gen.aclose()  # the replica is gone with its sequence
            raise ActorDiedError()
        if self.left is not None:
            self.left -= 1
        return await self.gen.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


async def _collect(stream) -> tuple[np.ndarray, list]:
    chunks = [c async for c in stream]
    return np.concatenate([c.samples for c in chunks]), chunks


def test_a_continuation_gives_the_unbroken_runs_audio(setup):
    _check_continuations(*setup, atol=ATOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_continuation_on_the_cuda_plan_gives_the_unbroken_runs_audio(family, tmp_path_factory):
    """The seam on the CUDA default plan: the continuation's ids are prefilled where the unbroken
    run decoded them through graphs, and its flow passes batch other rows. The bound is the graphed
    stages' own (tests/deployments/test_runtime_load.py: graphs against eager)."""
    replicas, prepared = _setup(family, tmp_path_factory, "cuda")
    try:
        _check_continuations(replicas, prepared, atol=1e-3)
    finally:
        # the replicas' background graph captures end before the process does: one still running
        # at interpreter exit is a likely cause of a GPU run's segfault after its summary (H200 2026-12-07)
        for synth in replicas:
            synth.shutdown()
            assert synth.runtime.graph_schedule.done.wait(GRAPHS_STOP_S)


def _check_continuations(replicas, prepared, atol: float) -> None:
    unbroken, chunks = asyncio.run(_collect(replicas[0].synthesize(prepared)))
    pieces = [c.piece for c in chunks]
    assert len(chunks) >= 4 and pieces[0] == 0 and pieces[-1] == 1, pieces
    # Deaths after 1 chunk (mid first piece), at the border of the pieces, and in the second piece;
    # the last case dies twice (its continuation dies too).
    border = pieces.index(1)
    cases = [{0: 1}, {0: border}, {0: border + 1}, {0: 1, 1: 1}]
    for deaths in cases:
        handle = _Handle(replicas, deaths)
        audio, got = asyncio.run(_collect(FailoverStream(handle, prepared, retries=2)))
        assert len(handle.calls) == len(deaths) + 1, deaths
        assert len(audio) == len(unbroken), (deaths, len(audio), len(unbroken))
        np.testing.assert_allclose(audio, unbroken, atol=atol, rtol=0, err_msg=str(deaths))
        assert [c.index for c in got] == list(range(len(got)))  # the continuation numbers on
        assert got[-1].is_last
        resume = handle.calls[1].resume
        assert resume.chunks == deaths[0] and resume.samples > 0 and resume.tokens


def test_a_whole_request_whose_replica_dies_gets_the_unbroken_runs_audio(setup):
    """``"stream": false`` and the handle API's ``synthesize`` join the same stream
    (``TTSIngress.synthesize_whole``; one chunk a piece): a death after the first piece is continued
    from the second, not restarted, and the joined audio is the unbroken run's."""
    replicas, prepared = setup
    prepared = replace(prepared, stream=False)
    unbroken, chunks = asyncio.run(_collect(replicas[0].synthesize(prepared)))
    assert [c.piece for c in chunks] == [0, 1]
    handle = _Handle(replicas, {0: 1})
    result = asyncio.run(TTSIngress(IngressConfig(), None, handle).synthesize_whole(prepared))
    assert len(handle.calls) == 2 and handle.calls[1].resume.chunks == 1
    assert result.num_chunks == 2 and len(result.samples) == len(unbroken)
    np.testing.assert_allclose(result.samples, unbroken, atol=ATOL, rtol=0)


def test_no_continuation_left_is_an_error(setup):
    replicas, prepared = setup
    handle = _Handle(replicas, {0: 1, 1: 1})

    async def main():
        stream = FailoverStream(handle, prepared, retries=1)
        got = []
        with pytest.raises(StreamLostError, match="could not be continued"):
            async for chunk in stream:
                got.append(chunk)
        return got
    got = asyncio.run(main())
    assert len(got) == 2 and len(handle.calls) == 2  # a chunk from each replica, then none left
    assert handle.calls[1].resume is not None


def test_retries_zero_ends_at_the_first_death(setup):
    replicas, prepared = setup
    handle = _Handle(replicas, {0: 0})
    with pytest.raises(StreamLostError):
        asyncio.run(_collect(FailoverStream(handle, prepared, retries=0)))
    assert len(handle.calls) == 1


# ---------------------------------------------------------------- the rules alone (no synthesis)
def _bare(seed: int | None = None) -> PreparedRequest:
    return PreparedRequest(request_id="b", pieces=[], prompt=None, llm_prompt_text_ids=np.zeros(0, np.int32),
                           llm_use_prompt_speech=False, seed=seed)


class _Calls:
    """A handle whose calls answer from ``answers`` in turn (an exception is raised)."""

    def __init__(self, *answers) -> None:
        self.answers, self.calls = list(answers), []

    def options(self, stream: bool):
        return self

    @property
    def synthesize(self):
        return self

    def remote(self, prepared):
        self.calls.append(prepared)
        answer = self.answers.pop(0)

        async def stream():
            if isinstance(answer, BaseException):
                raise answer
            yield answer
        return _Call(stream(), None)


def _chunk() -> AudioChunk:
    return AudioChunk(request_id="b", samples=np.zeros(4, np.float32), sample_rate=24000, index=0, piece=0)


def test_other_errors_are_not_retried():
    handle = _Calls(ValueError("bad request"))
    with pytest.raises(ValueError, match="bad request"):
        asyncio.run(_collect(FailoverStream(handle, _bare())))
    assert len(handle.calls) == 1


def test_a_continuation_that_finds_no_room_is_lost():
    from ray.serve.exceptions import BackPressureError

    outcomes = []
    handle = _Calls(ActorDiedError(), BackPressureError(num_queued_requests=4, max_queued_requests=4))
    with pytest.raises(StreamLostError, match="no other replica had room"):
        asyncio.run(_collect(FailoverStream(handle, _bare(), on_failover=outcomes.append)))
    assert outcomes == ["continued", "lost"]
    # before any failover, a full service is the request's own 429
    with pytest.raises(BackPressureError):
        asyncio.run(_collect(FailoverStream(_Calls(BackPressureError(num_queued_requests=4, max_queued_requests=4)),
                                            _bare())))


def test_a_request_without_seed_gets_one_and_a_given_seed_is_kept():
    seeds = {with_seed(_bare()).seed for _ in range(8)}
    assert None not in seeds and len(seeds) > 1
    assert with_seed(_bare(123)).seed == 123
    handle = _Calls(_chunk())
    asyncio.run(_collect(FailoverStream(handle, _bare())))
    assert handle.calls[0].seed is not None and handle.calls[0].resume is None


def test_no_seed_the_ingress_draws_is_one_the_fakes_act_on(monkeypatch):
    """A drawn seed in the fakes' hold range stopped a stream after one hop, so a sentence-mode
    stream-input session in the fresh-clone CI got 23,040 bytes of audio and an audio_timeout
    error (tests/serve_app/test_pronunciation_routes.py): the ranges must not meet."""
    bits = []
    monkeypatch.setattr(failover.secrets, "randbits", lambda n: bits.append(n) or 0)
    with_seed(_bare())
    drawn = range(2 ** bits[0])
    assert fakes.HOLD_SEEDS.start >= drawn.stop and fakes.NAN_SEED >= drawn.stop
    assert held_runtime.HOLD_SEEDS.start >= drawn.stop  # the Ray suites' held replicas
    assert held_runtime.HOLD_SEEDS.stop <= 4_294_967_296  # the ElevenLabs body's cap: every route takes them


def _whole(handle, retries: int):
    """``TTSIngress.synthesize_whole`` of a bare request over ``handle`` (no frontend call)."""
    ingress = TTSIngress(IngressConfig(stream_failover_retries=retries), None, handle)
    return asyncio.run(ingress.synthesize_whole(_bare()))


def test_a_whole_request_is_continued_like_a_stream_and_lost_without_a_continuation_left():
    handle = _Calls(ActorDiedError(), _chunk())
    result = _whole(handle, retries=1)
    assert result.num_chunks == 1 and len(result.samples) == 4 and result.sample_rate == 24000
    assert len(handle.calls) == 2 and handle.calls[1].resume is not None
    handle = _Calls(ActorDiedError(), ActorDiedError())
    with pytest.raises(StreamLostError, match="could not be continued"):
        _whole(handle, retries=1)
    assert len(handle.calls) == 2
