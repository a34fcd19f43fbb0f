"""GPU measurement behind the one-vs-two synthesizer deployments decision (docs/serving.md).

Full-size CosyVoice2 architecture with random weights (timing only), fp16 LLM + flow, fp32 HiFT:

* ``llm``: decode steps of a 16-sequence running batch (LLMEngine);
* ``flow``: first streaming chunk jobs (flow + HiFT) of 3 s-prompt requests, one at a time;
* ``serial``: both workloads interleaved in one process / thread (the one-deployment layout);
* ``threads``: one process, two threads (LLM and token2wav each on its own CUDA stream);
* ``procs``: two processes on the same GPU at once (what two deployments with num_gpus 0.5 are).

Run on a GPU machine: ``python -m tests.integration.measure_colocation``.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import tempfile
import threading
import time

import torch

STEPS = 300
FLOW_JOBS = 30
BATCH = 16


def _build(device: str):
    from cosyvoice_runtime.llm.engine import LLMEngine
    from cosyvoice_runtime.model import build_modules
    from cosyvoice_runtime.tiny_model import write_config_dir
    from cosyvoice_runtime.token2wav import FlowPrompt, Token2Wav

    spec = write_config_dir(tempfile.mkdtemp(), "cosyvoice2")
    torch.manual_seed(0)
    mods = build_modules(spec, device=device)
    llm = mods["llm"].to(torch.float16).eval().requires_grad_(False)
    flow = mods["flow"].to(torch.float16).eval().requires_grad_(False)
    hift = mods["hift"].eval().requires_grad_(False)
    if hasattr(hift, "remove_weight_norm"):
        hift.remove_weight_norm()
    engine = LLMEngine(llm, max_batch_size=BATCH, max_seq_len=1024)
    for i in range(BATCH):
        emb = torch.randn(150, spec.llm.llm_input_size, device=device, dtype=torch.float16) * 0.02
        engine.add_request(f"r{i}", emb, min_len=800, max_len=800)
    t2w = Token2Wav(spec, flow, hift)
    lp = 75
    prompt = FlowPrompt(tokens=torch.randint(0, 6561, (1, lp), dtype=torch.int32, device=device),
                        feat=torch.randn(1, 2 * lp, 80, device=device, dtype=torch.float16),
                        embedding=torch.randn(1, 192, device=device, dtype=torch.float16))
    tokens = torch.randint(0, 6561, (200,)).tolist()

    def flow_job():
        state = t2w.new_stream(prompt, stream=True)
        job = t2w.next_job(state, tokens, llm_done=False)
        t2w.run(job)

    return engine, flow_job


def _timed(fn, n, sync):
    lat = []
    start = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        fn()
        sync()
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - start, lat


def _worker(kind, barrier, out):
    torch.cuda.init()
    engine, flow_job = _build("cuda")
    sync = torch.cuda.synchronize
    for _ in range(5):
        engine.step(), flow_job()
    sync()
    barrier.wait()
    if kind == "llm":
        wall, lat = _timed(engine.step, STEPS, sync)
    else:
        wall, lat = _timed(flow_job, FLOW_JOBS, sync)
    out.put((kind, wall, statistics.median(lat), torch.cuda.max_memory_allocated()))


def main() -> None:
    res: dict = {"gpu": torch.cuda.get_device_name(0)}
    engine, flow_job = _build("cuda")
    sync = torch.cuda.synchronize
    for _ in range(5):
        engine.step(), flow_job()
    sync()
    wall, lat = _timed(engine.step, STEPS, sync)
    res["llm_alone"] = {"wall_s": wall, "step_ms_median": 1e3 * statistics.median(lat)}
    wall, lat = _timed(flow_job, FLOW_JOBS, sync)
    res["flow_alone"] = {"wall_s": wall, "job_ms_median": 1e3 * statistics.median(lat)}
    per = STEPS // FLOW_JOBS
    step_lat = []

    def serial():
        for _ in range(FLOW_JOBS):
            for _ in range(per):
                t = time.perf_counter()
                engine.step()
                sync()
                step_lat.append(time.perf_counter() - t)
            flow_job()
        sync()

    t = time.perf_counter()
    serial()
    res["serial_one_thread"] = {"wall_s": time.perf_counter() - t, "step_ms_median": 1e3 * statistics.median(step_lat),
                                "step_ms_p95": 1e3 * sorted(step_lat)[int(0.95 * len(step_lat))]}
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    lat_llm, lat_flow = [], []

    def run_llm():
        with torch.cuda.stream(s1):
            for _ in range(STEPS):
                t = time.perf_counter()
                engine.step()
                s1.synchronize()
                lat_llm.append(time.perf_counter() - t)

    def run_flow():
        with torch.cuda.stream(s2):
            for _ in range(FLOW_JOBS):
                t = time.perf_counter()
                flow_job()
                s2.synchronize()
                lat_flow.append(time.perf_counter() - t)

    t = time.perf_counter()
    threads = [threading.Thread(target=run_llm), threading.Thread(target=run_flow)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    res["two_threads_one_process"] = {"wall_s": time.perf_counter() - t,
                                      "step_ms_median": 1e3 * statistics.median(lat_llm),
                                      "job_ms_median": 1e3 * statistics.median(lat_flow)}
    res["one_process_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    engine = flow_job = None  # free the first model before the two processes start
    torch.cuda.empty_cache()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(k, barrier, out)) for k in ("llm", "flow")]
    [p.start() for p in procs]
    barrier.wait()
    t = time.perf_counter()
    got = {}
    for _ in procs:
        kind, wall, med, mem = out.get(timeout=600)
        got[kind] = {"wall_s": wall, "median_ms": 1e3 * med, "max_allocated_gib": mem / 2**30}
    res["two_processes_same_gpu"] = {"wall_s": time.perf_counter() - t, **got}
    [p.join() for p in procs]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
