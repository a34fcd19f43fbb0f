"""GPU check of the step-by-step flow solve (cosyvoice_runtime.flow.stepper) before a capacity
run leans on it: graphed stepper vs graphed whole solve on the full-size model (max error per
job), and the time of one pass per (batch, frames) bucket against one whole solve.

    python -m bench.stepper_check --family cosyvoice2 --device cuda --out /tmp/stepper.json
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from bench.gpu_bench import DTYPES, cast, make_model
from cosyvoice_runtime.flow.flow import FlowItem
from cosyvoice_runtime.flow.graph_setup import enable_flow_graphs


def _items(model, n: int, seed: int) -> list[FlowItem]:
    gen = torch.Generator().manual_seed(seed)
    spec = model.spec.flow
    dev = model.device
    out = []
    for _ in range(n):
        n_prompt, n_tok = 87, int(torch.randint(20, 400, (1,), generator=gen))
        out.append(FlowItem(
            token=torch.randint(0, spec.vocab_size, (1, n_tok), generator=gen, dtype=torch.int32).to(dev),
            prompt_token=torch.randint(0, spec.vocab_size, (1, n_prompt), generator=gen, dtype=torch.int32).to(dev),
            prompt_feat=torch.randn(1, 2 * n_prompt, spec.output_size, generator=gen).to(dev),
            embedding=torch.randn(1, spec.spk_embed_dim, generator=gen).to(dev),
            streaming=True, finalize=bool(torch.rand(1, generator=gen) < 0.3)))
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, reps: int = 5) -> float:
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync()
    return (time.perf_counter() - t0) / reps * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="cosyvoice2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--size", default="full", choices=["full", "tiny"])
    ap.add_argument("--frames", default="256,640,1024", help="timed frame lengths")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model = cast(make_model(args.family, args.size, args.device), DTYPES[args.dtype])
    flow = model.flow
    enable_flow_graphs(flow, max_batch=16, max_frames=1024, stepper=True)
    items = _items(model, 8, seed=3)
    whole = flow.inference_batch(items)
    rng = random.Random(1)
    live, waiting, done = [], list(range(len(items))), {}
    steps = flow.spec.n_timesteps
    while waiting or live:
        if waiting and (not live or rng.random() < 0.5):
            i = waiting.pop(0)
            live += flow.start_rows([items[i]], [i])
        batch = rng.sample(live, rng.randint(1, len(live)))
        flow.stepper.advance(batch)
        for row in [r for r in live if r.step == steps]:
            live.remove(row)
            done[row.tag] = flow.row_mel(row, items[row.tag].prompt_feat.shape[1])
    errors = [float((done[i] - w).abs().max()) for i, w in enumerate(whole)]
    scale = max(float(w.abs().max()) for w in whole)
    timing = []
    for b in (1, 4, 16):
        for frames in [int(f) for f in args.frames.split(",")]:
            base = _items(model, b, seed=frames + b)
            for it in base:  # force the length: prompt + tokens = frames / 2
                it.token = it.token[:, :1].repeat(1, frames // 2 - it.prompt_token.shape[1])
            rows = flow.start_rows(base, list(range(b)))

            def one_pass(rows=rows):
                for r in rows:
                    r.step = 0
                flow.stepper.advance(rows)

            pass_ms = _timed(one_pass)
            solve_ms = _timed(lambda base=base: flow.inference_batch(base))
            timing.append({"batch": b, "frames": frames, "pass_ms": round(pass_ms, 2), "whole_solve_ms": round(solve_ms, 2)})
    doc = {"family": args.family, "dtype": args.dtype, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "max_err_per_job": errors, "output_scale": scale, "replays": flow.stepper.replays,
           "eager_passes": flow.stepper.eager_calls, "timing": timing}
    print(json.dumps(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
