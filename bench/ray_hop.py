"""One Ray call's cost for a voice prompt's payload: Ray's defaults against the project's system
config (``deployments.constants.RAY_SYSTEM_CONFIG``).

A request's prompt features cross two calls (frontend -> ingress as a return value, ingress ->
synthesizer as an argument). Over Ray's inline limit a value goes through the shared-memory object
store. This times both hops between two local actors for prompts of several lengths (the mel is
16 KB a second of prompt), in rounds that alternate nothing else, each arm on its own fresh local
Ray::

    python -m bench.ray_hop --out bench/results/<date>-cpu-serving-layer-ray-hop

``--serve`` makes the same hops through Ray Serve's deployment handles instead, as the app's are
made: a unary call returning the payload (the frontend's ``prepare``) and a streaming call taking
it whose first item is back at once (the synthesizer's stream: the ``handoff`` stage without any
model work). Writes ``ray-hop.json`` and ``ray-hop.md`` (median ms per hop, per round). What it is
not: a loaded node.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from deployments.constants import RAY_SYSTEM_CONFIG

MEL_BINS, MEL_FPS = 80, 50  # a prompt's mel, frames-major float32 (cosyvoice_runtime/voice_prompt.py)


def payload(prompt_s: float) -> dict:
    frames = int(prompt_s * MEL_FPS)
    return {"mel": np.zeros((frames, MEL_BINS), np.float32), "speech_tokens": np.zeros(frames // 2, np.int32)}


def medians(ret: list[float], arg: list[float]) -> dict[str, float]:
    """One cell of a round: the median ms of each hop."""
    return {"return_ms": round(statistics.median(ret), 3), "argument_ms": round(statistics.median(arg), 3)}


def measure(system_config: dict | None, prompts_s: list[float], calls: int, rounds: int) -> dict[str, list]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", _system_config=system_config or {})
    try:
        @ray.remote
        class Frontend:
            def prepare(self, prompt_s: float) -> dict:
                return payload(prompt_s)

        @ray.remote
        class Synthesizer:
            def take(self, prepared: dict) -> int:
                return prepared["mel"].shape[0]

        front, synth = Frontend.remote(), Synthesizer.remote()
        ray.get(synth.take.remote(ray.get(front.prepare.remote(1.0))))  # both actors up
        out: dict[str, list] = {}
        for _ in range(rounds):
            for prompt_s in prompts_s:
                ret, arg = [], []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    prepared = ray.get(front.prepare.remote(prompt_s))
                    t1 = time.perf_counter()
                    ray.get(synth.take.remote(prepared))
                    ret.append((t1 - t0) * 1e3)
                    arg.append((time.perf_counter() - t1) * 1e3)
                out.setdefault(str(prompt_s), []).append(medians(ret, arg))
        return out
    finally:
        ray.shutdown()


def measure_serve(system_config: dict | None, prompts_s: list[float], calls: int, rounds: int) -> dict[str, list]:
    """The two hops through Serve's deployment handles, made from a third replica as the ingress
    makes them (so Serve's handle and replica settings in the environment apply as in the app)."""
    import asyncio

    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             _system_config=system_config or {})
    try:
        @serve.deployment(ray_actor_options={"num_cpus": 0})
        class Frontend:
            def prepare(self, prompt_s: float) -> dict:
                return payload(prompt_s)

        @serve.deployment(ray_actor_options={"num_cpus": 0})
        class Synthesizer:
            async def stream(self, prepared: dict):
                yield prepared["mel"].shape[0]

        @serve.deployment(ray_actor_options={"num_cpus": 0})
        class Prober:
            def __init__(self, front, synth) -> None:
                self.front, self.synth = front, synth.options(stream=True)

            async def hops(self, prompt_s: float, calls: int) -> list[tuple[float, float]]:
                out = []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    prepared = await self.front.prepare.remote(prompt_s)
                    t1 = time.perf_counter()
                    async for _ in self.synth.stream.remote(prepared):
                        break
                    out.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
                return out

        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        serve.run(Prober.bind(Frontend.bind(), Synthesizer.bind()), name="hop", route_prefix=None)

        async def drive() -> dict[str, list]:
            prober = serve.get_app_handle("hop")  # in a loop: RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 needs one
            await prober.hops.remote(1.0, 3)
            out: dict[str, list] = {}
            for _ in range(rounds):
                for prompt_s in prompts_s:
                    ret, arg = zip(*await prober.hops.remote(prompt_s, calls), strict=True)
                    out.setdefault(str(prompt_s), []).append(medians(ret, arg))
            await serve.shutdown_async()  # in the loop the handle's router may live in
            return out

        return asyncio.run(drive())
    finally:
        ray.shutdown()


def in_child(fn, *args):
    """``fn(*args)`` in a fresh process: each arm gets its own local Ray (and a handle's router
    bound to a closed event loop cannot break the next arm's shutdown)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def markdown(result: dict) -> str:
    lines = [(f"# One Ray call per prompt payload: defaults against RAY_SYSTEM_CONFIG ({result['date']}, "
             f"{result['device']})"), "",
             (f"{result['calls']} calls per cell, median ms, {result['rounds']} rounds (one column each); "
             f"{result.get('path', 'Ray actor calls')}, local; the mel is {MEL_BINS * MEL_FPS * 4 // 1000} KB a second of prompt. "
             f"Project config: `{result['system_config']}`; Serve's environment: `{result.get('serve_env') or {}}`."), "",
             "| prompt s | payload KB | arm | return (frontend -> ingress) ms | argument (ingress -> synthesizer) ms |",
             "|---|---|---|---|---|"]
    for prompt_s in result["prompts_s"]:
        kb = payload(prompt_s)["mel"].nbytes / 1e3
        for arm in ("ray_default", "project"):
            rows = result[arm][str(prompt_s)]
            ret = " / ".join(f"{r['return_ms']:.2f}" for r in rows)
            arg = " / ".join(f"{r['argument_ms']:.2f}" for r in rows)
            lines.append(f"| {prompt_s:g} | {kb:.0f} | {arm} | {ret} | {arg} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts-s", default="3.5,6,6.5,10,20", help="prompt seconds, comma-separated")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help="through Serve's deployment handles (unary, then streaming)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    prompts = [float(x) for x in args.prompts_s.split(",")]
    # by the module's name, not __main__'s: what a spawned child can import
    module = importlib.import_module("bench.ray_hop")
    hop = functools.partial(in_child, module.measure_serve if args.serve else module.measure)
    serve_env = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
    result = {"date": time.strftime("%Y-%m-%d"), "device": "cpu", "calls": args.calls, "rounds": args.rounds,
              "serve_env": serve_env,
              "prompts_s": prompts, "system_config": RAY_SYSTEM_CONFIG,
              "path": "Serve deployment handles (unary return, streaming call's first item)" if args.serve
              else "Ray actor calls",
              "ray_default": hop(None, prompts, args.calls, args.rounds),
              "project": hop(RAY_SYSTEM_CONFIG, prompts, args.calls, args.rounds)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ray-hop.json").write_text(json.dumps(result, indent=1))
    (args.out / "ray-hop.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
