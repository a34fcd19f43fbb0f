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
import itertools

import numpy as np
import pytest
from ray.exceptions import ActorDiedError

from deployments.frontend import FrontendConfig, TextFrontend
from deployments.model_source import ModelSource
from deployments.protocol import SynthesisMode, SynthesisRequest
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from serve_app.failover import FailoverStream, StreamLostError, unary, with_seed

# Two sentence pieces (the splitter's pieces are independent LLM sequences): a continuation may
# start in either, or at the border between them.
TEXT = ("The weather is lovely today, and the park is full of people walking their dogs in the sun. "
        "Shall we take a long walk along the river after lunch and come back before the rain starts?")
# Float noise: a continuation prefills the ids an unbroken run decoded one by one, and its
# token2wav batches differ; a different id or a misplaced seam would differ by far more.
ATOL = 1e-4


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def setup(family, tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    model_dir = str(write_tiny_model(tmp_path_factory.mktemp("tiny") / family, family))
    frontend = TextFrontend(FrontendConfig(voices_dir=str(tmp_path_factory.mktemp("voices"))), ModelSource(model_dir))
    replicas = [_synth(model_dir), _synth(model_dir)]
    # A prompt upload (the frontend adds CosyVoice3's prefix to its transcript).
    audio = (0.1 * np.random.default_rng(3).standard_normal(2 * 16000)).astype(np.float32)
    prepared = asyncio.run(frontend.prepare(SynthesisRequest(
        request_id="r", text=TEXT, mode=SynthesisMode.ZERO_SHOT, prompt_audio=audio, prompt_sample_rate=16000,
        prompt_text="A voice for the test.", stream=True)))
    assert len(prepared.pieces) == 2, [p.text for p in prepared.pieces]
    return replicas, with_seed(prepared)


def _synth(model_dir: str) -> Synthesizer:
    synth = Synthesizer(SynthesizerConfig(device="cpu", warmup=False, max_model_len=1024), ModelSource(model_dir))

    async def direct(job, s=synth):  # outside a replica: the @serve.batch method run one job at a time
        return (await s._run_jobs([job]))[0]
    synth._token2wav = direct
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
    replicas, prepared = setup
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
        np.testing.assert_allclose(audio, unbroken, atol=ATOL, rtol=0, err_msg=str(deaths))
        assert [c.index for c in got] == list(range(len(got)))  # the continuation numbers on
        assert got[-1].is_last
        resume = handle.calls[1].resume
        assert resume.chunks == deaths[0] and resume.samples > 0 and resume.tokens


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


def test_other_errors_are_not_retried(setup):
    replicas, prepared = setup

    class Failing(_Handle):
        def remote(self, prepared):
            self.calls.append(prepared)
            return _Call(_raise(ValueError("bad request")), None)

    async def _raise(exc):
        raise exc
        yield  # an async generator

    handle = Failing(replicas, {})
    with pytest.raises(ValueError, match="bad request"):
        asyncio.run(_collect(FailoverStream(handle, prepared)))
    assert len(handle.calls) == 1


def test_a_request_without_seed_gets_one_and_a_given_seed_is_kept(setup):
    _, prepared = setup
    from dataclasses import replace

    seeds = {with_seed(replace(prepared, seed=None)).seed for _ in range(8)}
    assert None not in seeds and len(seeds) > 1
    assert with_seed(replace(prepared, seed=123)).seed == 123


def test_unary_is_retried_on_another_replica(setup):
    replicas, prepared = setup
    counter = itertools.count()

    class Unary:
        class synthesize_unary:  # the handle method's name
            @staticmethod
            def remote(p):
                n = next(counter)

                async def call():
                    if n == 0:
                        raise ActorDiedError()
                    return await replicas[n % 2].synthesize_unary(p)
                return call()

    result = asyncio.run(unary(Unary, prepared, retries=1))
    assert next(counter) == 2 and len(result.samples) > 0
    counter = itertools.count()

    class Dead(Unary):
        class synthesize_unary:  # the handle method's name
            @staticmethod
            def remote(p):
                next(counter)

                async def call():
                    raise ActorDiedError()
                return call()

    with pytest.raises(StreamLostError):
        asyncio.run(unary(Dead, prepared, retries=1))
    assert next(counter) == 2
