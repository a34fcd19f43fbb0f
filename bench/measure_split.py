"""Measure what splitting token generation and token2wav into two deployments would cost.

Run: RAY_AUTH_MODE=disabled .venv/bin/python -m bench.measure_split

Measures on real local Ray (no model): (1) per-item latency of a handle stream (what a
TokenGenerator -> Token2Wav token stream costs per token), (2) round trip of a unary handle call
carrying one chunk job's state (prompt mel + tokens + vocoder cache) both ways, which a
stateless Token2Wav deployment would need per chunk.
"""
from __future__ import annotations

import asyncio
import os
import pickle
import statistics
import time

import numpy as np

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


class Streamer:
    async def tokens(self, n: int):
        for i in range(n):
            yield i


class Echo:
    async def job(self, state: dict) -> dict:
        return state


def job_state(prompt_s: float = 3.0, generated_tokens: int = 200) -> dict:
    """A chunk job's state for CosyVoice2 (spec §6.2 C/D): prompt mel/tokens/embedding, tokens so far,
    CV2 vocoder caches (8 mel frames, 3840 source + speech samples)."""
    lp = int(prompt_s * 25)
    return {
        "prompt_tokens": np.zeros(lp, np.int32), "prompt_mel": np.zeros((2 * lp, 80), np.float32),
        "embedding": np.zeros(192, np.float32), "tokens": np.zeros(generated_tokens, np.int32),
        "mel_cache": np.zeros((80, 8), np.float32), "source_cache": np.zeros(3840, np.float32),
        "speech_cache": np.zeros(3840, np.float32),
    }


def main() -> None:
    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    h_stream = serve.run(serve.deployment(Streamer, ray_actor_options={"num_cpus": 0.1}).bind(), name="s",
                         route_prefix=None)
    h_echo = serve.run(serve.deployment(Echo, ray_actor_options={"num_cpus": 0.1}).bind(), name="e", route_prefix=None)

    async def run():
        n = 500
        for _ in range(2):  # warm-up, then measure
            t0 = time.perf_counter()
            count = 0
            async for _ in h_stream.options(stream=True).tokens.remote(n):
                count += 1
            per_item = (time.perf_counter() - t0) / count
        state = job_state()
        await h_echo.job.remote(state)
        rtts = []
        for _ in range(50):
            t0 = time.perf_counter()
            await h_echo.job.remote(state)
            rtts.append(time.perf_counter() - t0)
        return per_item, statistics.median(rtts), len(pickle.dumps(state))

    per_item, rtt, size = asyncio.run(run())
    print(f"handle stream: {per_item * 1e3:.3f} ms per yielded item ({1 / per_item:.0f} items/s, one stream)")
    print(f"unary job round trip with state ({size / 1024:.1f} KiB pickled): median {rtt * 1e3:.2f} ms")
    ray.shutdown()


if __name__ == "__main__":
    main()
