"""Leak probe: the real Synthesizer (tiny model, CPU) driven in-process, RSS sampled per request.

No Ray and no HTTP: the frontend runtime prepares requests, the Synthesizer's ``synthesize``
streams them (:meth:`~deployments.synthesizer.Synthesizer.outside_serve`: each chunk job a batch of
its own, as ``@serve.batch`` runs only in a replica), ``--concurrency`` at a time. Every ``--every``
requests it records the process RSS, live Python objects, live torch tensors and the sizes of
the replica's per-request bookkeeping (:meth:`~deployments.synthesizer.Synthesizer.open_entries`:
engine-loop mailboxes and pending adds, engine requests, silent token filters, scheduler entries). A leak shows up as a container or object count that grows
with the request count; an allocator high-water mark as RSS that rises and then flattens while
every count stays flat.

    python -m bench.leak_probe --requests 600 --concurrency 8 --every 50 [--trim]

``--trim`` calls glibc ``malloc_trim(0)`` before each sample (how much RSS is only freed-but-held
heap). ``MALLOC_ARENA_MAX=2`` in the environment limits glibc's per-thread arenas.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import random
import tempfile
import time
import uuid
from pathlib import Path

import psutil

TEXTS = ("Hi.", "Hello world.", "Good morning to you.", "One. Two.", "The quick brown fox jumps.")


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _tensors() -> tuple[int, int]:
    import torch

    n = nbytes = 0
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                size = obj.element_size() * obj.nelement()
                if not isinstance(size, int):  # a traced (fake, symbolic) tensor left by torch.compile: no memory
                    continue
                n += 1
                nbytes += size
        except Exception:  # noqa: BLE001, S112 - proxies and half-dead objects
            continue
    return n, nbytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) before each sample")
    p.add_argument("--stream-fraction", type=float, default=0.8)
    p.add_argument("--texts", nargs="*", default=list(TEXTS))
    p.add_argument("--out", default=None, help="write the samples as JSON here")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from deployments.frontend import FrontendConfig, TextFrontend
    from deployments.model_source import ModelSource
    from deployments.protocol import SynthesisRequest
    from deployments.synthesizer import Synthesizer
    from deployments.synthesizer_config import SynthesizerConfig

    source = ModelSource(None, "cosyvoice2")
    fe = TextFrontend(FrontendConfig(voices_dir=tempfile.mkdtemp(prefix="leak-voices-")), source)
    synth = Synthesizer(SynthesizerConfig(device="cpu", max_running=8, max_ongoing_requests=8, max_model_len=1024,
                                          token2wav={"max_batch_size": 4}), source)

    synth.outside_serve()
    proc = psutil.Process()
    rng = random.Random(0)
    samples = []
    t0 = time.perf_counter()

    def sample(done: int) -> None:
        gc.collect()
        if a.trim:
            _malloc_trim()
        n_t, b_t = _tensors()
        row = {"requests": done, "t_s": round(time.perf_counter() - t0, 1),
               "rss_mib": round(proc.memory_info().rss / 2**20, 1), "objects": len(gc.get_objects()),
               "tensors": n_t, "tensor_mib": round(b_t / 2**20, 2),
               # compute seconds per kind of call (LLM step/add vs flow + HiFT)
               "compute_s": {k: round(v, 1) for k, v in synth.compute.seconds_by_call().items()},
               **synth.open_entries()}
        samples.append(row)
        print(json.dumps(row), flush=True)

    async def one(i: int) -> int:
        req = SynthesisRequest(request_id=uuid.uuid4().hex, text=rng.choice(a.texts), voice_id="default",
                               stream=rng.random() < a.stream_fraction, seed=i)
        prepared = await fe.prepare(req)
        n = 0
        async for chunk in synth.synthesize(prepared):
            n += len(chunk.samples)
        return n

    async def run() -> None:
        counter = iter(range(a.requests))
        done = 0

        async def worker() -> None:
            nonlocal done
            for i in counter:
                await one(i)
                done += 1
                if done % a.every == 0:
                    sample(done)

        sample(0)
        await asyncio.gather(*(worker() for _ in range(a.concurrency)))

    asyncio.run(run())
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "env_malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
                                           "samples": samples}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
