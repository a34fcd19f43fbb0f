"""One Ray call's cost for a voice prompt's payload: Ray's defaults against the project's system
config (``deployments.constants.RAY_SYSTEM_CONFIG``).

A request's prompt features cross two calls (frontend -> ingress as a return value, ingress ->
synthesizer as an argument). Over Ray's inline limit a value goes through the shared-memory object
store. This times both hops between two local actors for prompts of several lengths (the mel is
16 KB a second of prompt), in rounds that alternate nothing else, each arm on its own fresh local
Ray::

    python -m bench.ray_hop --out bench/results/<date>-cpu-serving-layer-ray-hop

Writes ``ray-hop.json`` and ``ray-hop.md`` (median ms per hop, per round). What it is not: a
Serve handle call (the router and the streaming generator add their own time), nor a loaded node.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from deployments.constants import RAY_SYSTEM_CONFIG

MEL_BINS, MEL_FPS = 80, 50  # a prompt's mel, frames-major float32 (cosyvoice_runtime/voice_prompt.py)


def payload(prompt_s: float) -> dict:
    frames = int(prompt_s * MEL_FPS)
    return {"mel": np.zeros((frames, MEL_BINS), np.float32), "speech_tokens": np.zeros(frames // 2, np.int32)}


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
                out.setdefault(str(prompt_s), []).append(
                    {"return_ms": round(statistics.median(ret), 3), "argument_ms": round(statistics.median(arg), 3)})
        return out
    finally:
        ray.shutdown()


def markdown(result: dict) -> str:
    lines = [(f"# One Ray call per prompt payload: defaults against RAY_SYSTEM_CONFIG ({result['date']}, "
             f"{result['device']})"), "",
             (f"{result['calls']} calls per cell, median ms, {result['rounds']} rounds (one column each); "
             f"two local actors; the mel is {MEL_BINS * MEL_FPS * 4 // 1000} KB a second of prompt. "
             f"Project config: `{result['system_config']}`."), "",
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
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    prompts = [float(x) for x in args.prompts_s.split(",")]
    result = {"date": time.strftime("%Y-%m-%d"), "device": "cpu", "calls": args.calls, "rounds": args.rounds,
              "prompts_s": prompts, "system_config": RAY_SYSTEM_CONFIG,
              "ray_default": measure(None, prompts, args.calls, args.rounds),
              "project": measure(RAY_SYSTEM_CONFIG, prompts, args.calls, args.rounds)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ray-hop.json").write_text(json.dumps(result, indent=1))
    (args.out / "ray-hop.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
