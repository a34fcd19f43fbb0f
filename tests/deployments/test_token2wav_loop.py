"""token2wav.scheduler "steps" (deployments/token2wav_loop.py, issue 14): the same audio as the
batch scheduler on the real tiny model, urgent jobs first, and failures isolated per job."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from deployments.compute import ComputeExecutor
from deployments.model_source import ModelSource
from deployments.protocol import EngineDeadError, PreparedRequest, RequestFailedError, TextPiece, VoicePrompt
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from deployments.token2wav_loop import SteppedToken2Wav


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "cv2", "cosyvoice2"))


def _req(rid: str, n_text: int, seed: int) -> PreparedRequest:
    g = np.random.default_rng(seed)
    prompt = VoicePrompt(family="cosyvoice2", text_tokens=np.arange(5, dtype=np.int32),
                         speech_tokens=g.integers(0, 100, 30).astype(np.int32),
                         mel=g.standard_normal((60, 80)).astype(np.float32),
                         embedding=g.standard_normal(192).astype(np.float32))
    text = g.integers(100, 1000, n_text).astype(np.int32)
    return PreparedRequest(request_id=rid, pieces=[TextPiece("x", text)], prompt=prompt,
                           llm_prompt_text_ids=np.arange(5, dtype=np.int32), llm_use_prompt_speech=True,
                           stream=True, seed=seed)


def _speak(synth: Synthesizer, reqs: list[PreparedRequest]) -> list[np.ndarray]:
    async def one(req):
        return [c.samples async for c in synth.synthesize(req)]

    async def main():
        return await asyncio.gather(*(one(r) for r in reqs))

    return [np.concatenate(chunks) for chunks in asyncio.run(main())]


def test_steps_stream_the_batch_schedulers_audio(model_dir):
    """Three concurrent streams of different lengths through the real tiny model: the stepped
    scheduler (passes over rows at different steps) gives each the batch path's samples, with
    CosyVoice2's flow recomputed or incremental (token2wav.cv2_flow); the LLM giving way to
    token2wav's due jobs (token2wav.give_way_ms) changes when tokens are made, not the audio."""
    reqs = [_req(f"r{i}", n, seed=i) for i, n in enumerate((6, 11, 3))]
    out = {}
    for cv2_flow in ("recompute", "incremental"):
        for scheduler in ("batch", "steps", "steps-give-way"):
            give_way = 5.0 if scheduler == "steps-give-way" else 0.0
            scheduler = scheduler.removesuffix("-give-way")
            cfg = SynthesizerConfig(device="cpu", warmup=False, max_model_len=512,
                                    token2wav={"scheduler": scheduler, "cv2_flow": cv2_flow, "give_way_ms": give_way})
            synth = Synthesizer(cfg, ModelSource(model_dir))
            synth.outside_serve()  # no @serve.batch outside a replica (the stepped scheduler batches by itself)
            out[scheduler + ("-give-way" if give_way else ""), cv2_flow] = _speak(synth, reqs)
            stats = synth.stats()
            assert stats["token2wav_scheduler"] == scheduler
            assert (synth.loop._give_way is not None) == (give_way > 0)
            if scheduler == "steps":
                assert synth.gate is None and stats["flow_passes_total"] > 0
                assert stats["flow_rows_in_passes_total"] > stats["flow_passes_total"]  # passes were shared
                assert stats["flow_rows_ready_total"] >= stats["flow_rows_in_passes_total"]
            # three new voices: the stepped incremental flow solves their prompt prefixes ahead
            primed = 3 if (scheduler, cv2_flow) == ("steps", "incremental") else 0
            assert stats["flow_prompt_prefix_primed_total"] == primed, (scheduler, cv2_flow)
            if cv2_flow == "incremental":
                assert (stats["flow_prompt_prefix_misses_total"], stats["flow_prompt_prefix_hits_total"]) == (3, 0)
    reference = out["batch", "recompute"]
    for key in (("steps", "recompute"), ("batch", "incremental"), ("steps", "incremental"),
                ("steps-give-way", "recompute"), ("steps-give-way", "incremental")):
        for a, b in zip(reference, out[key]):
            assert a.size == b.size > 0, key
            assert float(np.abs(a - b).max()) < 1e-4, key


def test_a_new_voices_prefix_is_solved_before_its_first_chunk_and_kept(model_dir):
    """The stepped incremental flow: a request of a new voice has its prompt prefix solved by a job
    of its own, and its first chunk starts after it; a request of that voice later, and one of it
    beside a new voice, find it kept. Same audio as without prompt prefixes (token2wav.cv2_prompt_cache_bytes 0)."""
    first, again, beside = _req("a", 8, seed=1), _req("b", 5, seed=1), _req("c", 6, seed=2)
    out, stats = {}, {}
    for cache in (0, 1 << 30):
        cfg = SynthesizerConfig(device="cpu", warmup=False, max_model_len=512,
                                token2wav={"scheduler": "steps", "cv2_flow": "incremental", "cv2_prompt_cache_bytes": cache})
        synth = Synthesizer(cfg, ModelSource(model_dir))
        synth.outside_serve()
        t2w = synth.runtime.token2wav.t2w
        starts, start_solves = [], t2w.start_solves

        def spy(jobs, start_solves=start_solves, starts=starts):
            rows = start_solves(jobs)
            starts.extend((type(job).__name__, job.state.token_offset, row.start) for job, row in zip(jobs, rows))
            return rows

        t2w.start_solves = spy
        out[cache] = _speak(synth, [first])
        first_rows = list(starts)
        out[cache] += _speak(synth, [again, beside])
        stats[cache] = {k: synth.stats()[f"flow_prompt_prefix_{k}_total"] for k in ("primed", "hits", "misses")}
    assert stats[0] == {"primed": 0, "hits": 0, "misses": 0}
    assert stats[1 << 30] == {"primed": 2, "hits": 1, "misses": 2}
    prefix = t2w.flow.prompt_prefix_frames(len(first.prompt.speech_tokens))
    assert prefix > 0 and first_rows[:2] == [("PrefixJob", 0, 0), ("Token2WavJob", 0, prefix)]
    for a, b in zip(out[0], out[1 << 30]):
        assert a.size == b.size > 0 and float(np.abs(a - b).max()) < 1e-4


def test_the_stepped_first_chunk_carries_the_token2wav_marks_in_order(model_dir):
    """The first chunk's timing splits token2wav: tokens ready <= driver took the job <= solved <=
    audio on the event loop (the stamps Server-Timing's t2w-* parts are made of); later chunks carry none."""
    cfg = SynthesizerConfig(device="cpu", warmup=False, max_model_len=512, token2wav={"scheduler": "steps"})
    synth = Synthesizer(cfg, ModelSource(model_dir))

    async def main():
        return [c async for c in synth.synthesize(_req("r", 11, seed=3))]

    chunks = asyncio.run(main())
    t = chunks[0].timing
    assert set(t) == {"first_token", "first_chunk_tokens", "t2w_started", "t2w_solved", "first_audio", "replica_up"}
    assert t["first_token"] <= t["first_chunk_tokens"] <= t["t2w_started"] < t["t2w_solved"] <= t["first_audio"]
    assert len(chunks) > 1 and all(c.timing is None for c in chunks[1:])


def test_the_driver_stamps_each_jobs_marks_once():
    ticks = iter(range(1, 100))
    loop = SteppedToken2Wav(_FakeT2W(), ComputeExecutor(lanes=("t2w",)), "t2w", clock=lambda: float(next(ticks)),
                            slack_s=0.5, max_batch=4, on_fatal=lambda exc: None)
    first: dict[str, float] = {}
    kept = {"t2w_started": -1.0, "t2w_solved": -2.0}  # a request's later jobs keep its first stamps

    async def main():
        await asyncio.gather(loop.run(_job("a"), 0.0, first), loop.run(_job("b"), 0.0, kept), loop.run(_job("c"), 0.0))

    asyncio.run(main())
    assert set(first) == {"t2w_started", "t2w_solved"} and first["t2w_started"] < first["t2w_solved"]
    assert kept == {"t2w_started": -1.0, "t2w_solved": -2.0}


class _FakeT2W:
    """Rows of ``frames``; a job whose ``poison`` names a step raises there (alone or not)."""

    n_steps = 3

    def __init__(self, fatal: bool = False) -> None:
        self.passes: list[list[str]] = []
        self.fatal = fatal

    def start_solves(self, jobs):
        return [SimpleNamespace(step=0, frames=j.frames, kind="recompute", job=j) for j in jobs]

    def advance(self, rows):
        if any(r.job.poison == "advance" for r in rows):
            raise (RuntimeError("CUDA error: an illegal memory access") if self.fatal else RuntimeError("bad row"))
        self.passes.append([r.job.name for r in rows])
        for r in rows:
            r.step += 1

    def finish(self, rows):
        if any(r.job.poison == "finish" for r in rows):
            raise RuntimeError("vocoder failed")
        audios = [np.full(4, float(len(r.job.name)), np.float32) for r in rows]

        def collect():  # what waits for the audio on the host (the copy back from the GPU)
            if any(r.job.poison == "collect" for r in rows):
                raise RuntimeError("CUDA error: an illegal memory access" if self.fatal else "copy failed")
            return audios
        return collect


def _job(name: str, frames: int = 100, poison: str | None = None):
    return SimpleNamespace(name=name, frames=frames, poison=poison)


def _loop(t2w, fatal: list | None = None) -> SteppedToken2Wav:
    return SteppedToken2Wav(t2w, ComputeExecutor(lanes=("t2w",)), "t2w", clock=lambda: 100.0, slack_s=0.5,
                            max_batch=4, on_fatal=(fatal.append if fatal is not None else lambda exc: None))


def test_a_job_that_fails_alone_fails_only_its_request():
    t2w = _FakeT2W()
    loop = _loop(t2w)

    async def main():
        return await asyncio.gather(loop.run(_job("ok"), 100.0), loop.run(_job("bad", poison="advance"), 100.0),
                                    loop.run(_job("late", poison="finish"), 100.0), loop.run(_job("fine"), 100.0))

    ok, bad, late, fine = asyncio.run(main())
    assert ok.tolist() == [2.0] * 4 and fine.tolist() == [4.0] * 4
    assert isinstance(bad, RequestFailedError) and "bad row" in str(bad)
    assert isinstance(late, RequestFailedError) and "vocoder failed" in str(late)
    assert loop.failed_jobs == 2
    assert all("bad" not in names for names in t2w.passes)  # the failed pass was retried without it


@pytest.mark.parametrize("fatal", [False, True])
def test_audio_that_fails_on_its_way_back_fails_the_jobs_of_that_batch(fatal):
    """The wait for a finished batch's audio runs off the driver thread: an error there fails
    the batch's requests (a fatal one is reported, and its jobs name a dead replica); a job
    finished in another batch is unaffected."""
    reported: list = []
    t2w = _FakeT2W(fatal=fatal)
    loop = _loop(t2w, reported)

    async def main():
        ok = await loop.run(_job("ok"), 100.0)
        bad = await loop.run(_job("bad", poison="collect"), 100.0)
        return ok, bad

    ok, bad = asyncio.run(main())
    assert ok.tolist() == [2.0] * 4
    assert isinstance(bad, EngineDeadError if fatal else RequestFailedError) and "audio generation failed" in str(bad)
    assert loop.failed_jobs == 1 and len(reported) == fatal


def test_a_fatal_error_fails_every_job_in_hand_and_reports_it():
    fatal: list = []
    loop = _loop(_FakeT2W(fatal=True), fatal)

    async def main():
        return await asyncio.gather(loop.run(_job("a"), 100.0), loop.run(_job("b", poison="advance"), 100.0))

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert len(fatal) == 1 and "illegal memory access" in str(fatal[0])


def test_the_most_urgent_job_gets_the_passes_first():
    """A first chunk (due now) submitted while a long job with audio to spare is in its passes
    takes every pass until it is done; the long one waits (earliest deadline first)."""
    t2w = _FakeT2W()
    gate = threading.Event()
    started = threading.Event()
    advance = t2w.advance

    def held_advance(rows):  # hold the long job's first pass until the urgent one is queued
        started.set()
        if rows[0].job.name == "long" and rows[0].step == 0:
            gate.wait(timeout=60)
        advance(rows)

    t2w.advance = held_advance
    loop = _loop(t2w)

    async def main():
        long = asyncio.ensure_future(loop.run(_job("long", frames=900), 103.0))  # 3 s of audio in hand
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 60)
        first = asyncio.ensure_future(loop.run(_job("first", frames=200), 100.0))  # due now
        await asyncio.sleep(0)  # let run() queue it before the held pass ends
        gate.set()
        return await asyncio.gather(long, first)

    asyncio.run(main())
    assert t2w.passes[0] == ["long"]
    assert t2w.passes[1:4] == [["first"]] * 3  # the urgent job's three passes, alone (too short to pad to)
    assert t2w.passes[4:] == [["long"], ["long"]]


def test_gather_ms_is_gone():
    """token2wav.gather_ms (a pass of rows with slack waiting for more rows) measured no gain on an
    H100 and was removed (issue 42: docs/tuning.md §2): a config that still sets it fails at build."""
    with pytest.raises(ValueError, match="gather_ms"):
        SynthesizerConfig(token2wav={"gather_ms": 4})


def test_overdue_while_a_due_job_is_in_hand_and_rows_leaving_are_reported():
    """What the LLM's give-way reads (token2wav.give_way_ms): a job due already (deadline 100 on a
    clock at 100: a first chunk) makes the loop overdue from its arrival until its audio is back
    (its rows leave when the vocoder is queued); a job with audio to spare does not; on_rows_left
    is called when rows leave and when a job's audio is back."""
    t2w = _FakeT2W()
    seen, left = [], []
    loop = _loop(t2w)
    advance = t2w.advance

    def watching_advance(rows):
        seen.append(([r.job.name for r in rows], loop.overdue()))
        advance(rows)

    t2w.advance = watching_advance
    both_left = threading.Event()

    def rows_left():  # on the driver thread (rows leave), then on the event loop (audio back)
        left.append(loop.overdue())
        if len(left) == 4:
            both_left.set()

    loop.on_rows_left = rows_left

    async def main():
        spare = await loop.run(_job("spare", frames=200), 103.0)  # 3 s of audio in hand
        first = await loop.run(_job("first", frames=200), 100.0)
        return spare, first

    asyncio.run(main())
    assert both_left.wait(timeout=60)  # a failure guard, not a synchronisation by time
    assert seen == [(["spare"], False)] * 3 + [(["first"], True)] * 3
    assert left == [False, False, True, False] and not loop.overdue()
