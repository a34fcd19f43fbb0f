"""GPU measurement behind the one-vs-two synthesizer deployments decision (docs/serving.md).

Full-size CosyVoice2 architecture with random weights (timing only), fp16 LLM + flow, fp32 HiFT:

* ``llm``: decode steps of a 16-sequence running batch (LLMEngine);
* ``flow``: first streaming chunk jobs (flow + HiFT) of 3 s-prompt requests, one at a time;
* ``serial``: both workloads interleaved in one process / thread (the one-deployment layout);
* ``threads``: one process, two threads (LLM and token2wav each on its own CUDA stream);
* ``procs``: two processes on the same GPU at once (what two deployments with num_gpus 0.5 are).

All three with the replica's CUDA graphs (LLM decode, flow solve + encoder, vocoder), as a GPU
replica runs by default; ``--eager`` measures without them.

Run on a GPU machine: ``python -m bench.measure_colocation [--eager]``. The CPU test
runs it on the tiny model with a few steps (``--device cpu --size tiny``) so that a lease is
never spent on a script that fails.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

from cosyvoice_runtime.flow.graph_setup import enable_flow_graphs
from cosyvoice_runtime.voice_prompt import VoicePrompt

BATCH = 16
PROMPT_FRAMES = 150  # LLM prompt length of every measured request


@dataclass(frozen=True)
class Setup:
    device: str = "cuda"
    size: str = "full"  # "tiny": the project's tiny CV2 dimensions (CPU smoke test)
    graphs: bool = True
    steps: int = 300
    flow_jobs: int = 30

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16 if self.device == "cuda" else torch.float32

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def stream(self):
        return torch.cuda.stream(torch.cuda.Stream()) if self.device == "cuda" else contextlib.nullcontext()

    def max_allocated_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / 2**30 if self.device == "cuda" else None


def _build(setup: Setup):
    from cosyvoice_runtime.hift.graphs import graph_streaming_vocoder
    from cosyvoice_runtime.llm.engine import LLMEngine
    from cosyvoice_runtime.model import build_modules
    from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir
    from cosyvoice_runtime.token2wav import Token2Wav

    dims = TINY_DIMS["cosyvoice2"] if setup.size == "tiny" else None
    spec = write_config_dir(tempfile.mkdtemp(), "cosyvoice2", dims)
    torch.manual_seed(0)
    dev, dtype = setup.device, setup.dtype
    mods = build_modules(spec, device=dev)
    llm = mods["llm"].to(dtype).eval().requires_grad_(False)
    flow = mods["flow"].to(dtype).eval().requires_grad_(False)
    hift = mods["hift"].eval().requires_grad_(False)
    if hasattr(hift, "remove_weight_norm"):
        hift.remove_weight_norm()
    # Three phases decode from this engine (alone, serial, two threads): its requests must outlive
    # them all, or the later phases time empty steps.
    n_tokens = 3 * setup.steps + 50
    engine = LLMEngine(llm, max_batch_size=BATCH, max_seq_len=PROMPT_FRAMES + n_tokens + 8,
                       use_cuda_graphs=setup.graphs)
    if setup.graphs and dev == "cuda":  # captured before any other thread or process works, as at replica start
        engine.capture_graphs()
        enable_flow_graphs(flow, max_batch=1, max_frames=512, capture=True)
        graph_streaming_vocoder(hift, spec, max_batch=1)
    for i in range(BATCH):
        emb = torch.randn(PROMPT_FRAMES, spec.llm.llm_input_size, device=dev, dtype=dtype) * 0.02
        engine.add_request(f"r{i}", emb, min_len=n_tokens, max_len=n_tokens)
    t2w = Token2Wav(spec, flow, hift)
    lp = 75
    prompt = VoicePrompt(family=spec.family, text_tokens=torch.zeros(0, dtype=torch.int32).numpy(),
                         speech_tokens=torch.randint(0, spec.llm.speech_token_size, (lp,), dtype=torch.int32).numpy(),
                         mel=torch.randn(2 * lp, spec.flow.output_size).numpy(),
                         embedding=torch.randn(spec.flow.spk_embed_dim).numpy())
    tokens = torch.randint(0, spec.llm.speech_token_size, (200,)).tolist()

    def flow_job():
        state = t2w.new_stream(prompt, stream=True)
        job = t2w.next_job(state, tokens, llm_done=False)
        t2w.run(job)

    for _ in range(5):  # warm-up
        engine.step(), flow_job()
    setup.sync()
    return engine, flow_job


def _still_decoding(engine, phase: str) -> int:
    running = engine.num_running()
    if running < BATCH:
        raise RuntimeError(f"after {phase}: {running} of {BATCH} requests still decoding; the timings are void")
    return running


def _timed(fn, n, sync):
    lat = []
    start = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        fn()
        sync()
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - start, lat


def _ms(lat: list[float]) -> float:
    return 1e3 * statistics.median(lat)


def _worker(kind, setup, barrier, out):
    if setup.device == "cuda":
        torch.cuda.init()
    engine, flow_job = _build(setup)
    barrier.wait()
    if kind == "llm":
        wall, lat = _timed(engine.step, setup.steps, setup.sync)
        _still_decoding(engine, "the LLM process")
    else:
        wall, lat = _timed(flow_job, setup.flow_jobs, setup.sync)
    out.put((kind, wall, statistics.median(lat), setup.max_allocated_gib()))


def measure(setup: Setup) -> dict:
    res: dict = {"gpu": torch.cuda.get_device_name(0) if setup.device == "cuda" else "cpu",
                 "cuda_graphs": setup.graphs, "steps": setup.steps, "flow_jobs": setup.flow_jobs}
    engine, flow_job = _build(setup)
    wall, lat = _timed(engine.step, setup.steps, setup.sync)
    res["llm_alone"] = {"wall_s": wall, "step_ms_median": _ms(lat), "running": _still_decoding(engine, "llm_alone")}
    wall, lat = _timed(flow_job, setup.flow_jobs, setup.sync)
    res["flow_alone"] = {"wall_s": wall, "job_ms_median": _ms(lat)}
    per = max(1, setup.steps // setup.flow_jobs)
    step_lat = []
    t = time.perf_counter()
    for _ in range(setup.flow_jobs):
        for _ in range(per):
            t_step = time.perf_counter()
            engine.step()
            setup.sync()
            step_lat.append(time.perf_counter() - t_step)
        flow_job()
    setup.sync()
    res["serial_one_thread"] = {"wall_s": time.perf_counter() - t, "step_ms_median": _ms(step_lat),
                                "running": _still_decoding(engine, "serial_one_thread"),
                                "step_ms_p95": 1e3 * sorted(step_lat)[int(0.95 * len(step_lat))]}
    lat_llm, lat_flow = [], []

    def lane(fn, n, lat):
        with setup.stream():
            for _ in range(n):
                t_call = time.perf_counter()
                fn()
                setup.sync()
                lat.append(time.perf_counter() - t_call)

    t = time.perf_counter()
    threads = [threading.Thread(target=lane, args=(engine.step, setup.steps, lat_llm)),
               threading.Thread(target=lane, args=(flow_job, setup.flow_jobs, lat_flow))]
    [th.start() for th in threads]
    [th.join() for th in threads]
    res["two_threads_one_process"] = {"wall_s": time.perf_counter() - t, "step_ms_median": _ms(lat_llm),
                                      "running": _still_decoding(engine, "two_threads_one_process"),
                                      "job_ms_median": _ms(lat_flow)}
    res["one_process_max_allocated_gib"] = setup.max_allocated_gib()
    engine = flow_job = None  # free the first model before the two processes start
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(k, setup, barrier, out)) for k in ("llm", "flow")]
    [p.start() for p in procs]
    barrier.wait(timeout=600)
    t = time.perf_counter()
    got = {}
    for _ in procs:
        kind, wall, med, mem = out.get(timeout=600)
        got[kind] = {"wall_s": wall, "median_ms": 1e3 * med, "max_allocated_gib": mem}
    res["two_processes_same_gpu"] = {"wall_s": time.perf_counter() - t, **got}
    [p.join() for p in procs]
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one-vs-two synthesizer deployments on one GPU")
    ap.add_argument("--eager", action="store_true", help="without CUDA graphs")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--size", default="full", choices=["full", "tiny"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--flow-jobs", type=int, default=30)
    a = ap.parse_args(argv)
    setup = Setup(device=a.device, size=a.size, graphs=not a.eager, steps=a.steps, flow_jobs=a.flow_jobs)
    print(json.dumps(measure(setup), indent=1))


if __name__ == "__main__":
    main()
