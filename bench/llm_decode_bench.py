"""LLM decode step on GPU: CUDA-graph runner vs eager, full-size random-weight LLM.

Checks graphs == eager on CUDA (full-size model, greedy), then times ``LLMEngine.step()`` (the
whole decode step: host prep, model, sampling, the one sync) for several batch sizes, eager vs
graphs, in fp32 and bf16. Each timed step is a decode-only step of B running requests (all
prefilled before timing). Reports the median wall time per step (host clock, the step ends
with a sync) and the median CUDA-event time.

    python -m bench.llm_decode_bench --out results.json
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
import traceback

import torch

from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.model import build_llm
from cosyvoice_runtime.llm.sampling import SamplingParams
from cosyvoice_runtime.tiny_model import write_config_dir

logger = logging.getLogger("llm_decode_bench")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


DEVICE = "cuda"


def build_model(family: str, dtype: torch.dtype, tiny: bool = False):
    from cosyvoice_runtime.tiny_model import TINY_DIMS

    with tempfile.TemporaryDirectory() as tmp:
        spec = write_config_dir(tmp, family, TINY_DIMS[family] if tiny else None)
    torch.manual_seed(0)
    with torch.device(DEVICE):  # random init on the GPU: seconds instead of a minute on the CPU
        model = build_llm(spec.llm)
    return model.to(dtype).eval()


class _Timer:
    """CUDA events on CUDA, nothing on the CPU (smoke runs)."""

    def __init__(self) -> None:
        cuda = DEVICE == "cuda"
        self.a = torch.cuda.Event(enable_timing=True) if cuda else None
        self.b = torch.cuda.Event(enable_timing=True) if cuda else None

    def start(self) -> None:
        if self.a is not None:
            self.a.record()

    def stop(self) -> float:
        if self.a is None:
            return 0.0
        self.b.record()
        self.b.synchronize()
        return self.a.elapsed_time(self.b)


def fill(engine: LLMEngine, batch: int, prompt_len: int, n_tokens: int, sampling: str, seed: int = 0) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    h = engine.spec.llm_input_size
    for i in range(batch):
        x = torch.randn(prompt_len, h, device=DEVICE, generator=g, dtype=engine.cache.dtype)
        params = SamplingParams(method="greedy") if sampling == "greedy" else \
            SamplingParams.from_spec(engine.spec, seed=1000 + i)
        engine.add_request(f"r{i}", x, n_tokens, n_tokens, params)
    engine.step()  # prefills every request (max_prefills_per_step >= batch)
    assert engine.num_running() == batch and engine.num_waiting() == 0


def time_steps(engine: LLMEngine, warmup: int, steps: int) -> dict:
    for _ in range(warmup):
        engine.step()
    walls, gpus = [], []
    for _ in range(steps):
        timer = _Timer()
        t0 = time.perf_counter()
        timer.start()
        engine.step()
        gpus.append(timer.stop())
        walls.append((time.perf_counter() - t0) * 1e3)
    return {"wall_ms": statistics.median(walls), "event_ms": statistics.median(gpus),
            "wall_p90_ms": sorted(walls)[int(0.9 * len(walls))]}


def check_equal(model, dtype_name: str, batch: int = 4, n: int = 24) -> dict:
    """Graph engine vs eager engine: same greedy tokens, logits close (full-size model)."""
    out = []
    for graphs in (False, True):
        engine = LLMEngine(model, max_batch_size=8, max_seq_len=512, return_logits=True, use_cuda_graphs=graphs, static_decode=graphs)
        g = torch.Generator(device=DEVICE).manual_seed(5)
        lens = [17, 150, 60, 231][:batch]
        toks, logits = {}, {}
        for i, ln in enumerate(lens):
            x = torch.randn(ln, model.spec.llm_input_size, device=DEVICE, generator=g, dtype=engine.cache.dtype)
            params = SamplingParams(method="greedy") if i % 2 else SamplingParams.from_spec(model.spec, seed=i)
            engine.add_request(f"q{i}", x, n, n, params)
            toks[f"q{i}"], logits[f"q{i}"] = [], []
        while engine.has_unfinished():
            for ev in engine.step():
                logits[ev.request_id].append(ev.logits.float())
                toks[ev.request_id].extend(ev.tokens)
        out.append((toks, {k: torch.stack(v) for k, v in logits.items()}))
    (te, le), (tg, lg) = out
    agree = sum(a == b for r in te for a, b in zip(te[r], tg[r])) / sum(len(v) for v in te.values())
    # compare logits only up to the first divergence of each request (after it, inputs differ)
    diffs = []
    for r in te:
        k = next((i for i, (a, b) in enumerate(zip(te[r], tg[r])) if a != b), len(te[r]))
        k = min(k + 1, len(le[r]))
        diffs.append(float((le[r][:k] - lg[r][:k]).abs().max()))
    return {"dtype": dtype_name, "token_agreement": agree, "max_logit_diff_before_divergence": max(diffs),
            "exact": te == tg}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="llm_decode.json")
    ap.add_argument("--family", default="cosyvoice2")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--long-prompt-len", type=int, default=900)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cuda", help="cpu: smoke run of the script itself")
    ap.add_argument("--tiny", action="store_true", help="the tiny architecture (smoke runs)")
    ap.add_argument("--compile", default=None, metavar="BACKEND",
                    help="also time the graphed step compiled with this torch.compile backend (inductor), "
                         "as mode torchscript does for the LLM step")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    batches = [int(b) for b in args.batches.split(",")]
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "compile": args.compile, "checks": [], "timings": [], "errors": []}
    n_tokens = args.warmup + args.steps + 4
    # eager, graphed, and with --compile graphed over the compiled step (its first steps compile)
    variants = [(False, None), (True, None)] + ([(True, args.compile)] if args.compile else [])
    for dname in args.dtypes.split(","):
        model = build_model(args.family, DTYPES[dname], args.tiny)
        with torch.inference_mode():
            try:
                result["checks"].append(check_equal(model, dname))
                logger.info("check %s", result["checks"][-1])
            except Exception:  # noqa: BLE001  (report everything in one run)
                result["errors"].append(f"check {dname}: {traceback.format_exc()}")
                logger.error(result["errors"][-1])
            for prompt_len in (args.prompt_len, args.long_prompt_len):
                for b in batches:
                    if prompt_len == args.long_prompt_len and b != batches[-1]:
                        continue  # the long-context point only at the largest batch
                    for graphs, backend in variants:
                        for sampling in ("ras",):
                            try:
                                engine = LLMEngine(model, max_batch_size=max(batches), max_seq_len=prompt_len + n_tokens + 8,
                                                   max_prefills_per_step=64, use_cuda_graphs=graphs, static_decode=graphs,
                                                   compile_backend=backend)
                                fill(engine, b, prompt_len, n_tokens, sampling)
                                t0 = time.perf_counter()
                                # All buckets once (the serving-startup cost), else this batch's only.
                                full = prompt_len == args.long_prompt_len
                                n_graphs = 0 if not graphs else engine.capture_graphs() if full else \
                                    engine.runner.capture([b])
                                cap_s = time.perf_counter() - t0
                                row = {"dtype": dname, "batch": b, "prompt_len": prompt_len, "graphs": graphs,
                                       "compile": backend,
                                       "sampling": sampling, **time_steps(engine, args.warmup, args.steps),
                                       "graphs_captured": n_graphs, "capture_s": round(cap_s, 2)}
                                result["timings"].append(row)
                                logger.info("%s", row)
                                del engine
                            except Exception:  # noqa: BLE001
                                result["errors"].append(f"time {dname} b={b} graphs={graphs} compile={backend}: "
                                                        f"{traceback.format_exc()}")
                                logger.error(result["errors"][-1])
                            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    logger.info("%-5s %-6s %-6s %-7s %-8s %10s %10s", "dtype", "batch", "ctx", "graphs", "compile", "wall ms", "event ms")
    for r in result["timings"]:
        logger.info("%-5s %-6d %-6d %-7s %-8s %10.3f %10.3f", r["dtype"], r["batch"], r["prompt_len"], r["graphs"],
                    r["compile"] or "-", r["wall_ms"], r["event_ms"])
    logger.info("errors: %d", len(result["errors"]))
    with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
        f.write(markdown(result))
    return result


def markdown(result: dict) -> str:
    """The result as a markdown table (eager, graphs and, if timed, compiled graphs side by side)."""
    lines = [f"Device: {result['device']}, torch {result['torch']}", "",
             ("| dtype | batch | context | eager ms/step | graphs ms/step | speed-up | graphs event ms | graphs p90 ms "
             "| compiled graphs ms/step | compiled event ms |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = {(r["dtype"], r["batch"], r["prompt_len"], r["graphs"], r.get("compile")): r for r in result["timings"]}
    for (d, b, c, g, _), r in rows.items():
        if g:
            continue
        gr = rows.get((d, b, c, True, None))
        cr = rows.get((d, b, c, True, result.get("compile"))) if result.get("compile") else None
        compiled = f"{cr['wall_ms']:.3f} | {cr['event_ms']:.3f}" if cr else "- | -"
        if gr is None:
            lines.append(f"| {d} | {b} | {c} | {r['wall_ms']:.2f} | - | - | - | - | {compiled} |")
        else:
            lines.append(f"| {d} | {b} | {c} | {r['wall_ms']:.2f} | {gr['wall_ms']:.3f} | "
                         f"{r['wall_ms'] / gr['wall_ms']:.1f}x | {gr['event_ms']:.3f} | {gr['wall_p90_ms']:.3f} | {compiled} |")
    lines += ["", "Checks (graphs vs eager engine, full-size model, 24 steps, 2 greedy + 2 RAS requests):", ""]
    lines += [f"- {c}" for c in result["checks"]]
    lines += [f"- capture: {r['graphs_captured']} graphs in {r['capture_s']} s ({r['dtype']})"
              for r in result["timings"] if r["graphs"] and r["graphs_captured"] > 7]
    if result["errors"]:
        lines += ["", "Errors:", ""] + [f"```\n{e}\n```" for e in result["errors"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
