"""Measure the serving layer's own cost per decode step: the Synthesizer's engine loop, the
per-request coroutines, chunk scheduling and the deadline gate, with a zero-cost engine and
token2wav (:mod:`bench.null_runtime`), at several numbers of concurrent streams.

Run: .venv/bin/python -m bench.measure_loop [--streams 1,16,64] [--tokens 250]

``--step-ms 5 --t2w-ms 20`` gives the fakes a GPU-like cost instead: a decode step and a
token2wav batch that sleep (the GIL is free meanwhile, as while a replica waits on CUDA) on two
lanes as on a GPU replica; ``overhead_ms_per_step`` is then what the serving layer adds to each
step beyond the step itself.

On a GPU replica this overhead is paid on the replica's event loop between two decode steps
(the next step is submitted before the consumers run, but they hold the GIL the step's host
side needs), so it bounds the decode rate: a loop that needs 1 ms per step at 64 streams adds
up to 1 ms to a 5 ms graphed step. No Ray: the methods are called in-process, each chunk job a
batch of its own (``Synthesizer.outside_serve``: ``@serve.batch`` runs only in a replica).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from bench.null_runtime import TOKENS_PER_ID, null_runtime
from deployments.protocol import PreparedRequest, TextPiece, VoicePrompt
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig


def _prompt() -> VoicePrompt:
    return VoicePrompt(family="cosyvoice2", text_tokens=np.arange(3, dtype=np.int32),
                       speech_tokens=np.arange(10, dtype=np.int32), mel=np.zeros((20, 80), np.float32),
                       embedding=np.ones(192, np.float32))


def measure(streams: int, tokens: int, deadline_slack_s: float | None, step_s: float = 0.0,
            t2w_s: float = 0.0) -> dict:
    gpu_like = step_s > 0 or t2w_s > 0
    cfg = SynthesizerConfig(max_running=streams, max_ongoing_requests=streams, warmup=False, overlap_stages=gpu_like,
                            token2wav={"max_batch_size": min(16, streams), "deadline_slack_s": deadline_slack_s})
    s = Synthesizer(cfg, runtime_factory=null_runtime(step_s, t2w_s))
    s.outside_serve()
    n_ids = tokens // TOKENS_PER_ID

    async def one(i: int) -> int:
        req = PreparedRequest(request_id=f"r{i}", pieces=[TextPiece("x", np.arange(n_ids, dtype=np.int32))],
                              prompt=_prompt(), llm_prompt_text_ids=np.zeros(0, np.int32),
                              llm_use_prompt_speech=True, stream=True)
        return sum([len(c.samples) async for c in s.synthesize(req)])

    async def main() -> tuple[float, list[int]]:
        started = time.perf_counter()
        samples = await asyncio.gather(*(one(i) for i in range(streams)))
        return time.perf_counter() - started, samples

    wall, samples = asyncio.run(main())
    steps = s.loop.steps
    s.shutdown()
    return {"streams": streams, "tokens_per_stream": tokens, "samples_per_stream": sorted(set(samples)),
            "deadline_slack_s": deadline_slack_s, "steps": steps,
            "step_ms": 1e3 * step_s, "t2w_ms": 1e3 * t2w_s, "wall_s": wall, "ms_per_step": 1e3 * wall / steps,
            "overhead_ms_per_step": 1e3 * (wall / steps - step_s), "us_per_token": 1e6 * wall / (steps * streams)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--step-ms", type=float, default=0.0, help="fake decode step time (sleeps, GIL free)")
    ap.add_argument("--t2w-ms", type=float, default=0.0, help="fake token2wav batch time (sleeps, own lane)")
    ap.add_argument("--slack", default="none,0.5", help="deadline slacks to run (none = FIFO)")
    args = ap.parse_args(argv)
    slacks = [None if x == "none" else float(x) for x in args.slack.split(",")]
    for n in (int(x) for x in args.streams.split(",")):
        for slack in slacks:
            print(json.dumps(measure(n, args.tokens, slack, args.step_ms / 1e3, args.t2w_ms / 1e3)), flush=True)


if __name__ == "__main__":
    main()
