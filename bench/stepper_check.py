"""GPU check of the step-by-step flow solve (cosyvoice_runtime.flow.stepper) before a capacity
run leans on it: graphed stepper vs graphed whole solve on the full-size model (max error per
job), and the time of one pass per (batch, frames) bucket against one whole solve.

With ``--incremental`` (CosyVoice2) also the incremental pass (cosyvoice_runtime.flow.incremental):
a graphed two-job stream against the whole solve of the same tokens (max error), and the time of
one pass of ``--new`` frames over each cached length against the recomputed pass over
cached + new frames (what each replaces); ``--flow-compile inductor`` compiles that pass first.

    python -m bench.stepper_check --family cosyvoice2 --device cuda --incremental --out /tmp/stepper.json
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from bench.random_model import DTYPES, cast, make_model, sync
from cosyvoice_runtime.flow.flow import FlowItem
from cosyvoice_runtime.flow.flow_cache import FlowCache
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


def _timed(fn, reps: int = 5) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="cosyvoice2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--size", default="full", choices=["full", "tiny"])
    ap.add_argument("--frames", default="256,640,1024", help="timed frame lengths")
    ap.add_argument("--incremental", action="store_true", help="CosyVoice2: check and time the incremental pass too")
    ap.add_argument("--cached", default="0,512,1024", help="timed cached lengths of the incremental pass")
    ap.add_argument("--new", type=int, default=128, help="new frames of the timed incremental pass")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--flow-compile", default=None, metavar="BACKEND",
                    help="the incremental pass through torch.compile with this backend (inductor), as "
                         "token2wav.flow_compile does; graphed either way")
    ap.add_argument("--fused-norms", action="store_true",
                    help="the incremental pass with the Triton add + LayerNorm kernels (synthesizer.fused_norms)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model = cast(make_model(args.family, args.size, args.device), DTYPES[args.dtype])
    flow = model.flow
    cached = [int(c) for c in args.cached.split(",")]
    # the recomputed passes the incremental ones are timed against (cached + new frames) are graphed too
    max_frames = max(1024, max(cached) + args.new) if args.incremental else 1024
    enable_flow_graphs(flow, max_batch=16, max_frames=max_frames, stepper=True, incremental=args.incremental,
                       incremental_compile=args.flow_compile, incremental_fused_norms=args.fused_norms)
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
    batches = [int(b) for b in args.batches.split(",")]
    for b in batches:
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
    doc = {"family": args.family, "dtype": args.dtype, "flow_compile": args.flow_compile,
           "fused_norms": args.fused_norms, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "max_err_per_job": errors, "output_scale": scale, "replays": flow.stepper.replays,
           "eager_passes": flow.stepper.eager_calls, "timing": timing}
    if args.incremental:
        doc["incremental"] = _incremental(model, batches, cached, args.new)
    print(json.dumps(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def _incremental(model, batches: list[int], cached_lengths: list[int], new: int) -> dict:
    """Exactness of a graphed incremental stream (a first job, then the final one) against the
    whole solve of the final job's tokens, and the pass timing table."""
    flow = model.flow
    la = flow.spec.pre_lookahead_len
    errors = []
    for seed in range(4):
        item = _items(model, 1, seed=100 + seed)[0]
        n_tok = item.token.shape[1]
        first = FlowItem(item.token[:, :n_tok // 2 + la], item.prompt_token, item.prompt_feat, item.embedding,
                         streaming=True, finalize=False)
        final = FlowItem(item.token, item.prompt_token, item.prompt_feat, item.embedding, streaming=True, finalize=True)
        cache, mels = FlowCache(), []
        for job in (first, final):
            row = flow.start_incremental_rows([job], [cache], [None])[0]
            flow.incremental.solve([row])
            mels.append(row.x[None].float()[:, :, :row.keep or row.frames])
            row.commit()
        whole = flow.inference_batch([final])[0]
        got = torch.cat(mels, dim=-1)[:, :, item.prompt_feat.shape[1]:]
        errors.append(float((got - whole).abs().max()))
    dev, dtype = model.device, next(flow.parameters()).dtype
    n_mels, stepper = flow.spec.output_size, flow.incremental
    timing = []
    for b in batches:
        for cached in cached_lengths:
            rows = []
            for _ in range(b):
                cache = FlowCache()
                cache.reserve(cached + new, stepper.n_steps, stepper.layout, torch.zeros(1, device=dev, dtype=dtype))
                cache.frames = cached
                cache.convs = [torch.zeros(2, stepper.layout.conv_channels, stepper.layout.hist, device=dev, dtype=dtype)
                               for _ in range(stepper.n_steps)]
                rows.append(stepper.new_row(torch.randn(n_mels, new, device=dev, dtype=dtype),
                                            torch.zeros(n_mels, new, device=dev, dtype=dtype),
                                            torch.randn(n_mels, device=dev, dtype=dtype), cache, keep=new))
            recompute = flow.start_rows(_items(model, b, seed=cached + b), list(range(b)))
            for r in recompute:  # the recomputed row this pass replaces: cached + new frames
                r.mu = r.mu[:, :1].repeat(1, cached + new)
                r.cond, r.x = r.cond[:, :1].repeat(1, cached + new), r.x[:, :1].repeat(1, cached + new)

            def inc_pass(rows=rows):
                for r in rows:
                    r.step, r.new_convs = 0, []
                stepper.advance(rows)

            def full_pass(rows=recompute):
                for r in rows:
                    r.step = 0
                flow.stepper.advance(rows)

            timing.append({"batch": b, "cached": cached, "new": new, "incremental_pass_ms": round(_timed(inc_pass), 2),
                           "recomputed_pass_ms": round(_timed(full_pass), 2)})
    return {"max_err_per_stream": errors, "replays": stepper.replays, "eager_passes": stepper.eager_calls,
            "graphs": stepper.num_graphs, "compiled": stepper.compiled, "timing": timing}


if __name__ == "__main__":
    main()
