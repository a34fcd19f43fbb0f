"""Which kernels one graphed step costs: the LLM decode step and the incremental flow pass at
the shapes of a stream's first chunk, kernel by kernel, from the profiler's trace.

At one stream, first audio is the sum of ~16 decode steps and 10 flow passes, each a CUDA graph
replay whose time is its kernels in sequence (H100 2026-12-06: ~1.9 ms a step, ~4 ms a pass, the
same for 50 or 256 frames). Compiling did not shorten the step, so before writing fused kernels:
per step, how many kernels of which kind, how long each kind runs, and how much of the step is
no kernel at all, and in front of which kernels that idle time sits (launch gaps inside the
graph, or the host's eager work around it).

    python -m bench.kernel_profile --out bench/results --tag h100

Without CUDA (``--device cpu``, a smoke run on the tiny model) the profiler sees CPU ops, not
kernels: the tables then count top-level ops, which is what the CPU tests check.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import bench.llm_decode_bench as decode_bench
from bench.random_model import DTYPES, cast, make_model, sync
from bench.trace_export import chrome_trace, trace_profiler
from cosyvoice_runtime.flow.flow_cache import FlowCache
from cosyvoice_runtime.flow.graph_setup import enable_flow_graphs
from cosyvoice_runtime.llm.engine import LLMEngine

# First match wins: attention before GEMM (cuDNN's fused attention is named like a GEMM kernel).
CATEGORIES = (
    ("attention", r"sdpa|flash|fmha|attention"),
    ("gemm", r"nvjet|gemm|cutlass|xmma|splitk|cublas|addmm|matmul|\bmm\b|linear"),
    ("convolution", r"conv|cudnn|implicit"),
    ("norm", r"norm"),
    ("copy/index", r"copy|index|gather|scatter|cat|pad|roll|arange"),
    ("sampling", r"sort|topk|multinomial|cumsum|softmax|argmax|exponential|uniform"),
    ("reduction", r"reduce"),
    ("elementwise", r"elementwise|vectorized|unrolled|mish|gelu|silu|add|mul|where|fill"),
)


def category(name: str) -> str:
    """The kind of a kernel (or, on the CPU, an op) by its name; ``other`` when none matches."""
    low = name.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, low)), "other")


def kernel_table(events: list[dict], reps: int, cat: str = "kernel") -> dict:
    """Per-step figures from a Chrome trace's ``events`` covering ``reps`` steps: kernels (events
    of ``cat``) and their time per step, by category and by name (most time first)."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == cat and e.get("dur") is not None:
            by_name[e["name"]].append(float(e["dur"]))
    cats: dict[str, dict] = {}
    for name, durs in by_name.items():
        c = cats.setdefault(category(name), {"count": 0.0, "us": 0.0})
        c["count"] += len(durs) / reps
        c["us"] += sum(durs) / reps
    names = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {
        "kernels_per_step": sum(len(d) for d in by_name.values()) / reps,
        "kernel_us_per_step": sum(sum(d) for d in by_name.values()) / reps,
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1]["us"])),
        "top": [{"name": n[:100], "category": category(n), "per_step": len(d) / reps, "us_per_step": sum(d) / reps,
                 "us_each": sum(d) / len(d)} for n, d in names[:25]],
    }


STREAM_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # what occupies a CUDA stream in the trace


def gap_table(events: list[dict], reps: int, top: int = 12) -> dict:
    """Where a step's time without a kernel sits: each idle stretch of a stream (no kernel, copy or
    memset on it) charged to the kernel that ends it, per step, by that kernel's name (most idle
    time first). Gaps spread evenly over a graph's kernels are launch latency inside the graph;
    gaps in front of a few (the first kernel after the host's eager work, a copy) are the host."""
    by_stream: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in STREAM_CATS and e.get("dur") is not None:
            by_stream[e.get("tid")].append(e)
    gaps: dict[str, list[float]] = defaultdict(list)
    for stream in by_stream.values():
        stream.sort(key=lambda e: float(e["ts"]))
        end = None
        for e in stream:
            ts = float(e["ts"])
            if end is not None and ts > end:
                gaps[e["name"]].append(ts - end)
            end = max(end or ts, ts + float(e["dur"]))
    names = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))
    return {"gap_us_per_step_traced": sum(sum(g) for g in gaps.values()) / reps,
            "gaps_before": [{"name": n[:100], "category": category(n), "per_step": len(g) / reps,
                             "us_per_step": sum(g) / reps, "us_each": sum(g) / len(g)} for n, g in names[:top]]}


def _event_ms(fn, reps: int, cuda: bool) -> float:
    """Median CUDA-event time of ``fn`` (host time without CUDA)."""
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profiled(fn, reps: int, cuda: bool) -> dict:
    """``fn`` timed, then run ``reps`` times under the profiler: its per-step kernel table, with the
    step's time that no kernel covered (``gap_us_per_step``: launches and waits inside the step)."""
    for _ in range(3):
        fn()
    sync()
    event_ms = _event_ms(fn, reps, cuda)
    with trace_profiler(cuda) as prof:
        for _ in range(reps):
            fn()
        sync()
    events = chrome_trace(prof)["traceEvents"]
    table = kernel_table(events, reps, "kernel" if cuda else "cpu_op")
    table["event_ms_per_step"] = event_ms
    table["gap_us_per_step"] = event_ms * 1e3 - table["kernel_us_per_step"] if cuda else None
    if cuda:  # on the CPU the ops nest and run on the host: no stream to be idle
        table.update(gap_table(events, reps))
    return table


def decode_step(args: argparse.Namespace, cuda: bool) -> dict:
    """The graphed LLM decode step (``LLMEngine.step``, sampling and its one sync included)."""
    decode_bench.DEVICE = args.device
    model = decode_bench.build_model("cosyvoice2", DTYPES[args.dtype], tiny=args.size == "tiny")
    model.backbone.fused_norms = args.fused_norms
    n_tokens = 3 + 2 * args.reps + 8
    engine = LLMEngine(model, max_batch_size=max(args.batch, 1), max_seq_len=args.context + n_tokens + 8,
                       max_prefills_per_step=64, use_cuda_graphs=cuda, static_decode=True,
                       compile_backend=args.compile)
    with torch.inference_mode():
        decode_bench.fill(engine, args.batch, args.context, n_tokens, "ras")
        if cuda:
            engine.runner.capture([args.batch])
        return {"batch": args.batch, "context": args.context, "compile": args.compile, "fused_norms": args.fused_norms,
                **profiled(engine.step, args.reps, cuda)}


def flow_pass(args: argparse.Namespace, cuda: bool) -> dict:
    """One graphed incremental flow pass of ``--new`` frames over ``--cached`` ones (a first chunk
    after a voice's cached prompt prefix), both CFG halves."""
    model = cast(make_model(args.family, args.size, args.device), DTYPES[args.dtype])
    flow = model.flow
    enable_flow_graphs(flow, max_batch=max(args.batch, 1), max_frames=args.cached + args.new, incremental=True,
                       use_graphs=cuda, incremental_fused_norms=args.fused_norms)
    stepper = flow.incremental
    dev, dtype = model.device, next(flow.parameters()).dtype
    rows = []
    for _ in range(args.batch):
        cache = FlowCache()
        cache.reserve(args.cached + args.new, stepper.n_steps, stepper.layout, torch.zeros(1, device=dev, dtype=dtype))
        cache.frames = args.cached
        cache.convs = [torch.zeros(2, stepper.layout.conv_channels, stepper.layout.hist, device=dev, dtype=dtype)
                       for _ in range(stepper.n_steps)]
        n_mels = flow.spec.output_size
        rows.append(stepper.new_row(torch.randn(n_mels, args.new, device=dev, dtype=dtype),
                                    torch.zeros(n_mels, args.new, device=dev, dtype=dtype),
                                    torch.randn(n_mels, device=dev, dtype=dtype), cache, keep=args.new))

    def one_pass() -> None:
        for r in rows:
            r.step, r.new_convs = 0, []
        stepper.advance(rows)

    replays, eager = stepper.replays, stepper.eager_calls
    table = profiled(one_pass, args.reps, cuda)
    # whether the passes replayed their graph: an eager fallback launches every kernel from Python
    return {"family": args.family, "batch": args.batch, "cached": args.cached, "new": args.new,
            "fused_norms": args.fused_norms, "graph_replays": stepper.replays - replays,
            "eager_passes": stepper.eager_calls - eager, **table}


BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def markdown(doc: dict) -> str:
    lines = [f"# Kernels per graphed step: {doc['device']}, {doc['dtype']}, {doc['size']} model", "",
             (f"Command: `{doc['command']}`. Per step: kernels (profiler trace over {doc['reps']} steps), CUDA-event "
             "time, and the time no kernel covered (launches and waits inside the step)."), ""]
    for what, t in doc["targets"].items():
        gap = "-" if t["gap_us_per_step"] is None else f"{t['gap_us_per_step']:.0f}"
        lines += [f"## {what}", "",
                  (f"{t['kernels_per_step']:.0f} kernels, {t['kernel_us_per_step']:.0f} us of kernels, "
                  f"{t['event_ms_per_step'] * 1e3:.0f} us a step, {gap} us without a kernel."
                  + (f" Graph replays {t['graph_replays']}, eager passes {t['eager_passes']} (warm-up, timing and "
                     "trace together)." if "graph_replays" in t else "")), "",
                  "| category | kernels per step | us per step |", "|---|---|---|"]
        lines += [f"| {c} | {v['count']:.1f} | {v['us']:.1f} |" for c, v in t["categories"].items()]
        lines += ["", "| kernel | category | per step | us per step | us each |", "|---|---|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['category']} | {k['per_step']:.1f} | {k['us_per_step']:.1f} | "
                  f"{k['us_each']:.2f} |" for k in t["top"]]
        if t.get("gaps_before"):
            lines += ["", (f"Idle stream time in the trace, {t['gap_us_per_step_traced']:.0f} us a step (host time between "
                           "steps included), by the kernel each idle stretch ends at:"), "",
                      "| next kernel | category | gaps per step | us per step | us each |", "|---|---|---|---|---|"]
            lines += [f"| `{k['name']}` | {k['category']} | {k['per_step']:.1f} | {k['us_per_step']:.1f} | "
                      f"{k['us_each']:.2f} |" for k in t["gaps_before"]]
        lines.append("")
    lines += [f"{name}: {err}" for name, err in doc["errors"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--size", default="full", choices=["full", "tiny"])
    ap.add_argument("--what", default="decode,flow", help="comma-separated: decode, flow")
    ap.add_argument("--family", default="cosyvoice2", choices=["cosyvoice2", "cosyvoice3"],
                    help="the flow's estimator (the decode step is CosyVoice2's LLM either way)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--compile", default=None, metavar="BACKEND",
                    help="decode: the step's model part through torch.compile with this backend (inductor), as "
                         "mode torchscript does for the LLM step: which kernels fusing leaves (it did not shorten the step, "
                         "H100 2026-12-06)")
    ap.add_argument("--context", type=int, default=150, help="decode: tokens in the cache")
    ap.add_argument("--fused-norms", action="store_true",
                    help="the Triton add + norm kernels (synthesizer.fused_norms) in the decode step and the flow pass")
    ap.add_argument("--cached", type=int, default=150, help="flow: cached frames (a 3.5 s prompt's first 3 chunks)")
    ap.add_argument("--new", type=int, default=50, help="flow: new frames (one attention chunk)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sdpa", default="default",
                    help="comma-separated attention backends to profile each target under: default (PyTorch's "
                         f"choice), {', '.join(BACKENDS)}; a backend that cannot serve a target is reported as such")
    ap.add_argument("--out", default=None, help="folder for kernel-profile-<tag>.json and .md")
    ap.add_argument("--tag", default="run")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    targets = {"decode": decode_step, "flow": flow_pass}
    doc = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "dtype": args.dtype,
           "size": args.size, "reps": args.reps, "command": "python -m bench.kernel_profile " + " ".join(sys.argv[1:] if argv is None else argv),
           "targets": {}, "errors": {}}
    for what in args.what.split(","):
        if what not in targets:
            raise SystemExit(f"--what: unknown {what!r} (decode, flow)")
        for backend in args.sdpa.split(","):
            name = what if backend == "default" else f"{what} ({backend} attention)"
            try:
                # graphs are captured inside: the backend chosen at capture is the one replayed
                with sdpa_kernel([BACKENDS[backend]]) if backend != "default" else contextlib.nullcontext():
                    doc["targets"][name] = targets[what](args, cuda)
            except RuntimeError as exc:  # e.g. a backend without attention masks
                doc["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(name, "failed:", doc["errors"][name], flush=True)
                continue
            print(name, json.dumps({k: v for k, v in doc["targets"][name].items() if k != "top"}), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"kernel-profile-{args.tag}.json").write_text(json.dumps(doc, indent=1))
        (out / f"kernel-profile-{args.tag}.md").write_text(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
