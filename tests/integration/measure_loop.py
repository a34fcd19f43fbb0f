"""Measure the serving layer's own cost per decode step: the Synthesizer's engine loop, the
per-request coroutines, chunk scheduling and the deadline gate, with a zero-cost fake engine
and token2wav, at several numbers of concurrent streams.

Run: .venv/bin/python -m tests.integration.measure_loop [--streams 1,16,64] [--tokens 250]

On a GPU replica this overhead is paid on the replica's event loop between two decode steps
(the next step is submitted before the consumers run, but they hold the GIL the step's host
side needs), so it bounds the decode rate: a loop that needs 1 ms per step at 64 streams adds
up to 1 ms to a 5 ms graphed step. No Ray: the methods are called in-process, ``@serve.batch``
replaced by a direct call as in the unit tests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from deployments.protocol import PreparedRequest, TextPiece, VoicePrompt
from deployments.runtime_adapter import SynthesisRuntime
from deployments.synthesizer import Synthesizer, SynthesizerConfig
from tests.deployments import fakes


def _prompt() -> VoicePrompt:
    return VoicePrompt(family="cosyvoice2", prompt_text_ids=np.arange(3, dtype=np.int32),
                       speech_tokens=np.arange(10, dtype=np.int32), mel=np.zeros((20, 80), np.float32),
                       embedding=np.ones(192, np.float32))


def _runtime(cfg, source):
    return SynthesisRuntime(engine=fakes.FakeEngine(max_running=cfg.max_running, step_s=0.0),
                                  token2wav=fakes.FakeToken2Wav(batch_s=0.0), device="cpu")


def measure(streams: int, tokens: int, deadline_slack_s: float | None) -> dict:
    cfg = SynthesizerConfig(max_running=streams, max_ongoing_requests=streams, warmup=False,
                            token2wav={"max_batch_size": min(16, streams), "deadline_slack_s": deadline_slack_s})
    s = Synthesizer(cfg, runtime_factory=_runtime)

    async def direct(job):
        s.t2w_batch_sizes[1] += 1
        return (await s.compute.run(s.t2w.run_batch, [job], lane=s._t2w_lane))[0]

    s._token2wav = direct
    n_ids = tokens // fakes.TOKENS_PER_TEXT_ID

    async def one(i: int) -> int:
        req = PreparedRequest(request_id=f"r{i}", pieces=[TextPiece("x", np.arange(n_ids, dtype=np.int32))],
                              prompt=_prompt(), llm_prompt_text_ids=np.zeros(0, np.int32),
                              llm_use_prompt_speech=True, stream=True)
        return sum([len(c.samples) async for c in s.synthesize(req)])

    async def main() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(streams)))
        return time.perf_counter() - started

    wall = asyncio.run(main())
    steps = s.loop.steps
    s.compute.shutdown()
    return {"streams": streams, "tokens_per_stream": tokens, "deadline_slack_s": deadline_slack_s, "steps": steps,
            "wall_s": wall, "ms_per_step": 1e3 * wall / steps, "us_per_token": 1e6 * wall / (steps * streams)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=250)
    args = ap.parse_args(argv)
    for n in (int(x) for x in args.streams.split(",")):
        for slack in (None, 0.5):
            print(json.dumps(measure(n, args.tokens, slack)), flush=True)


if __name__ == "__main__":
    main()
