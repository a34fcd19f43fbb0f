"""What the GPU does before one stream's first audio: the config's deployments in this process
(as ``bench/capacity.py --level synth``), one request at a time under ``torch.profiler``.

Issue 14 asks for first audio <= 80 ms at one stream; the capacity runs measured 110 ms in process
on an H100 (2026-12-05), 65 ms of it token2wav's first chunk. The stage stamps say when each stage
ended on the host; this says what the GPU did meanwhile. Per CUDA stream: kernels and kernel time
between the request's submission and its first audio, and over the whole request; the time no
kernel ran on any stream; the kernels that took the time; kernels per flow pass. Only CUDA activity
is recorded on a GPU (recording every CPU op would slow the host threads being looked at); the
request's submission is placed on the trace's clock through the trace's ``baseTimeNanoseconds``.

With ``--sessions N``, also a few seconds of steady load (the capacity tool's voice-agent
sessions) under the profiler: whether the LLM's and token2wav's kernels run side by side on the GPU
(time with two or more streams busy) or one after the other, which says whether fewer, fuller flow
passes would give the LLM time (the GPU reads 95-98 % busy at capacity, with 3.5 rows per pass).

Writes ``profile-first-audio-<device>-<date>[-tag].{json,md}`` and, with ``--chrome``, the last
request's trace (gzip; Perfetto opens it)::

    FAST_COSY_MODEL_DIR=/tmp/cosyvoice2-full python -m bench.profile_first_audio --config configs/single-gpu.yaml \
        --sessions 56
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from bench.capacity import DEFAULT_MIX, apply_replica_env, describe_served, in_process_target
from bench.capacity_load import Mix, Slo, Workload, closed_loop
from bench.report import slug
from bench.trace_export import chrome_trace, trace_profiler
from bench.workload import add_args, source_from_args
from serve_app.args import AppArgs

logger = logging.getLogger("bench.profile_first_audio")
TOP_KERNELS = 12


def union_ms(spans: list[tuple[float, float]]) -> float:
    """Milliseconds covered by the union of ``(start, end)`` spans in microseconds."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def shared_ms(streams: dict[str, list[tuple[float, float]]]) -> float:
    """Milliseconds during which kernels of two or more streams ran at once (each stream's spans
    merged first: one stream's kernels run one after another)."""
    edges = []
    for spans in streams.values():
        reach = float("-inf")
        for start, end in sorted(spans):
            start = max(start, reach)
            if end > start:
                edges += [(start, 1), (end, -1)]
                reach = end
    total, active, last = 0.0, 0, 0.0
    for t, step in sorted(edges):
        if active >= 2:
            total += t - last
        active, last = active + step, t
    return total / 1e3


def trace_time_us(doc: dict, epoch_ns: int) -> float:
    """``time.time_ns()`` on a Chrome trace's clock: its timestamps are microseconds after
    ``baseTimeNanoseconds`` of the epoch (PyTorch's profiler, checked on the CPU)."""
    if "baseTimeNanoseconds" not in doc:
        raise RuntimeError("the trace has no baseTimeNanoseconds: this torch's profiler puts its events on a "
                           "clock this tool cannot place a request on")
    return (epoch_ns - int(doc["baseTimeNanoseconds"])) / 1e3


def thread_names() -> dict[int, str]:
    """This process's thread names under every id a trace may give a thread: CUPTI's runtime events
    carry the launching thread's pthread id cut to 32 bits (an H100 trace, 2026-12-05), CPU ops its
    native id."""
    names = {}
    for t in threading.enumerate():
        for key in (t.ident, (t.ident or 0) & 0xFFFFFFFF, t.native_id):
            if key is not None:
                names[key] = t.name
    return names


def stream_lanes(events: list[dict], threads: dict[int, str]) -> dict[str, str]:
    """Each stream's lane: the thread that launched most of its kernels (a kernel and the runtime
    call that launched it share a correlation id). Stream ids alone do not say which lane is which:
    an unnamed report once took the LLM's stream for the flow's."""
    launcher = {e["args"]["correlation"]: e.get("tid") for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    votes: dict[str, Counter] = defaultdict(Counter)
    for e in events:
        tid = launcher.get(e.get("args", {}).get("correlation")) if e.get("cat") == "kernel" else None
        if tid is not None:
            votes[str(e["args"].get("stream", "?"))][threads.get(tid, f"thread {tid}")] += 1
    return {stream: count.most_common(1)[0][0] for stream, count in votes.items()}


def summarize(events: list[dict], window: tuple[float, float], lanes: dict[str, str] | None = None) -> dict:
    """The kernels of a Chrome trace's ``events`` inside ``window`` (microseconds, the trace's
    clock; a kernel crossing an edge counts for its part inside): per stream their number, kernel
    time, union of busy time and lane (``lanes``: :func:`stream_lanes`), the time no stream ran
    one, and the kernels that took the most."""
    lanes = lanes or {}
    lo, hi = window
    streams: dict[str, list[tuple[float, float]]] = defaultdict(list)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") != "kernel":
            continue
        start, end = max(e["ts"], lo), min(e["ts"] + e.get("dur", 0.0), hi)
        if end <= start:
            continue
        streams[str(e.get("args", {}).get("stream", "?"))].append((start, end))
        by_name[e["name"]].append(end - start)
    every = [span for spans in streams.values() for span in spans]
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    return {
        "window_ms": (hi - lo) / 1e3,
        "gpu_busy_ms": union_ms(every),
        "gpu_idle_ms": (hi - lo) / 1e3 - union_ms(every),
        "streams_overlap_ms": shared_ms(streams),
        "streams": {s: {"kernels": len(spans), "kernel_ms": sum(b - a for a, b in spans) / 1e3,
                        "busy_ms": union_ms(spans), "lane": lanes.get(s, "?")} for s, spans in sorted(streams.items())},
        "top_kernels": [{"name": name[:90], "count": len(d), "ms": sum(d) / 1e3} for name, d in top],
    }


def profile_request(target, rid: str, audio_s: float, cuda: bool, chrome: Path | None, cpu_ops: bool = False) -> dict:
    """One request under the profiler: its first-audio stages, flow passes and GPU summaries."""
    before = asyncio.run(target.counters())
    with trace_profiler(cuda, cpu_ops) as prof:
        submitted_ns, submitted_s = time.time_ns(), time.perf_counter()
        trace = asyncio.run(target.synthesize(rid, audio_s, submitted_s))
        threads = thread_names()  # now: a step thread that idles long enough ends itself
        if cuda:
            torch.cuda.synchronize()
    after = asyncio.run(target.counters())
    if trace.error:
        raise RuntimeError(f"request {rid} failed: {trace.error}")
    doc = chrome_trace(prof, chrome)
    start = trace_time_us(doc, submitted_ns)
    events = doc["traceEvents"]
    lanes = stream_lanes(events, threads)
    passes = after["flow_passes"] - before["flow_passes"]
    whole = summarize(events, (start, start + 1e6 * (trace.chunk_times_s[-1] - submitted_s)), lanes)
    window = (start, start + 1e6 * trace.ttfa_s)
    return {"request": rid, "ttfa_ms": 1e3 * trace.ttfa_s, "audio_s": trace.audio_s, "stages_ms": trace.stages_ms,
            "flow_passes": passes, "first_audio_us": window, "first_audio": summarize(events, window, lanes),
            "whole_request": whole}


def profile_load(target, sessions: int, seconds: float, base: Workload, cuda: bool) -> dict:
    """``sessions`` closed-loop voice-agent sessions; once they have all started, ``seconds`` of
    them under the profiler. The kernels of that span, and the requests that finished in it. The
    sessions draw from ``base``'s workload (its voice pool is registered when the target is made)."""
    work = Workload(base.mix, seed=base.seed, window_s=seconds + 2.0, ramp_s=3.0, source=base.source)
    prof = trace_profiler(cuda)
    span = {}

    async def drive():
        loop = asyncio.get_running_loop()

        def start():
            span["start_ns"] = time.time_ns()
            prof.start()

        def stop():
            if cuda:
                torch.cuda.synchronize()
            prof.stop()
            span["end_ns"] = time.time_ns()
        # the sessions start over ~ramp_s; the profiled span follows, inside the judged window
        timers = [loop.call_later(work.ramp_s + 1.0, start), loop.call_later(work.ramp_s + 1.0 + seconds, stop)]
        probe = await closed_loop(target, sessions, work, Slo())
        for timer in timers:
            timer.cancel()
        if "start_ns" not in span:
            raise RuntimeError(f"the load of {sessions} sessions stopped before the profiled span began "
                               f"({probe.aborted}): profile fewer sessions")
        if "end_ns" not in span:  # an underrun or a failure ended the load early: the span ends with it
            stop()
        return probe

    before = asyncio.run(target.counters())
    probe = asyncio.run(drive())
    after = asyncio.run(target.counters())
    doc = chrome_trace(prof)
    got = summarize(doc["traceEvents"], (trace_time_us(doc, span["start_ns"]), trace_time_us(doc, span["end_ns"])),
                    stream_lanes(doc["traceEvents"], thread_names()))
    summary = probe.summary(Slo())
    return {"sessions": sessions, "seconds": seconds, "requests": summary["requests"],
            "ttfa_p50_ms": summary["ttfa_p50_ms"], "ttfa_p99_ms": summary["ttfa_p99_ms"],
            "underruns": summary["underruns"], "flow_passes_whole_run": after["flow_passes"] - before["flow_passes"],
            "profiled": got}


def _per_stream(streams: dict, fmt: str) -> str:
    return "; ".join(f"{s} {v.get('lane', '?')}: {v['kernels']}, {v['busy_ms']:{fmt}}" for s, v in streams.items())


def markdown(doc: dict) -> str:
    lines = [f"# What the GPU does before first audio: {doc['config']}, {doc['device']}, {doc['date']}", "",
             (f"Model: {doc['model']}. One request at a time, {doc['audio_s']} s answers, the benchmark's "
             "registered voice; CUDA activity only. `busy`: the union of kernel time on a stream; `idle`: no "
             "kernel on any stream. Streams are the trace's ids, each named by the thread that launched its "
             "kernels (`engine-step`: the LLM; `compute-token2wav`: flow and vocoder)."), "",
             "| request | first audio ms | GPU busy / idle ms before it | per stream: kernels, busy ms | stages ms |",
             "|---|---|---|---|---|"]
    for r in doc["requests"]:
        fa = r["first_audio"]
        per = _per_stream(fa["streams"], ".1f")
        stages = ", ".join(f"{k} {v:.0f}" for k, v in r["stages_ms"].items())
        lines.append(f"| {r['request']} | {r['ttfa_ms']:.1f} | {fa['gpu_busy_ms']:.1f} / {fa['gpu_idle_ms']:.1f} | "
                     f"{per} | {stages} |")
    lines += ["", "Whole requests (all their chunks):", "",
              "| request | audio s | flow passes | GPU busy / idle ms | per stream: kernels, busy ms | token2wav kernels per pass (vocoder and encoder included) |",
              "|---|---|---|---|---|---|"]
    for r in doc["requests"]:
        w = r["whole_request"]
        per = _per_stream(w["streams"], ".1f")
        flow = [v["kernels"] for v in w["streams"].values() if "token2wav" in v.get("lane", "")]
        per_pass = f"{flow[0] / r['flow_passes']:.0f}" if len(flow) == 1 and r["flow_passes"] else "-"
        lines.append(f"| {r['request']} | {r['audio_s']:.2f} | {r['flow_passes']:.0f} | {w['gpu_busy_ms']:.1f} / "
                     f"{w['gpu_idle_ms']:.1f} | {per} | {per_pass} |")
    if load := doc.get("load"):
        got = load["profiled"]
        lines += ["", (f"Under load: {load['sessions']} sessions, {got['window_ms']:.0f} ms profiled once all had "
                  f"started ({load['requests']} requests judged over the run: first audio p50 / p99 "
                  f"{load['ttfa_p50_ms']:.0f} / {load['ttfa_p99_ms']:.0f} ms, {load['underruns']} underruns). "
                  "`two or more streams busy`: kernels of several streams at once; near zero, the lanes take "
                  "turns on the GPU."), "",
                  "| GPU busy ms | idle ms | two or more streams busy ms | per stream: kernels, busy ms |",
                  "|---|---|---|---|",
                  f"| {got['gpu_busy_ms']:.0f} | {got['gpu_idle_ms']:.0f} | {got['streams_overlap_ms']:.0f} | "
                  + _per_stream(got["streams"], ".0f") + " |",
                  "", "| kernel (under load) | count | ms |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['count']} | {k['ms']:.1f} |" for k in got["top_kernels"]]
    last = doc["requests"][-1]["first_audio"]["top_kernels"]
    lines += ["", "Kernels that took the most time before the last request's first audio:", "",
              "| kernel | count | ms |", "|---|---|---|"]
    lines += [f"| `{k['name']}` | {k['count']} | {k['ms']:.2f} |" for k in last]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/single-gpu.yaml")
    ap.add_argument("--requests", type=int, default=4, help="profiled requests, one at a time, after one warm-up")
    ap.add_argument("--audio-s", type=float, default=6.0, help="audio per answer (the capacity mix's text)")
    ap.add_argument("--chrome", action="store_true", help="also write the last request's Chrome trace (gzip)")
    ap.add_argument("--cpu-ops", action="store_true", help="on a GPU, profile the requests' CPU ops too (the trace)")
    ap.add_argument("--sessions", type=int, default=0, help="also profile steady load of this many sessions")
    ap.add_argument("--load-seconds", type=float, default=3.0, help="seconds of that load under the profiler")
    ap.add_argument("--mix", default=DEFAULT_MIX, help="synthetic workload: the load's utterance lengths")
    ap.add_argument("--seed", type=int, default=0, help="the load's workload seed")
    add_args(ap)  # the load's workload, as the capacity tool's (production by default)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    apply_replica_env(Path(args.config))
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    date = dt.date.today().isoformat()
    stem = f"profile-first-audio-{slug(device)}-{date}" + (f"-{args.tag}" if args.tag else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mix = Mix.parse(args.mix)
    work = Workload(mix, seed=args.seed, source=source_from_args(args, mix))
    target = in_process_target(AppArgs.from_file(args.config), work)
    try:
        asyncio.run(target.synthesize("warm-up", args.audio_s, time.perf_counter()))
        rows = []
        for i in range(args.requests):
            chrome = out / f"{stem}-trace.json.gz" if args.chrome and i == args.requests - 1 else None
            rows.append(profile_request(target, f"profile-{i}", args.audio_s, cuda, chrome, args.cpu_ops))
            logger.info("request %d: first audio %.1f ms, GPU busy %.1f ms before it", i, rows[-1]["ttfa_ms"],
                        rows[-1]["first_audio"]["gpu_busy_ms"])
        load = profile_load(target, args.sessions, args.load_seconds, work, cuda) if args.sessions else None
        model, _ = describe_served({"mode": target.synth.mode, "runtime": target.synth.runtime.details})
    finally:
        target.close()
    doc = {"device": device, "date": date, "config": args.config, "audio_s": args.audio_s, "model": model,
           "requests": rows, "load": load, "load_workload": work.source.describe() if load else None}
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{stem}.md").write_text(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
