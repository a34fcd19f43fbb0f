"""Where the time of one streaming request goes, stage by stage, on one GPU.

Full-size architecture, random weights, the benchmark's zero-shot shapes. Each stage is timed
alone (warm, synchronised, median of several runs): LLM prefill and decode step, flow encoder,
one estimator call (wall clock and GPU time), a whole flow call, and the vocoder; plus a
``torch.profiler`` table of one first-chunk flow call. Writes ``<out>.json`` and ``<out>.md``.

    python -m bench.profile_stages --out bench/results/profile-<device>-<date>
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu_bench import DTYPES, PROMPT_SPEECH, TEXT, cast, make_model, make_voice
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.inputs import build_lm_input
from cosyvoice_runtime.llm.sampling import SamplingParams
from cosyvoice_runtime.token2wav import Token2Wav, prompt_token_pad


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> dict:
    """Median / min wall ms and median GPU ms (CUDA events) of ``fn`` over ``reps`` warm runs."""
    fn()
    torch.cuda.synchronize(device)
    wall, gpu = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        wall.append((time.perf_counter() - t0) * 1e3)
        gpu.append(start.elapsed_time(end))
    return {"wall_ms": statistics.median(wall), "wall_min_ms": min(wall), "gpu_ms": statistics.median(gpu)}


def llm_stages(model, voice, text, graphs: bool) -> dict:
    out = {}
    for batch in (1, 16):
        eng = LLMEngine(model.llm, max_batch_size=batch, max_seq_len=400, use_cuda_graphs=graphs)
        if graphs:
            eng.capture_graphs()
        lm = build_lm_input(model.llm, text, voice.prompt_text_ids, voice.llm_prompt_speech_ids)
        params = SamplingParams.from_spec(model.spec.llm, seed=1)
        for i in range(batch):
            eng.add_request(f"r{i}", lm.embeds, 200, 200, params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while eng.num_running() < batch or eng.num_waiting():
            eng.step()
        torch.cuda.synchronize()
        out[f"prefill_b{batch}_ms"] = (time.perf_counter() - t0) * 1e3
        steps = []
        for _ in range(60):
            t0 = time.perf_counter()
            eng.step()
            steps.append((time.perf_counter() - t0) * 1e3)
        out[f"decode_step_b{batch}_ms"] = statistics.median(steps[10:])
    out["prompt_positions"] = int(lm.embeds.shape[0])
    return out


def flow_stages(model, voice, reps: int) -> dict:
    t2w = Token2Wav(model.spec, model.flow, model.hift)
    spec = model.spec
    first = spec.stream.token_hop_len + prompt_token_pad(PROMPT_SPEECH, spec.stream.token_hop_len) + spec.flow.pre_lookahead_len
    out = {"first_chunk_tokens": first}
    dev = model.device
    g = torch.Generator().manual_seed(3)

    def jobs(n_tokens: int, batch: int):
        states = [t2w.new_stream(voice.flow, stream=True) for _ in range(batch)]
        toks = torch.randint(0, spec.llm.speech_token_size, (n_tokens,), generator=g).tolist()
        return [t2w.next_job(s, toks, llm_done=False) for s in states], states

    for batch in (1, 16):
        js, _ = jobs(first, batch)
        items = [t2w._flow_item(j) for j in js]
        out[f"encode_b{batch}"] = timed(lambda items=items: model.flow.encode(items), reps, dev)
        out[f"flow_first_b{batch}"] = timed(lambda js=js: t2w.flow_mels(js), reps, dev)
    # one estimator call at the first-chunk shape (CFG doubles the batch)
    est = model.flow.decoder.estimator
    frames = 2 * (PROMPT_SPEECH + first - spec.flow.pre_lookahead_len)
    for batch in (1, 16):
        b = 2 * batch
        dtype = next(est.parameters()).dtype
        x = torch.randn(b, 80, frames, device=dev, dtype=dtype)
        mask = torch.ones(b, 1, frames, device=dev, dtype=dtype)
        t = torch.rand(b, device=dev, dtype=dtype)
        spks = torch.randn(b, 80, device=dev, dtype=dtype)
        args = (x, mask, x.clone(), t, spks, x.clone(), True)
        with torch.inference_mode():
            out[f"estimator_b{b}_T{frames}_eager"] = timed(lambda args=args: est(*args), reps, dev)
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                est(*args)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                est(*args)
            out[f"estimator_b{b}_T{frames}_graph"] = timed(graph.replay, reps, dev)
    # vocoder: first chunk of one stream (fresh state each run)
    js, _ = jobs(first, 1)
    mel = t2w.flow_mels(js)[0]

    def vocode_first():
        st = t2w.new_stream(voice.flow, stream=True)
        job = t2w.next_job(st, js[0].tokens[0].tolist(), llm_done=False)
        t2w.vocode(job, mel)

    out["vocode_first_chunk"] = timed(vocode_first, reps, dev)
    out["first_chunk_mel_frames"] = int(mel.shape[2])
    return out


def _graphed(fn, args):
    """A CUDA graph replaying ``fn(*args)`` (warmed up on a side stream first)."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fn(*args)
    return graph.replay


def estimator_variants(model, reps: int, shapes=((2, 256), (32, 512))) -> dict:
    """One estimator call per execution variant: eager, CUDA graph, torch.jit.trace (frozen),
    torch.compile (inductor, static shapes) with and without a CUDA graph around it."""
    est = model.flow.decoder.estimator
    dtype = next(est.parameters()).dtype
    out = {}
    for b, frames in shapes:
        dev = model.device
        x = torch.randn(b, 80, frames, device=dev, dtype=dtype)
        mask = torch.ones(b, 1, frames, device=dev, dtype=dtype)
        t = torch.rand(b, device=dev, dtype=dtype)
        spks = torch.randn(b, 80, device=dev, dtype=dtype)
        flags = torch.ones(b, dtype=torch.bool, device=dev)
        args = (x, mask, x.clone(), t, spks, x.clone(), flags)
        key = f"b{b}_T{frames}"
        with torch.inference_mode():
            ref = est(*args)
            out[f"{key}_eager"] = timed(lambda a=args: est(*a), reps, dev)
            out[f"{key}_graph"] = timed(_graphed(est, args), reps, dev)
            try:
                t0 = time.perf_counter()
                traced = torch.jit.freeze(torch.jit.trace(est, args, check_trace=False).eval())
                traced(*args)
                out[f"{key}_jit_trace_build_s"] = time.perf_counter() - t0
                out[f"{key}_jit_trace"] = timed(lambda a=args, f=traced: f(*a), reps, dev)
                out[f"{key}_jit_trace_maxdiff"] = float((traced(*args) - ref).abs().max())
            except Exception as exc:  # noqa: BLE001 - report, keep measuring
                out[f"{key}_jit_trace_error"] = f"{type(exc).__name__}: {exc}"[:300]
            try:
                t0 = time.perf_counter()
                comp = torch.compile(est, dynamic=False)
                comp(*args)
                out[f"{key}_compile_build_s"] = time.perf_counter() - t0
                out[f"{key}_compile"] = timed(lambda a=args, f=comp: f(*a), reps, dev)
                out[f"{key}_compile_graph"] = timed(_graphed(comp, args), reps, dev)
                out[f"{key}_compile_maxdiff"] = float((comp(*args) - ref).abs().max())
            except Exception as exc:  # noqa: BLE001
                out[f"{key}_compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps({k: v for k, v in out.items() if k.startswith(key)}), flush=True)
    return out


def profile_table(model, voice, rows: int = 25) -> str:
    t2w = Token2Wav(model.spec, model.flow, model.hift)
    first = 41
    toks = list(range(first))
    st = t2w.new_stream(voice.flow, stream=True)
    job = t2w.next_job(st, toks, llm_done=False)
    t2w.run(t2w.next_job(t2w.new_stream(voice.flow, stream=True), toks, llm_done=False))
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t2w.run(job)
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows)
    return f"CUDA kernels in one first-chunk token2wav call: {kernels}\n\n```\n{table}\n```\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="cosyvoice2", choices=["cosyvoice2", "cosyvoice3"])
    ap.add_argument("--precision", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", required=True, help="path prefix of the .json / .md written")
    ap.add_argument("--estimator-only", action="store_true",
                    help="only the estimator variants: eager / graph / jit.trace / torch.compile")
    args = ap.parse_args(argv)
    base = make_model(args.family, "full", "cuda")
    model = cast(base, DTYPES[args.precision])
    voice, text = make_voice(model)
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "family": args.family, "precision": args.precision, "text_tokens": TEXT}
    if args.estimator_only:
        res["estimator"] = estimator_variants(model, args.reps)
        Path(f"{args.out}.json").write_text(json.dumps(res, indent=1))
        return
    res["llm_graphs"] = llm_stages(model, voice, text, graphs=True)
    print(json.dumps(res["llm_graphs"]), flush=True)
    res["flow"] = flow_stages(model, voice, args.reps)
    print(json.dumps(res["flow"]), flush=True)
    table = profile_table(model, voice)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(res, indent=1))
    Path(f"{args.out}.md").write_text(f"# Stage profile: {args.family} {args.precision}, {res['device']}, {res['date']}\n\n"
                                      f"```json\n{json.dumps(res, indent=1)}\n```\n\n{table}")
    print(table[:6000])


if __name__ == "__main__":
    main()
