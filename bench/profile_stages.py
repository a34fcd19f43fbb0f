"""Where the time of one streaming request goes, stage by stage, on one GPU.

Full-size architecture, random weights, the benchmark's zero-shot shapes. Each stage is timed
alone (warm, synchronised, median of several runs): LLM prefill and decode step, flow encoder,
one estimator call (wall clock and GPU time), a whole flow call, and the vocoder; plus a
``torch.profiler`` table of one first-chunk flow call. Writes ``<out>.json`` and ``<out>.md``.

    python -m bench.profile_stages --out bench/results/<date>-<card>-profile/profile-<device>-<date>
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.random_model import DTYPES, PROMPT_SPEECH, TEXT, cast, make_model, make_voice
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.inputs import build_lm_input
from cosyvoice_runtime.llm.sampling import SamplingParams
from cosyvoice_runtime.stream_schedule import prompt_token_pad
from cosyvoice_runtime.token2wav import Token2Wav


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> dict:
    """Median / min wall ms and median GPU ms (CUDA events) of ``fn`` over ``reps`` warm runs
    (wall clock only on the CPU, where the CPU tests run the same code)."""
    cuda = torch.device(device).type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    wall, gpu = [], []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
            gpu.append(start.elapsed_time(end))
        wall.append((time.perf_counter() - t0) * 1e3)
    return {"wall_ms": statistics.median(wall), "wall_min_ms": min(wall),
            "gpu_ms": statistics.median(gpu) if gpu else None}


def llm_stages(model, voice, text, graphs: bool) -> dict:
    out = {}
    for batch in (1, 16):
        eng = LLMEngine(model.llm, max_batch_size=batch, max_seq_len=400, use_cuda_graphs=graphs)
        if graphs:
            eng.capture_graphs()
        lm = build_lm_input(model.llm, text, voice.text_tokens, voice.speech_tokens)
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
        states = [t2w.new_stream(voice, stream=True) for _ in range(batch)]
        toks = torch.randint(0, spec.llm.speech_token_size, (n_tokens,), generator=g).tolist()
        return [t2w.next_job(s, toks, llm_done=False) for s in states], states

    for batch in (1, 16):
        js, _ = jobs(first, batch)
        items = [t2w.flow_item(j) for j in js]
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
        st = t2w.new_stream(voice, stream=True)
        job = t2w.next_job(st, js[0].tokens[0].tolist(), llm_done=False)
        t2w.vocode(job, mel)

    out["vocode_first_chunk"] = timed(vocode_first, reps, dev)
    out["first_chunk_mel_frames"] = int(mel.shape[2])
    return out


def _graphed(fn, args):
    """A CUDA graph replaying ``fn(*args)`` (warmed up on a side stream first); the plain call
    off CUDA."""
    if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        return lambda: fn(*args)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fn(*args)
    return graph.replay


def execution_variants(fn: Callable, args: tuple, reps: int, device: torch.device) -> dict:
    """One call of ``fn(*args)`` per execution variant: eager, CUDA graph, torch.jit.trace
    (frozen), torch.compile (inductor, static shapes) with and without a CUDA graph around it;
    build times and the largest difference to eager. A variant that fails is reported, not fatal."""
    out = {}
    with torch.inference_mode():
        ref = fn(*args)
        out["eager"] = timed(lambda: fn(*args), reps, device)
        out["graph"] = timed(_graphed(fn, args), reps, device)
        try:
            t0 = time.perf_counter()
            owner = getattr(fn, "__self__", None)
            if isinstance(owner, torch.nn.Module):  # a module's method: trace it as a method of the module
                module = torch.jit.trace_module(owner, {fn.__name__: args}, check_trace=False)
                traced = getattr(module, fn.__name__)
            else:
                traced = torch.jit.trace(fn, args, check_trace=False)
                if isinstance(traced, torch.jit.ScriptModule):
                    traced = torch.jit.freeze(traced.eval())
            traced(*args)
            out["jit_trace_build_s"] = time.perf_counter() - t0
            out["jit_trace"] = timed(lambda: traced(*args), reps, device)
            out["jit_trace_maxdiff"] = float((traced(*args) - ref).abs().max())
        except Exception as exc:  # noqa: BLE001 - report, keep measuring
            out["jit_trace_error"] = f"{type(exc).__name__}: {exc}"[:300]
        try:
            t0 = time.perf_counter()
            comp = torch.compile(fn, dynamic=False)
            comp(*args)
            out["compile_build_s"] = time.perf_counter() - t0
            out["compile"] = timed(lambda: comp(*args), reps, device)
            out["compile_graph"] = timed(_graphed(comp, args), reps, device)
            out["compile_maxdiff"] = float((comp(*args) - ref).abs().max())
        except Exception as exc:  # noqa: BLE001
            out["compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def estimator_variants(model, reps: int, shapes=((2, 256), (32, 512))) -> dict:
    """:func:`execution_variants` of one estimator call (CFG-doubled batch, frames)."""
    est = model.flow.decoder.estimator
    dtype = next(est.parameters()).dtype
    dev = model.device
    out = {}
    for b, frames in shapes:
        x = torch.randn(b, 80, frames, device=dev, dtype=dtype)
        mask = torch.ones(b, 1, frames, device=dev, dtype=dtype)
        t = torch.rand(b, device=dev, dtype=dtype)
        spks = torch.randn(b, 80, device=dev, dtype=dtype)
        flags = torch.ones(b, dtype=torch.bool, device=dev)
        key = f"estimator_b{b}_T{frames}"
        out[key] = execution_variants(est, (x, mask, x.clone(), t, spks, x.clone(), flags), reps, dev)
        print(json.dumps({key: out[key]}), flush=True)
    return out


def vocoder_variants(model, reps: int, shapes=((1, 26), (1, 58), (16, 208))) -> dict:
    """:func:`execution_variants` of the CV2 vocoder's deterministic part (mel + source -> audio)
    at streaming lengths: a 13-token first chunk, a 25-token hop, 16 streams at the 100-token hop."""
    hift = model.hift
    if not hasattr(hift, "decode_eager"):
        return {"skipped": "CV3 vocoder (causal, re-vocodes the accumulated mel)"}
    dev = model.device
    g = torch.Generator(device=dev).manual_seed(2)
    out = {}
    for b, frames in shapes:
        mel = torch.randn(b, hift.spec.in_channels, frames, device=dev, generator=g)
        with torch.inference_mode():
            source = hift.source(hift.f0(mel), generator=g)
        key = f"vocoder_b{b}_T{frames}"
        out[key] = execution_variants(hift.decode_eager, (mel, source), reps, dev)
        print(json.dumps({key: out[key]}), flush=True)
    return out


def encoder_variants(model, reps: int, shapes=((1, 103), (16, 203))) -> dict:
    """:func:`execution_variants` of the CV2 flow encoder (token ids -> mu) at a first chunk of
    the bench prompt (87 + 13 + 3 tokens) and 16 jobs at a later chunk."""
    flow = model.flow
    if flow.spec.family != "cosyvoice2":
        return {"skipped": "CV3 has no conformer encoder"}
    dev = model.device
    out = {}
    for b, t_in in shapes:
        ids = torch.randint(0, flow.spec.vocab_size, (b, t_in), device=dev)
        valid = torch.ones(b, t_in, dtype=torch.bool, device=dev)
        n_keep = t_in - flow.spec.pre_lookahead_len
        lengths = torch.full((b,), n_keep, device=dev)
        streaming = torch.ones(b, dtype=torch.bool, device=dev)
        key = f"encoder_b{b}_T{t_in}"
        out[key] = execution_variants(lambda *a, n=n_keep: flow.encode_ids(*a, n), (ids, valid, lengths, streaming),
                                      reps, dev)
        print(json.dumps({key: out[key]}), flush=True)
    return out


def profile_table(model, voice, rows: int = 25) -> str:
    t2w = Token2Wav(model.spec, model.flow, model.hift)
    first = 41
    toks = list(range(first))
    st = t2w.new_stream(voice, stream=True)
    job = t2w.next_job(st, toks, llm_done=False)
    t2w.run(t2w.next_job(t2w.new_stream(voice, stream=True), toks, llm_done=False))
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
    ap.add_argument("--variants-only", action="store_true",
                    help="only the execution variants (eager / graph / jit.trace / torch.compile) of the "
                         "flow estimator, the CV2 vocoder and the CV2 flow encoder")
    args = ap.parse_args(argv)
    base = make_model(args.family, "full", "cuda")
    model = cast(base, DTYPES[args.precision])
    voice, text = make_voice(model)
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "family": args.family, "precision": args.precision, "text_tokens": TEXT}
    if args.variants_only:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        for name, run in (("vocoder", vocoder_variants), ("encoder", encoder_variants),
                          ("estimator", estimator_variants)):
            res[name] = run(model, args.reps)
            Path(f"{args.out}.json").write_text(json.dumps(res, indent=1))  # kept if a later one runs out of time
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
